"""When a ``file://`` source's next frame is due: a file plays as the camera it stands for.

A file decodes far faster than real time. Each frame is due one step after the one before:
the step of its timestamps, or ``1/file_fps`` where a rate is set. Where the timestamps go
back (the file looped, or was cut from two recordings) or leap more than
:data:`MAX_PTS_STEP_S`, the step is one frame interval of the video, so a looped file goes
on at its rate instead of starting over as fast as it reopens, and a looped still image is a
camera of that picture, not a decode loop (it was: ~80 opens a second here). A pacer more
than :data:`MAX_BEHIND_S` behind (a slow decode, a reconnect's wait) starts afresh rather
than rush to catch up.
"""

from __future__ import annotations

from fractions import Fraction

MAX_PTS_STEP_S = 60.0
"""A longer leap of the timestamps is a cut, not a wait (a keyframe-only group is shorter)."""
MAX_BEHIND_S = 1.0
DEFAULT_FPS = 25.0
"""A video that states no rate (a still image's demuxer says 25 too)."""


def frame_interval(rate: Fraction | float | None) -> float:
    """Seconds between frames of a video at ``rate`` frames/s (PyAV's ``average_rate`` or
    ``guessed_rate``), kept to 1..120 frames/s; :data:`DEFAULT_FPS` where it states none."""
    fps = float(rate) if rate else DEFAULT_FPS
    return 1.0 / min(120.0, max(1.0, fps))


class FilePacer:
    """Each frame's due time (``time.monotonic()``), kept across the file's loops.

    Args:
        file_fps: ``None``: the frames' own timestamps; else this many frames a second (a
            rate of 0 is no pacing: the reader does not ask).
    """

    def __init__(self, file_fps: float | None = None) -> None:
        self._step = 1.0 / file_fps if file_fps else None
        self._due: float | None = None
        self._pts: float | None = None

    def due(self, pts: float | None, now: float, interval: float) -> float:
        """When the frame with timestamp ``pts`` (seconds; ``None``: unknown), decoded at
        ``now``, is due; ``interval``: the video's frame interval (:func:`frame_interval`)."""
        step = self._step
        if step is None:
            leap = None if pts is None or self._pts is None else pts - self._pts
            step = leap if leap is not None and 0.0 < leap <= MAX_PTS_STEP_S else interval
        if pts is not None:
            self._pts = pts
        due = now if self._due is None else self._due + step
        if due < now - MAX_BEHIND_S:
            due = now
        self._due = due
        return due


EARLY_SHARE = 0.05
"""A frame may always be taken this share of ``1/max_fps`` early (a keyframe 4.8 s after the
last at ``max_fps`` 0.2: :data:`streams.frames.KEYFRAME_SLACK`)."""


class RateSampler:
    """Which frames a stream's ``max_fps`` takes: one every ``1/max_fps`` seconds on average,
    each taken up to half the gap between the frames that come (at most half a step, at
    least :data:`EARLY_SHARE` of it) early, so a camera a little faster than ``max_fps``
    gives ``max_fps`` (frames spaced at least ``0.95/max_fps`` apart took every other frame
    of a 12.5 fps camera at ``max_fps`` 10: 6.25), and keyframes 4.8 s apart (keyframe-only
    decode) are each taken at ``max_fps`` 0.2. A gap (a slow decode, a reconnect) is not made
    up with a burst."""

    def __init__(self) -> None:
        self._due: float | None = None
        self._came: float | None = None  # when the last frame came
        self._rate: float | None = None  # the max_fps _due was set with

    def take(self, now: float, max_fps: float | None) -> bool:
        """Whether the frame that came at ``now`` (monotonic) is taken; ``max_fps`` ``None``
        or 0: every frame is."""
        gap = 0.0 if self._came is None else max(0.0, now - self._came)
        self._came = now
        if not max_fps:
            return True
        step = 1.0 / max_fps
        early = max(EARLY_SHARE * step, min(step, gap) / 2)
        due = self._due
        if max_fps != self._rate:  # changed (PATCH): the next frame is due at the new rate
            self._rate = max_fps
            if due is not None:
                due = min(due, now - gap + step)  # a step after the frame before this one
        if due is not None and now < due - early:
            return False
        if due is None or due < now - early:  # the first frame, or behind: afresh
            due = now
        self._due = due + step
        return True
