"""End to end against a real ``streamdet serve`` process (uvicorn)."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import httpx
import pytest

from loadtest.server import ServerProcess
from tests.helpers import CACHE_DIR, MODEL_PT, ultralytics_assets


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
