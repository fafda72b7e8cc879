"""End to end against a real ``streamdet serve`` process (uvicorn)."""

from __future__ import annotations

import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtest.server import ServerProcess
from tests.helpers import BOTTLE_CLIP, CACHE_DIR, MODEL_PT, ultralytics_assets


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    settings: dict[str, object] = {
        "model": str(MODEL_PT),
        "cache_dir": str(CACHE_DIR),
        "max_batch": 4,
        "workers": 1,
        "admission_deadline_ms": 0,
    }
    log_path = tmp_path_factory.mktemp("e2e") / "server.log"
    srv = ServerProcess(settings, log_path=log_path, ready_timeout_s=180)
    srv.start()
    yield srv.base_url
    code = srv.stop(30)
    log = srv.log_text()
    # uvicorn re-raises the caught SIGTERM after its graceful shutdown, hence -15.
    assert code in (0, -signal.SIGTERM), log
    assert "shutdown complete" in log


def test_detect_over_real_http(server: str) -> None:
    data = (ultralytics_assets() / "zidane.jpg").read_bytes()
    with httpx.Client(base_url=server, timeout=60) as client:
        resp = client.post("/detect", files={"image": ("zidane.jpg", data, "image/jpeg")})
        assert resp.status_code == 200, resp.text
        names = sorted(d["class_name"] for d in resp.json()["detections"])
        assert names == ["person", "person", "tie"]
        bad = client.post("/detect", content=b"nope", headers={"content-type": "image/jpeg"})
        assert bad.status_code == 400
        assert client.get("/healthz").status_code == 200


def test_an_idle_connection_outlives_a_clients_pool(server: str) -> None:
    """One connection, two requests 6 s apart: uvicorn's own 5 s keep-alive would have closed
    it as httpx (whose pool keeps connections 5 s) sent the second: a reset now and then."""
    with httpx.Client(base_url=server, timeout=30, limits=httpx.Limits(keepalive_expiry=60)) as c:
        first = c.get("/healthz", extensions={"trace": _note_connection})
        time.sleep(6)
        second = c.get("/healthz", extensions={"trace": _note_connection})
    assert first.status_code == second.status_code == 200
    assert _CONNECTIONS == ["new"], _CONNECTIONS  # the second reused the first's connection


_CONNECTIONS: list[str] = []


def _note_connection(event: str, info: dict[str, object]) -> None:
    if event == "connection.connect_tcp.complete":
        _CONNECTIONS.append("new")


def test_concurrent_clients_all_answered(server: str) -> None:
    import asyncio

    data = (ultralytics_assets() / "bus.jpg").read_bytes()

    async def run() -> list[int]:
        async with httpx.AsyncClient(base_url=server, timeout=120) as client:

            async def one() -> int:
                r = await client.post("/detect", files={"image": ("b.jpg", data, "image/jpeg")})
                return r.status_code

            return list(await asyncio.gather(*(one() for _ in range(8))))

    assert asyncio.run(run()) == [200] * 8


def test_a_sigterm_stops_it_all_within_one_drain_time(tmp_path: Path) -> None:
    """uvicorn's wait for an unfinished call, then the webhooks' last delivery, each took the
    whole --shutdown-timeout-s: 2x the setting (a `docker stop`'s 10 s killed it half way,
    its webhook cursors and last events unsaved). Each part gets what is left of one."""
    with socket.socket() as receiver:  # takes the webhook's calls, never answers
        receiver.bind(("127.0.0.1", 0))
        receiver.listen(16)
        settings: dict[str, object] = {
            "model": str(MODEL_PT),
            "cache_dir": str(CACHE_DIR),
            "data_dir": str(tmp_path / "data"),
            "allowed_file_dir": str(BOTTLE_CLIP.parent),
            "webhooks": [f"http://127.0.0.1:{receiver.getsockname()[1]}/hook"],
            "webhook_timeout_s": 30,
            "shutdown_timeout_s": 4,
        }
        srv = ServerProcess(settings, log_path=tmp_path / "server.log", ready_timeout_s=180)
        srv.start()
        try:
            with httpx.Client(base_url=srv.base_url, timeout=30) as c:
                made = c.post("/streams", json={"url": f"file://{BOTTLE_CLIP}", "id": "b"})
                assert made.status_code == 201, made.text
                assert c.post("/streams/b/events", json={"label": "bell"}).status_code == 201
            with socket.create_connection(("127.0.0.1", srv.port)) as stalled:  # a call unfinished
                stalled.sendall(
                    b"POST /detect HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\n"
                    b"Content-Length: 100000\r\n\r\n" + b"x" * 1000
                )
                time.sleep(1.0)
                started = time.monotonic()
                code = srv.stop(60)
                took = time.monotonic() - started
        finally:
            srv.stop(5)
    assert code in (0, -signal.SIGTERM), srv.log_text()
    assert "shutdown complete" in srv.log_text()
    assert took < 4 + 2.5, (took, srv.log_text()[-3000:])  # 4 s and the parts' floors; was 8+
