"""Tracking (``streams.track``): ids that follow objects across frames, objects counted once;
on synthetic boxes with known motion, and on the real model's detections of a real clip."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engines.types import Detections, DetectParams, Engine
from engines.yolo import box_iou
from streams.analytics import StreamAnalytics
from streams.detect import LOW_CONF, Roi, StreamDetect
from streams.fanout import detections_json
from streams.files import iter_video_frames
from streams.lines import Crossing, Line, LineCounter, parse_lines
from streams.track import MAX_AGE_S, MIN_HITS, Tracker
from tests.helpers import VIDEOS, infer_frames
from tests.helpers import synthetic_detections as dets


def ids(tracker: Tracker, d: Detections, t: float) -> list[int]:
    out = tracker.update(d, t).detections.track_ids
    assert out is not None
    return [int(i) for i in out]


def test_a_moving_object_keeps_its_id_and_is_counted_once() -> None:
    tracker = Tracker()
    seen, counted = set(), []
    for k in range(10):
        x = 100 + 30 * k  # 300 px/s, frames 0.1 s apart
        result = tracker.update(dets([[x, 100, x + 100, 200]]), 0.1 * k)
        assert result.detections.track_ids is not None
        seen.update(result.detections.track_ids.tolist())
        counted += result.new_objects
    assert seen == {1}
    assert counted == [2]  # one car, counted when it had been seen MIN_HITS times


def test_velocity_carries_a_fast_object_across_frames_it_does_not_overlap() -> None:
    # 150 px a frame with a 100 px box: consecutive boxes never overlap, the prediction does.
    tracker = Tracker()
    got = [ids(tracker, dets([[150 * k, 0, 150 * k + 100, 100]]), 0.1 * k) for k in range(2)]
    assert got == [[1], [2]]  # without a velocity yet, the second frame starts a track
    tracker = Tracker()
    ids(tracker, dets([[0, 0, 100, 100]]), 0.0)
    ids(tracker, dets([[50, 0, 150, 100]]), 0.1)  # overlaps: paired, velocity 500 px/s
    assert ids(tracker, dets([[200, 0, 300, 100]]), 0.4) == [1]  # 3 frames dropped, predicted


def test_two_objects_passing_each_other_keep_their_ids() -> None:
    tracker = Tracker()
    for k in range(8):
        left = [50 + 40 * k, 100, 150 + 40 * k, 200]  # moving right
        right = [450 - 40 * k, 130, 550 - 40 * k, 230]  # moving left, a little lower
        swap = k % 2 == 1  # the order detections come in must not matter
        got = ids(tracker, dets([right, left] if swap else [left, right]), 0.1 * k)
        assert (got[::-1] if swap else got) == [1, 2], k


def test_tracks_end_after_max_age_and_ids_are_never_reused() -> None:
    tracker = Tracker()
    box = [[100, 100, 200, 200]]
    assert ids(tracker, dets(box), 0.0) == [1]
    assert ids(tracker, dets([]), 0.5) == []
    assert ids(tracker, dets(box), 0.5 + MAX_AGE_S / 2) == [1]  # unseen for less: same id
    assert ids(tracker, dets(box), 2.0 + MAX_AGE_S) == [2]  # gone too long: a new object
    tracker.clear()
    assert len(tracker) == 0
    assert ids(tracker, dets(box), 10.0) == [3]


def test_flicker_and_class_flips_are_not_counted_twice() -> None:
    tracker = Tracker()
    counted: list[int] = []
    vehicle = [300, 300, 400, 400]
    for k in range(6):
        boxes = [vehicle]
        classes = [2 if k % 2 else 7]  # car, truck, car, ...: one vehicle
        if k == 2:
            boxes.append([800, 800, 850, 850])  # one frame only: a false positive
            classes.append(0)
        if k == 3:
            boxes.append([301, 300, 401, 401])  # class-aware NMS kept a second box on it
            classes.append(7)
        result = tracker.update(dets(boxes, classes), 0.1 * k)
        assert result.detections.track_ids is not None
        assert result.detections.track_ids[0] == 1
        if k == 3:
            assert result.detections.track_ids.tolist() == [1, 1]  # the same object
        counted += result.new_objects
    assert counted == [2 if MIN_HITS % 2 == 0 else 7]  # once, with its class at the time


def test_a_parked_object_becomes_stationary_and_a_moving_one_does_not() -> None:
    analytics = StreamAnalytics()
    detect = StreamDetect(track=True)
    for i in range(25):  # 12 s at 2 fps: a parked car jittering a pixel, a walker
        t = i * 0.5
        jitter = i % 2
        frame = dets(
            [[100 + jitter, 100, 300 + jitter, 200], [600 + 20 * i, 500, 640 + 20 * i, 600]]
        )
        done = analytics.process(frame, detect, t, i + 1)
    assert done.still is not None
    parked, walker = done.still
    assert parked == pytest.approx(12.0) and walker == 0.0
    message = detections_json(done.detections, None, None, done.still)
    assert [(d["still_s"], d["stationary"]) for d in message] == [(12.0, True), (0.0, False)]
    assert analytics.snapshot()["stationary"] == {"car": 1}
    # The parked car drives off: it settles anew where it stops.
    moved = analytics.process(dets([[400, 100, 600, 200]]), detect, 12.5, 26)
    assert moved.still == [0.0]
    assert analytics.snapshot()["stationary"] == {}
    untracked = StreamAnalytics().process(dets([[0, 0, 10, 10]]), StreamDetect(), 0.0, 1)
    assert untracked.still is None


def test_bad_settings_are_refused() -> None:
    for kwargs, message in (
        ({"iou_match": 0.0}, "iou_match"),
        ({"max_age_s": 0.0}, "max_age_s"),
        ({"min_hits": 0}, "min_hits"),
    ):
        with pytest.raises(ValueError, match=message):
            Tracker(**kwargs)


def test_json_carries_track_ids_only_when_tracked() -> None:
    plain = dets([[0, 0, 10, 10]])
    assert "track_id" not in plain.to_json()[0]
    tracked = Tracker().update(plain, 0.0).detections
    assert tracked.to_json()[0]["track_id"] == 1
    assert tracked.select(np.array([False])).track_ids is not None


def scored(boxes: list[list[float]], scores: list[float]) -> Detections:
    """Cars at ``boxes`` with these confidences (descending)."""
    return dataclasses.replace(dets(boxes), scores=np.asarray(scores, np.float32))


def test_an_object_whose_confidence_dips_keeps_its_track_through_weak_boxes() -> None:
    """ByteTrack's second association: a tracked car under the stream's confidence for two
    frames keeps its id and its box; weak boxes elsewhere, or on an object not yet seen
    often enough to count, are dropped, and never start a track."""
    tracker = Tracker()

    def car(k: int) -> list[float]:  # 300 px/s
        return [100 + 30 * k, 100, 200 + 30 * k, 200]

    for k in range(3):  # seen three times: an object
        assert ids(tracker, dets([car(k)]), 0.1 * k) == [1]
    none = dets([])
    for k in (3, 4):  # detected only weakly, beside a weak box of nothing in particular
        weak = scored([car(k), [700, 700, 760, 760]], [0.18, 0.12])
        got = tracker.update(none, 0.1 * k, low=weak).detections
        assert got.track_ids is not None and got.track_ids.tolist() == [1]
        assert got.boxes.tolist() == [car(k)] and got.scores.tolist() == pytest.approx([0.18])
    confident = tracker.update(scored([car(5), [700, 100, 760, 160]], [0.9, 0.8]), 0.5)
    assert confident.detections.track_ids is not None
    assert confident.detections.track_ids.tolist() == [1, 2]  # one object all along; a new one
    # Car 2 was seen once: a weak box on it next frame is not taken (not an object yet), and
    # car 1's confident box comes first, its weak twin after it is dropped.
    frame = scored([car(6)], [0.95])
    weak = scored([[703, 103, 763, 163], car(6)], [0.2, 0.15])
    got = tracker.update(frame, 0.6, low=weak).detections
    assert got.track_ids is not None and got.track_ids.tolist() == [1]
    assert tracker.update(none, 0.7, low=scored([[0, 0, 50, 50]], [0.2])).detections.boxes.size == 0
    assert sorted(tracker.live_ids()) == [1, 2]  # no track from weak boxes alone


def test_a_tracked_stream_runs_the_engine_low_and_shows_weak_boxes_only_on_tracks() -> None:
    params = DetectParams(conf=0.5)
    assert StreamDetect(params).engine_params == params  # untracked: as asked
    assert StreamDetect(params, track=True).engine_params.conf == LOW_CONF
    low_already = DetectParams(conf=0.05)
    assert StreamDetect(low_already, track=True).engine_params == low_already
    analytics = StreamAnalytics()
    settings = StreamDetect(params, track=True)
    for k in range(3):
        done = analytics.process(scored([[100, 100, 200, 200]], [0.9]), settings, 0.1 * k, k)
    # The engine's weak boxes: on the tracked car (kept, with its id), elsewhere (dropped).
    frame = scored([[102, 100, 202, 200], [600, 600, 700, 700]], [0.3, 0.2])
    done = analytics.process(frame, settings, 0.3, 3)
    assert done.detections.track_ids is not None
    assert done.detections.track_ids.tolist() == [1] and len(done.detections) == 1
    counts = analytics.snapshot()
    assert counts["tracked"] == {"car": 1} and counts["detections"] == {"car": 4}


def av_rate(video: Path) -> float:
    """The clip's frame rate (the tracker works in seconds)."""
    import av

    with av.open(str(video)) as container:
        return float(container.streams.video[0].average_rate or 25)


# ---- the real model on a real clip ----------------------------------------------------------


@pytest.mark.parametrize(("clip", "step"), [("bottle", 3), ("car", 3), ("car", 6)])
def test_real_detections_keep_their_ids_from_frame_to_frame(
    ort_engine: Engine, clip: str, step: int
) -> None:
    """Every object that barely moved between two processed frames (its boxes overlap with
    IoU >= 0.5, each the other's best) keeps its id, on clips sampled at 2 to 10 fps."""
    video = next(v for v in VIDEOS if v.name.startswith(clip))
    frames = list(iter_video_frames(video, step=step, limit=48))
    results = infer_frames(ort_engine, frames, DetectParams())
    tracker = Tracker()
    fps = float(av_rate(video))
    tracked = [tracker.update(d, k * step / fps).detections for k, d in enumerate(results)]
    pairs = 0
    for before, after in itertools.pairwise(tracked):
        if not len(before) or not len(after):
            continue
        assert before.track_ids is not None and after.track_ids is not None
        iou = box_iou(before.boxes, after.boxes)
        for a in range(len(before)):
            b = int(iou[a].argmax())
            if iou[a, b] >= 0.5 and int(iou[:, b].argmax()) == a:
                pairs += 1
                assert before.track_ids[a] == after.track_ids[b], (a, b, iou)
    assert pairs >= 10  # the check saw objects to follow
    lengths = np.unique(
        np.concatenate([t.track_ids for t in tracked if t.track_ids is not None]),
        return_counts=True,
    )[1]
    assert lengths.max() >= 5  # some object followed over 5 processed frames or more


def test_track_bench_reports_per_frame_cost_and_keeps_every_track(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from benchmarks import track_bench

    monkeypatch.setattr("sys.argv", ["track_bench", "--objects", "5", "40", "--frames", "30"])
    track_bench.main()
    report = json.loads(capsys.readouterr().out)
    assert [r["objects"] for r in report] == [5, 40]
    for row in report:
        assert row["p99_ms"] >= row["p50_ms"] > 0
        # Constant-velocity objects: one track each, none lost and restarted.
        assert row["tracks"] == row["objects"]


# ---- counting lines ---------------------------------------------------------------------------

ACROSS = Line("across", (0.0, 0.5), (1.0, 0.5))  # drawn left to right: "in" is moving down


def test_a_line_is_crossed_in_or_out_only_between_its_ends() -> None:
    assert ACROSS.crossing((0.3, 0.4), (0.3, 0.6)) == "in"
    assert ACROSS.crossing((0.3, 0.6), (0.35, 0.4)) == "out"
    assert ACROSS.crossing((0.3, 0.4), (0.9, 0.45)) is None  # stayed above
    short = Line("short", (0.2, 0.5), (0.4, 0.5))
    assert short.crossing((0.3, 0.4), (0.3, 0.6)) == "in"
    assert short.crossing((0.6, 0.4), (0.6, 0.6)) is None  # passed beside its end
    # Reversing the line's points swaps the directions.
    backwards = Line("back", (1.0, 0.5), (0.0, 0.5))
    assert backwards.crossing((0.3, 0.4), (0.3, 0.6)) == "out"


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ([{"name": "", "points": [[0, 0], [1, 1]]}], "name"),
        ([{"name": "a", "points": [[0, 0]]}], "points"),
        ([{"name": "a", "points": [[0, 0], [1, 2]]}], "outside [0, 1]"),
        ([{"name": "a", "points": [[0.5, 0.5], [0.5, 0.5]]}], "same"),
        ([{"name": "a", "points": [[0, 0], [1, 1]]}] * 2, "same name 'a'"),
        ([{"name": f"l{i}", "points": [[0, 0], [1, 1]]} for i in range(17)], "at most 16"),
    ],
)
def test_bad_lines_are_refused_with_the_reason(raw: list[dict[str, Any]], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_lines(raw)


def test_lines_need_tracking() -> None:
    with pytest.raises(ValueError, match="track set to true"):
        StreamDetect(lines=(ACROSS,))
    assert StreamDetect(track=True, lines=(ACROSS,)).lines == (ACROSS,)


def test_each_object_counts_once_per_crossing() -> None:
    tracker, counter = Tracker(), LineCounter()
    crossings = []
    for k in range(8):  # one car driving down through the line at y = 500 of 1000
        y = 300 + 60 * k
        boxes = [[400, y - 100, 500, y]]
        classes = [2]
        if k == 4:  # a second class on the same car: not a second crossing
            boxes.append([401, y - 100, 501, y])
            classes.append(7)
        frame = tracker.update(dets(boxes, classes), 0.1 * k).detections
        crossings += counter.update(frame, [ACROSS], tracker.live_ids(), k)
    assert crossings == [Crossing("across", "in", 1, 2, 4)]  # from y = 480 to 540 in frame 4
    # Gone longer than a track lives, then back on the other side: a new object, and no
    # crossing made up from where the old one was last seen.
    frame = tracker.update(dets([[400, 100, 500, 200]]), 5.0).detections
    assert counter.update(frame, [ACROSS], tracker.live_ids(), 9) == []
    assert frame.track_ids is not None and frame.track_ids.tolist() == [2]


def test_a_track_crosses_only_once_it_is_an_object() -> None:
    """A flicker seen in two frames on either side of the line (a hand called two people,
    one box jumping) was counted as crossing; a track not yet seen in ``min_hits`` frames
    keeps the side it was first seen on, and an object that crossed in its first frames is
    counted once it is one."""
    tracker, counter = Tracker(), LineCounter()
    flicker = []
    for k, y in enumerate((480, 530)):  # seen twice, across the line at y = 500, then gone
        frame = tracker.update(dets([[400, y - 100, 500, y]]), 0.1 * k).detections
        flicker += counter.update(frame, [ACROSS], tracker.live_ids(), k, tracker.confirmed_ids())
    assert flicker == [] and tracker.confirmed_ids() == set()
    tracker, counter = Tracker(), LineCounter()
    early = []
    for k, y in enumerate((470, 530, 560, 590)):  # across in its second frame
        frame = tracker.update(dets([[400, y - 100, 500, y]]), 0.1 * k).detections
        early += counter.update(frame, [ACROSS], tracker.live_ids(), k, tracker.confirmed_ids())
    assert early == [Crossing("across", "in", 1, 2, 2)]  # once an object, at its 3rd frame
    assert MIN_HITS == 3


def test_real_cars_crossing_a_line_are_counted(ort_engine: Engine) -> None:
    """The car clip at a third of its 12.5 fps: cars drive up and down through the middle of
    the picture."""
    video = next(v for v in VIDEOS if v.name.startswith("car"))
    fps = float(av_rate(video))
    tracker, counter = Tracker(), LineCounter()
    crossings: list[Crossing] = []
    frames = list(iter_video_frames(video, step=3, limit=120))
    for k, found in enumerate(infer_frames(ort_engine, frames, DetectParams())):
        tracked = tracker.update(found, k * 3 / fps).detections
        crossings += counter.update(tracked, [ACROSS], tracker.live_ids(), k)
    assert {c.direction for c in crossings} == {"in", "out"}, crossings
    assert len({c.track_id for c in crossings}) == len(crossings)  # each car once


def test_settings_round_trip_and_older_descriptions_still_load() -> None:
    names = {0: "person", 2: "car"}
    full = StreamDetect(
        DetectParams(conf=0.4, classes=frozenset({2})),
        Roi(((0.0, 0.0), (1.0, 0.0), (1.0, 1.0))),
        track=True,
        lines=(ACROSS, Line("side", (0.5, 0.0), (0.5, 1.0))),
    )
    assert StreamDetect.from_description(full.describe(names), names) == full
    # Stored before tracking and lines existed: neither is on.
    older = {"conf": 0.4, "iou": 0.7, "classes": ["car"], "max_det": 300, "roi": None}
    loaded = StreamDetect.from_description(older, names)
    assert (loaded.track, loaded.lines) == (False, ())
    with pytest.raises(ValueError, match="track"):
        StreamDetect.from_description({**older, "track": "yes"}, names)


def test_a_streams_stationary_s_sets_when_a_still_object_is_stationary() -> None:
    """A doorway stream (3 s) calls the parked car stationary where the default (10 s) does
    not yet; the setting is checked and round-trips through the stored description."""
    doorway, default = StreamAnalytics(), StreamAnalytics()
    quick, plain = StreamDetect(track=True, stationary_s=3), StreamDetect(track=True)
    for i in range(11):  # 5 s at 2 fps
        frame = dets([[100, 100, 300, 200]])
        short = doorway.process(frame, quick, i * 0.5, i + 1)
        long = default.process(frame, plain, i * 0.5, i + 1)
    assert short.still is not None and long.still is not None
    assert short.still[0] == long.still[0] == pytest.approx(5.0)
    assert detections_json(short.detections, None, None, short.still, short.stationary_s)[0][
        "stationary"
    ]
    assert not detections_json(long.detections, None, None, long.still, long.stationary_s)[0][
        "stationary"
    ]
    assert doorway.snapshot()["stationary"] == {"car": 1} and default.snapshot()["stationary"] == {}
    names = {2: "car"}
    assert StreamDetect.from_description(quick.describe(names), names) == quick
    with pytest.raises(ValueError, match="stationary_s"):
        StreamDetect(track=True, stationary_s=0)


def test_an_object_standing_on_a_line_crosses_nothing() -> None:
    """A car queued at a stop line for 30 s, its box's bottom jittering 2 px either way of the
    line, crosses nothing (it was counted 73 times in and 74 out); once it drives on, once."""
    tracker, counter = Tracker(), LineCounter()
    rng = np.random.default_rng(3)
    crossings: list[Crossing] = []
    for k in range(150):  # 5 frames a second: comes down to the line at y = 500, stands there
        y = 400 + 20 * k if k < 5 else 500 + float(rng.uniform(-2, 2))
        frame = tracker.update(dets([[400, y - 100, 500, y]]), 0.2 * k).detections
        crossings += counter.update(frame, [ACROSS], tracker.live_ids(), k)
    assert crossings == []
    for k in range(150, 156):  # then drives on, down the picture
        y = 500 + 30 * (k - 149)
        frame = tracker.update(dets([[400, y - 100, 500, y]]), 0.2 * k).detections
        crossings += counter.update(frame, [ACROSS], tracker.live_ids(), k)
    assert [(c.direction, c.track_id) for c in crossings] == [("in", 1)]


def test_a_box_cut_off_by_the_frame_edge_is_in_a_zone_drawn_to_it() -> None:
    """A box reaching the frame's bottom or right edge stands on it (1.0): it is in a zone and
    a region of interest drawn to the edge (the even-odd rule put it outside both)."""
    from streams.geometry import anchors, polygon_contains
    from streams.zones import Zone

    whole = ((0.0, 0.0), (1.0, 0.0), (1.0, 1.0), (0.0, 1.0))
    cut = dets([[100, 700, 300, 1000], [900, 500, 1000, 800], [0, 0, 1000, 1000]])
    xs, ys = anchors(cut)
    assert polygon_contains(whole, xs, ys).tolist() == [True, True, True]
    porch = Zone("porch", ((0.0, 0.5), (1.0, 0.5), (1.0, 1.0), (0.0, 1.0)))
    roi = Roi(whole)
    assert len(roi.filter(cut)) == 3
    analytics = StreamAnalytics()
    done = analytics.process(cut, StreamDetect(zones=(porch,)), 0.0, 1)
    assert done.zones == [["porch"], ["porch"], ["porch"]]


def test_frames_further_apart_than_a_second_keep_their_tracks() -> None:
    """A stream at max_fps 0.5 (or a snapshot camera polled once a second, a job at fps 0.9):
    a track lives 3 of its frame intervals unseen, so a standing person keeps one id (every
    frame was a new object: 30 ids in 30 frames, nothing counted); a reconnect's long gap
    among them does not stretch it."""
    tracker = Tracker()
    seen = {i for k in range(30) for i in ids(tracker, dets([[400, 300, 500, 600]]), 2.0 * k)}
    assert seen == {1}
    assert MAX_AGE_S == 1.0  # at 10 frames a second it is still a second
    fast = Tracker()
    for k in range(20):
        ids(fast, dets([[400, 300, 500, 600]]), 0.1 * k)
    assert ids(fast, dets([[400, 300, 500, 600]]), 0.1 * 19 + 1.5) == [2]


def resized(d: Detections, width: int, height: int) -> Detections:
    """``d`` (a 1000x1000 frame) as a ``width`` x ``height`` frame shows it."""
    scale = np.array([width, height, width, height], np.float32) / 1000
    boxes = (d.boxes * scale).astype(np.float32)
    return dataclasses.replace(d, boxes=boxes, width=width, height=height)


def test_a_camera_changing_resolution_keeps_its_objects_and_counts() -> None:
    """An NVR switching a camera to its sub-stream mid-way (1000x1000 to 320x240): the same
    car in the same place keeps its id and crosses the line once, where compared in the old
    pixels it began again as a new object (and was counted again)."""
    tracker, counter = Tracker(), LineCounter()
    crossings, counted, seen = [], [], set()
    for k in range(8):  # down through the line at y = 0.5, 6% of the frame a frame
        y = 300 + 60 * k
        frame = dets([[400, y - 100, 500, y]])
        if k >= 3:
            frame = resized(frame, 320, 240)
        result = tracker.update(frame, 0.1 * k)
        assert result.detections.track_ids is not None
        seen.update(result.detections.track_ids.tolist())
        counted += result.new_objects
        crossings += counter.update(result.detections, [ACROSS], tracker.live_ids(), k)
    assert seen == {1}
    assert counted == [2]
    assert crossings == [Crossing("across", "in", 1, 2, 4)]
