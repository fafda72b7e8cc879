"""Live-stream benchmark: N looping RTSP cameras into a real ``streamdet serve``, measured at
the WebSocket.

For each camera count it starts the GStreamer test camera (``tests/rtsp_server.py``, one
mount per camera, same clip), a server process, adds the cameras, subscribes to each over
WebSocket, and after a warm-up measures for a fixed time:

* processed share: frames processed / frames decoded (from ``GET /streams``); with
  ``--motion`` the streams infer only what moves, and the share of still frames skipped and
  of the other frames processed are reported too;
* processed fps per stream, and slowest / fastest (fairness);
* frame latency p50/p99 (decode to publication: the message's ``latency_ms``; and decode to
  the client's receipt: receive time minus ``captured_at``, same host clock);
* the server process's CPU (user + system seconds per second, from ``/proc``) and the share
  of the frames that came in that were decoded: with ``--max-fps`` at or under the clip's
  keyframe rate only keyframes are (``--keyframe-decode false`` on the server: all);
* with ``--job VIDEO``, a video job (``POST /jobs``, every frame) kept running through the
  measured time, and the frames/s it got: the live figures beside a run without one show
  what the background lane costs the cameras.

Run (about 30 s per camera count; the machine is shared, so figures vary)::

    .venv/bin/python -m benchmarks.streams_bench --cameras 3 8 --imgsz 416 \\
        --out artifacts/streams_bench.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import websockets

from loadtest.server import ServerProcess, free_port

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("STREAMDET_SHARED_DIR", REPO.parent / "shared"))


class Child:
    """A child process whose stderr/stdout is drained; ``wait_for`` blocks on a log line."""

    def __init__(self, cmd: list[str], env: dict[str, str], ready_text: str) -> None:
        self.log: deque[str] = deque(maxlen=100)
        self._ready = threading.Event()
        self._text = ready_text
        self.proc = subprocess.Popen(
            cmd,
            env={**os.environ, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.append(line.rstrip())
            if self._text in line:
                self._ready.set()
        self._ready.set()

    def wait_ready(self, timeout_s: float) -> None:
        if not self._ready.wait(timeout_s) or self.proc.poll() is not None:
            self.stop()
            raise RuntimeError("child did not start:\n" + "\n".join(self.log))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._thread.join(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds the process ``pid`` and its live children (decode processes)
    have used (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    used = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            children = (task / "children").read_text().split()
        except OSError:  # the thread ended
            continue
        for child in children:
            with contextlib.suppress(OSError):  # the child ended
                used += cpu_seconds(int(child))
    return used


async def keep_a_job_running(
    client: httpx.AsyncClient,
    base: str,
    video: Path,
    until: float,
    samples: list[tuple[float, int]],
) -> None:
    """Upload ``video`` as a job, again each time one ends, until ``until``; ``samples``
    gets ``(monotonic, frames processed by every job so far)``."""
    data = await asyncio.to_thread(video.read_bytes)
    done_before = 0
    while time.monotonic() < until:
        created = await client.post(
            f"{base}/jobs", files={"video": (video.name, data, "video/mp4")}
        )
        created.raise_for_status()
        job_id = created.json()["id"]
        while True:
            job = (await client.get(f"{base}/jobs/{job_id}")).json()
            processed = job["progress"]["frames_processed"]
            samples.append((time.monotonic(), done_before + processed))
            if job["state"] not in ("queued", "running"):
                done_before += processed
                break
            if time.monotonic() >= until:
                await client.delete(f"{base}/jobs/{job_id}")
                return
            await asyncio.sleep(0.5)


def processed_between(samples: list[tuple[float, int]], start: float, end: float) -> int:
    """Job frames processed from ``start`` to ``end`` (the samples nearest inside)."""
    inside = [n for t, n in samples if start <= t <= end]
    return inside[-1] - inside[0] if len(inside) > 1 else 0


async def measure(
    base: str,
    ws_base: str,
    ids: list[str],
    warmup_s: float,
    seconds_s: float,
    *,
    pid: int,
    job: Path | None = None,
) -> dict[str, Any]:
    counts = dict.fromkeys(ids, 0)
    server_lat: list[float] = []
    client_lat: list[float] = []
    t_start = time.monotonic() + warmup_s
    t_end = t_start + seconds_s

    async def watch(sid: str) -> None:
        async with websockets.connect(f"{ws_base}/ws/streams/{sid}", open_timeout=30) as ws:
            while time.monotonic() < t_end:
                try:
                    text = await asyncio.wait_for(ws.recv(), max(0.1, t_end - time.monotonic()))
                except TimeoutError:
                    break
                now_wall, now = time.time(), time.monotonic()
                if now < t_start:
                    continue
                msg = json.loads(text)
                counts[sid] += 1
                server_lat.append(msg["latency_ms"])
                client_lat.append((now_wall - msg["captured_at"]) * 1000)

    async with httpx.AsyncClient(timeout=30) as client:

        async def snapshot() -> dict[str, dict[str, Any]]:
            streams = (await client.get(f"{base}/streams")).json()["streams"]
            return {s["id"]: s for s in streams}

        tasks = [asyncio.create_task(watch(sid)) for sid in ids]
        job_samples: list[tuple[float, int]] = []
        job_task = None
        if job is not None:
            job_task = asyncio.create_task(
                keep_a_job_running(client, base, job, t_end, job_samples)
            )
        await asyncio.sleep(warmup_s)
        before, cpu_before, wall_before = await snapshot(), cpu_seconds(pid), time.monotonic()
        await asyncio.gather(*tasks)
        after, cpu_after, wall_after = await snapshot(), cpu_seconds(pid), time.monotonic()
        if job_task is not None:
            await job_task

    per_stream = {}
    for sid in ids:
        frames_in = after[sid]["frames_in"] - before[sid]["frames_in"]
        processed = after[sid]["frames_processed"] - before[sid]["frames_processed"]
        per_stream[sid] = {
            "frames_in": frames_in,
            "decoded": after[sid]["frames_decoded"] - before[sid]["frames_decoded"],
            "keyframes_only": after[sid]["keyframes_only"],
            "processed": processed,
            "drops": after[sid]["drops"] - before[sid]["drops"],
            "motion_skipped": after[sid]["motion_skipped"] - before[sid]["motion_skipped"],
            "reconnects": after[sid]["reconnects"],
            "ws_messages": counts[sid],
            "fps_in": frames_in / seconds_s,
            "fps_processed": processed / seconds_s,
        }
    fps = [s["fps_processed"] for s in per_stream.values()]
    total_in = sum(s["frames_in"] for s in per_stream.values())
    total_done = sum(s["processed"] for s in per_stream.values())
    still = sum(s["motion_skipped"] for s in per_stream.values())
    decoded = sum(s["decoded"] for s in per_stream.values())
    return {
        "cameras": len(ids),
        "seconds": seconds_s,
        "server_cpu_per_s": (cpu_after - cpu_before) / (wall_after - wall_before),
        "decoded_share": decoded / max(total_in, 1),
        "processed_share": total_done / max(total_in, 1),
        "fps_in_total": total_in / seconds_s,
        "fps_processed_total": total_done / seconds_s,
        "motion_skipped_share": still / max(total_in, 1),
        # Of the frames that were to be inferred (not skipped as still), the share that was.
        "wanted_processed_share": total_done / max(total_in - still, 1),
        "fairness_min_over_max": min(fps) / max(*fps, 1e-9),
        "latency_ms_p50": float(np.percentile(server_lat, 50)) if server_lat else None,
        "latency_ms_p99": float(np.percentile(server_lat, 99)) if server_lat else None,
        "client_latency_ms_p50": float(np.percentile(client_lat, 50)) if client_lat else None,
        "client_latency_ms_p99": float(np.percentile(client_lat, 99)) if client_lat else None,
        "job": None if job is None else job.name,
        "job_fps": None
        if job is None
        else processed_between(job_samples, t_start, t_end) / seconds_s,
        "streams": per_stream,
    }


def run_scenario(cameras: int, args: argparse.Namespace) -> dict[str, Any]:
    rtsp_port = free_port()
    mounts = [f"--mount=cam{i}={args.clip}" for i in range(cameras)]
    camera = Child(
        [
            "/usr/bin/python3",
            str(REPO / "tests" / "rtsp_server.py"),
            "--port",
            str(rtsp_port),
            *mounts,
        ],
        {},
        "READY",
    )
    camera.wait_ready(60)
    data_dir = tempfile.mkdtemp(prefix="streamdet-bench-")
    settings: dict[str, object] = {
        "model": args.model,
        "imgsz": args.imgsz,
        "data_dir": data_dir,
        "access_log": False,
    }
    log_path = Path(data_dir) / "server.log"
    server = ServerProcess(settings, log_path=log_path, args=args.server_args, cwd=Path.cwd())
    try:
        server.start()
        ids = []
        for i in range(cameras):
            resp = httpx.post(
                f"{server.base_url}/streams",
                json={
                    "url": f"rtsp://127.0.0.1:{rtsp_port}/cam{i}",
                    "motion": args.motion,
                    "max_fps": args.max_fps,
                },
                timeout=30,
            )
            resp.raise_for_status()
            ids.append(resp.json()["id"])
            if i < cameras - 1:
                time.sleep(args.stagger_s)  # each camera's clip at another point
        return asyncio.run(
            measure(
                server.base_url,
                server.ws_url,
                ids,
                args.warmup_seconds,
                args.seconds,
                pid=server.pid,
                job=args.job,
            )
        )
    finally:
        server.stop()
        camera.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cameras", type=int, nargs="+", default=[3, 8])
    parser.add_argument("--imgsz", type=int, default=416)
    parser.add_argument("--model", type=Path, default=SHARED / "models" / "yolov8n.pt")
    parser.add_argument("--clip", type=Path, default=SHARED / "videos" / "car-detection.mp4")
    parser.add_argument("--seconds", type=float, default=15.0, help="measured time per run")
    parser.add_argument("--warmup-seconds", type=float, default=5.0)
    parser.add_argument("--motion", action="store_true", help="streams infer only motion")
    parser.add_argument(
        "--max-fps", type=float, default=None, help="each stream's max_fps (default: every frame)"
    )
    parser.add_argument(
        "--stagger-s",
        type=float,
        default=0.0,
        help="seconds between adding cameras, so their clips do not move at the same moments",
    )
    parser.add_argument(
        "--job", type=Path, default=None, help="keep a video job of this file running"
    )
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    parser.add_argument("server_args", nargs="*", help="extra `streamdet serve` flags, after --")
    args = parser.parse_args()
    results = []
    for n in args.cameras:
        r = run_scenario(n, args)
        results.append(r)
        print(
            f"{n} cameras: processed {r['processed_share'] * 100:.1f}% of"
            f" {r['fps_in_total']:.1f} fps in ({r['fps_processed_total']:.1f} fps out),"
            f" slowest/fastest {r['fairness_min_over_max']:.2f},"
            f" latency p50 {r['latency_ms_p50']:.0f} ms p99 {r['latency_ms_p99']:.0f} ms,"
            f" {r['motion_skipped_share'] * 100:.1f}% still (skipped), wanted frames processed"
            f" {r['wanted_processed_share'] * 100:.1f}%"
            f" (at client: p50 {r['client_latency_ms_p50']:.0f} p99"
            f" {r['client_latency_ms_p99']:.0f} ms); server CPU {r['server_cpu_per_s']:.2f}"
            f" s/s, {r['decoded_share'] * 100:.1f}% of the frames decoded"
            + ("" if r["job"] is None else f"; a job beside them got {r['job_fps']:.1f} fps"),
            flush=True,
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"cpu_cores": os.cpu_count(), "runs": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
