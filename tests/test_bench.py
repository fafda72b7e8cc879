"""``streamdet bench``'s engine-only rates, on every form of the shared model (its load test
against the server is what ``make bench`` runs; the figures are in the README)."""

from __future__ import annotations

from pathlib import Path

import pytest

from server.bench import engine_ceiling
from server.settings import Settings
from streams.files import sample_video_frames
from tests.helpers import CACHE_DIR, MODEL_PT, MODEL_TS, VIDEOS


@pytest.mark.parametrize("model", [MODEL_PT, MODEL_TS], ids=["pt", "torchscript"])
def test_engine_rates_at_square_and_rect_shapes(model: Path) -> None:
    settings = Settings(model=str(model), cache_dir=CACHE_DIR)
    (frame,) = sample_video_frames(VIDEOS[0], 1)  # 640x360: rect 640x384 where the model allows
    square = engine_ceiling(settings, frame, 0.3)
    rect = engine_ceiling(settings, frame, 0.3, rect=True)  # a TorchScript runs square anyway
    assert square > 0 and rect > 0
