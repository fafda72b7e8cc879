"""Time the stream tracker (``streams.track.Tracker.update``) per frame, on synthetic scenes of
``--objects`` boxes moving at random constant velocities: what tracking adds to each frame of a
tracked stream, on the engine worker thread.

    .venv/bin/python -m benchmarks.track_bench --objects 10 50 300

``--clips`` instead runs the real model (ONNX Runtime) on the shared clips at 10 and 5 fps
and compares tracking on the confident boxes alone (SORT) with ByteTrack's second association
of the weak ones, as tracked streams do: objects counted, and boxes shown.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

from engines.types import Detections, Engine
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


def cpu_engine() -> tuple[Engine, Path]:
    """The shared model loaded on ONNX Runtime (2 threads, batch 1), and the shared folder."""
    from engines.registry import EngineConfig, load_backend, prepare_model

    repo = Path(__file__).resolve().parents[1]
    shared = Path(os.environ.get("STREAMDET_SHARED_DIR", repo.parent / "shared"))
    cache = repo / ".cache" / "streamdet"
    model = prepare_model(str(shared / "models" / "yolov8n.pt"), cache, 640)
    engine = load_backend("onnxruntime")(
        EngineConfig(model=model, imgsz=640, max_batch=1, threads=2, device="cpu", cache_dir=cache)
    )
    engine.load()
    return engine, shared


def compare_on_clips(limit: int = 150) -> list[dict[str, object]]:
    """Per clip and sampling step: objects counted and boxes shown, confident boxes only
    against confident plus weak ones (:data:`streams.detect.LOW_CONF`)."""
    from engines.types import DetectParams
    from streams.analytics import StreamAnalytics
    from streams.detect import LOW_CONF, StreamDetect
    from streams.files import iter_video_frames

    engine, shared = cpu_engine()
    settings = StreamDetect(DetectParams(), track=True)
    report: list[dict[str, object]] = []
    for clip in sorted((shared / "videos").glob("*.mp4")):
        for step in (3, 6):
            frames = list(iter_video_frames(clip, step=step, limit=limit))
            low = DetectParams(conf=LOW_CONF)
            found = [engine.infer([f], [low])[0] for f in frames]
            row: dict[str, object] = {"clip": clip.name, "step": step, "frames": len(frames)}
            for mode in ("sort", "bytetrack"):
                analytics = StreamAnalytics()
                shown = 0
                for k, d in enumerate(found):
                    confident = d.select(d.scores >= settings.params.conf)
                    frame = confident if mode == "sort" else d
                    shown += len(analytics.process(frame, settings, k * step / 30, k).detections)
                row[mode] = {
                    "objects": sum(analytics.snapshot()["tracked"].values()),
                    "boxes_shown": shown,
                }
            report.append(row)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--objects", type=int, nargs="+", default=[10, 50, 300])
    parser.add_argument("--frames", type=int, default=300)
    parser.add_argument("--clips", action="store_true", help="compare SORT and ByteTrack")
    args = parser.parse_args()
    if args.clips:
        print(json.dumps(compare_on_clips(), indent=2))
        return
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
