from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from engines.pool import EnginePool
from engines.registry import EngineConfig, load_backend, prepare_model
from engines.types import Engine, EngineError, ModelInfo
from tests.helpers import CACHE_DIR, MODEL_PT, MODEL_TS

os.environ.setdefault("YOLO_OFFLINE", "true")
os.environ.setdefault("YOLO_AUTOINSTALL", "false")
os.environ.setdefault("YOLO_VERBOSE", "false")

# The tests' streams, events and jobs go to a folder of this run's own, never the user's data
# dir: a developer's cameras (from `make serve`) would open in the tests, and what the tests
# add would be there for the next run. The servers the tests start inherit it.
TEST_DATA_HOME = tempfile.mkdtemp(prefix="streamdet-tests-data-")
os.environ["XDG_DATA_HOME"] = TEST_DATA_HOME
os.environ.pop("STREAMDET_DATA_DIR", None)
atexit.register(shutil.rmtree, TEST_DATA_HOME, ignore_errors=True)

# Every backend is tried; the ones that cannot load here (no GPU, no TensorRT) are skipped
# with the reason their load gave.
BACKEND_NAMES = ["onnxruntime", "torch", "tensorrt"]
MODEL_FILES = [MODEL_PT, MODEL_TS]


@pytest.fixture(scope="session")
def model_info() -> ModelInfo:
    if not MODEL_PT.exists():
        pytest.fail(f"shared model missing: {MODEL_PT} (set STREAMDET_SHARED_DIR)")
    return prepare_model(str(MODEL_PT), CACHE_DIR, 640)


def backend_device(backend: str) -> str:
    """onnxruntime runs on the CPU, tensorrt on CUDA; torch on CUDA where a GPU is visible,
    else on the CPU (FP32, same device-side letterbox and NMS code), so the suite checks it here.
    STREAMDET_TEST_DEVICE overrides it (e.g. ``cuda:1``)."""
    if backend == "onnxruntime":
        return "cpu"
    if backend == "torch":
        import torch

        default = "cuda" if torch.cuda.is_available() else "cpu"
        return os.environ.get("STREAMDET_TEST_DEVICE", default)
    return os.environ.get("STREAMDET_TEST_DEVICE", "cuda")


def make_engine(name: str, model: ModelInfo, max_batch: int = 8, source: Path = MODEL_PT) -> Engine:
    factory = load_backend(name)
    config = EngineConfig(
        model=model,
        imgsz=640,
        max_batch=max_batch,
        threads=2,
        device=backend_device(name),
        cache_dir=CACHE_DIR,
        source=source,
    )
    engine = factory(config)
    engine.load()
    return engine


@pytest.fixture(
    scope="session",
    params=[(b, m) for m in MODEL_FILES for b in BACKEND_NAMES],
    ids=[f"{b}-{m.suffix[1:]}" for m in MODEL_FILES for b in BACKEND_NAMES],
)
def engine(request: pytest.FixtureRequest, model_info: ModelInfo) -> Iterator[Engine]:
    """Every backend on every form of the shared model: the ``.pt`` (rectangular letterbox)
    and its TorchScript trace (square 640x640, converted to ONNX for ONNX Runtime)."""
    backend, source = request.param
    if not source.exists():
        pytest.fail(f"shared model missing: {source} (set STREAMDET_SHARED_DIR)")
    info = model_info if source == MODEL_PT else prepare_model(str(source), CACHE_DIR, 640)
    try:
        eng = make_engine(backend, info, source=source)
    except EngineError as exc:
        pytest.skip(f"backend {backend} cannot load here: {exc}")
    yield eng
    eng.close()


@pytest.fixture(scope="session")
def ort_engine(model_info: ModelInfo) -> Engine:
    """The ONNX Runtime engine, loaded once, for tests that need real detections of frames."""
    from tests.helpers import ort_factory

    engine = ort_factory(model_info)()
    engine.load()
    return engine


@pytest.fixture(scope="module")
def pool(model_info: ModelInfo) -> Iterator[EnginePool]:
    """A started one-worker pool on the real ONNX Runtime engine, a 5 ms batching window, one
    per test module (a module that needs another defines its own)."""
    from tests.helpers import start_ort_pool

    p = start_ort_pool(model_info, max_wait_ms=5)
    yield p
    p.stop(5)


@pytest.fixture(autouse=True)
def _gil_switch_interval() -> Iterator[None]:
    """Each test starts at the interpreter's GIL switch interval as the one before found it:
    the server's and the benchmarks' code run here sets it (``--gil-switch-ms``), and which tests
    ran before in this process (one of the parallel workers) must not change what a test sees."""
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)
