"""``GET /``: the viewer page, the static files it loads from ``/static``, the API's ``/docs``
and ``/redoc`` pages with their files from ``/static/docs``, the JPEG frames it
asks for beside the JSON on ``WS /ws/streams/{id}?frames=jpeg`` (:class:`JpegFrames`), and
``GET /streams/{id}/latest.jpg``: a stream's last processed frame with its boxes drawn (for
dashboards, thumbnails and home-automation camera cards that poll a picture).

The page is plain HTML, CSS and an ES module in ``server/static`` (shipped as package data), so
it needs no build step and no internet: everything it loads comes from this server. So do
``/docs`` (Swagger UI) and ``/redoc``: their scripts, stylesheet and icon are the copies the
``fastapi-offline`` package ships (FastAPI's own pages load them from a CDN and a font host,
which a browser on an offline network or behind a strict proxy cannot reach: a blank page).
"""

from __future__ import annotations

import asyncio
import html
import json
import logging
from asyncio import FIRST_COMPLETED
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import fastapi_offline
from fastapi import APIRouter, Depends, HTTPException, Query, Request, WebSocket
from fastapi.openapi.docs import (
    get_redoc_html,
    get_swagger_ui_html,
    get_swagger_ui_oauth2_redirect_html,
)
from fastapi.responses import HTMLResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.types import Message, Send

from server.render import line_label, render_jpeg, zone_label
from server.routes.paths import root_of
from server.routes.query import check_query_and_body_type
from server.routes.streams import get_manager
from server.state import get_state
from server.transport import CLOSE_GRACE_S, abort_later, hold_little_unsent
from streams.detect import StreamDetect
from streams.fanout import Closed, ProcessedFrame, StateMessage
from streams.manager import StreamManager

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"
"""Where the viewer's files live inside the installed package."""

STATIC_PATH = "/static"

DOCS_DIR = Path(fastapi_offline.__file__).resolve().parent / "static"
"""Swagger UI's and ReDoc's files (``swagger-ui-bundle.js``, ``swagger-ui.css``,
``redoc.standalone.js``, ``favicon.png``) as the ``fastapi-offline`` package ships them."""

DOCS_STATIC_PATH = STATIC_PATH + "/docs"
"""Where the app mounts :data:`DOCS_DIR`: under ``/static``, open without a key as the
viewer's files are (the pages are open; their files answered 401 elsewhere)."""

OPENAPI_PATH = "/openapi.json"
DOCS_OAUTH2_REDIRECT = "/docs/oauth2-redirect"

log = logging.getLogger(__name__)
router = APIRouter()

# The page and its script change together on upgrade; revalidating costs one 304 per load.
_NO_CACHE = {"Cache-Control": "no-cache"}


PAGE_BASE = '<base href="./">'
"""The page's base as its file has it; served as ``<base href="{root path}/">``."""


@router.get("/", include_in_schema=False)
async def index(request: Request) -> HTMLResponse:
    """Serve the viewer page, its base the app's root (the proxy's prefix and a ``/``): its
    relative URLs (``static/viewer.js``, and the script's calls) resolve under the prefix
    whether the browser opened ``/streamdet/`` or ``/streamdet``, which a proxy that strips
    the prefix without redirecting (Traefik's StripPrefix) serves as the app's ``/`` too
    (there they resolved at the host's root: ``/static/viewer.js``, 404)."""
    page = await asyncio.to_thread((STATIC_DIR / "index.html").read_text, "utf-8")
    base = f'<base href="{html.escape(root_of(request.scope), quote=True)}/">'
    return HTMLResponse(page.replace(PAGE_BASE, base, 1), headers=_NO_CACHE)


def static_files() -> StaticFiles:
    """The app mounts this at :data:`STATIC_PATH` for the page's script and stylesheet.

    Raises:
        RuntimeError: the package was installed without its static files.
    """
    if not (STATIC_DIR / "index.html").is_file():
        raise RuntimeError(
            f"viewer files missing from {STATIC_DIR}; reinstall streamdet with its package data"
            " (pip install -e . from the repository)"
        )
    return StaticFiles(directory=STATIC_DIR)


def docs_files() -> StaticFiles:
    """The app mounts this at :data:`DOCS_STATIC_PATH` for ``/docs`` and ``/redoc``.

    Raises:
        RuntimeError: the ``fastapi-offline`` package lacks the files.
    """
    missing = [
        name
        for name in ("swagger-ui-bundle.js", "swagger-ui.css", "redoc.standalone.js")
        if not (DOCS_DIR / name).is_file()
    ]
    if missing:
        raise RuntimeError(
            f"API docs files {missing} missing from {DOCS_DIR}; reinstall streamdet's"
            " dependencies (pip install -e . from the repository, which pulls fastapi-offline)"
        )
    return StaticFiles(directory=DOCS_DIR)


@router.get("/docs", include_in_schema=False)
async def swagger_ui(request: Request) -> HTMLResponse:
    """Swagger UI for the API, its files from this server; "Try it out" calls the
    document's ``servers`` URL (the prefix behind a proxy)."""
    root = root_of(request.scope)
    return get_swagger_ui_html(
        openapi_url=root + OPENAPI_PATH,
        title=f"{request.app.title} - Swagger UI",
        swagger_js_url=f"{root}{DOCS_STATIC_PATH}/swagger-ui-bundle.js",
        swagger_css_url=f"{root}{DOCS_STATIC_PATH}/swagger-ui.css",
        swagger_favicon_url=f"{root}{DOCS_STATIC_PATH}/favicon.png",
        oauth2_redirect_url=root + DOCS_OAUTH2_REDIRECT,
    )


@router.get(DOCS_OAUTH2_REDIRECT, include_in_schema=False)
async def swagger_ui_redirect() -> HTMLResponse:
    """Swagger UI's OAuth2 redirect page."""
    return get_swagger_ui_oauth2_redirect_html()


@router.get("/redoc", include_in_schema=False)
async def redoc(request: Request) -> HTMLResponse:
    """ReDoc for the API, its script from this server and no web fonts."""
    root = root_of(request.scope)
    return get_redoc_html(
        openapi_url=root + OPENAPI_PATH,
        title=f"{request.app.title} - ReDoc",
        redoc_js_url=f"{root}{DOCS_STATIC_PATH}/redoc.standalone.js",
        redoc_favicon_url=f"{root}{DOCS_STATIC_PATH}/favicon.png",
        with_google_fonts=False,
    )


# ---- JPEG frames beside the JSON on ``WS /ws/streams/{id}`` ---------------------------------

FRAMES_OPTION = "frames"
WS_BAD_OPTION = 4400
"""Close code for a WebSocket whose query options are invalid (the reason names the option)."""


@dataclass(slots=True)
class Pace:
    """At most ``max_fps`` frames a second to one viewer, and never a frame while a newer one
    is already waiting for it: a slow viewer gets fewer frames, not older ones.

    Attributes:
        max_fps: most frames per second sent (query ``max_fps``, 0.1..60).
        skipped: frames not sent (over the rate, or a newer one was waiting).
    """

    max_fps: float = 5.0
    skipped: int = 0
    _next_due: float = field(default=0.0, repr=False)

    @staticmethod
    def of_json(options: Mapping[str, str]) -> Pace | None:
        """A JSON-only viewer's pace: ``max_fps`` where it gave one (a dashboard over a slow
        link), otherwise None: every frame. (It was ignored, a bad value too.)

        Raises:
            ValueError: an option is malformed; the message names it and its range.
        """
        JpegFrames.from_options({**options, FRAMES_OPTION: "jpeg"})  # every option checked
        if "max_fps" not in options:
            return None
        return Pace(max_fps=_number(options, "max_fps", 5.0, 0.1, 60.0))

    def due(self, frame: ProcessedFrame, newer_waiting: bool) -> bool:
        """Whether to send ``frame``; counts it as skipped otherwise."""
        if newer_waiting or frame.decoded_mono < self._next_due:
            self.skipped += 1
            return False
        period = 1.0 / self.max_fps
        # Keep the average rate at max_fps against the source's frame spacing, but after a
        # gap (stall, reconnect) start afresh rather than bursting to catch up.
        self._next_due += period
        if self._next_due < frame.decoded_mono:
            self._next_due = frame.decoded_mono + period
        return True


@dataclass(slots=True)
class JpegFrames(Pace):
    """What a viewer asked for with ``?frames=jpeg``: each frame it is sent is a JSON text
    message with a ``"jpeg"`` member, immediately followed by one binary message holding that
    very frame as a JPEG, so the boxes are always drawn on the picture they were computed on;
    paced as :class:`Pace` (``max_fps`` 5 unless given).

    Attributes:
        max_width: frames wider than this are scaled down (query ``max_width``, 32..3840,
            default 640).
        quality: JPEG quality (query ``quality``, 10..95, default 70).
        sent: frames sent so far.
    """

    max_width: int = 640
    quality: int = 70
    sent: int = 0

    @classmethod
    def from_options(cls, options: Mapping[str, str]) -> JpegFrames | None:
        """The viewer's request, or ``None`` when it asked for JSON only.

        Raises:
            ValueError: an option is malformed; the message names it and its range.
        """
        kind = options.get(FRAMES_OPTION, "none")
        if kind == "none":
            return None
        if kind != "jpeg":
            raise ValueError(f"frames={kind[:20]!r}: expected 'jpeg' or 'none'")
        return cls(
            max_fps=_number(options, "max_fps", 5.0, 0.1, 60.0),
            max_width=int(_number(options, "max_width", 640, 32, 3840)),
            quality=int(_number(options, "quality", 70, 10, 95)),
        )

    async def send(self, websocket: WebSocket, frame: ProcessedFrame) -> None:
        """Send ``frame``'s JSON (with a ``"jpeg"`` member) and then its JPEG."""
        jpeg, width, height = await asyncio.to_thread(
            render_jpeg, frame.image, self.max_width, self.quality
        )
        message = frame.to_message()
        message["jpeg"] = {"width": width, "height": height, "bytes": len(jpeg)}
        # Only this task sends on this socket, so the two messages stay adjacent.
        await websocket.send_text(json.dumps(message, separators=(",", ":")))
        await websocket.send_bytes(jpeg)
        self.sent += 1


def _number(
    options: Mapping[str, str], name: str, default: float, low: float, high: float
) -> float:
    raw = options.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw[:20]!r}: expected a number in [{low:g}, {high:g}]") from None
    if not low <= value <= high:
        raise ValueError(f"{name}={value:g}: expected a number in [{low:g}, {high:g}]")
    return value


@router.get(
    "/streams/{stream_id}/latest.jpg",
    dependencies=[Depends(check_query_and_body_type)],
    response_class=Response,
    responses={200: {"content": {"image/jpeg": {}}}},
)
async def latest_jpeg(
    stream_id: str,
    request: Request,
    *,
    boxes: Annotated[
        bool,
        Query(
            description="draw the detections, the stream's region of interest, and its zones"
            " and counting lines with their counts"
        ),
    ] = True,
    max_width: Annotated[int, Query(ge=32, le=3840, description="scale down wider frames")] = 1920,
    quality: Annotated[int, Query(ge=10, le=95, description="JPEG quality")] = 80,
) -> Response:
    """The stream's last processed frame as a JPEG; its number, capture time and detection
    count in ``X-Frame``, ``X-Captured-At`` and ``X-Detections``. ``503`` until the stream has
    processed a frame (with its state), ``404`` for an unknown stream."""
    manager = get_manager(request)
    info = manager.describe(stream_id)
    if info is None:
        raise HTTPException(404, f"no stream {stream_id[:64]!r}; list streams with GET /streams")
    now = info["state"]
    if now in ("disabled", "failed", "stopped"):
        # It shows nothing now, whatever it showed before (a file played to its end answered
        # its last picture): no Retry-After, it comes back only when someone changes it.
        raise HTTPException(503, f"stream {stream_id!r} is {now}: it shows nothing now")
    frame = manager.latest(stream_id)
    if frame is None:
        raise HTTPException(
            503,
            f"stream {stream_id!r} has no processed frame yet (state {now})",
            headers={"Retry-After": "1"},
        )
    render = _renderer(manager, stream_id, info, boxes=boxes)
    jpeg, _, _ = await asyncio.to_thread(render, frame, max_width, quality)
    headers = {
        "Cache-Control": "no-store",
        "X-Frame": str(frame.frame),
        "X-Captured-At": f"{frame.captured_at:.6f}",
        "X-Detections": str(len(frame.detections)),
    }
    return Response(jpeg, media_type="image/jpeg", headers=headers)


def _renderer(
    manager: StreamManager, stream_id: str, info: Mapping[str, Any], *, boxes: bool
) -> Callable[[ProcessedFrame, int, int], tuple[bytes, int, int]]:
    """Draws a frame of ``stream_id`` as ``latest.jpg`` and the MJPEG stream show it: with
    ``boxes``, its detections, region, zones and lines (labelled with the counts in
    ``info``, the stream's description)."""
    detect = manager.detect(stream_id) if boxes else None
    shown = detect or StreamDetect()
    lines = [(line, line_label(line.name, info["crossings"])) for line in shown.lines]
    zones = [(zone, zone_label(zone.name, info["zones"])) for zone in shown.zones]

    def render(frame: ProcessedFrame, max_width: int, quality: int) -> tuple[bytes, int, int]:
        return render_jpeg(
            frame.image,
            max_width,
            quality,
            detections=frame.detections if boxes else None,
            region=shown.roi,
            lines=lines,
            zones=zones,
        )

    return render


MJPEG_BOUNDARY = "frame"


@router.get(
    "/streams/{stream_id}/mjpeg",
    dependencies=[Depends(check_query_and_body_type)],
    response_class=StreamingResponse,
    responses={200: {"content": {f"multipart/x-mixed-replace; boundary={MJPEG_BOUNDARY}": {}}}},
)
async def mjpeg(
    stream_id: str,
    request: Request,
    *,
    boxes: Annotated[
        bool, Query(description="draw the detections, region, zones and lines with counts")
    ] = True,
    max_fps: Annotated[float, Query(ge=0.1, le=60.0, description="most frames a second")] = 5.0,
    max_width: Annotated[int, Query(ge=32, le=3840, description="scale down wider frames")] = 640,
    quality: Annotated[int, Query(ge=10, le=95, description="JPEG quality")] = 70,
) -> StreamingResponse:
    """The stream's processed frames as an MJPEG stream (``multipart/x-mixed-replace``), as
    Frigate and IP cameras serve them: an ``<img src>`` shows it live with no script, and
    Home Assistant's MJPEG camera, VLC or ffmpeg can open it. At most ``max_fps`` frames a
    second; a client that reads slower gets fewer frames, never old ones. Ends when the
    stream is removed or the server shuts down."""
    manager = get_manager(request)
    info = manager.describe(stream_id)
    sub = None if info is None else manager.subscribe(stream_id, {"mjpeg": "1"})
    if info is None or sub is None:
        raise HTTPException(404, f"no stream {stream_id[:64]!r}; list streams with GET /streams")
    pace = JpegFrames(max_fps=max_fps, max_width=max_width, quality=quality)

    async def parts() -> AsyncIterator[bytes]:
        try:
            while True:
                item = await sub.get()
                if isinstance(item, Closed):
                    return
                if isinstance(item, StateMessage):  # a picture stream has no place for it
                    continue
                if not pace.due(item, newer_waiting=sub.frames_waiting()):
                    continue
                # The counts drawn are read again for each frame, on the event loop.
                now = manager.describe(stream_id) or info
                render = _renderer(manager, stream_id, now, boxes=boxes)
                jpeg, _, _ = await asyncio.to_thread(render, item, max_width, quality)
                head = (
                    f"--{MJPEG_BOUNDARY}\r\nContent-Type: image/jpeg\r\n"
                    f"Content-Length: {len(jpeg)}\r\nX-Frame: {item.frame}\r\n\r\n"
                )
                yield head.encode() + jpeg + b"\r\n"
                pace.sent += 1
        finally:
            manager.unsubscribe(sub)
            log.info("stream %s: MJPEG client gone after %d frame(s)", stream_id, pace.sent)

    return TimedStream(
        parts(),
        closed=sub.wait_closed,
        send_timeout_s=get_state(request).settings.ws_send_timeout_s,
        what=f"stream {stream_id}: MJPEG client {request.client}",
        media_type=f"multipart/x-mixed-replace; boundary={MJPEG_BOUNDARY}",
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
    )


class TimedStream(StreamingResponse):
    """A streamed response each of whose parts has ``send_timeout_s`` to go out, and
    :data:`CLOSE_GRACE_S` once ``closed`` returns (its stream removed, the server going
    away): a client that stops reading (its socket's buffers full) is dropped, its connection
    aborted, where the send waited for ever, holding its subscription, the stream's removal
    and the server's shutdown."""

    def __init__(
        self,
        content: AsyncIterator[bytes],
        *,
        closed: Callable[[], Awaitable[None]],
        send_timeout_s: float,
        what: str,
        **kwargs: Any,
    ) -> None:
        super().__init__(content, **kwargs)
        self._closed = closed
        self._timeout_s = send_timeout_s
        self._what = what
        self._why = ""

    async def stream_response(self, send: Send) -> None:
        hold_little_unsent(send)  # a stalled client's backlog: dropped parts, not the socket

        async def timed(message: Message) -> None:
            sending = asyncio.ensure_future(send(message))
            closing = asyncio.ensure_future(self._closed())
            try:
                done, _ = await asyncio.wait(
                    {sending, closing}, timeout=self._timeout_s, return_when=FIRST_COMPLETED
                )
                if sending not in done and closing in done:
                    done, _ = await asyncio.wait({sending}, timeout=CLOSE_GRACE_S)
                    self._why = "not reading when its stream closed"
                if sending not in done:
                    self._why = self._why or f"a part waited over {self._timeout_s:g} s to go out"
                    raise TimeoutError
                sending.result()
            finally:
                closing.cancel()
                sending.cancel()

        try:
            await super().stream_response(timed)
        except TimeoutError:
            log.warning(
                "%s dropped, %s (setting STREAMDET_WS_SEND_TIMEOUT_S)", self._what, self._why
            )
            closing = getattr(self.body_iterator, "aclose", None)
            if closing is not None:
                await closing()  # its subscription ends now
            abort_later(send, 0.0)
