"""The JPEG frames the viewer asks for on ``WS /ws/streams/{id}?frames=jpeg``, and a stream's
``latest.jpg`` (no browser)."""

from __future__ import annotations

import asyncio
import io
import json
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image as PILImage

from engines.types import Detections
from engines.yolo import resize
from server.render import line_label, render_jpeg, zone_label
from server.routes.viewer import JpegFrames, Pace
from server.routes.ws import _send
from streams.detect import Roi
from streams.fanout import ProcessedFrame, StateMessage, Subscriber
from streams.lines import Crossing, Line
from streams.zones import Zone
from tests.helpers import (
    BOTTLE_CLIP,
    VIDEOS,
    clip_server,
    decode_jpeg,
    file_stream_app,
    wait_until,
)

SOURCE_FPS = 12.5  # car-detection.mp4


def frame_at(t: float, width: int = 768, height: int = 432) -> ProcessedFrame:
    image = np.zeros((height, width, 3), np.uint8)
    image[:, : width // 2] = (200, 30, 30)  # left half red, right half black
    detections = Detections(
        boxes=np.array([[10, 20, 110, 220]], np.float32),
        scores=np.array([0.9], np.float32),
        class_ids=np.array([2], np.int32),
        names={2: "car"},
        width=width,
        height=height,
    )
    return ProcessedFrame(
        stream_id="cam",
        frame=round(t * SOURCE_FPS),
        pts=t,
        captured_at=1e9 + t,
        decoded_mono=t,
        image=image,
        detections=detections,
        batch_size=1,
    )


def test_json_only_unless_asked() -> None:
    assert JpegFrames.from_options({}) is None
    assert JpegFrames.from_options({"frames": "none", "max_fps": "3"}) is None
    # A JSON-only viewer: every frame, or at most max_fps a second where it asks.
    assert Pace.of_json({}) is None
    paced = Pace.of_json({"frames": "none", "max_fps": "3"})
    assert paced is not None and paced.max_fps == 3.0
    for bad in ({"max_fps": "banana"}, {"max_width": "abc"}, {"quality": "5"}):
        with pytest.raises(ValueError, match=next(iter(bad))):  # 4400 naming it: was ignored
            Pace.of_json(bad)
    opts = JpegFrames.from_options({"frames": "jpeg", "max_fps": "2.5", "max_width": "320"})
    assert opts is not None
    assert (opts.max_fps, opts.max_width, opts.quality) == (2.5, 320, 70)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"frames": "png"}, "frames='png': expected 'jpeg' or 'none'"),
        ({"frames": "jpeg", "max_fps": "0"}, "max_fps=0: expected a number in [0.1, 60]"),
        ({"frames": "jpeg", "max_fps": "fast"}, "max_fps='fast': expected a number"),
        ({"frames": "jpeg", "max_width": "99999"}, "max_width=99999: expected a number"),
        ({"frames": "jpeg", "quality": "5"}, "quality=5: expected a number in [10, 95]"),
    ],
)
def test_bad_options_name_the_option(options: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace(".", r"\.")):
        JpegFrames.from_options(options)


@pytest.mark.parametrize("max_fps", [1.0, 2.0, 5.0, 10.0])
def test_rate_follows_the_viewer_not_the_source(max_fps: float) -> None:
    jpeg = JpegFrames(max_fps=max_fps)
    seconds = 20
    times = [i / SOURCE_FPS for i in range(int(seconds * SOURCE_FPS))]
    sent = [t for t in times if jpeg.due(frame_at(t), newer_waiting=False)]
    assert abs(len(sent) - seconds * max_fps) <= 1, (len(sent), max_fps)
    assert jpeg.skipped == len(times) - len(sent)


def test_a_viewer_behind_skips_to_the_newest_frame() -> None:
    jpeg = JpegFrames(max_fps=60)
    assert not jpeg.due(frame_at(0.0), newer_waiting=True)
    assert jpeg.due(frame_at(0.08), newer_waiting=False)


def test_no_burst_after_a_gap() -> None:
    jpeg = JpegFrames(max_fps=5)
    assert jpeg.due(frame_at(0.0), newer_waiting=False)
    # The camera stalled for 10 s: the next frames are paced afresh, not sent to catch up.
    after = [t for t in (10.0, 10.08, 10.16, 10.24) if jpeg.due(frame_at(t), False)]
    assert after == [10.0, 10.24]


def test_encode_scales_down_and_keeps_the_picture() -> None:
    frame = frame_at(0.0)
    data, width, height = render_jpeg(frame.image, 640, 80)
    assert (width, height) == (640, 360)
    decoded = np.asarray(PILImage.open(io.BytesIO(data)).convert("RGB"))
    assert decoded.shape == (360, 640, 3)
    left, right = decoded[:, :300].mean(axis=(0, 1)), decoded[:, 340:].mean(axis=(0, 1))
    assert np.allclose(left, (200, 30, 30), atol=8), left
    assert np.allclose(right, (0, 0, 0), atol=8), right
    small, w, h = render_jpeg(frame.image, 1920, 80)
    assert (w, h) == (768, 432)  # never scaled up
    assert small[:2] == b"\xff\xd8"


@pytest.mark.parametrize("decoded_small", [False, True], ids=["whole", "decoded-at-half"])
def test_encode_draws_the_boxes_scaled_to_the_picture(decoded_small: bool) -> None:
    """Scaled down to 384 wide for the viewer, or decoded at 384 wide already (a stream's
    frame decoded at the engine's size): the boxes, in the camera's pixels, land on it."""
    frame = frame_at(0.0)  # box 10,20 - 110,220 in a 768x432 frame
    image = resize(frame.image, (384, 216)) if decoded_small else frame.image
    plain, _, _ = render_jpeg(image, 384, 90)
    boxed, width, height = render_jpeg(image, 384, 90, detections=frame.detections)
    assert (width, height) == (384, 216)
    diff = np.abs(decode_jpeg(boxed) - decode_jpeg(plain)).sum(axis=2)
    changed = np.argwhere(diff > 60)
    # Drawn at half scale: the box 5,10 - 55,110, its label just above it, nothing elsewhere.
    ys, xs = changed[:, 0], changed[:, 1]
    assert xs.min() >= 3 and xs.max() <= 80 and ys.min() >= 0 and ys.max() <= 112
    assert diff[60, 54:57].max() > 60 and diff[60, 20:40].max() < 60  # right edge, not inside


def test_latest_jpeg_of_a_stream(tmp_path: Path) -> None:
    with TestClient(file_stream_app(tmp_path)) as c:
        assert c.get("/streams/nope/latest.jpg").status_code == 404
        sid = c.post("/streams", json={"url": f"file://{VIDEOS[0]}", "max_fps": 5}).json()["id"]
        deadline = time.monotonic() + 60
        while (resp := c.get(f"/streams/{sid}/latest.jpg")).status_code == 503:
            assert resp.headers["retry-after"] == "1" and "no processed frame" in resp.text
            assert time.monotonic() < deadline, resp.text
            time.sleep(0.1)
        assert resp.status_code == 200, resp.text
        assert resp.headers["content-type"] == "image/jpeg"
        assert resp.headers["cache-control"] == "no-store"
        assert int(resp.headers["x-frame"]) >= 1 and int(resp.headers["x-detections"]) >= 0
        assert decode_jpeg(resp.content).shape == (360, 640, 3)  # the clip's size, under 1920
        small = c.get(f"/streams/{sid}/latest.jpg?max_width=320&boxes=false&quality=50")
        assert small.status_code == 200 and decode_jpeg(small.content).shape == (180, 320, 3)
        region = [[0.0, 0.0], [0.5, 0.0], [0.5, 1.0], [0.0, 1.0]]
        assert c.patch(f"/streams/{sid}", json={"roi": region}).status_code == 200
        outlined = decode_jpeg(c.get(f"/streams/{sid}/latest.jpg").content)
        edge = outlined[150:210, 318:322].reshape(-1, 3).mean(axis=0)  # x = 0.5 of 640
        assert edge[0] > 150 and edge[1] < 120 and edge[2] > 150  # the region's magenta edge
        bad = c.get(f"/streams/{sid}/latest.jpg?max_width=10")
        assert bad.status_code == 422 and "max_width" in bad.text


def test_encode_outlines_the_region_of_interest() -> None:
    image = np.zeros((200, 400, 3), np.uint8)
    right_half = Roi(((0.5, 0.0), (1.0, 0.0), (1.0, 1.0), (0.5, 1.0)))
    plain, _, _ = render_jpeg(image, 400, 95)
    outlined, _, _ = render_jpeg(image, 400, 95, region=right_half)
    diff = np.abs(decode_jpeg(outlined) - decode_jpeg(plain)).sum(axis=2)
    assert diff[100, 198:202].max() > 200  # the left edge, at x = 0.5 of 400
    assert diff[100, 300] < 30 and diff[100, 100] < 30  # inside and outside stay as they were
    picture = decode_jpeg(outlined)[100, 199:201].mean(axis=0)
    assert picture[0] > 150 and picture[1] < 100 and picture[2] > 150  # magenta


def test_encode_draws_counting_lines_with_their_counts() -> None:
    image = np.zeros((200, 400, 3), np.uint8)
    gate = Line("gate", (0.0, 0.75), (1.0, 0.75))
    label = line_label("gate", {"gate": {"in": {"car": 3, "truck": 1}, "out": {"car": 2}}})
    assert label == "gate: 4 in, 2 out"
    drawn = decode_jpeg(render_jpeg(image, 400, 95, lines=[(gate, label)])[0])
    row = round(0.75 * 199)
    cyan = drawn[row - 1 : row + 2, 300:380].reshape(-1, 3).mean(axis=0)  # right of the label
    assert cyan[0] < 100 and cyan[1] > 150 and cyan[2] > 150
    assert drawn[row + 5 : row + 20, 2:60].max(axis=(0, 1))[1] > 150  # the label's text
    assert drawn[40:100].max() < 30  # nothing drawn far from the line


class _Socket:
    """What ``_send`` needs of a WebSocket: the messages it was sent."""

    def __init__(self) -> None:
        self.texts: list[dict[str, Any]] = []
        self.binaries = 0
        self.closed: tuple[int, str] | None = None

    async def send_text(self, text: str) -> None:
        self.texts.append(json.loads(text))

    async def send_bytes(self, data: bytes) -> None:
        self.binaries += 1

    async def close(self, code: int, reason: str) -> None:
        self.closed = (code, reason)


@pytest.mark.parametrize("frames", ["jpeg", "none"])
async def test_a_viewer_at_a_lower_rate_still_gets_every_event(frames: str) -> None:
    """Frames at 20 fps to a viewer that asked for 5 (with their pictures, or JSON only: its
    max_fps was ignored): it is sent one in four, and the crossing events of the frames it
    skips come with the next one it is sent; those of the last frames before the stream
    closes (or changes state) come with the newest of them, sent before the close (they
    were lost: no later frame came to carry them)."""
    sub = Subscriber("s1", maxsize=4)
    socket = _Socket()
    options = {"frames": frames, "max_fps": "5"}
    jpeg = JpegFrames.from_options(options)
    pace = jpeg or Pace.of_json(options)
    sender = asyncio.create_task(_send(socket, sub, jpeg, pace=pace))  # type: ignore[arg-type]
    image = np.zeros((48, 64, 3), np.uint8)
    for n in range(1, 14):
        crossing = Crossing("gate", "in", track_id=n, class_id=0, frame=n)
        sub.offer(
            ProcessedFrame(
                "s1",
                n,
                None,
                0.0,
                n * 0.05,
                image,
                Detections.empty({0: "person"}, 64, 48),
                1,
                events=(crossing,),
            )
        )
        await asyncio.sleep(0.05)  # the sender takes each frame before the next comes
        if n == 11:
            sub.offer(StateMessage('{"type":"stream_state","state":"reconnecting"}'))
            await asyncio.sleep(0.05)
    sub.close(1000, "done")
    await asyncio.wait_for(sender, 10)
    assert socket.closed == (1000, "done")
    sent = [m.get("frame", m.get("state")) for m in socket.texts]
    assert 4 <= len(sent) <= 8, sent  # ~5 of 20 fps, and the newest before each change
    assert socket.binaries == (len(sent) - 1 if frames == "jpeg" else 0)
    assert sent[-1] == 13 and sent[sent.index("reconnecting") - 1] == 11, sent
    events = [e["frame"] for m in socket.texts for e in m.get("events", [])]
    # Every crossing arrived, once, in order, each before the change that followed it.
    assert events == list(range(1, 14)), (sent, events)


def test_encode_outlines_zones_with_what_stands_in_them() -> None:
    image = np.zeros((200, 400, 3), np.uint8)
    dock = Zone("dock", ((0.5, 0.5), (1.0, 0.5), (1.0, 1.0), (0.5, 1.0)))
    label = zone_label("dock", {"dock": {"now": {"car": 2, "truck": 1}, "entered": {}}})
    assert label == "dock: 3"
    drawn = decode_jpeg(render_jpeg(image, 400, 95, zones=[(dock, label)])[0])
    edge = drawn[150, 198:202].max(axis=0)  # its left side, at x = 0.5 of 400
    assert edge[0] > 150 and edge[1] > 120 and edge[2] < 100  # yellow
    assert drawn[40:80, 20:180].max() < 30  # nothing drawn outside it


def test_zone_and_line_counts_are_drawn_over_the_boxes() -> None:
    """A box whose label lands on a zone's count does not hide it."""
    image = np.full((500, 1000, 3), 60, np.uint8)
    dock = Zone("dock", ((0.1, 0.3), (0.9, 0.3), (0.9, 0.9), (0.1, 0.9)))
    car = Detections(
        boxes=np.array([[80, 170, 600, 450]], np.float32),  # its label: y 153-170 from x 80
        scores=np.array([0.9], np.float32),
        class_ids=np.array([2], np.int32),
        names={2: "car"},
        width=1000,
        height=500,
    )
    drawn = decode_jpeg(render_jpeg(image, 1000, 95, detections=car, zones=[(dock, "dock: 1")])[0])
    # The zone's tag from (99, 149), 17 px high, its text from x 101: its black ground, not
    # the colour of the box's label under it, is on top.
    tag = drawn[155:162, 99:101].reshape(-1, 3)
    assert tag.max() < 50, tag
    label = drawn[155:162, 80:82].reshape(-1, 3)  # the box's label, left of the tag
    assert label.max(axis=1).min() > 150, label


def test_mjpeg_stream_of_a_stream_for_img_tags_and_camera_cards(tmp_path: Path) -> None:
    """A real server: ``GET /streams/{id}/mjpeg`` sends processed frames as JPEG parts of a
    ``multipart/x-mixed-replace`` body, at most ``max_fps`` a second, with the boxes drawn;
    removing the stream ends the body cleanly."""
    bottle = BOTTLE_CLIP
    server = clip_server(tmp_path)
    with server, httpx.Client(base_url=server.base_url, timeout=60) as c:
        assert c.get("/streams/nope/mjpeg").status_code == 404
        sid = c.post("/streams", json={"url": f"file://{bottle}", "classes": "bottle"}).json()["id"]
        bad = c.get(f"/streams/{sid}/mjpeg", params={"max_fps": 0})
        assert bad.status_code == 422 and "max_fps" in bad.text
        params = {"max_fps": 4, "max_width": 320}
        with c.stream("GET", f"/streams/{sid}/mjpeg", params=params) as resp:
            kind = resp.headers["content-type"]
            assert kind == "multipart/x-mixed-replace; boundary=frame", kind
            body = b""
            chunks = resp.iter_bytes()
            started = time.monotonic()
            while body.count(b"--frame\r\n") < 6:
                body += next(chunks)
            elapsed = time.monotonic() - started
            assert c.delete(f"/streams/{sid}").status_code == 204
            body += b"".join(chunks)  # ends once the stream is gone: no hang, no error
    parts = [p for p in body.split(b"--frame\r\n") if p]
    assert len(parts) >= 6
    frames = []
    for part in parts[:6]:
        head, _, rest = part.partition(b"\r\n\r\n")
        fields = dict(line.split(": ", 1) for line in head.decode().split("\r\n"))
        assert fields["Content-Type"] == "image/jpeg"
        jpeg = rest[: int(fields["Content-Length"])]
        assert rest[len(jpeg) :] == b"\r\n"
        assert decode_jpeg(jpeg).shape == (180, 320, 3)  # 640x360 scaled to 320 wide
        frames.append(int(fields["X-Frame"]))
    assert frames == sorted(frames) and len(set(frames)) == len(frames)
    # 4 a second from a 30 fps clip: frames skipped between parts, ~1.25 s for 5 gaps.
    assert frames[-1] - frames[0] >= 5 * 3, frames
    assert elapsed >= 0.5, elapsed


def test_every_get_route_answers_head_with_its_headers_and_no_body(tmp_path: Path) -> None:
    """A real server: ``HEAD`` on a ``GET`` route answers the GET's status and headers
    without a body (FastAPI's routes refused it with a 405: ``HEAD /streams``, a stream's
    ``latest.jpg``, the viewer page), and an endless answer (MJPEG, server-sent events) ends
    at its headers instead of hanging; a 405's ``Allow`` lists HEAD beside GET."""
    server = clip_server(tmp_path)
    with server, httpx.Client(base_url=server.base_url, timeout=30) as c:
        sid = c.post("/streams", json={"url": f"file://{BOTTLE_CLIP}", "loop": True}).json()["id"]
        wait_until(lambda: c.get(f"/streams/{sid}/latest.jpg").status_code == 200, "a frame")
        for path, kind in (
            ("/streams", "application/json"),
            (f"/streams/{sid}", "application/json"),
            (f"/streams/{sid}/latest.jpg", "image/jpeg"),
            ("/", "text/html"),
            ("/metrics", "text/plain"),
            ("/events", "application/json"),
            (f"/streams/{sid}/mjpeg", "multipart/x-mixed-replace"),
            ("/events", "text/event-stream"),  # server-sent events: endless
        ):
            accept = {"accept": kind} if kind == "text/event-stream" else {}
            head = c.head(path, headers=accept)
            assert head.status_code == 200, (path, head.status_code, head.text)
            assert head.headers["content-type"].startswith(kind), (path, head.headers)
            assert head.content == b"", path
        head = c.head("/model")  # an answer that does not change: the same length
        assert head.headers["content-length"] == c.get("/model").headers["content-length"]
        assert c.head("/streams/nope").status_code == 404
        assert c.head("/healthz").status_code == 200  # its own HEAD route
        refused = c.request("OPTIONS", "/streams")
        assert refused.status_code == 405
        assert refused.headers["allow"] == "GET, HEAD, POST", refused.headers
        assert c.get("/healthz").status_code == 200  # nothing hangs behind them
        counted = 'streamdet_http_requests_total{method="HEAD",route="/streams/{stream_id}",'
        assert counted in c.get("/metrics").text  # by its route, not as an unrouted call
        # The MJPEG answer's viewer left with it.
        wait_until(lambda: c.get(f"/streams/{sid}").json()["subscribers"] == 0, "no viewer")


async def test_head_ends_an_endless_answer_whose_server_never_says_the_client_left() -> None:
    """Behind a pipelined request uvicorn never woke a HEAD's streaming answer's wait for
    its client (it signals the connection's newest request): an MJPEG answer ran on, its
    viewer counted, until a send failed. The wait is woken once the headers are sent."""
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse
    from starlette.types import Message

    from server.head import HeadAsGet

    async def endless() -> Any:
        while True:
            yield b"--frame\r\n"
            await asyncio.sleep(0.01)

    app = FastAPI()

    @app.get("/live")
    async def live() -> StreamingResponse:
        return StreamingResponse(endless(), media_type="multipart/x-mixed-replace")

    head = HeadAsGet(app, app.router.routes)
    asked = False

    async def receive() -> Message:
        nonlocal asked
        if not asked:
            asked = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await asyncio.Event().wait()  # never woken, as behind a pipelined request
        raise AssertionError("unreachable")

    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "HEAD",
        "scheme": "http",
        "path": "/live",
        "raw_path": b"/live",
        "root_path": "",
        "query_string": b"",
        "headers": [],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }
    await asyncio.wait_for(head(scope, receive, send), 10)
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[0]["status"] == 200 and sent[1] == {
        "type": "http.response.body",
        "body": b"",
        "more_body": False,
    }
