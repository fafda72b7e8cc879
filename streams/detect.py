"""What a stream detects: the engine's parameters (:class:`engines.types.DetectParams`) and an
optional region of interest (:class:`Roi`).

The region is a polygon in frame-relative coordinates; detections whose anchor (the bottom
centre of the box, where an object stands on the ground, as Frigate's zones use) lies outside
it are dropped before they are counted or published. Relative coordinates (0..1 of the width
and height) keep a region valid when a camera's resolution changes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from engines.types import Detections, DetectParams, class_ids
from streams.filters import ObjectFilters
from streams.geometry import (
    Point,
    anchors,
    check_area,
    check_polygon,
    parse_points,
    polygon_contains,
)
from streams.lines import Line, parse_lines
from streams.track import STATIONARY_S
from streams.zones import Zone, parse_zones


@dataclass(frozen=True, slots=True)
class Roi:
    """A simple polygon, ``(x, y)`` vertices in [0, 1] of the frame.

    Raises:
        ValueError: fewer than 3 or more than 64 vertices, or a coordinate outside [0, 1].
    """

    points: tuple[Point, ...]

    def __post_init__(self) -> None:
        check_polygon(self.points, "roi")

    @classmethod
    def parse(cls, raw: Sequence[Sequence[float]]) -> Roi:
        """From ``[[x, y], ...]`` (JSON).

        Raises:
            ValueError: not a list of ``[x, y]`` pairs, or see :class:`Roi`.
        """
        return cls(parse_points(raw, "roi"))

    def to_json(self) -> list[list[float]]:
        return [[x, y] for x, y in self.points]

    def contains(
        self, xs: npt.NDArray[np.float64], ys: npt.NDArray[np.float64]
    ) -> npt.NDArray[np.bool_]:
        """Which relative points lie inside (even-odd rule; a point on an edge may go either
        way)."""
        return polygon_contains(self.points, xs, ys)

    def filter(self, detections: Detections) -> Detections:
        """The detections whose bottom-centre anchor is inside the region."""
        if len(detections) == 0:
            return detections
        xs, ys = anchors(detections)
        if len(xs) == 0:
            return detections
        keep = self.contains(xs, ys)
        return detections if keep.all() else detections.select(keep)


MAX_MASKS = 16


def parse_masks(raw: Sequence[Sequence[Sequence[float]]]) -> tuple[Roi, ...]:
    """``motion_mask`` (JSON: a list of polygons) as polygons.

    Raises:
        ValueError: more than :data:`MAX_MASKS`, or a bad polygon (named ``motion_mask``).
    """
    if len(raw) > MAX_MASKS:
        raise ValueError(f"motion_mask: at most {MAX_MASKS} polygons")
    masks = []
    for polygon in raw:
        points = parse_points(polygon, "motion_mask")
        check_polygon(points, "motion_mask")
        masks.append(Roi(points))
    return tuple(masks)


DAY_S = 86_400.0
LOW_CONF = 0.1
"""On a tracked stream the engine keeps detections down to this confidence: those under the
stream's ``conf`` only carry on tracks that lost their confident detection (ByteTrack's second
association, :mod:`streams.track`); they never start a track."""


@dataclass(frozen=True, slots=True)
class StreamDetect:
    """A stream's detection settings, swapped as one reference while the stream runs."""

    params: DetectParams = field(default_factory=DetectParams)
    roi: Roi | None = None
    track: bool = False
    """Give detections a ``track_id`` across frames and count objects once
    (:mod:`streams.track`)."""
    lines: tuple[Line, ...] = ()
    """Counting lines (:mod:`streams.lines`); they need ``track``."""
    zones: tuple[Zone, ...] = ()
    """Zones that count what stands in them (:mod:`streams.zones`); entries need ``track``."""
    clips: bool = False
    """Keep a video clip of each event (:mod:`streams.clips`)."""
    motion: bool = False
    """Infer only frames where something moved (:mod:`streams.motion`)."""
    motion_mask: tuple[Roi, ...] = ()
    """Parts of the picture whose changes are not motion (a camera's clock, a tree)."""
    motion_min_area: float | None = None
    """This stream's share of the picture that must move (``None``: the server's)."""
    motion_threshold: int | None = None
    """This stream's grey levels a pixel must change by to have moved (``None``: the
    server's)."""
    filters: ObjectFilters | None = None
    """Per-class minimum confidence, sizes and shapes (:mod:`streams.filters`)."""
    stationary_s: float | None = None
    """Seconds a tracked object stands still before it is stationary (``None``:
    :data:`streams.track.STATIONARY_S`): short at a doorway, long in a car park."""

    def __post_init__(self) -> None:
        if len(self.motion_mask) > MAX_MASKS:
            raise ValueError(f"motion_mask: at most {MAX_MASKS} polygons")
        area: object = self.motion_min_area  # from JSON it may be anything
        if area is not None and (
            not isinstance(area, int | float) or isinstance(area, bool) or not 0 < area <= 1
        ):
            raise ValueError(f"motion_min_area: a share of the picture in (0, 1], not {area!r}")
        level: object = self.motion_threshold
        if level is not None and (
            not isinstance(level, int) or isinstance(level, bool) or not 1 <= level <= 255
        ):
            raise ValueError(f"motion_threshold: grey levels from 1 to 255, not {level!r}")
        still: object = self.stationary_s
        if still is not None and (
            not isinstance(still, int | float) or isinstance(still, bool) or not 0 < still <= DAY_S
        ):
            raise ValueError(f"stationary_s: seconds in (0, {DAY_S:.0f}], not {still!r}")
        if self.lines and not self.track:
            raise ValueError(
                "lines: counting lines need track set to true (crossings are counted per"
                " tracked object)"
            )

    def refuse_useless(self) -> None:
        """Raises ValueError, naming the field, for settings that can never do anything: a
        zone's ``loiter_s`` without ``track``, a region, zone or motion mask enclosing no
        area. For what the API is given; settings stored before these were refused still
        load (their streams would fail at start)."""
        loiter = next((z.name for z in self.zones if z.loiter_s is not None), None)
        if loiter is not None and not self.track:
            raise ValueError(
                f"zones: {loiter!r}: loiter_s needs track set to true (how long an object stays"
                " is counted per tracked object)"
            )
        if self.roi is not None:
            check_area(self.roi.points, "roi")
        for zone in self.zones:
            check_area(zone.points, f"zones: {zone.name!r}")
        for mask in self.motion_mask:
            check_area(mask.points, "motion_mask")

    @property
    def stationary_after_s(self) -> float:
        """When a still object counts as stationary: ``stationary_s`` or the default."""
        return STATIONARY_S if self.stationary_s is None else float(self.stationary_s)

    @property
    def engine_params(self) -> DetectParams:
        """What the engine runs with: ``params``, with the confidence lowered to
        :data:`LOW_CONF` where the stream tracks, and to the lowest class ``min_conf`` of its
        ``filters``."""
        conf = self.params.conf
        lowest = None if self.filters is None else self.filters.lowest_conf()
        if lowest is not None:
            conf = min(conf, lowest)  # the others are held to params.conf after
        if self.track:
            conf = min(conf, LOW_CONF)
        return (
            self.params if conf == self.params.conf else dataclasses.replace(self.params, conf=conf)
        )

    def describe(self, names: Mapping[int, str]) -> dict[str, Any]:
        """JSON form: the parameters (classes by name), ``roi`` (``null``: whole frame),
        ``track``, ``lines``, ``zones``, ``clips``, ``motion``, ``motion_mask``,
        ``motion_min_area``, ``motion_threshold``, ``filters`` (by class name) and
        ``stationary_s``."""
        return {
            **self.params.describe(names),
            "roi": None if self.roi is None else self.roi.to_json(),
            "track": self.track,
            "lines": [line.to_json() for line in self.lines],
            "zones": [zone.to_json() for zone in self.zones],
            "clips": self.clips,
            "motion": self.motion,
            "motion_mask": [mask.to_json() for mask in self.motion_mask],
            "motion_min_area": self.motion_min_area,
            "motion_threshold": self.motion_threshold,
            "filters": {} if self.filters is None else self.filters.to_json(names),
            "stationary_s": self.stationary_s,
        }

    @classmethod
    def from_description(cls, data: Mapping[str, Any], names: Mapping[int, str]) -> StreamDetect:
        """Inverse of :meth:`describe`.

        Raises:
            ValueError: a value out of range, a class the model lacks, or a bad region.
        """
        roi = data.get("roi")
        lines = parse_lines(data.get("lines") or ())
        zones = parse_zones(data.get("zones") or ())
        for what, shapes in (("lines", lines), ("zones", zones)):
            for shape in shapes:
                try:  # stored by name: the model served now may lack one
                    class_ids(shape.classes, names)
                except ValueError as exc:
                    raise ValueError(f"{what}: {shape.name!r}: {exc}") from None
        # Absent in streams stored before tracking (clips, motion) existed.
        flags = {key: data.get(key, False) for key in ("track", "clips", "motion")}
        for key, flag in flags.items():
            if not isinstance(flag, bool):
                raise ValueError(f"{key}: expected true or false, got {flag!r}")
        return cls(
            DetectParams.from_description(data, names),
            None if roi is None else Roi.parse(roi),
            flags["track"],
            lines,
            zones,
            flags["clips"],
            flags["motion"],
            parse_masks(data.get("motion_mask") or ()),
            data.get("motion_min_area"),
            data.get("motion_threshold"),
            ObjectFilters.parse(data["filters"], names) if data.get("filters") else None,
            data.get("stationary_s"),
        )
