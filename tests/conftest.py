from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from engines.registry import EngineConfig, load_backend, prepare_model
from engines.types import Engine, EngineError, ModelInfo
from tests.helpers import CACHE_DIR, MODEL_PT

os.environ.setdefault("YOLO_OFFLINE", "true")
os.environ.setdefault("YOLO_AUTOINSTALL", "false")
os.environ.setdefault("YOLO_VERBOSE", "false")

# Every backend is tried; the ones that cannot load here (no GPU, no TensorRT) are skipped
# with the reason their load gave.
BACKEND_NAMES = ["onnxruntime", "torch", "tensorrt"]


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


def make_engine(name: str, model: ModelInfo, max_batch: int = 8) -> Engine:
    factory = load_backend(name)
    config = EngineConfig(
        model=model,
        imgsz=640,
        max_batch=max_batch,
        threads=2,
        device=backend_device(name),
        cache_dir=CACHE_DIR,
        source=MODEL_PT,
    )
    engine = factory(config)
    engine.load()
    return engine


@pytest.fixture(scope="session", params=BACKEND_NAMES)
def engine(request: pytest.FixtureRequest, model_info: ModelInfo) -> Iterator[Engine]:
    try:
        eng = make_engine(request.param, model_info)
    except EngineError as exc:
        pytest.skip(f"backend {request.param} cannot load here: {exc}")
    yield eng
    eng.close()
