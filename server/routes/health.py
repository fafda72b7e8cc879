"""Liveness, readiness and model description."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from server.state import get_state

router = APIRouter()

PRESSURE_WINDOW_S = 60.0
"""Streams' drop ratios in ``/healthz`` are over this window."""
DROP_RATIO_THRESHOLD = 0.5
"""A stream dropping more than this share of its frames is listed (the alert rule's)."""


class StreamPressure:
    """Drop ratios over the last :data:`PRESSURE_WINDOW_S`, from the streams' counters as
    ``/healthz`` saw them (at most one sample a second is kept; where calls come less often,
    since the call before; for a stream not seen before, since it was added)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._samples: deque[tuple[float, Mapping[str, tuple[int, int]]]] = deque()

    def observe(self, counters: Mapping[str, tuple[int, int]]) -> dict[str, float]:
        """``counters``: ``(frames_in, drops)`` by stream now; returns drop ratios by stream."""
        now = self.clock()
        # The newest sample at least a window old stays as the window's start.
        while len(self._samples) > 1 and self._samples[1][0] <= now - PRESSURE_WINDOW_S:
            self._samples.popleft()
        ratios: dict[str, float] = {}
        for sid, (frames, drops) in counters.items():
            base = self._base(sid, frames)
            seen = frames - base[0]
            ratios[sid] = max(0, drops - base[1]) / seen if seen > 0 else 0.0
        if not self._samples or now - self._samples[-1][0] >= 1.0:
            self._samples.append((now, dict(counters)))
        return ratios

    def _base(self, sid: str, frames: int) -> tuple[int, int]:
        """The window's first counters of this stream since it last started: a stream
        removed and added again under its id (absent from a sample, or counters gone back)
        starts anew (it was measured against its old counters, above its new ones: 0 for
        up to a window however much it dropped)."""
        base: tuple[int, int] | None = None
        last: tuple[int, int] | None = None
        for _, sample in self._samples:
            got = sample.get(sid)
            if got is None or (last is not None and got[0] < last[0]) or base is None:
                base = got
            last = got
        if base is None or (last is not None and frames < last[0]):
            return (0, 0)
        return base


def stream_pressure(request: Request) -> dict[str, Any] | None:
    """The streams' part of ``/healthz``: the lane's depth and the streams dropping most of
    their frames (``None`` with no stream)."""
    state = get_state(request)
    if state.streams is None:
        return None
    streams = state.streams.list()
    if not streams:
        return None
    tracker: StreamPressure | None = getattr(request.app.state, "stream_pressure", None)
    if tracker is None:
        tracker = request.app.state.stream_pressure = StreamPressure()
    # Of the frames sent to the engine: those max_fps or motion left out never were (a
    # stream sampled at under half its source's rate could drop all it sent, and never pass).
    ratios = tracker.observe({s["id"]: (sent(s), int(s["drops"])) for s in streams})
    dropping = {sid: round(r, 3) for sid, r in sorted(ratios.items()) if r > DROP_RATIO_THRESHOLD}
    _, lane = state.pool.queue.depth()
    return {
        "count": len(streams),
        "lane_depth": lane,
        "dropping": dropping,
        "drop_ratio_threshold": DROP_RATIO_THRESHOLD,
        "window_s": PRESSURE_WINDOW_S,
    }


# HEAD too: some load balancers' and uptime checkers' probes send it (it was 405).
@router.get("/healthz")
@router.head("/healthz", include_in_schema=False)
async def healthz(request: Request) -> dict[str, Any]:
    """Alive (always 200); with streams, their pressure: an operator reading it sees streams
    dropping most of their frames (a 95 % overload showed only in /metrics). ``/readyz`` is
    not affected: it gates ``/detect`` in load balancers."""
    body: dict[str, Any] = {"status": "ok"}
    if (pressure := stream_pressure(request)) is not None:
        body["streams"] = pressure
    return body


@router.get("/readyz")
@router.head("/readyz", include_in_schema=False)
async def readyz(request: Request) -> JSONResponse:
    state = get_state(request)
    if state.ready:
        return JSONResponse({"status": "ready", "model": state.pool.engine.model_name})
    return JSONResponse({"status": "not ready"}, status_code=503, headers={"Retry-After": "1"})


@router.get("/model")
async def model(request: Request) -> dict[str, Any]:
    state = get_state(request)
    engine = state.pool.engine
    return {
        "model": engine.model_name,
        "backend": state.settings.backend,
        "input_size": engine.input_size,
        "max_batch": engine.max_batch,
        "names": {str(k): v for k, v in engine.names.items()},
    }


def sent(stream: dict[str, Any]) -> int:
    """A stream's frames sent to the engine: taken in, less those its ``max_fps`` or its
    motion check left out."""
    return int(stream["frames_in"]) - int(stream["skipped"]) - int(stream["motion_skipped"])
