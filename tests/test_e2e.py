"""End to end against a real ``streamdet serve`` process (uvicorn)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.helpers import CACHE_DIR, MODEL_PT, REPO, free_port, ultralytics_assets


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    port = free_port()
    env = {
        **os.environ,
        "STREAMDET_CACHE_DIR": str(CACHE_DIR),
        "STREAMDET_MAX_BATCH": "4",
        "STREAMDET_ADMISSION_DEADLINE_MS": "0",
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "server.cli",
            "serve",
            "--model",
            str(MODEL_PT),
            "--port",
            str(port),
            "--workers",
            "1",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            if proc.stdout:
                proc.stdout.close()
            pytest.fail(f"server exited with {proc.returncode}:\n{out}")
        try:
            if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("server not ready within 180 s")
        time.sleep(0.25)
    yield base
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("server did not shut down within 30 s of SIGTERM")
    log = proc.stdout.read() if proc.stdout else ""
    if proc.stdout:
        proc.stdout.close()
    # uvicorn re-raises the caught SIGTERM after its graceful shutdown, hence -15.
    assert proc.returncode in (0, -signal.SIGTERM), log
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
