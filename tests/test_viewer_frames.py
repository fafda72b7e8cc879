"""The JPEG frames the viewer asks for on ``WS /ws/streams/{id}?frames=jpeg`` (no browser)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image as PILImage

from engines.types import Detections
from server.routes.viewer import JpegFrames, encode_jpeg
from streams.fanout import ProcessedFrame

SOURCE_FPS = 12.5  # car-detection.mp4


def frame_at(t: float, width: int = 768, height: int = 432) -> ProcessedFrame:
    image = np.zeros((height, width, 3), np.uint8)
    image[:, : width // 2] = (200, 30, 30)  # left half red, right half black
    detections = Detections(
        boxes=np.array([[10, 20, 110, 220]], np.float32),
        scores=np.array([0.9], np.float32),
        class_ids=np.array([2], np.int32),
        names={2: "car"},
        width=width,
        height=height,
    )
    return ProcessedFrame(
        stream_id="cam",
        frame=round(t * SOURCE_FPS),
        pts=t,
        captured_at=1e9 + t,
        decoded_mono=t,
        image=image,
        detections=detections,
        batch_size=1,
    )


def test_json_only_unless_asked() -> None:
    assert JpegFrames.from_options({}) is None
    assert JpegFrames.from_options({"frames": "none", "max_fps": "3"}) is None
    opts = JpegFrames.from_options({"frames": "jpeg", "max_fps": "2.5", "max_width": "320"})
    assert opts is not None
    assert (opts.max_fps, opts.max_width, opts.quality) == (2.5, 320, 70)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"frames": "png"}, "frames='png': expected 'jpeg' or 'none'"),
        ({"frames": "jpeg", "max_fps": "0"}, "max_fps=0: expected a number in [0.1, 60]"),
        ({"frames": "jpeg", "max_fps": "fast"}, "max_fps='fast': expected a number"),
        ({"frames": "jpeg", "max_width": "99999"}, "max_width=99999: expected a number"),
        ({"frames": "jpeg", "quality": "5"}, "quality=5: expected a number in [10, 95]"),
    ],
)
def test_bad_options_name_the_option(options: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace(".", r"\.")):
        JpegFrames.from_options(options)


@pytest.mark.parametrize("max_fps", [1.0, 2.0, 5.0, 10.0])
def test_rate_follows_the_viewer_not_the_source(max_fps: float) -> None:
    jpeg = JpegFrames(max_fps=max_fps)
    seconds = 20
    times = [i / SOURCE_FPS for i in range(int(seconds * SOURCE_FPS))]
    sent = [t for t in times if jpeg.due(frame_at(t), newer_waiting=False)]
    assert abs(len(sent) - seconds * max_fps) <= 1, (len(sent), max_fps)
    assert jpeg.skipped == len(times) - len(sent)


def test_a_viewer_behind_skips_to_the_newest_frame() -> None:
    jpeg = JpegFrames(max_fps=60)
    assert not jpeg.due(frame_at(0.0), newer_waiting=True)
    assert jpeg.due(frame_at(0.08), newer_waiting=False)


def test_no_burst_after_a_gap() -> None:
    jpeg = JpegFrames(max_fps=5)
    assert jpeg.due(frame_at(0.0), newer_waiting=False)
    # The camera stalled for 10 s: the next frames are paced afresh, not sent to catch up.
    after = [t for t in (10.0, 10.08, 10.16, 10.24) if jpeg.due(frame_at(t), False)]
    assert after == [10.0, 10.24]


def test_encode_scales_down_and_keeps_the_picture() -> None:
    frame = frame_at(0.0)
    data, width, height = encode_jpeg(frame.image, 640, 80)
    assert (width, height) == (640, 360)
    decoded = np.asarray(PILImage.open(io.BytesIO(data)).convert("RGB"))
    assert decoded.shape == (360, 640, 3)
    left, right = decoded[:, :300].mean(axis=(0, 1)), decoded[:, 340:].mean(axis=(0, 1))
    assert np.allclose(left, (200, 30, 30), atol=8), left
    assert np.allclose(right, (0, 0, 0), atol=8), right
    small, w, h = encode_jpeg(frame.image, 1920, 80)
    assert (w, h) == (768, 432)  # never scaled up
    assert small[:2] == b"\xff\xd8"
