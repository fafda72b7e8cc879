"""TensorRT backend parts that need no GPU: profiles, cache keys, the build recipe, refusals.

TensorRT itself cannot be installed here (its libraries come from NVIDIA's index), so the build
recipe is checked against a recording stand-in for the ``tensorrt`` module: strongly typed on
10.x, no flags on 11.x, never a precision flag, one dynamic-batch profile.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from engines.registry import EngineConfig, load_backend
from engines.tensorrt import (
    EngineKey,
    ProfileShapes,
    TensorBindings,
    TrtEngine,
    build_engine,
    ensure_engine,
    import_tensorrt,
    model_profile,
    profile_shapes,
    trt_major,
)
from engines.types import EngineError, ModelInfo
from tests.helpers import CACHE_DIR, MODEL_PT


def test_dynamic_profile_covers_every_letterbox_shape() -> None:
    shapes = profile_shapes(max_batch=32, imgsz=640, stride=32, dynamic_hw=True)
    assert shapes == ProfileShapes((1, 3, 160, 160), (32, 3, 384, 640), (32, 3, 640, 640))
    # 16:9 camera, portrait photo, square: all inside the profile.
    for h, w in [(384, 640), (640, 480), (640, 640), (160, 640)]:
        assert shapes.contains((1, 3, h, w)) and shapes.contains((32, 3, h, w))
    assert not shapes.contains((33, 3, 640, 640))
    assert not shapes.contains((1, 3, 672, 640))


def test_fixed_profile_varies_only_the_batch() -> None:
    shapes = profile_shapes(max_batch=8, imgsz=320, stride=32, dynamic_hw=False, opt_batch=4)
    assert shapes == ProfileShapes((1, 3, 320, 320), (4, 3, 320, 320), (8, 3, 320, 320))


def test_fixed_non_square_model_runs_at_its_own_shape(model_info: ModelInfo) -> None:
    """An ``imgsz=(320, 480)`` export: the profile is the model's own 320x480 (it was refused:
    the profile was square), and the engine letterboxes into it as the other backends do."""
    info = dataclasses.replace(model_info, imgsz=(320, 480), dynamic_hw=False)
    shapes = model_profile(info, max_batch=8, imgsz=640)
    assert shapes == ProfileShapes((1, 3, 320, 480), (8, 3, 320, 480), (8, 3, 320, 480))
    engine = TrtEngine(EngineConfig(model=info, imgsz=640, max_batch=8, threads=1))
    assert engine.input_size == 480 and engine.max_batch == 8


def test_fixed_batch_model_gets_that_batch_alone(model_info: ModelInfo) -> None:
    """A ``batch=8`` export: TensorRT refuses a batch range over its static batch axis, so the
    profile is 8..8 and every batch is padded to the one bucket 8."""
    fixed = dataclasses.replace(model_info, imgsz=(320, 320), dynamic_hw=False, fixed_batch=8)
    assert model_profile(fixed, max_batch=32, imgsz=640) == ProfileShapes(
        (8, 3, 320, 320), (8, 3, 320, 320), (8, 3, 320, 320)
    )
    engine = TrtEngine(EngineConfig(model=fixed, imgsz=640, max_batch=4, threads=1))
    assert engine.max_batch == 4 and engine._buckets == (8,)
    dynamic = dataclasses.replace(model_info, fixed_batch=8)
    assert model_profile(dynamic, max_batch=32, imgsz=640) == ProfileShapes(
        (8, 3, 160, 160), (8, 3, 384, 640), (8, 3, 640, 640)
    )


def test_export_builds_the_plan_serve_looks_for(
    model_info: ModelInfo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``streamdet export --format engine --max-batch 32`` of a fixed-batch model built a
    1..32 profile (a TensorRT error; and a key serve, capped at the graph's batch, never
    looked up): both now take the model's own profile, so serve finds export's plan."""
    import engines.tensorrt as trt_mod

    monkeypatch.setattr(trt_mod, "gpu_identity", lambda device: "NVIDIA H200 sm_90")
    info = dataclasses.replace(model_info, imgsz=(320, 480), dynamic_hw=False, fixed_batch=1)
    trt = _Recorder("10.13.0.35")
    exported = ensure_engine(
        EngineConfig(model=info, imgsz=640, max_batch=32, threads=1, cache_dir=tmp_path),
        torch.device("cuda"),
        trt,
    )
    assert ("profile", "images", (1, 3, 320, 480), (1, 3, 320, 480), (1, 3, 320, 480)) in (
        trt.calls
    )
    served = TrtEngine(EngineConfig(model=info, imgsz=640, max_batch=32, threads=1))
    again = _Recorder("10.13.0.35")
    found = ensure_engine(
        EngineConfig(
            model=info, imgsz=640, max_batch=served.max_batch, threads=1, cache_dir=tmp_path
        ),
        torch.device("cuda"),
        again,
    )
    assert found == exported and not [c for c in again.calls if c[0] == "build"]


def test_profile_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        profile_shapes(max_batch=8, imgsz=650, stride=32, dynamic_hw=True)
    with pytest.raises(ValueError, match="max_batch"):
        profile_shapes(max_batch=0, imgsz=640, stride=32, dynamic_hw=True)


def _key(**changes: Any) -> EngineKey:
    base = EngineKey(
        onnx_sha256="ab" * 32,
        trt_version="10.13.0.35",
        gpu="NVIDIA H200 sm_90",
        precision="fp16",
        profile=profile_shapes(32, 640, 32, True),
    )
    return dataclasses.replace(base, **changes)


def test_engine_cache_key_changes_with_every_input(tmp_path: Path) -> None:
    base = _key()
    assert base.digest() == _key().digest()
    variants = [
        _key(onnx_sha256="cd" * 32),
        _key(trt_version="11.0.0.1"),
        _key(gpu="NVIDIA L4 sm_89"),
        _key(precision="int8"),
        _key(profile=profile_shapes(16, 640, 32, True)),
        _key(profile=profile_shapes(32, 640, 32, True, opt_batch=8)),
        _key(profile=profile_shapes(32, 320, 32, True)),
    ]
    digests = {v.digest() for v in variants}
    assert len(digests) == len(variants) and base.digest() not in digests
    path = base.path(tmp_path, "yolov8n-fp16")
    assert path.parent == tmp_path / "engines"
    assert path.name == f"yolov8n-fp16-{base.digest()}.engine"


def test_trt_major() -> None:
    assert trt_major("10.13.0.35") == 10
    assert trt_major("11.0.0") == 11
    with pytest.raises(EngineError, match="unrecognised"):
        trt_major("x.y")


class _Recorder:
    """A stand-in for the ``tensorrt`` module that records what the build asks of it."""

    def __init__(self, version: str) -> None:
        self.__version__ = version
        self.calls: list[tuple[Any, ...]] = []
        rec = self

        class Logger:
            WARNING = 2

            def __init__(self, severity: int) -> None:
                rec.calls.append(("logger", severity))

        class Network:
            def get_input(self, i: int) -> Any:
                return type("Input", (), {"name": "images"})()

        class Profile:
            def set_shape(self, name: str, lo: Any, opt: Any, hi: Any) -> None:
                rec.calls.append(("profile", name, lo, opt, hi))

        class Config:
            def set_memory_pool_limit(self, pool: str, size: int) -> None:
                rec.calls.append(("pool", pool, size))

            def add_optimization_profile(self, profile: Profile) -> None:
                rec.calls.append(("add_profile",))

            def set_flag(self, flag: Any) -> None:
                rec.calls.append(("set_flag", flag))

        class Builder:
            def __init__(self, logger: Logger) -> None:
                pass

            def create_network(self, *flags: int) -> Network:
                rec.calls.append(("create_network", *flags))
                return Network()

            def create_builder_config(self) -> Config:
                return Config()

            def create_optimization_profile(self) -> Profile:
                return Profile()

            def build_serialized_network(self, network: Network, config: Config) -> bytes:
                rec.calls.append(("build",))
                return b"plan"

        class OnnxParser:
            num_errors = 0

            def __init__(self, network: Network, logger: Logger) -> None:
                pass

            def parse_from_file(self, path: str) -> bool:
                rec.calls.append(("parse", path))
                return True

        self.Logger, self.Builder, self.OnnxParser = Logger, Builder, OnnxParser
        self.NetworkDefinitionCreationFlag = type("Flags", (), {"STRONGLY_TYPED": 1})
        self.MemoryPoolType = type("Pools", (), {"WORKSPACE": "workspace"})


@pytest.mark.parametrize(
    ("version", "network_flags"), [("10.13.0.35", (1 << 1,)), ("11.0.0.114", ())]
)
def test_build_is_strongly_typed_without_precision_flags(
    tmp_path: Path, version: str, network_flags: tuple[int, ...]
) -> None:
    trt = _Recorder(version)
    shapes = profile_shapes(16, 640, 32, True)
    out = build_engine(trt, Path("model.onnx"), shapes, tmp_path / "engines" / "m.engine")
    assert out.read_bytes() == b"plan"
    assert ("create_network", *network_flags) in trt.calls
    assert not [c for c in trt.calls if c[0] == "set_flag"], "precision comes from the ONNX"
    assert ("profile", "images", shapes.min, shapes.opt, shapes.max) in trt.calls
    assert ("add_profile",) in trt.calls and trt.calls[-1] == ("build",)


def test_tensorrt_backend_refuses_cleanly_here(model_info: ModelInfo) -> None:
    if importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("TensorRT is installed here")
    with pytest.raises(EngineError, match=r"TensorRT not installed.*streamdet\[gpu\]"):
        import_tensorrt()
    config = EngineConfig(
        model=model_info,
        imgsz=640,
        max_batch=8,
        threads=1,
        device="cuda",
        cache_dir=CACHE_DIR,
        source=MODEL_PT,
    )
    engine = load_backend("tensorrt")(config)
    with pytest.raises(EngineError) as info:
        engine.load()
    message = str(info.value)
    assert "TensorRT not installed" in message
    import torch

    if not torch.cuda.is_available():
        assert "no CUDA device" in message


def test_export_engine_command_says_why_it_cannot_build(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    if importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("TensorRT is installed here")
    from server.cli import main

    rc = main(
        [
            "export",
            "--format",
            "engine",
            "--model",
            str(MODEL_PT),
            "--out",
            str(tmp_path / "m.engine"),
            "--cache-dir",
            str(CACHE_DIR),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2
    assert "TensorRT not installed" in err
    assert not (tmp_path / "m.engine").exists()


class _FakeContext:
    """An execution context's binding calls, on CPU tensors: outputs shaped as YOLOv8n's head
    for the input shape set, each run recorded with the addresses bound."""

    def __init__(self) -> None:
        self.shape: tuple[int, ...] = ()
        self.addresses: dict[str, int] = {}
        self.runs: list[tuple[tuple[int, ...], dict[str, int], int]] = []

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> bool:
        self.shape = shape
        return True

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        b, _, h, w = self.shape
        return (b, 84, (h // 8) * (w // 8) * 21 // 16)

    def set_tensor_address(self, name: str, address: int) -> bool:
        self.addresses[name] = address
        return True

    def execute_async_v3(self, stream: int) -> bool:
        self.runs.append((self.shape, dict(self.addresses), stream))
        return True


def test_outputs_are_bound_per_input_and_freed_with_it() -> None:
    """Each input tensor (a bucket's static input) gets its outputs once and keeps them while
    it lives, so a graph captured on them reads live memory; once the runner drops the
    input, its outputs go too (kept per shape for ever, they grew without bound)."""
    import gc

    context = _FakeContext()
    forward = TensorBindings(
        context, "images", {"output0": torch.float16}, torch.device("cpu"), stream=lambda: 7
    )
    a = torch.zeros((4, 3, 384, 640))
    out = forward(a)
    assert out.shape == (4, 84, 5040) and out.dtype == torch.float16
    assert forward(a) is out  # the same buffers, at the same addresses, run after run
    assert (
        context.runs[0][1]
        == context.runs[1][1]
        == {
            "images": a.data_ptr(),
            "output0": out.data_ptr(),
        }
    )
    assert context.runs[-1][2] == 7  # on the caller's stream
    for h in range(1, 21):  # a camera of every aspect ratio, each input dropped after use
        forward(torch.zeros((1, 3, 32 * h, 640)))
    gc.collect()
    assert len(forward) == 1  # a's outputs only: the others went with their inputs
    del a
    gc.collect()
    assert len(forward) == 0
