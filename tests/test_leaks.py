"""Churn against a real ``streamdet serve``: what streams, viewers and /detect calls take is
given back. Each loop runs after a warm-up (pools, first-use series); then the server's open
files, threads, child processes, ``/dev/shm`` rings and ``/metrics`` series are read before
and after N iterations and must come back to within a small margin (no timing asserted: a
count that settles is waited for up to a deadline)."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from loadtest.server import ServerProcess
from streams.decode_child import ring_prefix
from tests.helpers import BOTTLE_CLIP, clip_server, ultralytics_assets

ROUNDS = 30
WARM_UP = 5


def _counts(
    server: ServerProcess, client: httpx.Client, viewed: str, decoders: set[int]
) -> dict[str, int]:
    """The server's counts; ``decoders`` gathers the pids of its children seen so far, whose
    rings alone are counted (another server or test on the host makes rings of its own)."""
    pid = server.pid
    children = [p for p in os.listdir("/proc") if p.isdigit() and _parent(int(p)) == pid]
    decoders.update(int(p) for p in children)
    prefixes = tuple(ring_prefix(p) for p in decoders)
    # The viewed stream's series gain a class as its model first sees one (bounded by the
    # model's classes); those of streams added and removed must all go.
    metrics = [
        line
        for line in client.get("/metrics").text.splitlines()
        if line and not line.startswith("#") and f'stream="{viewed}"' not in line
    ]
    return {
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "threads": len(os.listdir(f"/proc/{pid}/task")),
        "children": len(children),
        "shm": sum(1 for n in os.listdir("/dev/shm") if prefixes and n.startswith(prefixes)),
        "series": len(metrics),
    }


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def _settles(read: Callable[[], dict[str, int]], baseline: dict[str, int]) -> dict[str, int]:
    """The counts once they are back within the margin of ``baseline``, or the last read
    after 30 s (a stream's thread or a dropped socket is given back a moment after)."""
    margin = {"fds": 3, "threads": 4, "children": 0, "shm": 0, "series": 0}
    deadline = time.monotonic() + 30
    while True:
        now = read()
        if all(now[k] <= baseline[k] + margin[k] for k in margin) or time.monotonic() > deadline:
            return now
        time.sleep(0.5)


def _raw(port: int, request: bytes, read: int) -> None:
    """Send ``request``, read about ``read`` bytes of the answer, then drop the connection
    without a close frame or the rest of the body."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(request)
        got = b""
        while len(got) < read:
            data = sock.recv(65536)
            if not data:
                break
            got += data


def _churn(server: ServerProcess, c: httpx.Client, viewed: str, image: bytes, i: int) -> None:
    resp = c.post("/streams", json={"url": f"file://{BOTTLE_CLIP}", "max_fps": 5})
    assert resp.status_code == 201, resp.text
    assert c.delete(f"/streams/{resp.json()['id']}").status_code == 204
    ws = (
        f"GET /ws/streams/{viewed}?frames=jpeg HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
        "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        "Sec-WebSocket-Version: 13\r\n\r\n"
    )
    _raw(server.port, ws.encode(), 400)
    _raw(server.port, f"GET /streams/{viewed}/mjpeg HTTP/1.1\r\nHost: x\r\n\r\n".encode(), 2000)
    head = (
        "POST /detect HTTP/1.1\r\nHost: x\r\ncontent-type: image/jpeg\r\n"
        f"content-length: {len(image)}\r\n\r\n"
    ).encode()
    _raw(server.port, head + image[: len(image) // 3], 0)  # dropped mid-upload
    bad = image[: len(image) // 2] if i % 2 else b"not an image"
    assert c.post("/detect", content=bad, headers={"content-type": "image/jpeg"}).status_code in (
        400,
        415,
    )


@pytest.mark.parametrize("decode_processes", [0, 1])
def test_stream_viewer_and_detect_churn_gives_back_what_it_takes(
    tmp_path: Path, decode_processes: int
) -> None:
    image = (ultralytics_assets() / "bus.jpg").read_bytes()
    server = clip_server(tmp_path, imgsz=320, decode_processes=decode_processes)
    with server, httpx.Client(base_url=server.base_url, timeout=60) as c:
        resp = c.post("/streams", json={"url": f"file://{BOTTLE_CLIP}", "max_fps": 5})
        assert resp.status_code == 201, resp.text
        viewed = resp.json()["id"]
        assert c.post("/detect", content=image, headers={"content-type": "image/jpeg"}).is_success
        for i in range(WARM_UP):
            _churn(server, c, viewed, image, i)
        c.get("/metrics")  # its own series, as the readings' calls make them
        decoders: set[int] = set()

        def read() -> dict[str, int]:
            return _counts(server, c, viewed, decoders)

        baseline = _settles(read, read())
        for i in range(ROUNDS):
            _churn(server, c, viewed, image, i)
        after = _settles(read, baseline)
        shown = c.get(f"/streams/{viewed}").json()
        streams = c.get("/streams").json()["streams"]
    assert after["fds"] <= baseline["fds"] + 3, (baseline, after)
    assert after["threads"] <= baseline["threads"] + 4, (baseline, after)
    assert after["children"] == baseline["children"], (baseline, after)
    assert after["shm"] == baseline["shm"], (baseline, after)
    assert after["series"] == baseline["series"], (baseline, after)
    assert shown["subscribers"] == 0, shown
    assert [s["id"] for s in streams] == [viewed]
