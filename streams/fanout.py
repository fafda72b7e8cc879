"""Processed frames and their fan-out to subscribers (WebSocket viewers).

Everything here runs on the event loop. Each subscriber owns a small bounded queue; when it
is full the oldest message is dropped, so a slow viewer loses old frames and never slows
the stream or the other viewers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engines.types import Detections, Image
from streams.events import StreamEvent
from streams.track import STATIONARY_S

WS_NORMAL = 1000
WS_GOING_AWAY = 1001
CLOSE_REASON_BYTES = 123  # RFC 6455: a close frame's payload is at most 125 bytes, 2 the code


def close_reason(text: str) -> str:
    """``text`` cut to what a WebSocket close frame holds, in UTF-8 bytes and whole characters
    (an id of 64 "é" in a reason cut by characters made the close frame too long: no close
    code reached the viewer, and a traceback was logged)."""
    return text.encode()[:CLOSE_REASON_BYTES].decode(errors="ignore")


STATES_OPTION = "states"
MAX_CARRIED = 1024
"""Events kept for a viewer that is not reading; the oldest go beyond this (a viewer that far
behind is stalled; the counts in ``GET /streams/{id}`` and ``GET /events`` stay whole)."""


def detections_json(
    detections: Detections,
    zones: Sequence[list[str]] | None,
    dwell: Sequence[dict[str, float]] | None,
    still: Sequence[float] | None = None,
    stationary_s: float = STATIONARY_S,
) -> list[dict[str, Any]]:
    """Detections as the API sends them, each with the ``zones`` it stands in and its
    ``dwell_s`` in each, and (tracked) ``still_s``, how long its object has stood still, and
    ``stationary`` from ``stationary_s`` on, where a stream's (or a job's) analytics gave
    them."""
    out = detections.to_json()
    if still is not None:
        for item, still_s in zip(out, still, strict=True):
            item["still_s"] = round(still_s, 2)
            item["stationary"] = still_s >= stationary_s
    if zones is not None:
        for item, names in zip(out, zones, strict=True):
            item["zones"] = names
    if dwell is not None:
        for item, seconds in zip(out, dwell, strict=True):
            item["dwell_s"] = seconds
    return out


def host_array(image: Image | Any) -> Image:
    """A frame as a host array; a torch tensor (NVDEC decodes into GPU memory) is copied down,
    which waits for the GPU: call it off the event loop."""
    if isinstance(image, np.ndarray):
        return image
    host: Image = np.ascontiguousarray(image.cpu().numpy())
    return host


@dataclass(slots=True)
class ProcessedFrame:
    """One frame of a stream with its detections, as published.

    The decoded ``image`` stays reachable here so a viewer can render or encode the very
    frame the detections belong to (e.g. a JPEG beside the JSON).

    Attributes:
        stream_id: the stream.
        frame: decoded-frame index since the stream was added.
        pts: presentation time in seconds from the source, if it has one.
        captured_at: wall-clock time (epoch seconds) when the frame was decoded.
        decoded_mono: ``time.monotonic()`` at decode, for latency.
        image: the RGB frame that was run (a torch tensor on the GPU when NVDEC decoded it).
        detections: its detections.
        batch_size: size of the engine batch it ran in.
        events: tracked objects that crossed a counting line, entered or exited a zone in this
            frame (and, on the way to one viewer, in earlier frames that viewer did not get).
        zones: per detection, the names of the zones it stands in (streams with zones).
        dwell: per detection, seconds its object has been in each of its zones (tracked
            streams with zones).
        still: per detection, seconds its object has stood still (tracked streams).
        stationary_s: from how many seconds still an object is stationary.
        latency_ms: decode to publication, set when published.
    """

    stream_id: str
    frame: int
    pts: float | None
    captured_at: float
    decoded_mono: float
    image: Image
    detections: Detections
    batch_size: int
    events: tuple[StreamEvent, ...] = ()
    zones: list[list[str]] | None = None
    dwell: list[dict[str, float]] | None = None
    still: list[float] | None = None
    stationary_s: float = STATIONARY_S
    latency_ms: float = 0.0
    _json: str | None = field(default=None, repr=False)

    def to_message(self) -> dict[str, Any]:
        """The WebSocket message (DESIGN §4); a frame in which objects crossed a counting line
        or entered or exited a zone also carries these ``events``, and on a stream with zones
        each detection lists the ``zones`` it stands in (and, tracked, its ``dwell_s`` in
        each)."""
        detections = detections_json(
            self.detections, self.zones, self.dwell, self.still, self.stationary_s
        )
        message = {
            "stream_id": self.stream_id,
            "frame": self.frame,
            "pts": None if self.pts is None else round(self.pts, 4),
            "captured_at": round(self.captured_at, 6),
            "width": self.detections.width,
            "height": self.detections.height,
            "detections": detections,
            "latency_ms": round(self.latency_ms, 2),
        }
        if self.events:
            message["events"] = [e.to_json(self.detections.name_of) for e in self.events]
        return message

    def with_events(self, earlier: Sequence[StreamEvent]) -> ProcessedFrame:
        """This frame carrying ``earlier`` events (of frames a viewer did not get) too."""
        return dataclasses.replace(self, events=(*earlier, *self.events), _json=None)

    def host_image(self) -> Image:
        """``image`` as a host array: a GPU frame (NVDEC) is copied down, e.g. for a JPEG."""
        return host_array(self.image)

    def json_text(self) -> str:
        """The message as JSON text, built once and shared by every subscriber."""
        if self._json is None:
            self._json = json.dumps(self.to_message(), separators=(",", ":"))
        return self._json


def wants_states(options: Mapping[str, str]) -> bool:
    """Whether a viewer asked for its stream's state changes too (``?states=true``; one that
    knows only frames asked for none).

    Raises:
        ValueError: ``states`` is neither true nor false (nor 1 or 0); the message says so.
    """
    value = options.get(STATES_OPTION, "false")
    if value not in ("true", "false", "1", "0"):
        raise ValueError(f"{STATES_OPTION}={value[:20]!r}: expected true or false")
    return value in ("true", "1")


@dataclass(frozen=True, slots=True)
class StateMessage:
    """A stream's state change (its ``stream_state`` event as logged, ``type`` and all), sent
    between its frames to the viewers that asked (``?states=true``): a camera that drops
    stops the frames, and this says why. A frame's message has no ``type``."""

    text: str

    def json_text(self) -> str:
        return self.text


@dataclass(frozen=True, slots=True)
class Closed:
    """End of a subscription: the WebSocket close code and reason to send."""

    code: int
    reason: str


class Subscriber:
    """One viewer of one stream: a bounded queue that drops its oldest message when full.

    Args:
        stream_id: the stream watched.
        maxsize: messages kept for a viewer that reads slower than the stream.
        options: the viewer's query options (a seam for viewers that want more than JSON).
    """

    def __init__(self, stream_id: str, maxsize: int, options: dict[str, str] | None = None) -> None:
        if maxsize < 1:
            raise ValueError("maxsize must be >= 1 (setting STREAMDET_WS_QUEUE_SIZE)")
        self.stream_id = stream_id
        self.options = options or {}
        self.wants_states = wants_states(self.options)
        self.dropped = 0
        self.closed: Closed | None = None
        self._queue: asyncio.Queue[ProcessedFrame | StateMessage | Closed] = asyncio.Queue(maxsize)
        # State changes pushed out of a full queue: sent before what is still in it (all
        # newer), never dropped (one a change: few).
        self._states: list[StateMessage] = []
        # Events of frames this viewer will not get, handed on with the next one: a viewer
        # may miss pictures, never an event.
        self._carried: list[StreamEvent] = []
        self._carried_frame: ProcessedFrame | None = None  # the newest of those skipped
        self.behind = False
        """The last change :meth:`get` gave was pushed out of a full queue: frames dropped
        after it may be newer than it."""
        self.dropped_events = 0
        # Set with ``closed``: the viewer's handler waits on it beside its send, which a
        # viewer that stopped reading holds up (the Closed in the queue would never be read).
        self._ended = asyncio.Event()

    def offer(self, frame: ProcessedFrame | StateMessage) -> None:
        """Queue ``frame`` (or a state change), dropping the oldest waiting frame if the
        queue is full."""
        if self.closed is not None:
            return
        self._put(frame)

    def close(self, code: int, reason: str) -> None:
        """End the subscription; the reader gets :class:`Closed` after nothing else."""
        if self.closed is not None:
            return
        self.closed = Closed(code, close_reason(reason))
        while not self._queue.empty():  # a closing viewer needs no backlog, but its events
            old = self._queue.get_nowait()
            if isinstance(old, ProcessedFrame):
                self.carry(old)
        self._states.clear()
        self._queue.put_nowait(self.closed)
        self._ended.set()

    async def wait_closed(self) -> None:
        """Wait until the subscription is closed (stream removed, server going away)."""
        await self._ended.wait()

    def _put(self, item: ProcessedFrame | StateMessage | Closed) -> None:
        if self._queue.full():
            old = self._queue.get_nowait()
            if isinstance(old, StateMessage):
                self._states.append(old)
            else:
                if isinstance(old, ProcessedFrame):
                    self.carry(old)
                self.dropped += 1
        self._queue.put_nowait(item)

    def carry(self, skipped: ProcessedFrame) -> None:
        """``skipped`` will not be sent: its events go with the next frame."""
        self._carried_frame = skipped
        self._carried += skipped.events
        if len(self._carried) > MAX_CARRIED:
            self.dropped_events += len(self._carried) - MAX_CARRIED
            del self._carried[:-MAX_CARRIED]

    async def get(self) -> ProcessedFrame | StateMessage | Closed:
        """The next frame (with the events of frames skipped before it) or state change, or
        :class:`Closed` once the subscription ended."""
        if self._states and self.closed is None:
            self.behind = True
            return self._states.pop(0)
        item = await self._queue.get()
        self.behind = False
        if isinstance(item, ProcessedFrame):
            self._carried_frame = None
            if self._carried:
                item, self._carried = item.with_events(self._carried), []
        return item

    def flush(self) -> ProcessedFrame | None:
        """The newest frame not sent, carrying every event still carried (its own among
        them), where any is: to be sent before a state change or the close, after which no
        frame may come to carry them (a paced viewer lost the last events before a stream
        stopped, was switched off or removed)."""
        frame = self._carried_frame
        if frame is None or not self._carried:
            return None
        flushed = dataclasses.replace(frame, events=tuple(self._carried), _json=None)
        self._carried, self._carried_frame = [], None
        return flushed

    def qsize(self) -> int:
        return self._queue.qsize()

    def frames_waiting(self) -> bool:
        """Whether a frame waits behind the one being sent (a state change is no newer
        picture: taken for one, a viewer's last frame before a loss was skipped, and its
        events waited for a frame that might never come)."""
        return any(isinstance(item, ProcessedFrame) for item in self._queue._queue)  # type: ignore[attr-defined]
