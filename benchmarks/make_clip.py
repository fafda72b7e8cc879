"""A camera-like clip for the decode benchmarks: a shared clip scaled to 1920x1080 at 25 fps
(each frame twice), H.264 with a keyframe every second and no B-frames, as IP cameras send
by default, written with PyAV's own x264.

Run (16 s here)::

    .venv/bin/python -m benchmarks.make_clip --out /tmp/car-1080p-gop1s.mp4
"""

from __future__ import annotations

import argparse
import fractions
import os
import sys
from collections.abc import Collection
from pathlib import Path

import av

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("STREAMDET_SHARED_DIR", REPO.parent / "shared"))


CODECS = ("h264", "hevc")


def make_clip(
    source: Path,
    out: Path,
    *,
    width: int,
    height: int,
    fps: int,
    gop: int,
    frames: int = 0,
    codec: str = "h264",
    start: int = 0,
    keyframes: Collection[int] = (),
) -> int:
    """Write ``source`` (``frames`` of it from its frame ``start``; 0: to its end) to ``out``
    at ``width`` x ``height``,
    ``fps`` (frames repeated to reach it), a keyframe every ``gop`` frames and at each frame
    of ``keyframes`` (as a camera adds one at a change of scene), in ``codec``
    (``h264`` by x264, ``hevc`` by x265, as H.265 cameras send); returns the frames
    written."""
    if codec not in CODECS:
        raise ValueError(f"codec must be one of {CODECS}, got {codec!r}")
    written = 0
    with av.open(str(source)) as src, av.open(str(out), "w") as dst:
        if codec == "hevc":
            stream = dst.add_stream("libx265", rate=fps)
            stream.codec_tag = "hvc1"  # as Apple's players and browsers want it
            stream.options = {
                "preset": "veryfast",
                "crf": "28",
                "x265-params": f"keyint={gop}:min-keyint={gop}:scenecut=0:bframes=0"
                ":log-level=error",
            }
        else:
            stream = dst.add_stream("libx264", rate=fps)
            stream.options = {
                "g": str(gop),
                "keyint_min": str(gop),
                "sc_threshold": "0",
                "bf": "0",
                "preset": "veryfast",
                "crf": "23",
            }
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        rate = float(src.streams.video[0].average_rate or fps)
        repeat = max(1, round(fps / rate))
        for index, frame in enumerate(src.decode(video=0)):
            if index < start:
                continue
            if frames and index >= start + frames:
                break
            picture = frame.reformat(width, height, "yuv420p").to_ndarray()
            for _ in range(repeat):
                scaled = av.VideoFrame.from_ndarray(picture, format="yuv420p")
                scaled.pts, scaled.time_base = written, fractions.Fraction(1, fps)
                if written in keyframes:
                    scaled.pict_type = av.video.frame.PictureType.I
                written += 1
                for packet in stream.encode(scaled):
                    dst.mux(packet)
        for packet in stream.encode():
            dst.mux(packet)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clip", type=Path, default=SHARED / "videos" / "car-detection.mp4")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--width", type=int, default=1920)
    parser.add_argument("--height", type=int, default=1080)
    parser.add_argument("--fps", type=int, default=25)
    parser.add_argument("--gop", type=int, default=25, help="frames from keyframe to keyframe")
    parser.add_argument("--frames", type=int, default=0, help="of the source; 0: all")
    parser.add_argument("--codec", choices=CODECS, default="h264")
    args = parser.parse_args(argv)
    size = {"width": args.width, "height": args.height}
    n = make_clip(
        args.clip,
        args.out,
        **size,
        fps=args.fps,
        gop=args.gop,
        frames=args.frames,
        codec=args.codec,
    )
    print(f"{args.out}: {n} frames", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
