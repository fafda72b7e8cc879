"""EnginePool with the real ONNX Runtime engine."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from engines.batching import DeadlineExceeded, PoolClosed, WorkItem, WorkResult
from engines.pool import EnginePool
from engines.types import DetectParams, EngineError, ModelInfo
from streams.files import load_image
from tests.helpers import ort_factory, start_ort_pool, ultralytics_assets


class Collector:
    def __init__(self) -> None:
        self.results: dict[str, WorkResult] = {}
        self.lock = threading.Lock()
        self.done = threading.Condition(self.lock)

    def callback(self, rid: str) -> functools.partial[None]:
        return functools.partial(self._put, rid)

    def _put(self, rid: str, result: WorkResult) -> None:
        with self.done:
            self.results[rid] = result
            self.done.notify_all()

    def wait(self, n: int, timeout: float = 60) -> None:
        with self.done:
            assert self.done.wait_for(lambda: len(self.results) >= n, timeout)


@pytest.fixture(scope="module")
def pool(model_info: ModelInfo) -> Iterator[EnginePool]:
    p = start_ort_pool(model_info, max_wait_ms=20, max_queue=32)
    yield p
    p.stop(5)


def test_bad_item_fails_alone_and_pool_keeps_running(pool: EnginePool) -> None:
    bus = load_image(ultralytics_assets() / "bus.jpg")
    broken = np.zeros((0, 0, 3), np.uint8)  # no pixels: preprocessing raises
    col = Collector()
    far = time.monotonic() + 60
    for rid, img in [("good1", bus), ("bad", broken), ("good2", bus)]:
        pool.submit(WorkItem(img, DetectParams(), far, col.callback(rid), request_id=rid))
    col.wait(3)
    assert col.results["good1"].detections is not None
    assert col.results["good2"].detections is not None
    assert len(col.results["good1"].detections) == 5
    assert isinstance(col.results["bad"].error, EngineError)
    assert pool.stats.failed >= 1
    # Still serving afterwards.
    col2 = Collector()
    pool.submit(WorkItem(bus, DetectParams(), far, col2.callback("after"), request_id="after"))
    col2.wait(1)
    assert col2.results["after"].detections is not None


def test_expired_items_are_answered_not_run(pool: EnginePool) -> None:
    bus = load_image(ultralytics_assets() / "bus.jpg")
    col = Collector()
    before = pool.stats.expired
    pool.submit(
        WorkItem(bus, DetectParams(), time.monotonic() - 1, col.callback("late"), request_id="late")
    )
    col.wait(1)
    assert isinstance(col.results["late"].error, DeadlineExceeded)
    assert pool.stats.expired == before + 1


def test_concurrent_items_share_batches(pool: EnginePool) -> None:
    bus = load_image(ultralytics_assets() / "bus.jpg")
    col = Collector()
    far = time.monotonic() + 60
    for i in range(8):
        pool.submit(WorkItem(bus, DetectParams(), far, col.callback(str(i)), request_id=str(i)))
    col.wait(8)
    sizes = [r.batch_size for r in col.results.values()]
    assert max(sizes) > 1
    assert all(len(r.detections or ()) == 5 for r in col.results.values())


def test_stop_answers_everything_accepted(model_info: ModelInfo) -> None:
    p = EnginePool(ort_factory(model_info), workers=1, max_batch=1, max_wait_ms=0, max_queue=64)
    p.start()
    bus = load_image(ultralytics_assets() / "bus.jpg")
    col = Collector()
    far = time.monotonic() + 60
    for i in range(20):
        p.submit(WorkItem(bus, DetectParams(), far, col.callback(str(i)), request_id=str(i)))
    p.stop(timeout_s=0.0)
    col.wait(20)
    outcomes = {type(r.error).__name__ if r.error else "ok" for r in col.results.values()}
    assert outcomes <= {"ok", "PoolClosed"}
    assert "PoolClosed" in outcomes
    with pytest.raises(PoolClosed):
        p.submit(WorkItem(bus, DetectParams(), far, col.callback("x")))


def test_failed_load_names_the_problem(model_info: ModelInfo) -> None:
    from dataclasses import replace

    bad = replace(model_info, path="/nonexistent/model.onnx")
    p = EnginePool(ort_factory(bad), workers=2, max_batch=1, max_wait_ms=0, max_queue=4)
    with pytest.raises(EngineError, match=r"/nonexistent/model\.onnx"):
        p.start()
