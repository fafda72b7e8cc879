"""``WS /ws/streams/{id}``: one JSON message per processed frame of a stream (DESIGN §4),
and, with ``?states=true``, the stream's ``stream_state`` events (a camera lost, back live,
failed) between them.

Close codes: ``4404`` unknown stream id, ``1000`` the stream was removed, ``1001`` the
server is shutting down. Each viewer reads from its own bounded queue (setting
``STREAMDET_WS_QUEUE_SIZE``): a slow viewer loses old messages, never slows the stream; its
connection holds little not yet sent (``server.transport.hold_little_unsent``), so the queue,
not the socket's buffers, is where a stalled viewer's backlog waits. A
viewer that stops reading altogether (its socket's buffers full, every send waiting) is
dropped, its connection aborted, once a send has waited ``STREAMDET_WS_SEND_TIMEOUT_S``, and
at once when its stream is removed or the server shuts down: a send without a limit waited
for ever, and held the stream's removal and the server's shutdown with it.

Query parameters are kept on the subscriber (``Subscriber.options``) so a richer viewer
(e.g. a JPEG of ``ProcessedFrame.image`` beside the JSON) can be added in ``_send`` alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import APIRouter, FastAPI, WebSocket
from starlette.websockets import WebSocketDisconnect

from server.routes.query import query_problem
from server.routes.viewer import FRAMES_OPTION, WS_BAD_OPTION, JpegFrames, Pace
from server.settings import Settings
from server.state import get_state
from server.transport import CLOSE_GRACE_S, abort_later, hold_little_unsent
from streams.fanout import (
    STATES_OPTION,
    WS_GOING_AWAY,
    Closed,
    ProcessedFrame,
    StateMessage,
    Subscriber,
    close_reason,
    wants_states,
)

log = logging.getLogger(__name__)
router = APIRouter()

WS_UNKNOWN_STREAM = 4404
WS_OPTIONS = (FRAMES_OPTION, "max_fps", "max_width", "quality", STATES_OPTION)
"""The query options a viewer may give (:class:`JpegFrames`, :class:`Pace`, states)."""
MAX_OPTIONS = 16
SEND_TIMEOUT_S: float = Settings.model_fields["ws_send_timeout_s"].default


@router.websocket("/ws/streams/{stream_id}")
async def watch_stream(websocket: WebSocket, stream_id: str) -> None:
    await websocket.accept()
    state = get_state(websocket)
    manager = state.streams
    if manager is None or state.shutting_down:
        await websocket.close(WS_GOING_AWAY, "server shutting down")
        return
    given = websocket.query_params.multi_items()
    options = dict(given)
    try:  # ?frames=jpeg: the viewer page also wants each frame's picture (server/routes/viewer.py)
        if len(given) > MAX_OPTIONS:  # those past it were ignored, a bad states= too
            raise ValueError(f"{len(given)} query options: at most {MAX_OPTIONS}")
        # A misspelt max_fps sent every frame; of max_fps=1&max_fps=2 one was kept, unsaid.
        if (problem := query_problem(given, WS_OPTIONS)) is not None:
            raise ValueError(problem)
        jpeg = JpegFrames.from_options(options)
        pace = jpeg or Pace.of_json(options)
        wants_states(options)
    except ValueError as exc:
        await websocket.close(WS_BAD_OPTION, close_reason(str(exc)))
        return
    sub = manager.subscribe(stream_id, options)
    if sub is None:
        why = f"unknown stream id {stream_id[:64]!r}; see GET /streams"
        await websocket.close(WS_UNKNOWN_STREAM, close_reason(why))
        return
    log.info("stream %s: viewer connected (%s)", stream_id, websocket.client)
    timeout_s = state.settings.ws_send_timeout_s
    hold_little_unsent(websocket._send)  # a stalled viewer's backlog: its queue, not the socket
    sender = asyncio.create_task(_send(websocket, sub, jpeg, timeout_s, pace))
    receiver = asyncio.create_task(_receive_until_gone(websocket))
    closed = asyncio.create_task(sub.wait_closed())
    stuck = None
    try:
        done, _ = await asyncio.wait(
            {sender, receiver, closed}, return_when=asyncio.FIRST_COMPLETED
        )
        if done == {closed}:
            # Removed or going away: the sender sends the close unless a send holds it up.
            await asyncio.wait(
                {sender, receiver},
                timeout=min(timeout_s, CLOSE_GRACE_S),
                return_when=asyncio.FIRST_COMPLETED,
            )
            if not sender.done() and not receiver.done():
                why = sub.closed.reason if sub.closed is not None else "closed"
                stuck = f"not reading when its stream closed ({why})"
        timed_out = sender.done() and not sender.cancelled() and sender.exception()
        if isinstance(timed_out, TimeoutError):
            stuck = f"a send to it waited over {timeout_s:g} s"
    finally:
        manager.unsubscribe(sub)
        for task in (sender, receiver, closed):
            task.cancel()
        for task in (sender, receiver, closed):
            with contextlib.suppress(
                asyncio.CancelledError, WebSocketDisconnect, RuntimeError, TimeoutError, OSError
            ):
                await task
        if stuck is not None:
            log.warning(
                "stream %s: viewer %s dropped, %s (setting STREAMDET_WS_SEND_TIMEOUT_S)",
                stream_id,
                websocket.client,
                stuck,
            )
        # A stalled viewer's socket would keep its unsent bytes (and the connection, which
        # the server's shutdown waits for) until its peer reads them: abort it. On shutdown
        # within CLOSE_GRACE_S: a close that fitted behind a stalled viewer's unsent bytes
        # held the exit up for the whole send timeout.
        exiting = getattr(websocket.app.state, "exiting", False) or state.shutting_down
        grace = min(timeout_s, CLOSE_GRACE_S) if exiting else timeout_s
        abort_later(websocket._send, 0.0 if stuck is not None else grace)
        log.info(
            "stream %s: viewer gone, %d message(s) and %d event(s) dropped for it",
            stream_id,
            sub.dropped,
            sub.dropped_events,
        )


async def _send(
    websocket: WebSocket,
    sub: Subscriber,
    jpeg: JpegFrames | None = None,
    timeout_s: float = SEND_TIMEOUT_S,
    pace: Pace | None = None,
) -> None:
    """Forward frames until the subscription closes, then close with its code; with
    ``jpeg``, each with its picture; at ``pace`` (``jpeg``'s where that is given), a frame not
    sent carrying its events to the next.

    Raises:
        TimeoutError: one message (or the close) took over ``timeout_s`` to go out.
    """
    pace = pace or jpeg
    while True:
        item = await sub.get()
        async with asyncio.timeout(timeout_s):
            ends = isinstance(item, Closed) or (isinstance(item, StateMessage) and not sub.behind)
            if ends and (last := sub.flush()) is not None:
                if jpeg is None:  # its events before the change: no later frame may come
                    await _send_frame(websocket, last, sub)
                else:
                    await jpeg.send(websocket, last)
            if isinstance(item, Closed):
                await websocket.close(item.code, item.reason)
                return
            if isinstance(item, StateMessage):
                await websocket.send_text(item.json_text())
            elif pace is not None and not pace.due(item, newer_waiting=sub.frames_waiting()):
                sub.carry(item)
            elif jpeg is None:
                await _send_frame(websocket, item, sub)
            else:
                await jpeg.send(websocket, item)


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
