"""``streamdet serve --root-path /streamdet`` behind a real nginx that serves it under that
prefix (``location /streamdet/ { proxy_pass http://127.0.0.1:PORT/; }``, which strips it):
the viewer page, ``/docs``, redirects, ``Location``, ``POST /detect``, the settings bodies'
limit, KServe v2's error form and a WebSocket, all through the proxy."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import websockets

from loadtest.server import ServerProcess, free_port
from tests.helpers import CACHE_DIR, MODEL_PT, ultralytics_assets

pytestmark = pytest.mark.proxy

PREFIX = "/streamdet"
NGINX = shutil.which("nginx") or "/usr/sbin/nginx"

NGINX_CONF = """
daemon off;
pid {run}/nginx.pid;
error_log {run}/error.log info;
events {{ worker_connections 64; }}
http {{
    access_log {run}/access.log;
    client_body_temp_path {run}/body;
    proxy_temp_path {run}/proxy;
    fastcgi_temp_path {run}/fastcgi;
    uwsgi_temp_path {run}/uwsgi;
    scgi_temp_path {run}/scgi;
    client_max_body_size 50m;
    # Bodies and answers in memory: the workers (nobody) cannot write under pytest's tmp.
    client_body_buffer_size 50m;
    proxy_max_temp_file_size 0;
    server {{
        listen 127.0.0.1:{port};
        location /streamdet/ {{
            proxy_pass http://127.0.0.1:{upstream}/;
            proxy_http_version 1.1;
            proxy_set_header Host $http_host;
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            proxy_set_header X-Forwarded-Proto $scheme;
            proxy_set_header Upgrade $http_upgrade;
            proxy_set_header Connection $connection_upgrade;
        }}
    }}
    map $http_upgrade $connection_upgrade {{ default upgrade; '' close; }}
}}
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("proxy")
    srv = ServerProcess(
        {
            "model": str(MODEL_PT),
            "cache_dir": str(CACHE_DIR),
            "workers": 1,
            "max_batch": 2,
            "root_path": PREFIX,
            "admission_deadline_ms": 0,
        },
        log_path=tmp / "server.log",
        ready_timeout_s=180,
    )
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def proxy(server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """nginx in front of ``server`` under :data:`PREFIX`; its base URL."""
    if not Path(NGINX).exists():
        pytest.fail("nginx not found: apt-get install nginx-light (Debian), or deselect")
    run = tmp_path_factory.mktemp("nginx")
    port = free_port()
    conf = run / "nginx.conf"
    conf.write_text(NGINX_CONF.format(run=run, port=port, upstream=server.port))
    proc = subprocess.Popen([NGINX, "-c", str(conf), "-p", str(run)], stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                httpx.get(f"{base}{PREFIX}/healthz", timeout=1).raise_for_status()
                break
            except httpx.HTTPError:
                if proc.poll() is not None:
                    pytest.fail(f"nginx exited: see {run / 'error.log'}")
                asyncio.run(asyncio.sleep(0.1))
        yield base
    finally:
        proc.terminate()
        proc.wait(10)


def test_pages_docs_and_redirects_carry_the_prefix(proxy: str) -> None:
    with httpx.Client(base_url=proxy + PREFIX, timeout=30) as c:
        page = c.get("/")
        assert page.status_code == 200
        # The page's own files and calls resolve under the prefix (they were /static/...).
        assert 'href="static/viewer.css"' in page.text and 'src="static/viewer.js"' in page.text
        assert "const BASE" in c.get("/static/viewer.js").text
        docs = c.get("/docs")
        assert docs.status_code == 200 and f"'{PREFIX}/openapi.json'" in docs.text
        document = c.get("/openapi.json").json()
        assert document["servers"] == [{"url": PREFIX}]
        moved = c.get("/docs/")
        assert moved.status_code == 307
        assert httpx.URL(moved.headers["location"]).path == f"{PREFIX}/docs"


def test_detect_kserve_and_settings_limits_through_the_proxy(proxy: str) -> None:
    bus = (ultralytics_assets() / "bus.jpg").read_bytes()
    with httpx.Client(base_url=proxy + PREFIX, timeout=60) as c:
        found = c.post("/detect", content=bus, headers={"content-type": "image/jpeg"})
        assert found.status_code == 200 and found.json()["detections"]
        # Under the prefix KServe's errors keep their form ({"error"}, which tritonclient
        # reads; it was FastAPI's {"detail"}), and its ready answers.
        assert c.get("/v2/models/other").json() == {
            "error": "unknown model 'other'; this server serves 'yolov8n'"
        }
        assert c.get("/v2/models/yolov8n/ready").status_code == 200
        # The settings bodies' limit holds under the prefix, and the upload routes keep
        # their own (it matched the prefixed path: /streamdet/jobs was a settings route).
        json_type = {"content-type": "application/json"}
        big = c.post("/streams", content=b"x" * (2 << 20), headers=json_type)
        assert big.status_code == 413 and "settings body" in big.json()["detail"]
        # An upload route under the prefix keeps its own limit (not the settings' 1 MiB).
        job = c.post("/jobs", content=b"\0" * (1_100_000), headers={"content-type": "video/mp4"})
        assert job.status_code != 413, job.text


def test_a_websocket_through_the_proxy(proxy: str) -> None:
    url = proxy.replace("http://", "ws://") + f"{PREFIX}/ws/streams/nope"

    async def watch() -> tuple[int | None, str | None]:
        async with websockets.connect(url) as ws:
            with contextlib.suppress(websockets.ConnectionClosed):
                await asyncio.wait_for(ws.recv(), 30)
            return ws.close_code, ws.close_reason

    code, reason = asyncio.run(watch())
    assert code is not None and code != 1006, (code, reason)
    assert reason is not None and "nope" in reason, json.dumps([code, reason])
