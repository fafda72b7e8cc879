"""Request payloads from real clips: JPEG frames at several sizes, as cameras and apps send."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image as PILImage

from streams.files import encode_jpeg, sample_video_frames

SIZES = ((320, 180), (640, 360), (768, 432), (1280, 720))
"""Width x height: thumbnails to 720p, so decode and letterbox costs vary like in service."""


@dataclass(frozen=True, slots=True)
class Payload:
    """One JPEG to post, with its pixel size."""

    jpeg: bytes
    width: int
    height: int


def shared_dir() -> Path:
    """``STREAMDET_SHARED_DIR`` or ``../shared`` beside the repository."""
    default = Path(__file__).resolve().parents[2] / "shared"
    return Path(os.environ.get("STREAMDET_SHARED_DIR", str(default))).resolve()


def default_videos() -> list[Path]:
    """The shared clips (``<shared>/videos/*.mp4``)."""
    return sorted((shared_dir() / "videos").glob("*.mp4"))


def build_payloads(
    videos: list[Path] | None = None,
    per_clip: int = 6,
    sizes: tuple[tuple[int, int], ...] | None = SIZES,
) -> list[Payload]:
    """``per_clip`` frames of every clip, each frame resized to one of ``sizes`` in turn
    (``None``: frames keep the clip's own size).

    Raises:
        FileNotFoundError: no clip found; the message names the folder searched.
    """
    clips = videos if videos is not None else default_videos()
    if not clips:
        raise FileNotFoundError(
            f"no *.mp4 clips under {shared_dir() / 'videos'}; set STREAMDET_SHARED_DIR"
        )
    payloads: list[Payload] = []
    for clip in clips:
        for i, frame in enumerate(sample_video_frames(clip, per_clip)):
            if sizes is None:
                height, width = frame.shape[:2]
                payloads.append(Payload(encode_jpeg(frame), width, height))
                continue
            width, height = sizes[i % len(sizes)]
            image = PILImage.fromarray(frame).resize((width, height), PILImage.Resampling.BILINEAR)
            payloads.append(Payload(encode_jpeg(np.asarray(image)), width, height))
    return payloads
