"""argparse types for the commands' numbers: each refuses, naming the bound, what is out of its
range (``--frames 0`` ran a frame a clip, ``--users -1`` ran a load test of no users,
``--min-score 2`` failed every run)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def number(
    kind: type[int] | type[float], low: float, high: float = math.inf, *, above: bool = False
) -> Callable[[str], float]:
    """An argparse type: a finite number of ``kind`` from ``low`` (above it where ``above``)
    to ``high``."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        under = value <= low if above else value < low
        if under or value > high or not math.isfinite(value):
            if above and high == math.inf:
                bound = f"above {low:g}"
            elif high == math.inf:
                bound = f"of {low:g} or more"
            else:
                bound = f"from {low:g} to {high:g}"
            raise argparse.ArgumentTypeError(f"{text!r}: give a number {bound}")
        return value

    return parse


def positive(kind: type[int] | type[float]) -> Callable[[str], float]:
    """An argparse type: a number of ``kind`` above 0."""
    return number(kind, 0, above=True)
