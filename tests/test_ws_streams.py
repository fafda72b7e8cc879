"""End to end: a real ``streamdet serve`` process, a real RTSP camera, a WebSocket client.

Covers the control API, the WebSocket messages and close codes, and that the stream list
survives a server restart."""

from __future__ import annotations

import json
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

from loadtest.server import ServerProcess, free_port
from tests.helpers import CACHE_DIR, MESSAGE_KEYS, MODEL_PT
from tests.rtsp_camera import BOTTLE, CAR, RtspCamera

pytestmark = pytest.mark.rtsp


def start_server(data_dir: Path, log_path: Path) -> ServerProcess:
    """``streamdet serve`` in a child process on a free port, keeping its streams in
    ``data_dir``; quick to notice a dead camera and to shut down."""
    settings: dict[str, object] = {
        "model": str(MODEL_PT),
        "imgsz": 640,
        "cache_dir": str(CACHE_DIR),
        "data_dir": str(data_dir),
        "stream_read_timeout_s": 3,
        "reconnect_max_s": 2,
        "shutdown_timeout_s": 5,
    }
    server = ServerProcess(settings, log_path=log_path, ready_timeout_s=180)
    server.start()
    return server


@pytest.fixture(scope="module")
def camera() -> Iterator[RtspCamera]:
    assert CAR is not None and BOTTLE is not None
    cam = RtspCamera({"car": CAR, "bottle": BOTTLE}).start()
    yield cam
    cam.stop()


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=30) as c:
        yield c


async def first_message_with_detections(url: str, limit: int = 250) -> dict[str, Any]:
    async with websockets.connect(url, open_timeout=30) as ws:
        for _ in range(limit):
            message: dict[str, Any] = json.loads(await ws.recv())
            if message["detections"]:
                return message
    pytest.fail(f"no detections in {limit} messages from {url}")


async def read_until_closed(ws: websockets.ClientConnection) -> int | None:
    """Read until the server closes; the close code it sent."""
    try:
        while True:
            await ws.recv()
    except websockets.ConnectionClosed as exc:
        return exc.rcvd.code if exc.rcvd else None


async def close_code(url: str) -> int | None:
    async with websockets.connect(url, open_timeout=30) as ws:
        return await read_until_closed(ws)


async def test_control_api_and_websocket(
    camera: RtspCamera, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    server = start_server(tmp_path / "data", tmp_path / "server.log")
    try:
        base = server.base_url
        resp = await client.post(f"{base}/streams", json={"url": camera.url("car"), "name": "car"})
        assert resp.status_code == 201, resp.text
        sid = resp.json()["id"]

        message = await first_message_with_detections(f"{server.ws_url}/ws/streams/{sid}")
        assert set(message) == MESSAGE_KEYS
        assert (message["stream_id"], message["width"], message["height"]) == (sid, 768, 432)
        assert message["latency_ms"] > 0
        det = message["detections"][0]
        assert set(det) == {"box", "confidence", "class_id", "class_name"}

        for bad, expected in (
            ({"url": "not a url"}, "spaces"),
            ({"url": "file:///etc/passwd"}, "STREAMDET_ALLOWED_FILE_DIR"),
            ({"url": "gopher://x/y"}, "not allowed"),
            ({"url": camera.url("car"), "max_fps": -1}, "greater than 0"),
        ):
            resp = await client.post(f"{base}/streams", json=bad)
            assert resp.status_code == 422, resp.text
            assert expected in resp.text

        resp = await client.post(
            f"{base}/streams", json={"url": f"rtsp://127.0.0.1:{free_port()}/x"}
        )
        assert resp.status_code == 201  # cameras come and go: accepted, reported in its state
        assert resp.json()["state"] in {"connecting", "reconnecting"}

        listed = (await client.get(f"{base}/streams")).json()["streams"]
        assert {s["id"] for s in listed} == {sid, resp.json()["id"]}
        one = (await client.get(f"{base}/streams/{sid}")).json()
        assert one["state"] == "live" and one["frames_processed"] > 0 and one["name"] == "car"

        assert await close_code(f"{server.ws_url}/ws/streams/nope") == 4404
        assert (await client.get(f"{base}/streams/nope")).status_code == 404

        async with websockets.connect(f"{server.ws_url}/ws/streams/{sid}") as ws:
            await ws.recv()
            assert (await client.delete(f"{base}/streams/{sid}")).status_code == 204
            assert await read_until_closed(ws) == 1000
        assert (await client.get(f"{base}/streams/{sid}")).status_code == 404
        assert (await client.delete(f"{base}/streams/{sid}")).status_code == 404
    finally:
        server.stop(60)


async def test_restart_keeps_streams_and_shutdown_says_going_away(
    camera: RtspCamera, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    server = start_server(data, tmp_path / "server.log")
    try:
        resp = await client.post(
            f"{server.base_url}/streams", json={"url": camera.url("bottle"), "max_fps": 5}
        )
        assert resp.status_code == 201, resp.text
        sid = resp.json()["id"]
        async with websockets.connect(f"{server.ws_url}/ws/streams/{sid}") as ws:
            await ws.recv()
            server.signal_stop()
            assert await read_until_closed(ws) == 1001
    finally:
        # uvicorn re-raises the SIGTERM after its graceful shutdown, hence -15.
        assert server.stop(60) in (0, -signal.SIGTERM)
    log = server.log_text()
    assert "shutdown complete" in log, log

    restarted = start_server(data, tmp_path / "restarted.log")
    try:
        listed = (await client.get(f"{restarted.base_url}/streams")).json()["streams"]
        assert [(s["id"], s["max_fps"]) for s in listed] == [(sid, 5)]
        message = await first_message_with_detections(f"{restarted.ws_url}/ws/streams/{sid}")
        assert message["stream_id"] == sid
    finally:
        restarted.stop(60)
