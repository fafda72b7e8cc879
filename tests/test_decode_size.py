"""Live streams decoded at the engine's size (setting ``stream_decode_size``): frames scaled by
FFmpeg as they are converted, detections still in the camera's pixels, on the real model and
the shared clips, in decode threads and in decode processes."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import av
import numpy as np
import pytest

from engines.pool import EnginePool
from engines.types import Detections, DetectParams, Engine
from engines.yolo import letterbox
from server.settings import Settings
from server.snapshots import SnapshotStore
from streams.events import EventLog
from streams.fanout import ProcessedFrame
from streams.frames import decoded_size, frame_rgb
from streams.geometry import Seen
from streams.lines import Crossing
from streams.manager import StreamManager
from tests.helpers import (
    BOTTLE_CLIP,
    CAR_CLIP,
    decode_jpeg,
    file_manager,
    published_frames,
)


def test_a_frame_is_decoded_at_the_size_the_letterbox_would_resize_it_to() -> None:
    assert decoded_size(1920, 1080, 640) == (640, 360)
    assert decoded_size(1080, 1920, 640) == (360, 640)  # portrait
    assert decoded_size(3840, 2160, 416) == (416, 234)
    assert decoded_size(1280, 720, 640) == (640, 360)
    assert decoded_size(768, 432, 640) == (768, 432)  # 640x360 would not halve it: as it is
    assert decoded_size(640, 360, 640) == (640, 360)  # small enough: as it is
    assert decoded_size(320, 240, 640) == (320, 240)  # never scaled up
    assert decoded_size(1920, 1080, 0) == (1920, 1080)  # 0: off
    # The engine takes a frame decoded at its size without resizing it again.
    for width, height in ((1920, 1080), (1280, 720), (2592, 1944), (1080, 1920), (1001, 333)):
        w, h = decoded_size(width, height, 640)
        _, meta = letterbox(np.zeros((h, w, 3), np.uint8), (640, 640), 640)
        assert meta.gain == 1.0, (width, height)


def test_detections_are_rescaled_to_the_source_and_kept_inside_it() -> None:
    small = Detections(
        boxes=np.array([[10, 20, 110, 120], [600, 300, 640, 360]], np.float32),
        scores=np.array([0.9, 0.5], np.float32),
        class_ids=np.array([2, 0], np.int32),
        names={0: "person", 2: "car"},
        width=640,
        height=360,
        track_ids=np.array([4, 5], np.int64),
    )
    big = small.rescaled(1920, 1080)
    assert (big.width, big.height) == (1920, 1080)
    assert np.allclose(big.boxes, [[30, 60, 330, 360], [1800, 900, 1920, 1080]])
    assert big.scores is small.scores and big.track_ids is small.track_ids
    assert small.rescaled(640, 360) is small
    assert np.array_equal(small.boxes[0], [10, 20, 110, 120])  # the original is left alone


def _frames(clip: Path, indices: range) -> list[av.VideoFrame]:
    with av.open(str(clip)) as container:
        decoded = zip(range(indices.stop), container.decode(video=0), strict=False)
        return [f for i, f in decoded if i in indices]


@pytest.mark.parametrize(
    ("clip", "indices", "source"),
    [(CAR_CLIP, range(190, 235, 5), (1280, 720)), (BOTTLE_CLIP, range(0, 400, 40), (1920, 1080))],
    ids=["cars-720p", "bottles-1080p"],
)
def test_frames_decoded_small_give_the_boxes_of_the_engines_own_resize(
    ort_engine: Engine, clip: Path, indices: range, source: tuple[int, int]
) -> None:
    """The real model on frames of the shared clips made 720p and 1080p (as cameras send
    them): decoded at the engine's input size, the engine gets the very pixels its letterbox
    would have made of the whole frame, and the boxes brought back to the camera's pixels are
    those of the whole frame."""
    params = DetectParams()
    width, height = source
    frames = [f.reformat(width=width, height=height) for f in _frames(clip, indices)]
    found = 0
    for frame in frames:
        size = decoded_size(frame.width, frame.height, ort_engine.input_size)
        assert size == (640, 360)
        image = frame_rgb(frame, size)
        assert image.shape == (360, 640, 3) and image.flags.c_contiguous
        whole = frame_rgb(frame, source)
        assert np.array_equal(image, letterbox(whole, (640, 640), 640)[0][140:500])
        into = np.zeros_like(image)
        assert frame_rgb(frame, size, into) is into and np.array_equal(into, image)
        [full] = ort_engine.infer([whole], [params])
        [small] = ort_engine.infer([image], [params])
        ours = small.rescaled(*source)
        assert np.array_equal(ours.class_ids, full.class_ids)
        assert np.allclose(ours.scores, full.scores)
        assert np.allclose(ours.boxes, full.boxes, atol=0.01), (ours.boxes, full.boxes)
        found += len(full)
    assert found >= 5  # objects found to compare


@pytest.fixture(params=[0, 1], ids=["decode-thread", "decode-process"])
async def manager(
    request: pytest.FixtureRequest, pool: EnginePool, tmp_path: Path
) -> AsyncIterator[StreamManager]:
    data = tmp_path / "data"
    async with file_manager(pool, data, decode_processes=request.param, decode_max_side=320) as m:
        yield m


async def test_a_stream_is_decoded_small_and_detected_in_the_cameras_pixels(
    manager: StreamManager,
) -> None:
    info = await manager.add(f"file://{BOTTLE_CLIP}", max_fps=5.0)
    frames = await published_frames(manager, info["id"], 4)
    for frame in frames:
        assert frame.image.shape == (180, 320, 3)  # 640x360 decoded at 320 wide
        d = frame.detections
        assert (d.width, d.height) == (640, 360)
        assert ((d.boxes >= 0) & (d.boxes <= [640, 360, 640, 360])).all()
        message = frame.to_message()
        assert (message["width"], message["height"]) == (640, 360)
    boxes = np.concatenate([f.detections.boxes for f in frames])
    names = {f.detections.name_of(c) for f in frames for c in f.detections.class_ids}
    assert "bottle" in names, names
    # In the camera's pixels: boxes reach past the 320 pixels the frames were decoded at (the
    # bottle on the right stands at x 520-574).
    assert boxes[:, 2].max() > 500, boxes
    described = manager.describe(info["id"])
    assert described is not None and (described["width"], described["height"]) == (640, 360)
    assert (described["decoded_width"], described["decoded_height"]) == (320, 180)


def test_the_setting_defaults_to_the_engines_input_size_and_0_turns_it_off() -> None:
    from server.routes.streams import reader_options

    assert reader_options(Settings(imgsz=416)).decode_max_side == 416
    assert reader_options(Settings(imgsz=416, stream_decode_size=960)).decode_max_side == 960
    assert reader_options(Settings(stream_decode_size=0)).decode_max_side == 0
    # The engine's own size where it is known: a model served at 320 (an artifact made at
    # that size, a fixed 320 export) decoded frames at imgsz's 640.
    assert reader_options(Settings(), 320).decode_max_side == 320
    assert reader_options(Settings(stream_decode_size=960), 320).decode_max_side == 960
    with pytest.raises(ValueError, match=r"stream_decode_size 320 is under .* imgsz 640.*0, or"):
        Settings(stream_decode_size=320)


async def test_thumbnails_are_cut_where_the_object_is_in_a_frame_decoded_small(
    tmp_path: Path,
) -> None:
    image = np.full((180, 640, 3), 90, np.uint8)  # a 1280x360 camera's frame, decoded halved
    image[50:100, 300:350] = (220, 20, 20)  # the object: a red square
    seen = Seen((600.0, 100.0, 700.0, 200.0), 0.9)  # where it is in the camera's pixels
    frame = ProcessedFrame(
        "s", 1, None, 1.0, 0.0, image, Detections.empty({0: "person"}, 1280, 360), 1
    )
    log = EventLog(size=10, start_id=1)
    store = SnapshotStore(2, 640, None, lambda _: None, directory=tmp_path, events=log)
    crossing = replace(Crossing("gate", "in", track_id=1, class_id=0, frame=1), seen=seen)
    store.capture(
        frame,
        log.add("s", "", 1.0, [crossing], str, extra=functools.partial(store.extra, frame)),
    )
    thumbnail = await store.get(1, thumbnail=True)
    assert thumbnail is not None
    cut = decode_jpeg(thumbnail)
    assert cut.shape == (80, 80, 3)  # 50 pixels and 30% of them each side
    assert tuple(cut[40, 40]) > (200, 0, 0) and cut[40, 40, 1] < 50  # red in the middle
    assert tuple(cut[3, 3]) == pytest.approx((90, 90, 90), abs=6)  # the frame around it
