"""Motion gating on the shared clips: how many frames a stream with ``motion`` on infers, and
whether it still counts what a stream inferring every frame counts.

Each clip is decoded at its own rate (every frame, and every second frame); the real model
(ONNX Runtime) runs once on every frame, then the stream's analytics (tracking, a counting line
across the middle, a zone over the left half) run twice: on every frame, and on the frames
the motion gate (``streams.motion``, the server's defaults) lets through, each at its own
time, as a stream would see them.

    .venv/bin/python -m benchmarks.motion_bench --out benchmarks/results/x.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import av
import numpy as np
import numpy.typing as npt

from benchmarks.track_bench import cpu_engine
from engines.types import Detections, DetectParams
from streams.analytics import StreamAnalytics
from streams.detect import LOW_CONF, StreamDetect
from streams.lines import parse_lines
from streams.motion import MotionGate, MotionOptions
from streams.zones import parse_zones

SETTINGS = StreamDetect(
    DetectParams(),
    track=True,
    lines=parse_lines([{"name": "middle", "points": [[0, 0.5], [1, 0.5]]}]),
    zones=parse_zones([{"name": "left", "points": [[0, 0], [0.5, 0], [0.5, 1], [0, 1]]}]),
)


def rgb(frame: Any) -> npt.NDArray[np.uint8]:
    image: npt.NDArray[np.uint8] = frame.to_ndarray(format="rgb24")
    return image


def counted(found: list[tuple[float, Detections]]) -> dict[str, Any]:
    """What a tracked stream with a line and a zone counts from these frames."""
    analytics = StreamAnalytics()
    events: Counter[str] = Counter()
    for k, (at, detections) in enumerate(found):
        done = analytics.process(detections, SETTINGS, at, k)
        for event in done.events:
            body = event.to_json(detections.name_of)
            where = body.get("line") or body.get("zone")
            events[f"{body['type']} {where} {body.get('direction', '')}".strip()] += 1
    snapshot = analytics.snapshot()
    return {
        "frames_inferred": len(found),
        "objects": sum(snapshot["tracked"].values()),
        "events": dict(sorted(events.items())),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=600, help="frames per clip at most")
    parser.add_argument("--out", type=Path, default=None, help="write the results here (JSON)")
    args = parser.parse_args()
    engine, shared = cpu_engine()
    low = DetectParams(conf=LOW_CONF)  # a tracked stream's engine confidence
    report: list[dict[str, Any]] = []
    for clip in sorted((shared / "videos").glob("*.mp4")):
        with av.open(str(clip)) as container:
            decoded = [
                f for _, f in zip(range(args.limit), container.decode(video=0), strict=False)
            ]
        times = [float(f.time or 0.0) for f in decoded]
        found = [engine.infer([rgb(f)], [low])[0] for f in decoded]
        for step in (1, 2):
            frames = list(range(0, len(decoded), step))
            gate = MotionGate(MotionOptions())
            spent = []
            passed = []
            for k in frames:
                started = time.perf_counter()
                if gate.infer(decoded[k], times[k]):
                    passed.append(k)
                spent.append((time.perf_counter() - started) * 1000)
            fps = round(len(frames) / (times[frames[-1]] - times[0]), 2)
            report.append(
                {
                    "clip": clip.name,
                    "fps": fps,
                    "seconds": round(times[-1] - times[0], 1),
                    "every_frame": counted([(times[k], found[k]) for k in frames]),
                    "motion": counted([(times[k], found[k]) for k in passed]),
                    "motion_ms_per_frame": round(sorted(spent)[len(spent) // 2], 3),
                }
            )
            print(json.dumps(report[-1]))
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
