"""POST /detect, health and readiness, in-process with the real model."""

from __future__ import annotations

import errno
import io
import json
import re
import shutil
import sqlite3
import time
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image as PILImage

from engines.types import Detections
from server.app import create_app
from server.routes.detect import megabytes
from server.settings import Settings
from tests.helpers import (
    CACHE_DIR,
    MODEL_PT,
    VIDEOS,
    decode_jpeg,
    detect_json,
    file_stream_app,
    match_reference,
    ultralytics_assets,
    wait_until,
)


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    # Admission's latency target is off here (tests/test_admission.py covers it): these
    # tests check answers, and a loaded CI host must not turn them into 429s.
    settings = Settings(
        model=str(MODEL_PT),
        cache_dir=CACHE_DIR,
        max_upload_mb=2.0,
        max_image_pixels=30_000_000,
        admission_deadline_ms=0,
    )
    with TestClient(create_app(settings)) as c:
        yield c


def bus_bytes() -> bytes:
    return (ultralytics_assets() / "bus.jpg").read_bytes()


def encode(image: PILImage.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def test_health_and_ready(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    assert client.get("/model").json()["names"]["0"] == "person"


def test_detect_multipart_matches_contract(client: TestClient) -> None:
    resp = client.post("/detect", files={"image": ("bus.jpg", bus_bytes(), "image/jpeg")})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert set(body) == {"detections", "image", "model", "timing_ms"}
    assert body["model"] == "yolov8n.pt"  # the file the user named, not the cached export
    assert body["image"] == {"width": 810, "height": 1080}
    assert set(body["timing_ms"]) == {"queue", "inference", "total"}
    names = sorted(d["class_name"] for d in body["detections"])
    assert names == ["bus", "person", "person", "person", "person"]
    first = body["detections"][0]
    assert set(first) == {"box", "confidence", "class_id", "class_name"}
    assert first["class_name"] == "person" and first["confidence"] == pytest.approx(0.895, abs=0.02)
    x1, y1, x2, y2 = first["box"]
    assert 0 <= x1 < x2 <= 810 and 0 <= y1 < y2 <= 1080


def test_detect_answers_the_picture_with_its_boxes_drawn(client: TestClient) -> None:
    """``format=jpeg``: the image as sent, at its own size, its boxes drawn on it."""
    files = {"image": ("bus.jpg", bus_bytes(), "image/jpeg")}
    boxes = client.post("/detect", files=files).json()["detections"]
    resp = client.post("/detect?format=jpeg&classes=bus", files=files)
    assert resp.status_code == 200 and resp.headers["content-type"] == "image/jpeg"
    assert resp.headers["x-detections"] == "1" and float(resp.headers["x-inference-ms"]) > 0
    drawn = decode_jpeg(resp.content).astype(np.int16)
    original = decode_jpeg(bus_bytes()).astype(np.int16)
    assert drawn.shape == original.shape == (1080, 810, 3)
    [bus] = [d for d in boxes if d["class_name"] == "bus"]
    x1, y1, _, y2 = (round(v) for v in bus["box"])
    left_side = np.abs(drawn[y1 + 40 : y2 - 40, x1 + 1] - original[y1 + 40 : y2 - 40, x1 + 1])
    assert left_side.mean() > 40, left_side.mean()  # the bus's box, in its class's colour
    untouched = np.abs(drawn[y1 + 40 : y2 - 40, x1 + 30] - original[y1 + 40 : y2 - 40, x1 + 30])
    assert untouched.mean() < 8, untouched.mean()  # inside it: the picture, re-encoded
    wrong = client.post("/detect?format=png", files=files)
    assert wrong.status_code == 422 and "format" in wrong.text


def test_a_large_jpeg_is_answered_in_its_own_pixels_with_the_boxes_of_its_picture(
    client: TestClient,
) -> None:
    """The bus photo at twice its size (1620x2160): decoded at half that by libjpeg for the
    engine, it gives the boxes of the photo itself, doubled, in the large image's pixels; drawn
    (``format=jpeg``), it is answered at its own size."""
    files = {"image": ("bus.jpg", bus_bytes(), "image/jpeg")}
    small = client.post("/detect", files=files).json()["detections"]
    with PILImage.open(io.BytesIO(bus_bytes())) as bus:
        large = encode(bus.resize((1620, 2160), PILImage.Resampling.BICUBIC), "JPEG")
    files = {"image": ("bus-large.jpg", large, "image/jpeg")}
    body = client.post("/detect", files=files).json()
    assert body["image"] == {"width": 1620, "height": 2160}
    got = Detections(
        boxes=np.array([d["box"] for d in body["detections"]], np.float32).reshape(-1, 4),
        scores=np.array([d["confidence"] for d in body["detections"]], np.float32),
        class_ids=np.array([d["class_id"] for d in body["detections"]], np.int32),
        names={},
        width=1620,
        height=2160,
    )
    problems = match_reference(
        got,
        np.array([d["box"] for d in small], np.float32) * 2,
        np.array([d["confidence"] for d in small], np.float32),
        np.array([d["class_id"] for d in small], np.int32),
        conf_tol=0.05,
        edge_conf=0.35,
    )
    assert problems == [], problems
    drawn = client.post("/detect?format=jpeg", files=files)
    assert decode_jpeg(drawn.content).shape == (2160, 1620, 3)


def test_a_picture_wider_than_jpeg_holds_is_drawn_scaled_to_fit(client: TestClient) -> None:
    """JPEG holds at most 65,500 pixels a side: a 65,501-wide strip drawn for
    ``format=jpeg`` failed to encode after its inference, a 500 in plain text."""
    for size in ((65_501, 2), (3, 65_501)):
        strip = encode(PILImage.new("RGB", size, (90, 90, 90)), "PNG")
        drawn = client.post(
            "/detect?format=jpeg", content=strip, headers={"content-type": "image/png"}
        )
        assert drawn.status_code == 200, drawn.text
        assert max(decode_jpeg(drawn.content).shape[:2]) == 65_500


def test_a_fault_of_the_servers_own_is_answered_as_json_naming_the_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bug's 500 was Starlette's plain text "Internal Server Error"; it is ``{"detail"}``
    (``{"error"}`` under ``/v2``) as the README promises every error, with the request id
    its traceback is logged under."""
    import server.routes.detect as detect_route

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(detect_route, "render_jpeg", broken)
    settings = Settings(model=str(MODEL_PT), cache_dir=CACHE_DIR, admission_deadline_ms=0)
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        files = {"image": ("bus.jpg", bus_bytes(), "image/jpeg")}
        resp = c.post("/detect?format=jpeg", files=files, headers={"x-request-id": "bug-1"})
        assert resp.status_code == 500 and resp.headers["x-request-id"] == "bug-1"
        assert resp.json() == {
            "detail": "internal error (ZeroDivisionError); the server's log has it as request bug-1"
        }


def test_detect_raw_body_png_and_webp(client: TestClient) -> None:
    image = PILImage.open(io.BytesIO(bus_bytes()))
    for fmt, ctype in [("PNG", "image/png"), ("WEBP", "image/webp")]:
        resp = client.post("/detect", content=encode(image, fmt), headers={"content-type": ctype})
        assert resp.status_code == 200, resp.text
        assert any(d["class_name"] == "bus" for d in resp.json()["detections"])


def test_query_parameters_filter(client: TestClient) -> None:
    files = {"image": ("bus.jpg", bus_bytes(), "image/jpeg")}
    only_bus = client.post("/detect?classes=bus", files=files).json()["detections"]
    assert [d["class_name"] for d in only_bus] == ["bus"]
    by_id = client.post("/detect?classes=5,0", files=files).json()["detections"]
    assert {d["class_id"] for d in by_id} == {0, 5}
    top1 = client.post("/detect?max_det=1", files=files).json()["detections"]
    assert len(top1) == 1
    high = client.post("/detect?conf=0.88&iou=0.5", files=files).json()["detections"]
    assert high and all(d["confidence"] > 0.88 for d in high)
    # Repeated, as requests and httpx send a list: every class named (the last alone was).
    listed = client.post("/detect", params={"classes": ["person", 5]}, files=files).json()
    assert {d["class_name"] for d in listed["detections"]} == {"bus", "person"}
    # A blank list is every class, as no list is (",": it dropped every detection).
    every = client.post("/detect?classes=,", files=files).json()["detections"]
    assert {d["class_name"] for d in every} == {"bus", "person"}


@pytest.mark.parametrize(
    ("query", "needle"),
    [
        ("conf=1.5", "conf"),
        ("conf=abc", "conf"),
        ("conf=nan", "conf"),
        ("iou=inf", "iou"),
        ("iou=-0.1", "iou"),
        ("max_det=0", "max_det"),
        ("max_det=many", "max_det"),
        ("classes=unicorn", "unicorn"),
        ("classes=999", "999"),
    ],
)
def test_bad_parameters_are_422_naming_the_field(
    client: TestClient, query: str, needle: str
) -> None:
    resp = client.post(f"/detect?{query}", files={"image": ("b.jpg", bus_bytes(), "image/jpeg")})
    assert resp.status_code == 422
    assert needle in resp.text


def test_bad_images(client: TestClient) -> None:
    data = bus_bytes()
    cases = [
        (b"", "image/jpeg", 400, "empty"),
        (data[: len(data) // 3], "image/jpeg", 400, "truncated"),
        (np.random.default_rng(1).bytes(5000), "image/jpeg", 400, "not a decodable image"),
        (encode(PILImage.new("RGB", (8, 8)), "GIF"), "image/gif", 415, "GIF"),
        (b"hello", "text/plain", 415, "text/plain"),
    ]
    for body, ctype, status, needle in cases:
        resp = client.post("/detect", content=body, headers={"content-type": ctype})
        assert resp.status_code == status, (needle, resp.text)
        assert needle in resp.json()["detail"]


def test_wrong_multipart_field_is_422(client: TestClient) -> None:
    resp = client.post("/detect", files={"file": ("bus.jpg", bus_bytes(), "image/jpeg")})
    assert resp.status_code == 422
    assert "'image'" in resp.json()["detail"] and "file" in resp.json()["detail"]
    resp = client.post("/detect", files={"image": (None, "not a file")})
    assert resp.status_code == 422
    assert "send it as a file part" in resp.json()["detail"]
    two = [("image", ("a.jpg", bus_bytes(), "image/jpeg")), ("image", ("b.jpg", b"x", "x/y"))]
    resp = client.post("/detect", files=two)  # the last one was answered for, the first lost
    assert resp.status_code == 422
    assert "2 fields 'image'" in resp.json()["detail"]
    resp = client.post("/detect", data={"image": "not a file"})  # url-encoded form
    assert resp.status_code == 415
    assert "multipart/form-data" in resp.json()["detail"]


def test_an_option_detect_does_not_take_or_one_given_twice_is_422(client: TestClient) -> None:
    """``cof=0.9``, Roboflow's ``confidence=90``, ``imgsz=320`` and options sent as form
    fields (Ultralytics HUB's way) were dropped without a word, and of ``conf=0.9&conf=0.1``
    the last won: the call ran on other options than the client asked for."""
    files = {"image": ("bus.jpg", bus_bytes(), "image/jpeg")}
    for query, words in (
        ("cof=0.9", "query: 'cof': not an option here; the options are conf, iou, classes"),
        ("confidence=90&overlap=30", "query: 'confidence', 'overlap': not an option"),
        ("imgsz=320", "'imgsz': not an option"),
        ("conf=0.9&conf=0.1", "query: 'conf' given more than once"),
    ):
        refused = client.post(f"/detect?{query}", files=files)
        assert refused.status_code == 422 and words in refused.json()["detail"], refused.text
    fields = client.post("/detect", files=files, data={"conf": "0.9", "classes": "bus"})
    assert fields.status_code == 422
    assert "multipart field 'classes': send only the file field 'image'" in fields.text
    # classes may be repeated (a list), and an API key may come in the query
    found = client.post("/detect?classes=bus&classes=person&access_token=x", files=files)
    assert found.status_code == 200 and found.json()["detections"]


def test_upload_over_limit_is_413(client: TestClient) -> None:
    big = b"\xff" * (3 * 1024 * 1024)
    resp = client.post("/detect", content=big, headers={"content-type": "image/jpeg"})
    assert resp.status_code == 413
    assert "STREAMDET_MAX_UPLOAD_MB" in resp.json()["detail"]
    assert "larger than 2 MB" in resp.json()["detail"]  # as set (it said 2.1: MiB over 1e6)
    # Fractions as set: jobs said 4 MB for 3.5, /detect 0.0999994 MB for 0.1.
    for mb in (0.1, 3.5, 20.0, 2048.0):
        assert megabytes(Settings(max_upload_mb=mb).max_upload_bytes) == f"{mb:g}"


def test_decompression_bomb_is_refused_from_its_header(client: TestClient) -> None:
    # A tiny PNG whose header claims 60000 x 60000 pixels (3.6 GP).
    bomb = encode(PILImage.new("1", (60_000, 60_000)), "PNG")
    assert len(bomb) < 1_000_000
    resp = client.post("/detect", content=bomb, headers={"content-type": "image/png"})
    assert resp.status_code == 413
    assert "STREAMDET_MAX_IMAGE_PIXELS" in resp.json()["detail"]


def test_grey_and_rgba_images_work(client: TestClient) -> None:
    image = PILImage.open(io.BytesIO(bus_bytes()))
    for mode in ("L", "RGBA"):
        resp = client.post(
            "/detect",
            content=encode(image.convert(mode), "PNG"),
            headers={"content-type": "image/png"},
        )
        assert resp.status_code == 200, resp.text
        assert resp.json()["detections"]


def test_server_still_serves_after_bad_input(client: TestClient) -> None:
    client.post("/detect", content=b"garbage", headers={"content-type": "image/jpeg"})
    resp = client.post("/detect", files={"image": ("bus.jpg", bus_bytes(), "image/jpeg")})
    assert resp.status_code == 200


def test_full_queue_answers_429_with_retry_after() -> None:
    from concurrent.futures import ThreadPoolExecutor

    settings = Settings(
        model=str(MODEL_PT), cache_dir=CACHE_DIR, max_queue=1, max_batch=1, max_wait_ms=0
    )
    with TestClient(create_app(settings)) as c:
        data = bus_bytes()

        def post(_: int) -> tuple[int, str | None]:
            r = c.post("/detect", files={"image": ("b.jpg", data, "image/jpeg")})
            return r.status_code, r.headers.get("retry-after")

        with ThreadPoolExecutor(12) as ex:
            results = list(ex.map(post, range(24)))
    statuses = {s for s, _ in results}
    assert statuses <= {200, 429}
    assert 200 in statuses and 429 in statuses
    assert all(ra is not None and int(ra) >= 1 for s, ra in results if s == 429)


def test_stream_detection_parameters_are_validated_and_patched(tmp_path: Path) -> None:
    url = f"file://{VIDEOS[0]}"
    with TestClient(file_stream_app(tmp_path)) as c:
        for bad, expected in (
            ({"classes": ["bottle", "unicorn"]}, "unknown class name 'unicorn'"),
            ({"classes": "0,99"}, "unknown class id 99"),
            ({"classes": "\u00b2"}, "classes: unknown class name '\u00b2'"),  # not an int()
            ({"classes": "--5"}, "classes: unknown class name '--5'"),
            # A list of none kept nothing (a "," or "" is every class, null too).
            ({"classes": []}, "classes: give at least one class, or null for every"),
            ({"classes": [" "]}, "classes: give at least one class, or null for every"),
            ({"classes": [True]}, "classes"),  # a class id, not a boolean (it was 1: bicycle)
            ({"conf": 1.5}, "conf"),
            # Numbers, not booleans nor text: true was 1 (every frame moved), "0.1" 0.1.
            ({"conf": True}, '"conf"],"msg":"Input should be a valid number'),
            ({"max_fps": "5"}, '"max_fps"],"msg":"Input should be a valid number'),
            ({"motion_threshold": True}, '"motion_threshold"],"msg":"Input should be a valid int'),
            ({"motion_min_area": "0.1"}, '"motion_min_area"],"msg":"Input should be a valid num'),
            ({"max_det": 5.0}, '"max_det"],"msg":"Input should be a valid integer'),
            ({"max_det": 0}, "max_det"),
            ({"clases": ["bottle"]}, "clases"),  # misspelt: refused, not ignored
            ({"roi": [[0, 0], [1, 1]]}, "roi: 2 points"),
            ({"roi": [[0, 0], [1, 0], [1.2, 1]]}, "outside [0, 1]"),
            ({"roi": [[0, 0], [1, 0], [1]]}, "roi"),
            # Numbers, not booleans: true was 1 ("its two points are the same"; min_conf 1.0).
            ({"track": True, "lines": [{"name": "g", "points": [[True, 0.5], [1, 0.5]]}]}, "lines"),
            ({"filters": {"bottle": {"min_conf": True}}}, "min_conf"),
            ({"lines": [{"name": "gate", "points": [[0, 0.5], [1, 0.5]]}]}, "track set to true"),
            ({"track": True, "lines": [{"name": "gate", "points": [[0, 0.5]]}]}, "points"),
            ({"track": True, "lines": [{"name": "g", "points": [[0, 0], [1, 1]], "x": 1}]}, "x"),
            # Shapes that could never hold anything, and settings that could never work.
            ({"roi": [[0.1, 0.1], [0.5, 0.5], [0.9, 0.9]]}, "roi: its points enclose no area"),
            (
                {"zones": [{"name": "z", "points": [[0.5, 0.5], [0.5, 0.5], [0.5, 0.5]]}]},
                "zones: 'z': its points enclose no area",
            ),
            (
                {"zones": [{"name": "z", "points": [[0, 0], [1, 0], [1, 1]], "loiter_s": 5}]},
                "zones: 'z': loiter_s needs track set to true",
            ),
            (
                {
                    "classes": "person",
                    "track": True,
                    "lines": [{"name": "g", "points": [[0, 0.5], [1, 0.5]], "classes": ["car"]}],
                },
                "lines: 'g': counts car, which the stream's classes (person) leave out",
            ),
            (
                {
                    "zones": [
                        {"name": "z1", "points": [[0, 0], [1, 0], [1, 1]]},
                        {"name": "z2", "points": [[0, 0], [1, 0], [1, 1]], "classes": ["carr"]},
                    ]
                },
                "zones: 'z2': classes: unknown class name 'carr'",
            ),
        ):
            resp = c.post("/streams", json={"url": url, **bad})
            assert resp.status_code == 422, resp.text
            assert expected in resp.text, resp.text
        # JSON has no NaN or Infinity, yet Python's parser takes them: refused, and the refusal
        # (which echoes the value) is written back as "nan" instead of failing with a 500.
        for field, value in (("conf", "NaN"), ("max_fps", "Infinity"), ("motion_threshold", "NaN")):
            body = f'{{"url": "{url}", "motion": true, "{field}": {value}}}'
            resp = c.post("/streams", content=body, headers={"content-type": "application/json"})
            assert resp.status_code == 422, resp.text
            (error,) = resp.json()["detail"]
            assert error["loc"] == ["body", field]
            assert error["input"] == str(float(value))
        # A lone surrogate (no UTF-8 holds it) echoed back was a 500 too: escaped.
        body = '{"url": "http://cam/x", "colour": "\\ud800"}'
        resp = c.post("/webhooks", content=body, headers={"content-type": "application/json"})
        assert resp.status_code == 422, resp.text
        assert "\\ud800" in resp.text
        assert c.get("/streams").json()["streams"] == []  # nothing was added by a bad call

        resp = c.post("/streams", json={"url": url, "classes": "Bottle, 0", "conf": 0.5})
        assert resp.status_code == 201, resp.text
        sid = resp.json()["id"]
        detect = detect_json(conf=0.5, classes=["person", "bottle"])
        assert resp.json()["detect"] == detect

        resp = c.patch(f"/streams/{sid}", json={"max_det": 5})  # only what is given changes
        assert resp.status_code == 200, resp.text
        assert resp.json()["detect"] == {**detect, "max_det": 5}
        resp = c.patch(f"/streams/{sid}", json={"stationary_s": 30})  # a car park's wait
        assert resp.json()["detect"] == {**detect, "max_det": 5, "stationary_s": 30}
        resp = c.patch(f"/streams/{sid}", json={"stationary_s": 0})
        assert resp.status_code == 422 and "stationary_s" in resp.text
        resp = c.patch(f"/streams/{sid}", json={"stationary_s": None})
        assert resp.json()["detect"] == {**detect, "max_det": 5}
        resp = c.patch(f"/streams/{sid}", json={"classes": None})
        assert resp.json()["detect"] == {**detect, "max_det": 5, "classes": None}
        assert c.get(f"/streams/{sid}").json()["detect"]["classes"] is None
        triangle = [[0.0, 1.0], [0.5, 0.0], [1.0, 1.0]]
        resp = c.patch(f"/streams/{sid}", json={"roi": triangle})
        assert resp.status_code == 200 and resp.json()["detect"]["roi"] == triangle
        assert resp.json()["detect"]["max_det"] == 5  # the rest stays
        assert c.patch(f"/streams/{sid}", json={"roi": None}).json()["detect"]["roi"] is None
        resp = c.patch(f"/streams/{sid}", json={"track": True})
        assert resp.json()["detect"] == {**detect, "max_det": 5, "classes": None, "track": True}
        resp = c.patch(f"/streams/{sid}", json={"name": "shelf", "max_fps": 3})
        assert (resp.json()["name"], resp.json()["max_fps"]) == ("shelf", 3.0)
        assert resp.json()["detect"]["max_det"] == 5
        assert c.patch(f"/streams/{sid}", json={"max_fps": None}).json()["max_fps"] is None
        for bad, expected in (
            ({"url": "rtsp://127.0.0.1/x"}, "url"),  # the source cannot change: delete and add
            ({"classes": ["unicorn"]}, "unicorn"),
            ({"iou": -0.1}, "iou"),
            ({"max_fps": 0}, "max_fps"),
            ({"name": "x" * 201}, "name"),
            ({"track": "sometimes"}, "track"),
            # A JSON boolean, not a word: "yes" and 1 were taken as true.
            ({"enabled": "yes"}, '"enabled"],"msg":"Input should be a valid boolean'),
            ({"motion": 1}, '"motion"],"msg":"Input should be a valid boolean'),
        ):
            resp = c.patch(f"/streams/{sid}", json=bad)
            assert resp.status_code == 422, resp.text
            assert expected in resp.text, resp.text
        resp = c.patch("/streams/nope", json={"conf": 0.3})
        assert resp.status_code == 404 and "nope" in resp.text
        assert c.delete(f"/streams/{sid}").status_code == 204


def test_misspelt_options_and_form_bodies_are_refused_naming_them(tmp_path: Path) -> None:
    """``GET /clips?stream=door`` listed every stream's clips, ``latest.jpg?maxwidth=100``
    answered the full picture, ``GET /streams?bogus=1`` a 200 (``/events`` and ``/detect``
    refused such typos); a body sent as a form (curl's ``-d``) was a 422 whose message named
    no type: it is a 415 naming it."""
    url = f"file://{VIDEOS[0]}"
    with TestClient(file_stream_app(tmp_path)) as c:
        sid = c.post("/streams", json={"url": url, "loop": True}).json()["id"]
        for path, named in (
            ("/clips?stream=door", "'stream': not an option here"),
            (f"/streams/{sid}/latest.jpg?maxwidth=100", "'maxwidth': not an option here"),
            ("/streams?bogus=1", "'bogus'"),
            (f"/streams/{sid}?fields=id", "'fields'"),
            ("/webhooks?limit=1", "'limit'"),
        ):
            got = c.get(path)
            assert got.status_code == 422 and named in got.text, (path, got.text)
        assert c.get("/streams", params={"access_token": "x", "_": "1"}).status_code == 200
        form = {"content-type": "application/x-www-form-urlencoded"}
        for method, path in (
            ("POST", "/streams"),
            ("PATCH", f"/streams/{sid}"),
            ("PUT", f"/streams/{sid}"),
            ("POST", f"/streams/{sid}/events"),
            ("POST", "/webhooks"),
        ):
            got = c.request(method, path, content=b'{"url": "x"}', headers=form)
            assert got.status_code == 415, (method, path, got.text)
            assert "'application/x-www-form-urlencoded': send the body as JSON" in got.text
        typed = {"content-type": "application/merge-patch+json"}  # JSON by another name
        patched = c.patch(f"/streams/{sid}", content=b'{"name": "door"}', headers=typed)
        assert patched.status_code == 200 and patched.json()["name"] == "door", patched.text
        untyped = c.patch(f"/streams/{sid}", content=b'{"name": "gate"}')
        assert untyped.status_code == 415 and "no Content-Type: send" in untyped.text


def test_a_max_fps_written_into_the_database_by_hand_fails_its_stream_until_patched(
    tmp_path: Path,
) -> None:
    """A stored ``max_fps`` no API call could give (text written into streams.sqlite3 by
    hand) failed the stream's decode thread at each try: the stream went on "reconnecting"
    with a TypeError. It is failed, naming max_fps, and a PATCH with a rate starts it."""
    url = f"file://{VIDEOS[0]}"
    with TestClient(file_stream_app(tmp_path)) as c:
        sid = c.post("/streams", json={"url": url, "loop": True, "max_fps": 5}).json()["id"]
    with closing(sqlite3.connect(tmp_path / "data" / "streams.sqlite3")) as db, db:
        db.execute("UPDATE streams SET max_fps = 'fast' WHERE id = ?", (sid,))
    with TestClient(file_stream_app(tmp_path)) as c:
        shown = c.get(f"/streams/{sid}").json()
        assert shown["state"] == "failed", shown
        assert "max_fps 'fast' stored for it is no frame rate" in shown["last_error"], shown
        resp = c.patch(f"/streams/{sid}", json={"max_fps": 4})
        assert resp.status_code == 200 and resp.json()["max_fps"] == 4.0, resp.text
        assert resp.json()["state"] != "failed", resp.text
        wait_until(lambda: c.get(f"/streams/{sid}").json()["state"] == "live", "stream live")


def test_cars_crossing_a_line_are_counted_by_the_api_and_metrics(tmp_path: Path) -> None:
    """A tracked file stream of the car clip with a line across the middle of the picture:
    its WebSocket says when each car drives through, GET /streams/{id} and /metrics count
    them by direction."""
    car = next(v for v in VIDEOS if v.name.startswith("car"))
    gate = {"name": "gate", "points": [[0.0, 0.5], [1.0, 0.5]]}
    with TestClient(file_stream_app(tmp_path)) as c:
        resp = c.post("/streams", json={"url": f"file://{car}", "max_fps": 8, "lines": [gate]})
        assert resp.status_code == 422 and "track set to true" in resp.text
        resp = c.post(
            "/streams", json={"url": f"file://{car}", "max_fps": 8, "track": True, "lines": [gate]}
        )
        assert resp.status_code == 201, resp.text
        sid = resp.json()["id"]
        assert resp.json()["detect"]["lines"] == [{**gate, "classes": None}]
        # Lines cannot outlive tracking: switching it off alone is refused, both together not.
        assert c.patch(f"/streams/{sid}", json={"track": False}).status_code == 422
        # Each crossing comes as an event on the stream's WebSocket, in the frame it happened.
        events: list[dict[str, object]] = []
        with c.websocket_connect(f"/ws/streams/{sid}") as ws:
            for _ in range(800):  # the clip, looping at 8 fps: cars cross within ~9 s of it
                message = ws.receive_json()
                for event in message.get("events", []):
                    if event["frame"] == message["frame"]:  # not one carried from a lost frame
                        track_ids = {d["track_id"] for d in message["detections"]}
                        assert event["track_id"] in track_ids  # an object of that very frame
                    events.append(event)
                if {e["direction"] for e in events} == {"in", "out"}:
                    break
        assert {e["direction"] for e in events} == {"in", "out"}, events
        assert {e["line"] for e in events} == {"gate"}
        assert {e["type"] for e in events} == {"line_crossing"}
        # The event log has each of them, with the stream's id, in order.
        params = {"stream_id": sid, "type": "line_crossing", "limit": 1000}
        logged = c.get("/events", params=params).json()
        assert logged["missed"] == 0
        ids = [e["id"] for e in logged["events"]]
        assert ids == sorted(ids) and logged["next"] >= ids[-1]
        key = ("frame", "track_id", "direction", "class_name")
        assert {tuple(e[k] for k in key) for e in events} <= {
            tuple(e[k] for k in key) for e in logged["events"]
        }
        assert {e["stream_id"] for e in logged["events"]} == {sid}
        crossings = c.get(f"/streams/{sid}").json()["crossings"]
        assert set(crossings) == {"gate"}, crossings
        for direction in ("in", "out"):  # the counts hold at least the events seen
            seen = sum(1 for e in events if e["direction"] == direction)
            assert sum(crossings["gate"][direction].values()) >= seen, (crossings, events)
        metrics = c.get("/metrics").text
        for direction, by_class in crossings["gate"].items():
            for name, n in by_class.items():
                line = (
                    f'streamdet_stream_line_crossings_total{{class="{name}",'
                    f'direction="{direction}",line="gate",stream="{sid}"}}'
                )
                assert any(
                    m.startswith(line) and float(m.split()[-1]) >= n for m in metrics.splitlines()
                ), line
        resp = c.patch(f"/streams/{sid}", json={"track": False, "lines": []})
        assert resp.status_code == 200, resp.text
        assert resp.json()["detect"]["lines"] == []
        # From the next frame on, the removed line's counts are gone (and its metric series).
        deadline = time.monotonic() + 30
        while c.get(f"/streams/{sid}").json()["crossings"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert c.get(f"/streams/{sid}").json()["crossings"] == {}
        assert "streamdet_stream_line_crossings_total{" not in c.get("/metrics").text


def test_the_openapi_document_is_whole(client: TestClient) -> None:
    """What a client generator reads: every reference resolves (the jobs body pointed at its
    own ``$defs``), every POST/PUT/PATCH has its body (``/detect`` and KServe's ``infer``,
    read by hand, had none), operation ids are unique, and a job's body lists no live
    stream's setting (they are refused 422)."""
    schema = client.get("/openapi.json").json()
    defined = schema["components"]["schemas"]
    refs = re.findall(r'"\$ref": "([^"]+)"', json.dumps(schema))
    assert refs and all(r.removeprefix("#/components/schemas/") in defined for r in refs), refs
    ids = []
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            ids.append(operation["operationId"])
            if method in ("post", "put", "patch"):
                assert "requestBody" in operation, (method, path)
    assert len(ids) == len(set(ids))
    body = schema["paths"]["/detect"]["post"]["requestBody"]["content"]
    assert {"multipart/form-data", "image/jpeg", "image/png", "image/webp"} <= set(body)
    job = schema["paths"]["/jobs"]["post"]
    properties = job["requestBody"]["content"]["application/json"]["schema"]["properties"]
    assert "url" in properties and not {"clips", "motion"} & set(properties)
    assert {p["name"] for p in job["parameters"]} == {"settings", "filename"}


@pytest.mark.parametrize(
    "failure",
    [sqlite3.OperationalError("database or disk is full"), OSError(errno.ENOSPC, "No space")],
    ids=["sqlite-full", "enospc"],
)
def test_a_data_dir_that_cannot_be_written_is_507_naming_the_setting(
    client: TestClient, monkeypatch: pytest.MonkeyPatch, failure: Exception
) -> None:
    """A full disk (or a read-only one) under the data directory: every write route answered
    a bare 500 with a traceback. 507, saying why and which setting; nothing half-added."""
    manager = client.app.state.streamdet.streams  # type: ignore[attr-defined]

    def full(*_: object) -> None:
        raise failure

    monkeypatch.setattr(manager._store, "add", full)
    resp = client.post("/streams", json={"url": "rtsp://camera.invalid/stream"})
    assert resp.status_code == 507, resp.text
    assert "STREAMDET_DATA_DIR" in resp.json()["detail"]
    assert client.get("/streams").json()["streams"] == []


def test_a_data_dir_deleted_while_the_server_runs_is_507_naming_the_setting(
    tmp_path: Path,
) -> None:
    """``rm -rf`` of the data dir under a running server: the write routes were a 500
    ("no such table: streams"), naming no setting."""
    with TestClient(file_stream_app(tmp_path)) as c:
        shutil.rmtree(tmp_path / "data")
        for path in ("/streams", "/webhooks"):
            body = {"url": "rtsp://camera.invalid/a" if path == "/streams" else "http://h/"}
            resp = c.post(path, json=body)
            assert resp.status_code == 507, (path, resp.text)
            assert "STREAMDET_DATA_DIR" in resp.json()["detail"], resp.text


def test_a_removal_the_data_dir_refuses_changes_nothing(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``DELETE`` of a stream or a webhook answered 507 had already stopped and forgotten it
    (and told every sink the stream was removed); it came back at the next start."""
    state = client.app.state.streamdet  # type: ignore[attr-defined]
    sid = client.post("/streams", json={"url": "rtsp://camera.invalid/a", "enabled": False})
    sid = sid.json()["id"]
    hook = client.post("/webhooks", json={"url": "http://127.0.0.1:9/hook"}).json()["id"]
    logged = state.streams.events.last_id

    def full(*_: object) -> None:
        raise sqlite3.OperationalError("database or disk is full")

    with monkeypatch.context() as m:
        m.setattr(state.streams._store, "remove", full)
        m.setattr(state.webhook_store, "remove", full)
        for path in (f"/streams/{sid}", f"/webhooks/{hook}"):
            resp = client.delete(path)
            assert resp.status_code == 507 and "STREAMDET_DATA_DIR" in resp.text, path
        assert [s["id"] for s in client.get("/streams").json()["streams"]] == [sid]
        assert client.get(f"/webhooks/{hook}").status_code == 200
        assert state.streams.events.last_id == logged  # no "removed" told
    assert client.delete(f"/streams/{sid}").status_code == 204
    assert client.delete(f"/webhooks/{hook}").status_code == 204
    assert client.get("/streams").json()["streams"] == []


def test_a_v2_json_request_is_parsed_off_the_event_loop(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """20 MB of JSON (20 kB gzipped, sent with a read-only key) held the event loop about a
    second a call: every viewer and /healthz waited. It is inflated, parsed and converted in
    a decode thread, and a flat ``data`` of the wrong length is refused before converting."""
    import gzip
    import threading

    from server.routes import kserve, v2_tensors

    threads: list[str] = []
    split, uint8 = kserve._split, v2_tensors._uint8

    def spied_split(*args: Any) -> Any:
        threads.append(threading.current_thread().name)
        return split(*args)

    def spied_uint8(*args: Any) -> Any:
        threads.append(threading.current_thread().name)
        return uint8(*args)

    monkeypatch.setattr(kserve, "_split", spied_split)
    monkeypatch.setattr(v2_tensors, "_uint8", spied_uint8)
    tensor = {"name": "images", "datatype": "UINT8", "shape": [1, 32, 32, 3]}
    body = json.dumps({"inputs": [{**tensor, "data": [0] * (32 * 32 * 3)}]}).encode()
    resp = client.post(
        "/v2/models/yolov8n/infer",
        content=gzip.compress(body),
        headers={"content-type": "application/json", "content-encoding": "gzip"},
    )
    assert resp.status_code == 200, resp.text
    assert len(threads) == 2 and all(t.startswith("decode") for t in threads), threads
    long = json.dumps({"inputs": [{**tensor, "data": [0] * 100_000}]}).encode()
    resp = client.post("/v2/models/yolov8n/infer", content=long)
    assert resp.status_code == 400 and "100000 values for shape" in resp.json()["error"]
    assert len(threads) == 3  # parsed; never converted
