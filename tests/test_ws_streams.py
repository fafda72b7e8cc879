"""End to end: a real ``streamdet serve`` process, a real RTSP camera, a WebSocket client.

Covers the control API, the WebSocket messages and close codes, that the stream list
survives a server restart, and that a viewer that stops reading is dropped."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import socket
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

from loadtest.server import ServerProcess, free_port
from server.transport import MAX_UNSENT_BYTES
from tests.helpers import BOTTLE_CLIP, CACHE_DIR, MESSAGE_KEYS, MODEL_PT, clip_server
from tests.rtsp_camera import BOTTLE, CAR, RtspCamera


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


async def state_messages(ws: websockets.ClientConnection, until: str) -> list[dict[str, Any]]:
    """The state changes ``ws`` is sent up to one to ``until``, skipping frames (60 s at
    most)."""
    changes: list[dict[str, Any]] = []
    async with asyncio.timeout(60):
        while not changes or changes[-1]["state"] != until:
            message: dict[str, Any] = json.loads(await ws.recv())
            if "type" in message:
                assert message["type"] == "stream_state" and "detections" not in message
                changes.append(message)
    return changes


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


@pytest.mark.rtsp
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
        # Reasons cut to a close frame's 123 bytes, not characters: no close code came, and
        # a traceback was logged.
        assert await close_code(f"{server.ws_url}/ws/streams/{'%C3%A9' * 100}") == 4404
        assert (await client.get(f"{base}/streams/nope")).status_code == 404

        # ?states=true: told why the frames stop (disabled here, a camera lost alike) and that
        # they come again, with the events as GET /events logs them; a viewer that did not
        # ask gets frames only.
        stream_ws = f"{server.ws_url}/ws/streams/{sid}"
        async with (
            websockets.connect(f"{stream_ws}?states=true") as told,
            websockets.connect(stream_ws) as plain,
        ):
            await told.recv()
            await plain.recv()
            off = await client.patch(f"{base}/streams/{sid}", json={"enabled": False})
            assert off.status_code == 200 and off.json()["state"] == "disabled", off.text
            # A viewer that comes while it is down is told why at once (it got nothing).
            async with websockets.connect(f"{stream_ws}?states=true") as late:
                first = json.loads(await asyncio.wait_for(late.recv(), 10))
                assert (first["type"], first["state"]) == ("stream_state", "disabled"), first
            # A disabled stream given a new source stays disabled: no "disabled" again.
            moved = {"url": camera.url("car") + "?x=1", "name": "car", "enabled": False}
            assert (await client.put(f"{base}/streams/{sid}", json=moved)).status_code == 200
            on = await client.patch(f"{base}/streams/{sid}", json={"enabled": True})
            assert on.status_code == 200, on.text
            changes = await state_messages(told, until="live")
            assert (changes[0]["previous"], changes[0]["state"]) == ("live", "disabled"), changes
            assert [c["state"] for c in changes].count("disabled") == 1, changes
            logged = (
                await client.get(
                    f"{base}/events", params={"type": "stream_state", "stream_id": sid}
                )
            ).json()["events"]
            assert all(c in logged for c in changes), (changes, logged)
            for _ in range(5):  # frames again, and never a state change for this one
                assert "detections" in json.loads(await asyncio.wait_for(plain.recv(), 30))
        assert await close_code(f"{stream_ws}?states=maybe") == 4400
        assert await close_code(f"{stream_ws}?max_fsp=1") == 4400  # every frame, was sent
        assert await close_code(f"{stream_ws}?{'%F0%9F%98%80' * 60}=1") == 4400
        assert await close_code(f"{stream_ws}?max_fps=1&max_fps=2") == 4400  # one kept
        repeated = "&".join(["access_token=a"] * 17)  # counted once: over 16 all the same
        assert await close_code(f"{stream_ws}?{repeated}") == 4400
        many = "&".join(f"p{n}=1" for n in range(16))
        assert await close_code(f"{stream_ws}?{many}&states=true") == 4400  # states was ignored

        viewer = {"X-Request-ID": "viewer-7"}
        async with websockets.connect(
            f"{server.ws_url}/ws/streams/{sid}", additional_headers=viewer
        ) as ws:
            assert ws.response is not None
            assert ws.response.headers["x-request-id"] == "viewer-7"  # the handshake's id
            await ws.recv()
            assert (await client.delete(f"{base}/streams/{sid}")).status_code == 204
            assert await read_until_closed(ws) == 1000
        assert (await client.get(f"{base}/streams/{sid}")).status_code == 404
        assert (await client.delete(f"{base}/streams/{sid}")).status_code == 404
    finally:
        server.stop(60)


@pytest.mark.rtsp
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


# ---- a viewer that stops reading ------------------------------------------------------------
STALLING_STREAM = {"url": f"file://{BOTTLE_CLIP}", "max_fps": 30}
"""The bottle clip looping, fast: with full-size JPEGs (``STALLING_VIEW``) it fills a stalled
viewer's socket buffers in seconds."""
STALLING_VIEW = "frames=jpeg&max_fps=60&quality=95"


def stalled_viewer(port: int, sid: str, view: str = STALLING_VIEW) -> socket.socket:
    """A WebSocket viewer of ``sid`` that never reads: its tiny receive buffer closes its
    TCP window at once, and the server's buffers fill behind it."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    sock.settimeout(30)
    sock.connect(("127.0.0.1", port))
    key = base64.b64encode(os.urandom(16)).decode()
    request = (
        f"GET /ws/streams/{sid}?{view} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
        f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    sock.sendall(request.encode())
    answer = b""
    while b"\r\n\r\n" not in answer:
        answer += sock.recv(1)
    assert answer.startswith(b"HTTP/1.1 101"), answer
    return sock


def server_side(server_port: int, client_port: int) -> bool:
    """Whether the server's end of the connection is still there, in any state (Linux)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        _, local, remote, *_ = line.split()
        if (int(local.split(":")[1], 16), int(remote.split(":")[1], 16)) == (
            server_port,
            client_port,
        ):
            return True
    return False


def unsent_bytes(server_port: int, client_port: int) -> int | None:
    """Bytes the server's end of an open connection holds unacknowledged (Linux
    /proc/net/tcp); None once the server closed it (what is left to the kernel then)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        _, local, remote, state, queues, *_ = line.split()
        ports = (int(local.split(":")[1], 16), int(remote.split(":")[1], 16))
        if ports == (server_port, client_port) and state == "01":  # ESTABLISHED
            return int(queues.split(":")[0], 16)
    return None


def wait_until(what: str, check: Any, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not {what} within {timeout_s:.0f} s"
        time.sleep(0.25)


def wait_stalled(server_port: int, sock: socket.socket) -> None:
    """Until the server's socket buffer for ``sock`` is full (its unsent bytes stop growing
    for a second): the server's next send to it waits."""
    client_port = sock.getsockname()[1]
    seen: list[int | None] = []

    def stalled() -> bool:
        seen.append(unsent_bytes(server_port, client_port))
        last = seen[-5:]
        return len(last) == 5 and len(set(last)) == 1 and bool(last[0])

    wait_until("stalled", stalled)


@pytest.mark.parametrize("kind", ["websocket", "mjpeg"])
def test_a_stalled_viewer_holds_up_neither_its_streams_removal_nor_the_shutdown(
    tmp_path: Path, kind: str
) -> None:
    """Its send waits (the timeout is long): the stream's removal and the server's shutdown
    drop it at once, instead of waiting for a send that never ends (a WebSocket viewer, or an
    MJPEG client: it held the shutdown for uvicorn's graceful timeout, logging a traceback)."""
    stalled = stalled_viewer if kind == "websocket" else stalled_mjpeg_client
    server = clip_server(
        tmp_path, ws_send_timeout_s=600, stream_decode_size=0, shutdown_timeout_s=30
    )
    with server, httpx.Client(base_url=server.base_url, timeout=30) as c:
        removed = c.post("/streams", json=STALLING_STREAM).json()["id"]
        with stalled(server.port, removed) as sock:
            wait_stalled(server.port, sock)
            assert c.delete(f"/streams/{removed}").status_code == 204
            client_port = sock.getsockname()[1]
            # Reset, not closed: the kernel kept trying to send the stalled viewer its unsent
            # bytes for minutes (FIN-WAIT-1), the viewer none the wiser.
            wait_until("reset", lambda: not server_side(server.port, client_port), 10)

        kept = c.post("/streams", json=STALLING_STREAM).json()["id"]
        with stalled(server.port, kept) as sock:
            wait_stalled(server.port, sock)
            started = time.monotonic()
            # SIGTERM: well under the 30 s the shutdown may take, and nothing cancelled.
            assert server.stop(60) in (0, -signal.SIGTERM)
            took = time.monotonic() - started
    log = server.log_text()
    assert "graceful shutdown exceeded" not in log and took < 25, (took, log[-3000:])
    assert log.count("not reading when its stream closed") == 2, log
    assert log.count("(setting STREAMDET_WS_SEND_TIMEOUT_S)") == 2, log
    assert "shutdown complete" in log


def test_a_stalled_viewer_loses_old_messages_in_its_queue_not_in_the_servers_socket(
    tmp_path: Path,
) -> None:
    """A viewer that stops reading with its window closed: the server's socket took what the
    stream sent it (it grows to a few MB: after 30 s at 10 fps, 331 messages were waiting,
    the oldest 30 s old, none counted dropped). Now the connection holds at most
    MAX_UNSENT_BYTES unsent in the socket and as much in the event loop's buffer, the sends
    wait beyond it, and the viewer's queue drops old messages, counted."""
    with (
        clip_server(tmp_path, ws_send_timeout_s=600) as server,
        httpx.Client(base_url=server.base_url, timeout=30) as c,
    ):
        sid = c.post("/streams", json=STALLING_STREAM).json()["id"]
        with stalled_viewer(server.port, sid, view="") as sock:
            wait_stalled(server.port, sock)
            held = unsent_bytes(server.port, sock.getsockname()[1])
            assert held is not None and held <= 2 * MAX_UNSENT_BYTES, held
            wait_until("dropping", lambda: c.get(f"/streams/{sid}").json()["viewer_drops"] > 10)


def stalled_mjpeg_client(port: int, sid: str) -> socket.socket:
    """An MJPEG client of ``sid`` that never reads (as :func:`stalled_viewer`)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    sock.connect(("127.0.0.1", port))
    query = "max_fps=60&max_width=3840&quality=95"
    sock.sendall(f"GET /streams/{sid}/mjpeg?{query} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    return sock


@pytest.mark.parametrize("kind", ["websocket", "mjpeg"])
def test_a_viewer_that_stops_reading_is_dropped_after_the_send_timeout(
    tmp_path: Path, kind: str
) -> None:
    """A WebSocket viewer, or an MJPEG client (a dashboard tab left in the background, a
    camera viewer gone to sleep), that stops reading: its send waited for ever, holding its
    subscription; dropped after the send timeout, its connection aborted."""
    stalled = stalled_viewer if kind == "websocket" else stalled_mjpeg_client
    with (
        clip_server(tmp_path, ws_send_timeout_s=1, stream_decode_size=0) as server,
        httpx.Client(base_url=server.base_url, timeout=30) as c,
    ):
        sid = c.post("/streams", json=STALLING_STREAM).json()["id"]
        with stalled(server.port, sid) as sock:
            client_port = sock.getsockname()[1]
            wait_until("dropped", lambda: "waited over 1 s" in server.log_text())
            # Its connection is aborted: the server holds no socket for what it never read.
            wait_until("aborted", lambda: unsent_bytes(server.port, client_port) is None, 10)
        wait_until("unsubscribed", lambda: c.get(f"/streams/{sid}").json()["subscribers"] == 0)
        # What it missed outlives it, in GET and in /metrics (was only in its disconnect log).
        missed = c.get(f"/streams/{sid}").json()["viewer_drops"]
        assert missed > 0
        metrics = c.get("/metrics").text
        assert f'streamdet_stream_viewer_messages_dropped_total{{stream="{sid}"}} {missed}' in (
            metrics.replace(".0\n", "\n")
        ), metrics
        assert f'streamdet_stream_viewers{{stream="{sid}"}} 0.0' in metrics
    log = server.log_text()
    assert "(setting STREAMDET_WS_SEND_TIMEOUT_S)" in log, log
    assert "graceful shutdown exceeded" not in log


def test_viewers_whose_close_fitted_behind_their_unsent_frames_hold_up_no_shutdown(
    tmp_path: Path,
) -> None:
    """A stalled viewer's close frame that fitted behind its unsent bytes ended its sender,
    and its abort was put off by the whole --ws-send-timeout-s: uvicorn waited for its
    connection that long on SIGTERM, with nothing in flight."""
    server = clip_server(tmp_path, ws_send_timeout_s=20, shutdown_timeout_s=30)
    with server, httpx.Client(base_url=server.base_url, timeout=30) as c:
        sid = c.post("/streams", json=STALLING_STREAM).json()["id"]
        viewers = []
        for _ in range(12):  # some stall before their close, some after it
            viewers.append(stalled_viewer(server.port, sid, "frames=jpeg&max_width=320"))
            time.sleep(0.3)
        started = time.monotonic()
        assert server.stop(60) in (0, -signal.SIGTERM)
        took = time.monotonic() - started
        for sock in viewers:
            sock.close()
    log = server.log_text()
    assert took < 10, (took, log[-3000:])  # was the 20 s send timeout
    assert "shutdown complete" in log
