"""On a CUDA device: the torch engine (FP16, streams, CUDA graphs) against itself on the CPU,
graphs against eager, device-resident frames against host frames (each for the ``.pt`` and its
``.torchscript`` trace), and NVDEC decode.

Skipped where no GPU is visible; ``scripts/gpu_check.sh`` runs them on the GPU machine.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from engines.gpu import STAGE_SHARE_BYTES, DeviceWorkspace, unsupported_capability
from engines.nvdec import VideoDecoder, nvdec_unavailable
from engines.pool import EnginePool
from engines.registry import EngineConfig
from engines.torch_cuda import TorchEngine, checkpoint_info
from engines.types import Detections, DetectParams
from streams.fanout import ProcessedFrame
from streams.files import iter_video_frames, load_image, sample_video_frames
from streams.manager import ManagerOptions, StreamManager
from streams.reader import ReaderOptions
from streams.store import StreamStore
from tests.helpers import (
    CACHE_DIR,
    MODEL_PT,
    MODEL_TS,
    VIDEOS,
    match_reference,
    next_frame,
    ultralytics_assets,
)

# ``cpu`` rehearses this file where there is no GPU (``scripts/gpu_check.sh rehearse``): the
# same fixtures and harness, FP32 on the CPU, no graphs; the NVDEC checks skip.
DEVICE = os.environ.get("STREAMDET_GPU_TEST_DEVICE", "cuda")
ON_CUDA = DEVICE.startswith("cuda")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(ON_CUDA and not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _config(device: str, model: Path, max_batch: int = 8) -> EngineConfig:
    return EngineConfig(
        model=checkpoint_info(model),
        imgsz=640,
        max_batch=max_batch,
        threads=1,
        device=device,
        cache_dir=CACHE_DIR,
        source=model,
    )


def _engine(device: str, model: Path, use_graphs: bool = True) -> TorchEngine:
    engine = TorchEngine(_config(device, model), use_graphs=use_graphs)
    engine.load()
    return engine


@pytest.fixture(scope="module", params=[MODEL_PT, MODEL_TS], ids=["pt", "torchscript"])
def model(request: pytest.FixtureRequest) -> Path:
    """The checkpoint (run through Ultralytics' modules) and its TorchScript trace."""
    path: Path = request.param
    if not path.exists():
        pytest.fail(f"model missing: {path} (scripts/gpu_check.sh prepare copies it)")
    return path


@pytest.fixture(scope="module")
def cuda_engine(model: Path) -> Iterator[TorchEngine]:
    engine = _engine(DEVICE, model)
    engine.warmup()
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def frames() -> list[np.ndarray]:
    images = [load_image(ultralytics_assets() / n) for n in ("bus.jpg", "zidane.jpg")]
    return images + [f for v in VIDEOS for f in sample_video_frames(v, 6)]


@pytest.fixture(scope="module")
def cpu_results(model: Path, frames: list[np.ndarray]) -> list[Detections]:
    engine = _engine("cpu", model)
    return engine.infer(frames, [DetectParams()] * len(frames))


def _assert_match(ours: list[Detections], ref: list[Detections], conf_tol: float) -> None:
    for o, r in zip(ours, ref, strict=True):
        problems = match_reference(
            o,
            r.boxes,
            r.scores,
            r.class_ids,
            min_iou=0.9,
            conf_tol=conf_tol,
            edge_conf=0.25 + conf_tol,
        )
        assert not problems, problems


def test_warmup_captures_every_bucket_at_square_and_16_9(cuda_engine: TorchEngine) -> None:
    """A camera's first batch of any size replays a graph instead of capturing one (runs first:
    the later tests add shapes of their own)."""
    if not ON_CUDA:
        pytest.skip("graphs are captured on CUDA only")
    assert cuda_engine._runner is not None
    shapes = 2 if cuda_engine._dynamic_hw else 1
    assert cuda_engine._runner.captured == len(cuda_engine._buckets) * shapes


def test_this_gpu_is_one_the_installed_torch_has_kernels_for() -> None:
    """The load-time compute capability check passes the GPU this torch runs on (its arch
    list and the device's capability, as read on the device)."""
    if not ON_CUDA:
        pytest.skip("compute capability is CUDA's")
    index = torch.device(DEVICE).index or 0
    capability = torch.cuda.get_device_capability(index)
    assert unsupported_capability(index) is None, (capability, torch.cuda.get_arch_list())


def test_fp16_cuda_matches_fp32_cpu(
    cuda_engine: TorchEngine, frames: list[np.ndarray], cpu_results: list[Detections]
) -> None:
    ours = cuda_engine.infer(frames, [DetectParams()] * len(frames))
    assert sum(len(d) for d in ours) > 0
    _assert_match(ours, cpu_results, conf_tol=0.03)


def test_graph_replay_equals_eager(
    cuda_engine: TorchEngine, model: Path, frames: list[np.ndarray]
) -> None:
    eager = _engine(DEVICE, model, use_graphs=False)
    want = eager.infer(frames[:5], [DetectParams()] * 5)
    got = cuda_engine.infer(frames[:5], [DetectParams()] * 5)
    assert cuda_engine._runner is not None
    assert cuda_engine._runner.captured > 0 or not ON_CUDA
    _assert_match(got, want, conf_tol=0.002)


def test_device_frames_equal_host_frames(
    cuda_engine: TorchEngine, frames: list[np.ndarray]
) -> None:
    on_device = [torch.from_numpy(f.copy()).to(DEVICE) for f in frames[:4]]  # f: read-only
    _assert_match(
        cuda_engine.infer(on_device, [DetectParams()] * 4),
        cuda_engine.infer(frames[:4], [DetectParams()] * 4),
        conf_tol=0.002,
    )


def test_a_fixed_batch_graph_runs_every_batch_padded_to_it(
    cuda_engine: TorchEngine, model: Path, frames: list[np.ndarray]
) -> None:
    """A graph whose batch is fixed (``export(batch=8)``) captures the one bucket 8 and pads
    every batch of 1..8 to it: the boxes are those of the unpadded batch."""
    import dataclasses

    config = _config(DEVICE, model)
    fixed = TorchEngine(
        dataclasses.replace(config, model=dataclasses.replace(config.model, fixed_batch=8))
    )
    fixed.load()
    try:
        fixed.warmup()
        assert fixed._buckets == (8,)
        if ON_CUDA:
            assert fixed._runner is not None
            assert fixed._runner.captured == (2 if fixed._dynamic_hw else 1)
        for n in (1, 3):
            _assert_match(
                fixed.infer(frames[:n], [DetectParams()] * n),
                cuda_engine.infer(frames[:n], [DetectParams()] * n),
                # FP16 convolutions are picked per shape, the batch size among them: bucket 8
                # and bucket 1 or 2 need not agree to the bit (0.002 holds on the CPU, FP32).
                conf_tol=0.01 if ON_CUDA else 0.002,
            )
    finally:
        fixed.close()


def test_a_batch_staged_by_several_threads_reaches_the_device_whole(
    frames: list[np.ndarray],
) -> None:
    """The copy threads write pinned staging; one async copy takes it to the device."""
    if not ON_CUDA:
        pytest.skip(
            "pinned staging and the async copy are CUDA's (the CPU test is in test_gpu_layer)"
        )
    ws = DeviceWorkspace(torch.device(DEVICE), copy_threads=3)
    assert ws.stream is not None
    batch = [frames[i % len(frames)] for i in range(24)]
    assert sum(f.nbytes for f in batch) >= 3 * STAGE_SHARE_BYTES
    try:
        with torch.cuda.stream(ws.stream):
            views = ws.upload(batch)
        assert ws._copiers is not None  # several threads did copy
        ws.stream.synchronize()
        for view, frame in zip(views, batch, strict=True):
            assert np.array_equal(view.cpu().numpy(), frame)
    finally:
        ws.close()


def test_nvdec_frames_match_cpu_decode() -> None:
    decoder = VideoDecoder(VIDEOS[0], device=DEVICE)
    if not decoder.on_gpu:
        pytest.skip(f"NVDEC not usable here: {decoder.reason}")
    got = list(itertools.islice(iter(decoder), 5))
    want = list(iter_video_frames(VIDEOS[0], limit=5))
    for g, w in zip(got, want, strict=True):
        assert isinstance(g, torch.Tensor) and g.is_cuda, type(g)
        # Shapes first: a decoder surface padded to the coded size (432 -> 448 rows) shows here.
        assert tuple(g.shape) == w.shape and g.dtype == torch.uint8, (g.shape, g.dtype, w.shape)
        diff = np.abs(g.cpu().numpy().astype(int) - w.astype(int))
        per_channel = diff.reshape(-1, 3).mean(axis=0).round(2).tolist()
        assert diff.mean() < 2.0, f"mean {diff.mean():.2f}, RGB {per_channel}, max {diff.max()}"


def test_live_stream_decodes_on_nvdec_into_the_torch_engine(model: Path, tmp_path: Path) -> None:
    """``streamdet serve --decode cuda``: a stream's frames stay on the GPU from NVDEC to
    the engine; detections come back and a preview can still copy a frame down. (Sync,
    running its own loop: the GPU image's pytest has no asyncio plugin.)"""
    if ON_CUDA and (reason := nvdec_unavailable(DEVICE)) is not None:
        pytest.skip(f"NVDEC not usable here: {reason}")
    config = _config(DEVICE, model, max_batch=2)
    pool = EnginePool(  # batch 2: fewer graphs to capture at warmup, inside the test's limit
        lambda: TorchEngine(config), workers=1, max_batch=2, max_wait_ms=2, max_queue=8
    )
    pool.start()
    options = ManagerOptions(
        reader=ReaderOptions(open_timeout_s=5, read_timeout_s=5, decode_device=DEVICE),
        allowed_file_dir=VIDEOS[0].parent,
    )

    async def run() -> tuple[list[ProcessedFrame], str]:
        manager = StreamManager(pool, StreamStore(tmp_path / "data"), options)
        await manager.start()
        try:
            info = await manager.add(f"file://{VIDEOS[0]}")
            sub = manager.subscribe(info["id"])
            assert sub is not None
            frames: list[ProcessedFrame] = []
            while len(frames) < 10:
                try:
                    frames.append(await next_frame(sub, 30))
                except TimeoutError:  # say where the stream stands, not just that it timed out
                    raise AssertionError(
                        f"{len(frames)} frames in 30 s: {manager.describe(info['id'])}"
                    ) from None
            return frames, (manager.describe(info["id"]) or {}).get("decode", "")
        finally:
            await manager.stop(10)

    try:
        frames, decode = asyncio.run(run())
    finally:
        pool.stop(5)
    assert decode == ("cuda" if ON_CUDA else "cpu")
    on_gpu = [isinstance(f.image, torch.Tensor) and f.image.is_cuda for f in frames]
    assert all(on_gpu) if ON_CUDA else not any(on_gpu)
    assert sum(len(f.detections) for f in frames) > 0
    host = frames[-1].host_image()  # what a JPEG preview encodes
    assert isinstance(host, np.ndarray) and host.shape == tuple(frames[-1].image.shape)
