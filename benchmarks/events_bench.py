"""Event delivery benchmark: how soon line crossings and zone entries and exits reach a
webhook receiver, a server-sent-events client and a long-polling client, measured from the
decode of the frame they happened in (``captured_at``; same host clock).

It starts a real ``streamdet serve`` with a webhook to an HTTP receiver on loopback, adds
``--streams`` looping file streams of the car clip (tracked, a counting line across the middle
and a zone over the lower half), reads events the three ways for ``--seconds``, and reports
per channel: events received, latency p50/p99/max, and whether every channel got the same
events (none lost, none twice). Run::

    .venv/bin/python -m benchmarks.events_bench --streams 2 --seconds 60 \\
        --out benchmarks/results/<date>-cpu2-events.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from loadtest.server import ServerProcess

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("STREAMDET_SHARED_DIR", REPO.parent / "shared")).resolve()
GATE = {"name": "gate", "points": [[0.0, 0.5], [1.0, 0.5]]}
LOWER = {"name": "lower", "points": [[0.0, 0.5], [1.0, 0.5], [1.0, 1.0], [0.0, 1.0]]}


class WebhookReceiver:
    """An HTTP server on loopback that answers 503 to its first ``refuse`` POSTs and keeps
    the others' headers and bodies, with the time each arrived."""

    def __init__(self, refuse: int = 0) -> None:
        self.refuse = refuse
        self.refused = 0
        self.calls: list[tuple[float, dict[str, str], bytes]] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                at = time.time()
                with receiver._lock:
                    if receiver.refused < receiver.refuse:
                        receiver.refused += 1
                        self.send_response(503)
                    else:
                        receiver.calls.append((at, dict(self.headers.items()), body))
                        self.send_response(204)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/hooks/streamdet?token=x"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def events(self) -> list[dict[str, Any]]:
        """Every event received, in order."""
        return [e for _, e in self.timed()]

    def timed(self) -> list[tuple[float, dict[str, Any]]]:
        """Every event received, with the time its POST arrived."""
        with self._lock:
            return [(at, e) for at, _, body in self.calls for e in json.loads(body)["events"]]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _sse(base_url: str, got: list[tuple[float, dict[str, Any]]], stop: threading.Event) -> None:
    with (
        httpx.Client(base_url=base_url, timeout=None) as c,
        c.stream("GET", "/events", headers={"Accept": "text/event-stream"}) as sse,
    ):
        for line in sse.iter_lines():
            if line.startswith("data: "):
                got.append((time.time(), json.loads(line[6:])))
            if stop.is_set():
                return


def _long_poll(
    base_url: str, got: list[tuple[float, dict[str, Any]]], stop: threading.Event
) -> None:
    with httpx.Client(base_url=base_url, timeout=60) as c:
        cursor = c.get("/events", params={"limit": 1}).json()["next"]
        while not stop.is_set():
            page = c.get("/events", params={"after": cursor, "wait_s": 5, "limit": 1000}).json()
            at = time.time()
            got += [(at, e) for e in page["events"]]
            cursor = page["next"]


def _summary(timed: list[tuple[float, dict[str, Any]]]) -> dict[str, Any]:
    ms = np.array([(at - e["captured_at"]) * 1000.0 for at, e in timed]) if timed else None
    return {
        "events": len(timed),
        "latency_p50_ms": None if ms is None else round(float(np.percentile(ms, 50)), 1),
        "latency_p99_ms": None if ms is None else round(float(np.percentile(ms, 99)), 1),
        "latency_max_ms": None if ms is None else round(float(ms.max()), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--max-fps", type=float, default=8.0)
    parser.add_argument("--model", type=Path, default=SHARED / "models" / "yolov8n.pt")
    parser.add_argument("--clip", type=Path, default=SHARED / "videos" / "car-detection.mp4")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    receiver = WebhookReceiver()
    sse: list[tuple[float, dict[str, Any]]] = []
    polled: list[tuple[float, dict[str, Any]]] = []
    stop = threading.Event()
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess(
            {
                "model": str(args.model),
                "cache_dir": str(REPO / ".cache" / "streamdet"),
                "data_dir": tmp,
                "allowed_file_dir": str(args.clip.parent),
                "webhooks": receiver.url,
                "shutdown_timeout_s": 5,
            },
            log_path=Path(tmp) / "server.log",
        )
        with server, httpx.Client(base_url=server.base_url, timeout=60) as c:
            readers = [
                threading.Thread(target=_sse, args=(server.base_url, sse, stop), daemon=True),
                threading.Thread(
                    target=_long_poll, args=(server.base_url, polled, stop), daemon=True
                ),
            ]
            for reader in readers:
                reader.start()
            time.sleep(1.0)  # both readers connected before the first event
            for k in range(args.streams):
                c.post(
                    "/streams",
                    json={
                        "url": f"file://{args.clip}",
                        "name": f"cars-{k}",
                        "max_fps": args.max_fps,
                        "track": True,
                        "lines": [GATE],
                        "zones": [LOWER],
                    },
                ).raise_for_status()
            time.sleep(args.seconds)
            streams = c.get("/streams").json()["streams"]
            logged = c.get("/events", params={"limit": 1000}).json()
            stop.set()
            time.sleep(6.0)  # the long poll's last wait and the webhook's last batch
    receiver.close()
    hooked = receiver.timed()
    first_ids = {e["id"] for e in logged["events"]}
    report = {
        "benchmark": "events",
        "cores": os.cpu_count(),
        "streams": args.streams,
        "seconds": args.seconds,
        "max_fps": args.max_fps,
        "fps_processed": [round(s["fps_processed"], 2) for s in streams],
        "by_type": {
            t: sum(1 for e in logged["events"] if e["type"] == t)
            for t in ("line_crossing", "zone_enter", "zone_exit")
        },
        "webhook": _summary(hooked),
        "sse": _summary(sse),
        "long_poll": _summary(polled),
        "same_events": sorted(e["id"] for _, e in hooked if e["id"] in first_ids)
        == sorted(e["id"] for _, e in sse if e["id"] in first_ids)
        == sorted(e["id"] for _, e in polled if e["id"] in first_ids),
        "snapshots": sum(1 for e in logged["events"] if "snapshot" in e),
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
