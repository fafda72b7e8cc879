"""Events of every stream (line crossings, zone entries and exits, state changes) in one
bounded log, read by ``GET /events`` (a cursor, long-polled, or server-sent events), by
webhooks (``server/webhooks.py``) and by MQTT (``server/mqtt.py``).

Each event gets an id that grows by one per event. With an :class:`EventStore` (the server
keeps one under its data directory) the log survives restarts and ids carry on where they
stopped (above the ids a run that did not close had reserved: an id is never given twice,
even where its event never reached a full disk); a new log's ids start from the time in
microseconds, so a cursor kept by a client across a restart still points before every new
event (nothing is skipped). So the ids the log holds can have gaps, and it finds them by
bisection, never by arithmetic. ``missed`` counts the events after a cursor that left the
log (``event_log_size``, retention) or never reached its store before they were read.
Webhooks and MQTT keep their cursors in the store too (:meth:`EventLog.saved_cursor`).

Everything here runs on the event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import weakref
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import islice
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
        snapshots_from: events below this id lost their snapshots (deleted since).
        clips_present: the clips to be had (on disk, or being written); None: any named.
        clips_new_from: clips from this id on are of events logged after ``clips_present``
            was read (a long poll's, say): to be had.
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
    snapshots_from: int = 0
    snapshots_lost: frozenset[int] = frozenset()
    """Events above ``snapshots_from`` whose snapshot could not be written (a full disk)."""
    clips_present: frozenset[int] | None = None
    clips_new_from: int = 0

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
        if self.has_clip is not None and has_clip(event, self) != self.has_clip:
            return False
        return self.has_snapshot is None or has_snapshot(event, self) == self.has_snapshot


def has_clip(event: dict[str, Any], wanted: EventFilter) -> bool:
    """Whether ``event`` (as logged) has its clip still: it was made one (its ``clip`` path,
    ``/clips/{id}.mp4``), which is on disk or being written
    (:meth:`streams.clips.ClipIndex.presence`): not pruned, deleted or failed, before a
    restart too (those were known only to the run they happened in)."""
    path = event.get("clip")
    if not isinstance(path, str):
        return False
    try:
        clip_id = int(path.rsplit("/", 1)[-1].removesuffix(".mp4"))
    except ValueError:
        return True
    present = wanted.clips_present
    return present is None or clip_id in present or clip_id >= wanted.clips_new_from


def has_snapshot(event: dict[str, Any], wanted: EventFilter) -> bool:
    """Whether ``event`` (as logged) has its snapshot still: it was made one, and is not
    below ``wanted.snapshots_from`` (:meth:`server.snapshots.SnapshotStore.kept_from`)."""
    event_id = int(event.get("id", -1))
    return (
        "snapshot" in event
        and event_id >= wanted.snapshots_from
        and event_id not in wanted.snapshots_lost
    )


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

    Held in id order in a list (``_ids`` beside it, for bisection), from ``_head`` on: the
    ids are growing but need not be contiguous (events of a write that failed, or ids passed
    over after a run that did not close, are missing from a log loaded from its store).

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
        self._size = size
        self._ids: list[int] = []
        self._events: list[dict[str, Any]] = []
        self._head = 0  # index of the oldest event held; those before left the log
        self._first = first  # id of the first event of this run
        self._next = first  # id the next event gets
        self._waiters: set[asyncio.Future[None]] = set()
        # Earlier runs of ids whose events all left the log, (first, last): ids restart from
        # the clock where retention emptied the store, and ``missed`` counts events, not the
        # gap between two runs.
        self._gone: list[tuple[int, int]] = []
        # Ids of this run (or a gone one) never given, (first, last): passed over at a start
        # after a run that did not close. Not events, so not missed either.
        self._skips: list[tuple[int, int]] = []
        # Above this id the log holds every event given (none missed): a live reader's read
        # counts nothing. Moves up as events leave the log (by its size, or retention).
        self._whole_after = first - 1
        self.closed = False
        self.finished = False
        self.store = store
        # Filtered readers (a webhook's filter): told of each event that leaves the log
        # before they took it that their filter passes over, so their ``missed`` is theirs.
        self._filtered: weakref.WeakSet[LogReader] = weakref.WeakSet()
        if store is not None:
            resumed = store.resume(first)
            kept = resumed.events[-size:]
            self._events = list(kept)
            self._ids = [int(e["id"]) for e in kept]
            self._next = resumed.next_id
            self._first = resumed.first
            self._gone = resumed.gone
            self._skips = resumed.skips
            # Ids from which on every id given is held (the log has it): those of a frame
            # logged since, and of the last run of contiguous ids loaded up to the newest.
            k = len(self._ids) - 1
            if self._ids and self._ids[k] == self.last_id:
                while k > 0 and self._ids[k - 1] == self._ids[k] - 1:
                    k -= 1
                self._whole_after = self._ids[k] - 1
            else:
                self._whole_after = self.last_id

    @property
    def capacity(self) -> int:
        """Events the log keeps (``event_log_size``)."""
        return self._size

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
        return self._ids[self._head] if self._head < len(self._ids) else self._next

    def _compact(self) -> None:
        """Let go of the events that left the log, now and then (amortised: O(1) an event)."""
        if self._head > max(64, self._size // 8):
            del self._ids[: self._head]
            del self._events[: self._head]
            self._head = 0

    def forget_before(self, cutoff: float) -> int:
        """Retention: drop the events captured before ``cutoff`` (Unix seconds), from the
        oldest on, here and in the store; returns how many. A reader behind them is told it
        missed them, as for events past the log's size."""
        dropped = 0
        events = self._events
        while self._head < len(events) and events[self._head]["captured_at"] < cutoff:
            self._left(events[self._head])
            self._head += 1
            dropped += 1
        if dropped:
            self._whole_after = max(self._whole_after, self.oldest_id - 1)
            self._compact()
            if self.store is not None:
                self.store.forget_before(self.oldest_id)
        return dropped

    def watch_unwanted(self, reader: LogReader) -> None:
        """Tell ``reader`` (:meth:`LogReader.note_left`) of each event that leaves the log,
        so that it counts as missed only those its filter takes."""
        self._filtered.add(reader)

    def _left(self, event: dict[str, Any]) -> None:
        for reader in self._filtered:
            reader.note_left(event)

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
            self._ids.append(self._next)
            self._events.append(record)
            logged.append(record)
            self._next += 1
        if logged:
            over = len(self._ids) - self._head - self._size
            if over > 0:
                for gone in self._events[self._head : self._head + over]:
                    self._left(gone)
                self._head += over
                self._whole_after = max(self._whole_after, self._ids[self._head] - 1)
                self._compact()
            if self.store is not None:
                self.store.append(logged)
            self._wake()
        return logged

    def close(self) -> None:
        """The server is shutting down: readers waiting return now, and none waits again
        (long polls, event streams). Sinks (webhooks, MQTT) go on until :meth:`finish`: the
        streams stopping after this still log events (their last state), and senders that
        ended here left those undelivered with their receivers up."""
        self.closed = True
        self._wake()

    def finish(self) -> None:
        """Nothing more will be logged (the streams have stopped): sinks deliver what is left
        and end."""
        self.closed = self.finished = True
        self._wake()

    def _wake(self) -> None:
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()

    def _index(self, event_id: int) -> int | None:
        """Where the log holds ``event_id``, if it does."""
        k = bisect_left(self._ids, event_id, self._head)
        return k if k < len(self._ids) and self._ids[k] == event_id else None

    def get(self, event_id: int) -> dict[str, Any] | None:
        """The event ``event_id`` while the log holds it."""
        k = self._index(event_id)
        return None if k is None else self._events[k]

    def frame_start(self, event_id: int) -> int | None:
        """The id of the first event logged with ``event_id`` from the same frame (a frame's
        events are logged together); None when the log does not hold it."""
        k = self._index(event_id)
        if k is None:
            return None
        event = self._events[k]
        while (
            k > self._head
            and self._ids[k - 1] == self._ids[k] - 1
            and all(
                self._events[k - 1].get(key) == event.get(key)
                for key in ("stream_id", "frame", "captured_at")
            )
        ):
            k -= 1
        return self._ids[k]

    def read(
        self, after: int, limit: int, wanted: EventFilter = EVERY_EVENT, *, to_gap: bool = False
    ) -> EventPage:
        """Up to ``limit`` events with ids above ``after`` that are ``wanted``; ``next`` (never
        below ``after``) is the last id looked at, and ``missed`` counts the events with ids
        in between that the log does not hold (they left it, or never reached it: a failed
        write's, before a restart).

        ``to_gap``: stop before events the log lacks that come after a held one, so
        ``missed`` only counts those before the first event of the page: a reader that reads
        its page again (its delivery failed) from before that event counts them once.
        """
        ids, events = self._ids, self._events
        found: list[dict[str, Any]] = []
        cursor = max(after, self.last_id)  # every event looked at, unless stopped earlier
        before: int | None = None  # the id looked at last
        for k in range(bisect_right(ids, after, self._head), len(ids)):
            event_id = ids[k]
            gap = to_gap and before is not None and event_id != before + 1
            if gap and before is not None and self._given(before, event_id - 1):
                cursor = before
                break
            before = event_id
            if wanted.matches(events[k]):
                found.append(events[k])
                if len(found) >= limit:
                    cursor = event_id
                    break
        else:
            if to_gap and before is not None and self._given(before, self.last_id):
                cursor = before
        return EventPage(found, cursor, self.missed_between(after, cursor))

    def _given(self, after: int, upto: int) -> int:
        """How many ids in ``(after, upto]`` were given to events (held or not): those of
        this run of ids and of earlier runs that left the log whole, less the ids passed
        over."""
        if upto <= after:
            return 0
        n = _overlap(self._first, self.last_id, after, upto)
        for first, last in self._gone:
            n += _overlap(first, last, after, upto)
        for first, last in self._skips:
            n -= _overlap(first, last, after, upto)
        return n

    def missed_between(self, after: int, upto: int) -> int:
        """Events with ids in ``(after, upto]`` that the log does not hold (they left it, by
        its size or retention, or never reached it)."""
        if upto <= after or after >= self._whole_after:
            return 0
        held = bisect_right(self._ids, upto, self._head) - bisect_right(
            self._ids, after, self._head
        )
        return max(0, self._given(after, upto) - held)

    def logged_after(self, after: int) -> int:
        """Events with ids above ``after``, held or missed (not ids passed over)."""
        return max(0, self._given(after, self.last_id))

    def latest(self, limit: int, wanted: EventFilter = EVERY_EVENT) -> EventPage:
        """The newest ``limit`` events that are ``wanted``, oldest first; ``next`` is the
        newest id, to read on from."""
        found: list[dict[str, Any]] = []
        events = self._events
        for k in range(len(events) - 1, self._head - 1, -1):
            if wanted.matches(events[k]):
                found.append(events[k])
                if len(found) >= limit:
                    break
        return EventPage(found[::-1], self.last_id, 0)

    def count_after(self, after: int, wanted: EventFilter) -> int:
        """How many events the log holds with ids above ``after`` that are ``wanted``."""
        start = bisect_right(self._ids, after, self._head)
        return sum(1 for k in range(start, len(self._events)) if wanted.matches(self._events[k]))

    def drop_cursor(self, name: str) -> None:
        """Forget the sink ``name`` (a webhook deleted): its cursor is no longer kept."""
        if self.store is not None:
            self.store.drop_cursor(name)

    def held(self) -> list[dict[str, Any]]:
        """Every event the log holds, oldest first: a copy, which a worker thread may go
        through while the log takes new ones (3 ms for 100 000 events)."""
        return self._events[self._head :]

    @property
    def kept_since(self) -> float | None:
        """When the oldest event the log still holds was captured, where older ones (of this
        run or before a restart) left it; None while it holds every event it ever had."""
        lowest = min([self._first, *(first for first, _ in self._gone)])
        if self.missed_between(lowest - 1, self.last_id) == 0:
            return None
        # Retention may have emptied it: then nothing before now is held.
        return float(self._events[self._head]["captured_at"]) if self.held_count else time.time()

    @property
    def held_count(self) -> int:
        """Events the log holds."""
        return len(self._ids) - self._head

    def has_stream(self, stream_id: str) -> bool:
        """Whether the log holds an event of ``stream_id`` (one since removed, say)."""
        return any(e["stream_id"] == stream_id for e in islice(self._events, self._head, None))

    async def wait(self, after: int, timeout_s: float, *, sink: bool = False) -> bool:
        """Wait up to ``timeout_s`` for an event with an id above ``after``; False on
        timeout or once the log is closed (a ``sink``'s wait: once it is finished)."""
        if self.last_id > after or (self.finished if sink else self.closed):
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


def _overlap(first: int, last: int, after: int, upto: int) -> int:
    """How many ids ``[first, last]`` and ``(after, upto]`` share."""
    return max(0, min(last, upto) - max(first, after + 1) + 1)


class LogReader:
    """A sink's place in the log (a webhook's, an MQTT broker's): kept across restarts where
    the log has a store, and what it missed.

    Args:
        sink: the sink's name in the store (and in logs, unless ``shown``).
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
        shown: str | None = None,
    ) -> None:
        self.sink = sink
        self.shown = shown or sink
        """Its name in log lines: ``sink`` may hold what the log must not (a webhook's URL,
        a Slack hook's secret in its path)."""
        self.log = events
        self.wanted = wanted
        self.cursor = events.saved_cursor(sink)
        self._save_at = 0.0  # when a cursor moved past unwanted events may be saved next
        self.sent = self.missed = 0
        self._count = count
        # The ids of events its filter passes over that left the log above its cursor, as
        # runs [first, last] of consecutive ids: not missed (a filtered webhook's ``missed``
        # counted every other stream's events). A run ends at an event it wants.
        self._passed_over: list[list[int]] = []
        if wanted is not EVERY_EVENT:
            events.watch_unwanted(self)

    def note_left(self, event: dict[str, Any]) -> None:
        """``event`` left the log (by its size or retention)."""
        event_id = int(event["id"])
        if event_id <= self.cursor or self.wanted.matches(event):
            return
        runs = self._passed_over
        if runs and runs[-1][1] == event_id - 1:
            runs[-1][1] = event_id
        else:
            runs.append([event_id, event_id])

    def _passed_over_in(self, after: int, upto: int) -> int:
        """Events its filter passes over that left the log, with ids in ``(after, upto]``."""
        return sum(_overlap(first, last, after, upto) for first, last in self._passed_over)

    def _forget_passed_over(self) -> None:
        """Let go of those at or below its cursor: no read from it counts them."""
        runs = [run for run in self._passed_over if run[1] > self.cursor]
        if runs and runs[0][0] <= self.cursor:
            runs[0] = [self.cursor + 1, runs[0][1]]
        self._passed_over = runs

    @property
    def pending(self) -> int:
        """Events logged and not delivered yet: those it takes (a filtered sink's count
        used to include the events its filter passes over)."""
        if self.wanted is EVERY_EVENT:
            # Counted, not the gap between ids: ids jump to the clock where retention emptied
            # the log between runs (16 million "pending" after a restart).
            return self.log.logged_after(self.cursor)
        return self.log.count_after(self.cursor, self.wanted)

    def next_page(self, limit: int) -> EventPage:
        """Up to ``limit`` events to deliver next; those that left the log first are counted
        (once: the cursor moves past them) and logged. A page ends before events the log
        lacks after its first (ids can have gaps): they are counted as the next page's."""
        page = self.log.read(self.cursor, limit, self.wanted, to_gap=True)
        if page.missed and self._passed_over:
            unwanted = self._passed_over_in(self.cursor, page.next)
            page = dataclasses.replace(page, missed=max(0, page.missed - unwanted))
        if page.missed:
            self.missed += page.missed
            if self._count is not None:
                self._count("missed", page.missed)
            log.warning(
                "%s: %d event(s) left the event log before they could be delivered (setting"
                " STREAMDET_EVENT_LOG_SIZE)",
                self.shown,
                page.missed,
            )
        if page.missed or not page.events:
            moved = page.events[0]["id"] - 1 if page.events else page.next
            if moved != self.cursor and time.monotonic() >= self._save_at:
                # Past events its filter passes over: kept (at most once a second), or after
                # a restart those that left the log meanwhile were counted as missed.
                self._save_at = time.monotonic() + 1.0
                self.log.save_cursor(self.sink, moved)
            self.cursor = moved
            self._forget_passed_over()
        return page

    async def take(self, limit: int, wait_s: float) -> EventPage | None:
        """:meth:`next_page`, waiting up to ``wait_s`` for events when there are none (the
        page is empty then); None once the log is finished and everything was taken."""
        page = self.next_page(limit)
        if page.events or page.missed:
            return page
        if self.log.finished:
            return None
        await self.log.wait(self.cursor, wait_s, sink=True)
        return page

    def delivered(self, through: int, n: int) -> None:
        """Every event up to id ``through`` was delivered, ``n`` of them just now."""
        self.cursor = through
        self._forget_passed_over()
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
