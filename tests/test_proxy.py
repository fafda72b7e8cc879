"""``streamdet serve --root-path /streamdet`` behind a real nginx that serves it under that
prefix with README's configuration (``location /streamdet/ { proxy_pass
http://127.0.0.1:PORT/; ... }``, which strips it): the viewer page, ``/docs``, redirects,
``Location``, ``POST /detect``, the settings bodies' limit, KServe v2's error form and a
WebSocket, all through the proxy; what the server pushes out (webhooks, job callbacks, MQTT
events and Home Assistant's device links) as absolute URLs under ``--public-url``, which point
at the proxy and are followed through it; and the viewer and ``/docs`` in headless Chromium
through it (marker ``browser`` too)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import websockets
from playwright.sync_api import Browser, Page, expect, sync_playwright

from benchmarks.events_bench import WebhookReceiver
from loadtest.server import ServerProcess, free_port
from tests.helpers import (
    BOTTLE_CLIP,
    CACHE_DIR,
    CAR_CLIP,
    MODEL_PT,
    REPO,
    clip_server,
    ultralytics_assets,
)
from tests.test_viewer import CHROMIUM, CHROMIUM_ARGS

pytestmark = pytest.mark.proxy

PREFIX = "/streamdet"
NGINX = shutil.which("nginx") or "/usr/sbin/nginx"

# What the test runs around README's configuration (the "Behind a reverse proxy" paragraph's
# nginx block, read from there so the two cannot drift apart): its files under pytest's tmp.
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
    # Bodies and answers in memory: the workers (nobody) cannot write under pytest's tmp.
    client_body_buffer_size 50m;
    proxy_max_temp_file_size 0;
    {http}
    server {{
        listen 127.0.0.1:{port};
        {location}
    }}
    server {{
        listen 127.0.0.1:{strip_port};
        # As Traefik's StripPrefix serves it: the prefix itself is the app's /, no redirect.
        location = /streamdet {{ proxy_pass http://127.0.0.1:{upstream}/; }}
        {location}
    }}
}}
"""
README_UPSTREAM = "http://127.0.0.1:8000/"


def readme_nginx() -> tuple[str, str]:
    """README's nginx example: its ``map`` (for ``http``) and its ``location`` block."""
    text = (REPO / "README.md").read_text()
    paragraph = text.index("**Behind a reverse proxy**")
    found = re.search(r"```nginx\n(.*?)```", text[paragraph:], re.S)
    if found is None:
        raise AssertionError("README: no ```nginx block after 'Behind a reverse proxy'")
    block = found.group(1)
    http = re.search(r"^map .*$", block, re.M)
    location = re.search(r"^location /streamdet/ \{$.*?^\}$", block, re.M | re.S)
    if http is None or location is None or README_UPSTREAM not in location.group(0):
        raise AssertionError(f"README's nginx block lacks a map or a location to {PREFIX}/")
    return http.group(0), location.group(0)


def nginx_conf(run: Path, port: int, upstream: int, strip_port: int) -> str:
    http, location = readme_nginx()
    location = location.replace(README_UPSTREAM, f"http://127.0.0.1:{upstream}/")
    return NGINX_CONF.format(
        run=run, port=port, http=http, location=location, upstream=upstream, strip_port=strip_port
    )


@pytest.fixture(scope="module")
def receiver() -> Iterator[WebhookReceiver]:
    """The server's webhook and its jobs' callback: what it POSTs, no request in scope."""
    got = WebhookReceiver()
    yield got
    got.close()


@pytest.fixture(scope="module")
def nginx_ports() -> tuple[int, int]:
    """The ports of :func:`proxies`, chosen before the server starts: its public URL
    (``--public-url``) is README's proxy's."""
    return free_port(), free_port()


@pytest.fixture(scope="module")
def public_url(nginx_ports: tuple[int, int]) -> str:
    """Where receivers reach the server: README's nginx, under the prefix."""
    return f"http://127.0.0.1:{nginx_ports[0]}{PREFIX}"


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, receiver: WebhookReceiver, public_url: str
) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("proxy")
    srv = ServerProcess(
        {
            "model": str(MODEL_PT),
            "cache_dir": str(CACHE_DIR),
            "workers": 1,
            "max_batch": 2,
            "root_path": PREFIX,
            "public_url": public_url,
            "admission_deadline_ms": 0,
            # A small engine and a looping clip: the browser test's stream, cheap on 2 cores.
            "imgsz": 320,
            "allowed_file_dir": str(CAR_CLIP.parent),
            "webhooks": receiver.url,
            "event_clip_pre_s": 1,
            "event_clip_post_s": 1,
        },
        log_path=tmp / "server.log",
        ready_timeout_s=180,
    )
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def proxies(
    server: ServerProcess,
    tmp_path_factory: pytest.TempPathFactory,
    nginx_ports: tuple[int, int],
) -> Iterator[tuple[str, str]]:
    """nginx in front of ``server`` under :data:`PREFIX`: the base URLs of README's
    configuration and of one that serves the prefix without a slash with no redirect."""
    with nginx(tmp_path_factory.mktemp("nginx"), server.port, *nginx_ports) as bases:
        yield bases


@contextlib.contextmanager
def nginx(run: Path, upstream: int, port: int, strip_port: int) -> Iterator[tuple[str, str]]:
    """nginx (its files in ``run``) in front of the server on port ``upstream``, under
    :data:`PREFIX`, listening on ``port`` (README's configuration) and ``strip_port`` (no
    redirect): their base URLs, once it answers."""
    if not Path(NGINX).exists():
        pytest.fail("nginx not found: apt-get install nginx-light (Debian), or deselect")
    conf = run / "nginx.conf"
    conf.write_text(nginx_conf(run, port, upstream, strip_port))
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
        yield base, f"http://127.0.0.1:{strip_port}"
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="module")
def proxy(proxies: tuple[str, str]) -> str:
    """README's nginx in front of ``server``: its base URL."""
    return proxies[0]


@pytest.fixture(scope="module")
def stripping(proxies: tuple[str, str]) -> str:
    """The proxy that serves :data:`PREFIX` itself as the app's ``/`` (Traefik's
    StripPrefix): its base URL."""
    return proxies[1]


def test_pages_docs_and_redirects_carry_the_prefix(proxy: str) -> None:
    with httpx.Client(base_url=proxy + PREFIX, timeout=30) as c:
        page = c.get("/")
        assert page.status_code == 200
        # The page's own files and calls resolve under the prefix (they were /static/...).
        assert 'href="static/viewer.css"' in page.text and 'src="static/viewer.js"' in page.text
        # Relative to the app's root, wherever the page was opened (see test_the_viewer_
        # without_a_redirect_in_a_browser).
        assert f'<base href="{PREFIX}/">' in page.text
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
        # Its connection is not used again: nginx, having answered before it read the body
        # whole, now and then closed it as the next request came (httpx's "Server
        # disconnected without sending a response" on a 2-core machine under load).
        json_type = {"content-type": "application/json", "connection": "close"}
        big = c.post("/streams", content=b"x" * (2 << 20), headers=json_type)
        assert big.status_code == 413 and "settings body" in big.json()["detail"]
        # An upload route under the prefix keeps its own limit (not the settings' 1 MiB).
        job = c.post("/jobs", content=b"\0" * (1_100_000), headers={"content-type": "video/mp4"})
        assert job.status_code != 413, job.text


def follow(c: httpx.Client, proxy: str, path: str) -> None:
    """``path`` as the API handed it out, followed through the proxy as a client does:
    under the prefix, and found there."""
    assert path.startswith(PREFIX + "/"), path
    got = c.get(proxy + path)
    assert got.status_code == 200, (path, got.status_code, got.text[:200])


def fetch(url: str) -> None:
    """An absolute URL the server pushed out, fetched as its receiver does: found."""
    got = httpx.get(url, timeout=60)
    assert got.status_code == 200, (url, got.status_code, got.text[:200])


def test_paths_the_api_hands_out_work_through_the_proxy(
    proxy: str, receiver: WebhookReceiver, server: ServerProcess, public_url: str
) -> None:
    """Every path in a body (an event's snapshot, thumbnail and clip, over JSON and
    server-sent events; a clip's url; a job's frames, events and video, in its body and its
    list) and the job's ``Location`` carry the prefix and answer 200 through nginx (they
    were app-relative: the proxy's host root answered 404); what the server pushes out (a
    webhook's events, a job's callback) carries them as absolute URLs under
    ``--public-url``, which answer 200 through nginx too (a receiver cannot fetch a path);
    a followed job result says not to buffer it (``X-Accel-Buffering: no``, which it
    lacked)."""
    with httpx.Client(base_url=proxy + PREFIX, timeout=60) as c:
        stream = {"url": CAR_CLIP.as_uri(), "track": True, "zones": [LOT], "clips": True}
        sid = c.post("/streams", json=stream).json()["id"]
        try:
            events: list[dict[str, object]] = []
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline and not any(
                "thumbnail" in e and "clip" in e for e in events
            ):
                page = c.get("/events", params={"stream_id": sid, "wait_s": 5}).json()
                events = page["events"] or events
            entered = next(e for e in events if "thumbnail" in e and "clip" in e)
            for key in ("snapshot", "thumbnail", "clip"):
                follow(c, proxy, str(entered[key]))
            latest = c.get("/events", params={"stream_id": sid, "latest": True}).json()
            pictured = [str(e["snapshot"]) for e in latest["events"] if "snapshot" in e]
            assert pictured and all(path.startswith(PREFIX + "/") for path in pictured)
            with c.stream(
                "GET",
                "/events",
                params={"stream_id": sid, "after": int(str(entered["id"])) - 1},
                headers={"Accept": "text/event-stream"},
            ) as sse:
                for line in sse.iter_lines():
                    if line.startswith("data: "):
                        assert json.loads(line[6:])["snapshot"] == entered["snapshot"]
                        break
            for clip in c.get("/clips", params={"stream_id": sid}).json()["clips"]:
                follow(c, proxy, clip["url"])
            # A webhook's payload: no request, absolute URLs under the public URL.
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not any(
                e["id"] == entered["id"] for e in receiver.events()
            ):
                time.sleep(0.2)
            hooked = next(e for e in receiver.events() if e["id"] == entered["id"])
            assert {k: hooked[k] for k in ("snapshot", "thumbnail", "clip")} == {
                k: public_url + str(entered[k]).removeprefix(PREFIX)
                for k in ("snapshot", "thumbnail", "clip")
            }
            for key in ("snapshot", "thumbnail", "clip"):
                fetch(hooked[key])
        finally:
            c.delete(f"/streams/{sid}")
        job_in = {"url": BOTTLE_CLIP.as_uri(), "fps": 0.5, "render": True}
        created = c.post("/jobs", json={**job_in, "callback_url": receiver.url})
        assert created.status_code == 202, created.text
        job = created.json()
        assert httpx.URL(created.headers["location"]).path == f"{PREFIX}/jobs/{job['id']}"
        follow(c, proxy, created.headers["location"])
        done = c.get(f"/jobs/{job['id']}", params={"wait_s": 60}).json()
        assert done["state"] == "done", done
        for key in ("frames_url", "events_url", "video_url"):
            follow(c, proxy, done[key])
        # A followed result streams, as MJPEG and server-sent events do: nginx is told not
        # to buffer it (the header is nginx's own, so asked of the server itself).
        for key in ("frames_url", "events_url"):
            path = done[key].removeprefix(PREFIX)
            followed = httpx.get(f"{server.base_url}{path}", params={"follow": True}, timeout=30)
            assert followed.status_code == 200, followed.text
            assert followed.headers.get("x-accel-buffering") == "no", followed.headers
        listed = next(j for j in c.get("/jobs").json()["jobs"] if j["id"] == job["id"])
        assert listed["video_url"] == done["video_url"]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (
            called := [
                json.loads(body)["job"]
                for _, _, body in receiver.calls
                if "job" in json.loads(body)
            ]
        ):
            time.sleep(0.2)
        assert called, receiver.calls
        for key in ("frames_url", "events_url", "video_url"):  # the callback's: absolute
            assert called[-1][key] == public_url + done[key].removeprefix(PREFIX), called
            fetch(called[-1][key])
        c.delete(f"/jobs/{job['id']}")


def test_readme_nginx_outwaits_the_long_polls(proxy: str) -> None:
    """nginx's default 60 s between reads cut a 60 s long poll (``GET /events?wait_s=60``
    answered 504 after 60.2 s through this config without it): README's waits longer than
    any route's ``wait_s`` may ask for (read from the OpenAPI document)."""
    document = httpx.get(f"{proxy}{PREFIX}/openapi.json", timeout=30).json()
    waits = [
        param["schema"]["maximum"]
        for route in document["paths"].values()
        for operation in route.values()
        for param in operation.get("parameters", [])
        if param["name"] == "wait_s"
    ]
    assert len(waits) >= 2, waits  # GET /events and GET /jobs/{id}
    _, location = readme_nginx()
    found = re.search(r"proxy_read_timeout (\d+)([smh]?);", location)
    assert found is not None, location
    seconds = int(found.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[found.group(2)]
    assert seconds > max(waits) + 10, (location, waits)


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


@pytest.mark.mqtt
async def test_mqtt_events_carry_the_root_path(tmp_path: Path) -> None:
    """An event's paths published over MQTT carry the prefix (``--root-path``) as
    ``GET /events`` gives them: no request is in scope, it comes from the setting (they were
    app-relative, 404 through the proxy)."""
    from server.mqtt import MqttPublisher
    from streams.events import EventLog, ManualEvent
    from tests.helpers import eventually
    from tests.test_mqtt import Broker, Listener

    broker = Broker(tmp_path / "mosquitto.log")
    broker.start()
    listener = Listener(broker.port)
    try:
        log = EventLog(100)
        publisher = MqttPublisher(
            f"mqtt://127.0.0.1:{broker.port}", "streamdet", log, root_path=PREFIX
        )
        publisher.start()
        media = {"snapshot": "/events/1/snapshot.jpg", "clip": "/clips/1.mp4"}
        log.add("door", "door", time.time(), [ManualEvent("bell", 0)], str, extra=lambda _: media)
        await eventually(lambda: listener.on("streamdet/events"))
        got = json.loads(listener.on("streamdet/events")[0])
        assert {k: got[k] for k in media} == {k: PREFIX + v for k, v in media.items()}
        assert log.read(0, 10).events[0]["snapshot"] == media["snapshot"]  # kept app-relative
        log.finish()
        await publisher.stop(2)
    finally:
        listener.close()
        broker.stop()


@pytest.mark.mqtt
def test_mqtt_events_and_discovery_carry_the_public_url(tmp_path: Path) -> None:
    """A real server with ``--public-url`` (its own nginx, README's configuration) and a
    real Mosquitto: each event published carries its snapshot, thumbnail and clip as
    absolute URLs under the public URL, each answering 200 through nginx (they were paths,
    which Home Assistant or Node-RED cannot fetch), and each Home Assistant device links to
    the viewer (``configuration_url``, which it lacked), which answers too."""
    from tests.test_mqtt import Broker, Listener

    port, strip_port = free_port(), free_port()
    public = f"http://127.0.0.1:{port}{PREFIX}"
    broker = Broker(tmp_path / "mosquitto.log")
    broker.start()
    listener = Listener(broker.port)
    srv = clip_server(
        tmp_path,
        root_path=PREFIX,
        public_url=public + "/",  # the final slash is dropped
        mqtt_url=f"mqtt://127.0.0.1:{broker.port}",
        workers=1,
        imgsz=320,
        event_clip_pre_s=1,
        event_clip_post_s=1,
    )
    try:
        with srv, nginx(tmp_path, srv.port, port, strip_port):
            stream = {"url": CAR_CLIP.as_uri(), "track": True, "zones": [LOT], "clips": True}
            with httpx.Client(base_url=public, timeout=60) as c:
                created = c.post("/streams", json=stream)
                assert created.status_code == 201, created.text
                sid = created.json()["id"]
                deadline = time.monotonic() + 90
                while time.monotonic() < deadline and not (
                    pictured := [
                        e
                        for e in map(json.loads, listener.on("streamdet/events"))
                        if "thumbnail" in e and "clip" in e
                    ]
                ):
                    time.sleep(0.2)
                assert pictured, listener.on("streamdet/events")
                event = pictured[0]
                for key in ("snapshot", "thumbnail", "clip"):
                    assert str(event[key]).startswith(public + "/"), event
                    fetch(str(event[key]))
                # GET /events keeps paths, under the prefix the request came by.
                page = c.get("/events", params={"stream_id": sid, "latest": True}).json()
                served = next(e for e in page["events"] if e["id"] == event["id"])
                assert served["snapshot"] == event["snapshot"].removeprefix(
                    f"http://127.0.0.1:{port}"
                )
                configs = [
                    json.loads(payload)
                    for topic, payload, _ in listener.messages
                    if topic.startswith("homeassistant/") and sid in topic and payload
                ]
                assert configs, listener.messages[-5:]
                assert {config["device"]["configuration_url"] for config in configs} == {
                    public + "/"
                }
                viewer = httpx.get(public + "/", timeout=30)
                assert viewer.status_code == 200 and "streamdet viewer" in viewer.text
                c.delete(f"/streams/{sid}")
    finally:
        listener.close()
        broker.stop()


# ---- the viewer and /docs in a real headless Chromium, through the proxy ------------------

BROWSER_TIMEOUT_MS = 20_000
# Over the picture: each car the stream tracks enters it, an event with a snapshot.
LOT = {"name": "lot", "points": [[0.02, 0.02], [0.98, 0.02], [0.98, 0.98], [0.02, 0.98]]}


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not CHROMIUM.exists():
        pytest.fail(f"Chromium not found at {CHROMIUM}: see tests/test_viewer.py, or deselect")
    with sync_playwright() as pw:
        chromium = pw.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        yield chromium
        chromium.close()


class Traffic:
    """What a page asked for and what went wrong in it: every request and WebSocket URL,
    answers of 400 and over, failed requests, console errors and uncaught exceptions."""

    def __init__(self, page: Page) -> None:
        self.urls: list[str] = []
        self.bad: list[str] = []
        page.on("request", lambda r: self.urls.append(r.url))
        page.on("websocket", lambda ws: self.urls.append(ws.url))
        page.on(
            "response",
            lambda r: self.bad.append(f"{r.status} {r.url}") if r.status >= 400 else None,
        )
        page.on("requestfailed", lambda r: self.bad.append(f"failed {r.url}: {r.failure}"))
        page.on(
            "console",
            lambda m: self.bad.append(f"console: {m.text}") if m.type == "error" else None,
        )
        page.on("pageerror", lambda exc: self.bad.append(f"uncaught: {exc}"))

    def outside(self, base: str) -> list[str]:
        """The URLs not under ``base`` (the proxy's prefix, itself or its folder)."""
        origin = httpx.URL(base)
        return [
            url
            for url in self.urls
            if not url.startswith("data:")
            and not url.startswith("blob:")
            and (
                httpx.URL(url).host != origin.host
                or httpx.URL(url).port != origin.port
                or not (httpx.URL(url).path + "/").startswith(origin.path + "/")
            )
        ]


@pytest.fixture
def page(browser: Browser) -> Iterator[tuple[Page, Traffic]]:
    context = browser.new_context(viewport={"width": 1400, "height": 1100})
    context.set_default_timeout(BROWSER_TIMEOUT_MS)
    pg = context.new_page()
    traffic = Traffic(pg)
    yield pg, traffic
    context.close()


REDOCLY_LOGO = "https://cdn.redoc.ly/redoc/logo-mini.svg"
LOADED_JS = (
    "(id) => { const i = document.getElementById(id); return i.complete && i.naturalWidth > 0; }"
)


@pytest.mark.browser
@pytest.mark.timeout(90)
def test_the_viewer_through_the_proxy_in_a_browser(proxy: str, page: tuple[Page, Traffic]) -> None:
    """The page behind nginx under the prefix, as a user sees it: its script and styles,
    the stream list, a tile's frames and boxes over the WebSocket, events over EventSource
    with their thumbnails and snapshots, MJPEG and latest.jpg pictures; every request it
    made went under the prefix, none failed, nothing on the console."""
    pg, traffic = page
    base = proxy + PREFIX
    with httpx.Client(base_url=base, timeout=30) as c:
        created = c.post(
            "/streams",
            json={"url": CAR_CLIP.as_uri(), "name": "car", "track": True, "zones": [LOT]},
        )
        assert created.status_code == 201, created.text
        sid = created.json()["id"]
    try:
        # Opened as a user types it, without the slash: nginx sends the browser to the
        # prefix's folder, where the page's relative URLs resolve under the prefix.
        pg.goto(base)
        assert pg.url == base + "/"
        expect(pg.locator("#server-status")).to_have_text("connected")
        # The stylesheet applied (a hidden element stays hidden), the module ran.
        assert pg.evaluate("() => document.styleSheets.length") == 1
        row = pg.locator(f'#stream-rows tr[data-id="{sid}"]')
        expect(row.locator(".name")).to_have_text("car")
        expect(row.locator("td.state")).to_have_text("live")
        # Watched: its tile draws frames with boxes, frame and detections on one WebSocket.
        row.locator("input.watch").check()
        tile = f"tile-{sid}"
        pg.wait_for_function(
            "(id) => { const d = window.streamdet.drawn[id];"
            " return d !== undefined && d.shapes.length > 0; }",
            arg=tile,
        )
        # The cars' entries come over the events feed, each with its thumbnail and snapshot.
        entered = pg.locator("#event-list li.zone_enter").first
        expect(entered.locator(".event-text")).to_contain_text("entered lot")
        pg.wait_for_function(
            "() => { const i = document.querySelector('#event-list li.zone_enter img.event-thumb');"
            " return i && i.complete && i.naturalWidth > 0; }"
        )
        entered.locator("button.event-snapshot").click()
        expect(pg.locator("#snapshot-dialog")).to_be_visible()
        pg.wait_for_function(LOADED_JS, arg="snapshot-image")
        pg.locator("#snapshot-dialog button[type=submit]").click()
        # The stream's pictures, as a dashboard embeds them: URLs relative to the page.
        pg.evaluate(
            """(sid) => {
              for (const [id, src] of [["mjpeg", `streams/${sid}/mjpeg?max_fps=2`],
                                       ["latest", `streams/${sid}/latest.jpg`]]) {
                const img = document.createElement("img");
                img.id = id;
                img.src = src;
                document.body.append(img);
              }
            }""",
            sid,
        )
        pg.wait_for_function(LOADED_JS, arg="latest")
        pg.wait_for_function(LOADED_JS, arg="mjpeg")
        pg.evaluate("() => document.getElementById('mjpeg').remove()")
        expect(pg.locator("#errors .error")).to_have_count(0)
        assert any("/events?" in url and "after=" in url for url in traffic.urls), traffic.urls
        assert any(url.startswith("ws://") for url in traffic.urls), traffic.urls
        assert traffic.outside(base) == []
        assert traffic.bad == []
    finally:
        with httpx.Client(base_url=base, timeout=30) as c:
            c.delete(f"/streams/{sid}")


@pytest.mark.browser
@pytest.mark.timeout(90)
def test_the_viewer_without_a_redirect_in_a_browser(
    stripping: str, page: tuple[Page, Traffic]
) -> None:
    """The page where a proxy serves the prefix without its slash and no redirect (Traefik's
    StripPrefix): the browser stays at ``/streamdet``, whose directory is the host's root,
    and the page's relative URLs resolve under the prefix all the same, from its ``<base>``
    (they went to ``/static/viewer.js``, ``/streams``: 404)."""
    pg, traffic = page
    base = stripping + PREFIX
    pg.goto(base)
    assert pg.url == base
    expect(pg.locator("#server-status")).to_have_text("connected")
    assert pg.evaluate("() => document.styleSheets.length") == 1
    expect(pg.locator("#model-name")).not_to_be_empty()
    expect(pg.locator("#errors .error")).to_have_count(0)
    assert any(url.startswith(base + "/static/") for url in traffic.urls), traffic.urls
    assert traffic.outside(base) == []
    assert traffic.bad == []


@pytest.mark.browser
@pytest.mark.timeout(90)
def test_docs_through_the_proxy_in_a_browser(proxy: str, page: tuple[Page, Traffic]) -> None:
    """Swagger UI under the prefix: its own files, the OpenAPI document, and "Try it out"
    of ``GET /healthz`` answered through the proxy; ReDoc beside it. Their files came from a
    CDN (and ReDoc's fonts from Google's): offline, as here, both pages stayed blank."""
    pg, traffic = page
    base = proxy + PREFIX
    pg.goto(base + "/docs")
    operation = pg.locator("#operations-default-healthz_healthz_get")
    expect(operation).to_be_visible()
    operation.locator(".opblock-summary").click()
    operation.get_by_role("button", name="Try it out").click()
    with pg.expect_response(lambda r: r.url.endswith("/healthz")) as answered:
        operation.get_by_role("button", name="Execute").click()
    assert answered.value.url == f"{base}/healthz" and answered.value.status == 200
    # What the page shows: the call it made, under the prefix, and the server's answer.
    expect(operation.locator(".request-url pre")).to_have_text(f"{base}/healthz")
    answer = operation.locator(".live-responses-table tbody tr.response")
    expect(answer.locator(".response-col_status")).to_have_text("200")
    expect(answer.locator(".response-col_description")).to_contain_text('"status"')
    assert any(url == f"{base}/openapi.json" for url in traffic.urls), traffic.urls
    assert traffic.outside(base) == []
    assert traffic.bad == []
    traffic.urls.clear()
    # ReDoc too: its script from the server, the document read, the API's routes listed.
    pg.goto(base + "/redoc")
    expect(pg.get_by_role("heading", name="streamdet (0.1.0)")).to_be_visible()
    expect(pg.get_by_text("/healthz").first).to_be_attached()
    # But for the logo of ReDoc's "API docs by Redocly" link, which its bundle always asks
    # its own CDN for, and leaves out when it does not load.
    assert [url for url in traffic.outside(base) if url != REDOCLY_LOGO] == []
    assert [bad for bad in traffic.bad if REDOCLY_LOGO not in bad and "ERR_NAME" not in bad] == []
