"""``GET /``: the viewer page, the static files it loads from ``/static``, the JPEG frames it
asks for beside the JSON on ``WS /ws/streams/{id}?frames=jpeg`` (:class:`JpegFrames`), and
``GET /streams/{id}/latest.jpg``: a stream's last processed frame with its boxes drawn (for
dashboards, thumbnails and home-automation camera cards that poll a picture).

The page is plain HTML, CSS and an ES module in ``server/static`` (shipped as package data), so
it needs no build step and no internet: everything it loads comes from this server.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import cv2
import numpy as np
from fastapi import APIRouter, HTTPException, Query, Request, WebSocket
from fastapi.responses import FileResponse, Response
from fastapi.staticfiles import StaticFiles

from engines.types import Detections, Image
from server.routes.streams import get_manager
from streams.detect import Roi, StreamDetect
from streams.fanout import ProcessedFrame, host_array
from streams.files import encode_jpeg
from streams.lines import Line
from streams.zones import Zone

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"
"""Where the viewer's files live inside the installed package."""

STATIC_PATH = "/static"

router = APIRouter()

# The page and its script change together on upgrade; revalidating costs one 304 per load.
_NO_CACHE = {"Cache-Control": "no-cache"}


@router.get("/", include_in_schema=False)
async def index() -> FileResponse:
    """Serve the viewer page."""
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html", headers=_NO_CACHE)


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


# ---- JPEG frames beside the JSON on ``WS /ws/streams/{id}`` ---------------------------------

FRAMES_OPTION = "frames"
WS_BAD_OPTION = 4400
"""Close code for a WebSocket whose query options are invalid (the reason names the option)."""


@dataclass(slots=True)
class JpegFrames:
    """What a viewer asked for with ``?frames=jpeg``: each frame it is sent is a JSON text
    message with a ``"jpeg"`` member, immediately followed by one binary message holding that
    very frame as a JPEG, so the boxes are always drawn on the picture they were computed on.

    A viewer gets at most ``max_fps`` frames a second, and never a frame while a newer one
    is already waiting for it: a slow browser gets fewer frames, not older ones.

    Attributes:
        max_fps: most frames per second sent (query ``max_fps``, 0.1..60, default 5).
        max_width: frames wider than this are scaled down (query ``max_width``, 32..3840,
            default 640).
        quality: JPEG quality (query ``quality``, 10..95, default 70).
        sent: frames sent so far.
        skipped: frames not sent (over the rate, or a newer one was waiting).
    """

    max_fps: float = 5.0
    max_width: int = 640
    quality: int = 70
    sent: int = 0
    skipped: int = 0
    _next_due: float = field(default=0.0, repr=False)

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
        raise HTTPException(404, f"no stream {stream_id!r}; list streams with GET /streams")
    frame = manager.latest(stream_id)
    if frame is None:
        raise HTTPException(
            503,
            f"stream {stream_id!r} has no processed frame yet (state {info['state']})",
            headers={"Retry-After": "1"},
        )
    detect = manager.detect(stream_id)
    region = detect.roi if boxes and detect is not None else None
    detections = frame.detections if boxes else None
    shown = detect if boxes and detect is not None else StreamDetect()
    lines = [(line, line_label(line.name, info["crossings"])) for line in shown.lines]
    zones = [(zone, zone_label(zone.name, info["zones"])) for zone in shown.zones]
    render = functools.partial(
        render_jpeg, detections=detections, region=region, lines=lines, zones=zones
    )
    jpeg, _, _ = await asyncio.to_thread(render, frame.image, max_width, quality)
    headers = {
        "Cache-Control": "no-store",
        "X-Frame": str(frame.frame),
        "X-Captured-At": f"{frame.captured_at:.6f}",
        "X-Detections": str(len(frame.detections)),
    }
    return Response(jpeg, media_type="image/jpeg", headers=headers)


REGION_RGB = (255, 0, 255)  # the outline of a stream's region of interest: magenta
LINE_RGB = (0, 255, 255)  # counting lines: cyan, as on the viewer page
ZONE_RGB = (255, 212, 0)  # zones: yellow, as on the viewer page


def line_label(name: str, crossings: Mapping[str, Mapping[str, Mapping[str, int]]]) -> str:
    """``gate: 3 in, 1 out``: a line's crossings each way, summed over classes (ASCII: OpenCV's
    Hershey fonts have nothing else)."""
    ways = crossings.get(name, {})
    n_in, n_out = (sum(ways.get(way, {}).values()) for way in ("in", "out"))
    return f"{name}: {n_in} in, {n_out} out"


def zone_label(name: str, zones: Mapping[str, Mapping[str, Mapping[str, int]]]) -> str:
    """``dock: 2``: how many objects stand in a zone, summed over classes."""
    return f"{name}: {sum(zones.get(name, {}).get('now', {}).values())}"


def _color(class_id: int) -> tuple[int, int, int]:
    """A fixed, distinct RGB colour per class."""
    hue = (class_id * 47) % 180
    hsv = np.array([[[hue, 200, 255]]], np.uint8)
    r, g, b = (int(v) for v in cv2.cvtColor(hsv, cv2.COLOR_HSV2RGB)[0, 0])
    return r, g, b


def _label(
    rgb: Image,
    text: str,
    at: tuple[int, int],
    colors: tuple[tuple[int, int, int], tuple[int, int, int]],
    *,
    above: bool = False,
) -> None:
    """``text`` on a filled box (``colors``: box, text) with its top left corner at ``at``
    (its bottom left, ``above``), kept inside the image."""
    height, width = rgb.shape[:2]
    (tw, th), base = cv2.getTextSize(text, cv2.FONT_HERSHEY_SIMPLEX, 0.5, 1)
    left, top = at
    if above:
        top -= th + base + 2
    left = min(max(left, 0), max(width - tw - 4, 0))
    top = min(max(top, 0), max(height - th - base - 2, 0))
    cv2.rectangle(rgb, (left, top), (left + tw + 4, top + th + base + 2), colors[0], -1)
    cv2.putText(rgb, text, (left + 2, top + th + 1), cv2.FONT_HERSHEY_SIMPLEX, 0.5, colors[1], 1)


def draw_detections(rgb: Image, detections: Detections, scale: float) -> None:
    """Draw each box with its class name, track id (if tracked) and confidence onto ``rgb``
    (in place), boxes given in source pixels and scaled by ``scale`` to the image."""
    tracks = detections.track_ids
    for i, (box, score, cid) in enumerate(
        zip(detections.boxes, detections.scores, detections.class_ids, strict=True)
    ):
        x1, y1, x2, y2 = (round(float(v) * scale) for v in box)
        color = _color(int(cid))
        cv2.rectangle(rgb, (x1, y1), (x2, y2), color, 2)
        track = "" if tracks is None else f" #{int(tracks[i])}"
        label = f"{detections.name_of(cid)}{track} {float(score):.2f}"
        _label(rgb, label, (x1, y1), (color, (0, 0, 0)), above=True)


def draw_line(rgb: Image, line: Line, label: str) -> None:
    """Draw a counting line, its label under its first point, onto ``rgb`` (in place)."""
    height, width = rgb.shape[:2]
    (ax, ay), (bx, by) = (
        (round(x * (width - 1)), round(y * (height - 1))) for x, y in (line.a, line.b)
    )
    cv2.line(rgb, (ax, ay), (bx, by), LINE_RGB, 2)
    _label(rgb, label, (ax, ay + 3), ((0, 0, 0), LINE_RGB))


def render_jpeg(
    image: Image | Any,
    max_width: int,
    quality: int,
    *,
    detections: Detections | None = None,
    region: Roi | None = None,
    lines: Sequence[tuple[Line, str]] = (),
    zones: Sequence[tuple[Zone, str]] = (),
) -> tuple[bytes, int, int]:
    """``image`` (RGB) scaled down to at most ``max_width`` wide, as JPEG bytes, with
    ``region``'s outline, ``zones`` and counting ``lines`` (each with its label) and
    ``detections`` drawn on it when given.

    Runs in a worker thread (OpenCV releases the GIL; a GPU frame is copied down here, not
    on the event loop). Returns the bytes and the JPEG's width and height.
    """
    image = source = host_array(image)
    height, width = image.shape[:2]
    if width > max_width:
        height = max(1, round(height * max_width / width))
        width = max_width
        # INTER_AREA only where it matters (shrinking to under half): for 768x432 -> 640x360
        # it took 3.6 ms a frame against 0.7 ms for INTER_LINEAR, here on one CPU core.
        interpolation = cv2.INTER_AREA if width * 2 < image.shape[1] else cv2.INTER_LINEAR
        image = np.ascontiguousarray(
            cv2.resize(image, (width, height), interpolation=interpolation), dtype=np.uint8
        )
    if image is source and (region is not None or detections is not None or lines or zones):
        image = image.copy()  # drawn on: never the frame that other viewers share
    if region is not None:
        corners = np.array([[x * (width - 1), y * (height - 1)] for x, y in region.points])
        cv2.polylines(image, [corners.round().astype(np.int32)], True, REGION_RGB, 2)
    for zone, label in zones:
        corners = np.array([[x * (width - 1), y * (height - 1)] for x, y in zone.points])
        cv2.polylines(image, [corners.round().astype(np.int32)], True, ZONE_RGB, 2)
        _label(image, label, (int(corners[0, 0]), int(corners[0, 1])), ((0, 0, 0), ZONE_RGB))
    for line, label in lines:
        draw_line(image, line, label)
    if detections is not None:
        draw_detections(image, detections, width / detections.width if detections.width else 1.0)
    return encode_jpeg(image, quality), width, height
