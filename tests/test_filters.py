"""Per-class object filters (``filters``): each class's own confidence, sizes and shapes, on
synthetic boxes and on the real model's detections of the real clips, through a video job and
a live stream."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from engines.types import DetectParams
from streams.analytics import StreamAnalytics
from streams.detect import LOW_CONF, StreamDetect
from streams.filters import ObjectFilters
from tests.helpers import BOTTLE_CLIP, SYNTHETIC_NAMES, file_stream_app, synthetic_detections


def test_filters_keep_each_classes_sizes_shapes_and_confidence() -> None:
    # Scores 0.9, 0.8, 0.7, 0.6, 0.5 (synthetic_detections), in a 1000x1000 frame.
    boxes = [
        [0, 0, 100, 100],  # car, 1% of the frame, square
        [0, 0, 300, 100],  # car, 3%, ratio 3
        [0, 0, 20, 20],  # car, 0.04%: a speck
        [0, 0, 40, 100],  # person, 0.4%, ratio 0.4
        [0, 0, 100, 40],  # person lying down?, ratio 2.5
    ]
    detections = synthetic_detections(boxes, [2, 2, 2, 0, 0])
    filters = ObjectFilters.parse(
        {
            "car": {"min_area": 0.005, "max_ratio": 2.0},
            "0": {"max_ratio": 1.0, "min_conf": 0.55},
        },
        SYNTHETIC_NAMES,
    )
    kept, need = filters.apply(detections, conf=0.25)
    assert kept.boxes.tolist() == [[0, 0, 100, 100], [0, 0, 40, 100]]
    assert need.tolist() == pytest.approx([0.25, 0.55])
    assert filters.to_json(SYNTHETIC_NAMES) == {
        "person": {"max_ratio": 1.0, "min_conf": 0.55},
        "car": {"min_area": 0.005, "max_ratio": 2.0},
    }
    # Through a stream's analytics: a class's min_conf below the stream's conf takes it lower.
    detect = StreamDetect(
        DetectParams(conf=0.75),
        filters=ObjectFilters.parse({"person": {"min_conf": 0.55}}, SYNTHETIC_NAMES),
    )
    assert detect.engine_params.conf == 0.55  # what the engine must run at
    out = StreamAnalytics().process(detections, detect, 0.0, 1).detections
    assert out.scores.tolist() == pytest.approx([0.9, 0.8, 0.6])  # two cars and a person
    tracked = StreamDetect(DetectParams(conf=0.75), track=True, filters=detect.filters)
    assert tracked.engine_params.conf == LOW_CONF
    for raw, words in (
        ({"unicorn": {}}, "unicorn"),
        ({"car": {"min_area": 0.5, "max_area": 0.1}}, "min_area 0.5 is over max_area 0.1"),
        ({"car": {"min_area": 2}}, "min_area: from 0 to 1"),
        ({"car": {"max_ratio": 0}}, "max_ratio: a width over a height above 0"),
        ({"car": {"size": 1}}, "unknown size"),
        # by id and by name: the one given last was kept, unsaid (key order decided)
        ({"2": {"min_conf": 0.5}, "Car": {"min_conf": 0.3}}, "'2' and 'Car' are the same class"),
    ):
        with pytest.raises(ValueError, match=words):
            ObjectFilters.parse(raw, SYNTHETIC_NAMES)


def _job_detections(c: TestClient, settings: dict[str, Any]) -> list[list[dict[str, Any]]]:
    created = c.post("/jobs", json={"url": f"file://{BOTTLE_CLIP}", "fps": 0.25, **settings})
    assert created.status_code == 202, created.text
    job = c.get(f"/jobs/{created.json()['id']}", params={"wait_s": 60}).json()
    assert job["state"] == "done", job
    lines = c.get(f"/jobs/{job['id']}/frames").text.splitlines()
    return [json.loads(line)["detections"] for line in lines]


def _area(d: dict[str, Any]) -> float:
    x1, y1, x2, y2 = d["box"]
    return float((x2 - x1) * (y2 - y1)) / (640 * 360)


def test_filters_drop_exactly_what_they_say_from_the_models_detections(tmp_path: Path) -> None:
    with TestClient(file_stream_app(tmp_path)) as c:
        everything = _job_detections(c, {"conf": 0.1})
        bottles = sorted(
            _area(d) for frame in everything for d in frame if d["class_name"] == "bottle"
        )
        assert len(bottles) >= 20
        # The three bottles stand still, each its own size: cut in the widest gap between
        # their areas, well clear of the boxes' rounding (0.01 px) in the API.
        gap, at = max((b - a, i) for i, (a, b) in enumerate(itertools.pairwise(bottles)))
        assert gap > 1e-3
        cut = (bottles[at] + bottles[at + 1]) / 2
        filters = {"bottle": {"min_area": cut, "min_conf": 0.1}}
        filtered = _job_detections(c, {"conf": 0.5, "filters": filters})
        expected = [
            [
                d
                for d in frame
                if (d["class_name"] == "bottle" and _area(d) >= cut)
                or (d["class_name"] != "bottle" and d["confidence"] >= 0.5)
            ]
            for frame in everything
        ]
        assert filtered == expected
        assert sum(len(frame) for frame in filtered) < sum(len(frame) for frame in everything)

        # A stream takes them as a job does; PATCH changes them; bad ones are 422s.
        stream = c.post(
            "/streams", json={"url": f"file://{BOTTLE_CLIP}", "max_fps": 1, "filters": filters}
        )
        assert stream.status_code == 201, stream.text
        sid = stream.json()["id"]
        assert c.get(f"/streams/{sid}").json()["detect"]["filters"] == {
            "bottle": {"min_conf": 0.1, "min_area": cut}
        }
        for bad, words in (
            ({"unicorn": {"min_conf": 0.5}}, "unicorn"),
            ({"bottle": {"min_area": 0.5, "max_area": 0.1}}, "over max_area"),
            ({"bottle": {"min_area": 7}}, "min_area"),
            ({"bottle": {"colour": "red"}}, "colour"),
        ):
            refused = c.patch(f"/streams/{sid}", json={"filters": bad})
            assert refused.status_code == 422 and words in refused.text, refused.text
        assert c.patch(f"/streams/{sid}", json={"filters": {}}).status_code == 200
        assert c.get(f"/streams/{sid}").json()["detect"]["filters"] == {}
        assert "filters" in c.get("/streams", params={"format": "yaml"}).text
