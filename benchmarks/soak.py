"""Soak: mixed load for a long time; the server's RSS, open file descriptors and threads must
not grow (issue 5: under 5 % from start to end). Not part of CI::

    .venv/bin/python -m benchmarks.soak --minutes 10 --out loadtest-results/soak.json

A real ``streamdet serve`` process gets ``--clients`` closed-loop ``/detect`` clients (real
frames at four sizes, a short think time) and ``--viewers`` WebSocket viewers on a looping
file stream of the car clip, tracked, with a counting line and a zone, event clips and motion
gating, so events flow all along: logged (and kept on disk), drawn as snapshots, recorded as
clips, POSTed to a webhook receiver on
loopback and streamed to a server-sent-events reader. The process is sampled from ``/proc``
every ``--sample-s`` seconds; the start figures are taken after ``--warmup-s`` (arenas,
thread pools and caches fill up first). It passes only while the server keeps serving: every
sampling interval must see ``/detect`` answered 200 and WebSocket frames arrive, and no
``/detect`` call may end in anything but 200 or 429 (a server that hung or died would
otherwise pass with flat figures).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from benchmarks.events_bench import GATE, LOWER, WebhookReceiver
from loadtest.frames import build_payloads, shared_dir
from loadtest.server import ServerProcess

GROWTH_LIMIT = 0.05
EXPECTED = ("200", "429")  # /detect statuses a healthy server answers with


@dataclass(frozen=True)
class Sample:
    """One look at the server process."""

    t_s: float
    rss_bytes: int
    open_fds: int
    threads: int


def sample(pid: int, t0: float) -> Sample:
    """RSS, open descriptors and threads of ``pid`` from ``/proc``."""
    fields: dict[str, str] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return Sample(
        t_s=round(time.monotonic() - t0, 1),
        rss_bytes=int(fields["VmRSS"].split()[0]) * 1024,
        open_fds=len(os.listdir(f"/proc/{pid}/fd")),
        threads=int(fields["Threads"]),
    )


async def detect_client(
    base: str, jpegs: list[bytes], k: int, stop: asyncio.Event, progress: dict[str, int]
) -> dict[str, int]:
    """Post frames until ``stop``; counts by status (the 200s also in ``progress``)."""
    counts: dict[str, int] = {}
    i = k
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        while not stop.is_set():
            try:
                resp = await client.post(
                    "/detect",
                    content=jpegs[i % len(jpegs)],
                    headers={"content-type": "image/jpeg"},
                )
                status = str(resp.status_code)
                pause = float(resp.headers.get("retry-after", "0.2")) if status == "429" else 0.2
            except httpx.HTTPError as exc:
                status, pause = type(exc).__name__, 1.0
            counts[status] = counts.get(status, 0) + 1
            progress["detect_200"] += status == "200"
            i += 7
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), pause)
    return counts


async def viewer(base: str, stream_id: str, stop: asyncio.Event, progress: dict[str, int]) -> int:
    """Watch a stream until ``stop``, reconnecting after a close; frames received (also
    counted in ``progress``)."""
    frames = 0
    url = base.replace("http://", "ws://") + f"/ws/streams/{stream_id}"
    while not stop.is_set():
        try:
            async with connect(url) as ws:
                while not stop.is_set():
                    try:
                        await asyncio.wait_for(ws.recv(), 15)
                        frames += 1
                        progress["ws_frames"] += 1
                    except TimeoutError:
                        continue
        except (ConnectionClosed, OSError):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
    return frames


async def soak(args: argparse.Namespace, server: ServerProcess) -> dict[str, object]:
    base = server.base_url
    jpegs = [p.jpeg for p in build_payloads(per_clip=8)]
    clip = shared_dir() / "videos" / "car-detection.mp4"
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        resp = await client.post(
            "/streams",
            json={
                "url": clip.resolve().as_uri(),
                "name": "soak",
                "max_fps": args.stream_fps,
                "loop": True,
                "track": True,
                "lines": [GATE],
                "zones": [{**LOWER, "inertia": 1}],
                "clips": True,  # each event's video written too
                "motion": True,  # and still frames skipped
            },
        )
        resp.raise_for_status()
        stream_id = str(resp.json()["id"])
    stop = asyncio.Event()
    progress = {"detect_200": 0, "ws_frames": 0}
    tasks = [
        asyncio.create_task(detect_client(base, jpegs, k, stop, progress))
        for k in range(args.clients)
    ]
    views = [
        asyncio.create_task(viewer(base, stream_id, stop, progress)) for _ in range(args.viewers)
    ]
    sse = asyncio.create_task(event_reader(base, stop))
    t0 = time.monotonic()
    samples: list[Sample] = []
    seen: list[dict[str, int]] = []  # progress at each sample
    end = t0 + args.minutes * 60
    await asyncio.sleep(min(args.warmup_s, args.minutes * 60 / 4))
    while time.monotonic() < end:
        samples.append(sample(server.pid, t0))
        seen.append(dict(progress))
        print(
            f"t={samples[-1].t_s:7.1f}s rss={samples[-1].rss_bytes / 2**20:7.1f} MiB"
            f" fds={samples[-1].open_fds} threads={samples[-1].threads}",
            flush=True,
        )
        await asyncio.sleep(max(0.0, min(args.sample_s, end - time.monotonic())))
    samples.append(sample(server.pid, t0))
    seen.append(dict(progress))
    stop.set()
    counts: dict[str, int] = {}
    for result in await asyncio.gather(*tasks):
        for status, n in result.items():
            counts[status] = counts.get(status, 0) + n
    frames = sum(await asyncio.gather(*views))
    streamed = await sse
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        await client.delete(f"/streams/{stream_id}")
    # Serving all along: each interval between samples saw 200s and frames.
    stalls = [
        {"from_s": a.t_s, "to_s": b.t_s, **{k: n1[k] - n0[k] for k in n1}}
        for a, b, n0, n1 in zip(samples, samples[1:], seen, seen[1:], strict=False)
        if any(n1[k] == n0[k] for k in n1)
    ]
    unexpected = {s: n for s, n in counts.items() if s not in EXPECTED}
    first, last = samples[0], samples[-1]
    # Each figure at the end is the least of the last three samples: a leak raises them all,
    # while a thread or descriptor that lives for a moment (a file stream reopening its
    # decoder at the end of each loop) caught by one sample is no growth.
    tail = samples[-3:]
    growth = {
        "rss": min(s.rss_bytes for s in tail) / first.rss_bytes - 1,
        "open_fds": min(s.open_fds for s in tail) / first.open_fds - 1,
        "threads": min(s.threads for s in tail) / first.threads - 1,
    }
    checks = {
        "growth_under_limit": all(v < GROWTH_LIMIT for v in growth.values()),
        "served_every_interval": not stalls and len(samples) > 1,
        "detect_only_200_or_429": not unexpected,
    }
    return {
        "minutes": args.minutes,
        "detect_statuses": counts,
        "stalls": stalls,
        "ws_frames": frames,
        "events_streamed": streamed,
        "start": asdict(first),
        "end": asdict(last),
        "growth": {k: round(v, 4) for k, v in growth.items()},
        "checks": checks,
        "passed": all(checks.values()),
        "samples": [asdict(s) for s in samples],
    }


async def event_reader(base: str, stop: asyncio.Event) -> int:
    """Reads ``GET /events`` as server-sent events until ``stop``; the events it got."""
    got = 0

    async def read() -> None:
        nonlocal got
        headers = {"Accept": "text/event-stream"}
        async with (
            httpx.AsyncClient(base_url=base, timeout=None) as client,
            client.stream("GET", "/events", headers=headers) as resp,
        ):
            async for line in resp.aiter_lines():
                got += line.startswith("data: ")

    task = asyncio.create_task(read())
    await stop.wait()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return got


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--viewers", type=int, default=2)
    parser.add_argument("--stream-fps", type=float, default=2.0)
    parser.add_argument("--warmup-s", type=float, default=60.0)
    parser.add_argument("--sample-s", type=float, default=30.0)
    parser.add_argument("--max-batch", type=int, default=0, help="0 = the backend default")
    parser.add_argument("--model", default=str(shared_dir() / "models" / "yolov8n.pt"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    out_dir = args.out.parent if args.out else Path("loadtest-results")
    settings: dict[str, object] = {
        "model": args.model,
        "max_batch": args.max_batch,
        "allowed_file_dir": str(shared_dir() / "videos"),
        "data_dir": str(out_dir / "soak-data"),
    }
    shutil.rmtree(out_dir / "soak-data", ignore_errors=True)  # no streams of an earlier run
    receiver = WebhookReceiver()
    settings["webhooks"] = receiver.url
    try:
        with ServerProcess(settings, log_path=out_dir / "soak-server.log") as server:
            report = asyncio.run(soak(args, server))
    finally:
        receiver.close()
    report["events_to_webhook"] = len(receiver.events())
    report["event_clips"] = len(list((out_dir / "soak-data" / "clips").glob("*.mp4")))
    summary = {k: v for k, v in report.items() if k != "samples"}
    print(json.dumps(summary, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    checks = report["checks"]
    assert isinstance(checks, dict)
    missed = [name for name, ok in checks.items() if not ok]
    print(
        "PASS"
        if report["passed"]
        else f"FAIL: {', '.join(missed)} (growth limit {GROWTH_LIMIT:.0%})"
    )
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
