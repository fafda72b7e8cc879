"""Counting lines: how many tracked objects crossed a line drawn on a stream's picture, and
which way (DeepStream's nvdsanalytics and Roboflow's ``LineZone`` do the same).

A line is a segment between two points in 0..1 of the frame. An object crosses it when the
anchor of its box (the bottom centre, where it stands, as regions use) moves from one side of
the segment to the other between two frames in which its track was seen, and the move passes
between the segment's ends. An object standing on a line (a car queued at a stop line, its
box's bottom jittering a pixel either way) crosses nothing: once it has a side, its side
changes only when its anchor is past :data:`BAND` of its box's height from the line, so a
crossing is a move to clearly the other side (it was counted in and out 27 times in 30 s;
Roboflow's ``LineZone`` has ``minimum_crossing_threshold`` for the same). Standing at ``a`` and
looking at ``b`` in the picture, a crossing towards the right-hand side is ``in``, towards the
left ``out``: for a line drawn left to right across the picture, ``in`` is moving down it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from engines.types import Detections
from streams.geometry import (
    BAND,
    Point,
    Seen,
    anchors,
    check_name,
    check_point,
    heights,
    parse_class_names,
    parse_named,
    parse_points,
)

MAX_LINES = 16
MIN_LINE_LENGTH = 0.001
"""The shortest line, in the picture's size (0.64 px at 640 px)."""
Direction = Literal["in", "out"]


def _side(a: Point, b: Point, p: Point) -> float:
    """> 0 when ``p`` is on the right of ``a -> b`` in the picture (y grows downwards)."""
    return (b[0] - a[0]) * (p[1] - a[1]) - (b[1] - a[1]) * (p[0] - a[0])


@dataclass(frozen=True, slots=True)
class Line:
    """A named counting line from ``a`` to ``b``, points in [0, 1] of the frame.

    Raises:
        ValueError: an empty or over-long name, a point outside [0, 1], or ``a`` and ``b``
            under :data:`MIN_LINE_LENGTH` apart.
    """

    name: str
    a: Point
    b: Point
    classes: tuple[str, ...] = ()
    """The class names it counts (empty: every class)."""

    def __post_init__(self) -> None:
        check_name(self.name, "lines")
        for point in (self.a, self.b):
            check_point(point, f"lines: {self.name!r}")
        if self.a == self.b:
            raise ValueError(f"lines: {self.name!r}: its two points are the same")
        if math.hypot(self.b[0] - self.a[0], self.b[1] - self.a[1]) < MIN_LINE_LENGTH:
            raise ValueError(
                f"lines: {self.name!r}: its points are under {MIN_LINE_LENGTH:g} of the"
                " picture apart (under a pixel): nothing would cross it"
            )

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> Line:
        """From ``{"name": s, "points": [[x, y], [x, y]], "classes"?: [...]}`` (JSON).

        Raises:
            ValueError: another shape, or see :class:`Line`.
        """
        name = str(raw.get("name", ""))
        points = parse_points(raw.get("points") or (), f"lines: {name!r}")
        if len(points) != 2:
            raise ValueError(f"lines: {name!r}: a line has 2 points, not {len(points)}")
        unknown = set(raw) - {"name", "points", "classes"}
        if unknown:
            raise ValueError(f"lines: {name!r}: unknown field(s) {sorted(unknown)}")
        classes = parse_class_names(raw.get("classes"), f"lines: {name!r}")
        return cls(name, points[0], points[1], classes)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "points": [list(self.a), list(self.b)],
            "classes": list(self.classes) or None,
        }

    def distance(self, p: Point) -> float:
        """Signed distance of ``p`` from the line through ``a`` and ``b`` (> 0: its right),
        in relative units of the frame."""
        length = math.hypot(self.b[0] - self.a[0], self.b[1] - self.a[1])
        return _side(self.a, self.b, p) / length

    def crossing(self, before: Point, after: Point) -> Direction | None:
        """Which way a move from ``before`` to ``after`` crosses the line, if it does."""
        s0, s1 = _side(self.a, self.b, before), _side(self.a, self.b, after)
        if (s0 < 0) == (s1 < 0):
            return None
        # The move's own line must separate the segment's ends, or it passed beside it.
        t0, t1 = _side(before, after, self.a), _side(before, after, self.b)
        if (t0 < 0) == (t1 < 0) and t0 != 0 and t1 != 0:
            return None
        return "in" if s1 >= 0 else "out"


def parse_lines(raw: Sequence[Mapping[str, Any]]) -> tuple[Line, ...]:
    """A stream's lines from JSON.

    Raises:
        ValueError: more than :data:`MAX_LINES`, two with one name, or a bad line.
    """
    return parse_named(raw, Line.parse, "lines", MAX_LINES)


@dataclass(frozen=True, slots=True)
class Crossing:
    """One object crossing one line, in the stream's frame number ``frame``."""

    line: str
    direction: Direction
    track_id: int
    class_id: int
    frame: int
    seen: Seen | None = None
    """The object's box and confidence in that frame."""

    def to_json(self, name_of: Callable[[int], str]) -> dict[str, Any]:
        """The event as the WebSocket, ``GET /events`` and webhooks send it."""
        return {
            "type": "line_crossing",
            "line": self.line,
            "direction": self.direction,
            "track_id": self.track_id,
            "class_id": self.class_id,
            "class_name": name_of(self.class_id),
            "frame": self.frame,
            **(self.seen.to_json() if self.seen is not None else {}),
        }


class LineCounter:
    """Where each tracked object stood when last seen, and the crossings since. Not
    thread-safe: its stream calls it in frame order, after the tracker."""

    def __init__(self) -> None:
        # (track id, line name) -> the side it is on (1: right, -1: left) and where it was
        # last seen clearly there
        self._sides: dict[tuple[int, str], tuple[int, Point]] = {}

    def clear(self) -> None:
        self._sides.clear()

    def update(
        self,
        detections: Detections,
        lines: Sequence[Line],
        live: Iterable[int],
        frame: int,
        confirmed: Container[int] | None = None,
    ) -> list[Crossing]:
        """The crossings in one tracked frame (number ``frame``); ``live`` are the tracker's
        live track ids (an object unseen for a frame or two keeps its last place), and
        ``confirmed`` those that are objects (``None``: all). A track not yet an object keeps
        the side it was first seen on, and crosses once it is one: a flicker of two frames
        (a hand called two people) was counted as crossing, one object twice."""
        ids = detections.track_ids
        xs, ys = (a.tolist() for a in anchors(detections))
        if ids is None or len(xs) != len(ids):
            return []
        tall = heights(detections).tolist()
        crossings: list[Crossing] = []
        boxes: dict[int, list[int]] = {}  # a second class on the same object: one object
        for i, track_id in enumerate(ids.tolist()):
            boxes.setdefault(track_id, []).append(i)
        names = [detections.name_of(c) for c in detections.class_ids.tolist()]
        for track_id, rows in boxes.items():
            for line in lines:
                # Its first box of a class the line counts (a car also called a cell phone,
                # listed first, is a car in this frame: its crossing came a frame late). Of
                # none: on neither side (as zones count it), so a car the model calls a cell
                # phone as it crosses is counted when it is a car again beyond the line (its
                # side was taken and the crossing lost).
                i = next((r for r in rows if not line.classes or names[r] in line.classes), -1)
                if i < 0:
                    continue
                point = (xs[i], ys[i])
                class_id = int(detections.class_ids[i])
                band = BAND * tall[i]
                distance = line.distance(point)
                key = (track_id, line.name)
                before = self._sides.get(key)
                if before is not None and confirmed is not None and track_id not in confirmed:
                    continue  # not an object yet: its first side kept
                if before is not None and abs(distance) <= band:
                    continue  # on the line: still on the side it was
                side = 1 if distance >= 0 else -1
                self._sides[key] = (side, point)
                if before is None or before[0] == side:
                    continue
                direction = line.crossing(before[1], point)
                if direction is not None:
                    crossings.append(Crossing(line.name, direction, track_id, class_id, frame))
        alive = set(live)
        kept = {line.name for line in lines}
        self._sides = {k: v for k, v in self._sides.items() if k[0] in alive and k[1] in kept}
        return crossings
