"""Motion gating: a stream with ``motion`` on runs the detector only on frames where something
moved, as Frigate runs its object detection on motion, so a CPU serves many more cameras that
look at still scenes most of the time.

Each sampled frame's grey picture (the luma plane the decoder made: no conversion for frames
that are not inferred) is scaled down to about :data:`WIDTH` pixels wide, blurred, and
compared with a running average of the frames before it (which absorbs slow changes of light);
the frame *moved* when more than ``min_area`` of its pixels differ by more than ``threshold``
grey levels. A frame that did not move is skipped, unless the stream's last inferred frame is
``1 / idle_fps`` seconds old: still objects (a parked car) are detected that often, so their
tracks, zone stays and ``dwell_s`` carry on (tracks end after 1 s unseen).

Runs on the stream's decode thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import cv2
import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from streams.detect import Roi

WIDTH = 160
"""About the width of the picture motion is measured on (height: the frame's aspect)."""
AVERAGE_ALPHA = 0.2
"""Weight of each new frame in the running average it is compared with."""


@dataclass(frozen=True, slots=True)
class MotionOptions:
    """How motion is measured (from settings).

    Attributes:
        threshold: grey levels (0-255) a pixel must change by to count as moving.
        min_area: share of the picture that must move for the frame to be inferred.
        idle_fps: still frames are inferred at least this often.
    """

    threshold: int = 25
    min_area: float = 0.002
    idle_fps: float = 2.0


YUV_FORMATS = frozenset(
    {"yuv420p", "yuvj420p", "yuv422p", "yuvj422p", "yuv444p", "yuvj444p", "nv12", "nv21"}
)
"""Decoded formats whose first plane is the grey picture (luma) itself."""


def luma(frame: Any) -> npt.NDArray[np.uint8]:
    """The grey picture of a decoded ``av.VideoFrame``: its luma plane as it is, without a
    copy, where the decoder gives YUV (what H.264 and H.265 cameras send), else converted."""
    if frame.format.name in YUV_FORMATS:
        plane = frame.planes[0]
        rows = np.frombuffer(plane, np.uint8).reshape(plane.height, plane.line_size)
        return rows[:, : plane.width]
    gray: npt.NDArray[np.uint8] = frame.to_ndarray(format="gray")
    return gray


def shrink(gray: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
    """``gray`` averaged over blocks of k x k pixels, k the whole number that brings its width
    nearest :data:`WIDTH` from above (OpenCV's fast path: 0.1 ms where an odd ratio costs 1)."""
    height, width = gray.shape
    k = max(1, width // WIDTH)
    if k == 1:
        return np.ascontiguousarray(gray)
    cropped = gray[: height - height % k, : width - width % k]
    size = (cropped.shape[1] // k, cropped.shape[0] // k)
    return np.asarray(cv2.resize(cropped, size, interpolation=cv2.INTER_AREA), np.uint8)


class MotionGate:
    """Decides frame by frame whether a stream's frame is inferred.

    Args:
        options: see :class:`MotionOptions`.
    """

    def __init__(self, options: MotionOptions) -> None:
        self.options = options
        self._average: npt.NDArray[np.float32] | None = None
        self._idle_due = float("-inf")  # when a still frame is to be inferred next
        self._mask: tuple[tuple[tuple[int, ...], tuple[Roi, ...]], npt.NDArray[np.bool_]] | None = (
            None
        )
        self.moving = False
        """Whether the last frame looked at moved."""
        self.area = 0.0
        """Share of the last frame's picture that moved."""

    def measure(
        self,
        gray: npt.NDArray[np.uint8],
        mask: Sequence[Roi] = (),
        min_area: float | None = None,
        threshold: int | None = None,
    ) -> bool:
        """Whether the small grey picture ``gray`` moved against the frames before it (the
        first one always does), outside the polygons of ``mask``, by more than ``threshold``
        grey levels over more than ``min_area`` (``None``: the options'); updates the running
        average."""
        blurred = cv2.GaussianBlur(gray, (5, 5), 0).astype(np.float32)
        if self._average is None or self._average.shape != blurred.shape:
            self._average = blurred
            self.area, self.moving = 1.0, True
            return True
        level = self.options.threshold if threshold is None else threshold
        changed = np.abs(blurred - self._average) > level
        cv2.accumulateWeighted(blurred, self._average, AVERAGE_ALPHA)
        if mask:
            watched = ~self._masked(changed.shape, tuple(mask))
            changed = changed[watched] if watched.any() else np.zeros(1, bool)
        self.area = float(changed.mean())
        self.moving = self.area > (self.options.min_area if min_area is None else min_area)
        return self.moving

    def _masked(self, shape: tuple[int, ...], mask: tuple[Roi, ...]) -> npt.NDArray[np.bool_]:
        """Which pixels of a picture of ``shape`` the polygons cover (kept until either
        changes)."""
        if self._mask is None or self._mask[0] != (shape, mask):
            height, width = shape
            covered = np.zeros((height, width), np.uint8)
            for polygon in mask:
                corners = np.array([[x * width, y * height] for x, y in polygon.points])
                cv2.fillPoly(covered, [corners.round().astype(np.int32)], 1)
            self._mask = ((shape, mask), covered.astype(bool))
        return self._mask[1]

    def infer(
        self,
        frame: Any,
        now: float,
        mask: Sequence[Roi] = (),
        min_area: float | None = None,
        threshold: int | None = None,
    ) -> bool:
        """Whether the decoded ``frame`` (an ``av.VideoFrame``) at monotonic time ``now`` is
        to be inferred: it moved outside ``mask`` (see :meth:`measure`), or a still frame is
        due (``idle_fps`` a second, kept to however often frames come)."""
        moved = self.measure(shrink(luma(frame)), mask, min_area, threshold)
        if not moved and now < self._idle_due:
            return False
        # A still frame is due an interval after the last one was due, not after it came:
        # frames come at the stream's max_fps, and one taken late made the next late too
        # (1.25 a second at max_fps 5 where 1.5 were set).
        interval = 1.0 / self.options.idle_fps
        late = now - self._idle_due
        self._idle_due = now + interval if moved or late >= interval else self._idle_due + interval
        return True

    def reset(self) -> None:
        """A new source (reconnected): its first frame is compared with nothing."""
        self._average = None
