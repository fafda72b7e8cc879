"""Calibration frames from a live camera: GStreamer's RTSP server on 127.0.0.1 looping a clip."""

from __future__ import annotations

import pytest

from engines.calibration import CalibrationError, parse_sources, sample_frames
from loadtest.server import free_port
from tests.helpers import VIDEOS
from tests.rtsp_camera import CAR, RtspCamera

pytestmark = pytest.mark.rtsp


def test_calibration_frames_from_a_live_camera() -> None:
    if CAR is None:
        pytest.fail(f"shared clip car-detection.mp4 missing: {VIDEOS} (set STREAMDET_SHARED_DIR)")
    camera = RtspCamera({"car": CAR}).start()
    try:
        (source,) = parse_sources([camera.url("car")])
        assert source.kind == "live" and source.name == f"127.0.0.1:{camera.port}/car"
        sample = sample_frames([source], 4, progress=False)
    finally:
        camera.stop()
    assert len(sample.frames) == 4
    assert all(f.shape == (432, 768, 3) for f in sample.frames)
    (record,) = sample.sources
    assert record.total is None and record.indices == []
    # Every 5th frame of a moving scene: no two samples are the same picture.
    assert len({f.tobytes() for f in sample.frames}) == 4


def test_unreachable_camera_is_named() -> None:
    url = f"rtsp://user:secret@127.0.0.1:{free_port()}/none"
    with pytest.raises(
        CalibrationError, match=r"live source rtsp://127\.0\.0\.1:\d+/none: cannot open"
    ) as err:
        sample_frames(parse_sources([url]), 2, progress=False)
    assert "secret" not in str(err.value)
