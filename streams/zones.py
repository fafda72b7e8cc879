"""Zones: named areas of a stream's picture that count what stands in them, without hiding
anything (the region of interest filters; zones only count). Frigate's zones do the same.

Each frame, every detection whose anchor (the bottom centre of its box) is inside a zone is
counted in that zone's occupancy, by class, and lists the zone in its ``zones``. Where the
stream tracks, an object entering a zone is counted once in the zone's ``entered`` counts: a
tracked object that stays inside, or drops out of detection for a frame or two, is not
counted again, and each tracked detection says how long it has been in each of its zones
(Frigate's loitering time).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engines.types import Detections
from streams.geometry import (
    Point,
    anchors,
    check_name,
    check_polygon,
    parse_named,
    parse_points,
    polygon_contains,
)

MAX_ZONES = 16


@dataclass(frozen=True, slots=True)
class Zone:
    """A named polygon, points in [0, 1] of the frame.

    Raises:
        ValueError: an empty or over-long name, or a bad polygon.
    """

    name: str
    points: tuple[Point, ...]

    def __post_init__(self) -> None:
        check_name(self.name, "zones")
        check_polygon(self.points, f"zones: {self.name!r}")

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> Zone:
        """From ``{"name": s, "points": [[x, y], ...]}`` (JSON).

        Raises:
            ValueError: another shape, or see :class:`Zone`.
        """
        name = str(raw.get("name", ""))
        points = raw.get("points")
        if not isinstance(points, list):
            raise ValueError('zones: each zone is {"name": ..., "points": [[x, y], ...]}')
        return cls(name, parse_points(points, f"zones: {name!r}"))

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "points": [[x, y] for x, y in self.points]}


def parse_zones(raw: Sequence[Mapping[str, Any]]) -> tuple[Zone, ...]:
    """A stream's zones from JSON.

    Raises:
        ValueError: more than :data:`MAX_ZONES`, two with one name, or a bad zone.
    """
    return parse_named(raw, Zone.parse, "zones", MAX_ZONES)


@dataclass(frozen=True, slots=True)
class ZoneFrame:
    """What one frame's zones hold.

    Attributes:
        members: per detection, the names of the zones it stands in.
        occupancy: per zone, detections inside by class id.
        entered: ``(zone, class id)`` of each tracked object that entered a zone this frame.
        dwell: per detection, seconds since its object entered each of its zones (tracked
            detections; ``None`` where the frame is not tracked).
    """

    members: list[list[str]]
    occupancy: dict[str, Counter[int]]
    entered: list[tuple[str, int]] = field(default_factory=list)
    dwell: list[dict[str, float]] | None = None


class ZoneCounter:
    """Which tracked objects are in which zone. Not thread-safe: its stream calls it in frame
    order, after the tracker."""

    def __init__(self) -> None:
        self._inside: dict[str, dict[int, float]] = {}  # zone -> track id -> entered at

    def clear(self) -> None:
        self._inside.clear()

    def update(
        self,
        detections: Detections,
        zones: Sequence[Zone],
        live: Iterable[int] = (),
        t: float = 0.0,
    ) -> ZoneFrame:
        """One frame's (decoded at monotonic ``t``) occupancy and members; entries and dwell
        times where ``detections`` carry track ids (``live``: the tracker's live ids, whose
        membership is kept while unseen)."""
        xs, ys = anchors(detections)
        members: list[list[str]] = [[] for _ in range(len(detections))]
        occupancy: dict[str, Counter[int]] = {}
        entered: list[tuple[str, int]] = []
        ids = detections.track_ids
        dwell: list[dict[str, float]] | None = (
            None if ids is None else [{} for _ in range(len(detections))]
        )
        seen = set() if ids is None else set(ids.tolist())
        alive = set(live)
        for zone in zones:
            # An unsized frame has no anchors: nothing is in any zone.
            inside = polygon_contains(zone.points, xs, ys).tolist() if len(xs) else []
            counts: Counter[int] = Counter()
            was = self._inside.get(zone.name, {})
            # Tracked but not detected in this frame: stays where it was.
            now = {i: at for i, at in was.items() if i in alive and i not in seen}
            counted: set[int] = set()
            for i, hit in enumerate(inside):
                if not hit:
                    continue
                class_id = int(detections.class_ids[i])
                members[i].append(zone.name)
                if ids is None:
                    counts[class_id] += 1
                    continue
                track_id = int(ids[i])
                if track_id not in counted:  # not a second class on the same object
                    counted.add(track_id)
                    counts[class_id] += 1
                    if track_id not in was:
                        entered.append((zone.name, class_id))
                    now[track_id] = was.get(track_id, t)
                if dwell is not None:
                    dwell[i][zone.name] = round(t - now[track_id], 3)
            occupancy[zone.name] = counts
            self._inside[zone.name] = now
        for name in set(self._inside) - {zone.name for zone in zones}:
            del self._inside[name]  # a zone that was removed
        return ZoneFrame(members, occupancy, entered, dwell)
