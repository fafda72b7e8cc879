"""Per-class object filters, as Frigate's ``objects.filters``: a class's own minimum
confidence, and the sizes and shapes its boxes may have, so a stream drops what its camera
makes of leaves, reflections and far-away specks before anything is tracked or counted.

Areas are shares of the frame (0..1, resolution-free, as regions are); ratios are a box's
width over its height (a standing person about 0.4, a car from the side about 2.5).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from engines.types import Detections, class_ids, class_name

MAX_FILTERS = 80
FIELDS = ("min_conf", "min_area", "max_area", "min_ratio", "max_ratio")


@dataclass(frozen=True, slots=True)
class ObjectFilter:
    """What one class's detections must be to be kept (None: no bound).

    Raises:
        ValueError: a bound out of range, or a minimum over its maximum.
    """

    min_conf: float | None = None
    min_area: float | None = None
    max_area: float | None = None
    min_ratio: float | None = None
    max_ratio: float | None = None

    def __post_init__(self) -> None:
        for name in FIELDS:
            value: object = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise ValueError(f"{name}: a number, not {value!r}")
            share = name not in {"min_ratio", "max_ratio"}
            if share and not 0 <= value <= 1:
                raise ValueError(f"{name}: from 0 to 1, not {value!r}")
            if not share and not (0 < value < math.inf):
                raise ValueError(f"{name}: a width over a height above 0, not {value!r}")
        for low, high in (("min_area", "max_area"), ("min_ratio", "max_ratio")):
            a, b = getattr(self, low), getattr(self, high)
            if a is not None and b is not None and a > b:
                raise ValueError(f"{low} {a} is over {high} {b}")

    def to_json(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in FIELDS if getattr(self, name) is not None}


@dataclass(frozen=True, slots=True)
class ObjectFilters:
    """Filters by class id (a tuple of pairs: hashable and ordered)."""

    by_class: tuple[tuple[int, ObjectFilter], ...]

    @classmethod
    def parse(cls, raw: Mapping[str, Mapping[str, Any]], names: Mapping[int, str]) -> ObjectFilters:
        """``{"person": {"min_conf": 0.5, "min_area": 0.001}, ...}`` (classes by name or
        id).

        Raises:
            ValueError: naming the class and the bound that is not right.
        """
        if len(raw) > MAX_FILTERS:
            raise ValueError(f"filters: at most {MAX_FILTERS} classes")
        found: dict[int, ObjectFilter] = {}
        keys: dict[int, str] = {}
        for key, bounds in raw.items():
            try:
                (class_id,) = class_ids([key], names)
            except ValueError as exc:
                raise ValueError(f"filters: {exc}") from None
            if class_id in keys:  # by id and by name: the one given last was kept, unsaid
                raise ValueError(
                    f"filters: {keys[class_id]!r} and {key!r} are the same class"
                    f" ({class_name(names, class_id)}); give its bounds once"
                )
            keys[class_id] = key
            if not isinstance(bounds, Mapping):
                raise ValueError(f"filters: {key!r}: an object of bounds, not {bounds!r}")
            unknown = set(bounds) - set(FIELDS)
            if unknown:
                raise ValueError(
                    f"filters: {key!r}: unknown {', '.join(sorted(unknown))}; use"
                    f" {', '.join(FIELDS)}"
                )
            try:
                found[class_id] = ObjectFilter(**bounds)
            except ValueError as exc:
                raise ValueError(f"filters: {key!r}: {exc}") from None
        return cls(tuple(sorted(found.items())))

    def to_json(self, names: Mapping[int, str]) -> dict[str, dict[str, float]]:
        return {class_name(names, c): f.to_json() for c, f in self.by_class}

    def lowest_conf(self) -> float | None:
        """The lowest class confidence given, if any (the engine must run at most at it)."""
        given = [f.min_conf for _, f in self.by_class if f.min_conf is not None]
        return min(given, default=None)

    def apply(
        self, detections: Detections, conf: float
    ) -> tuple[Detections, npt.NDArray[np.float32]]:
        """``detections`` whose boxes fit their class's sizes and shapes, and the confidence
        each must reach: its class's ``min_conf``, else ``conf``."""
        n = len(detections)
        need = np.full(n, conf, np.float32)
        if n == 0 or not self.by_class:
            return detections, need
        boxes = detections.boxes
        w = np.maximum(boxes[:, 2] - boxes[:, 0], 0.0)
        h = np.maximum(boxes[:, 3] - boxes[:, 1], 0.0)
        area = w * h / float(max(detections.width * detections.height, 1))
        ratio = w / np.maximum(h, 1e-6)
        keep = np.ones(n, bool)
        for class_id, bounds in self.by_class:
            mine = detections.class_ids == class_id
            if not mine.any():
                continue
            if bounds.min_conf is not None:
                need[mine] = bounds.min_conf
            for values, low, high in (
                (area, bounds.min_area, bounds.max_area),
                (ratio, bounds.min_ratio, bounds.max_ratio),
            ):
                if low is not None:
                    keep &= ~mine | (values >= low)
                if high is not None:
                    keep &= ~mine | (values <= high)
        if keep.all():
            return detections, need
        return detections.select(keep), need[keep]
