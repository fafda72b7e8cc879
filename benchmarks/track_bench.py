"""Time the stream tracker (``streams.track.Tracker.update``) per frame, on synthetic scenes of
``--objects`` boxes moving at random constant velocities: what tracking adds to each frame of a
tracked stream, on the engine worker thread.

    .venv/bin/python -m benchmarks.track_bench --objects 10 50 300
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from engines.types import Detections
from streams.track import Tracker

FRAME_DT_S = 1 / 30


def scene(objects: int, frames: int, seed: int) -> list[Detections]:
    rng = np.random.default_rng(seed)
    xy = rng.uniform(0, 1800, (objects, 2))
    size = rng.uniform(30, 120, (objects, 2))
    velocity = rng.uniform(-200, 200, (objects, 2))  # px/s
    out = []
    for k in range(frames):
        at = xy + velocity * k * FRAME_DT_S
        boxes = np.concatenate([at, at + size], axis=1).astype(np.float32)
        out.append(
            Detections(
                boxes=boxes,
                scores=np.full(objects, 0.8, np.float32),
                class_ids=np.zeros(objects, np.int32),
                names={0: "person"},
                width=1920,
                height=1080,
            )
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--objects", type=int, nargs="+", default=[10, 50, 300])
    parser.add_argument("--frames", type=int, default=300)
    args = parser.parse_args()
    report = []
    for objects in args.objects:
        frames = scene(objects, args.frames, seed=objects)
        tracker = Tracker()
        times_ms = []
        for k, dets in enumerate(frames):
            start = time.perf_counter()
            tracker.update(dets, k * FRAME_DT_S)
            times_ms.append((time.perf_counter() - start) * 1000)
        times_ms.sort()
        report.append(
            {
                "objects": objects,
                "frames": args.frames,
                "p50_ms": round(statistics.median(times_ms), 3),
                "p99_ms": round(times_ms[int(0.99 * (len(times_ms) - 1))], 3),
                "tracks": len(tracker),
            }
        )
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
