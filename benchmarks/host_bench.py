"""Host cost per frame: what the server's own Python spends on each live frame, beside an
engine that costs nothing.

On a GPU the engine's host side is short and runs beside everything else in one process
under one interpreter lock: the readers' hand-over, the latest-frame lane and batching, the
fan-out of results (analytics, publication on the event loop). That cost per frame caps the
frames/s the server can feed a GPU whatever the GPU, so it is measured here on the CPU.

The run is the server's own path in this process: a :class:`~streams.manager.StreamManager`
with ``--streams`` looping file streams (the shared clips) played at ``--fps`` each (a
camera's rate; 0: as fast as they decode, where frames the pool cannot take are dropped and
still cost the server their hand-over), decoded in
``--decode-processes`` child processes (0: decode threads here), feeding an
:class:`~engines.pool.EnginePool` of :class:`NullEngine` workers. A null engine sleeps
``--infer-ms`` per batch (a GPU's time, which holds no lock) and returns two boxes per image.
After a warm-up it reports frames/s published and this process's CPU per published frame,
split by thread (decode hub, engine workers, event loop, the rest; with decode threads, their
decoding too); the decode processes' CPU is reported apart (it is not the server's).

Run::

    .venv/bin/python -m benchmarks.host_bench --streams 32 --fps 30 --seconds 10 \\
        --out benchmarks/results/<date>-cpu2-host.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from engines.pool import EnginePool
from engines.types import Detections, DetectParams, Image
from streams.fanout import ProcessedFrame
from streams.manager import ManagerOptions, StreamManager
from streams.reader import ReaderOptions
from streams.store import StreamStore

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("STREAMDET_SHARED_DIR", REPO.parent / "shared"))
NAMES = {i: f"class{i}" for i in range(80)}
GROUPS = {
    "decode-hub": "decode_hub",
    "stream-": "decode_threads",  # --decode-processes 0: each stream decodes here
    "engine-worker": "engine_workers",
    "MainThread": "loop",
}


class NullEngine:
    """An engine whose ``infer`` sleeps ``infer_s`` (no interpreter lock held, as on a GPU)
    and finds the same two boxes in every image."""

    def __init__(self, infer_s: float, max_batch: int) -> None:
        self._infer_s = infer_s
        self._max_batch = max_batch
        self._boxes = np.array([[10, 10, 100, 100], [200, 120, 300, 300]], np.float32)
        self._scores = np.array([0.9, 0.5], np.float32)
        self._classes = np.array([0, 2], np.int32)

    @property
    def names(self) -> Mapping[int, str]:
        return NAMES

    @property
    def input_size(self) -> int:
        return 640

    @property
    def max_batch(self) -> int:
        return self._max_batch

    @property
    def model_name(self) -> str:
        return "null"

    def load(self) -> None:
        pass

    def warmup(self) -> None:
        pass

    def close(self) -> None:
        pass

    def infer(self, images: Sequence[Image], params: Sequence[DetectParams]) -> list[Detections]:
        time.sleep(self._infer_s)
        return [
            Detections(
                boxes=self._boxes.copy(),
                scores=self._scores.copy(),
                class_ids=self._classes.copy(),
                names=NAMES,
                width=int(im.shape[1]),
                height=int(im.shape[0]),
            )
            for im in images
        ]


def _cpu_s(stat_path: str) -> float:
    """User + system CPU seconds from a ``/proc/.../stat`` file (0 once it is gone)."""
    try:
        with open(stat_path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds (user + system) of this process's live threads, by thread group."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        name = names.get(int(tid), "")
        group = next((g for prefix, g in GROUPS.items() if name.startswith(prefix)), "other")
        out[group] = out.get(group, 0.0) + _cpu_s(f"/proc/self/task/{tid}/stat")
    return out


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    clips = sorted((SHARED / "videos").glob("*.mp4"))
    if not clips:
        raise SystemExit(f"no clips in {SHARED / 'videos'} (setting STREAMDET_SHARED_DIR)")
    pool = EnginePool(
        lambda: NullEngine(args.infer_ms / 1000.0, args.max_batch),
        workers=args.workers,
        max_batch=args.max_batch,
        max_wait_ms=args.max_wait_ms,
        max_queue=64,
    )
    pool.start()
    options = ManagerOptions(
        reader=ReaderOptions(file_fps=args.fps, keyframe_decode=False),
        allowed_file_dir=clips[0].parent,
        decode_processes=args.decode_processes,
        max_streams=max(64, args.streams),
    )
    published = 0
    latencies: list[float] = []

    def count(frame: ProcessedFrame) -> None:
        nonlocal published
        published += 1
        latencies.append(frame.latency_ms)

    with tempfile.TemporaryDirectory() as data:
        manager = StreamManager(pool, StreamStore(Path(data)), options)
        await manager.start()
        manager.frame_observers.append(count)
        try:
            for k in range(args.streams):
                await manager.add(clips[k % len(clips)].as_uri(), loop=True)
            await asyncio.sleep(args.warmup)
            pids = manager.decode_pids()
            cpu0, n0, t0 = thread_cpu_s(), published, time.monotonic()
            kids0 = sum(_cpu_s(f"/proc/{pid}/stat") for pid in pids)
            batches0, items0 = pool.stats.batches, pool.stats.items
            del latencies[:]
            await asyncio.sleep(args.seconds)
            cpu1, n1, t1 = thread_cpu_s(), published, time.monotonic()
            kids1 = sum(_cpu_s(f"/proc/{pid}/stat") for pid in pids)
            batches, items = pool.stats.batches - batches0, pool.stats.items - items0
            streams = manager.list()
        finally:
            await manager.stop(10.0)
            pool.stop(10.0)
    frames = max(n1 - n0, 1)
    by_group = {g: cpu1.get(g, 0.0) - cpu0.get(g, 0.0) for g in sorted(set(cpu0) | set(cpu1))}
    server_s = sum(by_group.values())
    lat = np.array(latencies or [0.0])
    return {
        "frames_per_s": round((n1 - n0) / (t1 - t0), 1),
        "server_cpu_us_per_frame": round(server_s / frames * 1e6, 1),
        "server_cpu_us_per_frame_by_thread": {
            g: round(s / frames * 1e6, 1) for g, s in by_group.items()
        },
        "server_cpu_s_per_s": round(server_s / (t1 - t0), 3),
        "decode_processes_cpu_s_per_s": round((kids1 - kids0) / (t1 - t0), 3),
        "mean_batch": round(items / max(batches, 1), 1),
        "frame_latency_p50_ms": round(float(np.percentile(lat, 50)), 2),
        "frame_latency_p99_ms": round(float(np.percentile(lat, 99)), 2),
        "drops": sum(int(s["drops"]) for s in streams),
        "frames_copied": sum(int(s.get("frames_copied", 0)) for s in streams),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--fps", type=float, default=30.0, help="per stream; 0: unpaced")
    parser.add_argument("--decode-processes", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2, help="engine workers")
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--max-wait-ms", type=float, default=2.0)
    parser.add_argument("--infer-ms", type=float, default=2.0, help="null engine, per batch")
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    result = {
        "benchmark": "host_bench",
        "machine": f"{platform.machine()} {os.cpu_count()} cpus",
        "python": platform.python_version(),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        **asyncio.run(measure(args)),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
