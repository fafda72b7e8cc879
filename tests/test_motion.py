"""Motion gating (``streams/motion.py``): real clip frames through the gate, then a real server
whose stream infers only what moves."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import av
import httpx
import numpy as np
import numpy.typing as npt
import pytest

from streams.detect import Roi
from streams.motion import MotionGate, MotionOptions, luma, shrink
from tests.helpers import CAR_CLIP, clip_server

pytestmark = pytest.mark.skipif(not CAR_CLIP.is_file(), reason="needs ../shared/videos")


def first_frame() -> npt.NDArray[np.uint8]:
    with av.open(str(CAR_CLIP)) as clip:
        frame = next(clip.decode(video=0))
        return np.asarray(frame.to_ndarray(format="rgb24"), np.uint8)


def as_frame(rgb: npt.NDArray[np.uint8]) -> av.VideoFrame:
    """An RGB picture as a decoder would give it (YUV 4:2:0)."""
    return av.VideoFrame.from_ndarray(rgb, format="rgb24").reformat(format="yuv420p")


def test_a_still_scene_is_inferred_only_at_the_idle_rate() -> None:
    gate = MotionGate(MotionOptions(idle_fps=2.0))
    still = as_frame(first_frame())
    inferred = [t / 10 for t in range(30) if gate.infer(still, t / 10)]  # 3 s at 10 fps
    assert inferred == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]  # the first, then every 0.5 s
    assert gate.area == 0.0 and not gate.moving


def test_still_frames_come_at_the_idle_rate_whatever_the_streams_rate() -> None:
    """Sampled 5 times a second, ``idle_fps`` 1.5 inferred 1.25 a second: each still frame
    was due 1/1.5 s after the last one taken, which came up to a frame late. Each is due an
    interval after the last one was due."""
    gate = MotionGate(MotionOptions(idle_fps=1.5))
    still = as_frame(first_frame())
    inferred = [k / 5 for k in range(30) if gate.infer(still, k / 5)]  # 6 s at 5 fps
    assert len(inferred) == 9, inferred  # 1.5 a second
    gaps = [b - a for a, b in itertools.pairwise(inferred)]
    assert max(gaps) <= 0.8 + 1e-9, gaps


def test_light_changing_slowly_and_sensor_noise_are_not_motion() -> None:
    rng = np.random.default_rng(0)
    base = first_frame().astype(np.int16)
    gate = MotionGate(MotionOptions(idle_fps=1.1))
    moved = []
    for t in range(40):  # dusk: a grey level darker each frame, and noise of +-6 levels
        noisy = base - t + rng.integers(-6, 7, base.shape)
        moved.append(gate.measure(shrink(luma(as_frame(np.clip(noisy, 0, 255).astype(np.uint8))))))
    assert moved[0] and not any(moved[1:]), moved


def test_an_object_coming_in_is_motion_at_once() -> None:
    scene = first_frame()
    gate = MotionGate(MotionOptions(idle_fps=1.1))
    assert gate.infer(as_frame(scene), 0.0)  # the first frame
    assert not gate.infer(as_frame(scene), 0.1)
    visitor = scene.copy()
    visitor[200:260, 300:380] = 230  # an 80x60 bright object: 1.4% of a 768x432 frame
    assert gate.infer(as_frame(visitor), 0.2)
    assert gate.moving and 0.01 < gate.area < 0.03, gate.area
    # A stream that wants more of the picture to move (a busy view) lets it pass.
    picky = MotionGate(MotionOptions(idle_fps=1.1))
    picky.measure(shrink(luma(as_frame(scene))))
    assert not picky.measure(shrink(luma(as_frame(visitor))), min_area=0.05)
    # One that wants pixels to change more (a noisy night picture) lets a dim one pass.
    dim = scene.copy()
    dim[200:260, 300:380] = np.clip(scene[200:260, 300:380].astype(np.int16) + 40, 0, 255)
    for level, moves in ((25, True), (60, False)):
        night = MotionGate(MotionOptions(idle_fps=1.1))
        night.measure(shrink(luma(as_frame(scene))))
        assert night.measure(shrink(luma(as_frame(dim))), threshold=level) is moves, level


def test_a_masked_clock_is_no_motion_and_what_moves_elsewhere_still_is() -> None:
    """Most cameras burn a clock into the picture: it changes every second. Masked, it is
    no motion; an object coming in elsewhere still is."""
    rng = np.random.default_rng(1)
    scene = first_frame()
    clock = [(0.0, 0.0), (0.35, 0.0), (0.35, 0.12), (0.0, 0.12)]  # top left: 269 x 52 px
    mask = (Roi(tuple(clock)),)
    bare, masked = MotionGate(MotionOptions()), MotionGate(MotionOptions())
    seen_bare, seen_masked = [], []
    for _ in range(10):
        frame = scene.copy()
        digits = rng.integers(0, 2, (2, 15)).repeat(16, axis=0).repeat(16, axis=1)
        frame[8:40, 8:248] = digits[:, :, None] * 255  # 16 px strokes, changing every frame
        yuv = as_frame(frame)
        seen_bare.append(bare.measure(shrink(luma(yuv))))
        seen_masked.append(masked.measure(shrink(luma(yuv)), mask))
    assert all(seen_bare) and seen_masked == [True] + [False] * 9
    visitor = scene.copy()
    visitor[8:40, 8:248] = 0
    visitor[250:330, 400:500] = 230  # a car coming in, bottom right
    assert masked.measure(shrink(luma(as_frame(visitor))), mask)


def test_the_grey_picture_is_the_luma_plane_shrunk_by_whole_blocks() -> None:
    scene = first_frame()
    yuv = as_frame(scene)
    gray = luma(yuv)
    assert gray.shape == (432, 768) and gray.base is not None  # a view, no copy
    assert abs(float(gray.mean()) - float(luma(yuv.reformat(format="rgb24")).mean())) < 2
    small = shrink(gray)
    assert small.shape == (108, 192)  # blocks of 4 x 4
    assert shrink(np.zeros((1080, 1920), np.uint8)).shape == (90, 160)
    assert shrink(np.zeros((90, 100), np.uint8)).shape == (90, 100)


def test_on_the_car_clip_about_half_the_frames_are_inferred() -> None:
    """The clip's street is empty between cars: those frames are skipped (benchmarks/
    motion_bench.py counts the same crossings and zone entries either way)."""
    gate = MotionGate(MotionOptions())
    with av.open(str(CAR_CLIP)) as clip:
        inferred = [gate.infer(f, float(f.time or 0)) for f in clip.decode(video=0)]
    assert 0.35 < sum(inferred) / len(inferred) < 0.65, sum(inferred)


def test_a_stream_with_motion_on_skips_still_frames_and_says_so(tmp_path: Path) -> None:
    server = clip_server(tmp_path)
    body = {"url": f"file://{CAR_CLIP}", "motion": True, "track": True}
    with server, httpx.Client(base_url=server.base_url, timeout=60) as c:
        created = c.post("/streams", json=body)
        assert created.status_code == 201, created.text
        sid = created.json()["id"]
        assert created.json()["detect"]["motion"] is True
        deadline = time.monotonic() + 60
        info = c.get(f"/streams/{sid}").json()
        while info["motion_skipped"] < 10 or info["frames_processed"] < 5:
            assert time.monotonic() < deadline, info
            time.sleep(0.5)
            info = c.get(f"/streams/{sid}").json()
        assert info["frames_processed"] + info["motion_skipped"] <= info["frames_in"]
        assert 0.0 <= info["motion_area"] <= 1.0
        metrics = c.get("/metrics").text
        assert f'streamdet_stream_frames_motion_skipped_total{{stream="{sid}"}}' in metrics
        # A mask: kept as given, checked, cleared.
        clock = [[0, 0], [0.3, 0], [0.3, 0.1], [0, 0.1]]
        masked = c.patch(f"/streams/{sid}", json={"motion_mask": [clock]})
        assert masked.status_code == 200 and masked.json()["detect"]["motion_mask"] == [clock]
        for bad in ([[[0, 0], [1, 1]]], [[[0, 0], [2, 0], [0, 1]]], [clock] * 17, [[0, 1]]):
            refused = c.patch(f"/streams/{sid}", json={"motion_mask": bad})
            assert refused.status_code == 422 and "motion_mask" in refused.text, refused.text
        cleared = c.patch(f"/streams/{sid}", json={"motion_mask": None}).json()
        assert cleared["detect"]["motion_mask"] == []
        area = c.patch(f"/streams/{sid}", json={"motion_min_area": 0.01}).json()
        assert area["detect"]["motion_min_area"] == 0.01
        for bad_area in (0, 1.5, "x"):
            refused = c.patch(f"/streams/{sid}", json={"motion_min_area": bad_area})
            assert refused.status_code == 422 and "motion_min_area" in refused.text
        back = c.patch(f"/streams/{sid}", json={"motion_min_area": None}).json()
        assert back["detect"]["motion_min_area"] is None
        level = c.patch(f"/streams/{sid}", json={"motion_threshold": 40}).json()
        assert level["detect"]["motion_threshold"] == 40
        for bad_level in (0, 256, 2.5, "x"):
            refused = c.patch(f"/streams/{sid}", json={"motion_threshold": bad_level})
            assert refused.status_code == 422 and "motion_threshold" in refused.text
        # Off again: every frame is inferred from now on, nothing more is skipped.
        off = c.patch(f"/streams/{sid}", json={"motion": False}).json()
        assert off["detect"]["motion"] is False and off["motion_area"] is None
        # A frame checked just before the change may still be counted: from two frames on.
        processed, deadline = off["frames_processed"], time.monotonic() + 30
        while (now := c.get(f"/streams/{sid}").json())["frames_processed"] < processed + 2:
            assert time.monotonic() < deadline, now
            time.sleep(0.1)
        skipped = now["motion_skipped"]
        time.sleep(2)
        assert c.get(f"/streams/{sid}").json()["motion_skipped"] == skipped
