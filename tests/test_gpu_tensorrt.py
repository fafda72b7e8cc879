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
    torch_dtype,
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


class _RefusingContext(_FakeContext):
    """A context whose profile does not take the shape: TensorRT answers False and leaves the
    output shapes unknown (-1)."""

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> bool:
        return False

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        return (-1, 84, -1)


def test_a_shape_outside_the_profile_is_refused_naming_it() -> None:
    """``set_input_shape`` returns False outside the engine's profile; its result was ignored,
    and the outputs were allocated at TensorRT's -1 shapes ('negative dimension -1')."""
    profile = profile_shapes(8, 640, 32, True)
    forward = TensorBindings(
        _RefusingContext(),
        "images",
        {"output0": torch.float32},
        torch.device("cpu"),
        stream=lambda: 7,
        profile=profile,
    )
    with pytest.raises(EngineError) as info:
        forward(torch.zeros((16, 3, 640, 640)))
    message = str(info.value)
    assert "(16, 3, 640, 640)" in message and str(profile.max) in message
    assert "--max-batch" in message and len(forward) == 0


def _data_types() -> Any:
    return type(
        "DataType",
        (),
        {n: f"DataType.{n}" for n in ("FLOAT", "HALF", "BF16", "INT8", "INT32", "INT64", "BOOL")},
    )


@pytest.mark.parametrize(
    ("member", "dtype"),
    [
        ("FLOAT", torch.float32),
        ("HALF", torch.float16),
        ("BF16", torch.bfloat16),
        ("INT32", torch.int32),
        ("INT64", torch.int64),
        ("BOOL", torch.bool),
    ],
)
def test_io_tensors_get_torch_buffers_of_their_own_type(member: str, dtype: torch.dtype) -> None:
    """An output's buffer is allocated in its dtype: an INT64 or BF16 output was given float32
    (an INT64 one half the bytes TensorRT writes into it)."""
    trt = type("trt", (), {"DataType": _data_types()})
    assert torch_dtype(trt, f"DataType.{member}", "output0", Path("m.engine")) == dtype


def test_an_io_type_torch_cannot_hold_is_refused_naming_the_tensor() -> None:
    """An unknown input type raised a bare KeyError."""
    trt = type("trt", (), {"DataType": _data_types()})
    with pytest.raises(EngineError, match=r"'images' is of TensorRT type DataType.FP8.*float32"):
        torch_dtype(trt, "DataType.FP8", "images", Path("m.engine"))


def test_workers_loading_at_once_build_the_engine_once(
    model_info: ModelInfo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pool's workers load together: each found no plan and built it, at the same time
    (minutes of GPU each, and their memory together); now one builds and the others use it."""
    import threading

    import engines.tensorrt as trt_mod

    monkeypatch.setattr(trt_mod, "gpu_identity", lambda device: "NVIDIA H200 sm_90")
    trt = _Recorder("10.13.0.35")
    second = threading.Event()
    builder = trt.Builder

    class SlowBuilder(builder):  # type: ignore[misc, valid-type]
        def build_serialized_network(self, network: Any, config: Any) -> bytes:
            builds = [c for c in trt.calls if c[0] == "build"]
            if builds:
                second.set()
            else:  # the first build: long enough for another worker to start one alongside
                second.wait(3)
            return super().build_serialized_network(network, config)  # type: ignore[no-any-return]

    trt.Builder = SlowBuilder
    config = EngineConfig(model=model_info, imgsz=640, max_batch=8, threads=1, cache_dir=tmp_path)
    paths: list[Path] = []
    workers = [
        threading.Thread(
            target=lambda: paths.append(ensure_engine(config, torch.device("cuda"), trt))
        )
        for _ in range(2)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert len(paths) == 2 and paths[0] == paths[1] and paths[0].read_bytes() == b"plan"
    assert [c for c in trt.calls if c[0] == "build"] == [("build",)]
    assert not list(paths[0].parent.glob(".build-*"))


class _Engine:
    """A deserialized engine whose execution context cannot be made (its memory)."""

    num_aux_streams = 0

    def create_execution_context(self) -> None:
        return None


def _serving_trt(engine: object) -> Any:
    class Logger:
        WARNING = 2

        def __init__(self, severity: int) -> None:
            pass

    class Runtime:
        def __init__(self, logger: Logger) -> None:
            pass

        def deserialize_cuda_engine(self, plan: bytes) -> object:
            return engine

    return type("trt", (), {"__version__": "10.13.0.35", "Logger": Logger, "Runtime": Runtime})


@pytest.mark.parametrize("engine", [_Engine(), None], ids=["no-context", "no-engine"])
def test_an_engine_that_cannot_run_here_says_why(
    model_info: ModelInfo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: object
) -> None:
    """An execution context TensorRT cannot allocate is None (it failed later with
    AttributeError on None); a plan it cannot deserialize names what to rebuild."""
    import engines.tensorrt as trt_mod

    plan = tmp_path / "engines" / "m.engine"
    plan.parent.mkdir()
    plan.write_bytes(b"plan")
    monkeypatch.setattr(trt_mod, "import_tensorrt", lambda: _serving_trt(engine))
    monkeypatch.setattr(trt_mod, "ensure_engine", lambda config, device, trt: plan)
    monkeypatch.setattr(trt_mod, "gpu_identity", lambda device: "NVIDIA H200 sm_90")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (300 << 20, 141 << 30))
    trt_engine = TrtEngine(EngineConfig(model=model_info, imgsz=640, max_batch=8, threads=1))
    with pytest.raises(EngineError) as info:
        trt_engine._open(torch.device("cuda"))
    message = str(info.value)
    if engine is None:
        assert "TensorRT 10.13.0.35 cannot load" in message and "NVIDIA H200 sm_90" in message
        assert "delete it" in message and str(plan) in message
    else:
        assert "out of GPU memory? 300 MiB free of 144384 MiB" in message
        assert "--workers" in message


class _ServingEngine:
    """A deserialized YOLOv8n engine: one image input, one output, each context its own."""

    num_aux_streams = 0
    num_io_tensors = 2

    def __init__(self) -> None:
        self.contexts: list[_FakeContext] = []

    def create_execution_context(self) -> _FakeContext:
        self.contexts.append(_FakeContext())
        return self.contexts[-1]

    def get_tensor_name(self, index: int) -> str:
        return ("images", "output0")[index]

    def get_tensor_mode(self, name: str) -> str:
        return "INPUT" if name == "images" else "OUTPUT"

    def get_tensor_dtype(self, name: str) -> str:
        return "DataType.HALF"


def test_workers_share_one_deserialized_engine_each_with_its_own_context(
    model_info: ModelInfo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each worker deserialized the plan itself: a pool of N workers held N copies of the
    weights on the GPU. Now the first loads it, the others make their contexts from it, and
    it is freed with the last; a plan written anew (rebuilt) is loaded anew."""
    import gc
    import os
    import threading

    import engines.tensorrt as trt_mod

    plan = tmp_path / "engines" / "m.engine"
    plan.parent.mkdir()
    plan.write_bytes(b"plan")
    loads: list[_ServingEngine] = []

    def deserialize(self: object, data: bytes) -> _ServingEngine:
        loads.append(_ServingEngine())
        return loads[-1]

    trt = _serving_trt(None)
    trt.Runtime.deserialize_cuda_engine = deserialize
    trt.TensorIOMode = type("TensorIOMode", (), {"INPUT": "INPUT"})
    trt.DataType = _data_types()
    monkeypatch.setattr(trt_mod, "import_tensorrt", lambda: trt)
    monkeypatch.setattr(trt_mod, "ensure_engine", lambda config, device, trt: plan)
    config = EngineConfig(model=model_info, imgsz=640, max_batch=8, threads=1)
    device = torch.device("cuda", 0)
    forwards: list[Any] = []

    def open_one() -> None:
        forwards.append(TrtEngine(config)._open(device)[0])

    workers = [threading.Thread(target=open_one) for _ in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert len(forwards) == 4 and len(loads) == 1  # one copy for the pool
    engine = loads[0]
    assert len(engine.contexts) == 4 and len({id(c) for c in engine.contexts}) == 4
    assert {id(f._context) for f in forwards} == {id(c) for c in engine.contexts}
    assert trt_mod.load_plan(trt, plan, torch.device("cuda")).engine is engine  # cuda:0
    assert trt_mod.load_plan(trt, plan, torch.device("cuda", 1)).engine is not engine
    assert len(loads) == 2  # another GPU: its own copy
    forwards.clear()
    gc.collect()
    open_one()  # the last one gone, the engine went with it: loaded again
    assert len(loads) == 3 and forwards[0]._context in loads[2].contexts
    plan.write_bytes(b"rebuilt")
    os.utime(plan, ns=(1, 1))
    open_one()
    assert len(loads) == 4  # the plan on disk changed: not the one in memory
