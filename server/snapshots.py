"""Event snapshots: the frame each event happened in, as a JPEG with its boxes (and track
ids), the stream's zones and counting lines drawn, for ``GET /events/{id}/snapshot.jpg`` (as
Frigate keeps a snapshot per event). A webhook receiver or a notification fetches the picture
of what crossed the line.

A frame with several events is drawn once. The JPEG is made in a worker thread as soon as the
frame's events are logged (the frame itself is not kept: at 1080p it would weigh 6 MB), scaled
to at most ``event_snapshot_width`` pixels wide; the last ``event_snapshots`` frames' JPEGs
are kept (about 40 kB each at 640 px). A frame whose JPEG cannot start because
:data:`MAX_PENDING` others are still being drawn gets none (counted in
``streamdet_event_snapshots_total{outcome="skipped"}``): under a burst of events the CPU goes
to detection first.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

from server.metrics import Metrics
from server.render import render_jpeg
from streams.detect import StreamDetect
from streams.fanout import ProcessedFrame

log = logging.getLogger(__name__)
MAX_PENDING = 8
QUALITY = 80
SNAPSHOT_PATH = "/events/{id}/snapshot.jpg"


class SnapshotStore:
    """The JPEGs of the last ``size`` frames with events, by event id.

    Args:
        size: frames kept (0: no snapshots).
        max_width: wider frames are scaled down to this.
        executor: where the JPEGs are drawn.
        detect_of: a stream's current settings (its zones and lines are drawn).
        metrics: counts snapshots made and skipped.
    """

    def __init__(
        self,
        size: int,
        max_width: int,
        executor: Executor | None,
        detect_of: Callable[[str], StreamDetect | None],
        metrics: Metrics | None = None,
    ) -> None:
        self.size = size
        self._max_width = max_width
        self._executor = executor
        self._detect_of = detect_of
        self._metrics = metrics
        self._frames: OrderedDict[tuple[str, int], asyncio.Future[bytes]] = OrderedDict()
        self._events: dict[tuple[str, int], list[int]] = {}
        self._by_event: dict[int, tuple[str, int]] = {}
        self._pending = 0

    @property
    def enabled(self) -> bool:
        return self.size > 0

    def extra(self, frame: ProcessedFrame, event_id: int) -> dict[str, Any]:
        """What each logged event gets: the path of its snapshot, where its frame will have
        one (:meth:`capture` follows on the event loop, with nothing in between)."""
        if not self.enabled or self._pending >= MAX_PENDING:
            return {}
        return {"snapshot": SNAPSHOT_PATH.format(id=event_id)}

    def capture(self, frame: ProcessedFrame, events: list[dict[str, Any]]) -> None:
        """Event loop: start drawing ``frame`` for its ``events`` (as logged)."""
        if not self.enabled or not events:
            return
        if self._pending >= MAX_PENDING:
            self._count("skipped")
            return
        key = (frame.stream_id, frame.frame)
        detect = self._detect_of(frame.stream_id) or StreamDetect()
        render = functools.partial(
            render_jpeg,
            frame.image,
            self._max_width,
            QUALITY,
            detections=frame.detections,
            lines=[(line, line.name) for line in detect.lines],
            zones=[(zone, zone.name) for zone in detect.zones],
        )
        self._pending += 1
        loop = asyncio.get_running_loop()
        drawn = loop.run_in_executor(self._executor, render)
        jpeg: asyncio.Future[bytes] = loop.create_future()

        def done(result: asyncio.Future[tuple[bytes, int, int]]) -> None:
            self._pending -= 1
            if result.cancelled():
                jpeg.cancel()
            elif (error := result.exception()) is not None:
                log.warning("stream %s: snapshot of frame %d failed: %s", *key, error)
                jpeg.set_exception(error)
            else:
                self._count("made")
                jpeg.set_result(result.result()[0])

        drawn.add_done_callback(done)
        self._frames[key] = jpeg
        self._events[key] = [int(e["id"]) for e in events]
        for event in events:
            self._by_event[int(event["id"])] = key
        while len(self._frames) > self.size:
            old, _ = self._frames.popitem(last=False)
            for event_id in self._events.pop(old, ()):
                self._by_event.pop(event_id, None)

    async def get(self, event_id: int) -> bytes | None:
        """The JPEG of ``event_id``'s frame (waiting for it to be drawn); None when there is
        none (an unknown id, an event older than the frames kept, or a skipped one)."""
        key = self._by_event.get(event_id)
        jpeg = None if key is None else self._frames.get(key)
        if jpeg is None:
            return None
        try:
            return await asyncio.shield(jpeg)
        except Exception:  # drawing failed: logged when it did
            return None

    def _count(self, outcome: str) -> None:
        if self._metrics is not None:
            self._metrics.event_snapshots.labels(outcome).inc()
