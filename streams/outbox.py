"""Processed frames on their way from the engine workers to the event loop.

A worker hands each frame it finishes to the :class:`Outbox`; the loop is woken once for
all the frames that arrive before it runs (a batch's worth). When the loop falls behind (a
long callback, a collection pause, more frames per second than it publishes), a stream's
frames would pile up here with their images, a GPU's thousands a second: so each stream
keeps at most ``per_stream`` frames waiting, and beyond them its oldest frame without events
is dropped, the latest frame winning as it does at ingest (counted as the stream's
``publish_drops``: processed, not published; not among its ``drops``, frames the engine never
took). A frame with events is never dropped: an event reaches the event log, its sinks and
the viewers whatever the lag.
"""

from __future__ import annotations

import threading
from collections import deque

from streams.fanout import ProcessedFrame

OUTBOX_PER_STREAM = 8
"""Frames of one stream that may wait for the event loop (266 ms of a 30 fps camera)."""


class Outbox:
    """A bounded, thread-safe hand-over of processed frames, each with its reader's token.

    Args:
        per_stream: frames of one stream kept waiting; at least 1.
    """

    def __init__(self, per_stream: int = OUTBOX_PER_STREAM) -> None:
        if per_stream < 1:
            raise ValueError(f"per_stream must be >= 1, got {per_stream}")
        self.per_stream = per_stream
        self._frames: deque[tuple[ProcessedFrame, object]] = deque()
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()
        self._scheduled = False

    def put(
        self, frame: ProcessedFrame, token: object
    ) -> tuple[bool, tuple[ProcessedFrame, object] | None]:
        """Add ``frame``; whether the loop must be woken (no wake-up is pending), and the
        frame dropped to make room (its stream's oldest without events) with its token, if
        one was."""
        with self._lock:
            self._frames.append((frame, token))
            sid = frame.stream_id
            count = self._counts[sid] = self._counts.get(sid, 0) + 1
            dropped = self._drop_oldest(sid) if count > self.per_stream else None
            wake = not self._scheduled
            self._scheduled = True
        return wake, dropped

    def _drop_oldest(self, stream_id: str) -> tuple[ProcessedFrame, object] | None:
        for i, item in enumerate(self._frames):
            if item[0].stream_id == stream_id and not item[0].events:
                del self._frames[i]
                self._counts[stream_id] -= 1
                return item
        return None  # all of them carry events: kept

    def take(self) -> list[tuple[ProcessedFrame, object]]:
        """Every waiting frame, oldest first; the next :meth:`put` wakes the loop again."""
        with self._lock:
            frames = list(self._frames)
            self._frames.clear()
            self._counts.clear()
            self._scheduled = False
        return frames

    def clear(self) -> None:
        """Forget every waiting frame (the loop is gone, or the streams stopped)."""
        self.take()

    def __len__(self) -> int:
        with self._lock:
            return len(self._frames)
