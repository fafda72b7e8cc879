"""``WS /ws/streams/{id}``: one JSON message per processed frame of a stream (DESIGN §4).

Close codes: ``4404`` unknown stream id, ``1000`` the stream was removed, ``1001`` the
server is shutting down. Each viewer reads from its own bounded queue (setting
``STREAMDET_WS_QUEUE_SIZE``): a slow viewer loses old messages, never slows the stream.

Query parameters are kept on the subscriber (``Subscriber.options``) so a richer viewer
(e.g. a JPEG of ``ProcessedFrame.image`` beside the JSON) can be added in ``_send`` alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import APIRouter, FastAPI, WebSocket
from starlette.websockets import WebSocketDisconnect

from server.routes.viewer import WS_BAD_OPTION, JpegFrames
from server.state import get_state
from streams.fanout import WS_GOING_AWAY, Closed, ProcessedFrame, Subscriber

log = logging.getLogger(__name__)
router = APIRouter()

WS_UNKNOWN_STREAM = 4404
MAX_OPTIONS = 16


@router.websocket("/ws/streams/{stream_id}")
async def watch_stream(websocket: WebSocket, stream_id: str) -> None:
    await websocket.accept()
    state = get_state(websocket)
    manager = state.streams
    if manager is None or state.shutting_down:
        await websocket.close(WS_GOING_AWAY, "server shutting down")
        return
    options = dict(list(websocket.query_params.items())[:MAX_OPTIONS])
    try:  # ?frames=jpeg: the viewer page also wants each frame's picture (server/routes/viewer.py)
        jpeg = JpegFrames.from_options(options)
    except ValueError as exc:
        await websocket.close(WS_BAD_OPTION, str(exc)[:120])
        return
    sub = manager.subscribe(stream_id, options)
    if sub is None:
        await websocket.close(
            WS_UNKNOWN_STREAM, f"unknown stream id {stream_id[:64]!r}; see GET /streams"
        )
        return
    log.info("stream %s: viewer connected (%s)", stream_id, websocket.client)
    sender = asyncio.create_task(_send(websocket, sub, jpeg))
    receiver = asyncio.create_task(_receive_until_gone(websocket))
    try:
        await asyncio.wait({sender, receiver}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        manager.unsubscribe(sub)
        for task in (sender, receiver):
            task.cancel()
        for task in (sender, receiver):
            with contextlib.suppress(asyncio.CancelledError, WebSocketDisconnect, RuntimeError):
                await task
        log.info(
            "stream %s: viewer gone, %d message(s) and %d event(s) dropped for it",
            stream_id,
            sub.dropped,
            sub.dropped_events,
        )


async def _send(websocket: WebSocket, sub: Subscriber, jpeg: JpegFrames | None = None) -> None:
    """Forward frames until the subscription closes, then close with its code."""
    while True:
        item = await sub.get()
        if isinstance(item, Closed):
            await websocket.close(item.code, item.reason)
            return
        if jpeg is None:
            await _send_frame(websocket, item, sub)
        elif jpeg.due(item, newer_waiting=sub.qsize() > 0):
            await jpeg.send(websocket, item)
        else:
            sub.carry(item)


async def _send_frame(websocket: WebSocket, frame: ProcessedFrame, sub: Subscriber) -> None:
    # The one place to add per-viewer extras from ``sub.options`` (frame.image is here).
    await websocket.send_text(frame.json_text())


async def _receive_until_gone(websocket: WebSocket) -> None:
    """Read (and ignore) client messages; returns when the client disconnects."""
    while True:
        message = await websocket.receive()
        if message["type"] == "websocket.disconnect":
            return


def going_away(app: FastAPI) -> None:
    """Close every viewer with 1001 at once, and end waits on jobs; safe from a signal
    handler or any thread.

    The CLI calls it when shutdown begins, before uvicorn closes open WebSockets itself
    (which it does with 1012); the lifespan's shutdown closes any left the same way.
    """
    state = getattr(app.state, "streamdet", None)
    if state is not None and state.streams is not None:
        state.streams.going_away()
    if state is not None and state.jobs is not None:
        state.jobs.going_away()  # long-polls and followers of jobs answer now


async def viewers_gone(app: FastAPI, timeout_s: float) -> None:
    """Wait (at most ``timeout_s``) until every viewer told :func:`going_away` has been sent
    its 1001, so the HTTP server's own shutdown (1012 to any socket left) finds none."""
    state = getattr(app.state, "streamdet", None)
    if state is not None and state.streams is not None:
        await state.streams.wait_viewers_gone(timeout_s)
