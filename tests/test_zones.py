"""Zones (``streams.zones``) and a stream's analytics (``streams.analytics``): what stands in a
zone, objects entering it counted once; on synthetic boxes and on the real model's detections
of a real clip, and through the API."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from engines.types import DetectParams, Engine
from streams.analytics import StreamAnalytics
from streams.detect import StreamDetect
from streams.files import iter_video_frames
from streams.lines import Line
from streams.track import Tracker
from streams.zones import Zone, ZoneCounter, parse_zones
from tests.helpers import VIDEOS, file_stream_app, infer_frames
from tests.helpers import synthetic_detections as dets

LEFT = Zone("left", ((0.0, 0.0), (0.5, 0.0), (0.5, 1.0), (0.0, 1.0)))
BOTTOM = Zone("bottom", ((0.0, 0.6), (1.0, 0.6), (1.0, 1.0), (0.0, 1.0)))


def test_zones_count_what_stands_in_them_by_its_anchor() -> None:
    # Anchors (bottom centres): (150, 400) left; (700, 800) bottom; (300, 900) both.
    frame = dets([[100, 200, 200, 400], [650, 600, 750, 800], [250, 700, 350, 900]], [0, 2, 2])
    got = ZoneCounter().update(frame, [LEFT, BOTTOM])
    assert got.members == [["left"], ["bottom"], ["left", "bottom"]]
    assert got.occupancy == {"left": {0: 1, 2: 1}, "bottom": {2: 2}}
    assert got.entered == [] and got.dwell is None  # untracked: occupancy only


def test_a_tracked_object_entering_a_zone_is_counted_once() -> None:
    tracker, zones = Tracker(), ZoneCounter()
    entered: list[tuple[str, int]] = []
    ids: set[int] = set()
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
        got = zones.update(frame, [LEFT], tracker.live_ids(), 0.1 * k)
        if k == 2:
            assert got.occupancy["left"] == {2: 1}  # one object, not two
            assert got.dwell == [{"left": 0.2}, {"left": 0.2}]  # in since frame 0, both boxes
        if k == 5:  # after the frame it was missed in: still in since frame 0
            assert got.dwell == [{"left": 0.5}]
        if x is not None and x >= 550:
            assert got.dwell == [{}]  # outside: in no zone
        if k == len(path) - 1:  # back in since the frame before: x = 500 is on the edge
            assert got.dwell is not None and got.dwell[0]["left"] <= 0.1 + 1e-9
        entered += got.entered
    assert ids == {1}  # one object all along
    # Entered at the start; the missed frame, the twin and the class flip are no entries;
    # out at x = 500 (the edge goes either way) or 550, back in at 450: a second entry.
    assert entered == [("left", 2), ("left", 2)]


def test_removed_zones_are_forgotten_and_bad_zones_refused() -> None:
    tracker, zones = Tracker(), ZoneCounter()
    frame = tracker.update(dets([[100, 100, 200, 200]]), 0.0).detections
    assert zones.update(frame, [LEFT], tracker.live_ids()).entered == [("left", 2)]
    zones.update(frame, [], tracker.live_ids())  # the zone was removed
    assert zones.update(frame, [LEFT], tracker.live_ids()).entered == [("left", 2)]
    square = [[0, 0], [1, 0], [1, 1], [0, 1]]
    for raw, message in (
        ([{"name": "", "points": square}], "name"),
        ([{"name": "a", "points": [[0, 0], [1, 1]]}], "2 points"),
        ([{"name": "a", "points": [[0, 0], [1, 0], [1, 2]]}], "outside [0, 1]"),
        ([{"name": "a", "points": "x"}], "points"),
        ([{"name": "a", "points": square}] * 2, "same name"),
        ([{"name": f"z{i}", "points": square} for i in range(17)], "at most 16"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            parse_zones(raw)


def test_analytics_apply_the_frame_settings_and_keep_the_counts() -> None:
    analytics = StreamAnalytics()
    settings = StreamDetect(
        track=True,
        lines=(Line("gate", (0.0, 0.5), (1.0, 0.5)),),
        zones=(BOTTOM,),
    )
    for k in range(8):  # a car driving down the picture, through the gate into BOTTOM
        y = 300 + 50 * k
        done = analytics.process(dets([[400, y - 100, 500, y]]), settings, 0.1 * k, k)
        assert done.detections.track_ids is not None and done.zones is not None
    counts = analytics.snapshot()
    assert counts["crossings"] == {"gate": {"in": {"car": 1}, "out": {}}}
    assert counts["zones"] == {"bottom": {"now": {"car": 1}, "entered": {"car": 1}}}
    assert counts["tracked"] == {"car": 1} and counts["detections"] == {"car": 8}
    # Lines and zones taken away: their counts go with them (bounded counts and series).
    done = analytics.process(dets([[400, 700, 500, 800]]), StreamDetect(), 0.8, 8)
    assert done.zones is None and done.detections.track_ids is None
    counts = analytics.snapshot()
    assert counts["zones"] == {} and counts["crossings"] == {}
    assert counts["tracked"] == {"car": 1}  # objects seen stay counted


# ---- the real model on a real clip, and through the API --------------------------------------


BOTTLE_CLIP = next((v for v in VIDEOS if v.name.startswith("bottle")), Path("missing"))
# The right 40% of the bottle clip, where one of its three bottles stands.
SHELF = {"name": "shelf", "points": [[0.6, 0.0], [1.0, 0.0], [1.0, 1.0], [0.6, 1.0]]}


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
    assert dwell == sorted(dwell) and dwell[0] == 0.0 and dwell[-1] >= 2.0  # one long stay


def test_zones_through_the_api_websocket_and_metrics(tmp_path: Path) -> None:
    with TestClient(file_stream_app(tmp_path)) as c:
        bad = c.post("/streams", json={"url": f"file://{BOTTLE_CLIP}", "zones": [{"name": "x"}]})
        assert bad.status_code == 422 and "points" in bad.text
        resp = c.post(
            "/streams",
            json={
                "url": f"file://{BOTTLE_CLIP}",
                "max_fps": 8,
                "classes": "bottle",
                "zones": [SHELF],
            },
        )
        assert resp.status_code == 201, resp.text
        sid = resp.json()["id"]
        assert resp.json()["detect"]["zones"] == [SHELF]
        with c.websocket_connect(f"/ws/streams/{sid}") as ws:
            messages: list[dict[str, Any]] = [ws.receive_json() for _ in range(4)]
        detections = [d for m in messages for d in m["detections"]]
        assert detections and all("zones" in d for d in detections)
        assert not any("dwell_s" in d for d in detections)  # dwell needs tracking
        shelf = [d for d in detections if d["zones"] == ["shelf"]]
        assert shelf and all((d["box"][0] + d["box"][2]) / 2 >= 0.6 * 640 for d in shelf)
        zones = c.get(f"/streams/{sid}").json()["zones"]
        assert zones["shelf"]["now"] == {"bottle": 1}, zones
        assert zones["shelf"]["entered"] == {}  # entries need tracking
        metrics = c.get("/metrics").text
        want = f'streamdet_stream_zone_objects{{class="bottle",stream="{sid}",zone="shelf"}} 1.0'
        assert want in metrics
        resp = c.patch(f"/streams/{sid}", json={"zones": []})
        assert resp.status_code == 200 and resp.json()["detect"]["zones"] == []
