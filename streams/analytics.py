"""What a stream makes of each frame's detections once they are back from the engine: the
region of interest, tracking, counting lines and zones, and the counts they keep.

One :class:`StreamAnalytics` per stream. Its reader calls :meth:`StreamAnalytics.process` for
each frame, in frame order, from engine worker threads one at a time; the event loop reads
the counts with :meth:`StreamAnalytics.snapshot` at any time.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from engines.types import Detections
from streams.detect import StreamDetect
from streams.events import StreamEvent
from streams.geometry import seen_by_track
from streams.lines import Crossing, LineCounter
from streams.track import STATIONARY_S, Tracker
from streams.zones import ZoneCounter, ZoneEvent


@dataclass(frozen=True, slots=True)
class Analysed:
    """One frame after the stream's analytics.

    Attributes:
        detections: inside the region of interest, with track ids where the stream tracks.
        events: tracked objects that crossed a counting line, entered or exited a zone in
            this frame.
        zones: per detection, the zones it stands in; ``None`` where the stream has no zones.
        dwell: per detection, seconds its object has been in each of its zones (tracked
            streams with zones; ``None`` otherwise).
        still: per detection, seconds its object has stood still (tracked streams; ``None``
            otherwise); from ``stationary_s`` on it is stationary.
        stationary_s: the stream's ``stationary_s`` (or :data:`streams.track.STATIONARY_S`).
    """

    detections: Detections
    events: tuple[StreamEvent, ...] = ()
    zones: list[list[str]] | None = None
    dwell: list[dict[str, float]] | None = None
    still: list[float] | None = None
    stationary_s: float = STATIONARY_S


def _shape_names(detect: StreamDetect) -> tuple[frozenset[str], frozenset[str]]:
    """The names of ``detect``'s lines and of its zones."""
    return (
        frozenset(line.name for line in detect.lines),
        frozenset(zone.name for zone in detect.zones),
    )


class StreamAnalytics:
    """A stream's tracker, line and zone counters, and everything they counted."""

    def __init__(self) -> None:
        self._tracker = Tracker()
        self._lines = LineCounter()
        self._zones = ZoneCounter()
        self._lock = threading.Lock()  # the counts, read by the event loop
        self._detections: Counter[str] = Counter()  # by class name, since added
        self._objects: dict[str, int] = {}  # by class name, in the last frame
        self._stationary: dict[str, int] = {}  # of those, objects standing still
        self._tracked: Counter[str] = Counter()  # objects (tracks) by class name
        self._crossings: Counter[tuple[str, str, str]] = Counter()  # line, direction, class
        self._zone_now: dict[str, dict[str, int]] = {}  # zone -> class -> in the last frame
        self._zone_moves: Counter[tuple[str, str, str]] = Counter()  # zone, enter|exit, class
        self._shapes: tuple[frozenset[str], frozenset[str]] = (frozenset(), frozenset())
        self._shaped_by: StreamDetect | None = None  # the settings _shapes_now is of
        self._shapes_now = self._shapes
        # The shapes of the settings given last (reshape), None before any: a frame still in
        # flight with older settings counts none that they removed (it brought them back).
        self._latest: tuple[frozenset[str], frozenset[str]] | None = None

    def process(
        self, detections: Detections, detect: StreamDetect, t: float, frame: int
    ) -> Analysed:
        """One frame (number ``frame``, decoded at monotonic ``t``) through the settings it was
        taken with; frames must come in order."""
        if detect.roi is not None:
            detections = detect.roi.filter(detections)
        need: float | npt.NDArray[np.float32] = detect.params.conf
        if detect.filters is not None:  # sizes and shapes; each class's own confidence
            detections, need = detect.filters.apply(detections, detect.params.conf)
            if not detect.track:
                detections = detections.select(detections.scores >= need)
        new_objects: list[int] = []
        still: list[float] | None = None
        if detect.track:
            # The engine ran at LOW_CONF: boxes under the stream's conf only carry on tracks.
            confident = detections.scores >= need
            low = None if confident.all() else detections.select(~confident)
            high = detections if low is None else detections.select(confident)
            tracked = self._tracker.update(high, t, low=low)
            detections, new_objects = tracked.detections, tracked.new_objects
            assert detections.track_ids is not None
            still = self._tracker.still_seconds(detections.track_ids)
        else:
            self._tracker.clear()
        live = self._tracker.live_ids() if detect.lines or detect.zones else []
        crossings: list[Crossing] = []
        if detect.lines:
            confirmed = self._tracker.confirmed_ids()
            crossings = self._lines.update(detections, detect.lines, live, frame, confirmed)
        else:
            self._lines.clear()
        members = dwell = None
        zone_events: list[ZoneEvent] = []
        if detect.zones:
            zoned = self._zones.update(detections, detect.zones, live, t, frame)
            members, dwell, zone_events = zoned.members, zoned.dwell, zoned.events
        else:  # the last zone removed: the objects in it leave it (their entries unpaired)
            zone_events = self._zones.end(frame)
        name = detections.name_of
        names = [name(c) for c in detections.class_ids.tolist()]
        if detect is not self._shaped_by:  # the same settings object frame after frame
            self._shaped_by, self._shapes_now = detect, _shape_names(detect)
        shapes = self._shapes_now
        with self._lock:
            if self._latest is not None and shapes != self._latest:
                shapes = (shapes[0] & self._latest[0], shapes[1] & self._latest[1])
            self._prune(shapes)
            # Counted by hand: Counter.update's type checks cost more than a frame's few boxes.
            objects: dict[str, int] = {}
            for n in names:
                objects[n] = objects.get(n, 0) + 1
            for n, k in objects.items():
                self._detections[n] += k
            self._objects = objects
            self._stationary = (
                {}
                if still is None
                else dict(
                    Counter(
                        n
                        for n, s in zip(names, still, strict=True)
                        if s >= detect.stationary_after_s
                    )
                )
            )
            if new_objects:
                self._tracked.update(name(c) for c in new_objects)
            if crossings:
                self._crossings.update(
                    (c.line, c.direction, name(c.class_id))
                    for c in crossings
                    if c.line in shapes[0]
                )
            if detect.zones:
                self._zone_now = {
                    zone: {name(c): n for c, n in counts.items()}
                    for zone, counts in zoned.occupancy.items()
                    if zone in shapes[1]
                }
                self._zone_moves.update(  # not a removed zone's (its objects' last exits)
                    (e.zone, e.kind, name(e.class_id)) for e in zone_events if e.zone in shapes[1]
                )
            else:
                self._zone_now = {}
        if crossings or zone_events:  # where each object was goes with its events
            seen = seen_by_track(detections)
            crossings = [replace(c, seen=seen.get(c.track_id)) for c in crossings]
            zone_events = [replace(e, seen=seen.get(e.track_id)) for e in zone_events]
        return Analysed(
            detections,
            (*crossings, *zone_events),
            members,
            dwell,
            still,
            detect.stationary_after_s,
        )

    def reshape(self, detect: StreamDetect) -> None:
        """The counts of lines and zones ``detect`` no longer has go at once: a stream that is
        not running (ended, disabled) has no next frame to drop them, and kept them (and
        their metric series) until it ran again."""
        shapes = _shape_names(detect)  # not the cache: the event loop calls this
        with self._lock:
            self._latest = shapes
            self._prune(shapes)

    def _prune(self, shapes: tuple[frozenset[str], frozenset[str]]) -> None:
        """Under the lock: a line or zone removed (or renamed) takes its counts with it, so
        they stay bounded, and so do the metric series built from them."""
        if shapes == self._shapes:
            return
        self._shapes = shapes
        lines, zones = shapes
        self._crossings = Counter({k: n for k, n in self._crossings.items() if k[0] in lines})
        self._zone_moves = Counter({k: n for k, n in self._zone_moves.items() if k[0] in zones})
        self._zone_now = {k: now for k, now in self._zone_now.items() if k in zones}

    def end(self, frame: int, name_of: Callable[[int], str]) -> list[ZoneEvent]:
        """The objects still in zones leave them, ``lost``, at ``frame`` (the last): a video
        job's end, where their entries stayed unpaired. Counted as every exit is."""
        events = self._zones.end(frame)
        with self._lock:
            self._zone_moves.update((e.zone, e.kind, name_of(e.class_id)) for e in events)
        return events

    def snapshot(self, showing: bool = True) -> dict[str, Any]:
        """The counts, as ``GET /streams/{id}`` shows them: ``detections`` and ``objects`` by
        class; ``tracked`` objects by class; ``crossings`` as ``{line: {"in": {class: n},
        "out": {...}}}``; ``zones`` as ``{zone: {"now": {class: n}, "entered": {...},
        "exited": {...}}}``.

        ``showing`` False (a stream disabled, failed or ended: it shows nothing now): what
        is seen now (``objects``, ``stationary``, each zone's ``now``) is empty, as MQTT's
        counts go to 0, so no dashboard keeps counting what its last frame showed; the
        totals stay."""
        with self._lock:
            crossings: dict[str, dict[str, dict[str, int]]] = {}
            for (line, direction, cls), n in sorted(self._crossings.items()):
                crossings.setdefault(line, {"in": {}, "out": {}})[direction][cls] = n
            zones: dict[str, dict[str, dict[str, int]]] = {
                zone: {
                    "now": dict(now) if showing else {},
                    "entered": {},
                    "exited": {},
                    "loitered": {},
                }
                for zone, now in self._zone_now.items()
            }
            for (zone, kind, cls), n in sorted(self._zone_moves.items()):
                empty: dict[str, dict[str, int]] = {
                    "now": {},
                    "entered": {},
                    "exited": {},
                    "loitered": {},
                }
                zones.setdefault(zone, empty)[f"{kind}ed"][cls] = n
            return {
                "detections": dict(self._detections),
                "objects": dict(self._objects) if showing else {},
                "stationary": dict(self._stationary) if showing else {},
                "tracked": dict(self._tracked),
                "crossings": crossings,
                "zones": zones,
            }
