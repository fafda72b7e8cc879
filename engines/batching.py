"""The work queue and the batch collector.

``collect_batch`` is the whole batching policy: wait for one item, then gather more until the
batch is full or ``max_wait_ms`` has passed since the first one arrived. It takes no engine,
so it is tested on its own.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from engines.types import Detections, DetectParams, Image

REMEMBERED_STREAMS = 8192
"""Streams whose last turn the queue remembers (twice the most ``STREAMDET_MAX_STREAMS``
allows): one forgotten is one served longest ago, which goes first all the same."""


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
    answered: bool = field(default=False, compare=False)
    """Set by the worker that answered it: an answer is given once, whatever fails after."""


class WorkQueue:
    """Three lanes under one lock: interactive calls (FIFO, bounded) outrank stream frames,
    which outrank background work (video jobs).

    The stream lane holds at most one frame per stream (a newer frame replaces the waiting
    one, keeping its place) and serves first the stream served longest ago, so under
    overload every stream drops frames instead of building a backlog, and none starves: a
    stream whose frames come less often than a round of the others takes its turn when its
    frame comes (it went in at the back of the round, behind every stream served since, and
    where a round took longer than the frame deadline each of its frames expired). The
    background lane is FIFO and runs only on capacity the other two leave; its producers
    bound it (a job keeps a few frames in flight), and a live frame arriving behind it
    waits at most for the batch running.

    Waking a thread costs the producer a system call and, on a busy machine, often its
    turn on the CPU with the interpreter lock held, so an item wakes a worker only when that
    worker has something to do: a worker filling a batch (:meth:`fill`) is woken when the
    items waiting can fill it (or at its deadline), not per item; an idle worker is woken
    for a new item only when no batch is filling (the filling batch takes it: it runs by
    its deadline anyway, and the idle worker stays free for the next one).
    """

    def __init__(self, max_interactive: int) -> None:
        if max_interactive < 1:
            raise ValueError("max_interactive must be >= 1")
        self._max_interactive = max_interactive
        self._interactive: deque[WorkItem] = deque()
        self._streams: dict[str, WorkItem] = {}
        # Waiting streams by (last served, arrival, id), a heap; an entry is live while
        # _turn_of names its arrival (a discarded stream's entry is skipped).
        self._turns: list[tuple[int, int, str]] = []
        self._turn_of: dict[str, int] = {}
        self._served: OrderedDict[str, int] = OrderedDict()  # when each was last served
        self._seq = itertools.count()
        self._background: deque[WorkItem] = deque()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # workers waiting for a first item
        self._filling = threading.Condition(self._lock)  # workers waiting for a batch to fill
        self._idle_waiting = 0
        self._needs: list[int] = []  # items each filling worker still wants
        self._closed = False

    @property
    def max_interactive(self) -> int:
        """Interactive items that may wait at once."""
        return self._max_interactive

    def put(self, item: WorkItem) -> None:
        """Queue an interactive item. Raises :class:`QueueFull` or :class:`PoolClosed`."""
        self.put_all([item])

    def put_all(self, items: Sequence[WorkItem]) -> None:
        """Queue the interactive items of one call, all of them or none (a call of several
        images half queued ran its first ones for an answer of 429). Raises
        :class:`QueueFull` or :class:`PoolClosed`."""
        with self._lock:
            if self._closed:
                raise PoolClosed("the engine pool is shutting down")
            if len(self._interactive) + len(items) > self._max_interactive:
                raise QueueFull(
                    f"{len(self._interactive)} requests already waiting"
                    " (setting STREAMDET_MAX_QUEUE)"
                )
            self._interactive.extend(items)
            self._wake()

    def withdraw(self, items: Sequence[WorkItem]) -> list[WorkItem]:
        """Take back those of ``items`` still waiting (their caller went away, or their
        deadline passed); returns them."""
        gone = {id(item) for item in items}
        with self._lock:
            taken = [i for i in self._interactive if id(i) in gone]
            if taken:
                self._interactive = deque(i for i in self._interactive if id(i) not in gone)
        return taken

    def put_latest(self, key: str, item: WorkItem) -> WorkItem | None:
        """Offer a stream frame; returns the frame it replaced (a drop), if any."""
        with self._lock:
            if self._closed:
                raise PoolClosed("the engine pool is shutting down")
            replaced = self._streams.get(key)
            self._streams[key] = item  # a replaced frame keeps its stream's turn
            if replaced is None:  # one more item waiting
                arrival = next(self._seq)
                self._turn_of[key] = arrival
                heapq.heappush(self._turns, (self._served.get(key, -1), arrival, key))
                self._wake()
            return replaced

    def put_background(self, item: WorkItem) -> None:
        """Queue background work, served when no call or stream frame waits. Raises
        :class:`PoolClosed`."""
        with self._lock:
            if self._closed:
                raise PoolClosed("the engine pool is shutting down")
            self._background.append(item)
            self._wake()

    def discard(self, key: str) -> WorkItem | None:
        """Remove a stream's waiting frame and forget its turns (stream removed)."""
        with self._lock:
            self._turn_of.pop(key, None)
            self._served.pop(key, None)
            if not self._turn_of:
                self._turns.clear()
            return self._streams.pop(key, None)

    def _waiting(self) -> int:
        return len(self._interactive) + len(self._streams) + len(self._background)

    def _wake(self) -> None:
        """With the lock held, after items were added: wake the worker that has work now."""
        if self._needs:
            if self._waiting() >= min(self._needs):
                self._filling.notify_all()  # one or two fill; the one that cannot waits on
        elif self._idle_waiting:
            self._idle.notify()

    def _pop(self) -> WorkItem | None:
        if self._interactive:
            return self._interactive.popleft()
        while self._turns:
            _, arrival, key = heapq.heappop(self._turns)
            if self._turn_of.get(key) != arrival:
                continue  # discarded while it waited
            del self._turn_of[key]
            self._served[key] = next(self._seq)
            self._served.move_to_end(key)
            if len(self._served) > REMEMBERED_STREAMS:
                self._served.popitem(last=False)
            return self._streams.pop(key)
        if self._background:
            return self._background.popleft()
        return None

    def get(self, timeout: float | None) -> WorkItem | None:
        """Next item, interactive first; ``None`` on timeout or once closed and empty."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while True:
                item = self._pop()
                if item is not None or self._closed:
                    return item
                remaining = None if end is None else end - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._idle_waiting += 1
                try:
                    self._idle.wait(remaining)
                finally:
                    self._idle_waiting -= 1

    def fill(self, batch: list[WorkItem], max_batch: int, until: float) -> None:
        """Add items to ``batch`` until it holds ``max_batch`` or ``time.monotonic()`` reaches
        ``until``; once closed, only what is waiting."""
        with self._lock:
            while True:
                while len(batch) < max_batch:
                    item = self._pop()
                    if item is None:
                        break
                    batch.append(item)
                need = max_batch - len(batch)
                remaining = until - time.monotonic()
                if need == 0 or remaining <= 0 or self._closed:
                    break
                self._needs.append(need)
                try:
                    self._filling.wait(remaining)
                finally:
                    self._needs.remove(need)
            if self._waiting() and self._idle_waiting and not self._needs:
                self._idle.notify()  # what this batch left is another worker's now

    def close(self) -> None:
        """Refuse new items; waiting ones are still handed out."""
        with self._lock:
            self._closed = True
            self._idle.notify_all()
            self._filling.notify_all()

    def drain(self) -> list[WorkItem]:
        """Take every waiting item (to fail them on a hard shutdown)."""
        with self._lock:
            items = [*self._interactive, *self._streams.values(), *self._background]
            self._interactive.clear()
            self._streams.clear()
            self._turns.clear()
            self._turn_of.clear()
            self._background.clear()
            return items

    @property
    def closed(self) -> bool:
        return self._closed

    def depth(self) -> tuple[int, int]:
        """``(interactive, stream)`` items waiting."""
        with self._lock:
            return len(self._interactive), len(self._streams)

    def background_depth(self) -> int:
        """Background items waiting."""
        with self._lock:
            return len(self._background)


def collect_batch(queue: WorkQueue, max_batch: int, max_wait_ms: float) -> list[WorkItem]:
    """Block for the first item, then fill the batch for at most ``max_wait_ms``.

    Returns an empty list only when the queue is closed and empty.
    """
    first = queue.get(timeout=None)
    if first is None:
        return []
    batch = [first]
    queue.fill(batch, max_batch, time.monotonic() + max_wait_ms / 1000.0)
    return batch
