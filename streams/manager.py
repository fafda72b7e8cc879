"""StreamManager: the set of live streams, their persistence, and the fan-out of their
detections to subscribers.

Threads: each stream decodes on its own thread (``StreamReader``), in this process or in a
decode process (:mod:`streams.decode_procs`, a ``RemoteReader`` here); detections arrive on
engine worker threads and are handed to the event loop in bursts (one wake-up for the frames
that arrive before it runs); everything else here (subscribers, the stream table) lives on
the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

from engines.pool import EnginePool
from engines.types import class_name
from streams.clips import CLIP_PATH, ClipIndex, ClipOptions
from streams.decode_child import SLOTS
from streams.decode_procs import DecodeHub
from streams.detect import StreamDetect
from streams.events import EventFilter, EventLog, ManualEvent, StateEvent, StreamEvent
from streams.fanout import WS_GOING_AWAY, WS_NORMAL, ProcessedFrame, StateMessage, Subscriber
from streams.jobs import FrameSource
from streams.outbox import Outbox
from streams.reader import NOT_SHOWING, ReaderOptions, StreamConfig, StreamReader, StreamState
from streams.sources import SourceError, SourceSpec, Transport, parse_source, redact
from streams.store import StreamRecord, StreamStore, new_record

log = logging.getLogger(__name__)

OPENING_WAIT_S = 0.5
"""How long a stream's removal (or new source) waits for a decode thread still opening its
source before it lets it go (see :meth:`StreamManager._let_go`)."""


class StreamLimitError(RuntimeError):
    """No more streams may be added (setting ``STREAMDET_MAX_STREAMS``)."""


class StreamExistsError(RuntimeError):
    """A stream with the id asked for exists already."""


class ManagerClosed(RuntimeError):
    """The server is shutting down."""


@dataclass(frozen=True, slots=True)
class ManagerOptions:
    """Settings the manager needs.

    Attributes:
        reader: per-stream timeouts, backoff and limits.
        allowed_file_dir: the only directory ``file://`` sources may come from.
        ws_queue_size: messages kept per subscriber.
        max_streams: most streams at once.
        stop_timeout_s: how long to wait for a decode thread to exit.
        event_log_size: events kept for ``GET /events`` and webhooks.
        clips: where event clips go and how long they are (``None``: no clips).
        decode_processes: processes that decode streams (0: decode threads in this process);
            streams that decode with NVDEC decode here all the same.
        streams_file: whether a streams file declares streams in this run: without one, a
            stream an earlier run's file declared is the API's (``from_file`` false).
    """

    reader: ReaderOptions
    allowed_file_dir: Path | None
    ws_queue_size: int = 4
    max_streams: int = 64
    stop_timeout_s: float = 10.0
    event_log_size: int = 10_000
    clips: ClipOptions | None = None
    decode_processes: int = 0
    streams_file: bool = False


class StreamChanges(TypedDict, total=False):
    """What ``PATCH /streams/{id}`` may change while a stream runs; absent keys stay."""

    name: str
    max_fps: float | None
    detect: StreamDetect
    enabled: bool


@dataclass(frozen=True, slots=True)
class _Wanted:
    """Every setting of a stream, as :meth:`StreamManager.add` and ``put`` take them."""

    url: str
    name: str = ""
    max_fps: float | None = None
    transport: Transport = "tcp"
    loop: bool = True
    detect: StreamDetect | None = None
    from_file: bool = False
    enabled: bool = True


class _IdLocks:
    """One :class:`asyncio.Lock` per id, kept only while a call holds or waits for it."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, list[int]]] = {}

    @contextlib.asynccontextmanager
    async def __call__(self, key: str) -> AsyncIterator[None]:
        lock, users = self._locks.setdefault(key, (asyncio.Lock(), [0]))
        users[0] += 1
        try:
            async with lock:
                yield
        finally:
            users[0] -= 1
            if not users[0]:
                del self._locks[key]

    def __len__(self) -> int:
        return len(self._locks)


class StreamManager:
    """Adds, removes, persists and reports streams; publishes their processed frames.

    Args:
        pool: the started engine pool frames go to.
        store: where the stream list is kept.
        options: see :class:`ManagerOptions`.
        events: the event log (a new one in memory when not given).
    """

    def __init__(
        self,
        pool: EnginePool,
        store: StreamStore,
        options: ManagerOptions,
        events: EventLog | None = None,
    ) -> None:
        self._pool = pool
        self._store = store
        self._opt = options
        self._records: dict[str, StreamRecord] = {}
        # Calls that add, change or remove a stream run one at a time per id (each awaits the
        # store and stopping decode threads: interleaved, two of them left a reader running
        # that nothing would stop, or GET showing another source than the one decoded).
        self._held = _IdLocks()
        self._creating: set[str] = set()  # ids being added: they count towards the limit
        self._reserved: set[str] = set()  # ids the streams file is adding: so do they
        self._readers: dict[str, StreamReader] = {}
        # Each reader's token: what a reader stopped to reopen its stream (a new source) still
        # hands over (frames in flight, its state) carries the old token and is dropped.
        self._tokens: dict[str, object] = {}
        self._subs: dict[str, set[Subscriber]] = {}
        # Messages (frames) dropped for each stream's viewers that have left; with those of
        # the viewers still attached, GET /streams/{id}'s ``viewer_drops`` and /metrics.
        self._viewer_drops: dict[str, int] = {}
        # Each stream's last state change as sent to viewers (its state, the message), for a
        # viewer asking for them that comes while the stream is down.
        self._last_state: dict[str, tuple[str, StateMessage]] = {}
        self._latest: dict[str, ProcessedFrame] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        # Frames from engine workers waiting for the loop (see _publish_threadsafe).
        self._outbox = Outbox()
        self._closing = False
        self._viewers_gone: asyncio.Event | None = None
        self._bad_detect: set[str] = set()  # streams held back by stored settings
        self.events = events or EventLog(options.event_log_size)
        # Called on the event loop with each frame that had events and those events as
        # logged (e.g. to keep a snapshot of the frame).
        self.event_observers: list[Callable[[ProcessedFrame, list[dict[str, Any]]], None]] = []
        # Called on the event loop with every published frame (keep them cheap).
        self.frame_observers: list[Callable[[ProcessedFrame], None]] = []
        # More members for each event of a frame, from the frame and the event's id.
        self.event_extras: list[Callable[[ProcessedFrame, dict[str, Any]], dict[str, Any]]] = []
        self.clips = None if options.clips is None else ClipIndex(options.clips)
        self._hub: DecodeHub | None = None
        if options.decode_processes > 0:
            # 8 slots a stream: a frame waiting, one in a batch, the latest; frames kept longer
            # (viewers' queues) are copied once half are taken, so more slots would only cost
            # shared memory.
            self._hub = DecodeHub(options.decode_processes, options.reader, SLOTS, options.clips)

    # ---- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        """Re-open every persisted stream."""
        self._loop = asyncio.get_running_loop()
        for record in await asyncio.to_thread(self._store.load):
            if len(self._records) >= self._opt.max_streams:
                # Kept, not opened: a lower limit set since they were added opened them all.
                error = (
                    f"not opened: more streams are stored than the limit {self._opt.max_streams}"
                    " (setting STREAMDET_MAX_STREAMS): raise it, or delete streams"
                )
                log.error("stream %s: %s", record.id, error)
                self._launch(record, None, error=error)
                continue
            try:
                spec = self._spec(record)
            except SourceError as exc:
                # Settings changed since it was added (e.g. the allowed directory): show it.
                log.error("stream %s: cannot re-open %s: %s", record.id, redact(record.url), exc)
                self._launch(record, None, error=str(exc))
                continue
            self._launch(record, spec)
        log.info("streams: re-opened %d persisted stream(s)", len(self._records))

    def going_away(self) -> None:
        """Close every subscriber with 1001 (going away); safe from any thread or a signal
        handler. Called as soon as shutdown begins, before the HTTP server drops sockets."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop has already stopped
            loop.call_soon_threadsafe(self._close_all, WS_GOING_AWAY, "server shutting down")

    def decode_pids(self) -> list[int]:
        """The decode processes' ids (none without ``decode_processes``, or before a stream)."""
        return [] if self._hub is None else self._hub.pids()

    def job_frames(self) -> FrameSource | None:
        """Where video jobs decode: in the decode processes (their hub's
        :meth:`~streams.decode_procs.DecodeHub.job_frames`); None: in the job's own thread."""
        return None if self._hub is None else self._hub.job_frames

    def decode_stats(self) -> tuple[int, int] | None:
        """Decode processes running, and those that died so far; None without them."""
        return None if self._hub is None else self._hub.stats()

    async def stop(self, timeout_s: float) -> None:
        """Stop intake, close subscribers (1001), stop every decode thread."""
        self._closing = True
        self._close_all(WS_GOING_AWAY, "server shutting down")
        readers = list(self._readers.values())
        for reader in readers:
            reader.stop()
        # All at once, and those waiting on their source let go as DELETE lets one go: a
        # camera that accepted the connection and said nothing held the shutdown for its
        # whole open timeout (10 s, Docker's stop grace), and each joined in turn.
        start = time.monotonic()
        end = start + timeout_s
        await _until(lambda: not any(r.alive for r in readers), start + OPENING_WAIT_S, end)
        for reader in readers:
            if reader.alive and reader.waiting_on_source:
                reader.let_go()
                log.info(
                    "stream %s: let go of its decode thread waiting on its source", reader.config.id
                )
        waited = [r for r in readers if r.alive and not r.waiting_on_source]
        await _until(lambda: not any(r.alive for r in waited), end, end)
        for reader in waited:
            if reader.alive:
                log.warning(
                    "stream %s: decode thread still running after %.1f s",
                    reader.config.id,
                    timeout_s,
                )
        self._readers.clear()
        self._latest.clear()
        self._outbox.clear()
        if self._hub is not None:
            await asyncio.to_thread(self._hub.shutdown, 5.0)

    # ---- control API -------------------------------------------------------------------
    async def add(
        self,
        url: str,
        name: str = "",
        max_fps: float | None = None,
        transport: Transport = "tcp",
        loop: bool = True,
        *,
        detect: StreamDetect | None = None,
        stream_id: str | None = None,
        from_file: bool = False,
        enabled: bool = True,
    ) -> dict[str, Any]:
        """Validate, persist and open a stream (with the id ``stream_id``, or a new one);
        returns its description.

        Raises:
            SourceError: malformed or disallowed URL.
            StreamExistsError: a stream with the id ``stream_id`` exists.
            StreamLimitError: already ``max_streams`` streams.
            ManagerClosed: shutting down.
        """
        sid = stream_id or uuid.uuid4().hex[:12]
        wanted = _Wanted(url, name, max_fps, transport, loop, detect, from_file, enabled)
        async with self._held(sid):
            return await self._add(sid, wanted)

    async def _add(self, sid: str, wanted: _Wanted) -> dict[str, Any]:
        if self._closing:
            raise ManagerClosed("server shutting down")
        if sid in self._records:
            raise StreamExistsError(f"a stream with the id {sid!r} exists")
        # What is wrong with the request first: at the limit a bad URL was 409 "already N
        # streams", and fixed only once a stream had been removed for it.
        spec = parse_source(wanted.url, self._opt.allowed_file_dir, wanted.transport, wanted.loop)
        held = self._reserved - self._records.keys() - self._creating - {sid}
        count = len(self._records) + len(self._creating) + len(held)
        if count >= self._opt.max_streams:
            raise StreamLimitError(
                f"already {count} streams, the limit {self._opt.max_streams}"
                " (setting STREAMDET_MAX_STREAMS)"
            )
        record = new_record(
            sid,
            wanted.url,
            name=wanted.name,
            max_fps=wanted.max_fps,
            transport=wanted.transport,
            loop=spec.loop,
            detect=self._encode(wanted.detect or StreamDetect()),
            from_file=wanted.from_file,
            enabled=wanted.enabled,
        )
        self._creating.add(sid)  # counted while the store writes it
        try:
            await asyncio.to_thread(self._store.add, record)
        finally:
            self._creating.discard(sid)
        if self._closing:  # stopped meanwhile: what it stops would not include this one
            await asyncio.to_thread(self._store.remove, sid)
            raise ManagerClosed("server shutting down")
        self._launch(record, spec, added=True)
        log.info("stream %s: added %s", sid, redact(wanted.url))
        return self._describe(record)

    @contextlib.contextmanager
    def reserving(self, ids: Iterable[str]) -> Iterator[None]:
        """Count the streams ``ids`` towards ``max_streams`` while a caller adds them one by
        one (the streams file): another stream added meanwhile cannot take their room."""
        new = set(ids) - self._reserved
        self._reserved |= new
        try:
            yield
        finally:
            self._reserved -= new

    @property
    def max_streams(self) -> int:
        return self._opt.max_streams

    def check_source(self, url: str, transport: Transport, loop: bool) -> None:
        """Raises :class:`SourceError` where :meth:`add` would, for the same source."""
        parse_source(url, self._opt.allowed_file_dir, transport, loop)

    def detect(self, stream_id: str) -> StreamDetect | None:
        """What a stream detects now; None if unknown."""
        reader = self._readers.get(stream_id)
        return None if reader is None else reader.detect

    async def update(
        self,
        stream_id: str,
        changes: StreamChanges | Callable[[StreamDetect], StreamChanges],
    ) -> dict[str, Any] | None:
        """Apply ``changes`` from the stream's next frame on, without reopening its source,
        and persist them; returns its description, None if unknown. A stream that could not
        start because its stored settings no longer fit the model starts now.

        ``changes`` may be made from what the stream detects now, in its turn: calls that
        change one stream at once each build on the one before (two PATCHes built theirs
        from the same settings, and the second undid the first's)."""
        async with self._held(stream_id):
            return await self._update(stream_id, changes)

    async def _update(
        self,
        stream_id: str,
        changes: StreamChanges | Callable[[StreamDetect], StreamChanges],
    ) -> dict[str, Any] | None:
        if self._closing:  # its readers are stopped (an MQTT command during shutdown)
            raise ManagerClosed("server shutting down")
        record = self._records.get(stream_id)
        if record is None:
            return None
        reader = self._readers[stream_id]
        if callable(changes):
            changes = changes(reader.detect)
        detect = changes.get("detect")
        was_enabled = record.enabled
        record = dataclasses.replace(
            record,
            name=changes.get("name", record.name),
            max_fps=changes.get("max_fps", record.max_fps),
            # Stored settings that did not fit the model stay stored until replaced.
            detect=record.detect if detect is None else self._encode(detect),
            enabled=changes.get("enabled", record.enabled),
        )
        await asyncio.to_thread(self._store.update, record)
        self._records[stream_id] = record
        reader.max_fps = record.max_fps
        if detect is not None:
            reader.set_detect(detect)
        # Switched on where it is on but failed (gave up reconnecting, a file that was no
        # video): tried again, as switching it off and on did (it stayed failed).
        revive = changes.get("enabled") is True and reader.state is StreamState.FAILED
        if (
            record.enabled != was_enabled
            or revive
            or (stream_id in self._bad_detect and (detect is not None or "max_fps" in changes))
        ):
            await self._relaunch(record, reader)
        log.info("stream %s: updated %s", stream_id, sorted(changes))
        return self.describe(stream_id)

    async def put(
        self,
        stream_id: str,
        url: str,
        *,
        name: str = "",
        max_fps: float | None = None,
        transport: Transport = "tcp",
        loop: bool = True,
        detect: StreamDetect,
        from_file: bool = False,
        enabled: bool = True,
    ) -> tuple[dict[str, Any], bool]:
        """Give the stream ``stream_id`` every setting anew, or :meth:`add` it where there is
        none, in one step (``PUT /streams/{id}``, the streams file); its description, and
        whether it was added. An existing stream keeps its id, counts and viewers: a new
        source (``url``, ``transport``, ``loop``) is opened in place of the old one;
        otherwise it changes from its next frame, as :meth:`update`.

        Raises:
            SourceError, StreamLimitError, ManagerClosed: as :meth:`add`.
        """
        wanted = _Wanted(url, name, max_fps, transport, loop, detect, from_file, enabled)
        async with self._held(stream_id):
            info = await self._replace(stream_id, wanted)
            if info is not None:
                return info, False
            return await self._add(stream_id, wanted), True

    async def _replace(self, stream_id: str, wanted: _Wanted) -> dict[str, Any] | None:
        if self._closing:
            raise ManagerClosed("server shutting down")
        old = self._records.get(stream_id)
        if old is None:
            return None
        spec = parse_source(wanted.url, self._opt.allowed_file_dir, wanted.transport, wanted.loop)
        detect = wanted.detect or StreamDetect()
        record = dataclasses.replace(
            old,
            url=wanted.url,
            name=wanted.name,
            max_fps=wanted.max_fps,
            transport=wanted.transport,
            loop=spec.loop,
            detect=self._encode(detect),
            from_file=wanted.from_file,
            enabled=wanted.enabled,
        )
        await asyncio.to_thread(self._store.replace, record)
        self._records[stream_id] = record
        reader = self._readers[stream_id]
        same = (record.url, record.transport, record.loop, record.enabled) == (
            old.url,
            old.transport,
            old.loop,
            old.enabled,
        )
        # A failed stream given its settings again (a configuration tool's PUT, the
        # streams file applied again) is tried again; it stayed failed.
        failed = record.enabled and reader.state is StreamState.FAILED
        if same and not failed and stream_id not in self._bad_detect:
            reader.max_fps = record.max_fps
            reader.set_detect(detect)
            return self._describe(record)
        await self._relaunch(record, reader)
        return self.describe(stream_id)

    async def _relaunch(self, record: StreamRecord, old: StreamReader) -> None:
        """Stop ``old`` and start the stream anew as ``record`` says: on its (new) source, or
        disabled (logged as a ``disabled`` state event), going on from ``old``'s counts,
        analytics and frame numbers. The new reader has a new token: frames the old one
        still hands over are not published."""
        was = old.state  # before it stops (a disabled event said "previous": "stopped")
        old.stop()
        if self._pool.queue.discard(record.id) is not None:
            old.count_drop()  # its frame waiting for the engine: never run
        await self._let_go(old, record.id)
        if self._closing:
            return  # the manager is stopping its readers: a new one would run on
        try:
            if not record.enabled:
                self._launch(record, None, carry=old, previous=was)
                return
            try:
                self._launch(record, self._spec(record), carry=old)
            except SourceError as exc:
                self._launch(record, None, error=str(exc), carry=old, previous=was)
        finally:
            # Its last frame shown no more; after the launch, whose lost zone exits (a
            # stream disabled, failed) go to its viewers with it.
            self._latest.pop(record.id, None)
        log.info("stream %s: opened on %s", record.id, redact(record.url))

    async def _let_go(self, reader: StreamReader, stream_id: str) -> None:
        """Wait for a stopped reader's decode thread to exit, up to ``stop_timeout_s``; but
        one waiting on its source, opening it (a camera that accepted the connection and says
        nothing) or reading it (a camera that froze while live), is let go after
        :data:`OPENING_WAIT_S`: FFmpeg's waits cannot be interrupted, and DELETE, a disable
        or a new source waited up to the whole open or read timeout (10 s, 5 s). Its thread
        ends by itself when the wait returns, publishing nothing."""
        if not reader.alive:
            return
        if await asyncio.to_thread(reader.join, min(OPENING_WAIT_S, self._opt.stop_timeout_s)):
            return
        if reader.waiting_on_source:
            reader.let_go()
            log.info(
                "stream %s: let go of its decode thread while it waits on its source; it ends"
                " when FFmpeg's wait returns (within STREAMDET_STREAM_OPEN_TIMEOUT_S opening,"
                " STREAMDET_STREAM_READ_TIMEOUT_S reading)",
                stream_id,
            )
            return
        left = max(0.0, self._opt.stop_timeout_s - OPENING_WAIT_S)
        if not await asyncio.to_thread(reader.join, left):
            log.warning(
                "stream %s: decode thread did not exit within %.1f s",
                stream_id,
                self._opt.stop_timeout_s,
            )

    async def remove(self, stream_id: str) -> bool:
        """Stop a stream, free its decoder, forget it. False if unknown."""
        async with self._held(stream_id):
            return await self._remove(stream_id)

    async def _remove(self, stream_id: str) -> bool:
        if stream_id not in self._records:
            return False
        # From the store first: a removal it refuses (a full disk: 507) changes nothing. It
        # was stopped, told to every sink as removed, and back at the next start.
        await asyncio.to_thread(self._store.remove, stream_id)
        record = self._records.pop(stream_id)
        self._tokens.pop(stream_id, None)
        reader = self._readers.pop(stream_id)
        was = reader.state
        reader.stop()
        self._pool.queue.discard(stream_id)
        # The last word on it, for webhooks, MQTT (which clears its retained topics) and SSE.
        removed = StateEvent(was.value, "removed", None, reader.frame_no)
        at = time.time()
        self._end_stays(stream_id, reader, record.name, at)
        self.events.add(stream_id, record.name, at, [removed], str)
        for sub in self._subs.pop(stream_id, set()):
            sub.close(WS_NORMAL, "stream removed")
        self._viewer_drops.pop(stream_id, None)
        self._last_state.pop(stream_id, None)
        self._latest.pop(stream_id, None)
        await self._let_go(reader, stream_id)
        log.info("stream %s: removed", stream_id)
        return True

    def describe(self, stream_id: str) -> dict[str, Any] | None:
        """``GET /streams/{id}``: the stream, its state and counters."""
        record = self._records.get(stream_id)
        return None if record is None else self._describe(record)

    def _describe(self, record: StreamRecord) -> dict[str, Any]:
        return {
            "id": record.id,
            "name": record.name,
            "url": redact(record.url),
            "max_fps": record.max_fps,
            "transport": record.transport,
            "loop": record.loop,
            "enabled": record.enabled,
            # (the viewer locked an earlier run's, which the API let change)
            "from_file": record.from_file and self._opt.streams_file,
            "created_at": record.created_at,
            "detect": self._readers[record.id].detect.describe(self._pool.engine.names),
            **self._readers[record.id].snapshot(),
            "subscribers": len(self._subs.get(record.id, ())),
            "viewer_drops": self._viewer_drops.get(record.id, 0)
            + sum(sub.dropped for sub in self._subs.get(record.id, ())),
        }

    def name_of(self, stream_id: str) -> str | None:
        """A stream's name (``None``: no such stream)."""
        record = self._records.get(stream_id)
        return None if record is None else record.name

    def roster(self) -> dict[str, tuple[str, bool]]:
        """Every stream's name, and whether it is enabled, by id."""
        return {sid: (record.name, record.enabled) for sid, record in self._records.items()}

    def list(self) -> list[dict[str, Any]]:
        return [d for sid in self._records if (d := self.describe(sid)) is not None]

    async def wait_state(self, stream_id: str, states: set[StreamState], timeout_s: float) -> bool:
        """Wait until a stream reaches one of ``states``; False on timeout or unknown id."""
        reader = self._readers.get(stream_id)
        if reader is None:
            return False
        return await asyncio.to_thread(reader.wait_state, states, timeout_s)

    def threads_alive(self) -> int:
        """Decode threads still running (leak checks)."""
        return sum(1 for r in self._readers.values() if r.alive)

    # ---- subscribers -------------------------------------------------------------------
    def subscribe(self, stream_id: str, options: dict[str, str] | None = None) -> Subscriber | None:
        """A new subscriber of ``stream_id``; ``None`` if the stream is unknown."""
        if stream_id not in self._records or self._closing:
            return None
        sub = Subscriber(stream_id, self._opt.ws_queue_size, options)
        self._subs.setdefault(stream_id, set()).add(sub)
        last = self._last_state.get(stream_id)
        reader = self._readers.get(stream_id)
        if sub.wants_states and last is not None and reader is not None:
            # Down, disabled, failed or played to its end when the viewer came: it is told
            # why no frames come (the change that made it so), where that is still so.
            state, message = last
            if state == reader.state.value and reader.state is not StreamState.LIVE:
                sub.offer(message)
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        subs = self._subs.get(sub.stream_id)
        if subs is not None and sub in subs:  # counted once, and not for a removed stream
            subs.discard(sub)
            self._viewer_drops[sub.stream_id] = (
                self._viewer_drops.get(sub.stream_id, 0) + sub.dropped
            )
        if self._viewers_gone is not None and not self.viewers():
            self._viewers_gone.set()

    def viewers(self) -> int:
        """Subscribers still attached (a viewer leaves once its close frame is sent)."""
        return sum(len(subs) for subs in self._subs.values())

    async def wait_viewers_gone(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) until no viewer is attached; whether none is."""
        if not self.viewers():
            return True
        self._viewers_gone = asyncio.Event()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._viewers_gone.wait(), timeout_s)
        return not self.viewers()

    def latest(self, stream_id: str) -> ProcessedFrame | None:
        """The last published frame of a stream (with its image)."""
        return self._latest.get(stream_id)

    def _close_all(self, code: int, reason: str) -> None:
        self.events.close()  # long polls and event streams (SSE) end too
        for subs in self._subs.values():
            for sub in subs:
                sub.close(code, reason)

    # ---- publication -------------------------------------------------------------------
    def _publish_threadsafe(self, token: object, frame: ProcessedFrame) -> None:
        """Engine worker thread: hand the frame of the reader with ``token`` to the event
        loop. Frames queue in the outbox and the loop is woken once for all that arrive
        before it runs (a batch's worth): a wake-up per frame cost the worker a system call
        and the loop a turn per frame. A loop that falls behind costs a stream its oldest
        waiting frames without events, counted as ``publish_drops`` (:mod:`streams.outbox`):
        each was counted as processed already, so they are not ``drops`` (frames the engine
        never took), and every frame taken in ends in one counter."""
        loop = self._loop
        if loop is None:
            return
        wake, dropped = self._outbox.put(frame, token)
        if dropped is not None and (reader := self._reader_of(*dropped)) is not None:
            reader.count_publish_drop()
        if not wake:
            return
        try:
            loop.call_soon_threadsafe(self._publish_outbox)
        except RuntimeError:  # loop closed: nobody is listening any more; keep no frames
            self._outbox.clear()

    def _publish_outbox(self) -> None:
        for frame, token in self._outbox.take():
            self._publish(frame, token)

    def _state_threadsafe(
        self,
        reader: tuple[str, object],
        previous: StreamState,
        state: StreamState,
        error: str | None,
        frame: int,
    ) -> None:
        """Decode thread: the stream of ``reader`` (its id and token) went live, lost its
        source or failed; logged as an event."""
        event = StateEvent(previous.value, state.value, error, frame)
        loop = self._loop
        if loop is None:
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self._log_state, *reader, event, time.time())

    def _log_state(self, stream_id: str, token: object, event: StateEvent, at: float) -> None:
        record = self._records.get(stream_id)
        if record is None or self._tokens.get(stream_id) is not token:
            return  # removed, or reopened on a new source, meanwhile
        self._state_changed(stream_id, record.name, at, event)

    def _state_changed(self, stream_id: str, name: str, at: float, event: StateEvent) -> None:
        """Log a stream's state change, and send it to the viewers that asked for them: they
        see why its frames stopped, or that they come again. (A removed stream's viewers are
        closed, 1000 "stream removed", instead.)"""
        reader = self._readers.get(stream_id)
        if reader is not None and StreamState(event.state) in NOT_SHOWING:
            self._end_stays(stream_id, reader, name, at)
        for logged in self.events.add(stream_id, name, at, [event], str):
            message = StateMessage(json.dumps(logged, separators=(",", ":")))
            self._last_state[stream_id] = (event.state, message)
            for sub in self._subs.get(stream_id, ()):
                if sub.wants_states:
                    sub.offer(message)

    def _recall_state(self, stream_id: str) -> None:
        """The change that left a stream disabled, from the log, for its viewers: one kept
        disabled across a restart logs none, and its viewers were told nothing (those of one
        disabled in the same run were told why no frames come)."""
        wanted = EventFilter(streams=frozenset({stream_id}), types=frozenset({"stream_state"}))
        found = self.events.latest(1, wanted).events
        if found and found[0].get("state") == StreamState.DISABLED.value:
            message = StateMessage(json.dumps(found[0], separators=(",", ":")))
            self._last_state[stream_id] = (StreamState.DISABLED.value, message)

    def _end_stays(self, stream_id: str, reader: StreamReader, name: str, at: float) -> None:
        """The objects in the zones of a stream that shows nothing now leave them, ``lost``:
        their exits logged (before what stopped it) and counted, and sent to its viewers
        with its last frame again (no frame comes after them: they reached every channel
        but the WebSocket, whose overlays kept the objects in their zones)."""
        name_of = functools.partial(class_name, self._pool.engine.names)
        exits = reader.end_stays(name_of)
        if not exits:
            return
        self.events.add(stream_id, name, at, exits, name_of)
        last = self._latest.get(stream_id)
        if last is not None:
            again = dataclasses.replace(last, events=tuple(exits), _json=None)
            for sub in self._subs.get(stream_id, ()):
                sub.offer(again)

    def _reader_of(self, frame: ProcessedFrame, token: object) -> StreamReader | None:
        """The reader of ``frame`` if it is still the one that read it (``token``); None for
        a stream removed, or reopened on a new source, while the frame was in flight."""
        reader = self._readers.get(frame.stream_id)
        return reader if self._tokens.get(frame.stream_id) is token else None

    def _publish(self, frame: ProcessedFrame, token: object) -> None:
        reader = self._reader_of(frame, token)
        if reader is None:
            return
        frame.latency_ms = (time.monotonic() - frame.decoded_mono) * 1000.0
        reader.record_latency(frame.latency_ms)
        self._latest[frame.stream_id] = frame
        if frame.events:
            self._log_events(
                frame.stream_id,
                frame,
                frame.events,
                at=frame.captured_at,
                name_of=frame.detections.name_of,
                extra=functools.partial(self._event_extra, frame, reader, frame.decoded_mono),
            )
        for watch in self.frame_observers:
            watch(frame)
        for sub in self._subs.get(frame.stream_id, ()):
            sub.offer(frame)

    def _log_events(
        self,
        stream_id: str,
        frame: ProcessedFrame | None,
        events: Sequence[StreamEvent],
        *,
        at: float,
        name_of: Callable[[int], str],
        extra: Callable[[dict[str, Any]], dict[str, Any]],
    ) -> Sequence[dict[str, Any]]:
        """Log events of a stream that happened in ``frame`` (none before its first) and show
        them, with the frame, to the event observers."""
        name = self._records[stream_id].name
        logged = self.events.add(stream_id, name, at, events, name_of, extra=extra)
        if frame is not None:
            for observe in self.event_observers:
                observe(frame, logged)
        return logged

    def _event_extra(
        self,
        frame: ProcessedFrame | None,
        reader: StreamReader,
        at_mono: float,
        event: dict[str, Any],
        *,
        clip: bool = True,
    ) -> dict[str, Any]:
        """More members of ``event`` (as logged so far) in ``frame``: the frame's size and
        its snapshot, and its clip from around ``at_mono`` where the stream keeps clips."""
        extra: dict[str, Any] = {}
        if frame is not None:
            extra.update(width=frame.detections.width, height=frame.detections.height)
            for more in self.event_extras:
                extra.update(more(frame, {**event, **extra}))
        requests = reader.clip_requests
        if clip and self.clips is not None and requests is not None and reader.detect.clips:
            clip_id = self.clips.request(requests, at_mono, int(event["id"]))
            extra["clip"] = CLIP_PATH.format(id=clip_id)
        return extra

    def trigger(
        self, stream_id: str, label: str, data: dict[str, Any] | None = None, *, clip: bool
    ) -> dict[str, Any] | None:
        """Log an event an outside system created on a stream (``POST /streams/{id}/events``)
        at its last processed frame, with that frame's snapshot and, where ``clip`` (the
        stream keeps clips), the video from around now; returns it as logged, None if the
        stream is unknown."""
        if stream_id not in self._records:
            return None
        reader = self._readers[stream_id]
        frame = self._latest.get(stream_id)
        # Without a frame shown now (disabled, failed): at its last frame all the same (it
        # said frame 0, a frame number like any other).
        event = ManualEvent(label, reader.frame_no if frame is None else frame.frame, data)
        extra = functools.partial(
            self._event_extra, frame, reader, time.monotonic(), clip=clip and reader.live
        )
        [logged] = self._log_events(
            stream_id, frame, [event], at=time.time(), name_of=str, extra=extra
        )
        log.info("stream %s: event %d (%s) created", stream_id, logged["id"], label)
        return logged

    # ---- internals ---------------------------------------------------------------------
    def _spec(self, record: StreamRecord) -> SourceSpec:
        transport: Transport = "udp" if record.transport == "udp" else "tcp"
        return parse_source(record.url, self._opt.allowed_file_dir, transport, record.loop)

    def _encode(self, detect: StreamDetect) -> str:
        return json.dumps(detect.describe(self._pool.engine.names))

    def _launch(
        self,
        record: StreamRecord,
        spec: SourceSpec | None,
        error: str = "",
        *,
        carry: StreamReader | None = None,
        added: bool = False,
        previous: StreamState = StreamState.CONNECTING,
    ) -> None:
        """Make and start the stream's reader for ``record`` (failed with ``error`` where
        ``spec`` is None; not started where the stream is disabled), going on from ``carry``
        (:meth:`StreamReader.carry_over`) where given. A stream that fails here, or one
        ``added`` disabled, logs that state change as its decode thread's are logged (no
        channel heard of it: MQTT's state topic kept "live" for a source gone at a
        restart), and so does one disabled here (``carry``: it was running); ``previous``:
        its state before (a relaunched stream's, before it stopped)."""
        placeholder = SourceSpec(record.url, "invalid")
        self._bad_detect.discard(record.id)
        try:
            detect = StreamDetect.from_description(
                json.loads(record.detect), self._pool.engine.names
            )
        except (ValueError, TypeError, AttributeError) as exc:
            # Stored with another model (classes by name): shown, fixed by PATCH /streams/{id}.
            detect, spec = StreamDetect(), None
            error = f"detect settings {record.detect} do not fit this model: {exc}"
            self._bad_detect.add(record.id)
            log.error("stream %s: %s", record.id, error)
        max_fps = record.max_fps
        if not _a_rate(max_fps):
            # Written into the database by hand: the decode thread failed on it at each try.
            wrong = f"max_fps {max_fps!r} stored for it is no frame rate in (0, 1000]; PATCH it"
            error, spec, max_fps = f"{error}; {wrong}" if error else wrong, None, None
            self._bad_detect.add(record.id)
            log.error("stream %s: %s", record.id, error)
        config = StreamConfig(record.id, spec or placeholder, record.name, max_fps, detect)
        token = self._tokens[record.id] = object()
        publish = functools.partial(self._publish_threadsafe, token)
        on_state = functools.partial(self._state_threadsafe, (record.id, token))
        reader: StreamReader
        # NVDEC streams decode here: their frames are on this process's GPU.
        if self._hub is not None and self._opt.reader.decode_device == "cpu":
            reader = self._hub.reader(
                config,
                self._pool.submit_latest,
                publish,
                on_state=on_state,
                on_clip_done=None if self.clips is None else self.clips.done_threadsafe,
            )
        else:
            reader = StreamReader(
                config,
                self._opt.reader,
                self._pool.submit_latest,
                publish,
                on_state=on_state,
                clips=None if self.clips is None else self.clips.recorder(record.id),
            )
        if carry is not None:
            reader.carry_over(carry)
        self._records[record.id] = record
        self._readers[record.id] = reader
        # In the stream's frame numbers, as its other events and frames (frames_in counted
        # every frame the camera sent, those max_fps skipped too). Not at each start of a
        # stream kept disabled, nor for a disabled one given a new source: no change to tell.
        if not record.enabled:
            reader.state = StreamState.DISABLED  # not started: no thread, camera closed
            if (added or carry is not None) and previous is not StreamState.DISABLED:
                disabled = StateEvent(previous.value, reader.state.value, None, reader.frame_no)
                self._state_changed(record.id, record.name, time.time(), disabled)
            elif record.id not in self._last_state:
                self._recall_state(record.id)
            return
        if spec is None:
            reader.state = StreamState.FAILED
            reader.last_error = error
            if previous is not StreamState.FAILED:
                failed = StateEvent(previous.value, reader.state.value, error, reader.frame_no)
                self._state_changed(record.id, record.name, time.time(), failed)
            return
        reader.start()


async def _until(done: Callable[[], bool], at: float, end: float) -> None:
    """Wait until ``done()`` or the earlier of ``at`` and ``end`` (monotonic), looking every
    50 ms."""
    while not done() and time.monotonic() < min(at, end):  # noqa: ASYNC110 - threads' ends
        await asyncio.sleep(0.05)


def _a_rate(max_fps: object) -> bool:
    """Whether a stored ``max_fps`` is one the API could have taken: none, or in (0, 1000]."""
    if max_fps is None:
        return True
    if isinstance(max_fps, bool) or not isinstance(max_fps, int | float):
        return False
    return 0 < max_fps <= 1000
