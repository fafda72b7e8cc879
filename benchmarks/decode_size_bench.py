"""What decoding a live stream's frames at the engine's size costs and saves, per frame.

For each camera size (``--sizes``, the shared car clip's frames scaled to it by FFmpeg, as a
camera would send them) it measures, on this machine:

* ``convert_ms``: an ``av.VideoFrame`` to RGB as the server does it (``streams.reader``
  ``frame_rgb``), whole and at the size it is decoded at (``--imgsz``; resized there as the
  engine's letterbox would have);
* ``letterbox_ms``: the CPU engine's letterbox of that RGB frame (``engines.yolo.letterbox``):
  the resize moves out of it when the frame comes decoded small;
* ``frame_mb``: the bytes a frame takes (copied into a decode process's ring, held by the
  server, staged for a GPU);
* ``stage_ms``: a GPU engine's host-side copy of a batch of ``--batch`` such frames into its
  staging buffer (``engines.gpu.DeviceWorkspace.stage`` into plain memory on the CPU, one copy
  thread), where torch is installed;
* ``upload_decode_ms``: the first frame as an uploaded JPEG (quality 90, ``upload_kb``)
  decoded by ``POST /detect`` (``server.images.decode_upload``): whole, and for the engine
  (libjpeg's scaled decode, at ``upload_decoded_at``).

Best of ``--repeats`` timings each (the machine is shared). Run::

    .venv/bin/python -m benchmarks.decode_size_bench \\
        --out benchmarks/results/<date>-cpu2-decode-size.json
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import av
from PIL import Image as PILImage

from engines.types import Image
from engines.yolo import letterbox
from server.images import decode_upload
from streams.frames import decoded_size, frame_rgb

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("STREAMDET_SHARED_DIR", REPO.parent / "shared"))
CLIP = SHARED / "videos" / "car-detection.mp4"


def _best_ms(step: Callable[[], object], items: int, repeats: int) -> float:
    """The fastest of ``repeats`` runs of ``step``, in milliseconds per item."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    return round(best / items * 1e3, 3)


def _stage_ms(batch: Sequence[Image], repeats: int) -> float | None:
    try:
        import torch

        from engines.gpu import DeviceWorkspace
    except ImportError:
        return None
    workspace = DeviceWorkspace(torch.device("cpu"), copy_threads=1)
    try:
        workspace.stage(batch)  # the buffer is made once
        return _best_ms(lambda: workspace.stage(batch), 1, repeats)
    finally:
        workspace.close()


def measure(
    clip: Path, size: tuple[int, int], imgsz: int, *, frames: int, batch: int, repeats: int
) -> dict[str, Any]:
    """The figures of one camera size (see the module's docstring)."""
    width, height = size
    with av.open(str(clip)) as container:
        decoded = zip(range(frames), container.decode(video=0), strict=False)
        camera = [f.reformat(width=width, height=height, format="yuv420p") for _, f in decoded]
    small = decoded_size(width, height, imgsz)
    result: dict[str, Any] = {"camera": f"{width}x{height}", "decoded_at": f"{small[0]}x{small[1]}"}
    for name, at in (("whole", size), ("decoded", small)):
        images = [frame_rgb(f, at) for f in camera]

        def convert(at: tuple[int, int] = at) -> None:
            for f in camera:
                frame_rgb(f, at)

        def letterboxed(images: list[Image] = images) -> None:
            for image in images:
                letterbox(image, (imgsz, imgsz), imgsz)

        result[name] = {
            "convert_ms": _best_ms(convert, frames, repeats),
            "letterbox_ms": _best_ms(letterboxed, frames, repeats),
            "frame_mb": round(images[0].nbytes / 1e6, 2),
            "stage_ms": _stage_ms([images[i % frames] for i in range(batch)], repeats),
        }
    picture = io.BytesIO()
    PILImage.fromarray(frame_rgb(camera[0], size)).save(picture, format="JPEG", quality=90)
    upload = picture.getvalue()
    result["upload_kb"] = round(len(upload) / 1000)
    for name, side in (("whole", 0), ("decoded", imgsz)):
        image, _ = decode_upload(upload, 2**31, side)

        def decode(side: int = side) -> None:
            decode_upload(upload, 2**31, side)

        result[name]["upload_decode_ms"] = _best_ms(decode, 1, repeats)
        if side:
            result["upload_decoded_at"] = f"{image.shape[1]}x{image.shape[0]}"
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clip", type=Path, default=CLIP)
    parser.add_argument(
        "--sizes",
        nargs="+",
        default=["1280x720", "1920x1080", "3840x2160", "4000x3000"],
        help="WxH",
    )
    parser.add_argument("--imgsz", type=int, default=640, help="the engine's input size")
    parser.add_argument("--frames", type=int, default=30)
    parser.add_argument("--batch", type=int, default=32, help="frames staged at once")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    sizes = [tuple(int(v) for v in s.lower().split("x")) for s in args.sizes]
    counts = {"frames": args.frames, "batch": args.batch, "repeats": args.repeats}
    results = [measure(args.clip, (w, h), args.imgsz, **counts) for w, h in sizes]
    report = {
        "benchmark": "decode_size",
        "host": platform.node(),
        "cores": os.cpu_count(),
        "imgsz": args.imgsz,
        "batch": args.batch,
        "command": "python -m benchmarks.decode_size_bench " + " ".join(argv or []),
        "sizes": results,
    }
    for r in results:
        whole, small = r["whole"], r["decoded"]
        print(
            f"{r['camera']} -> {r['decoded_at']}: convert {whole['convert_ms']} -> "
            f"{small['convert_ms']} ms, letterbox {whole['letterbox_ms']} -> "
            f"{small['letterbox_ms']} ms, frame {whole['frame_mb']} -> {small['frame_mb']} MB,"
            f" stage {args.batch} {whole['stage_ms']} -> {small['stage_ms']} ms; upload JPEG"
            f" ({r['upload_kb']} kB) decoded {whole['upload_decode_ms']} -> "
            f"{small['upload_decode_ms']} ms at {r['upload_decoded_at']}"
        )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
