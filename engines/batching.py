"""The work queue and the batch collector.

``collect_batch`` is the whole batching policy: wait for one item, then gather more until the
batch is full or ``max_wait_ms`` has passed since the first one arrived. It takes no engine,
so it is tested on its own.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engines.types import Detections, DetectParams, Image


class QueueFull(RuntimeError):
    """The interactive lane is full; the caller should answer 429."""


class PoolClosed(RuntimeError):
    """The pool is shutting down and takes no more work."""


class DeadlineExceeded(RuntimeError):
    """An item's deadline passed before an engine could run it."""


@dataclass(frozen=True, slots=True)
class WorkResult:
    """What comes back for one item: detections or the error, and where the time went."""

    detections: Detections | None
    error: BaseException | None
    queue_ms: float
    inference_ms: float
    batch_size: int


@dataclass(slots=True)
class WorkItem:
    """One image waiting for an engine.

    Attributes:
        image: RGB uint8 ``(H, W, 3)``.
        params: post-processing parameters.
        deadline: ``time.monotonic()`` after which the item is answered with an error.
        on_done: called once, from a worker thread, with the result; must not block.
        request_id: request or ``stream:frame`` id, for logs.
        stream_id: set for stream frames, which queue in the low-priority lane.
    """

    image: Image
    params: DetectParams
    deadline: float
    on_done: Callable[[WorkResult], None]
    request_id: str = ""
    stream_id: str | None = None
    enqueued_at: float = field(default_factory=time.monotonic)


class WorkQueue:
    """Three lanes under one lock: interactive calls (FIFO, bounded) outrank stream frames,
    which outrank background work (video jobs).

    The stream lane holds at most one frame per stream (a newer frame replaces the waiting
    one) and serves streams round-robin, so under overload every stream drops frames
    instead of building a backlog, and none starves. The background lane is FIFO and runs
    only on capacity the other two leave; its producers bound it (a job keeps a few frames
    in flight), and a live frame arriving behind it waits at most for the batch running.
    """

    def __init__(self, max_interactive: int) -> None:
        if max_interactive < 1:
            raise ValueError("max_interactive must be >= 1")
        self._max_interactive = max_interactive
        self._interactive: deque[WorkItem] = deque()
        self._streams: OrderedDict[str, WorkItem] = OrderedDict()
        self._background: deque[WorkItem] = deque()
        self._cond = threading.Condition()
        self._closed = False

    def put(self, item: WorkItem) -> None:
        """Queue an interactive item. Raises :class:`QueueFull` or :class:`PoolClosed`."""
        with self._cond:
            if self._closed:
                raise PoolClosed("the engine pool is shutting down")
            if len(self._interactive) >= self._max_interactive:
                raise QueueFull(
                    f"{len(self._interactive)} requests already waiting"
                    " (setting STREAMDET_MAX_QUEUE)"
                )
            self._interactive.append(item)
            self._cond.notify()

    def put_latest(self, key: str, item: WorkItem) -> WorkItem | None:
        """Offer a stream frame; returns the frame it replaced (a drop), if any."""
        with self._cond:
            if self._closed:
                raise PoolClosed("the engine pool is shutting down")
            replaced = self._streams.get(key)
            self._streams[key] = item  # a replaced frame keeps its stream's turn
            self._cond.notify()
            return replaced

    def put_background(self, item: WorkItem) -> None:
        """Queue background work, served when no call or stream frame waits. Raises
        :class:`PoolClosed`."""
        with self._cond:
            if self._closed:
                raise PoolClosed("the engine pool is shutting down")
            self._background.append(item)
            self._cond.notify()

    def discard(self, key: str) -> WorkItem | None:
        """Remove a stream's waiting frame (stream removed)."""
        with self._cond:
            return self._streams.pop(key, None)

    def _pop(self) -> WorkItem | None:
        if self._interactive:
            return self._interactive.popleft()
        if self._streams:
            return self._streams.popitem(last=False)[1]
        if self._background:
            return self._background.popleft()
        return None

    def get(self, timeout: float | None) -> WorkItem | None:
        """Next item, interactive first; ``None`` on timeout or once closed and empty."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                item = self._pop()
                if item is not None or self._closed:
                    return item
                if end is None:
                    self._cond.wait()
                else:
                    remaining = end - time.monotonic()
                    if remaining <= 0:
                        return None
                    self._cond.wait(remaining)

    def close(self) -> None:
        """Refuse new items; waiting ones are still handed out."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def drain(self) -> list[WorkItem]:
        """Take every waiting item (to fail them on a hard shutdown)."""
        with self._cond:
            items = [*self._interactive, *self._streams.values(), *self._background]
            self._interactive.clear()
            self._streams.clear()
            self._background.clear()
            return items

    @property
    def closed(self) -> bool:
        return self._closed

    def depth(self) -> tuple[int, int]:
        """``(interactive, stream)`` items waiting."""
        with self._cond:
            return len(self._interactive), len(self._streams)

    def background_depth(self) -> int:
        """Background items waiting."""
        with self._cond:
            return len(self._background)


def collect_batch(queue: WorkQueue, max_batch: int, max_wait_ms: float) -> list[WorkItem]:
    """Block for the first item, then fill the batch for at most ``max_wait_ms``.

    Returns an empty list only when the queue is closed and empty.
    """
    first = queue.get(timeout=None)
    if first is None:
        return []
    batch = [first]
    fill_until = time.monotonic() + max_wait_ms / 1000.0
    while len(batch) < max_batch:
        remaining = fill_until - time.monotonic()
        item = queue.get(timeout=max(remaining, 0.0))
        if item is None:
            break
        batch.append(item)
    return batch
