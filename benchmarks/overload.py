"""Overload benchmark: does admission control keep accepted latency and goodput far past
capacity? All phases run in one go on this machine (~3 minutes with the defaults)::

    .venv/bin/python -m benchmarks.overload --out loadtest-results/overload.json

1. **engine ceiling**: ONNX Runtime alone, batch 1, a 640x640 input, no HTTP (images/s);
2. a real ``streamdet serve`` process (the server's defaults unless ``--max-batch`` is given);
3. **idle latency**: one request at a time (median of ``--idle-requests``);
4. **capacity**: a few closed-loop clients (goodput = 200s per second);
5. **overload**: ``--clients`` (64) closed-loop clients; a 429 client sleeps ``Retry-After``
   as the contract asks (``--impatient``: retries after 50 ms instead);
6. **below capacity**: open-loop Poisson arrivals at half the measured capacity.

Checks (issue 5): under overload no status other than 200 and 429 (a 5xx, a client timeout,
a dropped connection all fail it), accepted p99 <= 1000 ms, goodput >= 0.8x the engine
ceiling; below capacity every call answered 200 and p99 <= 2.5x the idle latency. Every call
started in a phase is counted, the slowest ones ending after it too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loadtest.client import closed_loop, one_at_a_time, open_loop
from loadtest.frames import build_payloads, shared_dir
from loadtest.server import ServerProcess
from server.bench import engine_ceiling
from server.settings import Settings
from streams.files import sample_video_frames


def server_buckets(base: str) -> dict[str, dict[float, float]]:
    """Cumulative counts (le -> count) of the server's /detect total-latency histogram
    (``total``) and of its event-loop lag (``loop_lag``)."""
    text = httpx.get(f"{base}/metrics", timeout=30).text
    out: dict[str, dict[float, float]] = {"total": {}, "loop_lag": {}}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.endswith("_bucket"):
                continue
            if family.name == "streamdet_detect_stage_duration_seconds":
                if s.labels["stage"] == "total":
                    out["total"][float(s.labels["le"])] = s.value
            elif family.name == "streamdet_event_loop_lag_seconds":
                out["loop_lag"][float(s.labels["le"])] = s.value
    return out


def bucket_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """Upper bound (ms) of the histogram bucket holding quantile ``q`` of what was added."""
    delta = {le: after[le] - before.get(le, 0.0) for le in sorted(after)}
    total = delta[math.inf]
    for le, count in delta.items():
        if total and count >= q * total:
            return le * 1000
    return math.nan


async def idle_latency(base: str, jpegs: list[bytes], count: int) -> float:
    """Median latency of ``count`` requests sent one at a time."""
    return (await one_at_a_time(base, jpegs, count)).pct(50)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(shared_dir() / "models" / "yolov8n.pt"))
    parser.add_argument("--max-batch", type=int, default=0, help="0 = the backend default")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--overload-seconds", type=float, default=60.0)
    parser.add_argument("--capacity-seconds", type=float, default=8.0)
    parser.add_argument("--open-loop-seconds", type=float, default=60.0)
    parser.add_argument("--ceiling-seconds", type=float, default=5.0)
    parser.add_argument("--idle-requests", type=int, default=8)
    parser.add_argument("--impatient", action="store_true", help="retry 429s after 50 ms")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    args = parser.parse_args(argv)

    clips = sorted((shared_dir() / "videos").glob("*.mp4"))
    jpegs = [p.jpeg for p in build_payloads(clips, per_clip=10, sizes=None)]
    settings = Settings(model=args.model, max_batch=args.max_batch)
    frame = sample_video_frames(clips[0], 1)[0]
    ceiling = engine_ceiling(settings, frame, args.ceiling_seconds)
    print(f"engine ceiling (onnxruntime, batch 1, 640x640): {ceiling:.2f} img/s")

    server_settings: dict[str, object] = {"model": args.model, "max_batch": args.max_batch}
    out_dir = args.out.parent if args.out else Path("loadtest-results")
    with ServerProcess(server_settings, log_path=out_dir / "overload-server.log") as server:
        base = server.base_url
        idle_ms = asyncio.run(idle_latency(base, jpegs, args.idle_requests))
        print(f"idle single-request latency (median): {idle_ms:.0f} ms")
        cap = asyncio.run(
            closed_loop(base, jpegs, clients=3, seconds=args.capacity_seconds, warmup=2.0)
        )
        capacity = cap.goodput
        print(f"capacity (3 closed-loop clients): {capacity:.2f} img/s, p99 {cap.pct(99):.0f} ms")
        buckets_before = server_buckets(base)
        over = asyncio.run(
            closed_loop(
                base,
                jpegs,
                clients=args.clients,
                seconds=args.overload_seconds,
                warmup=3.0,
                impatient=args.impatient,
            )
        )
        buckets_after = server_buckets(base)
        server_p50 = bucket_quantile(buckets_before["total"], buckets_after["total"], 0.5)
        server_p99 = bucket_quantile(buckets_before["total"], buckets_after["total"], 0.99)
        lag_p99 = bucket_quantile(buckets_before["loop_lag"], buckets_after["loop_lag"], 0.99)
        print(f"overload ({args.clients} clients): {over.summary()}")
        print(
            f"  server-side (handler entry to response, histogram bucket bounds):"
            f" p50 <= {server_p50:.0f} ms, p99 <= {server_p99:.0f} ms;"
            f" event-loop lag p99 <= {lag_p99:.1f} ms"
        )
        below = asyncio.run(open_loop(base, jpegs, capacity / 2, args.open_loop_seconds))
        print(f"open loop at {capacity / 2:.2f}/s: {below.summary()}")

    checks = {
        "overload_only_200_or_429": not over.unexpected,
        "overload_accepted_p99_le_1000ms": over.pct(99) <= 1000,
        "overload_goodput_ge_0.8x_ceiling": over.goodput >= 0.8 * ceiling,
        "below_capacity_all_200": not below.errors,
        "below_capacity_p99_le_2.5x_idle": below.pct(99) <= 2.5 * idle_ms,
    }
    found = {
        "overload_only_200_or_429": f"other statuses: {over.unexpected}",
        "below_capacity_all_200": f"other statuses: {below.errors}",
    }
    figures = {
        "engine_ceiling_img_s": round(ceiling, 3),
        "idle_latency_ms": round(idle_ms, 1),
        "capacity_img_s": round(capacity, 3),
        "overload": {
            **over.summary(),
            "clients": args.clients,
            "impatient": args.impatient,
            "goodput_over_ceiling": round(over.goodput / ceiling, 3),
            "server_p50_ms_le": server_p50,
            "server_p99_ms_le": server_p99,
            "event_loop_lag_p99_ms_le": lag_p99,
        },
        "below_capacity": {
            **below.summary(),
            "rate_per_s": round(capacity / 2, 3),
            "p99_over_idle": round(below.pct(99) / idle_ms, 3),
        },
        "checks": checks,
    }
    for name, ok in checks.items():
        note = "" if ok or name not in found else f" ({found[name]})"
        print(f"{'ok    ' if ok else 'MISSED'} {name}{note}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(figures, indent=2))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
