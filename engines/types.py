"""Types that flow through every stage: detection parameters, results, the engine interface."""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

Image = npt.NDArray[np.uint8]
"""An RGB image, ``(H, W, 3)`` uint8, C-contiguous."""


class EngineError(RuntimeError):
    """A model or runtime could not be loaded or run; the message says what to change."""


class ModelError(EngineError):
    """The model file is missing, unreadable or not a detection model."""


@dataclass(frozen=True, slots=True)
class DetectParams:
    """Per-request post-processing parameters.

    Attributes:
        conf: minimum confidence kept.
        iou: IoU threshold of non-maximum suppression.
        classes: class ids to keep, or ``None`` for all.
        max_det: most detections returned per image.
    """

    conf: float = 0.25
    iou: float = 0.7
    classes: frozenset[int] | None = None
    max_det: int = 300

    def __post_init__(self) -> None:
        if not 0.0 <= self.conf <= 1.0:
            raise ValueError(f"conf must be within [0, 1], got {self.conf}")
        if not 0.0 <= self.iou <= 1.0:
            raise ValueError(f"iou must be within [0, 1], got {self.iou}")
        if not 1 <= self.max_det <= 10_000:
            raise ValueError(f"max_det must be within [1, 10000], got {self.max_det}")

    def describe(self, names: Mapping[int, str]) -> dict[str, Any]:
        """JSON form, classes by name (a stream keeps them across a change of model)."""
        classes = None if self.classes is None else [names[c] for c in sorted(self.classes)]
        return {"conf": self.conf, "iou": self.iou, "classes": classes, "max_det": self.max_det}

    @classmethod
    def from_description(cls, data: Mapping[str, Any], names: Mapping[int, str]) -> DetectParams:
        """Inverse of :meth:`describe`; missing keys take the defaults.

        Raises:
            ValueError: a value out of range or a class this model does not have.
        """
        classes, default = data.get("classes"), cls()
        return cls(
            conf=float(data.get("conf", default.conf)),
            iou=float(data.get("iou", default.iou)),
            classes=None if classes is None else class_ids(classes, names),
            max_det=int(data.get("max_det", default.max_det)),
        )


def class_ids(tokens: Iterable[str | int], names: Mapping[int, str]) -> frozenset[int]:
    """Class ids from ids or names (``["0", "car", 5]``, names case-insensitive).

    Raises:
        ValueError: an id or name the model does not have; the message names it.
    """
    by_name = {name.lower(): cid for cid, name in names.items()}
    ids: set[int] = set()
    for token in tokens:
        text = str(token).strip()
        if not text:
            continue
        if re.fullmatch(r"-?[0-9]+", text):  # ASCII digits ("²".isdigit() is true)
            cid = int(text)
            if cid not in names:
                raise ValueError(
                    f"classes: unknown class id {cid}; this model has ids 0..{len(names) - 1}"
                )
            ids.add(cid)
        elif text.lower() in by_name:
            ids.add(by_name[text.lower()])
        else:  # a hint that holds without a server too (streamdet analyze)
            close = difflib.get_close_matches(text.lower(), by_name, n=3, cutoff=0.6)
            hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
            raise ValueError(
                f"classes: unknown class name {text!r}; {hint}the model has {len(names)} class"
                " names (a server's GET /model lists them)"
            )
    return frozenset(ids)


def class_name(names: Mapping[int, str], class_id: int) -> str:
    """A class id's name in ``names``; the id itself where the model names no such class."""
    return names.get(int(class_id), str(int(class_id)))


@dataclass(frozen=True, slots=True)
class Detections:
    """Detections of one image, boxes in source-image pixels.

    Attributes:
        boxes: ``(N, 4)`` float32 ``x1, y1, x2, y2``.
        scores: ``(N,)`` float32 confidences, descending.
        class_ids: ``(N,)`` int32.
        names: class id to name, shared by all results of a model.
        width: source image width in pixels.
        height: source image height in pixels.
        track_ids: ``(N,)`` int64 ids of the objects across a stream's frames, where the
            stream tracks (:mod:`streams.track`); ``None`` otherwise.
    """

    boxes: npt.NDArray[np.float32]
    scores: npt.NDArray[np.float32]
    class_ids: npt.NDArray[np.int32]
    names: Mapping[int, str]
    width: int
    height: int
    track_ids: npt.NDArray[np.int64] | None = None

    def __len__(self) -> int:
        return int(self.scores.shape[0])

    def select(self, keep: npt.NDArray[np.bool_]) -> Detections:
        """The detections where ``keep`` is true, in order."""
        return Detections(
            boxes=self.boxes[keep],
            scores=self.scores[keep],
            class_ids=self.class_ids[keep],
            names=self.names,
            width=self.width,
            height=self.height,
            track_ids=None if self.track_ids is None else self.track_ids[keep],
        )

    def rescaled(self, width: int, height: int) -> Detections:
        """The same detections in an image of ``width`` x ``height`` pixels (the source of a
        frame that was decoded smaller: boxes scaled by the ratio of the sizes)."""
        if (width, height) == (self.width, self.height):
            return self
        sx = width / self.width if self.width else 1.0
        sy = height / self.height if self.height else 1.0
        boxes = self.boxes * np.array([sx, sy, sx, sy], np.float32)
        np.clip(boxes, 0, np.array([width, height, width, height], np.float32), out=boxes)
        return dataclasses.replace(self, boxes=boxes, width=width, height=height)

    def name_of(self, class_id: int) -> str:
        """A class id's name; the id itself where the model names no such class."""
        return class_name(self.names, class_id)

    def to_json(self) -> list[dict[str, Any]]:
        """The API form: one dict per detection (DESIGN §4), with ``track_id`` where the
        detections are tracked."""
        out = [
            {
                "box": [round(float(v), 2) for v in box],
                "confidence": round(float(score), 4),
                "class_id": int(cid),
                "class_name": self.name_of(cid),
            }
            for box, score, cid in zip(self.boxes, self.scores, self.class_ids, strict=True)
        ]
        if self.track_ids is not None:
            for item, track_id in zip(out, self.track_ids, strict=True):
                item["track_id"] = int(track_id)
        return out

    @classmethod
    def empty(cls, names: Mapping[int, str], width: int, height: int) -> Detections:
        return cls(
            boxes=np.zeros((0, 4), np.float32),
            scores=np.zeros((0,), np.float32),
            class_ids=np.zeros((0,), np.int32),
            names=names,
            width=width,
            height=height,
        )


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the ONNX metadata says about a model."""

    path: str
    names: Mapping[int, str]
    imgsz: tuple[int, int]
    stride: int
    dynamic_hw: bool
    precision: str = "fp32"
    extra: Mapping[str, str] = field(default_factory=dict)
    fixed_batch: int | None = None
    """The batch size the graph fixes (Ultralytics' default export: 1): the pool batches no
    more; ``None`` where the batch axis is dynamic."""


@runtime_checkable
class Engine(Protocol):
    """A loaded detector. One instance serves one worker thread.

    ``infer`` takes whole RGB images and returns one :class:`Detections` per image; pre- and
    post-processing belong to the engine so a GPU engine can do both on the device.
    """

    @property
    def names(self) -> Mapping[int, str]: ...

    @property
    def input_size(self) -> int: ...

    @property
    def max_batch(self) -> int: ...

    @property
    def model_name(self) -> str: ...

    def load(self) -> None: ...

    def warmup(self) -> None: ...

    def infer(
        self, images: Sequence[Image], params: Sequence[DetectParams]
    ) -> list[Detections]: ...

    def close(self) -> None: ...
