"""EnginePool: N worker threads, each owning one engine, fed by one two-lane queue.

Each free worker collects its own batch (``collect_batch``) and runs it. That is the
scheduler: a batch is formed only when a worker can run it at once, so it never waits
behind another batch while newer items could have joined it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engines.batching import (
    DeadlineExceeded,
    PoolClosed,
    WorkItem,
    WorkQueue,
    WorkResult,
    collect_batch,
)
from engines.types import DetectParams, Engine, EngineError, Image

log = logging.getLogger(__name__)


@dataclass
class PoolStats:
    """Counters read by health, admission control and metrics."""

    batches: int = 0
    items: int = 0
    expired: int = 0
    failed: int = 0
    ewma_batch_s: float = 0.0
    ewma_item_s: float = 0.0


BatchObserver = Callable[[int, float], None]


LOAD_SETTLE_S = 60.0
"""How long a failed or interrupted start waits for the workers still loading their engines."""


class EnginePool:
    """Runs engines on worker threads and answers every accepted item exactly once.

    Args:
        factory: builds one engine; called inside each worker thread (CUDA contexts and
            ONNX Runtime sessions belong to the thread that uses them).
        workers: number of worker threads.
        max_batch: largest batch a worker runs.
        max_wait_ms: how long a batch waits to fill after its first item.
        max_queue: interactive items allowed to wait.
    """

    def __init__(
        self,
        factory: Callable[[], Engine],
        workers: int,
        max_batch: int,
        max_wait_ms: float,
        max_queue: int,
    ) -> None:
        self._factory = factory
        self._workers = workers
        self._max_batch = max_batch
        self._max_wait_ms = max_wait_ms
        self.queue = WorkQueue(max_queue)
        self.stats = PoolStats()
        self._stats_lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._engines: list[Engine] = []
        self._ready = threading.Event()
        self._busy = 0
        self.batch_observers: list[BatchObserver] = []
        self.warm_item_s = 0.0
        """One square image's seconds on a warm engine (the slowest worker's; 0: unknown)."""

    # ---- lifecycle -------------------------------------------------------------------
    def start(self, timeout_s: float = 600.0) -> None:
        """Start the workers; returns once every engine is loaded and warmed.

        Raises:
            EngineError: an engine failed to load; the pool is stopped.
        """
        errors: list[BaseException] = []
        started = threading.Barrier(self._workers + 1)
        for idx in range(self._workers):
            thread = threading.Thread(
                target=self._run,
                args=(idx, started, errors),
                name=f"engine-worker-{idx}",
                daemon=True,
            )
            thread.start()
            self._threads.append(thread)
        try:
            started.wait(timeout_s)
        except threading.BrokenBarrierError:
            errors.append(EngineError(f"engines did not load within {timeout_s:.0f} s"))
        except BaseException:  # Ctrl-C while the engines load
            started.abort()
            self._abandon()
            raise
        if errors:
            self._abandon()
            err = errors[0]
            raise err if isinstance(err, EngineError) else EngineError(str(err))
        self._ready.set()

    def _abandon(self) -> None:
        """A start that failed or was interrupted: the workers still loading are waited for
        (:data:`LOAD_SETTLE_S` at most), each closing its engine. The process returned with
        them inside ONNX Runtime's session setup, and exited 134 ("terminate called without
        an active exception") instead of 2 or 130, one time in three."""
        self.queue.close()
        end = time.monotonic() + LOAD_SETTLE_S
        for thread in self._threads:
            thread.join(max(0.0, end - time.monotonic()))
        if any(t.is_alive() for t in self._threads):
            log.warning("engine workers still loading after %.0f s; leaving them", LOAD_SETTLE_S)

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and not self.queue.closed

    @property
    def workers(self) -> int:
        """Number of engine worker threads."""
        return self._workers

    @property
    def max_batch(self) -> int:
        """Largest batch a worker runs."""
        return self._max_batch

    @property
    def busy(self) -> int:
        """Workers running a batch right now (admission control reads it)."""
        return self._busy

    @property
    def engine(self) -> Engine:
        """The first worker's engine (for names and model metadata)."""
        return self._engines[0]

    @property
    def engines(self) -> tuple[Engine, ...]:
        """Every worker's loaded engine (benchmarks read their state)."""
        return tuple(self._engines)

    def stop(self, timeout_s: float) -> None:
        """Stop intake, let workers drain for ``timeout_s``, then fail what is left."""
        self.queue.close()
        end = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, end - time.monotonic()))
        for item in self.queue.drain():
            _deliver(item, WorkResult(None, PoolClosed("server shutting down"), 0.0, 0.0, 0))
        if any(t.is_alive() for t in self._threads):
            log.warning("engine workers still busy after %.1f s drain", timeout_s)
        self._ready.clear()

    # ---- intake -----------------------------------------------------------------------
    def submit(self, item: WorkItem) -> None:
        """Queue an interactive item (raises QueueFull / PoolClosed)."""
        self.queue.put(item)

    def submit_latest(self, stream_id: str, item: WorkItem) -> WorkItem | None:
        """Offer a stream frame; returns the replaced frame (count it as a drop)."""
        return self.queue.put_latest(stream_id, item)

    def submit_background(self, item: WorkItem) -> None:
        """Queue background work (a video job's frame), run on capacity that interactive
        calls and streams leave (raises PoolClosed)."""
        self.queue.put_background(item)

    async def detect(
        self, image: Image, params: DetectParams, deadline: float, request_id: str = ""
    ) -> WorkResult:
        """Run one interactive image from the event loop; raises QueueFull / PoolClosed."""
        (result,) = await self.detect_many([image], params, deadline, request_id)
        return result

    async def detect_many(
        self, images: Sequence[Image], params: DetectParams, deadline: float, request_id: str = ""
    ) -> list[WorkResult]:
        """Run the interactive images of one call from the event loop, queued all or none;
        raises QueueFull / PoolClosed. Cancelled (its caller went away), the images still
        waiting are taken back: they ran for nobody before, holding places in the queue."""
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[WorkResult]] = []
        items: list[WorkItem] = []
        for i, image in enumerate(images):
            future: asyncio.Future[WorkResult] = loop.create_future()

            def done(result: WorkResult, future: asyncio.Future[WorkResult] = future) -> None:
                loop.call_soon_threadsafe(_set_result, future, result)

            rid = request_id if len(images) == 1 else f"{request_id}:{i}"
            futures.append(future)
            items.append(WorkItem(image, params, deadline, done, request_id=rid))
        self.queue.put_all(items)
        try:
            # An image still queued at its deadline is answered then (DeadlineExceeded), not
            # when a worker comes to it, up to a batch later; one running is waited for.
            left = deadline - time.monotonic()
            _, pending = await asyncio.wait(futures, timeout=max(0.0, left) if left < 1e6 else None)
            if pending:
                now = time.monotonic()
                for item in self.queue.withdraw(items):  # a timer may fire a hair early
                    self._expire(item, now)
            return list(await asyncio.gather(*futures))
        except asyncio.CancelledError:
            if taken := self.queue.withdraw(items):
                log.info("request %s: gone; %d image(s) taken back", request_id, len(taken))
            raise

    # ---- workers ------------------------------------------------------------------------
    def _run(self, idx: int, started: threading.Barrier, errors: list[BaseException]) -> None:
        try:
            engine = self._factory()
            engine.load()
            engine.warmup()
            with self._stats_lock:  # the slowest worker's, until batches are measured
                self.warm_item_s = max(self.warm_item_s, getattr(engine, "warm_item_s", 0.0))
            self._engines.append(engine)
        except BaseException as exc:
            log.error("engine worker %d failed to load: %s", idx, exc)
            errors.append(exc)
            started.abort()
            return
        try:
            started.wait()
        except threading.BrokenBarrierError:
            engine.close()
            return
        try:
            while True:
                batch = collect_batch(self.queue, self._max_batch, self._max_wait_ms)
                if not batch:
                    break
                try:
                    self._run_batch(engine, batch)
                except Exception as exc:  # a bug must cost this batch, not the worker
                    log.exception("engine worker %d: batch of %d failed", idx, len(batch))
                    for item in batch:  # those not answered yet (an answer is given once)
                        _deliver(item, WorkResult(None, EngineError(f"{exc!r}"), 0.0, 0.0, 0))
        finally:
            engine.close()

    def _expired(self, item: WorkItem, now: float) -> bool:
        """Whether ``item``'s deadline has passed; if so it is answered so, and counted."""
        if item.deadline >= now:
            return False
        self._expire(item, now)
        return True

    def _expire(self, item: WorkItem, now: float) -> None:
        """Answer ``item`` as past its deadline, and count it."""
        self._count(expired=1)
        waited = (now - item.enqueued_at) * 1000
        error = DeadlineExceeded(f"waited {waited:.0f} ms in queue, past its deadline")
        _deliver(item, WorkResult(None, error, waited, 0.0, 0))

    def _run_batch(self, engine: Engine, batch: list[WorkItem]) -> None:
        now = time.monotonic()
        live = [item for item in batch if not self._expired(item, now)]
        if not live:
            return
        with self._stats_lock:
            self._busy += 1
        try:
            self._infer_isolating(engine, live, now)
        finally:
            with self._stats_lock:
                self._busy -= 1

    def _infer_isolating(self, engine: Engine, items: list[WorkItem], started: float) -> None:
        try:
            results = engine.infer([i.image for i in items], [i.params for i in items])
            if len(results) != len(items):
                raise EngineError(f"{len(results)} results for {len(items)} images")
        except Exception as exc:
            if len(items) > 1:
                # Retry one by one so a single bad input fails only its own request; those
                # whose deadline passed meanwhile are answered so, as in the queue.
                log.warning("batch of %d failed (%s); retrying items singly", len(items), exc)
                for item in items:
                    now = time.monotonic()
                    if not self._expired(item, now):
                        self._infer_isolating(engine, [item], now)
                return
            item = items[0]
            log.error("request %s: inference failed: %s", item.request_id, exc)
            self._count(failed=1)
            _deliver(
                item,
                WorkResult(
                    None,
                    EngineError(f"inference failed: {exc}"),
                    (started - item.enqueued_at) * 1000,
                    0.0,
                    1,
                ),
            )
            return
        elapsed = time.monotonic() - started
        self._observe(len(items), elapsed)
        for item, det in zip(items, results, strict=True):
            _deliver(
                item,
                WorkResult(
                    det, None, (started - item.enqueued_at) * 1000, elapsed * 1000, len(items)
                ),
            )

    def _observe(self, size: int, elapsed: float) -> None:
        with self._stats_lock:
            s = self.stats
            s.batches += 1
            s.items += size
            alpha = 0.2 if s.batches > 1 else 1.0
            s.ewma_batch_s += alpha * (elapsed - s.ewma_batch_s)
            s.ewma_item_s += alpha * (elapsed / size - s.ewma_item_s)
        for observer in self.batch_observers:
            try:
                observer(size, elapsed)
            except Exception:
                log.exception("batch observer failed")

    def _count(self, expired: int = 0, failed: int = 0) -> None:
        with self._stats_lock:
            self.stats.expired += expired
            self.stats.failed += failed


def _deliver(item: WorkItem, result: WorkResult) -> None:
    if item.answered:
        return
    item.answered = True
    try:
        item.on_done(result)
    except Exception:
        log.exception("request %s: result delivery failed", item.request_id)


def _set_result(future: asyncio.Future[WorkResult], result: WorkResult) -> None:
    if not future.done():  # the client may have gone away
        future.set_result(result)
