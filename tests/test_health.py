"""/healthz's stream pressure: drop ratios over the last minute (injected clock)."""

from __future__ import annotations

import pytest

from server.routes.health import DROP_RATIO_THRESHOLD, PRESSURE_WINDOW_S, StreamPressure


def test_stream_pressure_is_the_drop_ratio_over_the_last_minute() -> None:
    """Under a stream overload (95 % of frames dropped) /healthz said only "ok": its drop
    ratios over the window name the overloaded streams, and an overload that ended leaves
    the window."""
    now = [1000.0]
    tracker = StreamPressure(clock=lambda: now[0])
    # First sample: since the streams were added.
    first = tracker.observe({"a": (100, 95), "b": (100, 0)})
    assert first == {"a": 0.95, "b": 0.0}
    assert first["a"] > DROP_RATIO_THRESHOLD >= first["b"]
    now[0] += 10
    assert tracker.observe({"a": (200, 190), "b": (200, 5)}) == pytest.approx(
        {"a": 0.95, "b": 0.05}
    )
    # "a" recovers: once the overloaded samples leave the window, its ratio is today's.
    now[0] += PRESSURE_WINDOW_S + 1
    assert tracker.observe({"a": (300, 190), "b": (300, 5)}) == {"a": 0.0, "b": 0.0}
    now[0] += 5
    assert tracker.observe({"a": (400, 200), "b": (400, 5)}) == pytest.approx(
        {"a": 10 / 200, "b": 0.0}
    )
    # A stream added since: its counters since it was added; a stream gone is forgotten.
    assert tracker.observe({"c": (10, 9)}) == {"c": 0.9}


def test_a_stream_added_again_under_its_id_is_measured_from_its_new_start() -> None:
    """A stream removed and added again under the same id has counters from 0: it was
    measured against its old counters (above its new ones) and read 0 for up to a window
    however much it dropped."""
    now = [1000.0]
    tracker = StreamPressure(clock=lambda: now[0])
    tracker.observe({"a": (500, 10)})
    now[0] += 5
    # Added again and overloaded at once: counters back to small numbers.
    assert tracker.observe({"a": (40, 38)}) == {"a": 38 / 40}
    now[0] += 5
    assert tracker.observe({"a": (100, 95)}) == {"a": 95 / 100}
    # Gone from one sample (removed), then back: from its new start too.
    now[0] += 5
    tracker.observe({})
    now[0] += 5
    assert tracker.observe({"a": (600, 590)}) == pytest.approx({"a": 590 / 600})
