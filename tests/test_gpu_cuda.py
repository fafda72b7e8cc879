"""On a CUDA device: the torch engine (FP16, streams, CUDA graphs) against itself on the CPU,
graphs against eager, device-resident frames against host frames (each for the ``.pt`` and its
``.torchscript`` trace), and NVDEC decode.

Skipped where no GPU is visible; ``scripts/gpu_check.sh`` runs them on the GPU machine.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from engines.nvdec import VideoDecoder
from engines.registry import EngineConfig
from engines.torch_cuda import TorchEngine, checkpoint_info
from engines.types import Detections, DetectParams
from streams.files import iter_video_frames, load_image, sample_video_frames
from tests.helpers import (
    CACHE_DIR,
    MODEL_PT,
    MODEL_TS,
    VIDEOS,
    match_reference,
    ultralytics_assets,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _engine(device: str, model: Path, use_graphs: bool = True) -> TorchEngine:
    config = EngineConfig(
        model=checkpoint_info(model),
        imgsz=640,
        max_batch=8,
        threads=1,
        device=device,
        cache_dir=CACHE_DIR,
        source=model,
    )
    engine = TorchEngine(config, use_graphs=use_graphs)
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
    engine = _engine("cuda", model)
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


def test_fp16_cuda_matches_fp32_cpu(
    cuda_engine: TorchEngine, frames: list[np.ndarray], cpu_results: list[Detections]
) -> None:
    ours = cuda_engine.infer(frames, [DetectParams()] * len(frames))
    assert sum(len(d) for d in ours) > 0
    _assert_match(ours, cpu_results, conf_tol=0.03)


def test_graph_replay_equals_eager(
    cuda_engine: TorchEngine, model: Path, frames: list[np.ndarray]
) -> None:
    eager = _engine("cuda", model, use_graphs=False)
    want = eager.infer(frames[:5], [DetectParams()] * 5)
    got = cuda_engine.infer(frames[:5], [DetectParams()] * 5)
    assert cuda_engine._runner is not None and cuda_engine._runner.captured > 0
    _assert_match(got, want, conf_tol=0.002)


def test_device_frames_equal_host_frames(
    cuda_engine: TorchEngine, frames: list[np.ndarray]
) -> None:
    on_device = [torch.from_numpy(f.copy()).cuda() for f in frames[:4]]  # decoded: read-only
    _assert_match(
        cuda_engine.infer(on_device, [DetectParams()] * 4),
        cuda_engine.infer(frames[:4], [DetectParams()] * 4),
        conf_tol=0.002,
    )


def test_nvdec_frames_match_cpu_decode() -> None:
    decoder = VideoDecoder(VIDEOS[0], device="cuda")
    if not decoder.on_gpu:
        pytest.skip(f"NVDEC not usable here: {decoder.reason}")
    got = list(itertools.islice(iter(decoder), 5))
    want = list(iter_video_frames(VIDEOS[0], limit=5))
    for g, w in zip(got, want, strict=True):
        assert isinstance(g, torch.Tensor) and g.is_cuda
        diff = np.abs(g.cpu().numpy().astype(int) - w.astype(int))
        assert diff.mean() < 2.0, diff.mean()
