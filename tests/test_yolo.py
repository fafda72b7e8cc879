"""Letterbox and NMS against Ultralytics' own implementations."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from engines import yolo
from engines.types import DetectParams
from engines.yolo import (
    LetterboxMeta,
    box_iou,
    box_iou_rows,
    group_by_shape,
    letterbox,
    nms,
    postprocess_one,
    preprocess,
    rect_shape,
)


@pytest.mark.parametrize(("h", "w"), [(1080, 810), (432, 768), (360, 640), (100, 1000), (640, 640)])
def test_letterbox_matches_ultralytics(h: int, w: int) -> None:
    from ultralytics.data.augment import LetterBox

    rng = np.random.default_rng(h * w)
    image = rng.integers(0, 255, (h, w, 3), dtype=np.uint8)
    theirs = np.asarray(LetterBox((640, 640), auto=True, stride=32)(image=image))
    shape = rect_shape(h, w, 640, 32)
    ours, meta = letterbox(image, shape, 640)
    assert ours.shape == theirs.shape
    np.testing.assert_array_equal(ours, theirs)
    assert meta.width == w and meta.height == h


def test_square_letterbox_matches_ultralytics() -> None:
    from ultralytics.data.augment import LetterBox

    image = np.random.default_rng(0).integers(0, 255, (432, 768, 3), dtype=np.uint8)
    theirs = np.asarray(LetterBox((640, 640), auto=False, stride=32)(image=image))
    ours, _ = letterbox(image, (640, 640), 640)
    np.testing.assert_array_equal(ours, theirs)


def test_images_group_by_their_rect_shape() -> None:
    portrait = np.zeros((1080, 810, 3), np.uint8)
    landscape = np.zeros((432, 768, 3), np.uint8)
    groups = group_by_shape([portrait, landscape, landscape], 640, 32, dynamic_hw=True)
    assert groups == {(640, 480): [0], (384, 640): [1, 2]}
    assert group_by_shape([portrait, landscape], 640, 32, dynamic_hw=False) == {(640, 640): [0, 1]}
    with pytest.raises(ValueError, match="image 0"):
        group_by_shape([np.zeros((0, 5, 3), np.uint8)], 640, 32, dynamic_hw=True)


def test_preprocess_makes_a_normalised_batch() -> None:
    landscape = np.full((432, 768, 3), 255, np.uint8)
    blob, metas = preprocess([landscape, landscape], 640, (384, 640))
    assert blob.shape == (2, 3, 384, 640)
    assert blob.dtype == np.float32 and float(blob.max()) == 1.0
    assert metas[1].gain == pytest.approx(640 / 768)


def test_nms_matches_torchvision_semantics() -> None:
    from ultralytics.utils.nms import TorchNMS

    rng = np.random.default_rng(7)
    xy = rng.uniform(0, 500, (300, 2)).astype(np.float32)
    wh = rng.uniform(10, 120, (300, 2)).astype(np.float32)
    boxes = np.concatenate([xy, xy + wh], axis=1)
    scores = np.sort(rng.uniform(0, 1, 300).astype(np.float32))[::-1].copy()
    for iou in (0.3, 0.5, 0.7):
        ours = nms(boxes, scores, iou, limit=len(boxes))
        theirs = TorchNMS.nms(torch.from_numpy(boxes), torch.from_numpy(scores), iou)
        assert ours == theirs.tolist()
        # Stopped at a limit (max_det), it keeps the same first boxes.
        assert nms(boxes, scores, iou, limit=5) == theirs.tolist()[:5]


def test_nms_stops_at_max_det_where_nothing_is_suppressed(monkeypatch: pytest.MonkeyPatch) -> None:
    """``conf=0``: every anchor a candidate; with ``iou=1`` none suppresses another, and NMS
    stops at ``max_det`` (it kept all 8,400 candidates before, then cut: 0.3 to 0.6 s an
    image)."""
    pred = np.zeros((4 + 2, 8400), np.float32)
    pred[:4] = [[320.0], [320.0], [40.0], [40.0]]  # one box, 8,400 times
    pred[4] = np.linspace(0.9, 0.1, 8400, dtype=np.float32)
    meta = LetterboxMeta(width=640, height=640, gain=1.0, pad_x=0.0, pad_y=0.0)
    kept: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> list[int]:
        kept.extend(result := nms(*args, **kwargs))
        return result

    monkeypatch.setattr(yolo, "nms", counted)
    det = postprocess_one(pred, meta, DetectParams(conf=0.0, iou=1.0, max_det=7), {0: "a", 1: "b"})
    assert len(det.scores) == 7 and det.scores[0] == pytest.approx(0.9)
    assert len(kept) == 7  # NMS itself kept no more


def test_postprocess_maps_boxes_back_and_is_class_aware() -> None:
    nc = 3
    pred = np.zeros((4 + nc, 4), np.float32)
    # Two overlapping boxes of different classes survive; a same-class duplicate does not.
    pred[:4, 0] = [100, 100, 50, 50]
    pred[4 + 0, 0] = 0.9
    pred[:4, 1] = [102, 100, 50, 50]
    pred[4 + 1, 1] = 0.8
    pred[:4, 2] = [101, 101, 50, 50]
    pred[4 + 0, 2] = 0.7
    pred[:4, 3] = [300, 300, 20, 20]
    pred[4 + 2, 3] = 0.1  # under conf
    meta = LetterboxMeta(gain=0.5, pad_x=10, pad_y=20, width=1000, height=1000)
    det = postprocess_one(pred, meta, DetectParams(conf=0.25, iou=0.5), {0: "a", 1: "b", 2: "c"})
    assert list(det.class_ids) == [0, 1]
    np.testing.assert_allclose(
        det.boxes[0], [(75 - 10) / 0.5, (75 - 20) / 0.5, (125 - 10) / 0.5, (125 - 20) / 0.5]
    )
    assert det.to_json()[0]["class_name"] == "a"


def test_detect_params_reject_out_of_range() -> None:
    with pytest.raises(ValueError, match="conf"):
        DetectParams(conf=1.5)
    with pytest.raises(ValueError, match="max_det"):
        DetectParams(max_det=0)


def test_row_iou_is_the_diagonal_of_the_iou_matrix() -> None:
    rng = np.random.default_rng(0)
    a = rng.random((40, 4)) * 100
    a[:, 2:] += a[:, :2]
    b = a + rng.random((40, 4)) * 20
    b[5] = [0, 0, 0, 0]  # an empty box overlaps nothing
    rows = box_iou_rows(a, b)
    np.testing.assert_allclose(rows, np.diag(box_iou(a, b)))
    assert rows[5] == 0.0 and box_iou_rows(a[:1], a[:1]) == pytest.approx([1.0])


def test_fixed_non_square_letterbox_matches_ultralytics() -> None:
    """A fixed (320, 480) input: the image scaled to fit both sides, centred, grey padding."""
    from ultralytics.data.augment import LetterBox

    for h, w in [(1080, 810), (432, 768), (100, 1000)]:
        image = np.random.default_rng(h).integers(0, 255, (h, w, 3), dtype=np.uint8)
        theirs = np.asarray(LetterBox((320, 480), auto=False, stride=32)(image=image))
        (shape,) = group_by_shape([image], 480, 32, dynamic_hw=False, fixed=(320, 480))
        assert shape == (320, 480)
        ours, _ = letterbox(image, shape, 480)
        np.testing.assert_array_equal(ours, theirs)
