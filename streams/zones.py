"""Zones: named areas of a stream's picture that count what stands in them, without hiding
anything (the region of interest filters; zones only count). Frigate's zones do the same.

Each frame, every detection whose anchor (the bottom centre of its box) is inside a zone is
counted in that zone's occupancy, by class, and lists the zone in its ``zones``. Where the
stream tracks, objects *enter* and *exit* zones, each an event:

- an object enters after its anchor was inside in ``inertia`` frames in a row in which it
  was seen (3 by default, as Frigate's ``inertia``), and exits after it was seen outside in
  ``inertia`` frames in a row, so a box whose bottom edge jitters across the zone's border
  is one stay, not many; frames in which it is not detected do not count either way;
- an object whose track ends (unseen for the tracker's ``MAX_AGE``) while inside exits
  ``lost``: it left the picture or was hidden, not seen walking out;
- occupancy and each detection's ``zones`` then hold the objects that entered and have not
  exited, and each such detection says how long its object has been in each zone (``dwell``,
  Frigate's loitering time, from its first frame inside).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from engines.types import Detections
from streams.geometry import (
    BAND,
    Point,
    Seen,
    anchors,
    check_name,
    check_polygon,
    edge_distance,
    heights,
    parse_class_names,
    parse_named,
    parse_points,
    polygon_contains,
)

MAX_ZONES = 16
INERTIA = 3
"""Frames in a row an object must be seen inside a zone to enter it (and outside to exit)."""
MAX_INERTIA = 30
ZoneEventKind = Literal["enter", "exit", "loiter"]
MAX_LOITER_S = 86_400.0


@dataclass(frozen=True, slots=True)
class Zone:
    """A named polygon, points in [0, 1] of the frame, and its ``inertia`` in frames.

    Raises:
        ValueError: an empty or over-long name, a bad polygon or an inertia out of range.
    """

    name: str
    points: tuple[Point, ...]
    inertia: int = INERTIA
    classes: tuple[str, ...] = ()
    """The class names it counts (empty: every class), as Frigate's zone ``objects``."""
    loiter_s: float | None = None
    """A tracked object in it this long is loitering: one ``zone_loiter`` event a stay."""

    def __post_init__(self) -> None:
        check_name(self.name, "zones")
        loiter: object = self.loiter_s  # from JSON it may be anything
        if loiter is not None and (
            not isinstance(loiter, int | float)
            or isinstance(loiter, bool)
            or not 0 < loiter <= MAX_LOITER_S
        ):
            raise ValueError(
                f"zones: {self.name!r}: loiter_s is seconds from 0 to {MAX_LOITER_S:g},"
                f" not {loiter!r}"
            )
        check_polygon(self.points, f"zones: {self.name!r}")
        inertia: object = self.inertia  # from JSON it may be anything
        if (
            not isinstance(inertia, int)
            or isinstance(inertia, bool)
            or not 1 <= inertia <= MAX_INERTIA
        ):
            raise ValueError(
                f"zones: {self.name!r}: inertia is a number of frames from 1 to {MAX_INERTIA},"
                f" not {self.inertia!r}"
            )

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> Zone:
        """From ``{"name": s, "points": [[x, y], ...], "inertia"?: n, "classes"?: [...]}``
        (JSON).

        Raises:
            ValueError: another shape, or see :class:`Zone`.
        """
        name = str(raw.get("name", ""))
        points = raw.get("points")
        if not isinstance(points, list):
            raise ValueError('zones: each zone is {"name": ..., "points": [[x, y], ...]}')
        unknown = set(raw) - {"name", "points", "inertia", "classes", "loiter_s"}
        if unknown:
            raise ValueError(f"zones: {name!r}: unknown field(s) {sorted(unknown)}")
        inertia = raw.get("inertia", INERTIA)
        classes = parse_class_names(raw.get("classes"), f"zones: {name!r}")
        points_ = parse_points(points, f"zones: {name!r}")
        return cls(name, points_, inertia, classes, raw.get("loiter_s"))

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "points": [[x, y] for x, y in self.points],
            "inertia": self.inertia,
            "classes": list(self.classes) or None,
            "loiter_s": self.loiter_s,
        }


def parse_zones(raw: Sequence[Mapping[str, Any]]) -> tuple[Zone, ...]:
    """A stream's zones from JSON.

    Raises:
        ValueError: more than :data:`MAX_ZONES`, two with one name, or a bad zone.
    """
    return parse_named(raw, Zone.parse, "zones", MAX_ZONES)


@dataclass(frozen=True, slots=True)
class ZoneEvent:
    """A tracked object entering or exiting a zone, in the stream's frame number ``frame``.

    Attributes:
        dwell_s: on an exit, seconds from its first frame inside to its last; on a loiter,
            to this frame.
        lost: on an exit, its track ended inside (out of sight), rather than it being seen
            outside.
    """

    zone: str
    kind: ZoneEventKind
    track_id: int
    class_id: int
    frame: int
    dwell_s: float | None = None
    lost: bool = False
    seen: Seen | None = None
    """The object's box and confidence in that frame (none where it was lost)."""

    def to_json(self, name_of: Callable[[int], str]) -> dict[str, Any]:
        """The event as the WebSocket, ``GET /events`` and webhooks send it."""
        out: dict[str, Any] = {
            "type": f"zone_{self.kind}",
            "zone": self.zone,
            "track_id": self.track_id,
            "class_id": self.class_id,
            "class_name": name_of(self.class_id),
            "frame": self.frame,
        }
        if self.kind != "enter":
            out["dwell_s"] = self.dwell_s
        if self.kind == "exit":
            out["lost"] = self.lost
        if self.seen is not None:
            out.update(self.seen.to_json())
        return out


@dataclass(frozen=True, slots=True)
class ZoneFrame:
    """What one frame's zones hold.

    Attributes:
        members: per detection, the names of the zones it stands in.
        occupancy: per zone, detections inside by class id.
        events: tracked objects that entered or exited a zone in this frame.
        dwell: per detection, seconds since its object entered each of its zones (tracked
            detections; ``None`` where the frame is not tracked).
    """

    members: list[list[str]]
    occupancy: dict[str, Counter[int]]
    events: list[ZoneEvent] = field(default_factory=list)
    dwell: list[dict[str, float]] | None = None


@dataclass(slots=True)
class _Stay:
    """One tracked object's stay in one zone, from its first frame inside."""

    since: float  # its first frame inside
    last_in: float  # its last frame inside
    class_id: int
    inside: int = 0  # frames in a row seen inside
    outside: int = 0  # frames in a row seen outside, once entered
    entered: bool = False
    loitered: bool = False

    @property
    def dwell(self) -> float:
        """Seconds from its first frame inside to its last."""
        return round(self.last_in - self.since, 3)


class ZoneCounter:
    """Which tracked objects are in which zone. Not thread-safe: its stream calls it in frame
    order, after the tracker."""

    def __init__(self) -> None:
        self._stays: dict[str, dict[int, _Stay]] = {}  # zone -> track id -> its stay

    def end(self, frame: int) -> list[ZoneEvent]:
        """Every object in a zone leaves it, ``lost``, at ``frame``: its tracks end (tracking
        turned off, the last zone removed, a video job's end). Each entry gets its exit: they
        stayed unpaired."""
        return [event for name in list(self._stays) for event in self._leave(name, frame)]

    def _leave(self, name: str, frame: int) -> list[ZoneEvent]:
        """The zone ``name`` forgotten, the objects in it leaving it ``lost`` at ``frame``."""
        return [
            self._exit(name, track_id, stay, frame, lost=True)
            for track_id, stay in self._stays.pop(name).items()
            if stay.entered
        ]

    def update(
        self,
        detections: Detections,
        zones: Sequence[Zone],
        live: Iterable[int] = (),
        t: float = 0.0,
        frame: int = 0,
    ) -> ZoneFrame:
        """One frame's (number ``frame``, decoded at monotonic ``t``) occupancy and members;
        entries, exits and dwell times where ``detections`` carry track ids (``live``: the
        tracker's live ids, whose stays are kept while they are unseen)."""
        xs, ys = anchors(detections)
        n = len(detections)
        members: list[list[str]] = [[] for _ in range(n)]
        occupancy: dict[str, Counter[int]] = {}
        ids = None if detections.track_ids is None else detections.track_ids.tolist()
        # Tracking turned off: the objects in zones leave them (they stayed entered, unpaired).
        events: list[ZoneEvent] = self.end(frame) if ids is None else []
        dwell: list[dict[str, float]] | None = None if ids is None else [{} for _ in range(n)]
        alive = set(live)
        classes = detections.class_ids.tolist()
        # One step per object: a second box of another class on it is not a second one.
        first: dict[int, int] = {}
        for i, track_id in enumerate(ids or ()):
            first.setdefault(track_id, i)
        for zone in zones:
            # An unsized frame has no anchors: nothing is in any zone.
            inside = polygon_contains(zone.points, xs, ys).tolist() if len(xs) else [False] * n
            # Objects of other classes are not in it (nor out of it: a car the model calls
            # a truck for a frame neither enters nor leaves a zone for cars).
            counted_class = [
                not zone.classes or detections.name_of(c) in zone.classes for c in classes
            ]
            counts: Counter[int] = Counter()
            if ids is None:
                for i, hit in enumerate(inside):
                    if hit and counted_class[i]:
                        members[i].append(zone.name)
                        counts[classes[i]] += 1
                occupancy[zone.name] = counts
                continue
            stays = self._stays.setdefault(zone.name, {})
            # Each object's first box of a class the zone counts (a car also called a cell
            # phone, listed first, is a car in this frame: its step waited a frame).
            counted_first: dict[int, int] = {}
            for i, track_id in enumerate(ids):
                if counted_class[i]:
                    counted_first.setdefault(track_id, i)
            on_edge = self._on_edge(
                zone, detections, xs=xs, ys=ys, inside=inside, first=counted_first, stays=stays
            )
            for track_id, i in counted_first.items():
                events += self._step(
                    zone,
                    stays,
                    track_id,
                    hit=inside[i] or i in on_edge,
                    class_id=classes[i],
                    t=t,
                    frame=frame,
                )
            for track_id in [k for k in stays if k not in first and k not in alive]:
                gone = stays.pop(track_id)  # its track ended while it was in the zone
                if gone.entered:
                    events.append(self._exit(zone.name, track_id, gone, frame, lost=True))
            counted: set[int] = set()
            for i, track_id in enumerate(ids):
                stay = stays.get(track_id)
                if stay is None or not stay.entered:
                    continue
                members[i].append(zone.name)
                if track_id not in counted and counted_class[i]:
                    counted.add(track_id)
                    counts[classes[i]] += 1
                # Its time inside, to its last frame there: frames seen outside before its
                # exit (``inertia``) are no stay (one out after 1.95 s loitered at 2.4 s).
                if dwell is not None:
                    dwell[i][zone.name] = stay.dwell
                loiter = zone.loiter_s
                if (
                    loiter is not None
                    and not stay.loitered
                    and stay.outside == 0
                    and stay.last_in - stay.since >= loiter
                ):
                    stay.loitered = True
                    events.append(
                        ZoneEvent(zone.name, "loiter", track_id, stay.class_id, frame, stay.dwell)
                    )
            occupancy[zone.name] = counts
        for name in set(self._stays) - {zone.name for zone in zones}:
            # A zone removed (or renamed): the objects in it leave it, ``lost``, as where
            # tracking stops; its entries stayed unpaired.
            events += self._leave(name, frame)
        return ZoneFrame(members, occupancy, events, dwell)

    @staticmethod
    def _on_edge(
        zone: Zone,
        detections: Detections,
        *,
        xs: npt.NDArray[np.float64],
        ys: npt.NDArray[np.float64],
        inside: list[bool],
        first: dict[int, int],
        stays: dict[int, _Stay],
    ) -> set[int]:
        """The detections seen outside ``zone`` that entered it and stand on its edge (within
        :data:`BAND` of their box's height): still in it. A car parked across the edge, its
        anchor jittering either side, is one stay (it entered and exited 8 times in 30 s).
        Only those objects are measured: every box against every edge of every zone, each
        frame, cost the rest for nothing."""
        rows = [
            i
            for track_id, i in first.items()
            if not inside[i] and (stay := stays.get(track_id)) is not None and stay.entered
        ]
        if not rows:
            return set()
        picked = np.array(rows)
        bands = BAND * heights(detections)[picked]
        near = edge_distance(zone.points, xs[picked], ys[picked]) <= bands
        return {i for i, close in zip(rows, near.tolist(), strict=True) if close}

    @staticmethod
    def _step(
        zone: Zone,
        stays: dict[int, _Stay],
        track_id: int,
        *,
        hit: bool,
        class_id: int,
        t: float,
        frame: int,
    ) -> list[ZoneEvent]:
        """One seen frame of one object for one zone: its enter or exit event, if any."""
        stay = stays.get(track_id)
        if hit:
            if stay is None:
                stay = stays[track_id] = _Stay(t, t, class_id)
            stay.inside, stay.outside, stay.last_in = stay.inside + 1, 0, t
            if not stay.entered:  # entered, its class is kept: its exit and loiter say it too
                stay.class_id = class_id  # (one entered as a bottle left as a vase)
            if not stay.entered and stay.inside >= zone.inertia:
                stay.entered = True
                return [ZoneEvent(zone.name, "enter", track_id, class_id, frame)]
            return []
        if stay is None:
            return []
        if not stay.entered:
            del stays[track_id]  # in for fewer than ``inertia`` frames: never entered
            return []
        stay.outside += 1
        stay.inside = 0
        if stay.outside < zone.inertia:
            return []
        del stays[track_id]
        return [ZoneCounter._exit(zone.name, track_id, stay, frame, lost=False)]

    @staticmethod
    def _exit(zone: str, track_id: int, stay: _Stay, frame: int, *, lost: bool) -> ZoneEvent:
        return ZoneEvent(zone, "exit", track_id, stay.class_id, frame, stay.dwell, lost)
