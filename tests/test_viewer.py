"""The viewer page at ``GET /``, driven in Debian's headless Chromium by Playwright against a
real ``streamdet serve`` process (uvicorn). Screenshots go to ``tests/artifacts/``."""

from __future__ import annotations

import base64
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import (
    Browser,
    BrowserContext,
    FilePayload,
    Page,
    Playwright,
    Route,
    expect,
    sync_playwright,
)

from benchmarks.make_clip import make_clip
from loadtest.server import ServerProcess, free_port
from tests.helpers import BOTTLE_CLIP, CACHE_DIR, MODEL_PT, REPO, VIDEOS, ultralytics_assets
from tests.rtsp_camera import CAR, RtspCamera

pytestmark = pytest.mark.browser

ARTIFACTS = REPO / "tests" / "artifacts"
CHROMIUM = Path(os.environ.get("STREAMDET_CHROMIUM", "/usr/bin/chromium"))
# Playwright's own browser download cannot work offline; these flags keep Debian's Chromium
# from reaching the network or a GPU.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
START_TIMEOUT_S = 180.0
UI_TIMEOUT_MS = 60_000

# Counts, per drawn shape, the sampled points along its four edges whose canvas pixel is
# the shape's colour (``own``) or that of any drawn shape (``any``: where boxes overlap the
# later one wins), within 4 levels per channel (two antialiased fills of one colour can round
# differently). Runs in one task, so the canvas cannot change while it reads.
EDGE_PIXELS_JS = """
(canvasId) => {
  const canvas = document.getElementById(canvasId);
  const record = window.streamdet.drawn[canvasId];
  const ctx = canvas.getContext("2d");
  const { data, width, height } = ctx.getImageData(0, 0, canvas.width, canvas.height);
  const rgb = (hex) => [1, 3, 5].map((i) => parseInt(hex.slice(i, i + 2), 16));
  const near = (a, b) => a.every((v, i) => Math.abs(v - b[i]) <= 4);
  const drawnColors = record.shapes.map((s) => rgb(s.color));
  // A box that a later one nearly coincides with (class-aware NMS keeps a car and a truck on
  // one vehicle) is painted over, its edges blended with the later strokes: not checked.
  const coincide = (a, b) =>
    ["x1", "y1", "x2", "y2"].every((k) => Math.abs(a[k] - b[k]) <= 2 * a.lineWidth);
  const hits = record.shapes.map((s, index) => {
    const covered = record.shapes.slice(index + 1).some((later) => coincide(s, later));
    const want = rgb(s.color);
    const points = [];
    for (let k = 1; k < 10; k++) {
      const t = k / 10;
      const x = s.x1 + (s.x2 - s.x1) * t;
      const y = s.y1 + (s.y2 - s.y1) * t;
      points.push([x, s.y1], [x, s.y2], [s.x1, y], [s.x2, y]);
    }
    let own = 0, any = 0, total = 0;
    for (const [x, y] of points) {
      const px = Math.min(width - 1, Math.max(0, Math.floor(x)));
      const py = Math.min(height - 1, Math.max(0, Math.floor(y)));
      const i = (py * width + px) * 4;
      const got = [data[i], data[i + 1], data[i + 2]];
      total += 1;
      if (near(got, want)) own += 1;
      if (drawnColors.some((c) => near(got, c))) any += 1;
    }
    return { label: s.label, own, any, total, covered };
  });
  return { hits, drawn: JSON.stringify(record), png: canvas.toDataURL("image/png") };
}
"""


def viewer_server(log_path: Path, **settings: object) -> ServerProcess:
    """A started ``streamdet serve`` process (restartable on its port) with ``settings`` on
    top of the viewer tests' own."""
    base: dict[str, object] = {
        "model": str(MODEL_PT),
        "cache_dir": str(CACHE_DIR),
        "max_batch": 4,
        "workers": 1,
    }
    srv = ServerProcess({**base, **settings}, log_path=log_path, ready_timeout_s=START_TIMEOUT_S)
    srv.start()
    return srv


@pytest.fixture(scope="module")
def artifacts() -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS


@pytest.fixture(scope="module")
def server(artifacts: Path) -> Iterator[ServerProcess]:
    if not MODEL_PT.exists():
        pytest.fail(f"shared model missing: {MODEL_PT} (set STREAMDET_SHARED_DIR)")
    srv = viewer_server(artifacts / "viewer-server.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def playwright() -> Iterator[Playwright]:
    with sync_playwright() as pw:
        yield pw


@pytest.fixture(scope="module")
def browser(playwright: Playwright) -> Iterator[Browser]:
    if not CHROMIUM.exists():
        pytest.fail(
            f"Chromium not found at {CHROMIUM}: run scripts/system-deps.sh (Debian package"
            " chromium), point STREAMDET_CHROMIUM at another binary, or deselect with"
            " -m 'not browser'"
        )
    browser = playwright.chromium.launch(
        executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
    )
    yield browser
    browser.close()


class PageErrors:
    """Uncaught exceptions in the page's script; a test ends with none."""

    def __init__(self, page: Page) -> None:
        self.errors: list[str] = []
        page.on("pageerror", lambda exc: self.errors.append(str(exc)))


@pytest.fixture
def page(browser: Browser) -> Iterator[tuple[Page, PageErrors]]:
    context = browser.new_context(viewport={"width": 1400, "height": 1100})
    context.set_default_timeout(UI_TIMEOUT_MS)
    page = context.new_page()
    errors = PageErrors(page)
    yield page, errors
    context.close()


def assert_boxes_on_canvas(page: Page, canvas_id: str) -> None:
    """The boxes are really painted: along every drawn box's edges the pixels carry a drawn
    box's colour (a later box's edge or label may cross it), and the last box drawn, which
    nothing covers, has its own."""
    result: dict[str, Any] = page.evaluate(EDGE_PIXELS_JS, canvas_id)
    hits: list[dict[str, Any]] = result["hits"]
    assert hits, f"nothing drawn on #{canvas_id}"
    painted = all(hit["any"] >= 0.9 * hit["total"] for hit in hits if not hit["covered"])
    if not painted or hits[-1]["own"] < 0.75 * hits[-1]["total"]:
        # Keep the canvas as it was checked, and what the page says it drew, to look at.
        shot = ARTIFACTS / f"failed-{canvas_id}.png"
        shot.write_bytes(base64.b64decode(result["png"].partition(",")[2]))
        pytest.fail(f"boxes not painted on #{canvas_id} (see {shot}): {hits}\n{result['drawn']}")


def test_page_and_assets_are_served_locally(server: ServerProcess) -> None:
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        index = client.get("/")
        assert index.status_code == 200
        assert index.headers["content-type"].startswith("text/html")
        for asset, ctype in (("/static/viewer.js", "javascript"), ("/static/viewer.css", "css")):
            resp = client.get(asset)
            assert resp.status_code == 200, asset
            assert ctype in resp.headers["content-type"], asset
            # No CDN: the page works without internet.
            assert "https://" not in resp.text, asset
        assert "https://" not in index.text


def test_playground_draws_boxes_for_bus(
    server: ServerProcess, page: tuple[Page, PageErrors], artifacts: Path
) -> None:
    pg, errors = page
    bus = ultralytics_assets() / "bus.jpg"
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        expected = client.post(
            "/detect", files={"image": ("bus.jpg", bus.read_bytes(), "image/jpeg")}
        ).json()["detections"]
    pg.goto(server.base_url + "/")
    expect(pg.locator("#server-status")).to_have_text("connected")
    # From the keyboard: the drop zone, reached with Tab, opens the picker with Enter or Space
    # (its input is hidden: the playground was mouse-only). The picker's click is counted
    # and held back: a file chooser needs a window with focus, which headless runs lack.
    pg.evaluate(
        "() => { window.pickerClicks = 0; document.getElementById('pick').addEventListener("
        "'click', (e) => { window.pickerClicks += 1; e.preventDefault(); }); }"
    )
    zone = pg.locator("#drop-zone")
    zone.press("Enter")
    zone.press(" ")
    pg.wait_for_function("() => window.pickerClicks === 2")
    pg.set_input_files("#pick", bus)
    wait_for_playground(pg)
    expect(pg.locator("#pg-list li")).to_have_count(len(expected))
    drawn = pg.evaluate("() => window.streamdet.drawn['pg-canvas'].shapes")
    assert sorted(s["label"].split()[0] for s in drawn) == sorted(d["class_name"] for d in expected)
    assert {"bus", "person"} <= {d["class_name"] for d in expected}
    size = pg.evaluate(
        "() => [document.getElementById('pg-canvas').width,"
        " document.getElementById('pg-canvas').height]"
    )
    assert size == [810, 1080]
    expect(pg.locator("#pg-summary")).to_contain_text(f"{len(expected)} detection(s)")
    pg.screenshot(path=artifacts / "viewer-playground.png", full_page=True)
    pg.locator("#pg-canvas").screenshot(path=artifacts / "viewer-playground-canvas.png")
    assert_boxes_on_canvas(pg, "pg-canvas")
    assert errors.errors == []


def test_playground_shows_server_errors(
    server: ServerProcess, page: tuple[Page, PageErrors], artifacts: Path
) -> None:
    pg, errors = page
    pg.goto(server.base_url + "/")
    pg.fill("#pg-conf", "2")  # the server accepts 0..1
    pg.set_input_files("#pick", ultralytics_assets() / "zidane.jpg")
    alert = pg.locator('#errors [data-key="playground"]')
    expect(alert).to_contain_text("Detection failed for zidane.jpg: 422")
    expect(alert).to_contain_text("conf")
    not_an_image: FilePayload = {
        "name": "notes.txt",
        "mimeType": "text/plain",
        "buffer": b"not an image",
    }
    pg.set_input_files("#pick", files=not_an_image)
    expect(alert).to_contain_text("notes.txt is not an image")
    pg.screenshot(path=artifacts / "viewer-playground-error.png", full_page=True)
    assert errors.errors == []


def test_event_filters_changed_quickly_keep_one_event_connection(
    server: ServerProcess, page: tuple[Page, PageErrors]
) -> None:
    """Filters changed while the last change's first page loads (arrow keys through the type
    list): one event connection stays open, and the page keeps answering. Each change opened
    one that was never closed: events shown twice, and after ~6 every request of the page
    waited for a connection Chromium would not open."""
    pg, errors = page
    opened: list[str] = []
    finished: list[str] = []

    def live(url: str) -> bool:
        return "/events?" in url and "after=" in url

    pg.on("request", lambda r: opened.append(r.url) if live(r.url) else None)
    pg.on("requestfinished", lambda r: finished.append(r.url) if live(r.url) else None)
    pg.on("requestfailed", lambda r: finished.append(r.url) if live(r.url) else None)
    pg.goto(server.base_url + "/")
    expect(pg.locator("#server-status")).to_have_attribute("data-up", "true")
    pg.evaluate(
        """() => {
          const select = document.querySelector('#event-filter select[name=type]');
          for (let i = 0; i < 8; i++) {
            select.value = i % 2 ? '' : 'line_crossing';
            select.dispatchEvent(new Event('change', {bubbles: true}));
          }
        }"""
    )
    # One left open once the page is done: the count steady for a second (aborted ones are
    # told late under load).
    deadline, steady = time.monotonic() + 60, 0
    while steady < 10:
        before = (len(opened), len(finished))
        pg.wait_for_timeout(100)
        one_open = len(opened) - len(finished) == 1 and before == (len(opened), len(finished))
        steady = steady + 1 if one_open else 0
        if time.monotonic() > deadline:
            break
    assert len(opened) - len(finished) == 1, (opened, finished)
    answered = pg.evaluate(
        """() => Promise.race([fetch('/healthz').then((r) => r.status),
          new Promise((done) => setTimeout(() => done('pending'), 5000))])"""
    )
    assert answered == 200
    assert errors.errors == []


# ---- live streams: a real RTSP camera, the stream list, tiles, errors, reconnects ----------


@pytest.fixture(scope="module")
def camera() -> Iterator[RtspCamera]:
    if CAR is None:
        pytest.fail(f"shared clip car-detection.mp4 missing: {VIDEOS} (set STREAMDET_SHARED_DIR)")
    cam = RtspCamera({"car": CAR}).start()
    yield cam
    cam.stop()


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of short clips of the bottle clip (its three bottles detected from the first
    frame), for ``file://`` streams: ``bottles-3s.mp4`` (75 frames at 25 fps) to loop,
    ``bottles-8s.mp4`` (200) to play once while a test watches it."""
    if not BOTTLE_CLIP.exists():
        pytest.fail(
            f"shared clip bottle-detection.mp4 missing: {VIDEOS} (set STREAMDET_SHARED_DIR)"
        )
    folder = tmp_path_factory.mktemp("viewer-clips")
    for name, frames in (("bottles-3s.mp4", 75), ("bottles-8s.mp4", 200)):
        make_clip(BOTTLE_CLIP, folder / name, width=640, height=360, fps=25, gop=25, frames=frames)
    return folder


@pytest.fixture(scope="module")
def live_server(
    artifacts: Path, clips: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    srv = viewer_server(
        artifacts / "viewer-live-server.log",
        data_dir=str(tmp_path_factory.mktemp("viewer-data")),
        allowed_file_dir=str(clips),
        # Quick to notice a dead camera and to come back, so the test stays short.
        stream_open_timeout_s=3,
        stream_read_timeout_s=2,
        reconnect_max_s=1,
        shutdown_timeout_s=5,
        event_clip_pre_s=1,
        event_clip_post_s=1,
    )
    yield srv
    srv.stop()


def add_stream_in_page(pg: Page, url: str, name: str, **fields: str | bool) -> str:
    """Adds a stream with the page's form (optional ``fields`` such as ``classes``, or
    ``track=True`` to tick a box); returns its id from the row that appears."""
    for field, value in {"url": url, "name": name, **fields}.items():
        box = pg.locator(f'#add-stream input[name="{field}"]')
        if isinstance(value, bool):
            box.set_checked(value)
        else:
            box.fill(value)
    pg.click('#add-stream button[type="submit"]')
    row = pg.locator("#stream-rows tr", has=pg.locator(".name", has_text=name))
    expect(row).to_have_count(1)
    stream_id = row.get_attribute("data-id")
    assert stream_id
    return stream_id


def wait_for_playground(pg: Page) -> None:
    """Waits until the /detect playground drew its picture; fails with the page's error where
    it showed one instead (a CI run timed out here once, saying nothing of why)."""
    pg.wait_for_function(
        "() => window.streamdet.drawn['pg-canvas'] !== undefined"
        " || document.querySelector('#errors [data-key=\"playground\"]') !== null"
    )
    error = pg.locator('#errors [data-key="playground"]')
    assert error.count() == 0, error.first.text_content()


def wait_for_boxes(pg: Page, canvas_id: str, after_frame: int = -1) -> int:
    """Waits until the tile drew a frame newer than ``after_frame`` with at least one box;
    returns that frame's number."""
    pg.wait_for_function(
        "([id, after]) => { const d = window.streamdet.drawn[id];"
        " return d !== undefined && d.frame > after && d.shapes.length > 0; }",
        arg=[canvas_id, after_frame],
    )
    frame: int = pg.evaluate("(id) => window.streamdet.drawn[id].frame", canvas_id)
    return frame


@pytest.fixture
def live_page(live_server: ServerProcess, page: tuple[Page, PageErrors]) -> tuple[Page, PageErrors]:
    """The viewer of ``live_server``, open and connected."""
    pg, _ = page
    pg.goto(live_server.base_url + "/")
    expect(pg.locator("#server-status")).to_have_text("connected")
    return page


@pytest.mark.rtsp
def test_live_stream_boxes_errors_grid_and_reconnect(
    live_server: ServerProcess,
    camera: RtspCamera,
    live_page: tuple[Page, PageErrors],
    artifacts: Path,
) -> None:
    pg, errors = live_page

    # A real camera: listed, live, and its frames drawn with their boxes.
    car = add_stream_in_page(pg, camera.url("car"), "car")
    car_row = pg.locator(f'#stream-rows tr[data-id="{car}"]')
    expect(car_row.locator("td.state")).to_have_text("live")
    tile = f"tile-{car}"
    first = wait_for_boxes(pg, tile)
    later = wait_for_boxes(pg, tile, first)
    assert later > first
    # 768x432 scaled to the page's max width of 640, boxes scaled with it.
    assert pg.evaluate(
        f"() => [document.getElementById('{tile}').width, document.getElementById('{tile}').height]"
    ) == [640, 360]
    assert_boxes_on_canvas(pg, tile)
    labels = pg.evaluate(f"() => window.streamdet.drawn['{tile}'].shapes.map(s => s.label)")
    # Class name and confidence on each box (yolov8n names this top-down car many things).
    assert all(re.fullmatch(r"[a-z ]+ [01]\.\d\d", label) for label in labels), labels
    expect(car_row.locator("td.fps")).not_to_have_text("–")
    pg.locator(f'figure[data-stream-id="{car}"]').screenshot(
        path=artifacts / "viewer-live-tile.png"
    )

    expect(car_row.locator(".objects")).to_have_text("all ≥ 0.25")

    # Disabled from the list (its camera closed, a privacy switch), then enabled again: it
    # comes back live and its tile draws boxes again.
    car_row.locator("button.toggle", has_text="Disable").click()
    expect(car_row.locator("td.state")).to_have_text("disabled")
    expect(car_row.locator("button.toggle")).to_have_text("Enable")
    expect(pg.locator("#event-list li.stream_state .event-text").first).to_contain_text(
        "was disabled"
    )
    # No frames come: the tile shows no rate (it showed the last one for the whole outage).
    tile_fps = pg.locator(f'figure[data-stream-id="{car}"] .tile-fps')
    expect(tile_fps).to_have_text("")
    drawn_before = pg.evaluate(f"() => window.streamdet.drawn['{tile}'].frame")
    car_row.locator("button.toggle").click()
    expect(car_row.locator("td.state")).to_have_text("live")
    expect(car_row.locator("button.toggle")).to_have_text("Disable")
    wait_for_boxes(pg, tile, after_frame=drawn_before)
    expect(tile_fps).to_contain_text("fps shown")

    # A class the model lacks: the server's 422 is shown, nothing is added.
    dead_url = f"rtsp://127.0.0.1:{free_port()}/nothing"
    pg.fill('#add-stream input[name="url"]', dead_url)
    pg.fill('#add-stream input[name="classes"]', "car,unicorn")
    pg.click('#add-stream button[type="submit"]')
    expect(pg.locator('#errors [data-key="add"]')).to_contain_text("unknown class name 'unicorn'")
    expect(pg.locator("#stream-rows tr")).to_have_count(1)

    # A broken camera: accepted, shown with its error in the list and the page; its own
    # classes and confidence, from the form, in the list.
    broken = add_stream_in_page(pg, dead_url, "broken", classes="truck, Car", conf="0.4")
    expect(pg.locator('#errors [data-key="add"]')).to_have_count(0)
    expect(pg.locator(f'#stream-rows tr[data-id="{broken}"] .objects')).to_have_text(
        "car, truck ≥ 0.40"
    )
    broken_error = pg.locator(f'#errors [data-key="stream:{broken}"]')
    expect(broken_error).to_contain_text("Stream broken: reconnecting")
    expect(pg.locator(f'#stream-rows tr[data-id="{broken}"]')).to_have_attribute(
        "data-error", re.compile("reconnecting: .+")
    )
    # Grid: both watched, side by side.
    expect(pg.locator("#grid figure")).to_have_count(2)
    expect(pg.locator(f'figure[data-stream-id="{broken}"] .tile-error')).to_be_visible()
    pg.screenshot(path=artifacts / "viewer-live-grid.png", full_page=True)

    # Remove: gone from the list, the grid and the error list.
    pg.locator(f'#stream-rows tr[data-id="{broken}"] button.remove').click()
    expect(pg.locator(f'#stream-rows tr[data-id="{broken}"]')).to_have_count(0)
    expect(pg.locator("#grid figure")).to_have_count(1)
    expect(broken_error).to_have_count(0)

    # Server gone: said on the page; back: the WebSocket reconnects and boxes flow again
    # (the stream list survives the restart, so the stream keeps its id).
    live_server.stop()
    expect(pg.locator('#errors [data-key="server"]')).to_contain_text("Server unreachable")
    expect(pg.locator(f'figure[data-stream-id="{car}"] .tile-error')).to_contain_text(
        "connection lost"
    )
    pg.screenshot(path=artifacts / "viewer-server-gone.png", full_page=True)
    pg.evaluate(f"() => {{ delete window.streamdet.drawn['{tile}']; }}")
    live_server.start()
    expect(pg.locator("#server-status")).to_have_text("connected")
    wait_for_boxes(pg, tile)
    expect(pg.locator('#errors [data-key="server"]')).to_have_count(0)
    expect(pg.locator(f'figure[data-stream-id="{car}"] .tile-error')).to_be_hidden()
    pg.screenshot(path=artifacts / "viewer-reconnected.png", full_page=True)
    assert errors.errors == []


# Which drawn detections stand (bottom centre of the box) in the left half of the frame, and
# how many pixels along the region's right edge (x = LEFT_HALF_X) are painted magenta.
REGION_JS = """
([canvasId, edgeX]) => {
  const record = window.streamdet.drawn[canvasId];
  const [w] = record.size;
  const anchorsLeft = record.detections.map((d) => (d.box[0] + d.box[2]) / 2 / w <= edgeX);
  const canvas = document.getElementById(canvasId);
  const ctx = canvas.getContext("2d");
  const { data, width, height } = ctx.getImageData(0, 0, canvas.width, canvas.height);
  // The edge is antialiased across two or three columns: any of them may carry the colour.
  const x0 = Math.floor(edgeX * width);
  const magentaAt = (x, y) => {
    const i = (y * width + Math.min(width - 1, Math.max(0, x))) * 4;
    return data[i] > 180 && data[i + 1] < 100 && data[i + 2] > 180;
  };
  let magenta = 0, total = 0;
  for (let k = 1; k < 40; k++) {
    const y = Math.floor((0.05 + 0.9 * k / 40) * height);
    total += 1;
    if ([-2, -1, 0, 1, 2].some((dx) => magentaAt(x0 + dx, y))) magenta += 1;
  }
  return { frame: record.frame, anchorsLeft, magenta, total, region: record.region };
}
"""
LEFT_HALF_X = 0.5
LEFT_HALF = [(0.02, 0.02), (LEFT_HALF_X, 0.02), (LEFT_HALF_X, 0.98), (0.02, 0.98)]


def region_state(pg: Page, canvas_id: str) -> dict[str, Any]:
    state: dict[str, Any] = pg.evaluate(REGION_JS, [canvas_id, LEFT_HALF_X])
    return state


@pytest.mark.rtsp
def test_region_is_drawn_on_a_tile_saved_and_filters_the_stream(
    camera: RtspCamera, live_page: tuple[Page, PageErrors], artifacts: Path
) -> None:
    pg, errors = live_page
    api = httpx.Client(base_url=pg.url, timeout=30)  # the viewer's own server
    stream_id = add_stream_in_page(
        pg, camera.url("car"), "car-region", track=True, clips=True, motion=True
    )
    canvas_id = f"tile-{stream_id}"
    figure = pg.locator(f'figure[data-stream-id="{stream_id}"]')
    frame = wait_for_boxes(pg, canvas_id)
    # Without a region, cars are drawn in both halves of the frame (the clip's traffic runs
    # through both), so the filter below has something to drop.
    seen_right = False
    while not seen_right:
        frame = wait_for_boxes(pg, canvas_id, frame)
        seen_right = not all(region_state(pg, canvas_id)["anchorsLeft"])
    assert region_state(pg, canvas_id)["region"] is None
    # Tracked: each box's label carries its object's id, and the list counts objects.
    labels = pg.evaluate(f"() => window.streamdet.drawn['{canvas_id}'].shapes.map(s => s.label)")
    assert all(re.fullmatch(r"[a-z ]+ #\d+ [01]\.\d\d", label) for label in labels), labels
    row = pg.locator(f'#stream-rows tr[data-id="{stream_id}"] .objects')
    expect(row).to_have_text(re.compile(r"all ≥ 0\.25 · tracked: \d+ [a-z ]+"))

    figure.locator("button.tile-region").click()
    expect(figure.locator(".tile-edit-bar")).to_be_visible()
    canvas = figure.locator("canvas")
    size = canvas.bounding_box()
    assert size is not None

    def click(x: float, y: float) -> None:
        canvas.click(position={"x": x * size["width"], "y": y * size["height"]})

    # Two points are not a region: said in the tile, nothing saved.
    click(*LEFT_HALF[0])
    click(*LEFT_HALF[1])
    figure.locator("button.edit-save").click()
    expect(figure.locator(".edit-hint")).to_contain_text("at least 3 points")
    # Undo drops the last point; the left half of the frame, drawn while being edited.
    figure.locator("button.edit-undo").click()
    for x, y in LEFT_HALF[1:]:
        click(x, y)
    expect(figure.locator(".edit-hint")).to_contain_text("4 points")
    assert pg.evaluate(f"() => window.streamdet.drawn['{canvas_id}'].editing") == "region"
    figure.screenshot(path=artifacts / "viewer-region-editing.png")
    figure.locator("button.edit-save").click()
    expect(figure.locator(".tile-edit-bar")).to_be_hidden()

    # Saved on the server, within a pixel of where the clicks landed.
    roi = api.get(f"/streams/{stream_id}").json()["detect"]["roi"]
    assert len(roi) == len(LEFT_HALF)
    for got, want in zip(roi, LEFT_HALF, strict=True):
        assert got == pytest.approx(want, abs=2 / size["width"])

    # In frames captured from then on (earlier ones may still be in the engine with the old
    # settings), only cars standing in the left half are sent and drawn, and the region's
    # dashed magenta outline is painted under the boxes.
    saved_at = time.time()
    pg.wait_for_function(
        "([id, t]) => window.streamdet.drawn[id].capturedAt > t", arg=[canvas_id, saved_at]
    )
    frame = pg.evaluate(f"() => window.streamdet.drawn['{canvas_id}'].frame") - 1
    for _ in range(5):
        frame = wait_for_boxes(pg, canvas_id, frame)
        state = region_state(pg, canvas_id)
        assert state["region"] == roi
        assert all(state["anchorsLeft"]), state
        assert state["magenta"] >= state["total"] // 4, state
    figure.screenshot(path=artifacts / "viewer-region-saved.png")
    expect(row).to_contain_text("· region · tracked")

    # "Whole frame" removes it.
    figure.locator("button.tile-region").click()
    figure.locator("button.edit-clear").click()
    expect(figure.locator(".tile-edit-bar")).to_be_hidden()
    assert api.get(f"/streams/{stream_id}").json()["detect"]["roi"] is None
    pg.wait_for_function("(id) => window.streamdet.drawn[id].region === null", arg=canvas_id)

    # A counting line across the middle, drawn on the picture and named: saved on the server
    # (tracking stays on), drawn in cyan with its counts, listed with them.
    figure.locator("button.tile-line").click()
    expect(figure.locator("input.shape-name")).to_be_visible()
    click(0.02, 0.5)
    click(0.98, 0.5)
    click(0.5, 0.9)  # a third point is refused
    expect(figure.locator(".edit-hint")).to_contain_text("two points")
    figure.locator("input.shape-name").fill("gate")
    expect(figure.locator("input.shape-loiter")).to_be_hidden()  # zones only
    figure.locator("input.shape-classes").fill("car, truck")  # it counts vehicles only
    figure.screenshot(path=artifacts / "viewer-line-editing.png")
    figure.locator("button.edit-save").click()
    expect(figure.locator(".tile-edit-bar")).to_be_hidden()
    detect = api.get(f"/streams/{stream_id}").json()["detect"]
    api.close()
    assert detect["track"] is True
    assert detect["clips"] is True and detect["motion"] is True  # the form's boxes
    [gate] = detect["lines"]
    assert gate["name"] == "gate" and gate["classes"] == ["car", "truck"]
    for got, want in zip(gate["points"], [(0.02, 0.5), (0.98, 0.5)], strict=True):
        assert got == pytest.approx(want, abs=2 / size["width"])
    pg.wait_for_function("(id) => window.streamdet.drawn[id].lines.length === 1", arg=canvas_id)
    expect(row).to_contain_text(re.compile(r"gate \d+ in / \d+ out"))
    cyan = pg.evaluate(
        """(id) => {
          const canvas = document.getElementById(id);
          const y = Math.round(canvas.height / 2);
          const { data } = canvas.getContext("2d").getImageData(0, y - 1, canvas.width, 3);
          let n = 0;
          for (let i = 0; i < data.length; i += 4) {
            if (data[i] < 80 && data[i + 1] > 200 && data[i + 2] > 200) n += 1;
          }
          return n / (data.length / 4);
        }""",
        canvas_id,
    )
    assert cyan > 0.2, cyan  # a 2-3 px line across most of the picture, under some boxes
    figure.screenshot(path=artifacts / "viewer-line.png")

    # A zone over nearly all the picture: drawn on it, named, counted in the list.
    figure.locator("button.tile-zone").click()
    for x, y in [(0.02, 0.02), (0.98, 0.02), (0.98, 0.98), (0.02, 0.98)]:
        click(x, y)
    figure.locator("input.shape-name").fill("lot")
    # A misspelt class is refused by the server, named on the page; the editor stays open.
    figure.locator("input.shape-classes").fill("car, unicorn")
    figure.locator("input.shape-loiter").fill("2")
    figure.locator("button.edit-save").click()
    expect(pg.locator(f'#errors [data-key="edit:{stream_id}"]')).to_contain_text("'unicorn'")
    expect(figure.locator(".tile-edit-bar")).to_be_visible()
    figure.locator("input.shape-classes").fill("")  # every class, loitering after 2 s
    figure.locator("button.edit-save").click()
    expect(figure.locator(".tile-edit-bar")).to_be_hidden()
    expect(pg.locator(f'#errors [data-key="edit:{stream_id}"]')).to_have_count(0)
    pg.wait_for_function("(id) => window.streamdet.drawn[id].zones.length === 1", arg=canvas_id)
    zone = pg.evaluate(f"() => window.streamdet.drawn['{canvas_id}'].zones[0]")
    assert zone["name"] == "lot" and len(zone["points"]) == 4
    expect(row).to_contain_text(re.compile(r"lot \d+ now / \d+ entered"))
    # Cars in the zone are labelled with how long they have been there.
    pg.wait_for_function(
        "(id) => { const d = window.streamdet.drawn[id]; return d.shapes.length > 0"
        " && d.detections.every((det) => det.zones?.includes('lot')); }",
        arg=canvas_id,
    )
    labels = pg.evaluate(f"() => window.streamdet.drawn['{canvas_id}'].shapes.map(s => s.label)")
    assert all(re.fullmatch(r"[a-z ]+ #\d+ [01]\.\d\d \d+s", label) for label in labels), labels
    figure.screenshot(path=artifacts / "viewer-zone.png")
    # The cars' entries into it come to the page's event list as they happen (server-sent
    # events), newest first, with the stream's name.
    entered = pg.locator("#event-list li.zone_enter").first
    expect(entered.locator(".event-text")).to_have_text(
        re.compile(r"^\d\d?:\d\d:\d\d · .+ · [a-z ]+ #\d+ entered lot$")
    )
    expect(pg.locator("#no-events")).to_be_hidden()
    got = pg.evaluate("() => window.streamdet.events.filter((e) => e.type === 'zone_enter')")
    assert got and all(e["stream_id"] == stream_id and e["zone"] == "lot" for e in got), got
    # Each shows its car, cut from the frame (the thumbnail, fetched with the page's key).
    pg.wait_for_function(
        "() => { const i = document.querySelector('#event-list li.zone_enter img.event-thumb');"
        " return i && i.complete && i.naturalWidth > 0 && i.naturalHeight > 0; }"
    )
    pg.locator("#events-panel").screenshot(path=artifacts / "viewer-events.png")
    # Each has a snapshot: the frame it happened in, fetched and shown in a dialog.
    entered.locator("button.event-snapshot").click()
    expect(pg.locator("#snapshot-dialog")).to_be_visible()
    pg.wait_for_function(
        "() => { const i = document.getElementById('snapshot-image');"
        " return i.complete && i.naturalWidth > 0; }"
    )
    expect(pg.locator("#snapshot-caption")).to_contain_text("entered lot")
    pg.locator("#snapshot-dialog").screenshot(path=artifacts / "viewer-event-snapshot.png")
    pg.locator("#snapshot-dialog button[type=submit]").click()
    expect(pg.locator("#snapshot-dialog")).to_be_hidden()
    # And a clip, the camera's own video around it, played in the page.
    entered.locator("button.event-clip").click()
    expect(pg.locator("#clip-dialog")).to_be_visible()
    pg.wait_for_function(
        "() => { const v = document.getElementById('clip-video');"
        " return v.readyState >= 2 && v.duration > 1 && v.videoWidth === 768; }"
    )
    expect(pg.locator("#clip-caption")).to_contain_text("entered lot")
    pg.locator("#clip-dialog").screenshot(path=artifacts / "viewer-event-clip.png")
    pg.locator("#clip-dialog button[type=submit]").click()
    expect(pg.locator("#clip-dialog")).to_be_hidden()
    # An event created from outside (a doorbell) shows up as the others do.
    with httpx.Client(base_url=pg.url, timeout=30) as outside:
        created = outside.post(f"/streams/{stream_id}/events", json={"label": "doorbell"})
    assert created.status_code == 201, created.text
    expect(pg.locator("#event-list li.manual .event-text").first).to_contain_text(
        "car-region · doorbell (created from outside)"
    )
    # An object that stays 2 s in the zone is loitering (the zone's loiter_s from the editor).
    expect(pg.locator("#event-list li.zone_loiter .event-text").first).to_contain_text(
        re.compile(r"#\d+ loitering in lot for 2 s"), timeout=30_000
    )
    # The list's filters: only zone entries and exits (the doorbell goes); a class the model
    # lacks is named on the page; the events shown, counted per hour, as a CSV file.
    pg.select_option('#event-filter select[name="type"]', "zone_enter,zone_exit")
    pg.wait_for_function(
        "() => { const e = window.streamdet.events; return e.length > 0 &&"
        " e.every((x) => x.type === 'zone_enter' || x.type === 'zone_exit'); }"
    )
    expect(pg.locator("#event-list li.manual")).to_have_count(0)
    pg.fill('#event-filter input[name="classes"]', "unicorn")
    pg.press('#event-filter input[name="classes"]', "Enter")
    expect(pg.locator('#errors [data-key="event-filter"]')).to_contain_text("'unicorn'")
    pg.fill('#event-filter input[name="classes"]', "")
    pg.press('#event-filter input[name="classes"]', "Enter")
    expect(pg.locator('#errors [data-key="event-filter"]')).to_have_count(0)
    with pg.expect_download() as download:
        pg.click("#event-counts")
    table = Path(download.value.path()).read_text().splitlines()
    assert table[0] == "start,end,stream_id,type,class_name,count", table
    assert any(f",{stream_id},zone_enter," in row for row in table[1:]), table
    pg.select_option('#event-filter select[name="type"]', "")
    expect(pg.locator("#event-list li.manual")).not_to_have_count(0)

    # One line removed from the line editor's list; the zone stays.
    figure.locator("button.tile-line").click()
    expect(figure.locator("button.shape-remove")).to_have_text(["× gate (car, truck)"])
    figure.locator("button.shape-remove", has_text="gate").click()
    expect(figure.locator(".tile-edit-bar")).to_be_hidden()
    pg.wait_for_function("(id) => window.streamdet.drawn[id].lines.length === 0", arg=canvas_id)
    with httpx.Client(base_url=pg.url, timeout=30) as check:
        detect = check.get(f"/streams/{stream_id}").json()["detect"]
    assert detect["lines"] == [] and [z["name"] for z in detect["zones"]] == ["lot"]
    assert detect["zones"][0]["loiter_s"] == 2 and detect["zones"][0]["classes"] is None

    # A motion mask over the top left corner (where cameras burn their clock): saved (motion
    # gating stays on), shaded on the picture, then removed from the mask editor's list.
    figure.locator("button.tile-mask").click()
    for x, y in [(0.0, 0.0), (0.3, 0.0), (0.3, 0.1), (0.0, 0.1)]:
        click(x, y)
    expect(figure.locator(".edit-hint")).to_contain_text("4 points")
    figure.locator("button.edit-save").click()
    expect(figure.locator(".tile-edit-bar")).to_be_hidden()
    pg.wait_for_function("(id) => window.streamdet.drawn[id].masks.length === 1", arg=canvas_id)
    with httpx.Client(base_url=pg.url, timeout=30) as check:
        detect = check.get(f"/streams/{stream_id}").json()["detect"]
    assert detect["motion"] is True and len(detect["motion_mask"]) == 1
    for got, want in zip(
        detect["motion_mask"][0], [(0, 0), (0.3, 0), (0.3, 0.1), (0, 0.1)], strict=True
    ):
        assert got == pytest.approx(want, abs=2 / size["width"])
    figure.screenshot(path=artifacts / "viewer-mask.png")
    figure.locator("button.tile-mask").click()
    figure.locator("button.shape-remove", has_text="mask 1").click()
    expect(figure.locator(".tile-edit-bar")).to_be_hidden()
    pg.wait_for_function("(id) => window.streamdet.drawn[id].masks.length === 0", arg=canvas_id)
    expect(pg.locator("#errors .error")).to_have_count(0)
    assert errors.errors == []


@pytest.mark.rtsp
def test_api_key_is_asked_for_and_kept_for_the_session(
    camera: RtspCamera,
    page: tuple[Page, PageErrors],
    artifacts: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    key = "viewer-test-key"
    srv = viewer_server(
        artifacts / "viewer-auth-server.log",
        api_keys=key,
        data_dir=str(tmp_path_factory.mktemp("viewer-auth-data")),
    )
    try:
        with httpx.Client(base_url=srv.base_url, timeout=30) as client:
            assert client.get("/streams").status_code == 401
            created = client.post(
                "/streams",
                json={"url": camera.url("car"), "name": "car"},
                headers={"Authorization": f"Bearer {key}"},
            )
            assert created.status_code == 201, created.text
            stream_id = created.json()["id"]
        pg, errors = page
        pg.goto(srv.base_url + "/")  # the page itself is open; its API calls are not
        dialog = pg.locator("#key-dialog")
        expect(dialog).to_be_visible()
        expect(pg.locator("#key-reason")).to_contain_text("needs an API key")
        pg.screenshot(path=artifacts / "viewer-key-prompt.png", full_page=True)

        # Declined: the 401 is shown on the page, not retried in a loop.
        pg.click("#key-cancel")
        expect(dialog).to_be_hidden()
        expect(pg.locator('#errors [data-key="auth"]')).to_contain_text("401 Unauthorized")

        # A wrong key is refused and asked for again; the right one is kept for the session.
        pg.click("#key-button")
        pg.fill("#key-input", "wrong-key")
        pg.click("#key-save")
        expect(pg.locator("#key-reason")).to_contain_text("was refused")
        pg.fill("#key-input", key)
        pg.click("#key-save")
        expect(dialog).to_be_hidden()
        expect(pg.locator('#errors [data-key="auth"]')).to_have_count(0)
        expect(pg.locator("#model-name")).to_contain_text("onnxruntime")
        assert pg.evaluate("() => sessionStorage.getItem('streamdet.apiKey')") == key

        # The WebSocket carries the key too: the watched stream draws its boxes.
        pg.locator(f'#stream-rows tr[data-id="{stream_id}"] input.watch').check()
        wait_for_boxes(pg, f"tile-{stream_id}")

        # Reloading the tab keeps the key: no prompt, data flows.
        pg.reload()
        expect(pg.locator("#model-name")).to_contain_text("onnxruntime")
        expect(dialog).to_be_hidden()
        pg.set_input_files("#pick", ultralytics_assets() / "bus.jpg")
        wait_for_playground(pg)
        assert_boxes_on_canvas(pg, "pg-canvas")
        pg.screenshot(path=artifacts / "viewer-key-accepted.png", full_page=True)
        assert errors.errors == []
    finally:
        srv.stop()


@pytest.mark.rtsp
def test_streams_of_the_streams_file_are_shown_but_not_edited_in_the_page(
    camera: RtspCamera,
    page: tuple[Page, PageErrors],
    artifacts: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    folder = tmp_path_factory.mktemp("viewer-streams-file")
    declared = folder / "streams.yaml"
    declared.write_text(f"streams:\n  - id: gate_cam\n    url: {camera.url('car')}\n")
    srv = viewer_server(
        artifacts / "viewer-streams-file-server.log",
        streams_file=str(declared),
        data_dir=str(folder / "data"),
    )
    try:
        pg, errors = page
        pg.goto(srv.base_url + "/")
        row = pg.locator('#stream-rows tr[data-id="gate_cam"]')
        expect(row.locator("button.remove")).to_be_disabled()
        expect(row.locator("button.remove")).to_have_attribute("title", re.compile("streams file"))
        row.locator("input.watch").check()
        wait_for_boxes(pg, "tile-gate_cam")  # watched as any other
        figure = pg.locator('figure[data-stream-id="gate_cam"]')
        for editor in ("tile-region", "tile-line", "tile-zone", "tile-mask"):
            expect(figure.locator(f"button.{editor}")).to_be_disabled()
        expect(pg.locator("#errors .error")).to_have_count(0)
        assert errors.errors == []
    finally:
        srv.stop()


def test_a_video_job_is_uploaded_followed_and_its_drawn_video_played(
    server: ServerProcess, page: tuple[Page, PageErrors], artifacts: Path
) -> None:
    pg, errors = page
    pg.goto(server.base_url + "/")
    expect(pg.locator("#no-jobs")).to_be_visible()
    form = pg.locator("#add-job")
    # Something that is no video is refused with the server's reason, and nothing is kept.
    form.locator('input[name="video"]').set_input_files(
        FilePayload(name="notes.mp4", mimeType="video/mp4", buffer=b"not a video at all" * 50)
    )
    form.locator("button[type=submit]").click()
    expect(pg.locator("#errors .error")).to_contain_text(
        "Video job: 415: video: not a video FFmpeg can read"
    )
    pg.locator("#errors .error button").click()
    expect(pg.locator("#job-rows tr")).to_have_count(0)
    car = next(v for v in VIDEOS if v.name.startswith("car"))
    form.locator('input[name="video"]').set_input_files(str(car))
    form.locator('input[name="classes"]').fill("car")
    form.locator('input[name="fps"]').fill("2")
    form.locator('input[name="track"]').check()
    form.locator("button[type=submit]").click()
    row = pg.locator("#job-rows tr").first
    expect(row.locator("td").first).to_have_text(car.name)
    expect(row.locator(".job-state")).to_have_text("done", timeout=120_000)
    expect(row.locator(".job-progress")).to_contain_text("30.2 of 30.2 s · 61 frames")  # whole
    expect(row.locator(".job-found")).to_contain_text("car")
    pg.locator("#jobs-panel").screenshot(path=artifacts / "viewer-jobs.png")
    row.locator("button.job-video").click()
    expect(pg.locator("#clip-dialog")).to_be_visible()
    pg.wait_for_function(
        "() => { const v = document.getElementById('clip-video');"
        " return v.readyState >= 2 && v.duration > 25 && v.videoWidth === 768; }"
    )
    pg.locator("#clip-dialog").screenshot(path=artifacts / "viewer-job-video.png")
    pg.locator("#clip-dialog button[type=submit]").click()
    with pg.expect_download() as download:
        row.locator("button.job-frames").click()
    frames = Path(download.value.path()).read_text().splitlines()
    assert len(frames) == 61
    row.locator("button.job-delete").click()
    expect(pg.locator("#job-rows tr")).to_have_count(0)
    expect(pg.locator("#no-jobs")).to_be_visible()
    expect(pg.locator("#errors .error")).to_have_count(0)
    assert errors.errors == []


# ---- a tile when its stream stops showing, goes and comes back; errors; text; tabs -----------


def add_stream(client: httpx.Client, **body: object) -> str:
    """Adds a stream through the API (as another client would); returns its id."""
    created = client.post("/streams", json=body)
    assert created.status_code == 201, created.text
    stream_id: str = created.json()["id"]
    return stream_id


def watch(pg: Page, stream_id: str) -> None:
    """Ticks the stream's Watch box once the list shows it."""
    pg.locator(f'#stream-rows tr[data-id="{stream_id}"] input.watch').check()


def brightest(pg: Page, canvas_id: str) -> int:
    """The brightest channel of any pixel on the canvas (0: all black)."""
    most: int = pg.evaluate(
        """(id) => {
          const canvas = document.getElementById(id);
          const { data } = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height);
          let most = 0;
          for (let i = 0; i < data.length; i += 4) {
            most = Math.max(most, data[i], data[i + 1], data[i + 2]);
          }
          return most;
        }""",
        canvas_id,
    )
    return most


def wait_for_blank(pg: Page, canvas_id: str, state: str) -> None:
    """Waits until the tile shows nothing in ``state``, then checks it really does: no boxes,
    and a black canvas (the stream has no region, zones or lines)."""
    pg.wait_for_function(
        "([id, state]) => window.streamdet.drawn[id]?.blank === state", arg=[canvas_id, state]
    )
    drawn = pg.evaluate("(id) => window.streamdet.drawn[id]", canvas_id)
    assert drawn["shapes"] == [] and drawn["detections"] == [], drawn
    assert brightest(pg, canvas_id) < 16


def test_a_disabled_stream_shows_no_picture_until_its_frames_come_again(
    live_server: ServerProcess, clips: Path, live_page: tuple[Page, PageErrors], artifacts: Path
) -> None:
    """Disabling a stream is a privacy switch: its tile drops the last picture and its boxes
    at once and says why (they stayed on it for as long as it was disabled), and shows the
    frames again once it is enabled."""
    pg, errors = live_page
    with httpx.Client(base_url=live_server.base_url, timeout=30) as api:
        url = f"file://{clips / 'bottles-3s.mp4'}"
        stream_id = add_stream(api, url=url, name="shelf", max_fps=5)
        try:
            watch(pg, stream_id)
            canvas_id = f"tile-{stream_id}"
            figure = pg.locator(f'figure[data-stream-id="{stream_id}"]')
            placeholder = figure.locator(".tile-blank")
            frame = wait_for_boxes(pg, canvas_id)
            expect(placeholder).to_be_hidden(timeout=UI_TIMEOUT_MS)
            row = pg.locator(f'#stream-rows tr[data-id="{stream_id}"]')
            row.locator("button.toggle", has_text="Disable").click()
            expect(placeholder).to_have_text(
                "disabled: its camera is closed, nothing is shown", timeout=UI_TIMEOUT_MS
            )
            wait_for_blank(pg, canvas_id, "disabled")
            for editor in ("tile-region", "tile-line", "tile-zone", "tile-mask"):
                expect(figure.locator(f"button.{editor}")).to_be_disabled(timeout=UI_TIMEOUT_MS)
            figure.screenshot(path=artifacts / "viewer-tile-disabled.png")
            row.locator("button.toggle", has_text="Enable").click()
            wait_for_boxes(pg, canvas_id, frame)
            expect(placeholder).to_be_hidden(timeout=UI_TIMEOUT_MS)
            assert pg.evaluate("(id) => window.streamdet.drawn[id].blank", canvas_id) is None
            expect(pg.locator(f'#errors [data-key="stream:{stream_id}"]')).to_have_count(
                0, timeout=UI_TIMEOUT_MS
            )
        finally:
            api.delete(f"/streams/{stream_id}")
    assert errors.errors == []


def test_a_file_played_to_its_end_shows_no_picture_and_is_no_error(
    live_server: ServerProcess, clips: Path, live_page: tuple[Page, PageErrors], artifacts: Path
) -> None:
    """A file played once (``"loop": false``) that reached its end shows nothing now: its
    tile drops the last picture and says so. It ended as asked: no error in the list, the
    tile or the page (a red banner came back every 2 s however often it was dismissed), and
    the event list says it played to its end (it said it lost its source)."""
    pg, errors = live_page
    with httpx.Client(base_url=live_server.base_url, timeout=30) as api:
        url = f"file://{clips / 'bottles-8s.mp4'}"
        # Disabled until the page watches it, so the page sees it play.
        stream_id = add_stream(api, url=url, name="once", loop=False, enabled=False, max_fps=5)
        try:
            watch(pg, stream_id)
            canvas_id = f"tile-{stream_id}"
            figure = pg.locator(f'figure[data-stream-id="{stream_id}"]')
            placeholder = figure.locator(".tile-blank")
            expect(placeholder).to_contain_text("disabled", timeout=UI_TIMEOUT_MS)
            assert api.patch(f"/streams/{stream_id}", json={"enabled": True}).status_code == 200
            wait_for_boxes(pg, canvas_id)
            row = pg.locator(f'#stream-rows tr[data-id="{stream_id}"]')
            expect(row.locator("td.state")).to_have_text("stopped", timeout=UI_TIMEOUT_MS)
            expect(placeholder).to_have_text(
                "played to its end: nothing to show", timeout=UI_TIMEOUT_MS
            )
            wait_for_blank(pg, canvas_id, "stopped")
            # A frame decoded before it ended that comes after the state message (it was in
            # the engine then) is not drawn: the picture came back after "played to its end".
            late = pg.evaluate(
                """async (id) => {
                  const tile = window.streamdet.tiles.get(id);
                  const canvas = new OffscreenCanvas(8, 8);
                  canvas.getContext("2d").fillRect(0, 0, 8, 8);
                  const blob = await canvas.convertToBlob();
                  const meta = { frame: tile.blankFrame, captured_at: 0, width: 8, height: 8,
                                 detections: [] };
                  await tile.show({ meta, blob, number: tile.received + 1 });
                  return [tile.blankFrame, tile.current === null];
                }""",
                stream_id,
            )
            assert late[0] > 0 and late[1] is True, late
            # A new connection starts afresh: after a server restart frame numbers start again
            # from 0, and the tile stayed blank until they passed the old ones.
            again = pg.evaluate(
                "(id) => { const t = window.streamdet.tiles.get(id); t.ws.close(); t.connect();"
                " return t.blankFrame; }",
                stream_id,
            )
            assert again == 0
            # Nor does its last picture: it shows nothing now (it answered 200, its last frame).
            shown = api.get(f"/streams/{stream_id}/latest.jpg")
            assert shown.status_code == 503 and "Retry-After" not in shown.headers, shown
            assert (
                shown.json()["detail"] == f"stream {stream_id!r} is stopped: it shows nothing now"
            )
            figure.screenshot(path=artifacts / "viewer-tile-played-to-its-end.png")
            expect(pg.locator(f'#errors [data-key="stream:{stream_id}"]')).to_have_count(
                0, timeout=UI_TIMEOUT_MS
            )
            expect(figure.locator(".tile-error")).to_be_hidden(timeout=UI_TIMEOUT_MS)
            assert row.get_attribute("data-error") is None
            ended = pg.locator("#event-list li.stream_state .event-text", has_text=" · once · ")
            expect(ended.first).to_have_text(
                re.compile(r" · once · played to its end$"), timeout=UI_TIMEOUT_MS
            )
        finally:
            api.delete(f"/streams/{stream_id}")
    assert errors.errors == []


def test_a_dismissed_error_stays_dismissed_until_it_changes(
    live_server: ServerProcess, live_page: tuple[Page, PageErrors]
) -> None:
    """A stream's error dismissed stays away while it is the same (the list is read again
    every 2 s, and each time brought it back), and comes back once the error changes."""
    pg, errors = live_page
    with httpx.Client(base_url=live_server.base_url, timeout=30) as api:
        dead = f"rtsp://127.0.0.1:{free_port()}/nothing"
        stream_id = add_stream(api, url=dead, name="gone")
        try:
            banner = pg.locator(f'#errors [data-key="stream:{stream_id}"]')
            expect(banner).to_contain_text(dead, timeout=UI_TIMEOUT_MS)
            banner.locator("button", has_text="Dismiss").click()
            expect(banner).to_have_count(0, timeout=UI_TIMEOUT_MS)

            def listed(response: Any) -> bool:
                return bool(response.url.endswith("/streams") and response.request.method == "GET")

            # Three more lists read (the page reads one after rendering the last): the first two
            # at least rendered, the stream's error in them unchanged.
            for _ in range(3):
                with pg.expect_response(listed):
                    pass
            row = pg.locator(f'#stream-rows tr[data-id="{stream_id}"]')
            expect(row).to_have_attribute(
                "data-error", re.compile(re.escape(dead)), timeout=UI_TIMEOUT_MS
            )
            expect(banner).to_have_count(0, timeout=UI_TIMEOUT_MS)
            # Another error: shown again.
            other = f"rtsp://127.0.0.1:{free_port()}/elsewhere"
            assert api.put(f"/streams/{stream_id}", json={"url": other, "name": "gone"}).is_success
            expect(banner).to_contain_text(other, timeout=UI_TIMEOUT_MS)
        finally:
            api.delete(f"/streams/{stream_id}")
    assert errors.errors == []


def test_a_watched_stream_removed_and_added_again_is_watched_again(
    live_server: ServerProcess, clips: Path, live_page: tuple[Page, PageErrors]
) -> None:
    """A watched stream removed and added again under its id (another client, a script's
    DELETE then POST) before the page's next list: the tile subscribes again by itself. Its
    WebSocket's close (1000, removed) ended it for good: a dead tile under a ticked Watch."""
    pg, errors = live_page
    body = {"id": "again", "url": f"file://{clips / 'bottles-3s.mp4'}", "name": "again"}
    with httpx.Client(base_url=live_server.base_url, timeout=30) as api:
        add_stream(api, **body, max_fps=5)
        try:
            watch(pg, "again")
            canvas_id = "tile-again"
            figure = pg.locator('figure[data-stream-id="again"]')
            wait_for_boxes(pg, canvas_id)
            # The page's lists are held while the stream is gone, so none of them can say it
            # was removed (the tile would go, and the Watch box with it): the page hears of
            # it from its WebSocket alone.
            held: list[Route] = []
            holding = True

            def hold(route: Route) -> None:
                if holding and route.request.method == "GET":
                    held.append(route)
                else:
                    route.continue_()

            pg.route("**/streams", hold)
            try:
                assert api.delete("/streams/again").status_code == 204
                expect(figure.locator(".tile-error")).to_contain_text(
                    "stream no longer exists", timeout=UI_TIMEOUT_MS
                )
                removed_at = time.time()
                add_stream(api, **body, max_fps=5)
            finally:
                holding = False
                for route in held:
                    route.continue_()
                pg.unroute("**/streams")
            pg.wait_for_function(
                "([id, t]) => { const d = window.streamdet.drawn[id];"
                " return d.blank === null && d.shapes.length > 0 && d.capturedAt > t; }",
                arg=[canvas_id, removed_at],
            )
            expect(figure.locator(".tile-error")).to_be_hidden(timeout=UI_TIMEOUT_MS)
            expect(pg.locator('#stream-rows tr[data-id="again"] input.watch')).to_be_checked(
                timeout=UI_TIMEOUT_MS
            )
            deadline = time.monotonic() + 60
            while api.get("/streams/again").json()["subscribers"] != 1:
                assert time.monotonic() < deadline, api.get("/streams/again").json()
                pg.wait_for_timeout(200)
        finally:
            api.delete("/streams/again")
    assert errors.errors == []


def test_a_slow_stream_s_rate_is_shown(
    live_server: ServerProcess, clips: Path, live_page: tuple[Page, PageErrors]
) -> None:
    """A stream at max_fps 0.5 says about 0.5 frames a second, in its tile and the list:
    both took the rate over the last 3 s, which held fewer than two of its frames ("0.0")."""
    pg, errors = live_page
    with httpx.Client(base_url=live_server.base_url, timeout=30) as api:
        stream_id = add_stream(api, url=f"file://{clips / 'bottles-3s.mp4'}", max_fps=0.5)
        try:
            watch(pg, stream_id)
            rate = re.compile(r"^0\.[3-7] fps shown")
            figure = pg.locator(f'figure[data-stream-id="{stream_id}"]')
            expect(figure.locator(".tile-fps")).to_have_text(rate, timeout=UI_TIMEOUT_MS)
            row = pg.locator(f'#stream-rows tr[data-id="{stream_id}"]')
            expect(row.locator("td.fps")).to_have_text(
                re.compile(r"^0\.[3-7]$"), timeout=UI_TIMEOUT_MS
            )
        finally:
            api.delete(f"/streams/{stream_id}")
    assert errors.errors == []


def test_a_watched_stream_listed_gone_then_added_again_is_watched_again(
    live_server: ServerProcess, clips: Path, live_page: tuple[Page, PageErrors]
) -> None:
    """The same, with the page's list read between the DELETE and the POST (its WebSocket's
    close asks for one at once): the stream left the list, and was forgotten, unticked."""
    pg, errors = live_page
    body = {"id": "back", "url": f"file://{clips / 'bottles-3s.mp4'}", "name": "back"}
    with httpx.Client(base_url=live_server.base_url, timeout=30) as api:
        add_stream(api, **body, max_fps=5)
        try:
            watch(pg, "back")
            wait_for_boxes(pg, "tile-back")
            assert api.delete("/streams/back").status_code == 204
            expect(pg.locator('#stream-rows tr[data-id="back"]')).to_have_count(
                0, timeout=UI_TIMEOUT_MS
            )
            removed_at = time.time()
            add_stream(api, **body, max_fps=5)
            expect(pg.locator('#stream-rows tr[data-id="back"] input.watch')).to_be_checked(
                timeout=UI_TIMEOUT_MS
            )
            pg.wait_for_function(
                "([id, t]) => { const d = window.streamdet.drawn[id];"
                " return d && d.blank === null && d.shapes.length > 0 && d.capturedAt > t; }",
                arg=["tile-back", removed_at],
            )
        finally:
            api.delete("/streams/back")
    assert errors.errors == []


def test_the_page_fits_a_phone_and_tile_names_stay_readable(
    live_server: ServerProcess, clips: Path, browser: Browser, artifacts: Path
) -> None:
    """On a phone (390 px wide) the tiles' headers wrap: a long name keeps a readable width
    (it was set a letter a line) and the buttons stay on the page (they ran off its side)."""
    context = browser.new_context(viewport={"width": 390, "height": 844})
    context.set_default_timeout(UI_TIMEOUT_MS)
    url = f"file://{clips / 'bottles-3s.mp4'}"
    with httpx.Client(base_url=live_server.base_url, timeout=30) as api:
        long_name = "Conveyor line with a rather long camera name"
        ids = [add_stream(api, url=url, name=name, max_fps=2) for name in (long_name, "shelf")]
        try:
            pg = context.new_page()
            errors = PageErrors(pg)
            pg.goto(live_server.base_url + "/")
            for stream_id in ids:
                watch(pg, stream_id)
                wait_for_boxes(pg, f"tile-{stream_id}")
            layout = pg.evaluate(
                """() => ({
                  scroll: document.documentElement.scrollWidth,
                  client: document.documentElement.clientWidth,
                  tiles: [...document.querySelectorAll('.tile')].map((tile) => {
                    const box = tile.getBoundingClientRect();
                    const parts = [...tile.querySelectorAll('figcaption > *')]
                      .map((e) => e.getBoundingClientRect());
                    return {
                      name: tile.querySelector('.tile-name').getBoundingClientRect().width,
                      outside: parts.filter((p) => p.left < box.left || p.right > box.right)
                        .length,
                    };
                  }),
                })"""
            )
            pg.screenshot(path=artifacts / "viewer-phone.png", full_page=True)
            assert layout["scroll"] <= layout["client"], layout
            assert len(layout["tiles"]) == 2, layout
            for tile in layout["tiles"]:
                assert tile["name"] >= 100 and tile["outside"] == 0, layout
            assert errors.errors == []
        finally:
            context.close()
            for stream_id in ids:
                api.delete(f"/streams/{stream_id}")


# RIGHT-TO-LEFT OVERRIDE: the text after it, to the end of its paragraph, runs backwards.
RLO = "\u202e"

# Whether `word`, the page's own, in the element `selector` reads left to right on the screen:
# its first letter left of its last.
READS_LEFT_TO_RIGHT_JS = """
([selector, word]) => {
  const root = document.querySelector(selector);
  const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    const at = node.data.indexOf(word);
    if (at < 0) continue;
    const left = (i) => {
      const range = document.createRange();
      range.setStart(node, i);
      range.setEnd(node, i + 1);
      return range.getBoundingClientRect().left;
    };
    return left(at) < left(at + word.length - 1);
  }
  return null;
}
"""


def test_text_from_outside_cannot_reorder_the_pages_own_words(
    live_server: ServerProcess, live_page: tuple[Page, PageErrors]
) -> None:
    """A right-to-left override in a stream's name, a zone's name or an event's label stays
    inside it: the page's own words after it read as they should (they ran backwards)."""
    pg, errors = live_page
    with httpx.Client(base_url=live_server.base_url, timeout=30) as api:
        whole = [[0, 0], [1, 0], [1, 1], [0, 1]]
        stream_id = add_stream(
            api,
            url=f"rtsp://127.0.0.1:{free_port()}/nothing",
            name=f"cam{RLO}",
            zones=[{"name": f"lot{RLO}", "points": whole}],
        )
        try:
            created = api.post(f"/streams/{stream_id}/events", json={"label": f"door{RLO}"})
            assert created.status_code == 201, created.text
            banner = f'#errors [data-key="stream:{stream_id}"]'
            expect(pg.locator(banner)).to_contain_text(f"Stream cam{RLO}: ", timeout=UI_TIMEOUT_MS)
            objects = f'#stream-rows tr[data-id="{stream_id}"] .objects'
            expect(pg.locator(objects)).to_contain_text(f"lot{RLO} 0 now", timeout=UI_TIMEOUT_MS)
            event = "#event-list li.manual .event-text"
            expect(pg.locator(event).first).to_contain_text(
                f"door{RLO} (created from outside)", timeout=UI_TIMEOUT_MS
            )
            for selector, word in ((banner, "connecting"), (objects, "now"), (event, "created")):
                assert pg.evaluate(READS_LEFT_TO_RIGHT_JS, [selector, word]), (selector, word)
        finally:
            api.delete(f"/streams/{stream_id}")
    assert errors.errors == []


# Makes the tab hidden (or visible again) as switching away from it does, for the page's
# script: headless Chromium keeps every tab visible.
SET_HIDDEN_JS = """
(hidden) => {
  Object.defineProperty(document, "visibilityState", {
    configurable: true, get: () => (hidden ? "hidden" : "visible"),
  });
  Object.defineProperty(document, "hidden", { configurable: true, get: () => hidden });
  document.dispatchEvent(new Event("visibilitychange"));
}
"""


class EventConnections:
    """The page's server-sent event requests (``GET /events?...after=``) opened and ended."""

    def __init__(self, tab: Page) -> None:
        self.tab = tab
        self.opened: list[str] = []
        self.ended: list[str] = []
        tab.on("request", lambda r: self.opened.append(r.url) if self.live(r.url) else None)
        tab.on("requestfinished", lambda r: self.ended.append(r.url) if self.live(r.url) else None)
        tab.on("requestfailed", lambda r: self.ended.append(r.url) if self.live(r.url) else None)

    @staticmethod
    def live(url: str) -> bool:
        return "/events?" in url and "after=" in url

    def wait_open(self, count: int) -> None:
        deadline = time.monotonic() + UI_TIMEOUT_MS / 1000
        while len(self.opened) - len(self.ended) != count:
            assert time.monotonic() < deadline, (count, self.opened, self.ended)
            self.tab.wait_for_timeout(100)


def test_hidden_tabs_let_go_of_their_event_connections(
    live_server: ServerProcess, browser: Browser
) -> None:
    """A hidden tab closes its server-sent events and opens them again, after the last event
    it had, when shown: six tabs of the page held the six connections Chromium opens to one
    server over HTTP/1.1, and a seventh never loaded."""
    context: BrowserContext = browser.new_context()
    context.set_default_timeout(UI_TIMEOUT_MS)
    with httpx.Client(base_url=live_server.base_url, timeout=30) as api:
        stream_id = add_stream(api, url=f"rtsp://127.0.0.1:{free_port()}/nothing", name="bell")
        try:
            tabs: list[tuple[Page, EventConnections]] = []
            for _ in range(6):
                tab = context.new_page()
                connections = EventConnections(tab)
                tab.goto(live_server.base_url + "/")
                expect(tab.locator("#server-status")).to_have_text(
                    "connected", timeout=UI_TIMEOUT_MS
                )
                connections.wait_open(1)
                tab.evaluate(SET_HIDDEN_JS, True)
                connections.wait_open(0)
                tabs.append((tab, connections))
            # A seventh loads and works.
            seventh = context.new_page()
            seventh.goto(live_server.base_url + "/")
            expect(seventh.locator("#server-status")).to_have_text(
                "connected", timeout=UI_TIMEOUT_MS
            )
            EventConnections(seventh)  # (its own is opened by now or soon)
            answered = seventh.evaluate(
                """() => Promise.race([fetch('healthz').then((r) => r.status),
                  new Promise((done) => setTimeout(() => done('pending'), 10000))])"""
            )
            assert answered == 200
            # An event while the first is hidden comes to it once it is shown, once.
            first, connections = tabs[0]
            made = api.post(f"/streams/{stream_id}/events", json={"label": "while hidden"})
            assert made.status_code == 201, made.text
            first.evaluate(SET_HIDDEN_JS, False)
            connections.wait_open(1)
            shown = first.locator("#event-list li.manual .event-text", has_text="while hidden")
            expect(shown).to_have_count(1, timeout=UI_TIMEOUT_MS)
        finally:
            context.close()
            api.delete(f"/streams/{stream_id}")
