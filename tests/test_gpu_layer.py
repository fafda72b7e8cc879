"""The GPU device layer's CPU-checkable parts: buckets, letterbox, resize, NMS, buffers.

The layer runs unchanged on ``device="cpu"``; these tests hold it to ``engines.yolo`` (the CPU
engine's pre/post-processing) on real frames and the real model's raw outputs.
"""

from __future__ import annotations

from collections.abc import Iterator

import cv2
import numpy as np
import pytest
import torch

from engines.gpu import (
    STAGE_SHARE_BYTES,
    BucketRunner,
    DeviceWorkspace,
    _shares,
    batch_buckets,
    bucket_for,
    letterbox_into,
    placement,
    resize_linear,
    resolve_device,
)
from engines.registry import EngineConfig, load_backend
from engines.types import DetectParams, EngineError, ModelError, ModelInfo
from engines.yolo import PAD_VALUE, letterbox, postprocess, preprocess, rect_shape
from streams.files import load_image, sample_video_frames
from tests.helpers import CACHE_DIR, MODEL_PT, VIDEOS, ultralytics_assets

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def frames() -> list[np.ndarray]:
    assets = ultralytics_assets()
    images = [load_image(assets / "bus.jpg"), load_image(assets / "zidane.jpg")]
    return images + [f for v in VIDEOS for f in sample_video_frames(v, 3)]


def test_buckets_are_powers_of_two_up_to_max_batch() -> None:
    assert batch_buckets(1) == (1,)
    assert batch_buckets(8) == (1, 2, 4, 8)
    assert batch_buckets(12) == (1, 2, 4, 8, 12)
    assert batch_buckets(32) == (1, 2, 4, 8, 16, 32)
    with pytest.raises(ValueError, match="max_batch"):
        batch_buckets(0)


@pytest.mark.parametrize(
    ("size", "bucket"), [(1, 1), (2, 2), (3, 4), (5, 8), (8, 8), (9, 12), (12, 12)]
)
def test_bucket_for_picks_smallest_that_fits(size: int, bucket: int) -> None:
    assert bucket_for(size, batch_buckets(12)) == bucket


@pytest.mark.parametrize("size", [0, 13])
def test_bucket_for_rejects_sizes_outside_buckets(size: int) -> None:
    with pytest.raises(ValueError, match="STREAMDET_MAX_BATCH"):
        bucket_for(size, batch_buckets(12))


@pytest.mark.parametrize(
    ("h", "w"), [(1080, 810), (720, 1280), (432, 768), (360, 640), (33, 500), (640, 640), (7, 3)]
)
def test_placement_matches_cpu_letterbox(h: int, w: int) -> None:
    shape = rect_shape(h, w, 640, 32)
    image = np.zeros((h, w, 3), np.uint8)
    for target in (shape, (640, 640)):
        _, meta = letterbox(image, target, 640)
        assert placement(h, w, target, 640).meta == meta


@pytest.mark.parametrize(("h", "w"), [(100, 37), (480, 640), (1080, 1920), (300, 301), (33, 500)])
def test_resize_linear_is_opencv_inter_linear(h: int, w: int) -> None:
    rng = np.random.default_rng(h * w)
    image = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    for th, tw in [
        (max(1, h // 2 + 1), max(1, w // 3 + 1)),
        (max(1, h * 2 // 3), max(1, w * 5 // 7)),
    ]:
        ours = resize_linear(torch.from_numpy(image), th, tw).numpy()
        ref = cv2.resize(image, (tw, th), interpolation=cv2.INTER_LINEAR)
        assert np.array_equal(ours, ref), f"downscale {h}x{w} -> {th}x{tw} differs from cv2"
    # Upscaling: OpenCV's scalar tail rounds differently in a few pixels; never by more than 1.
    up = resize_linear(torch.from_numpy(image), h * 2, w * 2).numpy().astype(int)
    ref_up = cv2.resize(image, (w * 2, h * 2), interpolation=cv2.INTER_LINEAR).astype(int)
    assert np.abs(up - ref_up).max() <= 1


def test_letterbox_into_gives_the_cpu_engines_pixels(frames: list[np.ndarray]) -> None:
    for frame in frames:
        shape = rect_shape(frame.shape[0], frame.shape[1], 640, 32)
        ref, meta = letterbox(frame, shape, 640)
        out = torch.empty((2, 3, *shape))
        (ours_meta,) = letterbox_into([torch.from_numpy(frame.copy())], out, 640)
        ours = (out[0].permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
        assert ours_meta == meta
        assert np.array_equal(ours, ref)
        # The bucket's padding row is the pad grey, never stale data or NaN.
        assert torch.all((out[1] * 255).round() == PAD_VALUE)


def test_letterbox_into_a_mixed_batch_equals_one_frame_at_a_time(
    frames: list[np.ndarray],
) -> None:
    """Frames of one size are resized together; interleaved sizes (not a run of rows) and
    repeats land in their own rows with the pixels a lone letterbox gives them."""
    video = [f for f in frames if f.shape[:2] == frames[-1].shape[:2]]
    other = [f for f in frames if f.shape[:2] != frames[-1].shape[:2]]
    batch = [video[0], other[0], video[1], video[2], other[0]]
    tensors = [torch.from_numpy(f.copy()) for f in batch]
    out = torch.empty((6, 3, 640, 640))
    metas = letterbox_into(tensors, out, 640)
    for i, tensor in enumerate(tensors):
        alone = torch.empty((1, 3, 640, 640))
        (meta,) = letterbox_into([tensor], alone, 640)
        assert metas[i] == meta
        assert torch.equal(out[i], alone[0]), f"row {i}"
    assert torch.all((out[5] * 255).round() == PAD_VALUE)


def test_resize_linear_of_a_batch_equals_each_frame(frames: list[np.ndarray]) -> None:
    same = [f for f in frames if f.shape[:2] == frames[-1].shape[:2]][:3]
    batch = torch.from_numpy(np.stack(same))
    resized = resize_linear(batch, 300, 500)
    for i, frame in enumerate(same):
        assert torch.equal(resized[i], resize_linear(torch.from_numpy(frame.copy()), 300, 500))


def test_letterbox_into_refuses_more_frames_than_the_buffer() -> None:
    frame = torch.zeros((10, 10, 3), dtype=torch.uint8)
    with pytest.raises(ValueError, match="do not fit"):
        letterbox_into([frame] * 3, torch.empty((2, 3, 32, 32)), 32)


def test_upload_on_cpu_returns_the_images(frames: list[np.ndarray]) -> None:
    ws = DeviceWorkspace(CPU)
    assert ws.stream is None
    views = ws.upload(frames[:3])
    for view, frame in zip(views, frames[:3], strict=True):
        assert np.array_equal(view.numpy(), frame)


def test_stage_lays_frames_end_to_end_in_the_staging_buffer(frames: list[np.ndarray]) -> None:
    """What the CUDA upload copies to the device in one go (pinned there, plain here)."""
    ws = DeviceWorkspace(CPU)
    batch = [frames[0], np.ascontiguousarray(frames[1][::2, ::2]), frames[2]]  # two sizes
    offsets, total = ws.stage(batch)
    assert total == sum(f.nbytes for f in batch) and offsets[0] == 0
    staged = ws._staging.numpy()
    for frame, offset in zip(batch, offsets, strict=True):
        assert np.array_equal(staged[offset : offset + frame.nbytes].reshape(frame.shape), frame)
    grown = ws._staging
    ws.stage(batch[:1])  # a smaller batch reuses the buffer
    assert ws._staging is grown


def test_a_large_batch_is_staged_by_several_threads_to_the_same_bytes(
    frames: list[np.ndarray],
) -> None:
    """Over STAGE_SHARE_BYTES per thread, copy threads split the batch (frames whole, in
    order); the staging buffer holds what one thread would have written."""
    batch = [np.ascontiguousarray(np.roll(frames[i % len(frames)], i, axis=1)) for i in range(40)]
    batch[5] = frames[1][::2, ::2]  # not contiguous: copied all the same
    serial, parallel = DeviceWorkspace(CPU, copy_threads=1), DeviceWorkspace(CPU, copy_threads=3)
    assert sum(f.nbytes for f in batch) >= 3 * STAGE_SHARE_BYTES
    offsets, total = parallel.stage(batch)
    assert (offsets, total) == serial.stage(batch)
    assert parallel._copiers is not None  # it did split the batch
    assert np.array_equal(parallel._staging.numpy()[:total], serial._staging.numpy()[:total])
    parallel.close()
    same = [(i, np.zeros((10, 10, 3), np.uint8)) for i in range(4)]
    assert [[i for i, _ in share] for share in _shares(same, 4 * 300, 3)] == [[0, 1], [2], [3]]


@pytest.fixture(scope="module")
def ort(model_info: ModelInfo) -> Iterator[object]:
    config = EngineConfig(model=model_info, imgsz=640, max_batch=8, threads=2, cache_dir=CACHE_DIR)
    engine = load_backend("onnxruntime")(config)
    engine.load()
    yield engine
    engine.close()


PARAM_SETS = [
    DetectParams(),
    DetectParams(conf=0.5),
    DetectParams(classes=frozenset({0, 2})),
    DetectParams(max_det=2),
    DetectParams(conf=0.1, iou=0.5),
    DetectParams(conf=0.05, iou=0.9, max_det=7),
]


def test_device_nms_matches_cpu_postprocess(
    frames: list[np.ndarray], ort: object, model_info: ModelInfo
) -> None:
    """Same raw head output, per-image parameters mixed in one batch: same detections."""
    ws = DeviceWorkspace(CPU)
    by_shape: dict[tuple[int, int], list[np.ndarray]] = {}
    for frame in frames:
        by_shape.setdefault(rect_shape(frame.shape[0], frame.shape[1], 640, 32), []).append(frame)
    compared = 0
    for shape, group in by_shape.items():
        blob, metas = preprocess(group, 640, shape)
        raw = ort.run_raw(blob)  # type: ignore[attr-defined]
        params = [PARAM_SETS[i % len(PARAM_SETS)] for i in range(len(group))]
        ref = postprocess(raw, metas, params, model_info.names)
        ours = ws.postprocess(torch.from_numpy(raw), metas, params, model_info.names)
        for r, o, p in zip(ref, ours, params, strict=True):
            assert len(o) == len(r), f"{p}: {len(o)} vs {len(r)} detections"
            np.testing.assert_array_equal(o.class_ids, r.class_ids)
            np.testing.assert_allclose(o.scores, r.scores, atol=1e-6)
            np.testing.assert_allclose(o.boxes, r.boxes, atol=1e-3)
            assert (o.width, o.height) == (r.width, r.height)
            compared += len(r)
    assert compared > 10


def test_boxes_of_nan_or_infinity_are_no_detections_on_either_path(
    frames: list[np.ndarray], ort: object, model_info: ModelInfo
) -> None:
    """An FP16 model's overflow gave boxes of NaN: a 500 on /detect (JSON has no NaN), and
    ``"box": [NaN, ...]`` on the WebSocket. Such a box is no detection, on the CPU's
    post-processing and the device's alike; the others are kept."""
    frame = frames[0]
    blob, metas = preprocess([frame], 640, rect_shape(frame.shape[0], frame.shape[1], 640, 32))
    raw = ort.run_raw(blob)  # type: ignore[attr-defined]
    clean = postprocess(raw, metas, [DetectParams()], model_info.names)[0]
    best = raw[0, 4:].max(axis=0)
    strong = np.flatnonzero(best > 0.25)
    assert strong.size > 4
    poisoned = raw.copy()
    poisoned[0, 0, strong[::2]] = np.nan  # x of every other candidate
    poisoned[0, 2, strong[1::4]] = np.inf
    for found in (
        postprocess(poisoned, metas, [DetectParams()], model_info.names)[0],
        DeviceWorkspace(CPU).postprocess(
            torch.from_numpy(poisoned), metas, [DetectParams()], model_info.names
        )[0],
    ):
        assert np.isfinite(found.boxes).all() and 0 < len(found) <= len(clean)


def test_bucket_runner_reuses_buffers_and_bounds_them() -> None:
    calls: list[tuple[int, ...]] = []

    def forward(x: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(x.shape))
        return x.sum(dim=(2, 3))

    runner = BucketRunner(forward, DeviceWorkspace(CPU), torch.float32, max_graphs=2)
    first = runner.input_for(4, (32, 64))
    assert runner.input_for(4, (32, 64)) is first
    first.fill_(1.0)
    assert torch.all(runner.run(4, (32, 64)) == 32 * 64)
    runner.input_for(8, (32, 32))
    runner.input_for(1, (64, 64))  # third key: the least recently used one goes
    assert runner.input_for(4, (32, 64)) is not first
    assert runner.captured == 0  # no graphs on the CPU
    assert calls == [(4, 3, 32, 64)]


def test_cuda_device_without_gpu_is_refused_with_the_reason() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here")
    with pytest.raises(EngineError, match="no CUDA device"):
        resolve_device("cuda")
    with pytest.raises(EngineError, match="STREAMDET_DEVICE"):
        resolve_device("mps")


@pytest.mark.parametrize(
    ("capability", "archs", "usable"),
    [
        ((7, 0), ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"], False),  # V100
        ((8, 0), ["sm_86", "sm_90"], False),  # an sm_86 cubin does not run on 8.0
        ((8, 6), ["sm_80", "sm_90"], True),  # sm_80 runs on 8.6
        ((9, 0), ["sm_80", "sm_90a"], True),
        ((12, 1), ["sm_90", "compute_120"], True),  # PTX compiled at load
        ((8, 9), ["sm_90", "compute_90"], False),  # PTX of a newer capability: no
    ],
)
def test_a_gpu_torch_has_no_kernels_for_is_refused_naming_its_capability(
    monkeypatch: pytest.MonkeyPatch,
    capability: tuple[int, int],
    archs: list[str],
    usable: bool,
) -> None:
    """A GPU the installed torch was not built for is visible, and its first kernel fails
    mid-warmup ("no kernel image is available"): refused at load, saying which capability
    and which build to install."""
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: archs)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "Some GPU")
    if usable:
        assert resolve_device("cuda") == torch.device("cuda", 0)
        return
    major, minor = capability
    with pytest.raises(EngineError) as info:
        resolve_device("cuda")
    message = str(info.value)
    assert f"compute capability {major}.{minor}" in message
    assert f"torch build for sm_{major}{minor}" in message and "--backend onnxruntime" in message


def test_torch_backend_refuses_cuda_without_gpu(model_info: ModelInfo) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here")
    config = EngineConfig(
        model=model_info,
        imgsz=640,
        max_batch=4,
        threads=1,
        device="cuda",
        cache_dir=CACHE_DIR,
        source=MODEL_PT,
    )
    engine = load_backend("torch")(config)
    with pytest.raises(EngineError, match=r"no CUDA device.*--backend onnxruntime"):
        engine.load()


def test_torch_backend_needs_a_pt_checkpoint(model_info: ModelInfo) -> None:
    config = EngineConfig(
        model=model_info,
        imgsz=640,
        max_batch=4,
        threads=1,
        device="cpu",
        cache_dir=CACHE_DIR,
        source=None,
    )
    with pytest.raises(ModelError, match=r"\.pt checkpoint"):
        load_backend("torch")(config).load()


def test_torch_model_keeps_each_shapes_anchor_grid(monkeypatch: pytest.MonkeyPatch) -> None:
    """Back at a shape it has seen, the ``.pt`` model reuses that shape's grid: no host
    ``arange`` copied up (illegal inside a CUDA graph capture) and the grid a captured graph
    reads is never freed by another shape's rebuild."""
    from ultralytics.nn.modules import head as ultralytics_head

    from engines.torch_cuda import AnchorsPerShape, load_detection_model

    built: list[tuple[int, ...]] = []
    make_anchors = ultralytics_head.make_anchors

    def counting(feats: list[torch.Tensor], *args: object) -> object:
        built.append(tuple(feats[0].shape))
        return make_anchors(feats, *args)

    monkeypatch.setattr(ultralytics_head, "make_anchors", counting)
    forward = AnchorsPerShape(load_detection_model(MODEL_PT, CPU))
    wide, square = torch.rand((2, 3, 384, 640)), torch.rand((1, 3, 640, 640))
    with torch.inference_mode():
        first = forward(wide)
        forward(square)
        grid = forward._head.anchors
        again = forward(wide)
        assert forward._head.anchors is not grid  # the wide shape's own grid is back
        forward(square)
        assert forward._head.anchors is grid
        # Another batch bucket at a shape seen: the same grid (it does not hang on the batch).
        forward(torch.rand((4, 3, 640, 640)))
        assert forward._head.anchors is grid
        # Many shapes (a camera of each aspect ratio): every grid kept, none built twice.
        shapes = [(1, 3, 32 * h, 640) for h in range(1, 21)] + [(8, 3, 640, 32 * w) for w in (1, 2)]
        grids = []
        for shape in shapes * 2:
            forward(torch.rand(shape))
            grids.append(forward._head.anchors)
        assert all(a is b for a, b in zip(grids[: len(shapes)], grids[len(shapes) :], strict=True))
    assert len(built) == 2 + 20 + 2 - 2, built  # 384x640 and 640x640 were among them
    assert first.shape == (2, 84, 5040)
    assert torch.equal(first, again)


def test_a_fixed_batch_graph_gets_every_batch_padded_to_it(
    frames: list[np.ndarray], model_info: ModelInfo, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A graph whose batch is fixed at 8 takes batches of 8 only (the buckets 1, 2, 4 failed
    it): 3 frames run as one bucket of 8 and give the boxes they give unpadded."""
    import dataclasses

    def engine(info: ModelInfo) -> object:
        config = EngineConfig(
            model=info, imgsz=640, max_batch=8, threads=1, cache_dir=CACHE_DIR, source=MODEL_PT
        )
        made = load_backend("torch")(config)
        made.load()
        return made

    fixed = engine(dataclasses.replace(model_info, fixed_batch=8))
    plain = engine(model_info)
    assert fixed._buckets == (8,) and plain._buckets == (1, 2, 4, 8)  # type: ignore[attr-defined]
    runner = fixed._runner  # type: ignore[attr-defined]
    shapes: list[tuple[int, tuple[int, int]]] = []
    run = runner.run

    def spy(bucket: int, shape: tuple[int, int]) -> object:
        shapes.append((bucket, shape))
        return run(bucket, shape)

    monkeypatch.setattr(runner, "run", spy)
    three = frames[:3]
    got = fixed.infer(three, [DetectParams()] * 3)  # type: ignore[attr-defined]
    want = plain.infer(three, [DetectParams()] * 3)  # type: ignore[attr-defined]
    assert shapes and all(bucket == 8 for bucket, _ in shapes)
    assert any(len(d.boxes) for d in want)
    for a, b in zip(got, want, strict=True):
        assert a.class_ids.tolist() == b.class_ids.tolist()
        np.testing.assert_allclose(a.boxes, b.boxes, atol=0.05)


class _Graph:
    """``torch.cuda.CUDAGraph``'s part the runner uses: its replays are counted (the output
    captured stays valid, the inputs unchanged)."""

    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


def test_a_capture_out_of_memory_retries_that_bucket_later_and_spares_the_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A capture that ran out of GPU memory (other buckets, another process) turned graphs off
    for every bucket of the worker for good. Now that bucket runs eagerly and is captured
    again after ``CAPTURE_RETRY_S``; only an op that cannot be captured turns graphs off.
    (Stand-ins for the CUDA graph and its capture; a real capture is in the device check.)"""
    import contextlib
    import types

    import engines.gpu as gpu

    now = [1000.0]
    monkeypatch.setattr(gpu, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    failing: list[BaseException] = []
    captures: list[_Graph] = []
    capturing = [False]

    @contextlib.contextmanager
    def graph(g: _Graph, stream: object, capture_error_mode: str) -> Iterator[None]:
        captures.append(g)
        capturing[0] = True
        try:
            yield
            if failing:
                raise failing.pop()
        finally:
            capturing[0] = False

    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    eager: list[tuple[int, ...]] = []

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not capturing[0]:
            eager.append(tuple(x.shape))
        return x.sum(dim=(2, 3))

    ws = DeviceWorkspace(CPU)
    ws.cuda, ws.stream = True, object()  # type: ignore[assignment]
    runner = BucketRunner(forward, ws, torch.float32)
    runner.input_for(1, (32, 32)).fill_(1.0)
    runner.run(1, (32, 32))
    assert runner.captured == 1
    failing.append(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    runner.input_for(8, (32, 32)).fill_(2.0)
    assert torch.all(runner.run(8, (32, 32)) == 2 * 32 * 32)  # the eager pass's answer
    assert runner.captured == 1  # batch 8 not captured, batch 1 kept
    eager.clear()
    runner.run(8, (32, 32))
    assert eager == [(8, 3, 32, 32)] and len(captures) == 2  # eagerly until the retry
    now[0] += gpu.CAPTURE_RETRY_S
    assert torch.all(runner.run(8, (32, 32)) == 2 * 32 * 32)
    assert runner.captured == 2  # captured again once the retry came
    # Out of memory again, and again: each time it waits twice as long (60 s, 120 s).
    for wait in (60, 120):
        failing.append(torch.cuda.OutOfMemoryError("CUDA out of memory."))
        now[0] += 1000
        runner.run(4, (32, 32))
        tried = len(captures)
        now[0] += wait - 1
        runner.run(4, (32, 32))
        assert len(captures) == tried  # not yet
        now[0] += 1
    runner.run(4, (32, 32))
    assert runner.captured == 3 and len(captures) == 6
    # A capture that could not be ended (invalidated: an op of the model's, or an allocation
    # under pressure on some torch versions, with the OOM underneath or not) is not retried:
    # the allocator may have been left holding its pool.
    invalidated = RuntimeError("CUDA error: operation failed due to a previous error (capture)")
    invalidated.__context__ = torch.cuda.OutOfMemoryError("CUDA out of memory.")
    failing.append(invalidated)
    runner.run(2, (32, 32))
    runner.run(16, (32, 32))
    assert runner.captured == 3  # no capture is tried again
    assert len(captures) == 7
