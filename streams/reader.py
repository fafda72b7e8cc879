"""One stream: a decode thread that opens the source, decodes, paces and hands frames to the
engine pool, and reconnects with backoff when the source fails.

A stream never holds more than one frame waiting for inference: frames go to the pool's
per-stream latest-frame lane (``submit_latest``), where a newer frame replaces a waiting
one and the replaced frame is counted as a drop. So a stream that is faster than the
engines loses frames, never gains latency, and never blocks another stream.
"""

from __future__ import annotations

import dataclasses
import enum
import errno
import functools
import logging
import random
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from engines.batching import DeadlineExceeded, PoolClosed, WorkItem, WorkResult
from engines.types import Image
from engines.yolo import resize
from streams.analytics import StreamAnalytics
from streams.detect import StreamDetect
from streams.fanout import ProcessedFrame
from streams.frames import (
    bound_decoder,
    decoded_size,
    frame_rgb,
    keyframes_suffice,
    refused_size,
    too_large_message,
    upright,
)
from streams.motion import MotionGate, MotionOptions
from streams.pacing import FilePacer, RateSampler, frame_interval
from streams.sources import (
    RTSP_PROBE_S,
    SNAPSHOT_FPS,
    SourceError,
    SourceSpec,
    backoff_delay,
    check_unmoved,
    explain_open_failure,
    explain_rtsp_answer,
    is_still_image,
    open_options,
    redact,
    redact_in,
    rtsp_answer,
)
from streams.zones import ZoneEvent

if TYPE_CHECKING:
    from engines.nvdec import GpuDecode
    from streams.clips import ClipPlanner, ClipRecorder

log = logging.getLogger(__name__)

FrameSink = Callable[[str, WorkItem], "WorkItem | None"]
"""``EnginePool.submit_latest``: offer a frame, get back the one it replaced."""
PublishFn = Callable[[ProcessedFrame], None]
"""Called from an engine worker thread with each processed frame; must not block."""
StateFn = Callable[["StreamState", "StreamState", "str | None", int], None]
"""Told ``(previous, state, error, frame)`` when a stream goes live, loses its source or
fails (on its decode thread)."""


class StreamState(enum.StrEnum):
    CONNECTING = "connecting"
    LIVE = "live"
    RECONNECTING = "reconnecting"
    STOPPED = "stopped"
    FAILED = "failed"
    DISABLED = "disabled"  # by its user: camera closed, settings and counts kept


NOT_SHOWING = frozenset({StreamState.DISABLED, StreamState.FAILED, StreamState.STOPPED})
"""States in which a stream shows nothing now: its ``objects`` and zones' ``now`` are empty."""


GOP_MEMORY = 8
"""Groups of pictures whose longest decides whether keyframes alone give a stream's samples."""


def _sized(container: Any) -> bool:
    """Whether an HTTP source is a file of a known size (its ``Content-Length``): an MPEG-TS
    recording from a server without range requests (``python -m http.server``) has no
    duration, and was read as a camera: at 3x its rate, live and reconnecting at each end.
    Never an MJPEG stream (a camera's ``multipart/x-mixed-replace`` may state any length)."""
    if container.format.name in ("mpjpeg", "mjpeg"):
        return False
    size = getattr(container, "size", 0)
    return isinstance(size, int) and size > 0


def _undecodable(exc: Exception) -> bool:
    """Whether FFmpeg found the data it read no video (``InvalidDataError``)."""
    import av

    return isinstance(exc, av.error.InvalidDataError)


class FatalSourceError(RuntimeError):
    """The source opened but can never work (no video, frames too large): no retry."""


class SourceStalled(RuntimeError):
    """A live source sent nothing for the read timeout (a failure as FFmpeg's own timeout
    is: the stream reconnects)."""


@dataclass(frozen=True, slots=True)
class StreamConfig:
    """What the user asked for (persisted).

    Attributes:
        id: stream id.
        spec: the validated source.
        name: display name.
        max_fps: sample at most this many frames per second (``None``: every frame), at
            first; ``StreamReader.max_fps`` from then on.
        detect: what its first frames detect (``StreamReader.detect`` from then on).
    """

    id: str
    spec: SourceSpec
    name: str = ""
    max_fps: float | None = None
    detect: StreamDetect = field(default_factory=StreamDetect)


@dataclass(frozen=True, slots=True)
class ReaderOptions:
    """Timeouts, backoff and limits shared by every stream (from settings)."""

    open_timeout_s: float = 10.0
    read_timeout_s: float = 10.0
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    max_attempts: int = 0
    frame_deadline_ms: float = 1000.0
    max_pixels: int = 50_000_000
    decode_device: str = "cpu"
    """``cuda``/``cuda:N``: NVDEC, frames stay on the GPU (GPU backends only); else CPU."""
    motion: MotionOptions = field(default_factory=MotionOptions)
    """How streams with ``motion`` on measure it."""
    keyframe_decode: bool = True
    """Decode only keyframes where they come as often as ``max_fps`` samples (see
    :func:`keyframes_suffice`)."""
    codec_threads: int = 0
    """FFmpeg threads decoding each stream (slice threads: no frame delay); 0: FFmpeg's
    choice (one per core)."""
    decode_max_side: int = 0
    """Frames are decoded scaled down (aspect kept, as the engines' letterbox would) so their
    longer side is at most this (:func:`decoded_size`); 0: at the size they come. Detections
    are given in the source's pixels all the same."""
    file_fps: float | None = None
    """How fast ``file://`` sources play: ``None`` at their own timestamps (as the camera
    they stand for), ``0`` as fast as they decode, else this many frames a second
    (benchmarks: every stream at one rate, or unpaced)."""


FILE_ENDED = 'the file ended ("loop": false; "loop": true plays it again and again)'
"""A ``file://`` stream's ``last_error`` once it has played to its end without ``loop``."""


@dataclass(frozen=True, slots=True)
class _Pending:
    """A frame on its way through the pool."""

    frame_no: int
    pts: float | None
    captured_at: float
    decoded_mono: float
    image: Image
    detect: StreamDetect
    source: tuple[int, int]
    """The frame's width and height as the camera sent it (``image`` may be smaller)."""


class RateMeter:
    """Events per second over the last ``window`` events (bounded, no timers): those of the
    last ``horizon_s``; where fewer than two fell in it (a stream at ``max_fps`` 0.2), those
    of the last ``slow_horizon_s``, while the next is not overdue (twice their interval
    since the last). A stream processing a frame every 4 s read 0 frames a second."""

    def __init__(
        self, window: int = 50, horizon_s: float = 3.0, slow_horizon_s: float = 60.0
    ) -> None:
        self._times: deque[float] = deque(maxlen=window)
        self._horizon_s = horizon_s
        self._slow_horizon_s = slow_horizon_s

    def tick(self, now: float) -> None:
        self._times.append(now)

    def rate(self, now: float) -> float:
        recent = [t for t in self._times if now - t <= self._horizon_s]
        if len(recent) >= 2:
            interval = max(recent[-1] - recent[0], 1e-6) / (len(recent) - 1)
            # Stopped (a camera lost): it read on, then rose as its last frames aged out of
            # the window, the closest ones last (25 fps read 93 fps, reconnecting).
            return 0.0 if now - recent[-1] > max(2 * interval, 1.0) else 1 / interval
        slow = [t for t in self._times if now - t <= self._slow_horizon_s]
        if len(slow) < 2:
            return 0.0
        interval = max(slow[-1] - slow[0], 1e-6) / (len(slow) - 1)
        return 0.0 if now - slow[-1] > 2 * interval else 1 / interval


OUTAGE_SUMMARY_S = 300.0
"""While a source goes on failing with the same error, a summary this often (its retries
are at DEBUG)."""


class OutageLog:
    """How a stream's failing source is logged, as Frigate and other daemons do: a WARNING at
    its first failure and at each error not yet seen in this outage, the same error again at
    DEBUG, a WARNING summary at most every ``summary_s`` (``still failing after N attempts
    over M min: <error>``), the first ``reconnect attempt`` at INFO and the rest at DEBUG,
    and an INFO once frames come again (``reconnected after N attempts, down M s``, timed
    from the last frame). A camera with a wrong password, retried every 30 s, wrote a
    WARNING and an INFO at each retry: over 5,000 lines a weekend for one dead camera.

    Args:
        stream_id: named in each line.
        summary_s: how often a summary is logged while the error stays the same.
        clock: monotonic seconds (tests inject one).
    """

    MAX_ERRORS = 16
    """Errors remembered in an outage (warned of once each); more are said at DEBUG."""

    def __init__(
        self,
        stream_id: str,
        summary_s: float = OUTAGE_SUMMARY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream_id = stream_id
        self.summary_s = summary_s
        self.clock = clock
        self.failures = 0
        """Failed attempts in this outage (0: the source works, or has not failed yet)."""
        self.attempts = 0
        """Reconnect attempts in this outage."""
        self._down = False
        self._since = self._summarised = 0.0
        self._errors: set[str] = set()

    def lost(self, last_frame: float | None = None) -> None:
        """The source is gone (it ended, or failed): an outage begins, timed from
        ``last_frame`` (monotonic) where frames came, else from now. Logs nothing: the
        state's line, or :meth:`failed`'s, says why."""
        if not self._down:
            self._begin(self.clock(), last_frame)

    def _begin(self, now: float, last_frame: float | None = None) -> None:
        self._down, self._since, self._summarised = True, last_frame or now, now

    def failed(self, source: str, error: str, attempt_s: float = 0.0) -> None:
        """An attempt failed: ``source`` (the URL, redacted) gave ``error``; it began
        ``attempt_s`` ago, and so did an outage it begins (a camera down from the start was
        "down 4.0 s", timed from its first failure at the open timeout, when it had been
        16 s)."""
        now = self.clock()
        if not self._down:
            self._begin(now - attempt_s)
        self.failures += 1
        sid = self.stream_id
        if error not in self._errors and len(self._errors) < self.MAX_ERRORS:
            self._errors.add(error)
            self._summarised = now
            if self.failures == 1:
                log.warning("stream %s: %s: %s", sid, source, error)
            else:
                log.warning(
                    "stream %s: %s: %s (failed %d attempts)", sid, source, error, self.failures
                )
            return
        log.debug("stream %s: %s: %s (failed %d attempts)", sid, source, error, self.failures)
        if now - self._summarised >= self.summary_s:
            self._summarised = now
            log.warning(
                "stream %s: still failing after %d attempts over %.0f min: %s",
                sid,
                self.failures,
                (now - self._since) / 60,
                error,
            )

    def retrying(self, attempt: int, delay_s: float) -> None:
        """The next attempt is in ``delay_s``: said at INFO for an outage's first, DEBUG
        after."""
        self.lost()
        self.attempts += 1
        level = logging.INFO if self.attempts == 1 else logging.DEBUG
        log.log(
            level, "stream %s: reconnect attempt %d in %.2f s", self.stream_id, attempt, delay_s
        )

    def recovered(self) -> None:
        """Frames came: the end of an outage (if there was one) is logged at INFO."""
        if not self._down:
            return
        log.info(
            "stream %s: reconnected after %d attempts, down %.1f s",
            self.stream_id,
            self.attempts,
            self.clock() - self._since,
        )
        self._down, self.failures, self.attempts = False, 0, 0
        self._errors.clear()


class StreamReader:
    """The decode thread of one stream, and its state and counters.

    Args:
        config: the stream.
        options: timeouts, backoff and limits.
        submit: where frames go (``EnginePool.submit_latest``).
        publish: receives each processed frame on an engine worker thread.
        rng: jitter source (seeded in tests).
        on_state: told when the stream goes live, loses its source or fails (not when it
            starts connecting or is stopped).
        clips: keeps the stream's recent video and writes event clips, while its
            ``detect.clips`` is on.
    """

    LOG_STATES = True
    """Log each change of state (a decode process leaves it to the server's reader)."""

    def __init__(
        self,
        config: StreamConfig,
        options: ReaderOptions,
        submit: FrameSink,
        publish: PublishFn,
        *,
        rng: random.Random | None = None,
        on_state: StateFn | None = None,
        clips: ClipRecorder | None = None,
    ) -> None:
        self.config = config
        self.clips = clips
        self._on_state = on_state
        self._opt = options
        self._submit = submit
        self._publish = publish
        self._rng = rng or random.Random()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._run, name=f"stream-{config.id}", daemon=True)
        self.state = StreamState.CONNECTING
        self.last_error: str | None = None
        self.frames_in = 0
        self.processed = 0
        self.drops = 0
        self.publish_drops = 0
        """Frames processed but not published: the event loop fell behind (``streams.outbox``)."""
        self.skipped = 0
        self.decoded = 0
        self.keyframes_only = False
        self.motion_skipped = 0
        self.copied = 0
        """Frames copied out of a decode process's shared memory (its slots were kept)."""
        self._motion = MotionGate(options.motion)
        self.reconnects = 0
        self.failed = 0
        self._heir: StreamReader | None = None  # the reader this one's counts went on in
        # Results come back on engine worker threads, possibly out of order (two workers, one
        # stream): this lock puts them through the analytics and out one at a time, in order.
        self._result_lock = threading.Lock()
        self._last_result_frame = 0
        self._analytics = StreamAnalytics()
        self.width = 0
        self.height = 0
        self.last_latency_ms: float | None = None
        self._last_frame_mono: float | None = None
        self._fps_in = RateMeter()
        self._fps_out = RateMeter()
        self.outage = OutageLog(config.id)
        """How its source's failures are logged (its ``clock`` injectable in tests)."""
        self._pacer = FilePacer(options.file_fps)  # across a looped file's passes
        # max_fps across them too (and across a camera's reopenings): each pass took its
        # first frame, however soon after the last one taken.
        self._sampler = RateSampler()
        self._opened_at = 0.0  # when the source was last opened (monotonic)
        self._still = False  # it answers one picture an opening (a snapshot URL)
        self._recorded = False  # a recording (a file, or a video file over HTTP), not live
        self._phase = "open"  # what the source is doing: "open" or "read" (for errors)
        self._awaiting_packet = False  # in FFmpeg's read of the next packet (no stop cuts it)
        self._released = False  # let go by the server while it waits on FFmpeg (let_go)
        self._lost = False  # it was live and failed: going live again is a reconnect
        self._got_frames = False  # frames came since the source was last opened
        self._polling = False  # fetching such a picture again, the stream live
        self._replaying = False  # opening a looped file again, the stream live
        self._frame_no = 0
        self.detect = config.detect
        """What the next frames detect; one reference swap, read by the decode thread."""
        self.max_fps = config.max_fps
        """Sampling rate of the next frames (``None``: every frame); read per frame."""
        self._gpu_decode: GpuDecode | None = None  # CPU decode imports no GPU code
        if options.decode_device != "cpu":
            from engines.nvdec import GpuDecode

            self._gpu_decode = GpuDecode(options.decode_device)
            if not self._gpu_decode.on_gpu:
                log.warning(
                    "stream %s: decoding on the CPU: %s", config.id, self._gpu_decode.reason
                )

    # ---- control -----------------------------------------------------------------------
    def carry_over(self, old: StreamReader) -> None:
        """Before :meth:`start`: go on from ``old``, a stopped reader of the same stream (its
        source replaced, or the stream enabled again): its counts, its analytics (tracks,
        lines, zones) and its frame numbers, so a viewer's frames keep going forward and
        in-flight results of ``old`` go through the same analytics in order."""
        with old._lock:
            self.frames_in, self.processed, self.drops = old.frames_in, old.processed, old.drops
            self.skipped, self.decoded, self.failed = old.skipped, old.decoded, old.failed
            self.motion_skipped, self.reconnects = old.motion_skipped, old.reconnects
            self.copied, self.publish_drops = old.copied, old.publish_drops
            self.last_latency_ms = old.last_latency_ms
            # Its frames still in flight end in this reader's counters from now on (they
            # ended in the old one's, thrown away: frames_in outgrew what they add up to).
            old._heir = self
        with old._result_lock:
            self._frame_no = max(old._frame_no, old._last_result_frame)
            self._last_result_frame = old._last_result_frame
            self._analytics = old._analytics
            self._result_lock = old._result_lock
        self._analytics.reshape(self.detect)  # where it does not run (switched off)

    def set_detect(self, detect: StreamDetect) -> None:
        """What its next frames detect, from now; the counts of lines and zones ``detect``
        no longer has go now (one that is not running has no next frame to drop them)."""
        self.detect = detect
        self._analytics.reshape(detect)

    def end_stays(self, name_of: Callable[[int], str]) -> list[ZoneEvent]:
        """Its objects leave the zones they stand in, ``lost``, at its last processed frame:
        it shows nothing now (switched off, failed, ended or removed). Their stays were left
        open: ``now`` was empty while entries outnumbered exits, and the exits came, dated
        then, when it was switched on again, or never."""
        with self._result_lock:
            return self._analytics.end(self._last_result_frame, name_of)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to stop; it closes its decoder within one read timeout."""
        self._stop.set()

    def join(self, timeout_s: float) -> bool:
        """Wait for the thread; True once it has exited (or if it never started: a stream
        disabled, or whose settings do not fit the model)."""
        if self._thread.ident is None:
            return True
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    @property
    def waiting_on_source(self) -> bool:
        """Whether its thread waits in FFmpeg for the source, opening it or reading its next
        packet: no stop interrupts either; they end within the open or read timeout."""
        return self.alive and (self._phase == "open" or self._awaiting_packet)

    def let_go(self) -> None:
        """The server stops waiting for this stopped reader's thread, which ends by itself
        when FFmpeg's wait returns, publishing nothing; its state lines are no longer logged
        (a stream added again under its id meanwhile would seem to change state)."""
        self._released = True

    @property
    def frame_no(self) -> int:
        """The stream's number of its newest frame (the WebSocket's and events' ``frame``)."""
        return self._frame_no

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def live(self) -> bool:
        """Whether frames are coming in now."""
        return self.state is StreamState.LIVE

    @property
    def clip_requests(self) -> ClipRecorder | ClipPlanner | None:
        """Where the stream's event clips are reserved (None: it keeps none)."""
        return self.clips

    def record_latency(self, latency_ms: float) -> None:
        with self._lock:
            self.last_latency_ms = latency_ms

    def snapshot(self) -> dict[str, Any]:
        """State and counters, as ``GET /streams/{id}`` shows them."""
        now = time.monotonic()
        with self._lock:
            age = None if self._last_frame_mono is None else now - self._last_frame_mono
            return {
                "state": self.state.value,
                "last_error": self.last_error,
                "fps_in": round(self._fps_in.rate(now), 2),
                "fps_processed": round(self._fps_out.rate(now), 2),
                "frames_in": self.frames_in,
                "frames_decoded": self.decoded,
                "keyframes_only": self.keyframes_only,
                "frames_processed": self.processed,
                "drops": self.drops,
                "publish_drops": self.publish_drops,
                "skipped": self.skipped,
                "motion_skipped": self.motion_skipped,
                "motion_area": round(self._motion.area, 4) if self.detect.motion else None,
                "reconnects": self.reconnects,
                "frames_failed": self.failed,
                **self._analytics.snapshot(showing=self.state not in NOT_SHOWING),
                "last_frame_age_s": None if age is None else round(age, 3),
                "last_latency_ms": None
                if self.last_latency_ms is None
                else round(self.last_latency_ms, 2),
                "width": self.width,
                "height": self.height,
                **self._decoded_at(),
                "decode": "cuda" if self._gpu_decode and self._gpu_decode.on_gpu else "cpu",
                "decode_process": None,
                "frames_copied": self.copied,
            }

    def _decoded_at(self) -> dict[str, int]:
        """The size the stream's frames reach the engine at (NVDEC frames: as sent)."""
        gpu = self._gpu_decode is not None and self._gpu_decode.on_gpu
        side = 0 if gpu else self._opt.decode_max_side
        width, height = decoded_size(self.width, self.height, side)
        return {"decoded_width": width, "decoded_height": height}

    # ---- thread ------------------------------------------------------------------------
    def wait_state(self, states: set[StreamState], timeout_s: float) -> bool:
        """Block until the stream is in one of ``states``; False on timeout."""
        with self._changed:
            return self._changed.wait_for(lambda: self.state in states, timeout_s)

    def _set_state(self, state: StreamState, error: str | None = None) -> None:
        with self._changed:
            self._changed.notify_all()
            previous = self.state
            if state != previous and self.LOG_STATES and not self._released:
                log.info(
                    "stream %s: %s -> %s%s",
                    self.config.id,
                    previous.value,
                    state.value,
                    f" ({error})" if error else "",
                )
            self.state = state
            if error is not None:
                self.last_error = error
        # A reader stopped by the server (the stream removed, replaced, disabled) is not news;
        # a file that played to its end is (MQTT's and the dashboards' counts go to 0).
        told = state is not StreamState.CONNECTING and (
            state is not StreamState.STOPPED or error == FILE_ENDED
        )
        if state != previous and told and self._on_state is not None:
            self._on_state(previous, state, error, self._frame_no)

    def _run(self) -> None:
        sid = self.config.id
        attempt = 0
        while not self._stop.is_set():
            try:
                got_frames = self._open_and_read()
            except FatalSourceError as exc:
                log.error("stream %s: %s; not retrying", sid, exc)
                self._set_state(StreamState.FAILED, str(exc))
                return
            except PoolClosed:
                break
            except Exception as exc:  # any source failure: a camera may come back
                if self._stop.is_set():  # removed meanwhile: its open cut short, no failure
                    break
                # One that sent frames before it failed starts its backoff afresh: a camera
                # dropping once a day went on counting attempts, to --reconnect-max-attempts.
                got_frames = self._got_frames
                # A snapshot URL is live between fetches, a looped file between its passes:
                # a file that failed to open again (moved, its HTTP server down) was lost, and
                # its coming back a reconnect.
                replaying = self._replaying
                was_live = got_frames or self._polling or replaying
                self._polling = self._replaying = False
                error = redact_in(self._explain(exc), self.config.spec.url)
                if self.config.spec.is_file and not was_live and _undecodable(exc):
                    # Its header read, its frames not (zeroed, cut off): reopened as a lost
                    # camera is, for ever.
                    error = (
                        f"{redact(self.config.spec.url)}: not one frame of its video decodes"
                        f" (a damaged file: {error})"
                    )
                    log.error("stream %s: %s; not retrying", sid, error)
                    self._set_state(StreamState.FAILED, error)
                    return
                self._set_state(StreamState.RECONNECTING, error)
                if was_live:
                    self._lost = True
                if got_frames or replaying:
                    self.outage.lost(self._last_frame_mono)
                self.outage.failed(redact(self.config.spec.url), error, self._attempt_s())
            else:
                if self._stop.is_set():
                    break
                was_polling = self._polling or self._replaying
                self._polling = got_frames and self._still
                self._replaying = False
                if self._polling:
                    # A snapshot URL: one picture a fetch, and the stream stays live between
                    # them (it was "source ended", a reconnect and a state event each time).
                    attempt = 0
                    rate = self.max_fps or SNAPSHOT_FPS
                    if self._stop.wait(self._opened_at + 1.0 / rate - time.monotonic()):
                        break
                    continue
                if self._recorded and got_frames:
                    if self.config.spec.loop:
                        attempt = 0  # played: the next outage's backoff starts afresh
                        self._replaying = True
                        continue  # clip ended: start it again at once
                    # Played once, as asked: not reopened as a camera would be.
                    self._set_state(StreamState.STOPPED, FILE_ENDED)
                    return
                self._set_state(StreamState.RECONNECTING, "source ended")
                if got_frames or was_polling:
                    self._lost = True
                if got_frames:  # a camera lost (its state line says so): the outage begins
                    self.outage.lost(self._last_frame_mono)
                else:  # opened, but no frame: a failure as any other
                    self.outage.failed(
                        redact(self.config.spec.url), "source ended", self._attempt_s()
                    )
            attempt = 1 if got_frames else attempt + 1
            if self._opt.max_attempts and attempt > self._opt.max_attempts:
                self._set_state(
                    StreamState.FAILED,
                    f"gave up after {attempt - 1} reconnect"
                    f" attempts ({self.last_error}; setting"
                    " STREAMDET_RECONNECT_MAX_ATTEMPTS)",
                )
                return
            delay = backoff_delay(
                attempt, self._opt.backoff_initial_s, self._opt.backoff_max_s, self._rng
            )
            if self._stop.is_set():
                break
            self.outage.retrying(attempt, delay)
            if self._stop.wait(delay):
                break
        self._set_state(StreamState.STOPPED)

    def _attempt_s(self) -> float:
        """Seconds since the current (failed) attempt began opening the source (0: none)."""
        return time.monotonic() - self._opened_at if self._opened_at else 0.0

    def _explain(self, exc: Exception) -> str:
        """What a source failure says in ``last_error``: FFmpeg's own words, or, where it
        gave up waiting (its "Immediate exit requested", or RTSP's "Invalid data" at the
        open timeout), the wait and the setting that sets it."""
        import av

        text = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, av.error.FFmpegError):  # its code is FFmpeg's, not an OS errno
            text = re.sub(r"\[Errno -?\d+\] ", "", text, count=1)
        waited = time.monotonic() - self._opened_at
        opening = self._phase == "open"
        limit = self._opt.open_timeout_s if opening else self._opt.read_timeout_s
        timed_out = isinstance(exc, (av.error.ExitError, SourceStalled)) or (
            isinstance(exc, av.error.InvalidDataError) and opening and waited >= 0.9 * limit
        )
        # FFmpeg says "Invalid data" as much for a port that answers another protocol (and it
        # waits for an RTSP reply to the end) as for one that never answers: asked again,
        # the source's first bytes tell which (both were "no answer within 10 s").
        spec = self.config.spec
        if (
            opening
            and spec.scheme == "rtsp"
            and isinstance(exc, av.error.InvalidDataError)
            and not self._stop.is_set()
            and (answer := rtsp_answer(spec.url, min(RTSP_PROBE_S, limit))) is not None
            and (said := explain_rtsp_answer(answer, text, timed_out=timed_out)) is not None
        ):
            return said
        if timed_out and not self._stop.is_set():
            if opening:
                return (
                    f"no answer within {limit:g} s (setting STREAMDET_STREAM_OPEN_TIMEOUT_S);"
                    f" {text}"
                )
            return f"no data for {limit:g} s (setting STREAMDET_STREAM_READ_TIMEOUT_S); {text}"
        if opening and isinstance(exc, OSError) and exc.errno == errno.EIO:
            return f"cannot reach the host (unknown name, or no route); {text}"
        return explain_open_failure(opening and self.config.spec.is_file, text)

    def _open_and_read(self) -> bool:
        """Open the source and read it until it ends or the stream stops; True if any
        frame was decoded."""
        import av

        spec = self.config.spec
        self._opened_at = time.monotonic()
        self._phase = "open"
        self._got_frames = False
        if spec.path is not None:
            try:
                check_unmoved(spec.path)
            except SourceError as exc:
                raise FatalSourceError(str(exc)) from None
        try:
            container = av.open(
                spec.target,
                options=open_options(spec),
                timeout=(self._opt.open_timeout_s, self._opt.read_timeout_s),
                hwaccel=self._gpu_decode.hwaccel() if self._gpu_decode else None,
            )
        except av.error.InvalidDataError as exc:
            if spec.is_file:  # a file that is no video stays one: it was retried for ever
                raise FatalSourceError(self._explain(exc)) from None
            raise
        self._phase = "read"
        try:
            if not container.streams.video:
                raise FatalSourceError(f"{redact(spec.url)} has no video stream")
            stream = container.streams.video[0]
            if self._opt.codec_threads:
                stream.codec_context.thread_count = self._opt.codec_threads
            # Larger from the start: the decoder would not open (an FFmpeg "Invalid
            # argument" retried for ever as a camera lost), so it fails saying why.
            if size := refused_size(stream, self._opt.max_pixels):
                raise FatalSourceError(too_large_message(*size, self._opt.max_pixels))
            bound_decoder(stream, self._opt.max_pixels)
            self._still = not spec.is_file and is_still_image(container.format.name)
            # A video of known length (an MP4 over HTTP, an HLS recording) plays as a file
            # does, at its own rate, and its end is no camera lost: it decoded at 35x real
            # time and went live/reconnecting at each end, for ever. Cameras have none.
            # RTSP is a camera even where its server states a length (an NVR's playback):
            # at its end it reconnects, as before.
            web = spec.scheme in ("http", "https")
            self._recorded = spec.is_file or (
                web and not self._still and (bool(container.duration) or _sized(container))
            )
            if not self._polling:  # the next picture of a snapshot URL is compared with its last
                self._motion.reset()
            return self._read(container, stream)
        finally:
            if self.clips is not None:
                self._guard_clips(self.clips.source_closed, "the source closed")
            container.close()  # frees the decoder and the socket at once

    def _read(self, container: Any, stream: Any) -> bool:
        import av

        paced = self._recorded and self._opt.file_fps != 0
        interval = frame_interval(stream.average_rate or stream.guessed_rate)
        sampler = self._sampler
        last_key: float | None = None  # when the last keyframe was (seconds of the stream)
        # The last groups' lengths: a camera whose keyframes come unevenly (an extra one at a
        # change of scene) gave a short group, the next was decoded keyframe only, and a
        # stream at max_fps 2 took 1.3 frames a second.
        groups: deque[float] = deque(maxlen=GOP_MEMORY)
        reorders = bool(stream.codec_context.has_b_frames)
        self.keyframes_only = False
        packets = container.demux(stream)
        if not paced:  # a live source: a read that waited out the timeout gave a stale packet
            packets = self._live_packets(packets)
        for packet in packets:
            if self._stop.is_set():
                return self._got_frames
            if self.clips is not None:
                if self.detect.clips:
                    self._guard_clips(self.clips.packet, packet, stream, time.monotonic())
                else:
                    self._guard_clips(self.clips.discard)
            if packet.is_keyframe:
                if packet.pts is not None and packet.time_base:
                    # Each group of pictures is decoded whole or keyframe only, decided at its
                    # keyframe from the longest of the last groups: a decoder fed a P-frame
                    # whose references it skipped would show garbage.
                    at = float(packet.pts * packet.time_base)
                    if last_key is not None:
                        groups.append(at - last_key)
                    last_key = at
                    self.keyframes_only = self._opt.keyframe_decode and keyframes_suffice(
                        max(groups, default=None),
                        self.max_fps,
                        reorders or self._gpu_decode is not None,
                    )
            elif self.keyframes_only and packet.size:
                # A frame of the camera all the same: counted in, and as sampled out; a file's
                # played at its time too (they went by at once: a looped file ran at 1.5x).
                now = time.monotonic()
                if paced:
                    known = packet.pts is not None and packet.time_base
                    shown = float(packet.pts * packet.time_base) if known else None
                    due = self._pacer.due(shown, now, interval)
                    if due - now > 0 and self._stop.wait(due - now):
                        return self._got_frames
                    now = time.monotonic()
                self._count_in(now, self.width, self.height, decoded=False)
                continue
            try:
                frames = packet.decode()
            except (av.error.InvalidDataError, av.error.ArgumentError) as exc:
                if size := refused_size(stream, self._opt.max_pixels):
                    raise FatalSourceError(too_large_message(*size, self._opt.max_pixels)) from None
                if isinstance(exc, av.error.ArgumentError):
                    raise  # the decoder would not open: a source lost, reopened
                log.debug("stream %s: undecodable packet: %s", self.config.id, exc)
                continue
            for decoded in frames:
                frame = upright(decoded)
                now = time.monotonic()
                if not self._got_frames:
                    self._got_frames = True
                    if self._lost:  # reopened after a failure: one reconnect, however many tries
                        self._lost = False
                        with self._lock:
                            self.reconnects += 1
                    self._set_state(StreamState.LIVE)
                    self.outage.recovered()
                pts = frame.time
                if paced:  # a file: played like the camera it stands for (streams.pacing)
                    wait = self._pacer.due(pts, now, interval) - now
                    if wait > 0 and self._stop.wait(wait):
                        return self._got_frames
                    now = time.monotonic()
                self._count_in(now, frame.width, frame.height)
                if frame.width * frame.height > self._opt.max_pixels:  # NVDEC's, say
                    raise FatalSourceError(
                        too_large_message(frame.width, frame.height, self._opt.max_pixels)
                    )
                if not sampler.take(now, self.max_fps):
                    with self._lock:
                        self.skipped += 1
                    continue
                detect = self.detect
                if detect.motion and not self._motion.infer(
                    frame, now, detect.motion_mask, detect.motion_min_area, detect.motion_threshold
                ):
                    with self._lock:
                        self.motion_skipped += 1
                    continue
                self._deliver(frame, pts, now)
        spec = self.config.spec
        if spec.is_file and not self._got_frames and not self._stop.is_set():
            # Opened, then at its end without one frame (its data zeroed, cut off after the
            # header): it was reopened as a lost camera is, "source ended", for ever.
            raise FatalSourceError(
                f"{redact(spec.url)}: not one frame of its video decodes (a damaged or empty file)"
            )
        return self._got_frames

    def _live_packets(self, packets: Iterator[Any]) -> Iterator[Any]:
        """``packets`` of a live source, each read marked as a wait on it (see
        :attr:`waiting_on_source`), refused once one took the whole read timeout: FFmpeg's
        read, cut short at the timeout, hands back the packet its RTP depacketizer held back
        (waiting for the next one), and PyAV's timer starts again at the next read. A camera
        that froze was so still "live" for twice the timeout, and its last frame went out
        stamped as captured 5 s late."""
        limit = self._opt.read_timeout_s
        while True:
            self._awaiting_packet = True
            asked = time.monotonic()
            try:
                packet = next(packets, None)
            finally:
                self._awaiting_packet = False
            if packet is None:
                return
            if time.monotonic() - asked >= limit and not self._stop.is_set():
                raise SourceStalled(
                    f"no packet for {limit:g} s; dropped the one FFmpeg held back at the timeout"
                )
            yield packet

    def _deliver(self, frame: Any, pts: float | None, now: float) -> None:
        """Hand a sampled ``av.VideoFrame`` on to the engines (a decode process sends it to
        the server process instead: :mod:`streams.decode_procs`)."""
        source = (frame.width, frame.height)
        size = decoded_size(*source, self._opt.decode_max_side)
        if self._gpu_decode is None:
            self._offer(frame_rgb(frame, size), pts, now, source)
            return
        image = self._gpu_decode.convert(frame)  # NVDEC's GPU letterbox resizes its frames
        if isinstance(image, np.ndarray) and size != source:  # FFmpeg fell back to software
            image = resize(image, size)
        self._offer(image, pts, now, source)

    def _guard_clips(self, step: Callable[..., None], *args: Any) -> None:
        """Run a clip step; a failure costs clips, never the stream."""
        try:
            step(*args)
        except Exception:
            log.exception("stream %s: event clips failed", self.config.id)

    def _count_in(self, now: float, width: int, height: int, *, decoded: bool = True) -> None:
        """A frame came in: decoded, or left in its packet (keyframes only: as sampled out)."""
        with self._lock:
            self.frames_in += 1
            if decoded:
                self.decoded += 1
            else:
                self.skipped += 1
            self._fps_in.tick(now)
            self._last_frame_mono = now
            self.width, self.height = width, height

    def _offer(
        self, image: Image, pts: float | None, decoded_mono: float, source: tuple[int, int]
    ) -> None:
        """Send a decoded frame (``source``: its size as the camera sent it) to the engines."""
        self._frame_no += 1
        sid = self.config.id
        detect = self.detect
        # The wall time it was decoded at (monotonic time is one clock across processes):
        # stamped here, after a decode process's hand-over, the frames' latency measured from
        # ``captured_at`` (WebSocket and SSE clients, the load tests' gate) left that out.
        captured_at = time.time() - max(0.0, time.monotonic() - decoded_mono)
        pending = _Pending(self._frame_no, pts, captured_at, decoded_mono, image, detect, source)
        done = functools.partial(self._on_done, pending)
        item = WorkItem(
            image,
            detect.engine_params,
            deadline=decoded_mono + self._opt.frame_deadline_ms / 1000.0,
            on_done=done,
            request_id=f"{sid}:{self._frame_no}",
            stream_id=sid,
        )
        replaced = self._submit(sid, item)
        if replaced is not None:
            self.count_drop()

    def count_drop(self) -> None:
        """A frame of this stream was dropped, not processed: replaced by a newer one before
        the engine took it, past its deadline, or finished after a newer one."""
        self._count("drops")

    def count_publish_drop(self) -> None:
        """A processed frame of this stream (counted in ``processed``) was dropped on its way
        to the event loop, which fell behind (:mod:`streams.outbox`): not a drop as well."""
        self._count("publish_drops")

    def _count(self, counter: str) -> None:
        """One more of ``counter`` (see :meth:`_add_counts`)."""
        self._add_counts({counter: 1})

    def _add_counts(self, deltas: dict[str, int]) -> bool:
        """Add ``deltas`` to these counters or, where the stream went on in another reader
        (:meth:`carry_over`), to that one's; whether they were added here."""
        with self._lock:
            heir = self._heir
            if heir is None:
                for name, delta in deltas.items():
                    setattr(self, name, getattr(self, name) + delta)
                if "processed" in deltas:
                    self._fps_out.tick(time.monotonic())
                return True
        heir._add_counts(deltas)
        return False

    def _on_done(self, pending: _Pending, result: WorkResult) -> None:
        """Engine worker thread: count, then publish."""
        if result.detections is None:
            if isinstance(result.error, DeadlineExceeded):
                self.count_drop()
            elif not isinstance(result.error, PoolClosed):
                self._count("failed")
                log.warning(
                    "stream %s: frame %d failed: %s", self.config.id, pending.frame_no, result.error
                )
            return
        with self._result_lock:
            if pending.frame_no < self._last_result_frame:
                # A newer frame finished first on another worker: a live stream never goes
                # back in time (nor would its tracks), so this one counts as dropped.
                self.count_drop()
                return
            if self._stop.is_set():
                # Its stream stopped, was switched off, given a new source or removed while
                # it ran: never published, so not counted into lines and zones either (their
                # counts grew by crossings no event was logged for).
                self.count_drop()
                return
            self._last_result_frame = pending.frame_no
            detections = result.detections.rescaled(*pending.source)
            done = self._analytics.process(
                detections, pending.detect, pending.decoded_mono, pending.frame_no
            )
            if self.state in NOT_SHOWING:
                # Finished after its stream stopped showing (a file's last frames, in the
                # engine when it ended): nothing later closes the stays it opened.
                ended = self._analytics.end(pending.frame_no, detections.name_of)
                if ended:
                    done = dataclasses.replace(done, events=(*done.events, *ended))
            self._count("processed")
            self._publish(
                ProcessedFrame(
                    stream_id=self.config.id,
                    frame=pending.frame_no,
                    pts=pending.pts,
                    captured_at=pending.captured_at,
                    decoded_mono=pending.decoded_mono,
                    image=pending.image,
                    detections=done.detections,
                    batch_size=result.batch_size,
                    events=done.events,
                    zones=done.zones,
                    dwell=done.dwell,
                    still=done.still,
                    stationary_s=done.stationary_s,
                )
            )
