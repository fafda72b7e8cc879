"""Reading frames from local video files and image folders (tests, benchmarks, calibration)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
from PIL import Image as PILImage

from engines.types import Image
from streams.frames import upright

VIDEO_SUFFIXES = {".mp4", ".mkv", ".avi", ".mov", ".webm", ".ts"}
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp"}


def iter_video_frames(path: Path | str, step: int = 1, limit: int | None = None) -> Iterator[Image]:
    """Decode every ``step``-th frame of a video file as RGB, at most ``limit`` frames."""
    import av

    if step < 1:
        raise ValueError("step must be >= 1")
    produced = 0
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        for index, frame in enumerate(container.decode(stream)):
            if index % step:
                continue
            yield np.asarray(upright(frame).to_ndarray(format="rgb24"), np.uint8)
            produced += 1
            if limit is not None and produced >= limit:
                return


def video_frame_count(path: Path | str) -> int:
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        if stream.frames:
            return int(stream.frames)
        return sum(1 for _ in container.demux(stream) if _.size)


def sample_video_frames(path: Path | str, count: int, offset: int = 0) -> list[Image]:
    """``count`` frames spread evenly over the video, starting ``offset`` frames in."""
    total = video_frame_count(path)
    step = max(1, (total - offset) // max(count, 1))
    frames: list[Image] = []
    for i, frame in enumerate(iter_video_frames(path)):
        if i >= offset and (i - offset) % step == 0:
            frames.append(frame)
            if len(frames) >= count:
                break
    return frames


def encode_jpeg(image: Image, quality: int = 90) -> bytes:
    """An RGB image as JPEG bytes (OpenCV's libjpeg-turbo, which releases the GIL).

    Raises:
        RuntimeError: the encoder refused the image.
    """
    import cv2

    bgr = cv2.cvtColor(np.ascontiguousarray(image, dtype=np.uint8), cv2.COLOR_RGB2BGR)
    ok, buf = cv2.imencode(".jpg", bgr, [cv2.IMWRITE_JPEG_QUALITY, quality])
    if not ok:
        raise RuntimeError(f"JPEG encoding failed for a {image.shape[1]}x{image.shape[0]} image")
    return bytes(buf.tobytes())


def load_image(path: Path | str) -> Image:
    with PILImage.open(path) as img:
        return np.ascontiguousarray(np.asarray(img.convert("RGB"), dtype=np.uint8))
