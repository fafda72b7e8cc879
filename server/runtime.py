"""Building the engine pool from settings."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

from engines.model import default_imgsz
from engines.pool import EnginePool
from engines.registry import (
    EngineConfig,
    default_threads,
    fixed_batch,
    load_backend,
    prepare_model,
)
from engines.types import Engine, EngineError, ModelInfo
from server.settings import Settings

log = logging.getLogger(__name__)


def engine_config(settings: Settings, model: ModelInfo) -> EngineConfig:
    """The engine settings for ``model``: its own input size where ``imgsz`` was not set (a
    ``streamdet export`` artifact runs at the size it was calibrated and checked at), and no
    larger batch than a fixed-batch graph takes."""
    return EngineConfig(
        model=model,
        imgsz=served_imgsz(settings, model),
        max_batch=served_max_batch(settings, model),
        threads=default_threads(settings.workers, settings.threads_per_worker),
        device=settings.device,
        cache_dir=settings.cache_dir,
        source=Path(settings.model),
    )


def served_imgsz(settings: Settings, model: ModelInfo) -> int:
    """``imgsz`` as set (flag, environment), else the model's own (``default_imgsz``), else
    the setting's default."""
    if "imgsz" in settings.model_fields_set:
        return settings.imgsz
    return default_imgsz(model) or settings.imgsz


def served_max_batch(settings: Settings, model: ModelInfo) -> int:
    """``max_batch``; for a graph whose batch is fixed, no more than that batch, and that
    batch itself where ``max_batch`` was not set (every batch is padded up to it anyway:
    the backend's default of 1 on the CPU made a ``batch=8`` export run 8 images' compute
    for each one)."""
    fixed = fixed_batch(model)
    if fixed is None:
        return settings.max_batch
    if "max_batch" not in settings.model_fields_set:
        return fixed
    return min(settings.max_batch, fixed)


def build_pool(settings: Settings) -> EnginePool:
    """Resolve the model, load one engine per worker, warm them, and start the pool.

    Raises:
        EngineError: the model or backend cannot load; the message says what to change.
    """
    factory = load_backend(settings.backend)
    model = prepare_model(settings.model, settings.cache_dir, settings.imgsz)
    own = default_imgsz(model)
    if not model.dynamic_hw and "imgsz" in settings.model_fields_set and settings.imgsz != own:
        # As export refuses it: it was served at its own size, the --imgsz given ignored.
        raise EngineError(
            f"--imgsz {settings.imgsz}: model {settings.model} has a fixed"
            f" {model.imgsz[0]}x{model.imgsz[1]} input, so it runs at {own} only: drop --imgsz"
            f" (or pass --imgsz {own}; setting STREAMDET_IMGSZ), or export the model again"
            " with dynamic=True"
        )
    config = engine_config(settings, model)
    fixed = fixed_batch(model)
    if fixed is not None and config.max_batch < settings.max_batch:
        log.warning(
            "model %s: its graph takes batches of %d only: max batch %d lowered to %d"
            " (export it with dynamic=True to batch)",
            model.path,
            fixed,
            settings.max_batch,
            config.max_batch,
        )
    elif fixed is not None and config.max_batch < fixed:
        log.warning(
            "model %s: its graph takes batches of %d only: every batch of at most %d"
            " (setting STREAMDET_MAX_BATCH) is padded to %d, the compute of %d images"
            " (export it with dynamic=True to batch less)",
            model.path,
            fixed,
            config.max_batch,
            fixed,
            fixed,
        )
    if config.imgsz != settings.imgsz and "imgsz" not in settings.model_fields_set:
        log.info("model %s: served at its imgsz %d (--imgsz to change)", model.path, config.imgsz)
    log.info(
        "loading %s on %s: %d worker(s) x %d thread(s), max batch %d",
        model.path,
        settings.backend,
        settings.workers,
        config.threads,
        config.max_batch,
    )
    make: functools.partial[Engine] = functools.partial(factory, config)
    pool = EnginePool(
        make,
        workers=settings.workers,
        max_batch=config.max_batch,
        max_wait_ms=settings.max_wait_ms,
        max_queue=settings.max_queue,
    )
    pool.start()
    return pool
