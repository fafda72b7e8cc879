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


def test_a_stream_sampled_under_half_its_rate_is_measured_on_the_frames_it_sent() -> None:
    """12.5 fps sampled at 5, 41 of the 52 frames sent to the engine dropped: 0.79, over the
    threshold (measured on every frame taken in, 41 of 131, it could never pass 0.5)."""
    from server.routes.health import sent

    cars = {"frames_in": 131, "skipped": 79, "motion_skipped": 0, "drops": 41}
    tracker = StreamPressure(clock=lambda: 1000.0)
    ratio = tracker.observe({"cars": (sent(cars), cars["drops"])})["cars"]
    assert ratio == pytest.approx(41 / 52) and ratio > DROP_RATIO_THRESHOLD
    still = {"frames_in": 131, "skipped": 60, "motion_skipped": 19, "drops": 41}
    assert sent(still) == 52
