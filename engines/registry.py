"""Backends chosen by name and imported only when chosen, so a CPU install never imports
TensorRT or CUDA code."""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from engines.model import read_model_info, resolve_onnx
from engines.types import Engine, EngineError, ModelInfo

BACKENDS: dict[str, str] = {
    "onnxruntime": "engines.onnxruntime:OrtEngine",
    "torch": "engines.torch_cuda:TorchEngine",
    "tensorrt": "engines.tensorrt:TrtEngine",
}


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """What a backend needs to build one engine instance (one per worker)."""

    model: ModelInfo
    imgsz: int
    max_batch: int
    threads: int
    device: str = "cpu"
    cache_dir: Path = Path(".cache")
    # The model file as the user gave it (.pt), for backends that run it directly (torch).
    source: Path | None = None


def fixed_batch(info: ModelInfo) -> int | None:
    """The batch size a model's graph fixes (Ultralytics' default export: 1), or ``None`` where
    the batch axis is dynamic."""
    return info.fixed_batch


def fixed_shape(info: ModelInfo) -> tuple[int, int] | None:
    """The ``(H, W)`` a fixed-shape model runs at (``None``: dynamic height and width)."""
    return None if info.dynamic_hw else info.imgsz


class ConfiguredEngine:
    """What every backend answers from its :class:`EngineConfig` alone: class names, input
    size, largest batch and model name. Backends subclass it and add load/detect."""

    warm_item_s = 0.0
    """Seconds one square image took once warm (set by ``warmup``; 0 before): what admission
    plans a call by until the pool's first batches are measured (a burst right after
    ``/readyz`` said ready was half refused 429, "no batch has run yet")."""

    def __init__(self, config: EngineConfig) -> None:
        self._config = config
        info = config.model
        # A fixed-shape model dictates its size (the longer side of a non-square one: what
        # the image is scaled to fit before the letterbox pads it to the model's shape); a
        # dynamic one takes the configured imgsz.
        self._imgsz = config.imgsz if info.dynamic_hw else max(info.imgsz)

    @property
    def names(self) -> Mapping[int, str]:
        return self._config.model.names

    @property
    def input_size(self) -> int:
        return self._imgsz

    @property
    def max_batch(self) -> int:
        fixed = fixed_batch(self._config.model)
        return self._config.max_batch if fixed is None else min(self._config.max_batch, fixed)

    @property
    def model_name(self) -> str:
        """The file the user named (``yolov8n.pt``), not the cached export's name."""
        source = self._config.source
        return (source or Path(self._config.model.path)).name


class EngineFactory(Protocol):
    def __call__(self, config: EngineConfig) -> Engine: ...


def load_backend(name: str) -> EngineFactory:
    """Import the backend called ``name``.

    Raises:
        EngineError: unknown name or the backend's runtime is not installed.
    """
    try:
        target = BACKENDS[name]
    except KeyError:
        raise EngineError(
            f"unknown backend {name!r}; choose one of {sorted(BACKENDS)}"
            " (setting STREAMDET_BACKEND)"
        ) from None
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise EngineError(
            f"backend {name!r} cannot be imported ({exc}); install its runtime or pick"
            " --backend onnxruntime"
        ) from exc
    factory: EngineFactory = getattr(module, attr)
    return factory


def prepare_model(model: str, cache_dir: Path, imgsz: int) -> ModelInfo:
    """Resolve ``model`` to an ONNX file (exporting a .pt once) and read its metadata."""
    return read_model_info(resolve_onnx(model, cache_dir, imgsz))


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, e.g. a container's cpuset)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, cores or 1)


def default_threads(workers: int, threads_per_worker: int) -> int:
    """Intra-op threads per CPU worker: the setting, or the cores shared among workers."""
    if threads_per_worker > 0:
        return threads_per_worker
    return max(1, usable_cores() // workers)
