"""Object tracking within a stream: a ``track_id`` that stays with an object from frame to
frame, so overlays keep their labels steady and objects can be counted once, not once per
frame.

The tracker is SORT-like and runs on the detections alone (no appearance model): each track
predicts where its box is now from its velocity, predicted boxes and new detections are paired
greedily by IoU (best pair first), a paired track takes the new box and updates its velocity,
an unpaired detection starts a track, and a track not seen for ``max_age_s`` ends. Time is the
frames' decode time, not a frame count, because a live stream drops frames under load: a car
that skips three frames is predicted three frames further on. Classes are ignored when
pairing (as Ultralytics' ByteTrack does): a small model often flips one vehicle between
``car`` and ``truck`` from frame to frame, and the track takes the newest class; and where
class-aware NMS leaves two boxes of different classes on one object, both carry its id.

A track counts as an object once it was seen in ``min_hits`` frames, so a single-frame false
positive is not counted.

As ByteTrack does, detections under the stream's confidence threshold (``low``, down to
``streams.detect.LOW_CONF``) get a second chance: after the confident detections are paired,
a track left without one takes the low-confidence box that overlaps its prediction by at
least :data:`LOW_IOU_MATCH`. An object whose confidence dips for a few frames (partly hidden,
blurred, at the edge of the picture) keeps its track, its box and its id instead of
vanishing and coming back as a new object. Low-confidence boxes never start a track, and
those no track takes are dropped.
"""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from engines.types import Detections
from engines.yolo import box_iou, box_iou_rows

IOU_MATCH = 0.2
"""Least IoU between a track's predicted box and a detection for them to be paired."""
MAX_AGE_S = 1.0
"""A track not seen for this long ends (about Ultralytics' 30-frame buffer at 30 fps), or
for :data:`MAX_AGE_FRAMES` of the stream's frames where they come further apart."""
MAX_AGE_FRAMES = 3
"""Frames a track lives unseen at least, however far apart they come (a stream at max_fps
0.5, a snapshot camera polled once a second, a job at fps 0.9): with a fixed second, every
frame started every object anew, and nothing was tracked, crossed or entered."""
GAPS_KEPT = 9
"""Recent gaps between frames whose median is the stream's frame interval (one long gap, a
reconnect, does not make it)."""
MIN_HITS = 3
"""Frames a track must be seen in before it counts as an object."""
LOW_IOU_MATCH = 0.5
"""Least IoU for a track to take a low-confidence detection (ByteTrack's second association,
stricter than the first: a weak box must sit where the track is expected)."""
DUPLICATE_IOU = 0.8
"""A detection this close to one that has an id in the same frame is the same object under
another class (class-aware NMS keeps a ``car`` and a ``truck`` box on one vehicle): it shares
that id rather than starting a track."""
VELOCITY_SMOOTHING = 0.5
"""Weight of the newest velocity measurement against the running estimate."""
STATIONARY_S = 10.0
"""An object that has stood still this long is stationary (a parked car, a person waiting):
its detections say so, and its stream counts it apart."""
STILL_IOU = 0.8
"""A track whose box still overlaps the box it settled at by this much has not moved: a
parked car's box jitters well within it, a walking person leaves it in a step."""

Boxes = npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class Tracked:
    """One frame's tracking result.

    Attributes:
        detections: the frame's detections with ``track_ids`` set.
        new_objects: class ids of the tracks that became objects (reached ``min_hits``) on
            this frame, one entry per object.
    """

    detections: Detections
    new_objects: list[int]


class Tracker:
    """Tracks of one stream. Not thread-safe: its stream calls it in frame order.

    Args:
        iou_match: least IoU for pairing a predicted box with a detection.
        max_age_s: how long a track lives unseen.
        min_hits: frames seen before a track counts as an object.

    Raises:
        ValueError: a setting out of range.
    """

    def __init__(
        self,
        *,
        iou_match: float = IOU_MATCH,
        max_age_s: float = MAX_AGE_S,
        min_hits: int = MIN_HITS,
    ) -> None:
        if not 0.0 < iou_match <= 1.0:
            raise ValueError(f"iou_match must be in (0, 1], got {iou_match}")
        if max_age_s <= 0:
            raise ValueError(f"max_age_s must be > 0, got {max_age_s}")
        if min_hits < 1:
            raise ValueError(f"min_hits must be >= 1, got {min_hits}")
        self.iou_match = iou_match
        self.max_age_s = max_age_s
        self.min_hits = min_hits
        # One row per live track: arrays, not an object per track (50 tracks: 0.2 ms a frame
        # against 1.1 ms; 300: 5 against 9; `python -m benchmarks.track_bench`).
        self._ids = np.zeros(0, np.int64)
        self._boxes = np.zeros((0, 4))  # last seen, xyxy pixels
        self._velocity = np.zeros((0, 4))  # pixels/s per coordinate
        self._seen_at = np.zeros(0)
        self._hits = np.zeros(0, np.int64)
        self._settled = np.zeros((0, 4))  # where each track has stood since _settled_at
        self._settled_at = np.zeros(0)
        self._next_id = 1
        self._last_t: float | None = None
        self._gaps: collections.deque[float] = collections.deque(maxlen=GAPS_KEPT)
        self._size: tuple[int, int] | None = None  # the frames' width and height

    def __len__(self) -> int:
        """Live tracks."""
        return int(self._ids.shape[0])

    def live_ids(self) -> list[int]:
        """The ids of the live tracks, seen in this frame or recently."""
        ids: list[int] = self._ids.tolist()
        return ids

    def confirmed_ids(self) -> set[int]:
        """The ids of the live tracks that are objects: seen in ``min_hits`` frames."""
        return set(self._ids[self._hits >= self.min_hits].tolist())

    def still_seconds(self, ids: npt.NDArray[np.int64]) -> list[float]:
        """For each track id, how long its object has stood still: seconds from when it
        settled (its box moved less than :data:`STILL_IOU` since) to when it was last seen;
        0 for an id no live track has."""
        row_of = {track_id: row for row, track_id in enumerate(self._ids.tolist())}
        still = self._seen_at - self._settled_at
        return [float(still[row_of[i]]) if i in row_of else 0.0 for i in ids.tolist()]

    def _max_age(self, t: float) -> float:
        """How long a track lives unseen, with the frame at ``t`` counted in the stream's
        frame interval: :attr:`max_age_s`, or :data:`MAX_AGE_FRAMES` frame intervals."""
        if self._last_t is not None and t > self._last_t:
            self._gaps.append(t - self._last_t)
        self._last_t = t if self._last_t is None else max(t, self._last_t)
        if not self._gaps:
            return self.max_age_s
        interval = sorted(self._gaps)[len(self._gaps) // 2]
        return max(self.max_age_s, MAX_AGE_FRAMES * interval)

    def clear(self) -> None:
        """End every track (ids are not reused: a later track gets a new one)."""
        if len(self):  # called for every frame of an untracked stream: nothing to do there
            self._keep(np.zeros(len(self), bool))

    def update(self, detections: Detections, t: float, low: Detections | None = None) -> Tracked:
        """Pair ``detections`` (a frame decoded at ``t`` seconds, monotonic) with the tracks;
        then the tracks left unpaired with ``low``, the frame's detections under the stream's
        confidence threshold. The result holds ``detections`` and the ``low`` ones a track
        took, in that order.

        Frames must come in order of ``t``; an older frame than the last one is treated as
        if it were taken at the last one's time.
        """
        self._keep(t - self._seen_at <= self._max_age(t))
        self._resize(detections.width, detections.height)
        boxes = detections.boxes.astype(np.float64)
        classes = detections.class_ids
        n = len(detections)
        ids = np.zeros(n, np.int64)
        new_objects: list[int] = []
        since = np.maximum(t - self._seen_at, 0.0)
        paired: set[int] = set()
        if len(self) and n:
            iou = box_iou(self._boxes + self._velocity * since[:, None], boxes)
            # Greedy, best pair first; only pairs over the threshold are sorted.
            candidates = np.argwhere(iou >= self.iou_match)
            order = np.argsort(-iou[candidates[:, 0], candidates[:, 1]], kind="stable")
            tracks: list[int] = []
            found: list[int] = []
            for ti, di in candidates[order].tolist():
                if ti not in paired and not ids[di]:
                    paired.add(ti)
                    ids[di] = self._ids[ti]
                    tracks.append(ti)
                    found.append(di)
            if tracks:
                rows, cols = np.array(tracks), np.array(found)
                self._follow(rows, boxes[cols], since[rows])
                confirmed = self._hits[rows] == self.min_hits
                new_objects += [int(c) for c in classes[cols[confirmed]]]
        unpaired = np.flatnonzero(ids == 0)
        same = box_iou(boxes[unpaired], boxes) >= DUPLICATE_IOU
        started: list[int] = []
        for row, di in enumerate(unpaired.tolist()):
            twins = np.flatnonzero(same[row] & (ids != 0))
            if twins.size:  # a second class on an object that already has its id this frame
                ids[di] = ids[twins[0]]
                continue
            ids[di] = self._next_id
            self._next_id += 1
            started.append(di)
        result = dataclasses.replace(detections, track_ids=ids)
        if low is not None and len(low):
            # Before the new tracks start: only tracks that were live take a weak box.
            result = self._second_chance(result, low, since, paired)
        if started:
            self._start(ids[started], boxes[started], t)
            if self.min_hits == 1:
                new_objects += [int(c) for c in classes[started]]
        return Tracked(result, new_objects)

    def _resize(self, width: int, height: int) -> None:
        """Frames now ``width`` x ``height``: the tracks' boxes (pixels) are scaled to them. A
        camera that changes resolution mid-stream (an NVR switching to the sub-stream, a
        camera's bitrate ladder) shows the same objects in the same places: compared in the
        old pixels, none paired, and every object began again under a new id (counted again
        as it crossed a line or entered a zone)."""
        if not width or not height:
            return
        if self._size is not None and self._size != (width, height) and len(self):
            sx, sy = width / self._size[0], height / self._size[1]
            scale = np.array([sx, sy, sx, sy])
            self._boxes = self._boxes * scale
            self._velocity = self._velocity * scale
            self._settled = self._settled * scale
        self._size = (width, height)

    def _second_chance(
        self,
        frame: Detections,
        low: Detections,
        since: npt.NDArray[np.float64],
        paired: set[int],
    ) -> Detections:
        """ByteTrack's second association: objects unpaired in ``frame`` take the ``low``
        boxes over their predictions, best pair first; ``frame`` with those added."""
        # Only objects (tracks seen min_hits times) take weak boxes: a weak box never makes
        # a one-frame false positive an object (ByteTrack matches them to confirmed tracks).
        rows = np.array(
            [r for r in range(len(self)) if r not in paired and self._hits[r] >= self.min_hits],
            np.int64,
        )
        if not rows.size:
            return frame
        boxes = low.boxes.astype(np.float64)
        predicted = self._boxes[rows] + self._velocity[rows] * since[rows][:, None]
        iou = box_iou(predicted, boxes)
        candidates = np.argwhere(iou >= LOW_IOU_MATCH)
        order = np.argsort(-iou[candidates[:, 0], candidates[:, 1]], kind="stable")
        tracks: list[int] = []
        found: list[int] = []
        for ri, di in candidates[order].tolist():
            if rows[ri] not in tracks and di not in found:
                tracks.append(int(rows[ri]))
                found.append(di)
        if not tracks:
            return frame
        taken, cols = np.array(tracks), np.array(found)
        track_ids = self._ids[taken]
        self._follow(taken, boxes[cols], since[taken])
        # Low boxes are all under the confident ones: scores stay in descending order.
        ordered = np.argsort(-low.scores[cols], kind="stable")
        cols, track_ids = cols[ordered], track_ids[ordered]
        assert frame.track_ids is not None
        return dataclasses.replace(
            frame,
            boxes=np.concatenate([frame.boxes, low.boxes[cols]]),
            scores=np.concatenate([frame.scores, low.scores[cols]]),
            class_ids=np.concatenate([frame.class_ids, low.class_ids[cols]]),
            track_ids=np.concatenate([frame.track_ids, track_ids]),
        )

    def _keep(self, rows: npt.NDArray[np.bool_]) -> None:
        self._ids, self._boxes, self._velocity = (
            self._ids[rows],
            self._boxes[rows],
            self._velocity[rows],
        )
        self._seen_at, self._hits = self._seen_at[rows], self._hits[rows]
        self._settled, self._settled_at = self._settled[rows], self._settled_at[rows]

    def _start(self, ids: npt.NDArray[np.int64], boxes: Boxes, t: float) -> None:
        self._ids = np.concatenate([self._ids, ids])
        self._boxes = np.concatenate([self._boxes, boxes])
        self._velocity = np.concatenate([self._velocity, np.zeros_like(boxes)])
        self._seen_at = np.concatenate([self._seen_at, np.full(len(ids), t)])
        self._hits = np.concatenate([self._hits, np.ones(len(ids), np.int64)])
        self._settled = np.concatenate([self._settled, boxes])
        self._settled_at = np.concatenate([self._settled_at, np.full(len(ids), t)])

    def _follow(self, rows: npt.NDArray[np.int64], boxes: Boxes, dt: Boxes) -> None:
        """Tracks ``rows`` seen again at ``boxes``, ``dt`` seconds after they were last seen."""
        # Two frames decoded within a millisecond say nothing about speed.
        timed = dt > 1e-3
        measured = (boxes - self._boxes[rows]) / np.where(timed, dt, 1.0)[:, None]
        first = (self._hits[rows] == 1)[:, None]
        smoothed = VELOCITY_SMOOTHING * measured + (1 - VELOCITY_SMOOTHING) * self._velocity[rows]
        self._velocity[rows] = np.where(
            timed[:, None], np.where(first, measured, smoothed), self._velocity[rows]
        )
        self._boxes[rows] = boxes
        self._seen_at[rows] = self._seen_at[rows] + dt
        self._hits[rows] += 1
        moved = box_iou_rows(boxes, self._settled[rows]) < STILL_IOU
        if moved.any():  # settles anew where it is now
            self._settled[rows[moved]] = boxes[moved]
            self._settled_at[rows[moved]] = self._seen_at[rows[moved]]
