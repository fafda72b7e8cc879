"""Events of every stream (line crossings, zone entries and exits, state changes) in one
bounded log, read by ``GET /events`` (a cursor, long-polled, or server-sent events), by
webhooks (``server/webhooks.py``) and by MQTT (``server/mqtt.py``).

Each event gets an id that grows by one per event. With an :class:`EventStore` (the server
keeps one under its data directory) the log survives restarts and ids carry on where they
stopped; a new log's ids start from the time in microseconds, so a cursor kept by a client
across a restart still points before every new event (nothing is skipped). ``missed``
counts the events after a cursor that left the log (``event_log_size``) before they were read.
Webhooks and MQTT keep their cursors in the store too (:meth:`EventLog.saved_cursor`).

Everything here runs on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from streams.event_store import EventStore
from streams.lines import Crossing
from streams.zones import ZoneEvent

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StateEvent:
    """A stream went live, lost its source (``reconnecting``), ``failed`` or was ``removed``,
    after its decoded frame number ``frame``; ``error`` says why it lost its source."""

    previous: str
    state: str
    error: str | None
    frame: int

    def to_json(self, name_of: Callable[[int], str]) -> dict[str, Any]:
        """The event as ``GET /events``, webhooks and MQTT send it."""
        return {
            "type": "stream_state",
            "state": self.state,
            "previous": self.previous,
            "error": self.error,
            "frame": self.frame,
        }


@dataclass(frozen=True, slots=True)
class ManualEvent:
    """An event an outside system created on a stream (``POST /streams/{id}/events``: a
    doorbell pressed, an alarm raised), at the stream's last processed frame ``frame``, with
    its own ``label`` and optional ``data``."""

    label: str
    frame: int
    data: dict[str, Any] | None = None

    def to_json(self, name_of: Callable[[int], str]) -> dict[str, Any]:
        """The event as ``GET /events``, webhooks and MQTT send it."""
        body: dict[str, Any] = {"type": "manual", "label": self.label, "frame": self.frame}
        if self.data is not None:
            body["data"] = self.data
        return body


StreamEvent = Crossing | ZoneEvent | StateEvent | ManualEvent
EVENT_TYPES = frozenset(
    {"line_crossing", "zone_enter", "zone_exit", "zone_loiter", "stream_state", "manual"}
)


@dataclass(frozen=True, slots=True)
class EventFilter:
    """Which events a reader wants; each criterion given narrows it (None: any).

    Attributes:
        streams: stream ids.
        types: event types (:data:`EVENT_TYPES`).
        classes: class names of the object (events without one, a stream's state or a
            manual event, never match).
        zones: zone names (entries, exits, loiters there).
        lines: line names (crossings of them). With ``zones`` too, an event of either passes.
        since: ``captured_at`` at or after this (Unix seconds).
        until: ``captured_at`` before this.
        has_clip: whether the event has a video clip.
        has_snapshot: whether the event has a snapshot.
    """

    streams: frozenset[str] | None = None
    types: frozenset[str] | None = None
    classes: frozenset[str] | None = None
    zones: frozenset[str] | None = None
    lines: frozenset[str] | None = None
    since: float | None = None
    until: float | None = None
    has_clip: bool | None = None
    has_snapshot: bool | None = None

    def matches(self, event: dict[str, Any]) -> bool:
        """Whether ``event`` (as logged) passes every criterion given."""
        if self.streams is not None and event["stream_id"] not in self.streams:
            return False
        if self.types is not None and event["type"] not in self.types:
            return False
        if self.classes is not None and event.get("class_name") not in self.classes:
            return False
        if (self.zones is not None or self.lines is not None) and not (
            (self.zones is not None and event.get("zone") in self.zones)
            or (self.lines is not None and event.get("line") in self.lines)
        ):
            return False
        at = event["captured_at"]
        if (self.since is not None and at < self.since) or (
            self.until is not None and at >= self.until
        ):
            return False
        if self.has_clip is not None and ("clip" in event) != self.has_clip:
            return False
        return self.has_snapshot is None or ("snapshot" in event) == self.has_snapshot


EVERY_EVENT = EventFilter()


@dataclass(frozen=True, slots=True)
class EventPage:
    """One read of the log.

    Attributes:
        events: up to ``limit`` events after the cursor that pass the filters, oldest first.
        next: the cursor to read on from (the last event looked at, matching or not).
        missed: events after the cursor that left the log before this read.
    """

    events: list[dict[str, Any]]
    next: int
    missed: int


class EventLog:
    """The last ``size`` events of every stream.

    Raises:
        ValueError: ``size`` < 1 (names the setting).
    """

    def __init__(
        self, size: int, start_id: int | None = None, store: EventStore | None = None
    ) -> None:
        if size < 1:
            raise ValueError(
                "the event log keeps at least 1 event (setting STREAMDET_EVENT_LOG_SIZE)"
            )
        first = int(time.time() * 1_000_000) if start_id is None else start_id
        self._events: deque[dict[str, Any]] = deque(maxlen=size)
        self._first = first  # id of the first event of this run
        self._next = first  # id the next event gets
        self._waiters: set[asyncio.Future[None]] = set()
        # Earlier runs of ids whose events all left the log, (first, last): ids restart from
        # the clock where retention emptied the store, and ``missed`` counts events, not the
        # gap between two runs.
        self._gone: list[tuple[int, int]] = []
        self.closed = False
        self.store = store
        if store is not None:
            kept, first_ever = store.load()
            if kept:  # carry on from the last run
                self._events.extend(kept[-size:])
                self._next = int(kept[-1]["id"]) + 1
                self._first = int(kept[0]["id"]) if first_ever is None else first_ever
            self._gone = [(a, b) for a, b in store.gone_runs() if b < self._first]

    @property
    def capacity(self) -> int:
        """Events the log keeps (``event_log_size``)."""
        return self._events.maxlen or 0

    def saved_cursor(self, name: str) -> int:
        """Where the sink ``name`` had delivered up to before a restart; a new sink starts
        with the events to come, and from now on, even if it delivers nothing before a
        restart."""
        saved = None if self.store is None else self.store.cursor(name)
        if saved is None:
            self.save_cursor(name, self.last_id)
            return self.last_id
        return min(saved, self.last_id)

    def save_cursor(self, name: str, cursor: int) -> None:
        """The sink ``name`` delivered every event up to ``cursor``."""
        if self.store is not None:
            self.store.save_cursor(name, cursor)

    @property
    def oldest_id(self) -> int:
        """The id of the oldest event the log holds (the next id when it holds none)."""
        return self._next - len(self._events)

    def forget_before(self, cutoff: float) -> int:
        """Retention: drop the events captured before ``cutoff`` (Unix seconds), from the
        oldest on, here and in the store; returns how many. A reader behind them is told it
        missed them, as for events past the log's size."""
        dropped = 0
        while self._events and self._events[0]["captured_at"] < cutoff:
            self._events.popleft()
            dropped += 1
        if dropped and self.store is not None:
            self.store.forget_before(self.oldest_id)
        return dropped

    @property
    def last_id(self) -> int:
        """The id of the newest event (``first - 1`` before any)."""
        return self._next - 1

    def add(
        self,
        stream_id: str,
        stream_name: str,
        captured_at: float,
        events: Sequence[StreamEvent],
        name_of: Callable[[int], str],
        *,
        extra: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    ) -> list[dict[str, Any]]:
        """Log one frame's ``events`` and wake the readers waiting for new ones; returns them
        as logged. ``extra`` gives more members for an event from its record (with its
        ``id``)."""
        logged: list[dict[str, Any]] = []
        for event in events:
            record = {
                "id": self._next,
                "stream_id": stream_id,
                "stream_name": stream_name,
                "captured_at": round(captured_at, 6),
                **event.to_json(name_of),
            }
            if extra is not None:
                record.update(extra(record))
            self._events.append(record)
            logged.append(record)
            self._next += 1
        if logged:
            if self.store is not None:
                self.store.append(logged)
            self._wake()
        return logged

    def close(self) -> None:
        """The server is shutting down: readers waiting return now, and none waits again."""
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()

    def get(self, event_id: int) -> dict[str, Any] | None:
        """The event ``event_id`` while the log holds it."""
        index = event_id - (self._next - len(self._events))
        return self._events[index] if 0 <= index < len(self._events) else None

    def frame_start(self, event_id: int) -> int | None:
        """The id of the first event logged with ``event_id`` from the same frame (a frame's
        events are logged together); None when the log does not hold it."""
        event = self.get(event_id)
        if event is None:
            return None
        first = event_id
        while (before := self.get(first - 1)) is not None and all(
            before.get(key) == event.get(key) for key in ("stream_id", "frame", "captured_at")
        ):
            first -= 1
        return first

    def read(self, after: int, limit: int, wanted: EventFilter = EVERY_EVENT) -> EventPage:
        """Up to ``limit`` events with ids above ``after`` that are ``wanted``."""
        oldest = self._next - len(self._events)
        missed = self._missed(after, oldest)
        start = max(0, after + 1 - oldest)
        found: list[dict[str, Any]] = []
        cursor = max(after, oldest - 1)
        for k in range(start, len(self._events)):
            event = self._events[k]
            cursor = event["id"]
            if wanted.matches(event):
                found.append(event)
                if len(found) >= limit:
                    break
        return EventPage(found, cursor, missed)

    def _missed(self, after: int, oldest: int) -> int:
        """Events with ids above ``after`` that left the log (which now starts at ``oldest``):
        those of this run of ids, and of earlier runs that left it whole."""
        missed = max(0, oldest - max(after + 1, self._first))
        for first, last in self._gone:
            missed += max(0, last + 1 - max(after + 1, first))
        return missed

    def latest(self, limit: int, wanted: EventFilter = EVERY_EVENT) -> EventPage:
        """The newest ``limit`` events that are ``wanted``, oldest first; ``next`` is the
        newest id, to read on from."""
        found: list[dict[str, Any]] = []
        for event in reversed(self._events):
            if wanted.matches(event):
                found.append(event)
                if len(found) >= limit:
                    break
        return EventPage(found[::-1], self.last_id, 0)

    def count_after(self, after: int, wanted: EventFilter) -> int:
        """How many events the log holds with ids above ``after`` that are ``wanted``."""
        n = 0
        for event in reversed(self._events):
            if int(event["id"]) <= after:
                break
            n += wanted.matches(event)
        return n

    def drop_cursor(self, name: str) -> None:
        """Forget the sink ``name`` (a webhook deleted): its cursor is no longer kept."""
        if self.store is not None:
            self.store.drop_cursor(name)

    def held(self) -> list[dict[str, Any]]:
        """Every event the log holds, oldest first: a copy, which a worker thread may go
        through while the log takes new ones (3 ms for 100 000 events)."""
        return list(self._events)

    @property
    def kept_since(self) -> float | None:
        """When the oldest event the log still holds was captured, where older ones (of this
        run or before a restart) left it; None while it holds every event it ever had."""
        oldest = self._next - len(self._events)
        if oldest <= self._first and not self._gone:
            return None
        # Retention may have emptied it: then nothing before now is held.
        return float(self._events[0]["captured_at"]) if self._events else time.time()

    def has_stream(self, stream_id: str) -> bool:
        """Whether the log holds an event of ``stream_id`` (one since removed, say)."""
        return any(event["stream_id"] == stream_id for event in self._events)

    async def wait(self, after: int, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for an event with an id above ``after``; False on
        timeout or once the log is closed."""
        if self.last_id > after or self.closed:
            return self.last_id > after
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.add(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), timeout_s)
        except TimeoutError:
            return self.last_id > after
        finally:
            self._waiters.discard(waiter)
        return self.last_id > after


class LogReader:
    """A sink's place in the log (a webhook's, an MQTT broker's): kept across restarts where
    the log has a store, and what it missed.

    Args:
        sink: the sink's name, in logs and the store.
        events: the log.
        count: told ``("sent", n)`` when the sink delivered ``n`` events and ``("missed",
            n)`` when ``n`` left the log before it could take them (e.g. a metric).
        wanted: the events it takes (the others are passed over).
    """

    def __init__(
        self,
        sink: str,
        events: EventLog,
        count: Callable[[str, int], None] | None = None,
        wanted: EventFilter = EVERY_EVENT,
    ) -> None:
        self.sink = sink
        self.log = events
        self.wanted = wanted
        self.cursor = events.saved_cursor(sink)
        self.sent = self.missed = 0
        self._count = count

    @property
    def pending(self) -> int:
        """Events logged and not delivered yet: those it takes (a filtered sink's count
        used to include the events its filter passes over)."""
        if self.wanted is EVERY_EVENT:
            # Counted, not the gap between ids: ids jump to the clock where retention emptied
            # the log between runs (16 million "pending" after a restart).
            oldest = self.log.oldest_id
            held = self.log.last_id - max(self.cursor, oldest - 1)
            return max(0, held) + self.log._missed(self.cursor, oldest)
        return self.log.count_after(self.cursor, self.wanted)

    def next_page(self, limit: int) -> EventPage:
        """Up to ``limit`` events to deliver next; those that left the log first are counted
        (once: the cursor moves past them) and logged."""
        page = self.log.read(self.cursor, limit, self.wanted)
        if page.missed:
            self.missed += page.missed
            if self._count is not None:
                self._count("missed", page.missed)
            log.warning(
                "%s: %d event(s) left the event log before they could be delivered (setting"
                " STREAMDET_EVENT_LOG_SIZE)",
                self.sink,
                page.missed,
            )
        if page.missed or not page.events:
            self.cursor = page.events[0]["id"] - 1 if page.events else page.next
        return page

    async def take(self, limit: int, wait_s: float) -> EventPage | None:
        """:meth:`next_page`, waiting up to ``wait_s`` for events when there are none (the
        page is empty then); None once the log is closed and everything was taken."""
        page = self.next_page(limit)
        if page.events or page.missed:
            return page
        if self.log.closed:
            return None
        await self.log.wait(self.cursor, wait_s)
        return page

    def delivered(self, through: int, n: int) -> None:
        """Every event up to id ``through`` was delivered, ``n`` of them just now."""
        self.cursor = through
        self.sent += n
        self.log.save_cursor(self.sink, through)
        if self._count is not None and n:
            self._count("sent", n)


COUNT_KEYS = ("stream_id", "type", "class_name", "zone", "line", "direction", "label")
"""What :func:`count_events` can count by."""


def count_events(
    events: Iterable[dict[str, Any]], by: Sequence[str], interval_s: float | None
) -> list[dict[str, Any]]:
    """How many ``events`` there are of each combination of the ``by`` members (from
    :data:`COUNT_KEYS`; an event without one counts under None), per ``interval_s`` of
    capture time (buckets aligned to multiples of it since the Unix epoch, so 3600 gives
    hours and 86400 UTC days; None: one total). Rows ``{"start", "end", *by, "count"}``
    ordered by time, then by the ``by`` members; ``start`` and ``end`` are None without an
    interval."""
    counts: dict[tuple[float | None, tuple[Any, ...]], int] = {}
    for event in events:
        start = None
        if interval_s is not None:
            start = (event["captured_at"] // interval_s) * interval_s
        key = (start, tuple(event.get(member) for member in by))
        counts[key] = counts.get(key, 0) + 1
    rows = []
    for (start, values), n in sorted(counts.items(), key=lambda item: _order(item[0])):
        end = None if start is None or interval_s is None else start + interval_s
        rows.append({"start": start, "end": end, **dict(zip(by, values, strict=True)), "count": n})
    return rows


def _order(key: tuple[float | None, tuple[Any, ...]]) -> tuple[Any, ...]:
    """Rows' order: by time, then by each member, None first, numbers and text apart."""
    start, values = key
    return (start or 0.0, *((v is not None, str(v)) for v in values))
