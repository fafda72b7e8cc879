"""What event clips cost a stream's decode thread (``streams.clips.ClipRecorder.packet``), and
what they weigh on disk, next to what decoding the same packets costs.

The car clip is scaled to 1920x1080 and encoded as a camera would send it (H.264, 4 Mbit/s,
a keyframe every 2 s, 25 fps; libx264 from PyAV's wheel), then its packets are fed to a
recorder in video time, without pacing:

- ``buffer``: clips on, no events (each packet copied into the pre-roll buffer);
- ``events``: an event every 10 s (5 s before, 5 s after: a 10-12 s clip each);
- ``long``: an event every 2 s, so one clip grows to ``--max-s`` (its ``+faststart`` close
  rewrites the whole file on the decode thread).

    .venv/bin/python -m benchmarks.clips_bench --seconds 120 --out benchmarks/results/x.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

import av

from streams.clips import ClipOptions, ClipRecorder
from tests.helpers import CAR_CLIP

FPS = 25
GOP = 50
BITRATE = 4_000_000


def camera_stream(path: Path, seconds: float) -> None:
    """``seconds`` of the car clip at 1080p, as an H.264 camera would send it."""
    with av.open(str(CAR_CLIP)) as src, av.open(str(path), "w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=FPS)
        stream.width, stream.height, stream.pix_fmt = 1920, 1080, "yuv420p"
        stream.bit_rate = BITRATE
        stream.codec_context.gop_size = GOP
        stream.options = {"preset": "ultrafast", "tune": "zerolatency", "bf": "0"}
        frames = [f.reformat(1920, 1080, "yuv420p") for f in src.decode(video=0)]
        for n in range(round(seconds * FPS)):
            frame = frames[n % len(frames)]
            frame.pts, frame.time_base = n, Fraction(1, FPS)
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))


def percentiles(times_ms: list[float]) -> dict[str, float]:
    ordered = sorted(times_ms)
    return {
        "mean_ms": round(statistics.fmean(ordered), 4),
        "p50_ms": round(ordered[len(ordered) // 2], 4),
        "p99_ms": round(ordered[int(len(ordered) * 0.99)], 4),
        "max_ms": round(ordered[-1], 3),
    }


def run(source: Path, every_s: float | None, max_s: float, folder: Path) -> dict[str, Any]:
    done: list[tuple[int, Path | None, str | None]] = []
    options = ClipOptions(folder, pre_s=5.0, post_s=5.0, max_s=max_s)
    recorder = ClipRecorder("bench", options, lambda *call: done.append(call))
    times: list[float] = []
    with av.open(str(source)) as container:
        stream = container.streams.video[0]
        assert stream.time_base is not None
        next_event = 7.0
        for n, packet in enumerate(p for p in container.demux(stream) if p.size):
            at = float((packet.pts or 0) * stream.time_base)
            if every_s is not None and at >= next_event:
                recorder.request(at - 0.1, n)  # detected 100 ms after its frame was decoded
                next_event += every_s
            started = time.perf_counter()
            recorder.packet(packet, stream, at)
            times.append((time.perf_counter() - started) * 1000)
        recorder.source_closed("end of the benchmark")
    sizes = [path.stat().st_size for _, path, _ in done if path is not None]
    lengths = []
    for _, path, _ in done:
        if path is not None:
            with av.open(str(path)) as clip:
                lengths.append(float(clip.duration or 0) / 1e6)
    return {
        **percentiles(times),
        "packets": len(times),
        "clips": len(sizes),
        "failed": sum(1 for _, path, _ in done if path is None),
        "clip_s_mean": round(statistics.fmean(lengths), 2) if lengths else None,
        "clip_mb_mean": round(statistics.fmean(sizes) / 1e6, 2) if sizes else None,
    }


def decode_cost(source: Path) -> dict[str, float]:
    times: list[float] = []
    with av.open(str(source)) as container:
        stream = container.streams.video[0]
        for packet in container.demux(stream):
            started = time.perf_counter()
            for frame in packet.decode():
                frame.to_ndarray(format="rgb24")
            times.append((time.perf_counter() - started) * 1000)
    return percentiles(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=120.0, help="video fed to the recorder")
    parser.add_argument("--max-s", type=float, default=60.0, help="longest clip")
    parser.add_argument("--out", type=Path, default=None, help="write the results here (JSON)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        source = folder / "camera.mp4"
        camera_stream(source, args.seconds)
        mbit = source.stat().st_size * 8 / args.seconds / 1e6
        results: dict[str, Any] = {
            "benchmark": "clips_bench",
            "source": {
                "width": 1920,
                "height": 1080,
                "fps": FPS,
                "gop": GOP,
                "mbit_s": round(mbit, 2),
            },
            "seconds": args.seconds,
            "decode_rgb": decode_cost(source),
        }
        for name, every in (("buffer", None), ("events", 10.0), ("long", 2.0)):
            results[name] = run(source, every, args.max_s, folder / name)
    print(json.dumps(results, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
