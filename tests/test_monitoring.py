"""The shipped Grafana dashboard and Prometheus alert rules (``deploy/``), evaluated by a real
Prometheus (Debian's) scraping a real ``streamdet serve`` with a live stream, a camera that is
down, a webhook, a video job and ``/detect`` calls: every query has data (but the GPU's, on a
machine without one), every rule loads and evaluates, and the camera that is down is
alerted on."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from benchmarks.events_bench import WebhookReceiver
from loadtest.server import ServerProcess, free_port
from tests.helpers import BOTTLE_CLIP, REPO, clip_server, ultralytics_assets

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
DASHBOARD = REPO / "deploy" / "grafana" / "streamdet.json"
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"
NEEDS_A_GPU = {"GPU"}  # panels with no data on a machine without an NVIDIA GPU
INTERVAL = "30s"  # $__rate_interval, at a 1 s scrape

pytestmark = pytest.mark.prometheus


def _dashboard_queries() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [
        (panel["title"], target["expr"])
        for panel in dashboard["panels"]
        for target in panel["targets"]
    ]


def _concrete(expr: str) -> str:
    """A dashboard query as Grafana sends it: its variables given values."""
    return (
        expr.replace("$__rate_interval", INTERVAL)
        .replace("$stream", ".*")
        .replace("$instance", ".*")
    )


@pytest.fixture(scope="module")
def prometheus_bin() -> str:
    if not Path(PROMETHEUS).exists() or not Path(PROMTOOL).exists():
        pytest.fail(
            f"Prometheus not found at {PROMETHEUS}: run scripts/system-deps.sh (Debian package"
            " prometheus)"
        )
    return PROMETHEUS


@pytest.fixture(scope="module")
def receiver() -> Iterator[WebhookReceiver]:
    r = WebhookReceiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, receiver: WebhookReceiver
) -> Iterator[ServerProcess]:
    srv = clip_server(tmp_path_factory.mktemp("monitoring"), webhooks=receiver.url)
    srv.start()
    yield srv
    srv.stop()


def test_the_rules_file_is_valid_for_promtool(prometheus_bin: str) -> None:
    checked = subprocess.run(
        [PROMTOOL, "check", "rules", str(ALERTS)], capture_output=True, text=True, check=False
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    rules = yaml.safe_load(ALERTS.read_text())["groups"][0]["rules"]
    assert {"StreamdetDown", "StreamdetStreamDown", "StreamdetDetectP99High"} <= {
        r["alert"] for r in rules
    }


REJECTING_TESTS = """
evaluation_interval: 1m
tests:
  - interval: 1m  # 2060 calls a minute (1000 /detect, 1060 KServe), 60 refused: 2.9%
    input_series:
      - series: 'streamdet_rejections_total{instance="a:8000",reason="deadline"}'
        values: '0+60x20'
      - series: 'streamdet_inference_calls_total{instance="a:8000"}'
        values: '0+2060x20'
      - series: 'streamdet_http_requests_total{instance="a:8000",route="/detect",status="200"}'
        values: '0+1000x20'
    alert_rule_test:
      - eval_time: 15m
        alertname: StreamdetRejecting
        exp_alerts: []
  - interval: 1m  # Triton clients alone, every call refused: no /detect series at all
    input_series:
      - series: 'streamdet_rejections_total{instance="a:8000",reason="deadline"}'
        values: '0+100x20'
      - series: 'streamdet_inference_calls_total{instance="a:8000"}'
        values: '0+100x20'
    alert_rule_test:
      - eval_time: 15m
        alertname: StreamdetRejecting
        exp_alerts:
          - exp_labels: {severity: warning, instance: "a:8000"}
  - interval: 1m  # two servers: b refuses 20% of its calls, a none of its many more
    input_series:
      - series: 'streamdet_rejections_total{instance="b:8000",reason="deadline"}'
        values: '0+20x20'
      - series: 'streamdet_inference_calls_total{instance="b:8000"}'
        values: '0+100x20'
      - series: 'streamdet_inference_calls_total{instance="a:8000"}'
        values: '0+5000x20'
    alert_rule_test:
      - eval_time: 15m
        alertname: StreamdetRejecting
        exp_alerts:
          - exp_labels: {severity: warning, instance: "b:8000"}
"""


def test_the_refusal_alert_counts_every_call_for_inference_of_each_server(
    prometheus_bin: str, tmp_path: Path
) -> None:
    """``StreamdetRejecting`` divided every refusal (KServe's too) by ``/detect``'s calls
    alone: it fired at 2.9% refused, and never where only Triton clients called. And it
    summed every server's calls: one refusing 20% beside a busy healthy one never fired,
    and one that did fire could not say which server it was."""
    rules = yaml.safe_load(ALERTS.read_text())["groups"][0]["rules"]
    (rule,) = (r for r in rules if r.get("alert") == "StreamdetRejecting")
    spec = yaml.safe_load(REJECTING_TESTS)
    spec["rule_files"] = [str(ALERTS)]
    for test in spec["tests"][1:]:
        (alert,) = test["alert_rule_test"][0]["exp_alerts"]
        instance = alert["exp_labels"]["instance"]
        alert["exp_annotations"] = {
            k: v.replace("{{ $labels.instance }}", instance) for k, v in rule["annotations"].items()
        }
    tests = tmp_path / "rejecting.yml"
    tests.write_text(yaml.safe_dump(spec))
    checked = subprocess.run(
        [PROMTOOL, "test", "rules", str(tests)], capture_output=True, text=True, check=False
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_dashboard_and_alerts_have_data_from_a_real_server(
    prometheus_bin: str, server: ServerProcess, tmp_path: Path
) -> None:
    base = server.base_url
    with httpx.Client(base_url=base, timeout=60) as c:
        live = c.post(
            "/streams",
            json={
                "url": f"file://{BOTTLE_CLIP}",
                "max_fps": 5,
                "track": True,
                "zones": [{"name": "all", "points": [[0, 0], [1, 0], [1, 1], [0, 1]]}],
            },
        )
        assert live.status_code == 201, live.text
        down = c.post("/streams", json={"id": "dead_cam", "url": "rtsp://127.0.0.1:9/none"})
        assert down.status_code == 201, down.text
        job = c.post("/jobs", json={"url": f"file://{BOTTLE_CLIP}", "fps": 0.25})
        assert job.status_code == 202, job.text
        bus = (ultralytics_assets() / "bus.jpg").read_bytes()
        config = tmp_path / "prometheus.yml"
        port = free_port()
        config.write_text(
            yaml.safe_dump(
                {
                    "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                    "rule_files": [str(ALERTS)],
                    "scrape_configs": [
                        {
                            "job_name": "streamdet",
                            "static_configs": [{"targets": [base.removeprefix("http://")]}],
                        }
                    ],
                }
            )
        )
        prometheus_log = (tmp_path / "prometheus.log").open("w")
        prometheus = subprocess.Popen(
            [
                prometheus_bin,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=prometheus_log,
        )
        prom = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10)
        try:

            def query(expr: str) -> list[dict[str, Any]]:
                answer = prom.get("/api/v1/query", params={"query": expr}).json()
                assert answer["status"] == "success", (expr, answer)
                result: list[dict[str, Any]] = answer["data"]["result"]
                return result

            end = time.monotonic() + 90
            missing: list[tuple[str, str]] = []
            while time.monotonic() < end:
                for _ in range(3):  # calls to /detect keep coming, as in real use
                    assert c.post("/detect", content=bus).status_code == 200
                try:
                    missing = [
                        (title, expr)
                        for title, expr in _dashboard_queries()
                        if title not in NEEDS_A_GPU and not query(_concrete(expr))
                    ]
                except httpx.TransportError:  # Prometheus still starting
                    missing = [("prometheus", "not up")]
                if not missing:
                    break
                time.sleep(1)
            assert not missing, f"queries without data: {missing}"
            rules = prom.get("/api/v1/rules").json()["data"]["groups"][0]["rules"]
            assert {r["name"] for r in rules} == {
                r["alert"] for r in yaml.safe_load(ALERTS.read_text())["groups"][0]["rules"]
            }
            assert all(r["health"] == "ok" for r in rules), rules
            # The camera that is down is alerted on (pending for its 2 minutes), the live
            # one is not.
            pending: list[dict[str, Any]] = []
            while time.monotonic() < end and not pending:
                alerts = prom.get("/api/v1/alerts").json()["data"]["alerts"]
                pending = [a for a in alerts if a["labels"]["alertname"] == "StreamdetStreamDown"]
                time.sleep(0.5)
            assert [a["labels"]["stream"] for a in pending] == ["dead_cam"]
            assert pending[0]["state"] == "pending"
            assert query("streamdet_ready")[0]["value"][1] == "1"
        finally:
            prom.close()
            prometheus.terminate()
            prometheus.wait(10)
            prometheus_log.close()
