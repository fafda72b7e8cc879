"""Every backend that loads here against Ultralytics' own predictor on the same images and
the same model file (``.pt`` or ``.torchscript``)."""

from __future__ import annotations

import warnings
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engines.types import DetectParams, Engine
from streams.files import load_image, sample_video_frames
from tests.helpers import SHARED, VIDEOS, match_reference, ultralytics_assets

CONF = 0.25


@cache
def reference_model(name: str) -> Any:
    from ultralytics import YOLO

    return YOLO(str(SHARED / "models" / name), task="detect")


def reference(engine: Engine, image_rgb: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Ultralytics' predictor on the file ``engine`` serves (a TorchScript runs square, there
    too), ``conf`` 0.25."""
    return _predict(reference_model(engine.model_name), image_rgb)


def test_bus_matches_published_reference(engine: Engine) -> None:
    image = load_image(ultralytics_assets() / "bus.jpg")
    (det,) = engine.infer([image], [DetectParams(conf=CONF)])
    names = [det.names[int(c)] for c in det.class_ids]
    # The shared model's README: person x4 and bus, in this confidence order.
    assert sorted(names) == ["bus", "person", "person", "person", "person"]
    assert det.scores[0] == pytest.approx(0.895, abs=0.02)
    assert (det.width, det.height) == (810, 1080)


@pytest.mark.parametrize("name", ["bus.jpg", "zidane.jpg"])
def test_assets_match_ultralytics(engine: Engine, name: str) -> None:
    image = load_image(ultralytics_assets() / name)
    (det,) = engine.infer([image], [DetectParams(conf=CONF)])
    assert len(det) > 0
    problems = match_reference(det, *reference(engine, image), edge_conf=CONF + 0.02)
    assert not problems, problems


@pytest.mark.parametrize("video", VIDEOS, ids=[v.name for v in VIDEOS])
def test_video_frames_match_ultralytics(engine: Engine, video: Any) -> None:
    frames = sample_video_frames(video, 6)
    results = engine.infer(frames, [DetectParams(conf=CONF)] * len(frames))
    total = 0
    for frame, det in zip(frames, results, strict=True):
        assert (det.height, det.width) == frame.shape[:2]
        problems = match_reference(det, *reference(engine, frame), edge_conf=CONF + 0.02)
        assert not problems, problems
        total += len(det)
    assert total > 0, "the clips show cars and bottles; some must be found"


def test_batch_equals_single(engine: Engine) -> None:
    assets = ultralytics_assets()
    images = [load_image(assets / "bus.jpg"), load_image(assets / "zidane.jpg")]
    batched = engine.infer(images, [DetectParams()] * 2)
    for image, det in zip(images, batched, strict=True):
        (single,) = engine.infer([image], [DetectParams()])
        problems = match_reference(
            det,
            single.boxes,
            single.scores,
            single.class_ids,
            min_iou=0.95,
            conf_tol=0.01,
            edge_conf=0.27,
        )
        assert not problems, problems


def test_params_filter_results(engine: Engine) -> None:
    image = load_image(ultralytics_assets() / "bus.jpg")
    (only_bus,) = engine.infer([image], [DetectParams(classes=frozenset({5}))])
    assert list(only_bus.class_ids) == [5]
    (top2,) = engine.infer([image], [DetectParams(max_det=2)])
    assert len(top2) == 2
    (strict,) = engine.infer([image], [DetectParams(conf=0.88)])
    assert all(s > 0.88 for s in strict.scores)
    assert 1 <= len(strict) < 5


@pytest.mark.parametrize(("h", "w"), [(1, 5000), (5000, 1), (3, 4000), (1, 1)])
def test_a_sliver_of_an_image_finds_nothing_as_ultralytics(engine: Engine, h: int, w: int) -> None:
    """Scaled to fit, a 1x5000 image is under half a pixel high: it runs at one pixel (it
    failed every call it was in with OpenCV's "inv_scale_x > 0" assertion, a 500); Ultralytics'
    predictor finds nothing in it either."""
    sliver = np.full((h, w, 3), 128, np.uint8)
    bus = load_image(ultralytics_assets() / "bus.jpg")
    det, with_it = engine.infer([sliver, bus], [DetectParams(conf=CONF)] * 2)
    assert len(det) == 0 and (det.height, det.width) == (h, w)
    assert len(reference(engine, sliver)[0]) == 0
    assert len(with_it) >= 4  # a batch it is in is unharmed


# ---- a fixed non-square input: Ultralytics' export(format="onnx", imgsz=(320, 480)) ----------


@pytest.fixture(scope="module", params=["onnxruntime", "torch"])
def rect_engine(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> tuple[Engine, Any]:
    """A (320, 480) fixed-input export of a copy of the shared model (ONNX for ONNX Runtime,
    TorchScript for the torch backend's device-side letterbox, on the CPU here), and
    Ultralytics' predictor on the same file."""
    import shutil

    from ultralytics import YOLO

    from engines.model import read_model_info
    from engines.registry import EngineConfig, load_backend
    from tests.conftest import backend_device
    from tests.helpers import CACHE_DIR, MODEL_PT

    folder = tmp_path_factory.mktemp("rect")
    pt = folder / MODEL_PT.name
    shutil.copyfile(MODEL_PT, pt)
    backend = request.param
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kind = "onnx" if backend == "onnxruntime" else "torchscript"
        path = Path(YOLO(str(pt)).export(format=kind, imgsz=(320, 480), verbose=False))
    if backend == "onnxruntime":
        info = read_model_info(path)
    else:
        from engines.torch_cuda import checkpoint_info

        info = checkpoint_info(path)
    assert info.imgsz == (320, 480) and not info.dynamic_hw
    config = EngineConfig(
        model=info,
        imgsz=640,
        max_batch=2,
        threads=2,
        device=backend_device(backend),
        cache_dir=CACHE_DIR,
        source=path,
    )
    engine = load_backend(backend)(config)
    engine.load()
    engine.warmup()
    return engine, YOLO(str(path), task="detect")


def _predict(model: Any, image_rgb: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Ultralytics' boxes, scores and classes for ``image_rgb``, ``conf`` 0.25."""
    with warnings.catch_warnings():  # its first call loads the file: torch.jit.load warns
        warnings.simplefilter("ignore", FutureWarning)
        result = model.predict(
            np.ascontiguousarray(image_rgb[..., ::-1]), conf=CONF, verbose=False
        )[0]
    boxes = result.boxes
    return (
        boxes.xyxy.cpu().numpy(),
        boxes.conf.cpu().numpy(),
        boxes.cls.cpu().numpy().astype(np.int32),
    )


def test_fixed_non_square_input_matches_ultralytics(rect_engine: tuple[Engine, Any]) -> None:
    """It was refused ("non-square fixed input (320, 480) unsupported"); letterboxed into
    320x480 as Ultralytics' predictor does, the boxes are its boxes."""
    engine, reference_yolo = rect_engine
    assert engine.input_size == 480
    images = [load_image(ultralytics_assets() / n) for n in ("bus.jpg", "zidane.jpg")]
    images += [frame for video in VIDEOS for frame in sample_video_frames(video, 2, offset=40)]
    total = 0
    for image in images:
        (det,) = engine.infer([image], [DetectParams(conf=CONF)])
        assert (det.height, det.width) == image.shape[:2]
        problems = match_reference(det, *_predict(reference_yolo, image), edge_conf=CONF + 0.02)
        assert not problems, problems
        total += len(det)
    assert total > 0
