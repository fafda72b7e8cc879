"""Event clips: a short MP4 of what happened around each event, as Frigate records one per
event, for a notification, an audit or a look at what crossed the line.

A stream with ``clips`` on keeps its last few seconds of *compressed* video (the packets the
camera sent, whole groups of pictures from a keyframe on), costing a copy of each packet and
no decoding or encoding. When an event is logged, :meth:`ClipRecorder.request` reserves a
clip; the stream's decode thread then writes, without re-encoding, from the keyframe at or
before ``pre_s`` seconds ahead of the event to ``post_s`` seconds after it, into
``<directory>/<clip id>.mp4`` (``+faststart``, so a browser plays it as it downloads). An event
that comes while a clip is still being written extends it (up to ``max_s`` seconds) and
shares it, so a car that crosses a line and enters a zone has one clip. A clip id is the id of
the first event in it. The oldest clips are deleted once they weigh more than ``max_bytes``.

Only the video track is kept (no audio). A source lost while a clip is being written ends it
there; a clip that had not begun (no keyframe yet) fails, with the reason.

Threads: :meth:`ClipRecorder.request` runs on the event loop; everything else on the stream's
decode thread. One lock guards what they share. A stream decoded in a decode process
(:mod:`streams.decode_procs`) keeps its recorder there: the server plans its clips with a
:class:`ClipPlanner` (the same decisions, so an event's clip id is known at once) and the
process's recorder takes them with :meth:`ClipRecorder.reserve`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from streams.store import private_dir, write_private

log = logging.getLogger(__name__)

CLIP_PATH = "/clips/{id}.mp4"
MAX_BUFFER_BYTES = 64 * 1024 * 1024
"""Compressed video a stream keeps for pre-roll at most (a camera with very long groups of
pictures keeps less than ``pre_s``)."""

ClipDone = Callable[[int, "Path | None", "str | None"], None]
"""Told ``(clip id, file, None)`` when a clip is written, ``(clip id, None, error)`` when it
failed; on the decode thread."""
Reserve = Callable[[int, float, float, float, int], None]
"""Told ``(clip id, start, end, limit, event id)`` for each event a :class:`ClipPlanner`
gives a clip (see :meth:`ClipRecorder.reserve`)."""
PLAUSIBLE_FPS = (0.1, 120.0)
"""Frame rates a camera may have (0.1: one saving bandwidth, a frame each 10 s); one stated
outside them is taken for none (see :func:`_step`)."""
ENDED_KEPT = 256
"""Ids of the clips a recorder ended that it remembers (a late reservation of one is void)."""
CUT_SHORT = "the server stopped while it was being recorded"
"""Why a clip whose file a crash (or a stop) left half-written is missing, after the restart."""


@dataclass(frozen=True, slots=True)
class ClipOptions:
    """Where clips go and how long they are (from settings).

    Attributes:
        directory: the clips' folder (created when needed).
        pre_s: seconds before the event (rounded back to a keyframe).
        post_s: seconds after the event (after the last event of the clip).
        max_s: events extend a clip up to this long after its first event; later ones
            start a new clip (so a clip lasts at most ``max_s`` plus its pre-roll).
        max_bytes: the oldest clips are deleted beyond this.
    """

    directory: Path
    pre_s: float = 5.0
    post_s: float = 5.0
    max_s: float = 60.0
    max_bytes: int = 2048 * 1024 * 1024

    def path(self, clip_id: int) -> Path:
        return self.directory / f"{clip_id}.mp4"

    def parts(self, clip_id: int) -> tuple[Path, Path]:
        """The clip and its sidecar while they are written (neither listed nor pruned)."""
        return self.directory / f"{clip_id}.mp4.part", self.directory / f"{clip_id}.json.part"


@dataclass(frozen=True, slots=True)
class _Packet:
    mono: float
    data: bytes
    pts: int | None
    dts: int | None
    key: bool


@dataclass(slots=True)
class _Clip:
    id: int
    start: float
    """monotonic time the pre-roll begins at"""
    end: float
    """monotonic time it ends after (moved by later events)"""
    limit: float = 0.0
    """``end`` never moves past this (``max_s`` after its first event)"""
    events: list[int] = field(default_factory=list)
    """ids of the events it shows"""
    output: Any = None
    stream: Any = None
    time_base: Any = None
    times: _Times | None = None
    first_mono: float = 0.0
    """monotonic time of its first packet, and of its last one written"""
    last_mono: float = 0.0


@dataclass(slots=True)
class _Times:
    """Fills the timestamps a camera leaves out (an RTSP source's first packet has none) and
    rebases them to start at 0."""

    step: int
    first: int
    last: int = field(init=False)

    def __post_init__(self) -> None:
        self.last = self.first - self.step

    def of(self, packet: _Packet) -> tuple[int, int]:
        pts = self.last + self.step if packet.pts is None else packet.pts
        dts = pts if packet.dts is None else min(packet.dts, pts)
        self.last = pts
        return pts - self.first, dts - self.first


def _plan(
    latest: _Clip | None,
    at_mono: float,
    event_id: int,
    opt: ClipOptions,
    now: float | None = None,
) -> _Clip:
    """The clip of an event that happened in the frame decoded at ``at_mono``: ``latest``
    (the last one reserved, not ended) extended, where the event comes before its end, else
    a new one (not yet holding the event). ``now``: when the recorder is elsewhere, the clip
    counts as ended once its end has passed (the recorder ends it at the first packet after).

    A new clip's end is capped by its limit too: with ``max_s`` below ``post_s`` a clip
    still lasts at most ``max_s`` after its event, as ``--event-clip-max-s`` promises."""
    if latest is not None and at_mono <= latest.end and (now is None or now <= latest.end):
        latest.end = max(latest.end, min(at_mono + opt.post_s, latest.limit))
        return latest
    limit = at_mono + opt.max_s
    return _Clip(event_id, at_mono - opt.pre_s, min(at_mono + opt.post_s, limit), limit)


class ClipPlanner:
    """The server's side of a recorder in a decode process: makes :meth:`ClipRecorder.request`'s
    decisions and sends each to the recorder (``reserve``).

    Args:
        options: see :class:`ClipOptions`.
        reserve: sends ``(clip id, start, end, limit, event id)`` to the recorder.
    """

    def __init__(self, options: ClipOptions, reserve: Reserve) -> None:
        self.options = options
        self._reserve = reserve
        self._latest: _Clip | None = None
        self._lock = threading.Lock()

    def request(self, at_mono: float, event_id: int, now: float | None = None) -> int:
        """Reserve the clip of an event (see :meth:`ClipRecorder.request`); returns its id.
        ``now``: the time (monotonic) it is asked at."""
        now = time.monotonic() if now is None else now
        with self._lock:
            clip = self._latest = _plan(self._latest, at_mono, event_id, self.options, now)
            planned = (clip.id, clip.start, clip.end, clip.limit)
        self._reserve(*planned, event_id)
        return planned[0]

    def forget(self) -> None:
        """The recorder is gone (its process died): the next event starts a new clip."""
        with self._lock:
            self._latest = None

    def ended(self, clip_id: int) -> None:
        """The recorder ended clip ``clip_id`` (written or failed), maybe before its planned
        end (the source was lost or reopened, a file stream looped, writing failed): the next
        event starts a new clip. Without this the planner would keep extending the ended
        clip, whose recorder drops the plan: the event would name a clip that never shows it
        and that the server waits for forever."""
        with self._lock:
            if self._latest is not None and self._latest.id == clip_id:
                self._latest = None


def _step(stream: Any, packets: list[_Packet]) -> int:
    """One frame's duration in the stream's time base: the packets' own (their median
    timestamp step), else from the stream's stated rate, the packets' arrival or 25 fps.

    A stated rate outside :data:`PLAUSIBLE_FPS` is no frame rate: an RTSP camera that states
    none (no ``a=framerate``, no timing in its SPS) has FFmpeg guess its 90 kHz clock, 90000
    fps, which made a clip beginning with one timed packet (its first frame untimed) show
    that frame for one tick of 90 kHz."""
    known = [p.pts for p in packets if p.pts is not None]
    diffs = sorted(b - a for a, b in itertools.pairwise(known) if b > a)
    if diffs:
        return diffs[len(diffs) // 2]
    gaps = sorted(b.mono - a.mono for a, b in itertools.pairwise(packets))
    arrival = 1 / gaps[len(gaps) // 2] if gaps and gaps[len(gaps) // 2] > 0 else None
    low, high = PLAUSIBLE_FPS
    rate = next(
        (
            float(r)
            for r in (stream.average_rate, stream.guessed_rate, arrival)
            if r and low <= float(r) <= high
        ),
        25.0,
    )
    return max(1, round(1 / (rate * float(stream.time_base))))


class ClipRecorder:
    """The clip buffer and writer of one stream.

    Args:
        stream_id: for logs.
        options: see :class:`ClipOptions`.
        on_done: told when each clip is written or failed.
    """

    def __init__(
        self, stream_id: str, options: ClipOptions, on_done: ClipDone | None = None
    ) -> None:
        self.stream_id = stream_id
        self.options = options
        self._on_done = on_done
        self._lock = threading.Lock()
        self._gops: deque[list[_Packet]] = deque()  # each starts with a keyframe
        self._bytes = 0
        self._source: Any = None  # the input stream the buffer holds packets of
        self._pending: deque[_Clip] = deque()  # requested, not begun
        self._current: _Clip | None = None  # being written
        self._ended: deque[int] = deque(maxlen=ENDED_KEPT)

    # ---- event loop --------------------------------------------------------------------
    def request(self, at_mono: float, event_id: int) -> int:
        """Reserve the clip of an event that happened in the frame decoded at ``at_mono``;
        returns its id (that of an earlier event whose clip this one extends, or
        ``event_id``)."""
        with self._lock:
            latest = self._pending[-1] if self._pending else self._current
            clip = _plan(latest, at_mono, event_id, self.options)
            if clip is not latest:
                self._pending.append(clip)
            clip.events.append(event_id)
            return clip.id

    def reserve(self, clip_id: int, start: float, end: float, limit: float, event_id: int) -> None:
        """Take a :class:`ClipPlanner`'s decision: extend clip ``clip_id`` to ``end`` where it
        is pending or being written, or reserve it. One that has ended already (the planner
        could not know yet) holds the event's frame all the same (it came before the clip's
        end): nothing to do."""
        with self._lock:
            for clip in (self._current, *self._pending):
                if clip is not None and clip.id == clip_id:
                    clip.end = max(clip.end, end)
                    clip.events.append(event_id)
                    return
            if clip_id in self._ended:
                return
            clip = _Clip(clip_id, start, end, limit)
            clip.events.append(event_id)
            self._pending.append(clip)

    # ---- decode thread -----------------------------------------------------------------
    def packet(self, packet: Any, stream: Any, now: float) -> None:
        """Keep one demuxed packet of ``stream`` (decode thread), and write it to the clip
        being made, or begin the next clip."""
        if stream is not self._source:
            if self._source is not None:
                self.source_closed("the source was reopened")
            self._source = stream
        if packet.size == 0:
            return
        kept = _Packet(now, bytes(packet), packet.pts, packet.dts, bool(packet.is_keyframe))
        self._keep(kept, now)
        with self._lock:
            clip = self._current
            if clip is None and self._pending and self._gops:
                clip = self._current = self._pending.popleft()
        if clip is None:
            return
        try:
            if clip.output is None:
                self._begin(clip, stream)
            else:
                self._write(clip, kept)
        except Exception as exc:
            self._finish(clip, f"writing it failed: {type(exc).__name__}: {exc}")
            return
        with self._lock:
            over = now > clip.end
        if over:
            self._finish(clip, None)

    def source_closed(self, reason: str) -> None:
        """The source ended or was lost: end the clip being written there; clips that had
        not begun fail. Decode thread, before the input is closed."""
        with self._lock:
            clip, self._current = self._current, None
            pending = list(self._pending)
            self._pending.clear()
        if clip is not None:
            self._finish(clip, None)
        for waiting in pending:
            self._failed(waiting.id, f"the source was lost before the clip began ({reason})")
        self._gops.clear()
        self._bytes = 0
        self._source = None

    def discard(self) -> None:
        """Clips were turned off: drop the buffer, end what is under way."""
        if self._gops or self._current is not None or self._pending:
            self.source_closed("clips were turned off")

    # ---- internals ---------------------------------------------------------------------
    def _keep(self, packet: _Packet, now: float) -> None:
        if packet.key:
            self._gops.append([packet])
        elif self._gops:
            self._gops[-1].append(packet)
        else:
            return  # nothing decodable before the first keyframe
        self._bytes += len(packet.data)
        horizon = now - self.options.pre_s
        with self._lock:
            begun = self._pending[0].start if self._pending else horizon
        horizon = min(horizon, begun)
        while len(self._gops) > 1 and (
            self._gops[1][0].mono <= horizon or self._bytes > MAX_BUFFER_BYTES
        ):
            self._bytes -= sum(len(p.data) for p in self._gops.popleft())

    def _begin(self, clip: _Clip, stream: Any) -> None:
        """Open the clip's file and write the buffer from the keyframe at or before its
        start."""
        import av

        first = 0
        for i, gop in enumerate(self._gops):
            if gop[0].mono <= clip.start:
                first = i
        packets = [p for gop in list(self._gops)[first:] for p in gop]
        private_dir(self.options.directory)  # clips of people: this user's only (were 0644)
        part = self._part(clip.id)
        write_private(part, b"")  # FFmpeg opens it later, and keeps its mode
        clip.output = av.open(str(part), "w", format="mp4", options={"movflags": "+faststart"})
        clip.stream = clip.output.add_stream_from_template(stream)
        if stream.codec_context.name == "hevc":
            # FFmpeg tags H.265 in MP4 "hev1", which Apple's players and Safari refuse; they
            # play "hvc1" (Frigate's apple_compatibility tags it so too).
            clip.stream.codec_tag = "hvc1"
        step = _step(stream, packets)
        if packets[0].dts is not None:
            first = packets[0].dts
        else:
            known = next(((i, p.pts) for i, p in enumerate(packets) if p.pts is not None), (0, 0))
            first = int(known[1]) - step * known[0]
        clip.times = _Times(step, first)
        clip.time_base = stream.time_base
        clip.first_mono = packets[0].mono
        for kept in packets:
            self._write(clip, kept)

    def _write(self, clip: _Clip, kept: _Packet) -> None:
        import av

        assert clip.times is not None
        out = av.Packet(kept.data)
        out.pts, out.dts = clip.times.of(kept)
        out.is_keyframe = kept.key
        out.time_base = clip.time_base
        out.stream = clip.stream
        clip.output.mux(out)
        clip.last_mono = kept.mono

    def _finish(self, clip: _Clip, error: str | None) -> None:
        with self._lock:
            if self._current is clip:
                self._current = None
            self._ended.append(clip.id)
        part = self._part(clip.id)
        if clip.output is not None:
            try:
                clip.output.close()
            except Exception as exc:
                error = error or f"closing it failed: {type(exc).__name__}: {exc}"
        elif error is None:
            error = "the source sent no keyframe before it ended"
        if error is not None:
            with contextlib.suppress(OSError):
                part.unlink()
            self._failed(clip.id, error)
            return
        path = self.options.path(clip.id)
        try:
            size = self._publish(clip, part, path)
        except Exception as exc:
            # A full disk, an I/O error, something in the way: the clip fails (said so and
            # counted) and leaves nothing behind, rather than stay "being written" forever.
            for leftover in (*self.options.parts(clip.id), path.with_suffix(".json")):
                with contextlib.suppress(OSError):
                    if leftover.is_file():
                        leftover.unlink()
            self._failed(
                clip.id,
                f"saving it as {path} failed: {type(exc).__name__}: {exc} (check the space and"
                " permissions of the data directory, setting STREAMDET_DATA_DIR)",
            )
            return
        log.info("stream %s: clip %d written (%d bytes)", self.stream_id, clip.id, size)
        try:
            self._prune()
        except Exception:  # the clip is written all the same; the next one prunes again
            log.exception("stream %s: pruning clips failed", self.stream_id)
        if self._on_done is not None:
            self._on_done(clip.id, path, None)

    def _publish(self, clip: _Clip, part: Path, path: Path) -> int:
        """Write the sidecar of the closed ``part``, then move ``part`` to ``path`` (listed
        from then on); returns its size."""
        with self._lock:
            events = list(clip.events)
        size = part.stat().st_size
        info = {
            "id": clip.id,
            "stream_id": self.stream_id,
            "started_at": round(time.time() - (time.monotonic() - clip.first_mono), 3),
            "duration_s": round(clip.last_mono - clip.first_mono, 3),
            "bytes": size,
            "events": events,
            "url": CLIP_PATH.format(id=clip.id),
        }
        sidecar_part = self.options.parts(clip.id)[1]
        write_private(sidecar_part, json.dumps(info).encode())
        sidecar_part.replace(path.with_suffix(".json"))
        part.replace(path)  # listed from now on
        return size

    def _failed(self, clip_id: int, error: str) -> None:
        with self._lock:
            self._ended.append(clip_id)
        log.warning("stream %s: no clip %d: %s", self.stream_id, clip_id, error)
        if self._on_done is not None:
            self._on_done(clip_id, None, error)

    def _part(self, clip_id: int) -> Path:
        return self.options.parts(clip_id)[0]

    def _prune(self) -> None:
        prune_clips(self.options.directory, self.options.max_bytes)


def prune_clips(directory: Path, max_bytes: int) -> int:
    """Delete the oldest clips (lowest ids) until those left weigh at most ``max_bytes``;
    returns what they weigh."""
    clips: list[tuple[int, Path, int]] = []
    for path in directory.glob("*.mp4"):
        with contextlib.suppress(ValueError, OSError):
            clips.append((int(path.stem), path, path.stat().st_size))
    clips.sort()
    total = sum(size for _, _, size in clips)
    for clip_id, path, size in clips:
        if total <= max_bytes:
            break
        with contextlib.suppress(OSError):  # another stream's thread got there first
            delete_clip(path)
            log.info(
                "clip %d deleted: clips over %d bytes (setting STREAMDET_EVENT_CLIPS_MAX_MB)",
                clip_id,
                max_bytes,
            )
        total -= size
    return total


def forget_clips(
    directory: Path,
    before: int,
    keep: frozenset[int],
    *,
    cutoff: float | None = None,
    dated_before: int = 0,
) -> int:
    """Delete the clips with ids below ``before``, and with ``cutoff`` (Unix seconds) those
    with ids below ``dated_before`` whose file was last written before it, except ``keep``;
    returns how many.

    Retention knows the age of a clip's first event only while the event log holds it (or
    has just dropped it for its age); one that left the log by its size may be minutes old,
    so its clip goes by the file's age: a clip's file is last written after its last event
    (``post_s`` later), so it is never older than its events."""
    gone = 0
    for path in directory.glob("*.mp4"):
        with contextlib.suppress(ValueError, OSError):
            clip_id = int(path.stem)
            if clip_id in keep:
                continue
            if clip_id < before or (
                cutoff is not None and clip_id < dated_before and path.stat().st_mtime < cutoff
            ):
                delete_clip(path)
                gone += 1
    return gone


def remove_parts(directory: Path) -> int:
    """Delete the ``*.part`` files in ``directory`` (files being written when a server
    stopped, or crashed); returns how many. Only at startup: no file is being written then."""
    gone = 0
    for part in directory.glob("*.part"):
        with contextlib.suppress(OSError):
            if part.is_file():
                part.unlink()
                gone += 1
    return gone


def recover_clips(directory: Path) -> tuple[list[int], int]:
    """Tidy what a crash left in the clips' ``directory`` (at startup: nothing is being
    written): a clip saved but for its last rename (its sidecar written, its ``.mp4.part``
    closed at the size the sidecar says) is put in place; every other ``<id>.mp4.part`` is
    deleted, and a sidecar without its clip (a crash between the two) too. Returns the ids
    of the clips cut short and how many sidecars were deleted."""
    cut: list[int] = []
    for part in directory.glob("*.mp4.part"):
        with contextlib.suppress(ValueError, OSError):
            clip_id = int(part.name.removesuffix(".mp4.part"))
            sidecar = directory / f"{clip_id}.json"
            try:
                info = json.loads(sidecar.read_text())
                whole = isinstance(info, dict) and info.get("bytes") == part.stat().st_size
            except (OSError, ValueError):
                whole = False
            if whole:
                part.replace(directory / f"{clip_id}.mp4")
                log.info("clip %d: saved but for its name when the server stopped: kept", clip_id)
            else:
                part.unlink()
                cut.append(clip_id)
    orphans = 0
    for sidecar in directory.glob("*.json"):
        with contextlib.suppress(ValueError, OSError):
            clip_id = int(sidecar.stem)
            if not (directory / f"{clip_id}.mp4").exists():
                sidecar.unlink()
                orphans += 1
    return sorted(cut), orphans


def delete_clip(path: Path) -> None:
    """Delete a clip and what is known of it.

    Raises:
        FileNotFoundError: there is no such clip.
    """
    path.unlink()
    path.with_suffix(".json").unlink(missing_ok=True)


def _clip_ids(directory: Path) -> list[int]:
    """The ids of the clips on disk (``<id>.mp4``), in no order."""
    ids = []
    for path in directory.glob("*.mp4"):
        with contextlib.suppress(ValueError):
            ids.append(int(path.stem))
    return ids


_DAMAGED_SAID: set[Path] = set()


def _damaged(path: Path, why: str) -> None:
    """Say once that the clip of the description at ``path`` is not listed, and why."""
    if path not in _DAMAGED_SAID and len(_DAMAGED_SAID) < 4096:
        _DAMAGED_SAID.add(path)
        log.warning("clips: %s: %s; its clip is not listed (its video is kept)", path, why)


def list_clips(directory: Path, stream_id: str | None, limit: int) -> list[dict[str, Any]]:
    """The newest ``limit`` clips (of ``stream_id``, or of every stream), newest first."""
    found: list[dict[str, Any]] = []
    for clip_id in sorted(_clip_ids(directory), reverse=True):
        path = directory / f"{clip_id}.json"
        try:
            info = json.loads(path.read_text())
        except FileNotFoundError:
            continue  # deleted meanwhile
        except (OSError, ValueError) as exc:
            _damaged(path, str(exc))
            continue
        if not isinstance(info, dict) or not isinstance(info.get("stream_id"), str):
            _damaged(path, "not a clip's description")  # a [1, 2] was listed as a clip
            continue
        if stream_id is None or info.get("stream_id") == stream_id:
            found.append(info)
            if len(found) >= limit:
                break
    return found


class ClipIndex:
    """The clips of every stream, as ``GET /clips/{id}.mp4`` finds them: those being written
    (to wait for) and those that failed (to say why). Event loop, except
    :meth:`done_threadsafe`.

    Args:
        options: see :class:`ClipOptions`.
        on_outcome: told ``made`` or ``failed`` for each clip (metrics).
    """

    FAILURES_KEPT = 1024
    ENDED_REMEMBERED = 1024

    def __init__(
        self, options: ClipOptions, on_outcome: Callable[[str], None] | None = None
    ) -> None:
        self.options = options
        self.on_outcome = on_outcome
        self._writing: dict[int, asyncio.Future[None]] = {}
        self._failed: OrderedDict[int, str] = OrderedDict()
        self._deleted: OrderedDict[int, None] = OrderedDict()  # by DELETE, last ones
        self._ended: OrderedDict[int, None] = OrderedDict()  # written or failed, newest last
        self._loop: asyncio.AbstractEventLoop | None = None
        # Made once, at startup (before any stream records): a clip left half-written by a
        # crash is no clip (nothing lists or prunes a .part), and a lower
        # --event-clips-max-mb than the last run's applies now, not at the next clip.
        if options.directory.is_dir():
            cut, orphans = recover_clips(options.directory)
            for clip_id in cut:  # GET /clips/{id}.mp4 says so rather than blame the size cap
                self._failed[clip_id] = CUT_SHORT
            while len(self._failed) > self.FAILURES_KEPT:
                self._failed.popitem(last=False)
            stale = remove_parts(options.directory)  # the sidecars' parts
            if cut or stale or orphans:
                log.info(
                    "deleted %d unfinished clip(s) (%s), %d other unfinished file(s) and %d"
                    " description(s) of missing clips, of an earlier run",
                    len(cut),
                    ", ".join(map(str, cut[:10])) + (", ..." if len(cut) > 10 else ""),
                    stale,
                    orphans,
                )
            prune_clips(options.directory, options.max_bytes)

    def recorder(self, stream_id: str) -> ClipRecorder:
        """A new stream's recorder, reporting here."""
        return ClipRecorder(stream_id, self.options, self.done_threadsafe)

    def request(self, recorder: ClipRecorder | ClipPlanner, at_mono: float, event_id: int) -> int:
        """Reserve the clip of an event (see :meth:`ClipRecorder.request`); returns its id."""
        self._loop = asyncio.get_running_loop()
        clip_id = recorder.request(at_mono, event_id)
        if clip_id in self._ended and isinstance(recorder, ClipPlanner):
            # The planner had not heard yet that the clip ended: the event starts its own.
            # (Waiting on the ended one would wait forever: no recorder finishes it again.)
            recorder.ended(clip_id)
            clip_id = recorder.request(at_mono, event_id)
        if clip_id not in self._writing and clip_id not in self._ended:
            self._writing[clip_id] = self._loop.create_future()
        return clip_id

    def done_threadsafe(self, clip_id: int, path: Path | None, error: str | None) -> None:
        """A recorder wrote a clip or gave up on it (decode thread)."""
        loop = self._loop
        if loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is gone: the server stopped
            loop.call_soon_threadsafe(self._done, clip_id, error)

    def _done(self, clip_id: int, error: str | None) -> None:
        waiting = self._writing.pop(clip_id, None)
        if waiting is not None and not waiting.done():
            waiting.set_result(None)
        self._ended[clip_id] = None
        while len(self._ended) > self.ENDED_REMEMBERED:
            self._ended.popitem(last=False)
        if error is not None:
            self._failed[clip_id] = error
            while len(self._failed) > self.FAILURES_KEPT:
                self._failed.popitem(last=False)
        if self.on_outcome is not None:
            self.on_outcome("made" if error is None else "failed")

    def writing(self, clip_id: int) -> bool:
        return clip_id in self._writing

    async def presence(self) -> frozenset[int]:
        """The clips still to be had: on disk, or being written (and those of events logged
        since: see :class:`streams.events.EventFilter`). An event still names a clip that
        went (pruned, deleted, failed): it answered 404, and ``has_clip`` passed it."""
        on_disk = await asyncio.to_thread(_clip_ids, self.options.directory)
        return frozenset(on_disk) | frozenset(self._writing)

    async def listing(self, stream_id: str | None, limit: int) -> list[dict[str, Any]]:
        """See :func:`list_clips` (read in a worker thread)."""
        return await asyncio.to_thread(list_clips, self.options.directory, stream_id, limit)

    async def forget_before(
        self, event_id: int, *, cutoff: float | None = None, dated_before: int = 0
    ) -> int:
        """Retention: delete the clips whose first event has an id below ``event_id``, and
        with ``cutoff`` those below ``dated_before`` whose file is older than it (see
        :func:`forget_clips`), but not one being written; returns how many."""
        writing = frozenset(self._writing)
        return await asyncio.to_thread(
            functools.partial(
                forget_clips,
                self.options.directory,
                event_id,
                writing,
                cutoff=cutoff,
                dated_before=dated_before,
            )
        )

    async def delete(self, clip_id: int) -> str | None:
        """Delete a clip; why it cannot be, or None once it is gone."""
        if clip_id in self._writing:
            return f"clip {clip_id} is being written; delete it once it is done"
        try:
            await asyncio.to_thread(delete_clip, self.options.path(clip_id))
        except FileNotFoundError:
            return f"no clip {clip_id}"
        self._deleted[clip_id] = None
        while len(self._deleted) > self.FAILURES_KEPT:
            self._deleted.popitem(last=False)
        return None

    async def find(self, clip_id: int, wait_s: float) -> Path | str:
        """The file of clip ``clip_id``, waiting up to ``wait_s`` for one being written;
        otherwise why there is none."""
        waiting = self._writing.get(clip_id)
        if waiting is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(waiting), wait_s)
            if not waiting.done():
                return f"clip {clip_id} is still being written (events keep extending it)"
        path = self.options.path(clip_id)
        if path.is_file():
            return path
        if clip_id in self._failed:
            return f"clip {clip_id} could not be made: {self._failed[clip_id]}"
        if clip_id in self._deleted:  # it blamed the size limit
            return f"no clip {clip_id}: it was deleted (DELETE /clips/{clip_id}.mp4)"
        return (
            f"no clip {clip_id}: unknown, or deleted to keep clips under"
            f" {self.options.max_bytes // (1024 * 1024)} MB (setting"
            " STREAMDET_EVENT_CLIPS_MAX_MB), by a DELETE or for its age before the server last"
            " started, or not made then (its log says why)"
        )
