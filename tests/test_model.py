"""Model resolution: .pt export with a content-hash cache, .onnx metadata, clear failures."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import onnx
import pytest
import torch
from onnx import TensorProto, helper

from engines.export import ExportError, ExportRequest, export_model
from engines.model import read_model_info, resolve_onnx
from engines.types import ModelError, ModelInfo
from tests.helpers import CACHE_DIR, MODEL_PT, MODEL_TS, REPO, VIDEOS


def test_pt_export_is_cached_by_content_hash(model_info: ModelInfo) -> None:
    again = resolve_onnx(str(MODEL_PT), CACHE_DIR, 640)
    assert str(again) == model_info.path  # second call reuses the export
    assert again.parent == CACHE_DIR
    assert model_info.names[0] == "person" and len(model_info.names) == 80
    assert model_info.stride == 32 and model_info.dynamic_hw
    assert model_info.imgsz == (640, 640)


def test_onnx_file_is_used_directly(model_info: ModelInfo) -> None:
    path = Path(model_info.path)
    assert resolve_onnx(str(path), CACHE_DIR, 640) == path


def test_missing_file_names_it(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=r"nothere\.onnx: file not found"):
        resolve_onnx(str(tmp_path / "nothere.onnx"), tmp_path, 640)


def test_wrong_suffix(tmp_path: Path) -> None:
    bad = tmp_path / "weights.bin"
    bad.write_bytes(b"\0" * 10)
    with pytest.raises(ModelError, match=r"weights\.bin: expected an Ultralytics \.pt"):
        resolve_onnx(str(bad), tmp_path, 640)


def test_corrupt_pt_fails_with_its_name(tmp_path: Path) -> None:
    bad = tmp_path / "broken.pt"
    bad.write_bytes(b"this is not a checkpoint")
    with pytest.raises(ModelError, match=r"broken\.pt: cannot load"):
        resolve_onnx(str(bad), tmp_path / "cache", 640)


def test_torchscript_export_converts_to_a_square_onnx_with_its_metadata() -> None:
    info = read_model_info(resolve_onnx(str(MODEL_TS), CACHE_DIR, 320))
    assert info.names[0] == "person" and len(info.names) == 80
    # The trace fixes the size: --imgsz 320 cannot change it, and the ONNX says so.
    assert info.imgsz == (640, 640) and not info.dynamic_hw and info.stride == 32
    assert info.extra["streamdet_source"] == "torchscript"
    assert resolve_onnx(str(MODEL_TS), CACHE_DIR, 320) == Path(info.path)  # cached


def test_int8_from_a_torchscript_says_what_to_export_from(tmp_path: Path) -> None:
    request = ExportRequest(
        model=str(MODEL_TS),
        precision="int8",
        out=tmp_path / "int8.onnx",
        cache_dir=CACHE_DIR,
        calib=(str(VIDEOS[0]),),
    )
    with pytest.raises(ExportError, match=r"export INT8 from the \.pt checkpoint"):
        export_model(request)
    assert not (tmp_path / "int8.onnx").exists()


class _TinyDetector(torch.nn.Module):
    """A YOLOv8-shaped head for two classes: (B, 3, H, W) -> (B, 4 + 2, anchors)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 6, 8, stride=8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.conv(x).flatten(2)
        return out


def _save_trace(path: Path, size: int, config: dict[str, object] | None) -> None:
    extra = {"config.txt": json.dumps(config)} if config is not None else {}
    with warnings.catch_warnings():  # torch.jit is deprecated, and says so
        warnings.simplefilter("ignore", FutureWarning)
        traced = torch.jit.trace(  # type: ignore[no-untyped-call]
            _TinyDetector().eval(), torch.zeros(1, 3, size, size)
        )
        torch.jit.save(traced, str(path), _extra_files=extra)


def test_torchscript_without_metadata_runs_at_the_requested_size(tmp_path: Path) -> None:
    _save_trace(tmp_path / "plain.torchscript", 64, None)
    info = read_model_info(resolve_onnx(str(tmp_path / "plain.torchscript"), tmp_path, 64))
    assert info.names == {0: "class0", 1: "class1"}
    assert info.imgsz == (64, 64) and not info.dynamic_hw


def test_torchscript_of_another_task_is_refused(tmp_path: Path) -> None:
    _save_trace(tmp_path / "seg.torchscript", 64, {"task": "segment", "imgsz": [64, 64]})
    with pytest.raises(ModelError, match=r"seg\.torchscript: is a 'segment' model"):
        resolve_onnx(str(tmp_path / "seg.torchscript"), tmp_path, 64)


def test_corrupt_torchscript_fails_with_its_name(tmp_path: Path) -> None:
    bad = tmp_path / "broken.torchscript"
    bad.write_bytes(b"this is not a zip archive")
    with pytest.raises(ModelError, match=r"broken\.torchscript: not a loadable TorchScript"):
        resolve_onnx(str(bad), tmp_path, 640)


def test_corrupt_onnx_fails_with_its_name(tmp_path: Path) -> None:
    bad = tmp_path / "broken.onnx"
    bad.write_bytes(b"garbage" * 100)
    with pytest.raises(ModelError, match=r"broken\.onnx: not a readable ONNX"):
        read_model_info(bad)


def test_non_detection_onnx_is_refused(tmp_path: Path) -> None:
    # A classifier-shaped graph: (B, 3, 224, 224) -> (B, 1000).
    x = helper.make_tensor_value_info("images", TensorProto.FLOAT, ["b", 3, 224, 224])
    y = helper.make_tensor_value_info("output0", TensorProto.FLOAT, ["b", 1000])
    pool = helper.make_node("GlobalAveragePool", ["images"], ["p"])
    flat = helper.make_node("Flatten", ["p"], ["output0"])
    graph = helper.make_graph([pool, flat], "cls", [x], [y])
    model = helper.make_model(graph)
    path = tmp_path / "classifier.onnx"
    onnx.save(model, str(path))
    with pytest.raises(ModelError, match=r"classifier\.onnx: expected input \(B, 3, H, W\)"):
        read_model_info(path)
    meta = model.metadata_props.add()
    meta.key, meta.value = "task", "classify"
    onnx.save(model, str(path))
    with pytest.raises(ModelError, match="'classify' model"):
        read_model_info(path)


def run_serve(*flags: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    """``streamdet serve FLAGS`` in a child process, expected to refuse to start."""
    return subprocess.run(
        [sys.executable, "-m", "server.cli", "serve", *flags],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=REPO,
        check=False,
    )


def test_serve_with_missing_model_exits_with_message(tmp_path: Path) -> None:
    proc = run_serve(
        "--model", str(tmp_path / "gone.pt"), "--cache-dir", str(tmp_path), timeout_s=120
    )
    assert proc.returncode == 2
    assert "gone.pt: file not found" in proc.stderr


def test_serve_rejects_bad_flags() -> None:
    proc = run_serve("--imgsz", "641")
    assert proc.returncode == 2
    assert "--imgsz" in proc.stderr and "multiple of 32" in proc.stderr
    proc = run_serve("--backend", "magic")
    assert proc.returncode == 2
    assert "unknown backend 'magic'" in proc.stderr
    for flags in (("--decode", "cuda"), ("--decode", "cuda", "--backend", "torch")):
        proc = run_serve(*flags)
        assert proc.returncode == 2
        assert "needs --backend torch or tensorrt with --device cuda" in proc.stderr
        assert "STREAMDET_DECODE" in proc.stderr
