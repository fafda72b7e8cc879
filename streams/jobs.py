"""Video jobs: a recorded video read through as fast as the engines have room for.

A job decodes a file (or an HTTP video) from start to end, sampling at most ``fps`` frames per
second of video, and sends each sampled frame to the engine pool's background lane, which runs
only on capacity that ``POST /detect`` calls and live streams leave. A few frames stay in
flight (``inflight``) so batches fill on a GPU; their results are taken in frame order through
the same analytics as a live stream's (region of interest, tracking, counting lines, zones),
timed by the video's own clock, so a ``loiter_s`` is seconds of video.

What comes out goes to two files in the job's directory, a line of JSON each:
``frames.ndjson`` (every processed frame: its number in the file, ``pts``, size, detections
and events) and ``events.ndjson`` (the line crossings and zone entries, exits and loiters).
:func:`run_job` returns the counts. It runs in a thread of its own and reports progress
through :class:`JobProgress`; nothing here knows about HTTP. The video is decoded in that
thread (:func:`local_frames`), or in a decode process
(:meth:`streams.decode_procs.DecodeHub.job_frames`), frames at most ``decode_max_side``
pixels a side either way (boxes in the video's own pixels).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TextIO

from engines.batching import PoolClosed, WorkItem, WorkResult
from engines.types import Detections, Image
from streams.analytics import Analysed, StreamAnalytics
from streams.detect import StreamDetect
from streams.fanout import detections_json
from streams.frames import (
    bound_decoder,
    decoded_size,
    frame_rgb,
    refused_size,
    too_large_message,
    upright,
)
from streams.sources import explain_open_failure

log = logging.getLogger(__name__)

FRAMES_FILE = "frames.ndjson"
EVENTS_FILE = "events.ndjson"
BACKGROUND_DEADLINE_S = 24 * 3600.0
"""A job's frame waits as long as live work keeps the engines busy: it is never dropped."""
POLL_S = 0.25  # how often a runner waiting on a frame looks at its cancel flag
JOB_NICE = 10
"""A job's decoding yields the CPU to the cameras' and the calls' (Linux nice, per thread; in
a decode process, its job thread's)."""


class FrameSink(Protocol):
    """Takes each processed frame in order (a video of them drawn, ``server/job_video.py``)."""

    def write(
        self, image: Image, detections: Detections | None, pts: float, counts: dict[str, Any]
    ) -> None:
        """``detections`` after the analytics (None: the engine failed on the frame);
        ``counts`` so far, as :meth:`StreamAnalytics.snapshot` gives them."""

    def close(self) -> None:
        """The job has ended (or stopped)."""


class JobCancelled(Exception):
    """The job was cancelled (deleted) or the server is stopping; ``interrupted`` tells
    which: an interrupted job runs again from the start at the next start."""

    def __init__(self, interrupted: bool) -> None:
        super().__init__("interrupted by the server stopping" if interrupted else "cancelled")
        self.interrupted = interrupted


class JobError(RuntimeError):
    """The video cannot be read; the message says why."""

    counts: dict[str, Any] | None = None
    """Where it failed part way: the counts of the frames it finished (its results so far)."""


class FramesTooLarge(JobError):
    """The video's frames have more pixels than allowed (``STREAMDET_MAX_IMAGE_PIXELS``)."""

    def __init__(self, width: int, height: int, most: int) -> None:
        super().__init__(f"frames of {width}x{height} exceed {most} pixels")
        self.width, self.height, self.most = width, height, most


PROBED_STREAMS = 64
"""Streams of a container whose decoders are bounded by a probe's ``max_pixels``."""


@dataclass(frozen=True, slots=True)
class JobSpec:
    """What a job reads and how.

    Attributes:
        source: what FFmpeg opens (a path or an HTTP URL).
        detect: the detection settings, as a stream's (``clips`` and ``motion`` unused).
        fps: at most this many frames per second of video; None: every frame.
        options: FFmpeg demuxer options.
        max_pixels: a larger frame stops the job (setting ``STREAMDET_MAX_IMAGE_PIXELS``).
        timeout_s: FFmpeg's open and read timeouts (an HTTP video that stalls).
        decode_max_side: frames are decoded at most this large on their longer side, as a
            live stream's (:func:`streams.frames.decoded_size`; 0: whole); a job that draws
            its video (``sink``) decodes them whole.
    """

    source: str
    detect: StreamDetect
    fps: float | None = None
    options: dict[str, str] = field(default_factory=dict)
    max_pixels: int = 50_000_000
    timeout_s: tuple[float, float] = (10.0, 5.0)
    decode_max_side: int = 0


@dataclass
class JobProgress:
    """Where a running job is, written by its thread and read by the API (single values,
    each assignment atomic)."""

    frames_read: int = 0
    frames_processed: int = 0
    frames_failed: int = 0
    decode_errors: int = 0
    events: int = 0
    position_s: float = 0.0
    gaps_s: float = 0.0
    duration_s: float | None = None
    started_mono: float | None = None
    elapsed_s: float | None = None
    """Set once the job has ended (:meth:`freeze`)."""

    def freeze(self) -> None:
        """The job has ended: its elapsed time stops."""
        if self.elapsed_s is None and self.started_mono is not None:
            # Rounded as shown, so a job read back after a restart shows the same figures.
            self.elapsed_s = round(time.monotonic() - self.started_mono, 3)

    def to_json(self) -> dict[str, Any]:
        elapsed = self.elapsed_s
        if elapsed is None and self.started_mono is not None:
            elapsed = time.monotonic() - self.started_mono
        share = None
        if self.duration_s:
            share = round(min(1.0, self.position_s / self.duration_s), 4)
        return {
            "frames_read": self.frames_read,
            "frames_processed": self.frames_processed,
            "frames_failed": self.frames_failed,
            "decode_errors": self.decode_errors,
            "events": self.events,
            "position_s": round(self.position_s, 3),
            "gaps_s": round(self.gaps_s, 3),
            "duration_s": None if self.duration_s is None else round(self.duration_s, 3),
            "progress": share,
            "elapsed_s": None if elapsed is None else round(elapsed, 3),
            "fps": round(self.frames_processed / elapsed, 2) if elapsed else None,
        }


@dataclass(frozen=True, slots=True)
class _Sampled:
    index: int  # the frame's number in the file, from 0
    pts: float
    image: Image
    result: Future[WorkResult]
    source: tuple[int, int]  # the frame's width and height in the video (``image``: maybe less)


class Sampler:
    """Keeps frames on a grid of ``1 / fps`` seconds of video: 25 fps sampled at 10 keeps
    10 a second, not every third frame's 8.3."""

    def __init__(self, fps: float | None) -> None:
        self._step = None if fps is None else 1.0 / fps
        self._next: float | None = None

    def keep(self, t: float) -> bool:
        if self._step is None:
            return True
        if self._next is not None and t < self._next - 1e-6:
            return False
        # On the grid, unless the video jumped past it (a gap): then from here.
        nxt = t if self._next is None or t > self._next + self._step else self._next
        self._next = nxt + self._step
        return True


def probe(
    source: str,
    options: dict[str, str] | None = None,
    timeout_s: tuple[float, float] = (10.0, 5.0),
    max_pixels: int | None = None,
) -> dict[str, Any]:
    """Open ``source`` and decode its first frame: ``{"width", "height", "duration_s",
    "fps", "codec"}``.

    With ``max_pixels``, a video whose frames are larger is refused from its codec's
    parameters, before any frame of it is decoded: a probe of an 8192x8192 H.264 clip of
    16 kB decoding its first frame took 360 MB of memory (FFmpeg's stream-info probe
    decodes one frame, the probe another), and the server runs 4 probes at once. Its
    decoders are bounded by FFmpeg's own ``max_pixels`` too, for a frame larger than its
    parameters said.

    Raises:
        FramesTooLarge: its frames have more than ``max_pixels`` pixels.
        JobError: not a video FFmpeg can read, no video stream, or no frame decodes.
    """
    import av

    try:
        with _open_bounded(source, options or {}, timeout_s, max_pixels) as container:
            if not container.streams.video:
                raise JobError("it has no video stream")
            stream = container.streams.video[0]
            if max_pixels:
                codec = stream.codec_context
                if codec.width * codec.height > max_pixels:
                    raise FramesTooLarge(codec.width, codec.height, max_pixels)
                bound_decoder(stream, max_pixels)
            duration = _duration(container, stream)
            for frame in _frames(container, stream, None):
                rate = stream.average_rate
                return {
                    "width": frame.width,
                    "height": frame.height,
                    "duration_s": None if duration is None else round(duration, 3),
                    "fps": None if rate is None else round(float(rate), 3),
                    "codec": stream.codec_context.name,
                }
            raise JobError("no frame of it decodes")
    except av.error.ExitError:  # FFmpeg's wait cut short by the timeout
        raise JobError(_waited(timeout_s, 0)) from None
    except av.error.FFmpegError as exc:
        size = _header_size(source, options or {}, timeout_s) if max_pixels else None
        if max_pixels and size and size[0] * size[1] > max_pixels:  # the bound refused it
            raise FramesTooLarge(*size, max_pixels) from None
        hint = ""
        if source.startswith(("http://", "https://")) and getattr(exc, "errno", 0) == errno.EIO:
            hint = (
                " (over HTTP, an MP4 whose index is at its end needs a server that answers"
                " range requests)"
            )
        reason = explain_open_failure("format_whitelist" in (options or {}), _reason(exc))
        raise JobError(f"not a video FFmpeg can read: {reason}{hint}") from None


def _open_bounded(
    source: str, options: dict[str, str], timeout_s: tuple[float, float], max_pixels: int | None
) -> Any:
    """``av.open``, the decoders of FFmpeg's stream-info probe (which decodes a frame of each
    stream) refusing a frame of more than ``max_pixels``. A format whose streams are found
    only by that probe (MPEG-TS, MPEG-PS) cannot take them (PyAV: ValueError) and is opened
    as it is: its frames' size is checked before the first frame of the probe's own."""
    import av

    if max_pixels:
        bound: Any = [{"max_pixels": str(max_pixels)}] * PROBED_STREAMS  # stub: list[str]
        try:
            return av.open(source, options=options, timeout=timeout_s, stream_options=bound)
        except ValueError:
            pass
    return av.open(source, options=options, timeout=timeout_s)


def _header_size(
    source: str, options: dict[str, str], timeout_s: tuple[float, float]
) -> tuple[int, int] | None:
    """The width and height of ``source``'s first video stream as its headers say, no frame
    decoded; None where it cannot be opened so. For a codec whose size FFmpeg's stream-info
    probe learns by decoding a frame (MPEG-4 Part 2, MJPEG, a JPEG or PNG), a frame over the
    bound made the open fail "Invalid argument": refused 415 "not a video" instead of 413."""
    import av

    skip: Any = [{"skip_frame": "all"}] * PROBED_STREAMS  # stub: list[str]
    try:
        with av.open(source, options=options, timeout=timeout_s, stream_options=skip) as opened:
            if not opened.streams.video:
                return None
            codec = opened.streams.video[0].codec_context
            return (codec.width, codec.height) if codec.width and codec.height else None
    except (av.error.FFmpegError, ValueError):
        return None


def lower_priority(nice: int) -> None:
    """This thread's nice value raised to at least ``nice`` (Linux: per thread; threads it
    starts inherit it). Elsewhere, or refused, nothing changes."""
    try:
        tid = threading.get_native_id()
        current = os.getpriority(os.PRIO_PROCESS, tid)
        if current < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    except (AttributeError, OSError) as exc:  # not Linux, or not allowed
        log.debug("job thread priority unchanged: %s", exc)


def _waited(timeout_s: tuple[float, float], which: int) -> str:
    """Why FFmpeg's wait was cut short (its ``ExitError``, "Immediate exit requested"): no
    answer to the open (``which`` 0) or no data read (1) within its timeout, and the setting."""
    if which == 0:
        return f"no answer within {timeout_s[0]:g} s (setting STREAMDET_STREAM_OPEN_TIMEOUT_S)"
    return f"no data for {timeout_s[1]:g} s (setting STREAMDET_STREAM_READ_TIMEOUT_S)"


def _reason(exc: Exception) -> str:
    """FFmpeg's reason without the file's name (a path on the server)."""
    return str(getattr(exc, "strerror", None) or exc)


def _duration(container: Any, stream: Any) -> float | None:
    if stream.duration is not None and stream.time_base:
        return float(stream.duration * stream.time_base)
    if container.duration:
        return float(container.duration) / 1e6
    return None


def _frames(
    container: Any, stream: Any, errors: list[int] | None, max_pixels: int = 0
) -> Iterator[Any]:
    """Every frame, a packet that does not decode skipped (and counted in ``errors[0]``);
    with ``max_pixels``, a frame over it is refused by the decoder (:func:`bound_decoder`).

    Raises:
        JobError: the frames grew over ``max_pixels`` part way.
    """
    import av

    stream.thread_type = "AUTO"
    if max_pixels:
        bound_decoder(stream, max_pixels)
    for packet in container.demux(stream):
        try:
            frames = packet.decode()
        except av.error.InvalidDataError:
            if max_pixels and (size := refused_size(stream, max_pixels)):
                raise JobError(too_large_message(*size, max_pixels)) from None
            if errors is not None:
                errors[0] += 1
            continue
        for frame in frames:
            yield upright(frame)


def sampled_frames(
    spec: JobSpec, progress: JobProgress, stopped: Callable[[], None]
) -> Generator[tuple[int, float, Any], None, None]:
    """Open ``spec.source`` and yield each sampled frame: its number in the file, its time in
    the video and the ``av.VideoFrame``; ``progress`` follows every frame read.

    Raises:
        JobError: the video cannot be opened or read, or a frame is too large.
        JobCancelled: from ``stopped``.
    """
    import av

    try:
        container = av.open(spec.source, options=spec.options, timeout=spec.timeout_s)
    except av.error.ExitError:  # FFmpeg's wait cut short by the timeout
        raise JobError(f"cannot open the video: {_waited(spec.timeout_s, 0)}") from None
    except av.error.FFmpegError as exc:
        raise JobError(f"cannot open the video: {_reason(exc)}") from None
    with container:
        if not container.streams.video:
            raise JobError("the video has no video stream")
        stream = container.streams.video[0]
        progress.duration_s = _duration(container, stream)
        rate = float(stream.average_rate) if stream.average_rate else 25.0
        sampler = Sampler(spec.fps)
        errors = [0]
        first: float | None = None
        # Times from the video's start, as players show them: an MPEG-TS or HLS recording
        # starts at 1.4 s or later, a cut at its place in the whole (its progress was 1.0
        # from the first frame, and its count rows did not start at 0 s).
        start = container.start_time / av.time_base if container.start_time is not None else None
        try:
            for index, frame in enumerate(_frames(container, stream, errors, spec.max_pixels)):
                stopped()
                progress.frames_read = index + 1
                progress.decode_errors = errors[0]
                if frame.time is None:
                    t = index / rate
                else:
                    if start is None:
                        start = frame.time
                    t = frame.time - start
                if first is not None and t - progress.position_s > max(GAP_S, 10.0 / rate):
                    # A part of the video is missing (an HLS segment the server no longer
                    # has, a recording's break): FFmpeg reads on past it, without a word.
                    progress.gaps_s += t - progress.position_s - 1.0 / rate
                progress.position_s = t
                if first is None:
                    first = t
                if not sampler.keep(t):
                    continue
                if frame.width * frame.height > spec.max_pixels:  # a decoder without the option
                    raise JobError(too_large_message(frame.width, frame.height, spec.max_pixels))
                yield index, t, frame
        except av.error.FFmpegError as exc:
            why = _waited(spec.timeout_s, 1) if isinstance(exc, av.error.ExitError) else None
            raise JobError(
                f"reading the video failed at {progress.position_s:.2f} s: {why or _reason(exc)}"
            ) from None
        progress.decode_errors = errors[0]
        if progress.frames_read:  # read to the end of its last frame: a whole video shows 1
            progress.position_s += 1.0 / rate
        _check_whole(container, stream, first, progress.position_s)


GAP_S = 1.0
"""Frames further apart than this (and ten frames) are a gap in the video (``gaps_s``)."""

ESTIMATED_DURATIONS = ("mpegts", "mpeg")
"""Formats whose duration FFmpeg estimates (from the bit rate), not reads from an index."""


def _check_whole(container: Any, stream: Any, first: float | None, end: float) -> None:
    """Raise where a video whose index states its length ended well before it: a file cut
    short (an upload or copy interrupted, a camera's card pulled) read to its cut and was
    "done", its results half a video's, as if whole.

    Raises:
        JobError: it ended over a second (and 2 %) before the length its index states.
    """
    if stream.duration is None or not stream.time_base or first is None:
        return
    if container.format.name in ESTIMATED_DURATIONS:
        return
    stated = float(stream.duration * stream.time_base)
    read = end - first
    if read < stated - max(1.0, 0.02 * stated):
        raise JobError(
            f"the video ends at {end:.2f} s of the {stated:.2f} s its index states: it is cut"
            " short (truncated or damaged)"
        )


def local_frames(
    spec: JobSpec, progress: JobProgress, stopped: Callable[[], None], max_side: int
) -> Generator[tuple[int, float, Image, tuple[int, int]], None, None]:
    """:func:`sampled_frames` decoded here, in the job's thread, as RGB of at most
    ``max_side`` pixels a side, with the size they have in the video."""
    for index, t, frame in sampled_frames(spec, progress, stopped):
        source = (frame.width, frame.height)
        yield index, t, frame_rgb(frame, decoded_size(*source, max_side)), source


FrameSource = Callable[
    [JobSpec, JobProgress, Callable[[], None], int],
    Generator[tuple[int, float, Image, tuple[int, int]], None, None],
]
"""Where a job's frames come from: :func:`local_frames`, or a decode process
(:meth:`streams.decode_procs.DecodeHub.job_frames`)."""


def run_job(
    spec: JobSpec,
    submit: Callable[[WorkItem], None],
    directory: Path,
    name_of: Callable[[int], str],
    *,
    inflight: int,
    cancel: threading.Event,
    interrupt: threading.Event,
    progress: JobProgress,
    job_id: str = "",
    nice: int = 0,
    sink: FrameSink | None = None,
    frames: FrameSource = local_frames,
) -> dict[str, Any]:
    """Read the whole video through the engines; returns the counts (``GET /streams/{id}``'s
    ``detections``, ``tracked``, ``crossings``, ``zones``).

    ``sink`` gets every processed frame, in order, and is closed at the end whatever
    happens. ``nice`` lowers the CPU priority of the calling thread (and of FFmpeg's decoding
    threads, which it starts) for good, on Linux: call it from a thread kept for jobs.
    ``frames`` decodes the video (here by default; a decode process's hub can).

    Raises:
        JobError: the video cannot be opened or read, or a frame is too large.
        JobCancelled: ``cancel`` or ``interrupt`` was set, or the pool closed.
    """
    if nice:
        lower_priority(nice)

    directory.mkdir(parents=True, exist_ok=True)
    analytics = StreamAnalytics()
    pending: deque[_Sampled] = deque()
    last: _Sampled | None = None
    progress.started_mono = time.monotonic()

    def stopped() -> None:
        if interrupt.is_set():
            raise JobCancelled(interrupted=True)
        if cancel.is_set():
            raise JobCancelled(interrupted=False)

    finish = functools.partial(
        _finish,
        job_id=job_id,
        spec=spec,
        analytics=analytics,
        name_of=name_of,
        progress=progress,
        stopped=stopped,
        sink=sink,
    )
    max_side = 0 if sink is not None else spec.decode_max_side  # a drawn video: whole
    with (
        contextlib.closing(sink) if sink is not None else contextlib.nullcontext(),
        contextlib.closing(frames(spec, progress, stopped, max_side)) as decoded,
        # A line at a time (line buffered), so followers and readers of a running job get
        # each frame and event as it is done (an 8 kB buffer held events until the job's end).
        (directory / FRAMES_FILE).open("w", encoding="utf-8", buffering=1) as frames_out,
        (directory / EVENTS_FILE).open("w", encoding="utf-8", buffering=1) as events_out,
    ):
        # A frame's line is written once it is done, but for one that may be the video's
        # last (none read after it yet): its line waits for the next frame to be read, or
        # carries the exits of what was still in a zone at the video's end (as events.ndjson
        # has them).
        held: tuple[dict[str, Any], list[str]] | None = None

        def flush() -> None:
            nonlocal held
            if held is not None:
                _write(frames_out, events_out, held)
                held = None

        def done(lines: tuple[dict[str, Any], list[str]]) -> None:
            nonlocal held
            flush()
            if pending:
                _write(frames_out, events_out, lines)
            else:
                held = lines

        try:
            try:
                for index, t, image, source in decoded:
                    flush()  # not the last frame
                    result: Future[WorkResult] = Future()
                    submit(
                        WorkItem(
                            image,
                            spec.detect.engine_params,
                            deadline=time.monotonic() + BACKGROUND_DEADLINE_S,
                            on_done=result.set_result,
                            request_id=f"job:{job_id}:{index}",
                        )
                    )
                    pending.append(last := _Sampled(index, t, image, result, source))
                    while len(pending) >= inflight:
                        done(finish(pending.popleft()))
            except PoolClosed:
                raise JobCancelled(interrupted=True) from None
            except JobError as exc:  # the video failed part way: the frames sent to run are kept
                while pending:
                    done(finish(pending.popleft()))
                exc.counts = _whole_video_counts(analytics)  # and counted (it was null)
                raise
            while pending:
                done(finish(pending.popleft()))
            if last is not None and held is not None:  # what is still in a zone leaves it, lost
                ended = [
                    {**e.to_json(name_of), "pts": round(last.pts, 4)}
                    for e in analytics.end(last.index, name_of)
                ]
                if ended:
                    progress.events += len(ended)
                    held[0].setdefault("events", []).extend(ended)
                    held[1].extend(_dumps(event) for event in ended)
        finally:  # a job cut short keeps every frame it finished
            flush()
    if progress.gaps_s:
        log.warning(
            "job %s: %.1f s of its video are missing (its frames jump: an HLS segment gone,"
            " a recording's break); its results leave them out (progress.gaps_s)",
            job_id,
            progress.gaps_s,
        )
    return _whole_video_counts(analytics)


def _whole_video_counts(analytics: StreamAnalytics) -> dict[str, Any]:
    """A job's counts: the analytics' without what only a last frame means."""
    counts = analytics.snapshot()
    for last_frame in ("objects", "stationary"):  # meaningless for a whole video
        counts.pop(last_frame, None)
    for zone in counts.get("zones", {}).values():
        zone.pop("now", None)
    return counts


def _finish(
    sampled: _Sampled,
    *,
    job_id: str,
    spec: JobSpec,
    analytics: StreamAnalytics,
    name_of: Callable[[int], str],
    progress: JobProgress,
    stopped: Callable[[], None],
    sink: FrameSink | None,
) -> tuple[dict[str, Any], list[str]]:
    """Wait for a frame's result and take it through the analytics, in frame order; returns
    its line of ``frames.ndjson`` (to be written) and its lines of ``events.ndjson``."""
    while True:
        stopped()
        try:
            result = sampled.result.result(timeout=POLL_S)
            break
        except TimeoutError:
            continue
    line: dict[str, Any] = {"frame": sampled.index, "pts": round(sampled.pts, 4)}
    events: list[str] = []
    if result.detections is None:
        if isinstance(result.error, PoolClosed):
            raise JobCancelled(interrupted=True)
        progress.frames_failed += 1
        # Named by its id, never its source (a URL's password and token); the first at
        # WARNING, the rest at DEBUG (its frames_failed counts them): one a frame flooded.
        level = logging.WARNING if progress.frames_failed == 1 else logging.DEBUG
        log.log(level, "job %s: frame %d failed: %s", job_id, sampled.index, result.error)
        width, height = sampled.source
        line.update(width=width, height=height, detections=[], error=str(result.error))
        if sink is not None:
            sink.write(sampled.image, None, sampled.pts, analytics.snapshot())
    else:
        done: Analysed = analytics.process(
            result.detections.rescaled(*sampled.source), spec.detect, sampled.pts, sampled.index
        )
        detections = detections_json(
            done.detections, done.zones, done.dwell, done.still, done.stationary_s
        )
        line.update(
            width=done.detections.width, height=done.detections.height, detections=detections
        )
        if done.events:
            found = [
                {**event.to_json(name_of), "pts": round(sampled.pts, 4)} for event in done.events
            ]
            line["events"] = found
            events = [_dumps(event) for event in found]
        progress.frames_processed += 1
        if sink is not None:
            sink.write(sampled.image, done.detections, sampled.pts, analytics.snapshot())
    progress.events += len(events)
    return line, events


def _write(frames_out: TextIO, events_out: TextIO, lines: tuple[dict[str, Any], list[str]]) -> None:
    frame_line, events = lines
    frames_out.write(_dumps(frame_line) + "\n")
    for event in events:
        events_out.write(event + "\n")


def _dumps(value: dict[str, Any]) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=False)
