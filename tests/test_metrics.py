"""GET /metrics with the real model in-process: names, labels and counts after real calls."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from server.app import create_app
from server.metrics import Metrics, NvmlCollector, StreamSample, get_metrics
from server.settings import Settings
from tests.helpers import CACHE_DIR, MODEL_PT, ultralytics_assets


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    # No admission target: only the explicit X-Request-Deadline-Ms test may be refused.
    settings = Settings(
        model=str(MODEL_PT), cache_dir=CACHE_DIR, max_batch=2, admission_deadline_ms=0
    )
    app = create_app(settings)

    async def item(item_id: str) -> dict[str, str]:
        return {"id": item_id}

    app.add_api_route("/items/{item_id}", item)  # a templated route of the test's own
    with TestClient(app) as c:
        yield c


def scrape(client: TestClient) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Sample name -> [(labels, value)], parsed by prometheus_client's own parser."""
    resp = client.get("/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((dict(s.labels), s.value))
    return samples


def value(
    samples: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str
) -> float:
    for got, v in samples.get(name, []):
        if all(got.get(k) == want for k, want in labels.items()):
            return v
    raise AssertionError(f"no sample {name}{labels}; have {sorted(samples)}")


def test_detect_is_counted_by_route_status_and_stage(client: TestClient) -> None:
    before = scrape(client)
    bus = (ultralytics_assets() / "bus.jpg").read_bytes()
    for _ in range(2):
        resp = client.post("/detect", content=bus, headers={"content-type": "image/jpeg"})
        assert resp.status_code == 200, resp.text
    after = scrape(client)

    def delta(name: str, **labels: str) -> float:
        old = 0.0
        with contextlib.suppress(AssertionError):  # not exported before the first call
            old = value(before, name, **labels)
        return value(after, name, **labels) - old

    assert delta("streamdet_http_requests_total", route="/detect", method="POST", status="200") == 2
    assert delta("streamdet_http_request_duration_seconds_count", route="/detect") == 2
    for stage in ("queue", "preprocess", "inference", "postprocess", "total"):
        assert delta("streamdet_detect_stage_duration_seconds_count", stage=stage) == 2
    assert value(after, "streamdet_detect_stage_duration_seconds_sum", stage="inference") > 0
    assert delta("streamdet_batch_size_count") == 2
    assert delta("streamdet_batch_size_sum") == 2  # sequential calls: batches of one
    assert value(after, "streamdet_queue_depth", lane="interactive") == 0
    assert value(after, "streamdet_queue_depth", lane="stream") >= 0
    assert "streamdet_estimated_wait_seconds" in after
    assert value(after, "process_resident_memory_bytes") > 0
    # No GPU here: the GPU series are absent rather than zero.
    assert not any(name.startswith("streamdet_gpu_") for name in after)


def test_labels_are_route_templates_not_raw_paths(client: TestClient) -> None:
    assert client.get("/items/abc123").status_code == 200
    client.get("/no/such/path/7f3a")
    samples = scrape(client)
    routes = {labels["route"] for labels, _ in samples["streamdet_http_requests_total"]}
    assert "/items/{item_id}" in routes
    assert "<unrouted>" in routes
    assert not any("abc123" in r or "7f3a" in r for r in routes)


def test_rejections_counted_by_reason(client: TestClient) -> None:
    bus = (ultralytics_assets() / "bus.jpg").read_bytes()
    client.post("/detect", content=bus, headers={"content-type": "image/jpeg"})  # warm estimate
    before = value(scrape(client), "streamdet_rejections_total", reason="deadline")
    resp = client.post(
        "/detect", content=bus, headers={"content-type": "image/jpeg", "x-request-deadline-ms": "1"}
    )
    assert resp.status_code == 504  # no retry can meet 1 ms: still a deadline rejection
    samples = scrape(client)
    assert value(samples, "streamdet_rejections_total", reason="deadline") == before + 1
    for reason in ("queue_full", "expired", "not_ready", "shutting_down"):
        value(samples, "streamdet_rejections_total", reason=reason)  # present from the start


def test_stream_source_hook(client: TestClient) -> None:
    metrics = get_metrics(client)  # type: ignore[arg-type]
    previous = metrics.stream_source
    metrics.set_stream_source(
        lambda: [
            StreamSample(
                "cam1",
                fps_in=12.5,
                fps_processed=5.0,
                frames_in=250,
                frames_processed=100,
                drops=150,
                reconnects=2,
                frames_failed=3,
                frames_decoded=12,
                frames_copied=3,
                viewers=2,
                viewer_drops=9,
                state="reconnecting",
                detections={"car": 40, "person": 7},
                objects={"car": 2},
                tracked={"car": 5},
                crossings={("gate", "in", "car"): 3, ("gate", "out", "car"): 1},
            ),
        ]
    )
    try:
        samples = scrape(client)
    finally:
        metrics.set_stream_source(previous)
    assert value(samples, "streamdet_stream_fps", stream="cam1", direction="in") == 12.5
    assert value(samples, "streamdet_stream_fps", stream="cam1", direction="processed") == 5.0
    assert value(samples, "streamdet_stream_frames_received_total", stream="cam1") == 250
    assert value(samples, "streamdet_stream_frames_processed_total", stream="cam1") == 100
    assert value(samples, "streamdet_stream_frames_dropped_total", stream="cam1") == 150
    assert value(samples, "streamdet_stream_reconnects_total", stream="cam1") == 2
    assert value(samples, "streamdet_stream_frames_failed_total", stream="cam1") == 3
    assert value(samples, "streamdet_stream_frames_decoded_total", stream="cam1") == 12
    assert value(samples, "streamdet_stream_frames_copied_total", stream="cam1") == 3
    assert value(samples, "streamdet_stream_viewers", stream="cam1") == 2
    assert value(samples, "streamdet_stream_viewer_messages_dropped_total", stream="cam1") == 9
    assert value(samples, "streamdet_stream_state", stream="cam1", state="reconnecting") == 1
    detections = "streamdet_stream_detections_total"
    assert value(samples, detections, stream="cam1", **{"class": "car"}) == 40
    assert value(samples, detections, stream="cam1", **{"class": "person"}) == 7
    assert value(samples, "streamdet_stream_objects", stream="cam1", **{"class": "car"}) == 2
    assert value(samples, "streamdet_stream_objects", stream="cam1", **{"class": "person"}) == 0
    tracked = "streamdet_stream_tracked_objects_total"
    assert value(samples, tracked, stream="cam1", **{"class": "car"}) == 5
    crossings = "streamdet_stream_line_crossings_total"
    gate = {"stream": "cam1", "line": "gate", "class": "car"}
    assert value(samples, crossings, direction="in", **gate) == 3
    assert value(samples, crossings, direction="out", **gate) == 1


def test_failing_stream_source_does_not_break_scrape(client: TestClient) -> None:
    metrics = get_metrics(client)  # type: ignore[arg-type]
    previous = metrics.stream_source

    def broken() -> list[StreamSample]:
        raise RuntimeError("manager gone")

    metrics.set_stream_source(broken)
    try:
        samples = scrape(client)
    finally:
        metrics.set_stream_source(previous)
    assert "streamdet_http_requests_total" in samples
    assert "streamdet_stream_fps" not in samples


class FakeNvml:
    """Stands in for pynvml: no GPU on this machine (the one allowed fake)."""

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        return 2

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:  # noqa: N802
        return index

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:  # noqa: N802
        if handle == 1:
            raise RuntimeError("GPU has fallen off the bus")
        return SimpleNamespace(gpu=87, memory=40)

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any:  # noqa: N802
        return SimpleNamespace(used=3 * 2**30, total=80 * 2**30, free=77 * 2**30)


def test_gpu_collector_units() -> None:
    metrics = Metrics(gpu=NvmlCollector(FakeNvml()))
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    util = families["streamdet_gpu_utilization_ratio"].samples
    assert [(s.labels, s.value) for s in util] == [({"gpu": "0"}, 0.87)]
    used = families["streamdet_gpu_memory_used_bytes"].samples
    assert used[0].value == 3 * 2**30
    assert families["streamdet_gpu_memory_total_bytes"].samples[0].value == 80 * 2**30


def test_unknown_rejection_reason_is_refused() -> None:
    with pytest.raises(ValueError, match="REJECTION_REASONS"):
        Metrics().reject("because")


def test_event_loop_lag_is_sampled(client: TestClient) -> None:
    import time

    deadline = time.monotonic() + 5.0
    count = 0.0
    while time.monotonic() < deadline and count < 2:
        time.sleep(0.25)  # the app's loop runs in TestClient's portal thread meanwhile
        count = value(scrape(client), "streamdet_event_loop_lag_seconds_count")
    assert count >= 2
    samples = scrape(client)
    assert value(samples, "streamdet_admission_budget_ratio") == 1.0
    assert value(samples, "streamdet_estimated_wait_seconds") >= 0.0


def test_ready_goes_to_0_as_the_server_shuts_down(client: TestClient) -> None:
    """``streamdet_ready`` said 1 while ``/readyz`` said 503 during the shutdown (it read the
    pool alone)."""
    assert value(scrape(client), "streamdet_ready") == 1
    state = client.app.state.streamdet  # type: ignore[attr-defined]
    state.shutting_down = True
    try:
        assert client.get("/readyz").status_code == 503
        assert value(scrape(client), "streamdet_ready") == 0
    finally:
        state.shutting_down = False


async def _cancelled_call(
    app: Any, path: str, message: str | None, disconnect: bool, root_path: str = ""
) -> list[dict[str, Any]]:
    """What ``app`` sends for a GET of ``path`` cancelled (with ``message``) while it waits;
    ``disconnect``: its client left first."""
    import asyncio

    sent: list[dict[str, Any]] = []
    events = [{"type": "http.request", "body": b"", "more_body": False}]
    if disconnect:
        events.append({"type": "http.disconnect"})

    async def receive() -> dict[str, Any]:
        if events:
            return events.pop(0)
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)

    scope = {
        "type": "http",
        "method": "GET",
        "path": path,
        "root_path": root_path,
        "headers": [],
        "query_string": b"",
    }
    task = asyncio.ensure_future(app(scope, receive, send))
    for _ in range(20):
        await asyncio.sleep(0)
    task.cancel(message)
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return sent


def _hanging_app(metrics: Metrics, *paths: str) -> Any:
    """The metrics middleware around routes ``paths`` that wait for ever (a call queued)."""
    import asyncio

    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    from server.metrics import RequestMetricsMiddleware

    async def hang(request: Request) -> Response:
        await asyncio.Event().wait()
        raise AssertionError("never answered")

    async def listen(request: Request) -> Response:
        await request.body()
        assert await request.is_disconnected()  # the client left while its call waited
        await asyncio.Event().wait()
        raise AssertionError("never answered")

    routes = [Route(path, listen if path == "/listen" else hang) for path in paths]
    return RequestMetricsMiddleware(Starlette(routes=routes), metrics)


def test_a_call_cancelled_before_its_answer_is_counted_as_what_it_was() -> None:
    """A call cancelled before it answered was counted status 500 whatever it was: the client
    gone is 499 (uvicorn answers and logs nothing then), the shutdown's cancel is answered
    503 with Retry-After by the middleware (uvicorn answered and logged its own 500), any
    other cancellation stays 500 (uvicorn's answer)."""
    import asyncio

    from server.routes.detect import UVICORN_SHUTDOWN_CANCEL

    metrics = Metrics()
    app = _hanging_app(metrics, "/hang", "/listen")

    def count(path: str, status: str) -> float:
        return float(metrics.requests.labels(path, "GET", status)._value.get())

    shutdown = asyncio.run(_cancelled_call(app, "/hang", UVICORN_SHUTDOWN_CANCEL, False))
    assert shutdown[0]["status"] == 503
    assert (b"retry-after", b"5") in shutdown[0]["headers"]
    assert json.loads(shutdown[1]["body"]).keys() == {"detail"}
    assert b"STREAMDET_SHUTDOWN_TIMEOUT_S" in shutdown[1]["body"]
    assert count("/hang", "503") == 1
    # nothing to answer: the client left
    assert asyncio.run(_cancelled_call(app, "/listen", None, True)) == []
    assert count("/listen", "499") == 1
    # another cancel: uvicorn's 500
    assert asyncio.run(_cancelled_call(app, "/hang", None, False)) == []
    assert count("/hang", "500") == 1


@pytest.mark.parametrize("root_path", ["", "/streamdet"])
def test_the_shutdowns_503_under_v2_answers_error_as_kserve_clients_read(root_path: str) -> None:
    """The middleware's own 503 for a call the shutdown cancelled is ``{"error": ...}`` under
    ``/v2`` (tritonclient reads "error"), as every other /v2 answer, behind a proxy's prefix
    too: it was ``{"detail": ...}`` there."""
    import asyncio

    from server.routes.detect import UVICORN_SHUTDOWN_CANCEL

    app = _hanging_app(Metrics(), "/v2/models/{name}/infer")
    path = f"{root_path}/v2/models/yolov8n/infer"
    sent = asyncio.run(_cancelled_call(app, path, UVICORN_SHUTDOWN_CANCEL, False, root_path))
    assert sent[0]["status"] == 503
    body = json.loads(sent[1]["body"])
    assert body.keys() == {"error"}
    assert "STREAMDET_SHUTDOWN_TIMEOUT_S" in body["error"]


def test_a_server_without_a_broker_exports_no_mqtt_metrics(client: TestClient) -> None:
    """``streamdet_mqtt_connected`` was 0 on every server without ``--mqtt-url``: an alert
    on it fired for a broker none of them has. (tests/test_mqtt.py: exported with one.)"""
    names = scrape(client)
    assert "streamdet_ready" in names
    assert not [name for name in names if name.startswith("streamdet_mqtt")], sorted(names)
