"""Building the engine pool from settings."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

from engines.pool import EnginePool
from engines.registry import EngineConfig, default_threads, load_backend, prepare_model
from engines.types import Engine, ModelInfo
from server.settings import Settings

log = logging.getLogger(__name__)


def engine_config(settings: Settings, model: ModelInfo) -> EngineConfig:
    return EngineConfig(
        model=model,
        imgsz=settings.imgsz,
        max_batch=settings.max_batch,
        threads=default_threads(settings.workers, settings.threads_per_worker),
        device=settings.device,
        cache_dir=settings.cache_dir,
        source=Path(settings.model),
    )


def build_pool(settings: Settings) -> EnginePool:
    """Resolve the model, load one engine per worker, warm them, and start the pool.

    Raises:
        EngineError: the model or backend cannot load; the message says what to change.
    """
    factory = load_backend(settings.backend)
    model = prepare_model(settings.model, settings.cache_dir, settings.imgsz)
    config = engine_config(settings, model)
    log.info(
        "loading %s on %s: %d worker(s) x %d thread(s), max batch %d",
        model.path,
        settings.backend,
        settings.workers,
        config.threads,
        settings.max_batch,
    )
    make: functools.partial[Engine] = functools.partial(factory, config)
    pool = EnginePool(
        make,
        workers=settings.workers,
        max_batch=settings.max_batch,
        max_wait_ms=settings.max_wait_ms,
        max_queue=settings.max_queue,
    )
    pool.start()
    return pool
