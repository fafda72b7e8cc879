"""Zones (``streams.zones``) and a stream's analytics (``streams.analytics``): what stands in a
zone, objects entering it counted once; on synthetic boxes and on the real model's detections
of a real clip, and through the API."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from engines.types import DetectParams, Engine
from streams.analytics import StreamAnalytics
from streams.detect import StreamDetect
from streams.files import iter_video_frames
from streams.lines import Line, LineCounter
from streams.track import Tracker
from streams.zones import Zone, ZoneCounter, ZoneEvent, ZoneFrame, parse_zones
from tests.helpers import BOTTLE_CLIP, SHELF, SHELF_STREAM, file_stream_app, infer_frames
from tests.helpers import synthetic_detections as dets

LEFT = Zone("left", ((0.0, 0.0), (0.5, 0.0), (0.5, 1.0), (0.0, 1.0)))
BOTTOM = Zone("bottom", ((0.0, 0.6), (1.0, 0.6), (1.0, 1.0), (0.0, 1.0)))


def test_zones_count_what_stands_in_them_by_its_anchor() -> None:
    # Anchors (bottom centres): (150, 400) left; (700, 800) bottom; (300, 900) both.
    frame = dets([[100, 200, 200, 400], [650, 600, 750, 800], [250, 700, 350, 900]], [0, 2, 2])
    got = ZoneCounter().update(frame, [LEFT, BOTTOM])
    assert got.members == [["left"], ["bottom"], ["left", "bottom"]]
    assert got.occupancy == {"left": {0: 1, 2: 1}, "bottom": {2: 2}}
    assert got.events == [] and got.dwell is None  # untracked: occupancy only


def _walk(
    zone: Zone, path: Sequence[float | None], y: float = 400.0
) -> tuple[list[tuple[str, int]], list[ZoneFrame], set[int]]:
    """A car (anchor x along ``path``; None: a frame it was missed in) tracked through
    ``zone``, 0.1 s a frame: its events (kind, frame), each frame's zones, its track ids."""
    tracker, zones = Tracker(), ZoneCounter()
    events: list[tuple[str, int]] = []
    frames: list[ZoneFrame] = []
    ids: set[int] = set()
    for k, x in enumerate(path):
        boxes = [] if x is None else [[x - 100, y - 100, x + 100, y]]
        found = tracker.update(dets(boxes), 0.1 * k).detections
        assert found.track_ids is not None
        ids.update(found.track_ids.tolist())
        got = zones.update(found, [zone], tracker.live_ids(), 0.1 * k, k)
        events += [(e.kind, e.frame) for e in got.events]
        frames.append(got)
    return events, frames, ids


def test_a_stay_keeps_the_class_it_entered_with() -> None:
    """An object entered as one class and called another inside (a bottle, then a vase) left
    as the other: per class, exits outnumbered entries and occupancy went below zero."""
    tracker, zones = Tracker(), ZoneCounter()
    left = Zone("left", LEFT.points, inertia=1, loiter_s=0.3)
    events: list[ZoneEvent] = []
    for k, (x, cls) in enumerate([(300, 2), (350, 2), (400, 7), (450, 7), (550, 7), (600, 7)]):
        found = tracker.update(dets([[x - 100, 300, x + 100, 400]], [cls]), 0.1 * k).detections
        events += zones.update(found, [left], tracker.live_ids(), 0.1 * k, k).events
    assert [(e.kind, e.class_id) for e in events] == [("enter", 2), ("loiter", 2), ("exit", 2)]


def test_a_tracked_object_entering_a_zone_is_counted_once() -> None:
    tracker, zones = Tracker(), ZoneCounter()
    left = Zone("left", LEFT.points, inertia=1)  # entered in one frame, left in one
    kinds: list[str] = []
    ids: set[int] = set()
    exits: list[ZoneEvent] = []
    # A car (anchor x) driving right along y = 400, 50 px a frame, through LEFT's edge at
    # x = 500; it stops and comes back in. None: a frame it was missed in.
    path = [100, 150, 200, 250, None, 350, 400, 450, 500, 550, 600, 600, 600, 550, 500, 450]
    for k, x in enumerate(path):
        boxes = [] if x is None else [[x - 100, 300, x + 100, 400]]
        classes = [7] if k == 3 else [2]  # one frame called a truck: the same object
        if k == 2 and x is not None:
            boxes.append([x - 99, 300, x + 101, 401])  # and a twin box of another class
            classes = [2, 7]
        frame = tracker.update(dets(boxes, classes), 0.1 * k).detections
        assert frame.track_ids is not None
        ids.update(frame.track_ids.tolist())
        got = zones.update(frame, [left], tracker.live_ids(), 0.1 * k, k)
        if k == 2:
            assert got.occupancy["left"] == {2: 1}  # one object, not two
            assert got.dwell == [{"left": 0.2}, {"left": 0.2}]  # in since frame 0, both boxes
        if k == 5:  # after the frame it was missed in: still in since frame 0
            assert got.dwell == [{"left": 0.5}]
        if x is not None and x >= 550:
            assert got.dwell == [{}]  # outside: in no zone
        if k == len(path) - 1:  # back in since the frame before: x = 500 is on the edge
            assert got.dwell is not None and got.dwell[0]["left"] <= 0.1 + 1e-9
        kinds += [e.kind for e in got.events]
        exits += [e for e in got.events if e.kind == "exit"]
    assert ids == {1}  # one object all along
    # Entered at the start; the missed frame, the twin and the class flip are no entries;
    # out at x = 500 (the edge goes either way) or 550, back in at 450: a second entry.
    assert kinds == ["enter", "exit", "enter"]
    (out,) = exits
    assert out.class_id == 2 and not out.lost and out.track_id == 1
    assert out.dwell_s is not None and 0.7 <= out.dwell_s <= 0.8  # frames 0 to 7 or 8 inside


def test_inertia_keeps_a_box_jittering_on_a_zone_edge_one_stay() -> None:
    """A car parked across LEFT's edge (x = 500): its anchor flickers in and out as its box
    jitters. Counted once, as Frigate's zone inertia does; with no inertia, at every flicker
    out past the edge's band."""
    flicker = [560, 540, 490, 480, 495, 510, 490, 485, 505, 490, 495, 492, 530, 540, 550, 560]
    events, frames, ids = _walk(LEFT, flicker)  # inertia 3
    assert ids == {1}
    assert events == [("enter", 4), ("exit", 14)]  # in at 2-4, out at 12-14
    assert [f.members for f in frames[4:14]] == [[["left"]]] * 10  # inside all along
    assert frames[3].members == [[]] and frames[14].members == [[]]
    assert frames[5].occupancy == {"left": {2: 1}}
    jumpy, _, _ = _walk(Zone("left", LEFT.points, inertia=1), flicker)
    # No inertia: at every flicker out past the edge's band (a tenth of the box's height,
    # 10 px here), in at 2 and 6; 505 at 8 is still on the edge.
    assert jumpy == [("enter", 2), ("exit", 5), ("enter", 6), ("exit", 12)]
    # Fewer than 3 frames in a row inside, or missed in between: never entered.
    assert _walk(LEFT, [560, 490, 480, 520, 490, None, 480, 530])[0] == []


def test_an_object_lost_inside_a_zone_exits_when_its_track_ends() -> None:
    # In for 4 frames, then gone: its track ends after MAX_AGE unseen (1 s), and so does its
    # stay, marked lost (it was not seen walking out).
    path: list[float | None] = [300, 300, 300, 300] + [None] * 12
    events, _, _ = _walk(LEFT, path)
    assert events[0] == ("enter", 2)
    assert len(events) == 2 and events[1][0] == "exit"
    tracker, zones = Tracker(), ZoneCounter()
    lost: list[ZoneEvent] = []
    for k, x in enumerate(path):
        found = tracker.update(dets([] if x is None else [[x - 100, 300, x + 100, 400]]), k / 10)
        lost += zones.update(found.detections, [LEFT], tracker.live_ids(), k / 10, k).events
    assert [e.kind for e in lost] == ["enter", "exit"]
    assert lost[1].lost and lost[1].dwell_s == 0.3 and lost[1].class_id == 2


def test_an_object_staying_its_loiter_time_is_loitering_once_a_stay() -> None:
    """Frigate's loitering time: a car parked in LEFT 2 s (10 fps) with loiter_s 1 is one
    zone_loiter event, 1 s after its first frame inside; it then drives out and back in: a
    new stay, a new clock."""
    lot = Zone("left", LEFT.points, loiter_s=1.0)
    out, back = [380.0, 460.0, 540.0, 620.0, 700.0], [620.0, 540.0, 460.0, 380.0, 300.0]
    path = [300.0] * 20 + out + [700.0] * 4 + back + [300.0] * 6
    tracker, zones = Tracker(), ZoneCounter()
    got: list[ZoneEvent] = []
    for k, x in enumerate(path):
        found = tracker.update(dets([[x - 100, 300, x + 100, 400]]), k / 10)
        got += zones.update(found.detections, [lot], tracker.live_ids(), k / 10, k).events
    assert [(e.kind, e.frame) for e in got] == [
        ("enter", 2),
        ("loiter", 10),  # t = 1.0 s since its first frame inside (frame 0)
        ("exit", 24),  # outside (x > 500) from frame 22, 3 frames in a row
        ("enter", 33),  # inside again from frame 31
    ]  # and there for 0.8 s to the end: too short to loiter again
    loiter = got[1].to_json(str)
    assert loiter["type"] == "zone_loiter" and loiter["dwell_s"] == 1.0
    assert lot.to_json()["loiter_s"] == 1.0
    for bad in (0, -1, 90_000, "soon", True):
        with pytest.raises(ValueError, match="loiter_s"):
            Zone("z", LEFT.points, loiter_s=bad)  # type: ignore[arg-type]


def test_removed_zones_are_forgotten_and_bad_zones_refused() -> None:
    tracker, zones = Tracker(), ZoneCounter()
    left = Zone("left", LEFT.points, inertia=1)
    frame = tracker.update(dets([[100, 100, 200, 200]]), 0.0).detections
    assert [e.kind for e in zones.update(frame, [left], tracker.live_ids()).events] == ["enter"]
    # The zone removed: the object in it leaves it, lost (its entry stayed unpaired).
    (gone,) = zones.update(frame, [], tracker.live_ids(), frame=7).events
    assert (gone.zone, gone.kind, gone.lost, gone.frame) == ("left", "exit", True, 7)
    assert [e.kind for e in zones.update(frame, [left], tracker.live_ids()).events] == ["enter"]
    square = [[0, 0], [1, 0], [1, 1], [0, 1]]
    for raw, message in (
        ([{"name": "", "points": square}], "name"),
        ([{"name": "a", "points": [[0, 0], [1, 1]]}], "2 points"),
        ([{"name": "a", "points": [[0, 0], [1, 0], [1, 2]]}], "outside [0, 1]"),
        ([{"name": "a", "points": "x"}], "points"),
        ([{"name": "a", "points": square}] * 2, "same name"),
        ([{"name": f"z{i}", "points": square} for i in range(17)], "at most 16"),
        ([{"name": "a", "points": square, "inertia": 0}], "inertia is a number of frames"),
        ([{"name": "a", "points": square, "inertia": 2.5}], "inertia is a number of frames"),
        ([{"name": "a", "points": square, "inertias": 2}], "unknown field(s) ['inertias']"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            parse_zones(raw)
    assert parse_zones([{"name": "a", "points": square, "inertia": 5}])[0].inertia == 5


def test_analytics_apply_the_frame_settings_and_keep_the_counts() -> None:
    analytics = StreamAnalytics()
    settings = StreamDetect(
        track=True,
        lines=(Line("gate", (0.0, 0.5), (1.0, 0.5)),),
        zones=(BOTTOM,),
    )
    kinds: list[str] = []
    boxes: list[tuple[list[float], float]] = []
    for k in range(10):  # a car driving down the picture, through the gate into BOTTOM
        y = 300 + 50 * k  # inside BOTTOM (y >= 600) from frame 6, entered at frame 8
        done = analytics.process(dets([[400, y - 100, 500, y]]), settings, 0.1 * k, k)
        assert done.detections.track_ids is not None and done.zones is not None
        kinds += [f"{e.to_json(str)['type']}@{e.frame}" for e in done.events]
        boxes += [(e.to_json(str)["box"], e.to_json(str)["confidence"]) for e in done.events]
    # Crossed once clearly past the line (frame 4 stands on it: frame 5).
    assert kinds == ["line_crossing@5", "zone_enter@8"]
    # Each event says where its object was in that frame: the box and its confidence.
    assert boxes == [([400.0, 450.0, 500.0, 550.0], 0.9), ([400.0, 600.0, 500.0, 700.0], 0.9)]
    counts = analytics.snapshot()
    assert counts["crossings"] == {"gate": {"in": {"car": 1}, "out": {}}}
    assert counts["zones"] == {
        "bottom": {"now": {"car": 1}, "entered": {"car": 1}, "exited": {}, "loitered": {}}
    }
    assert counts["tracked"] == {"car": 1} and counts["detections"] == {"car": 10}
    # Lines and zones taken away: their counts go with them (bounded counts and series).
    done = analytics.process(dets([[400, 700, 500, 800]]), StreamDetect(), 1.0, 10)
    assert done.zones is None and done.detections.track_ids is None
    counts = analytics.snapshot()
    assert counts["zones"] == {} and counts["crossings"] == {}
    assert counts["tracked"] == {"car": 1}  # objects seen stay counted


def test_zones_and_lines_with_classes_count_only_those() -> None:
    """A zone for cars and a line for people, as Frigate's zone objects: a person and a car
    walk the same way; each shape counts its own class only."""
    analytics = StreamAnalytics()
    cars_only = Zone("bottom", BOTTOM.points, classes=("car",))
    people = Line("gate", (0.0, 0.5), (1.0, 0.5), classes=("person",))
    settings = StreamDetect(track=True, lines=(people,), zones=(cars_only, LEFT))
    kinds: list[str] = []
    for k in range(10):  # both driving down the picture, through the gate into BOTTOM
        y = 300 + 50 * k
        frame = dets([[100, y - 100, 200, y], [600, y - 100, 700, y]], [0, 2])  # person, car
        done = analytics.process(frame, settings, 0.1 * k, k)
        kinds += [
            f"{body['type']} {body.get('line') or body.get('zone')} {body['class_name']}"
            for body in (e.to_json(done.detections.name_of) for e in done.events)
        ]
    # The person crosses the gate (the car's crossing is not counted) and enters LEFT (every
    # class); only the car enters the zone for cars.
    assert sorted(kinds) == [
        "line_crossing gate person",
        "zone_enter bottom car",
        "zone_enter left person",
    ]
    counts = analytics.snapshot()
    assert counts["zones"]["bottom"]["now"] == {"car": 1}
    assert counts["crossings"] == {"gate": {"in": {"person": 1}, "out": {}}}
    assert cars_only.to_json()["classes"] == ["car"] and LEFT.to_json()["classes"] is None
    with pytest.raises(ValueError, match="classes is a list of class names"):
        parse_zones([{"name": "z", "points": [list(p) for p in BOTTOM.points], "classes": "car"}])


def test_a_line_for_cars_counts_a_car_the_model_calls_otherwise_as_it_crosses() -> None:
    """The real clip's first car is called a cell phone in the frames it crosses the line in:
    a line for cars took its side then and never counted it. Frames of another class are on
    neither side, as zones count them: the car beyond the line is counted (a truck here)."""
    analytics = StreamAnalytics()
    cars = Line("gate", (0.0, 0.5), (1.0, 0.5), classes=("car",))
    settings = StreamDetect(track=True, lines=(cars,))
    crossings = []
    path = [(600 - 20 * k, 2 if k < 4 or k > 7 else 7) for k in range(11)]  # car, truck, car
    for k, (y, cls) in enumerate(path):  # up the picture, across y=500 while called a truck
        done = analytics.process(dets([[300, y - 100, 400, y]], [cls]), settings, 0.1 * k, k)
        crossings += [e.to_json(done.detections.name_of) for e in done.events]
    assert [(c["line"], c["direction"], c["class_name"]) for c in crossings] == [
        ("gate", "out", "car")
    ]
    assert analytics.snapshot()["crossings"] == {"gate": {"in": {}, "out": {"car": 1}}}


def test_objects_in_zones_leave_them_when_tracking_is_turned_off_or_the_video_ends() -> None:
    """An entry always gets its exit: turning ``track`` off dropped the stays without one
    (entered stayed ahead of exited for good), and so did a video job's end."""
    analytics = StreamAnalytics()
    tracked = StreamDetect(track=True, zones=(LEFT,))
    kinds: list[tuple[str, int, bool]] = []

    def step(k: int, settings: StreamDetect) -> None:
        done = analytics.process(dets([[100, 300, 200, 400]]), settings, 0.1 * k, k)
        kinds.extend((e.kind, e.frame, e.lost) for e in done.events if isinstance(e, ZoneEvent))

    for k in range(4):
        step(k, tracked)
    step(4, StreamDetect(zones=(LEFT,)))  # PATCH {"track": false}
    for k in range(5, 9):
        step(k, tracked)
    assert kinds == [("enter", 2, False), ("exit", 4, True), ("enter", 7, False)]
    ended = analytics.end(9, lambda c: "car")
    assert [(e.zone, e.kind, e.frame, e.lost, e.dwell_s) for e in ended] == [
        ("left", "exit", 9, True, 0.3)
    ]
    moves = analytics.snapshot()["zones"]["left"]
    assert moves["entered"] == {"car": 2} and moves["exited"] == {"car": 2}, moves
    assert analytics.end(10, str) == []  # nobody left inside


def test_a_line_under_a_pixel_long_is_refused() -> None:
    with pytest.raises(ValueError, match=r"under 0\.001 of the picture apart"):
        Line.parse({"name": "dot", "points": [[0.5, 0.5], [0.5, 0.5000000001]]})
    assert Line.parse({"name": "short", "points": [[0.5, 0.5], [0.5, 0.502]]}).name == "short"


def test_shape_classes_are_checked_and_kept_by_name(tmp_path: Path) -> None:
    zone = {**SHELF, "classes": ["bottle", 41]}  # 41: cup
    with TestClient(file_stream_app(tmp_path)) as c:
        resp = c.post("/streams", json={**SHELF_STREAM, "zones": [zone]})
        assert resp.status_code == 201, resp.text
        sid = resp.json()["id"]
        assert resp.json()["detect"]["zones"][0]["classes"] == ["bottle", "cup"]
        loiter = c.patch(
            f"/streams/{sid}", json={"track": True, "zones": [{**zone, "loiter_s": 30}]}
        )
        assert loiter.json()["detect"]["zones"][0]["loiter_s"] == 30
        line = {"name": "gate", "points": [[0, 0.5], [1, 0.5]], "classes": "cup, Bottle"}
        resp = c.patch(f"/streams/{sid}", json={"track": True, "lines": [line]})
        assert resp.json()["detect"]["lines"][0]["classes"] == ["bottle", "cup"]
        for bad, words in (
            ({"zones": [{**SHELF, "classes": ["unicorn"]}]}, "unknown class name 'unicorn'"),
            ({"zones": [{**SHELF, "classes": []}]}, "at least one class"),
            ({"lines": [{**line, "classes": [999]}]}, "unknown class id 999"),
            ({"zones": [{**SHELF, "loiter_s": 0}]}, "loiter_s"),
        ):
            resp = c.patch(f"/streams/{sid}", json=bad)
            assert resp.status_code == 422 and words in resp.text, resp.text
    # A stored class the model does not have is named with its zone.
    with pytest.raises(ValueError, match="zones: 'shelf': classes: unknown class name 'wand'"):
        StreamDetect.from_description(
            {"zones": [{**SHELF, "classes": ["wand"]}]}, {0: "person", 39: "bottle"}
        )


# ---- the real model on a real clip, and through the API --------------------------------------


def test_the_bottle_standing_in_a_zone_is_counted_there_and_enters_once(
    ort_engine: Engine,
) -> None:
    frames = list(iter_video_frames(BOTTLE_CLIP, step=3, limit=24))
    analytics = StreamAnalytics()
    settings = StreamDetect(
        DetectParams(classes=frozenset({39})), track=True, zones=parse_zones([SHELF])
    )
    inside: list[int] = []
    dwell: list[float] = []
    for k, found in enumerate(infer_frames(ort_engine, frames, settings.params)):
        done = analytics.process(found, settings, k * 0.1, k)
        assert done.zones is not None and done.dwell is not None
        inside.append(sum("shelf" in z for z in done.zones))
        dwell += [d["shelf"] for d in done.dwell if "shelf" in d]
    assert max(inside) == 1 and sum(inside) >= len(inside) - 2, inside  # one bottle, steadily
    assert analytics.snapshot()["zones"]["shelf"]["entered"] == {"bottle": 1}
    # One long stay, entered in its third frame (inertia 3), timed from its first.
    assert dwell == sorted(dwell) and dwell[0] == 0.2 and dwell[-1] >= 2.0


def test_zones_through_the_api_websocket_and_metrics(tmp_path: Path) -> None:
    with TestClient(file_stream_app(tmp_path)) as c:
        bad = c.post("/streams", json={"url": f"file://{BOTTLE_CLIP}", "zones": [{"name": "x"}]})
        assert bad.status_code == 422 and "points" in bad.text
        resp = c.post("/streams", json=SHELF_STREAM)
        assert resp.status_code == 201, resp.text
        sid = resp.json()["id"]
        stored = {**SHELF, "inertia": 3, "classes": None, "loiter_s": None}
        assert resp.json()["detect"]["zones"] == [stored]
        with c.websocket_connect(f"/ws/streams/{sid}") as ws:
            messages: list[dict[str, Any]] = [ws.receive_json() for _ in range(4)]
        detections = [d for m in messages for d in m["detections"]]
        assert detections and all("zones" in d for d in detections)
        assert not any("dwell_s" in d for d in detections)  # dwell needs tracking
        shelf = [d for d in detections if d["zones"] == ["shelf"]]
        assert shelf and all((d["box"][0] + d["box"][2]) / 2 >= 0.6 * 640 for d in shelf)
        zones = c.get(f"/streams/{sid}").json()["zones"]
        assert zones["shelf"]["now"] == {"bottle": 1}, zones
        assert zones["shelf"]["entered"] == zones["shelf"]["exited"] == {}  # need tracking
        metrics = c.get("/metrics").text
        want = f'streamdet_stream_zone_objects{{class="bottle",stream="{sid}",zone="shelf"}} 1.0'
        assert want in metrics
        resp = c.patch(f"/streams/{sid}", json={"zones": []})
        assert resp.status_code == 200 and resp.json()["detect"]["zones"] == []


def test_viewers_get_the_lost_exits_of_a_stream_switched_off_or_restarted_disabled(
    tmp_path: Path,
) -> None:
    """A stream switched off with a tracked bottle on its shelf logs the bottle's exit,
    ``lost``: GET /events, webhooks and MQTT had it, the WebSocket never (its overlay kept the
    bottle on the shelf); it comes with the stream's last frame, before the state change. A
    viewer of a stream kept disabled across a restart is told so first, as one of a stream
    disabled in the same run is (it was told nothing)."""
    stream = {**SHELF_STREAM, "id": "shelf", "track": True}
    with TestClient(file_stream_app(tmp_path)) as c:
        assert c.post("/streams", json=stream).status_code == 201
        with c.websocket_connect("/ws/streams/shelf?states=true") as ws:
            for _ in range(200):  # until the bottle has entered the shelf
                message = ws.receive_json()
                if any(e["type"] == "zone_enter" for e in message.get("events", ())):
                    break
            else:
                raise AssertionError("no bottle entered the shelf")
            off = c.patch("/streams/shelf", json={"enabled": False})
            assert off.status_code == 200, off.text
            events: list[dict[str, Any]] = []
            while (message := ws.receive_json()).get("type") != "stream_state":
                events += message.get("events", [])
            assert message["state"] == "disabled", message
        lost = [e for e in events if e["type"] == "zone_exit"]
        assert len(lost) == 1 and lost[0]["lost"] is True, events
        logged = c.get("/events", params={"type": "zone_exit"}).json()["events"]
        assert [(e["track_id"], e["frame"]) for e in logged] == [
            (lost[0]["track_id"], lost[0]["frame"])
        ]
    with (
        TestClient(file_stream_app(tmp_path)) as c,
        c.websocket_connect("/ws/streams/shelf?states=true") as ws,
    ):
        told = ws.receive_json()
        assert (told["type"], told["state"]) == ("stream_state", "disabled"), told
        assert told["id"] == c.get("/events", params={"latest": "true"}).json()["events"][-1]["id"]


def test_a_car_parked_across_a_zone_edge_is_one_stay_however_long() -> None:
    """A parked car's anchor on LEFT's edge, a few pixels either way for 30 s at 5 fps: one
    stay (inertia 3 alone gave one stay per run of 3 frames inside: 8 entries in 30 s)."""
    rng = np.random.default_rng(5)
    path = [400.0, 450.0, 480.0, 495.0] + [500 + float(rng.uniform(-4, 4)) for _ in range(150)]
    events, _, _ = _walk(LEFT, path)
    assert [kind for kind, _ in events] == ["enter"]


def test_settings_stored_before_a_refusal_still_load_and_a_bow_tie_has_an_inside() -> None:
    """A zone with loiter_s on an untracked stream, or a flat zone, stored before the API
    refused them, still load (their streams failed at start, "do not fit this model"); a
    polygon whose edges cross encloses an area and is taken."""
    from streams.geometry import check_area

    stored = {
        "zones": [
            {"name": "lot", "points": [[0, 0], [1, 0], [1, 1]], "loiter_s": 30},
            {"name": "flat", "points": [[0.1, 0.1], [0.5, 0.5], [0.9, 0.9]]},
        ]
    }
    detect = StreamDetect.from_description(stored, {0: "person", 2: "car"})
    assert [z.name for z in detect.zones] == ["lot", "flat"]
    with pytest.raises(ValueError, match="'lot': loiter_s needs track"):
        detect.refuse_useless()
    check_area(((0.2, 0.2), (0.8, 0.8), (0.8, 0.2), (0.2, 0.8)), "zones: 'bow'")
    with pytest.raises(ValueError, match="enclose no area"):
        check_area(((0.1, 0.1), (0.5, 0.5), (0.9, 0.9)), "zones: 'flat'")


def test_names_with_control_characters_or_lone_surrogates_are_refused(tmp_path: Path) -> None:
    """A zone named ``bad\\u0000zone`` was accepted: its MQTT topic got the server's client
    dropped by the broker, again at each reconnect; ``sur\\ud800`` was a 500. Each is a 422
    naming the field, for zones, lines and the stream's name; stored settings with such a
    name still load (MQTT makes a valid topic level of it)."""
    line = {"name": "gate", "points": [[0, 0.5], [1, 0.5]]}
    escaped = {"content-type": "application/json"}  # as JSON escapes them: \u0000, \ud800
    with TestClient(file_stream_app(tmp_path)) as c:
        for body, field in (
            ({"zones": [{**SHELF, "name": "bad\u0000zone"}]}, "zones"),
            ({"zones": [{**SHELF, "name": "sur\ud800"}]}, "zones"),
            ({"zones": [{**SHELF, "name": "tab\tzone"}]}, "zones"),
            ({"track": True, "lines": [{**line, "name": "new\nline"}]}, "lines"),
            ({"name": "door\u0000"}, "name"),
            ({"name": "door\udfff"}, "name"),
        ):
            data = json.dumps({**SHELF_STREAM, **body})
            resp = c.post("/streams", content=data, headers=escaped)
            assert resp.status_code == 422, (body, resp.text)
            assert f"{field}: name " in resp.text, resp.text
        assert c.get("/streams").json()["streams"] == []
        sid = c.post("/streams", json={**SHELF_STREAM, "name": "入口 door"}).json()["id"]
        bad = c.patch(f"/streams/{sid}", json={"zones": [{**SHELF, "name": "bad\u0000zone"}]})
        assert bad.status_code == 422 and "zones: name" in bad.text
        data = json.dumps({"zones": [{**SHELF, "name": "sur\ud800"}]})
        assert c.patch(f"/streams/{sid}", content=data, headers=escaped).status_code == 422
        assert c.patch(f"/streams/{sid}", json={"name": "x\u0001"}).status_code == 422
        ok = c.patch(f"/streams/{sid}", json={"zones": [{**SHELF, "name": "入口"}]})
        assert ok.status_code == 200 and ok.json()["detect"]["zones"][0]["name"] == "入口"
    stored = {"zones": [{**SHELF, "name": "bad\u0000zone"}]}
    assert StreamDetect.from_description(stored, {39: "bottle"}).zones[0].name == "bad\u0000zone"


def test_a_zone_left_empty_reads_0_in_the_metrics_not_nothing() -> None:
    """``streamdet_stream_zone_objects`` of a class the stream has detected reads 0 while its
    zone is empty, as ``streamdet_stream_objects`` does (the series went missing: gaps in
    graphs, an "empty for 10 minutes" rule never fired); a zone counting some classes only
    has series of those."""
    from server.routes.streams import _zone_objects

    info = {
        "detect": {
            "zones": [{"name": "dock", "classes": None}, {"name": "bay", "classes": ["car"]}]
        },
        "detections": {"car": 40, "person": 3},
        "zones": {
            "dock": {"now": {"person": 1}, "entered": {}, "exited": {}, "loitered": {}},
            "bay": {"now": {}, "entered": {}, "exited": {}, "loitered": {}},
        },
    }
    assert _zone_objects(info) == {("dock", "car"): 0, ("dock", "person"): 1, ("bay", "car"): 0}


def test_an_object_on_its_way_out_neither_loiters_nor_stays_longer() -> None:
    """The frames an object is seen outside before its exit (``inertia``) are no stay: one
    inside 1.0 s with ``loiter_s`` 1.2 loitered at 1.2 s, seen outside, then exited with 1.0 s."""
    lot = Zone("left", LEFT.points, loiter_s=1.2)
    path = [300.0] * 9 + [380.0, 460.0, 540.0, 620.0, 700.0]  # inside to frame 10, 0.1 s each
    tracker, zones = Tracker(), ZoneCounter()
    got: list[ZoneEvent] = []
    dwell: list[float] = []
    for k, x in enumerate(path):
        found = tracker.update(dets([[x - 100, 300, x + 100, 400]]), k / 10).detections
        zoned = zones.update(found, [lot], tracker.live_ids(), k / 10, k)
        got += zoned.events
        assert zoned.dwell is not None
        dwell += [d["left"] for d in zoned.dwell if "left" in d]
    assert [(e.kind, e.frame, e.dwell_s) for e in got] == [("enter", 2, None), ("exit", 13, 1.0)]
    assert max(dwell) == 1.0  # it grew to 1.2 while the car was outside


def test_a_shape_for_cars_takes_the_cars_box_of_an_object_listed_after_another_class() -> None:
    """Two boxes of one object (a car also called a cell phone, listed first): a line and a
    zone for cars took the first box, were skipped, and counted the car a frame late."""
    cars_line = Line("gate", (0.0, 0.5), (1.0, 0.5), classes=("car",))
    cars_zone = Zone("bottom", BOTTOM.points, inertia=1, classes=("car",))
    lines, zones = LineCounter(), ZoneCounter()
    crossed: list[int] = []
    entered: list[int] = []
    for k, y in enumerate([300.0, 400.0, 700.0]):  # down across y=500 and into BOTTOM
        # The car alone, then the person's box first (another class, the same track).
        car = [300.0, y - 100, 400.0, y]
        classes, boxes = ([2], [car]) if k < 2 else ([0, 2], [[300.0, 200.0, 400.0, 300.0], car])
        frame = replace(dets(boxes, classes), track_ids=np.ones(len(boxes), np.int64))
        crossed += [c.frame for c in lines.update(frame, [cars_line], [1], k)]
        entered += [e.frame for e in zones.update(frame, [cars_zone], [1], 0.1 * k, k).events]
    assert crossed == [2] and entered == [2]


def test_a_removed_zone_or_line_takes_its_counts_at_once_where_no_frame_comes() -> None:
    """A stream not running (ended, disabled) has no next frame: a line or zone removed kept
    its counts, and their metric series, until it ran again."""
    analytics = StreamAnalytics()
    gate = Line("gate", (0.0, 0.5), (1.0, 0.5))
    settings = StreamDetect(track=True, lines=(gate,), zones=(BOTTOM,))
    for k in range(10):  # down the picture, through the gate into BOTTOM
        y = 300 + 50 * k
        analytics.process(dets([[600, y - 100, 700, y]]), settings, 0.1 * k, k)
    counts = analytics.snapshot()
    assert counts["crossings"]["gate"]["in"] == {"car": 1} and "bottom" in counts["zones"]
    analytics.reshape(StreamDetect(track=True))
    counts = analytics.snapshot()
    assert counts["crossings"] == {} and counts["zones"] == {}
    # A frame still in flight, taken with the old settings, brings none of them back.
    analytics.process(dets([[600, 700, 700, 800]]), settings, 1.0, 10)
    counts = analytics.snapshot()
    assert counts["crossings"] == {} and counts["zones"] == {}
