"""EnginePool with the real ONNX Runtime engine."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from engines.batching import DeadlineExceeded, PoolClosed, QueueFull, WorkItem, WorkResult
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


def test_a_failed_start_waits_for_the_workers_still_loading(model_info: ModelInfo) -> None:
    """One worker failing to load while another still loads (ONNX Runtime's session setup):
    the start returned with that worker inside ONNX Runtime, and the process then exited
    134 ("terminate called without an active exception") one time in three. The others
    are waited for, and each closes the engine it loaded."""
    from dataclasses import replace

    broken = ort_factory(replace(model_info, path="/nonexistent/model.onnx"))
    loaded: list[Any] = []
    calls = iter(range(2))

    def factory() -> Any:
        if next(calls) == 0:
            return broken()
        time.sleep(1.0)  # still loading when the other fails
        engine = _Closing(ort_factory(model_info)())
        loaded.append(engine)
        return engine

    p = EnginePool(factory, workers=2, max_batch=1, max_wait_ms=0, max_queue=4)
    with pytest.raises(EngineError, match=r"/nonexistent/model\.onnx"):
        p.start()
    assert not any(t.is_alive() for t in p._threads)
    assert len(loaded) == 1 and loaded[0].closed


class _Closing:
    """The real engine, noting that it was closed."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.closed = inner, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def close(self) -> None:
        self.closed = True
        self.inner.close()


class _Wrapped:
    """The real engine, held at each ``infer`` until ``gate`` opens, counting its calls;
    ``short`` times it answers one result too few (a broken engine)."""

    def __init__(self, inner: Any, gate: threading.Event, short: int = 0) -> None:
        self.inner, self.gate, self.short, self.calls = inner, gate, short, 0
        self.entered = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def infer(self, images: Any, params: Any) -> Any:
        self.calls += 1
        self.entered.set()
        assert self.gate.wait(60)
        out = self.inner.infer(images, params)
        if self.short:
            self.short -= 1
            return out[:-1]
        return out


def _gated_pool(
    model_info: ModelInfo, gate: threading.Event, short: int = 0, max_batch: int = 1
) -> tuple[EnginePool, list[_Wrapped]]:
    made: list[_Wrapped] = []

    def factory() -> Any:
        made.append(_Wrapped(ort_factory(model_info)(), gate, short))
        return made[-1]

    p = EnginePool(factory, workers=1, max_batch=max_batch, max_wait_ms=50, max_queue=4)
    p.start()
    return p, made


async def test_a_call_of_several_images_is_queued_whole_or_not_and_taken_back_when_gone(
    model_info: ModelInfo,
) -> None:
    """With the one worker busy: a call of 3 images where 2 places are left is refused
    whole (the first ones were queued and ran for an answer of 429); a call whose caller
    goes away (its task cancelled) takes its waiting images back (they ran for nobody)."""
    bus = load_image(ultralytics_assets() / "bus.jpg")
    gate = threading.Event()
    pool, made = _gated_pool(model_info, gate)
    far = time.monotonic() + 60
    try:
        busy = asyncio.ensure_future(pool.detect(bus, DetectParams(), far, "busy"))
        assert await asyncio.to_thread(made[0].entered.wait, 30)  # held at the gate
        two = asyncio.ensure_future(pool.detect_many([bus, bus], DetectParams(), far, "two"))
        await asyncio.sleep(0.05)
        assert pool.queue.depth()[0] == 2
        with pytest.raises(QueueFull):
            await pool.detect_many([bus] * 3, DetectParams(), far, "three")
        assert pool.queue.depth()[0] == 2  # nothing of it queued
        two.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await two
        assert pool.queue.depth()[0] == 0  # taken back
        gate.set()
        assert (await busy).detections is not None
        await asyncio.sleep(0.3)
        assert made[0].calls == 1  # only the call that stayed ran
    finally:
        gate.set()
        pool.stop(5)


async def test_a_call_queued_past_its_deadline_is_answered_then_not_when_a_worker_frees(
    model_info: ModelInfo,
) -> None:
    """With the one worker held: a queued call whose deadline passes is answered
    DeadlineExceeded (and counted expired) while the worker is still held; it was answered
    only once a worker took it, up to a batch late. The held call still runs."""
    bus = load_image(ultralytics_assets() / "bus.jpg")
    gate = threading.Event()
    pool, made = _gated_pool(model_info, gate)
    try:
        busy = asyncio.ensure_future(
            pool.detect(bus, DetectParams(), time.monotonic() + 60, "busy")
        )
        assert await asyncio.to_thread(made[0].entered.wait, 30)  # held at the gate
        late = await pool.detect_many([bus, bus], DetectParams(), time.monotonic() + 0.2, "late")
        assert not gate.is_set() and made[0].calls == 1  # answered with the worker still held
        assert all(isinstance(r.error, DeadlineExceeded) for r in late)
        assert pool.queue.depth()[0] == 0 and pool.stats.expired == 2
        gate.set()
        assert (await busy).detections is not None
    finally:
        gate.set()
        pool.stop(5)


async def test_an_engine_answering_too_few_results_fails_nobody_and_keeps_its_worker(
    model_info: ModelInfo,
) -> None:
    """A batch the engine answers with one result too few is retried image by image (each
    its own answer); the worker goes on (the mismatch escaped the worker and ended it: its
    batch and every call after it were never answered)."""
    bus = load_image(ultralytics_assets() / "bus.jpg")
    gate = threading.Event()
    gate.set()
    pool, made = _gated_pool(model_info, gate, short=1, max_batch=2)
    far = time.monotonic() + 60
    try:
        got = await asyncio.wait_for(pool.detect_many([bus, bus], DetectParams(), far, "x"), 60)
        assert [len(r.detections or ()) for r in got] == [5, 5]
        after = await asyncio.wait_for(pool.detect(bus, DetectParams(), far, "after"), 60)
        assert after.detections is not None
        assert made[0].calls == 4  # the batch, each image alone, then the next call
    finally:
        pool.stop(5)
