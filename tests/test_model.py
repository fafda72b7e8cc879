"""Model resolution: .pt export with a content-hash cache, .onnx metadata, clear failures."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
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


def test_truncated_pt_names_the_users_file(tmp_path: Path) -> None:
    """It named Ultralytics' temporary copy (.../.export-xxxx/trunc.pt) and advised running
    'yolo predict model=yolo26n.pt'."""
    trunc = tmp_path / "trunc.pt"
    data = MODEL_PT.read_bytes()
    trunc.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelError) as caught:
        resolve_onnx(str(trunc), tmp_path / "cache", 640)
    message = str(caught.value)
    assert message.startswith(f"model {trunc}: cannot load: not a loadable Ultralytics checkpoint")
    assert ".export-" not in message and "yolo predict" not in message, message
    assert "\n" not in message


def _tiny_onnx(path: Path, imgsz: str, dims: list[int | str]) -> Path:
    x = helper.make_tensor_value_info("images", TensorProto.FLOAT, dims)
    y = helper.make_tensor_value_info("output0", TensorProto.FLOAT, ["b", 6, "n"])
    graph = helper.make_graph(
        [helper.make_node("Identity", ["images"], ["output0"])], "g", [x], [y]
    )
    model = helper.make_model(graph)
    for key, value in (("imgsz", imgsz), ("names", "{0: 'a', 1: 'b'}")):
        prop = model.metadata_props.add()
        prop.key, prop.value = key, value
    onnx.save(model, str(path))
    return path


def test_malformed_imgsz_metadata_is_a_model_error(tmp_path: Path) -> None:
    for raw in ("[640", "'big'", "[]", "None"):
        path = _tiny_onnx(tmp_path / "m.onnx", raw, ["b", 3, "h", "w"])
        with pytest.raises(ModelError, match=r"m\.onnx: unreadable 'imgsz' metadata"):
            read_model_info(path)
    assert read_model_info(_tiny_onnx(tmp_path / "ok.onnx", "320", ["b", 3, "h", "w"])).imgsz == (
        320,
        320,
    )


@pytest.mark.parametrize("backend", ["onnxruntime", "torch", "tensorrt"])
def test_fixed_non_square_input_is_letterboxed_by_every_backend(
    tmp_path: Path, backend: str
) -> None:
    """Every backend letterboxes into a fixed (H, W) (tests/test_engine_parity.py); TensorRT
    refused such a model (its profile was square: tests/test_gpu_tensorrt.py)."""
    from engines.registry import EngineConfig, load_backend

    info = read_model_info(_tiny_onnx(tmp_path / "r.onnx", "[320, 480]", [1, 3, 320, 480]))
    assert info.imgsz == (320, 480) and not info.dynamic_hw
    config = EngineConfig(model=info, imgsz=640, max_batch=8, threads=1)
    engine = load_backend(backend)(config)
    assert engine.input_size == 480 and engine.max_batch == 1


# ---- exports interrupted: nothing left in the cache -------------------------------------------


def _age(path: Path, seconds: float) -> None:
    """Make ``path`` and everything in it last changed ``seconds`` ago."""
    then = time.time() - seconds
    for item in [*path.rglob("*"), path]:
        os.utime(item, (then, then))


def test_an_export_leaves_no_temporary_copy_whatever_stops_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An export killed mid-way (SIGKILL, a crash) left ``cache/.export-XXXX/`` (a copy of the
    checkpoint) for ever, one per interrupted start: the next export deletes those untouched
    for an hour, not a fresh one (another process may be exporting into it now). An export
    stopped by an error or Ctrl-C deletes its own."""
    import engines.model

    cache = tmp_path / "cache"
    stale, fresh = cache / ".export-stale1", cache / ".export-fresh1"
    for left in (stale, fresh):
        left.mkdir(parents=True)
        (left / "yolov8n.pt").write_bytes(b"x" * 1000)
    _age(stale, 2 * 3600)
    _age(fresh, 60)
    pt = tmp_path / "model.pt"
    pt.write_bytes(b"weights")

    def fails(*args: object) -> str:
        raise ModelError("export failed")

    monkeypatch.setattr(engines.model, "_export", fails)
    with pytest.raises(ModelError, match="export failed"):
        resolve_onnx(str(pt), cache, 640)
    assert sorted(p.name for p in cache.iterdir()) == [".export-fresh1"]

    def interrupted(*args: object) -> str:
        raise KeyboardInterrupt

    monkeypatch.setattr(engines.model, "_export", interrupted)
    with pytest.raises(KeyboardInterrupt):
        resolve_onnx(str(pt), cache, 640)
    assert sorted(p.name for p in cache.iterdir()) == [".export-fresh1"]


def test_sigterm_during_a_first_starts_export_leaves_no_temporary_copy(tmp_path: Path) -> None:
    """SIGTERM while a server still loading its model exports it (its default action: die at
    once) left the temporary copy of the checkpoint in the cache; the process still ends by
    the signal."""
    cache = tmp_path / "cache"
    pt = tmp_path / "model.pt"
    pt.write_bytes(b"weights")
    code = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "import engines.model as m\n"
        "def slow(*args):\n"
        "    time.sleep(60)\n"
        "m._export = slow\n"
        "m.resolve_onnx(sys.argv[1], Path(sys.argv[2]), 640)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code, str(pt), str(cache)], cwd=REPO)
    try:
        end = time.monotonic() + 30
        while not list(cache.glob(".export-*/model.pt")):
            assert time.monotonic() < end and child.poll() is None, "the export never began"
            time.sleep(0.02)
        child.send_signal(signal.SIGTERM)
        assert child.wait(30) == -signal.SIGTERM
    finally:
        child.kill()
        child.wait()
    assert list(cache.iterdir()) == []


def test_an_onnx_taking_float16_runs_with_the_float32_ones_boxes(
    tmp_path: Path, model_info: ModelInfo
) -> None:
    """An ONNX whose input is float16 (Ultralytics' ``half=True`` export, FP16 conversions
    that keep no float32 input) was refused by ONNX Runtime's "Unexpected input data type.
    Actual: (tensor(float)), expected: (tensor(float16))". It is fed float16, and finds what
    the float32 one finds on bus.jpg. One of another input type is refused naming it."""
    from dataclasses import replace

    from engines.types import DetectParams, EngineError
    from streams.files import load_image
    from tests.helpers import match_reference, ort_factory, ultralytics_assets

    model = onnx.load(model_info.path)
    name = model.graph.input[0].name
    for node in model.graph.node:
        node.input[:] = [f"{name}_f32" if i == name else i for i in node.input]
    cast = helper.make_node("Cast", [name], [f"{name}_f32"], to=TensorProto.FLOAT)
    model.graph.node.insert(0, cast)
    model.graph.input[0].type.tensor_type.elem_type = TensorProto.FLOAT16
    half = tmp_path / "fp16-input.onnx"
    onnx.save(model, str(half))
    bus = load_image(ultralytics_assets() / "bus.jpg")
    engines = [ort_factory(info)() for info in (model_info, read_model_info(half))]
    for engine in engines:
        engine.load()
    full, found = (e.infer([bus], [DetectParams()])[0] for e in engines)
    problems = match_reference(found, full.boxes, full.scores, full.class_ids, conf_tol=0.02)
    assert len(found) == len(full) and problems == [], problems
    model.graph.input[0].type.tensor_type.elem_type = TensorProto.INT32
    ints = tmp_path / "int-input.onnx"
    onnx.save(model, str(ints))
    engine = ort_factory(replace(read_model_info(half), path=str(ints)))()
    with pytest.raises(EngineError, match=r"int-input\.onnx: its input 'images' is tensor\(int"):
        engine.load()


def test_a_cache_directory_that_cannot_be_written_is_named_with_its_setting(
    tmp_path: Path,
) -> None:
    """A read-only root's ``~/.cache`` (here /proc's, where nothing can be made) gave the
    export's FileNotFoundError traceback and exit 1, in serve, export and analyze alike."""
    with pytest.raises(ModelError, match=r"cache directory /proc/nocache: cannot create it") as e:
        resolve_onnx(str(MODEL_PT), Path("/proc/nocache"), 640)
    assert "STREAMDET_CACHE_DIR / --cache-dir" in str(e.value)
    ran = run_serve("--model", str(MODEL_PT), "--cache-dir", "/proc/nocache", timeout_s=120)
    assert ran.returncode == 2 and "cache directory /proc/nocache" in ran.stderr, ran.stderr
    assert "Traceback" not in ran.stderr


def test_an_unknown_class_name_is_answered_with_the_names_it_is_close_to() -> None:
    """Its hint was "see GET /model", which ``streamdet analyze`` (no server) has not."""
    from engines.types import class_ids

    names = {0: "person", 2: "car", 7: "truck"}
    with pytest.raises(ValueError, match=r"unknown class name 'carr'; did you mean 'car'\?"):
        class_ids(["carr"], names)
    with pytest.raises(ValueError, match=r"'unicorn'; the model has 3 class names \(a server"):
        class_ids(["unicorn"], names)
