"""Shapes drawn on a stream's picture (regions, zones, lines): points in 0..1 of the frame, so
they survive a change of resolution, and the anchor they are tested against: the bottom
centre of a box, where an object stands on the ground (as Frigate's zones use)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from engines.types import Detections

MIN_POINTS = 3
MAX_POINTS = 64
MAX_NAME = 64
Point = tuple[float, float]


def check_name(name: str, what: str) -> None:
    """Raises ValueError, naming ``what``, for an empty or over-long shape name."""
    if not 1 <= len(name) <= MAX_NAME:
        raise ValueError(f"{what}: a name of 1 to {MAX_NAME} characters is needed")


def unprintable(char: str) -> bool:
    """Whether ``char`` is a control character (U+0000, a tab...), half of a surrogate pair
    or a noncharacter (U+FFFE...): MQTT refuses each in a topic (a zone's name is a topic
    level), and a lone surrogate cannot be written as UTF-8 at all. Unicode's line and
    paragraph separators (U+2028, U+2029) too: ``str.splitlines`` and log viewers break lines
    there, so a name holding one wrote a log line of the caller's own."""
    code = ord(char)
    return (
        code < 0x20
        or 0x7F <= code <= 0x9F
        or code in (0x2028, 0x2029)
        or 0xD800 <= code <= 0xDFFF
        or 0xFDD0 <= code <= 0xFDEF
        or (code & 0xFFFE) == 0xFFFE
    )


def check_text(name: str, what: str) -> None:
    """Raises ValueError, naming ``what``, for a name (a zone's, a line's, a stream's) that
    holds an :func:`unprintable` character. Checked on what the API is given: names stored
    before still load (``server/mqtt_discovery.py`` makes topic levels of them anyway)."""
    bad = next((c for c in name if unprintable(c)), None)
    if bad is not None:
        raise ValueError(
            f"{what}: name {name!r} holds {bad!r}: control characters, line separators and"
            " lone surrogates are not allowed in a name"
        )


def check_point(point: Point, what: str) -> None:
    """Raises ValueError, naming ``what``, for a point outside [0, 1] of the frame."""
    x, y = point
    if not (0.0 <= x <= 1.0 and 0.0 <= y <= 1.0):
        raise ValueError(f"{what}: point ({x:g}, {y:g}) is outside [0, 1] of the frame")


MIN_AREA = 1e-6
"""The least area (in shares of the frame) a triangle of a polygon's points encloses: a few
pixels of 1080p."""


def check_polygon(points: Sequence[Point], what: str) -> None:
    """Raises ValueError, naming ``what``, for a polygon of fewer than 3 or more than 64
    points or a point outside [0, 1]."""
    if not MIN_POINTS <= len(points) <= MAX_POINTS:
        raise ValueError(
            f"{what}: {len(points)} points; a polygon needs {MIN_POINTS} to {MAX_POINTS}"
        )
    for point in points:
        check_point(point, what)


def check_area(points: Sequence[Point], what: str) -> None:
    """Raises ValueError, naming ``what``, for a polygon whose points are all on one line (or
    the same): nothing is ever inside it (a roi of it dropped every detection). Checked on
    what the API is given, not on settings stored before it was (they would fail their
    stream at start). A polygon whose edges cross (a bow tie) has an inside, so it passes."""
    x0, y0 = points[0]
    spread = max(
        abs((x1 - x0) * (y2 - y0) - (x2 - x0) * (y1 - y0))
        for (x1, y1), (x2, y2) in itertools.pairwise(points[1:])
    )
    if spread / 2 < MIN_AREA:
        raise ValueError(f"{what}: its points enclose no area (on one line, or the same)")


def parse_class_names(raw: object, what: str) -> tuple[str, ...]:
    """A shape's ``classes`` (JSON: class names; null or []: every class) as a sorted tuple;
    ValueError naming ``what`` for another shape."""
    if raw is None:
        return ()
    if not isinstance(raw, list | tuple) or not all(isinstance(c, str) and c for c in raw):
        raise ValueError(f"{what}: classes is a list of class names, not {raw!r}")
    return tuple(sorted(set(raw)))


def parse_points(raw: Sequence[Sequence[float]], what: str) -> tuple[Point, ...]:
    """``[[x, y], ...]`` (JSON) as points; ValueError naming ``what`` for another shape."""
    try:
        points = tuple((float(p[0]), float(p[1])) for p in raw if len(p) == 2)
    except (TypeError, ValueError, IndexError):
        raise ValueError(f"{what}: expected a list of [x, y] points") from None
    if len(points) != len(raw):
        raise ValueError(f"{what}: expected a list of [x, y] points")
    return points


def polygon_contains(
    points: Sequence[Point], xs: npt.NDArray[np.float64], ys: npt.NDArray[np.float64]
) -> npt.NDArray[np.bool_]:
    """Which relative points lie inside the polygon (even-odd rule; a point on an edge may go
    either way)."""
    inside = np.zeros(xs.shape, bool)
    n = len(points)
    for i in range(n):
        x1, y1 = points[i]
        x2, y2 = points[(i + 1) % n]
        if y1 == y2:
            continue  # a horizontal edge never crosses a horizontal ray
        crosses = (y1 > ys) != (y2 > ys)
        x_at = x1 + (ys - y1) * (x2 - x1) / (y2 - y1)
        inside ^= crosses & (xs < x_at)
    return inside


BAND = 0.1
"""How near a line or a zone's edge (a share of the object's box height) an object stands
on it: its side, or whether it is in the zone, stays what it was until it is further."""


def edge_distance(
    points: Sequence[Point], xs: npt.NDArray[np.float64], ys: npt.NDArray[np.float64]
) -> npt.NDArray[np.float64]:
    """Each relative point's distance from the polygon's outline (relative units)."""
    best = np.full(xs.shape, np.inf)
    n = len(points)
    for i in range(n):
        (x1, y1), (x2, y2) = points[i], points[(i + 1) % n]
        dx, dy = x2 - x1, y2 - y1
        length2 = dx * dx + dy * dy
        u = np.zeros(xs.shape) if length2 == 0 else ((xs - x1) * dx + (ys - y1) * dy) / length2
        u = np.clip(u, 0.0, 1.0)
        best = np.minimum(best, np.hypot(xs - (x1 + u * dx), ys - (y1 + u * dy)))
    return best


def heights(detections: Detections) -> npt.NDArray[np.float64]:
    """Each box's height, relative to the frame's (zeros for an unsized frame)."""
    if not detections.height:
        return np.zeros(len(detections))
    boxes = detections.boxes.astype(np.float64)
    return np.maximum(boxes[:, 3] - boxes[:, 1], 0.0) / detections.height


EDGE = 1.0 - 1e-9
"""The largest relative coordinate an anchor has (see :func:`anchors`)."""


def anchors(detections: Detections) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """Each box's bottom centre, in 0..1 of the frame (empty for an unsized frame)."""
    if not detections.width or not detections.height:
        return np.zeros(0), np.zeros(0)
    boxes = detections.boxes.astype(np.float64)
    xs = (boxes[:, 0] + boxes[:, 2]) / 2.0 / detections.width
    ys = boxes[:, 3] / detections.height
    # A box cut off by the frame's bottom (or right) edge stands at 1.0, on the edge of a
    # zone or roi drawn to it, and the even-odd rule put it outside: in no zone, dropped by
    # a whole-frame roi. Just inside, it is in them.
    return np.clip(xs, 0.0, EDGE), np.clip(ys, 0.0, EDGE)


@dataclass(frozen=True, slots=True)
class Seen:
    """Where an object was in the frame of one of its events: its box (``[x1, y1, x2, y2]``,
    source pixels, as in the WebSocket's detections) and the box's confidence."""

    box: tuple[float, float, float, float]
    confidence: float

    def to_json(self) -> dict[str, Any]:
        return {"box": [round(v, 1) for v in self.box], "confidence": round(self.confidence, 3)}


def seen_by_track(detections: Detections) -> dict[int, Seen]:
    """Each tracked object's box and confidence in ``detections`` (its first box, where a
    class flip gave it two)."""
    ids = detections.track_ids
    if ids is None:
        return {}
    seen: dict[int, Seen] = {}
    for i, track_id in enumerate(ids.tolist()):
        if track_id not in seen:
            x1, y1, x2, y2 = (float(v) for v in detections.boxes[i])
            seen[track_id] = Seen((x1, y1, x2, y2), float(detections.scores[i]))
    return seen


class _Named(Protocol):
    @property
    def name(self) -> str: ...


Shape = TypeVar("Shape", bound=_Named)


def parse_named(
    raw: Sequence[Mapping[str, Any]],
    parse: Callable[[Mapping[str, Any]], Shape],
    what: str,
    most: int,
) -> tuple[Shape, ...]:
    """A stream's named shapes (``lines``, ``zones``) from JSON, each read by ``parse``.

    Raises:
        ValueError: more than ``most``, two with one name, or what ``parse`` raises.
    """
    shapes = tuple(parse(item) for item in raw)
    if len(shapes) > most:
        raise ValueError(f"{what}: {len(shapes)} {what}; a stream has at most {most}")
    names = [shape.name for shape in shapes]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ValueError(f"{what}: two {what} have the same name {twice[0]!r}")
    return shapes
