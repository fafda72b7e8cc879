"""Stream control API (DESIGN §4): ``POST/GET /streams``, ``GET/PATCH/DELETE /streams/{id}``.

Each stream carries its own detection parameters (``conf``, ``iou``, ``classes``,
``max_det``: those of ``POST /detect``) and an optional region of interest (``roi``), set when
it is added; ``PATCH`` changes them, the name and ``max_fps`` without reopening the camera.
All are persisted with the stream, classes by name.

An unreachable camera is accepted (it shows up as ``reconnecting`` with its last error);
a malformed URL or a source that is not allowed is a 422.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import APIRouter, Depends, HTTPException, Query, Request, Response
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
)

from engines.pool import EnginePool
from engines.types import DetectParams
from server import streams_file
from server.routes.detect import parse_classes
from server.routes.paths import root_of, served_event
from server.routes.query import check_query_and_body_type
from server.settings import Settings
from server.state import get_state
from streams.clips import ClipOptions
from streams.detect import MAX_MASKS, Roi, StreamDetect, parse_masks
from streams.event_store import EventStore
from streams.events import EventLog
from streams.filters import ObjectFilters
from streams.geometry import MAX_NAME, check_text
from streams.lines import MAX_LINES, Line, parse_lines
from streams.manager import (
    ManagerClosed,
    ManagerOptions,
    StreamChanges,
    StreamExistsError,
    StreamLimitError,
    StreamManager,
)
from streams.motion import MotionOptions
from streams.reader import ReaderOptions
from streams.sources import SourceError, Transport
from streams.store import StreamStore
from streams.zones import INERTIA, MAX_INERTIA, MAX_LOITER_S, MAX_ZONES, Zone, parse_zones

if TYPE_CHECKING:
    from server.metrics import StreamSample

log = logging.getLogger(__name__)
router = APIRouter(dependencies=[Depends(check_query_and_body_type)])


def printable(what: str) -> BeforeValidator:
    """A name's check: no control character (a zone's name is an MQTT topic level: one with
    U+0000 got the server's client dropped by the broker at every reconnect) nor lone
    surrogate, refused naming ``what`` (the 422 echoing it escapes a surrogate:
    ``server.routes.errors.http_error``)."""

    def check(value: object) -> object:
        if isinstance(value, str):
            check_text(value, what)
        return value

    return BeforeValidator(check)


class LineIn(BaseModel):
    """A counting line: a name and two points in 0..1 of the frame."""

    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, Field(min_length=1, max_length=MAX_NAME), printable("lines")]
    points: Annotated[list[tuple[StrictFloat, StrictFloat]], Field(min_length=2, max_length=2)]
    classes: Annotated[
        list[StrictInt | StrictStr] | str | None,
        Field(description="class ids or names it counts; null: every class"),
    ] = None


class ZoneIn(BaseModel):
    """A zone: a name, a polygon of 3 to 64 points in 0..1 of the frame, and its inertia."""

    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, Field(min_length=1, max_length=MAX_NAME), printable("zones")]
    points: Annotated[list[tuple[StrictFloat, StrictFloat]], Field(min_length=3, max_length=64)]
    inertia: Annotated[
        int,
        Field(
            ge=1,
            le=MAX_INERTIA,
            description="frames in a row a tracked object is seen inside to enter (outside to"
            " exit)",
        ),
    ] = INERTIA
    loiter_s: Annotated[
        float | None,
        Field(
            gt=0,
            le=MAX_LOITER_S,
            description="a tracked object in it this many seconds is loitering: one zone_loiter"
            " event per stay (needs track); null: none",
        ),
    ] = None
    classes: Annotated[
        list[StrictInt | StrictStr] | str | None,
        Field(description="class ids or names it counts (Frigate's zone objects); null: every"),
    ] = None


class FilterIn(BaseModel):
    """What one class's detections must be to be kept (Frigate's object filters)."""

    model_config = ConfigDict(extra="forbid")

    min_conf: Annotated[
        StrictFloat | None,
        Field(ge=0.0, le=1.0, description="this class's minimum confidence (instead of conf)"),
    ] = None
    min_area: Annotated[
        StrictFloat | None, Field(ge=0.0, le=1.0, description="smallest box, a share of the frame")
    ] = None
    max_area: Annotated[
        StrictFloat | None, Field(ge=0.0, le=1.0, description="largest box, a share of the frame")
    ] = None
    min_ratio: Annotated[
        StrictFloat | None, Field(gt=0.0, description="narrowest box: its width over its height")
    ] = None
    max_ratio: Annotated[
        StrictFloat | None, Field(gt=0.0, description="widest box: its width over its height")
    ] = None


class DetectIn(BaseModel):
    """A stream's detection parameters: those of ``POST /detect``'s query, same defaults."""

    model_config = ConfigDict(extra="forbid")  # a misspelt field is a 422, not ignored

    # Strict: true was taken as 1, "0.5" as 0.5 (a streams file's quoted value too).
    conf: Annotated[StrictFloat, Field(ge=0.0, le=1.0, description="minimum confidence")] = 0.25
    iou: Annotated[StrictFloat, Field(ge=0.0, le=1.0, description="NMS IoU threshold")] = 0.7
    classes: Annotated[
        list[StrictInt | StrictStr] | str | None,
        Field(description="class ids or names, a list or a comma string; null: every class"),
    ] = None
    max_det: Annotated[StrictInt, Field(ge=1, le=1000, description="most detections")] = 300
    roi: Annotated[
        list[tuple[StrictFloat, StrictFloat]] | None,
        Field(
            description="region of interest: [[x, y], ...] in 0..1 of the frame, 3 to 64 points;"
            " detections whose box's bottom centre is outside are dropped; null: whole frame"
        ),
    ] = None
    track: Annotated[
        StrictBool,
        Field(
            description="give each detection a track_id that follows its object across frames,"
            " and count objects once in the stream's 'tracked' counts"
        ),
    ] = False
    lines: Annotated[
        list[LineIn] | None,
        Field(
            max_length=MAX_LINES,
            description="counting lines (need track): [{name, points: [[x, y], [x, y]]}];"
            " crossings of tracked objects are counted per line, direction and class",
        ),
    ] = None
    zones: Annotated[
        list[ZoneIn] | None,
        Field(
            max_length=MAX_ZONES,
            description="zones: [{name, points: [[x, y], ...]}]; what stands in each is counted"
            " by class (and, where the stream tracks, each object entering it once)",
        ),
    ] = None
    clips: Annotated[
        StrictBool,
        Field(
            description="keep a video clip of each line crossing and zone entry or exit (from"
            " --event-clip-pre-s before to --event-clip-post-s after), at GET /clips/{id}.mp4",
        ),
    ] = False
    motion: Annotated[
        StrictBool,
        Field(
            description="infer only frames where something moved (and still ones at"
            " --motion-idle-fps), to serve more cameras on the same CPU or GPU",
        ),
    ] = False
    motion_threshold: Annotated[
        StrictInt | None,
        Field(
            ge=1,
            le=255,
            description="this stream's grey levels a pixel must change by to count as moving"
            " (higher for a noisy night picture); null: --motion-threshold",
        ),
    ] = None
    motion_min_area: Annotated[
        StrictFloat | None,
        Field(
            gt=0.0,
            le=1.0,
            description="this stream's share of the picture that must move for a frame to be"
            " inferred (lower for a wide view where people are small); null: --motion-min-area",
        ),
    ] = None
    motion_mask: Annotated[
        list[list[tuple[StrictFloat, StrictFloat]]] | None,
        Field(
            max_length=MAX_MASKS,
            description="polygons ([[x, y], ...] in 0..1 of the frame) whose changes are not"
            " motion: a camera's clock, a tree in the wind; null or []: none",
        ),
    ] = None
    stationary_s: Annotated[
        StrictFloat | None,
        Field(
            gt=0,
            le=86_400,
            description="seconds a tracked object stands still before it is 'stationary'"
            " (short at a doorway, long in a car park); null: 10",
        ),
    ] = None

    filters: Annotated[
        dict[str, FilterIn] | None,
        Field(
            description="per class (name or id): min_conf, min_area and max_area (shares of"
            " the frame), min_ratio and max_ratio (width over height); detections that fail"
            " are dropped before they are tracked or counted; null or {}: none",
        ),
    ] = None

    def detect(self, names: Mapping[int, str], current: StreamDetect) -> StreamDetect:
        """``current`` with the fields this body set; HTTP 422 for a class the model lacks or
        a bad region."""
        given, now = self.model_fields_set, current.params
        params = DetectParams(
            conf=self.conf if "conf" in given else now.conf,
            iou=self.iou if "iou" in given else now.iou,
            classes=parse_classes(self.classes, names) if "classes" in given else now.classes,
            max_det=self.max_det if "max_det" in given else now.max_det,
        )
        roi = current.roi
        if "roi" in given:
            try:
                roi = None if self.roi is None else Roi(tuple(self.roi))
            except ValueError as exc:
                raise HTTPException(422, str(exc)) from None
        lines, zones = current.lines, current.zones
        try:
            if "lines" in given:
                lines = parse_lines(
                    [_by_name(line.model_dump(), names, "lines") for line in self.lines or ()]
                )
            if "zones" in given:
                zones = parse_zones(
                    [_by_name(zone.model_dump(), names, "zones") for zone in self.zones or ()]
                )
            track = self.track if "track" in given else current.track
            clips = self.clips if "clips" in given else current.clips
            motion = self.motion if "motion" in given else current.motion
            masks = current.motion_mask
            if "motion_mask" in given:
                masks = parse_masks(self.motion_mask or ())
            area = self.motion_min_area if "motion_min_area" in given else current.motion_min_area
            level = (
                self.motion_threshold if "motion_threshold" in given else current.motion_threshold
            )
            filters = current.filters
            if "filters" in given:
                raw = {k: f.model_dump(exclude_none=True) for k, f in (self.filters or {}).items()}
                filters = ObjectFilters.parse(raw, names) if raw else None
            still = self.stationary_s if "stationary_s" in given else current.stationary_s
            _check_shape_classes(params.classes, names, (("lines", lines), ("zones", zones)))
            detect = StreamDetect(
                params, roi, track, lines, zones, clips, motion, masks, area, level, filters, still
            )
            detect.refuse_useless()
            return detect
        except ValueError as exc:
            raise HTTPException(422, str(exc)) from None


def _check_shape_classes(
    wanted: frozenset[int] | None,
    names: Mapping[int, str],
    shapes: Sequence[tuple[str, Sequence[Line] | Sequence[Zone]]],
) -> None:
    """ValueError for a line or zone counting only classes the stream's ``classes`` leave
    out: it would never count anything (it was accepted, and counted nothing)."""
    if wanted is None:
        return
    detected = {names[i] for i in wanted}
    for kind, group in shapes:
        for shape in group:
            if shape.classes and not detected.intersection(shape.classes):
                raise ValueError(
                    f"{kind}: {shape.name!r}: counts {', '.join(shape.classes)}, which the"
                    f" stream's classes ({', '.join(sorted(detected))}) leave out: it would"
                    " never count anything"
                )


def _by_name(shape: dict[str, Any], names: Mapping[int, str], kind: str) -> dict[str, Any]:
    """A line's or zone's JSON with its ``classes`` as the model's class names (HTTP 422
    naming ``kind`` (``lines`` or ``zones``), the shape and the class it lacks)."""
    where = f"{kind}: {shape['name']!r}"
    try:
        ids = parse_classes(shape.get("classes"), names)
    except HTTPException as exc:
        raise HTTPException(422, f"{where}: {exc.detail}") from None
    return {**shape, "classes": None if ids is None else sorted(names[i] for i in ids)}


class StreamPatch(DetectIn):
    """Body of ``PATCH /streams/{id}``: what may change while a stream runs."""

    name: Annotated[str, Field(max_length=200), printable("name")] = ""
    max_fps: Annotated[
        StrictFloat | None,
        Field(gt=0, le=1000, description="sample at most this many frames/s; null: every frame"),
    ] = None
    enabled: Annotated[
        StrictBool,
        Field(
            description="false: the camera is closed and nothing is detected (a privacy mode),"
            " its settings and counts kept; true opens it again"
        ),
    ] = True

    def changes(self, names: Mapping[int, str], current: StreamDetect) -> StreamChanges:
        """The fields this body set, as the manager applies them."""
        given = self.model_fields_set
        changes: StreamChanges = {}
        if "name" in given:
            changes["name"] = self.name
        if "max_fps" in given:
            changes["max_fps"] = self.max_fps
        if "enabled" in given:
            changes["enabled"] = self.enabled
        if given & DetectIn.model_fields.keys():
            changes["detect"] = self.detect(names, current)
        return changes


STREAM_ID = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$"
"""A stream id given by its user: a camera's name in URLs and MQTT topics (``front_door``)."""


class StreamIn(StreamPatch):
    """Body of ``POST /streams`` and ``PUT /streams/{id}``, and an entry of the streams
    file."""

    id: Annotated[
        str | None,
        Field(
            pattern=STREAM_ID,
            description="the stream's id (letters, digits, _ and -, at most 64): its name in"
            " URLs and MQTT topics; default: 12 random hex digits",
        ),
    ] = None

    url: Annotated[
        str,
        Field(
            min_length=1,
            max_length=2048,
            description="rtsp://, rtsps://, http(s):// or file:// URL",
        ),
    ]
    transport: Transport = "tcp"
    loop: StrictBool = True

    def settings(self, detect: StreamDetect, *, from_file: bool = False) -> dict[str, Any]:
        """What :meth:`StreamManager.add` and :meth:`StreamManager.put` take besides the
        url and the id, ``detect`` made from this body."""
        return {
            "name": self.name,
            "max_fps": self.max_fps,
            "transport": self.transport,
            "loop": self.loop,
            "detect": detect,
            "from_file": from_file,
            "enabled": self.enabled,
        }


MAX_EVENT_DATA = 4096


class EventIn(BaseModel):
    """Body of ``POST /streams/{id}/events``: an event an outside system creates."""

    model_config = ConfigDict(extra="forbid")

    label: Annotated[
        str,
        Field(min_length=1, max_length=MAX_NAME, description="what happened, e.g. 'doorbell'"),
        printable("label"),  # it goes into the log line: a newline wrote a line of its own
    ]
    data: Annotated[
        dict[str, Any] | None,
        Field(
            description="any JSON object sent along with the event (at most"
            f" {MAX_EVENT_DATA} bytes)"
        ),
    ] = None
    clip: Annotated[
        StrictBool | None,
        Field(
            description="record the video around it (the stream must keep clips); default:"
            " whenever the stream keeps clips"
        ),
    ] = None

    @field_validator("data")
    @classmethod
    def _small(cls, data: dict[str, Any] | None) -> dict[str, Any] | None:
        if data is not None and len(json.dumps(data)) > MAX_EVENT_DATA:
            raise ValueError(f"at most {MAX_EVENT_DATA} bytes of JSON")
        return data


def get_manager(request: Request) -> StreamManager:
    state = get_state(request)
    if state.streams is None or state.shutting_down:
        raise HTTPException(503, "server not ready", headers={"Retry-After": "1"})
    return state.streams


@router.post("/streams", status_code=201)
async def add_stream(body: StreamIn, request: Request) -> dict[str, Any]:
    manager = get_manager(request)
    detect = body.detect(get_state(request).pool.engine.names, StreamDetect())
    with _refusals():
        return await manager.add(body.url, stream_id=body.id, **body.settings(detect))


@router.put("/streams/{stream_id}")
async def put_stream(
    stream_id: str, body: StreamIn, request: Request, response: Response
) -> dict[str, Any]:
    """Create the stream ``stream_id`` (201) or give it every setting anew (200): what is
    not given takes its default. A new source (``url``, ``transport``, ``loop``) is opened in
    place of the old one; the stream keeps its id, counts and viewers. For scripts and
    configuration tools that declare streams: the same call twice changes nothing."""
    if re.fullmatch(STREAM_ID, stream_id) is None:
        raise HTTPException(422, f"stream id {stream_id[:80]!r}: letters, digits, _ and -, 1-64")
    if body.id is not None and body.id != stream_id:
        raise HTTPException(422, f"id: {body.id!r} in the body, {stream_id[:64]!r} in the path")
    manager = get_manager(request)
    check_changeable(request, stream_id)
    detect = body.detect(get_state(request).pool.engine.names, StreamDetect())
    with _refusals():
        info, added = await manager.put(stream_id, body.url, **body.settings(detect))
    if added:
        response.status_code = 201
    return info


async def set_enabled(manager: StreamManager, stream_id: str, on: bool) -> bool:
    """Enable or disable a stream (MQTT's ``.../enabled/set``); False if it is unknown."""
    return await manager.update(stream_id, {"enabled": on}) is not None


@contextlib.contextmanager
def _refusals() -> Iterator[None]:
    """The manager's refusals to add or change a stream as HTTP errors."""
    try:
        yield
    except SourceError as exc:
        raise HTTPException(422, f"url: {exc}") from None
    except (StreamLimitError, StreamExistsError) as exc:
        raise HTTPException(409, str(exc)) from None
    except ManagerClosed:
        raise HTTPException(503, "server shutting down", headers={"Retry-After": "5"}) from None


def check_changeable(request: Request, stream_id: str) -> None:
    """HTTP 409 for a stream the streams file declares: the file alone changes it. A stream
    a streams file declared in an earlier run, the server started without one now, is the
    API's (it was locked for good: no file to change it in)."""
    info = get_manager(request).describe(stream_id)
    path = get_state(request).settings.streams_file
    if info is not None and info["from_file"] and path is not None:
        raise HTTPException(
            409,
            f"stream {stream_id!r} is declared in the streams file {path}: change it there and"
            " send the server SIGHUP, or restart it (setting STREAMDET_STREAMS_FILE)",
        )


@router.get("/streams", response_model=None)
async def list_streams(
    request: Request,
    output: Annotated[
        Literal["json", "yaml"],
        Query(alias="format", description="json, or yaml: a streams file (--streams-file)"),
    ] = "json",
) -> dict[str, Any] | Response:
    streams = get_manager(request).list()
    if output == "json":
        return {"streams": streams}
    return Response(
        streams_file.to_text(streams),
        media_type="application/yaml",
        headers={"Content-Disposition": 'inline; filename="streams.yaml"'},
    )


@router.get("/streams/{stream_id}")
async def get_stream(stream_id: str, request: Request) -> dict[str, Any]:
    info = get_manager(request).describe(stream_id)
    if info is None:
        raise HTTPException(404, f"no stream {stream_id[:64]!r}; list streams with GET /streams")
    return info


@router.patch("/streams/{stream_id}")
async def update_stream(stream_id: str, body: StreamPatch, request: Request) -> dict[str, Any]:
    """Change a stream's name, rate or what it detects (only the fields given) from its next
    frame, without reopening its source; or disable it (``enabled``: false closes the camera)
    and enable it again."""
    manager = get_manager(request)
    current = manager.detect(stream_id)
    if current is None:
        raise HTTPException(404, f"no stream {stream_id[:64]!r}; list streams with GET /streams")
    if body.model_fields_set != {"enabled"}:  # a file's stream may be paused, as any other
        check_changeable(request, stream_id)
    names = get_state(request).pool.engine.names
    info = await manager.update(stream_id, lambda now: body.changes(names, now))
    if info is None:  # removed meanwhile
        raise HTTPException(404, f"no stream {stream_id[:64]!r}; list streams with GET /streams")
    return info


@router.post("/streams/{stream_id}/events", status_code=201)
async def create_event(stream_id: str, body: EventIn, request: Request) -> dict[str, Any]:
    """Log an event on a stream from outside (a doorbell pressed, an alarm raised), at its
    last processed frame, with that frame's snapshot and the video around it where the
    stream keeps clips; delivered as every other event is. Returns it as logged."""
    manager = get_manager(request)
    detect = manager.detect(stream_id)
    if detect is None:
        raise HTTPException(404, f"no stream {stream_id[:64]!r}; list streams with GET /streams")
    if body.clip and not detect.clips:
        raise HTTPException(
            409,
            f"clip: stream {stream_id} keeps no clips; turn them on with PATCH"
            f' /streams/{stream_id} {{"clips": true}}',
        )
    if body.clip and (state := (manager.describe(stream_id) or {}).get("state")) != "live":
        # Asked for, where no video comes (it was dropped without a word).
        raise HTTPException(
            409,
            f"clip: stream {stream_id} is {state}: no video comes to clip; send the event"
            ' without "clip", or once it is live',
        )
    event = manager.trigger(stream_id, body.label, body.data, clip=body.clip is not False)
    if event is None:  # removed meanwhile
        raise HTTPException(404, f"no stream {stream_id[:64]!r}; list streams with GET /streams")
    return served_event(event, root_of(request.scope))


@router.delete("/streams/{stream_id}", status_code=204)
async def delete_stream(stream_id: str, request: Request) -> Response:
    check_changeable(request, stream_id)
    if not await get_manager(request).remove(stream_id):
        raise HTTPException(404, f"no stream {stream_id[:64]!r}; list streams with GET /streams")
    return Response(status_code=204)


async def apply_streams_file(
    manager: StreamManager, path: Path, names: Mapping[int, str], environ: Mapping[str, str]
) -> None:
    """Make the streams the file at ``path`` declares match it: each is added, or given every
    setting anew (its source reopened only where it changed), and marked as the file's, so
    the API refuses to change it; a stream the file declared before and no longer does is
    removed. Streams added through the API are left as they are. The whole file is checked
    before anything changes.

    Raises:
        StreamsFileError: the file or an entry of it is not right; the message names it.
    """
    declared = []
    for entry in streams_file.read_entries(path, environ):
        where = f"streams file {path}: stream {entry['id']!r}"
        try:
            body = StreamIn.model_validate(entry)
            detect = body.detect(names, StreamDetect())
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in error['loc'])}: {error['msg']}"
                for error in exc.errors()
            )
            raise streams_file.StreamsFileError(f"{where}: {problems}") from None
        except HTTPException as exc:
            raise streams_file.StreamsFileError(f"{where}: {exc.detail}") from None
        try:
            manager.check_source(body.url, body.transport, body.loop)
        except SourceError as exc:
            raise streams_file.StreamsFileError(f"{where}: url: {exc}") from None
        declared.append((body, detect))
    ids = {str(body.id) for body, _ in declared}
    others = [s for s in manager.list() if not s["from_file"] and s["id"] not in ids]
    if len(others) + len(declared) > manager.max_streams:
        raise streams_file.StreamsFileError(
            f"streams file {path}: {len(declared)} streams and {len(others)} added through the"
            f" API are more than {manager.max_streams} (setting STREAMDET_MAX_STREAMS)"
        )
    # The file's streams hold their room from the check on: an API call coming between its
    # steps cannot take it (the reload was half applied, its log saying nothing changed).
    with manager.reserving(ids):
        for info in manager.list():
            if info["from_file"] and info["id"] not in ids:
                await manager.remove(info["id"])
                log.info(
                    "stream %s: removed, as the streams file no longer declares it", info["id"]
                )
        for body, detect in declared:
            sid = str(body.id)
            try:
                fields = body.settings(detect, from_file=True)
                await manager.put(sid, body.url, **fields)
            except (SourceError, StreamLimitError) as exc:
                raise streams_file.StreamsFileError(
                    f"streams file {path}: stream {sid!r}: {exc}"
                ) from None
    log.info("streams file %s: %d stream(s) declared", path, len(declared))


class StreamsFileReloads:
    """``SIGHUP`` re-applies the streams file (as nginx and Prometheus reload their
    configuration on it): a file that does not fit is logged and changes nothing.

    Args:
        manager: the streams.
        path: the streams file (None: nothing to reload; ``SIGHUP`` is logged).
        names: the model's class names.
    """

    def __init__(self, manager: StreamManager, path: Path | None, names: Mapping[int, str]):
        self._manager, self._path, self._names = manager, path, names
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[bool]] = set()

    def install(self) -> None:
        """Handle ``SIGHUP`` on the running loop (only where it runs in the main thread)."""
        with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.signalled)

    def uninstall(self) -> None:
        """At shutdown: ``SIGHUP`` is ignored from now on (removing the handler put back its
        default action, which ended the process at once, in the middle of its shutdown)."""
        with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            signal.signal(signal.SIGHUP, signal.SIG_IGN)

    def signalled(self) -> None:
        if self._path is None:
            log.warning("SIGHUP: no streams file to reload (setting STREAMDET_STREAMS_FILE)")
            return
        log.info("SIGHUP: reloading the streams file %s", self._path)
        task = asyncio.create_task(self.reload())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def reload(self) -> bool:
        """Apply the file again, one reload at a time; False (logged) if it does not fit."""
        if self._path is None:
            return False
        async with self._lock:
            try:
                await apply_streams_file(self._manager, self._path, self._names, os.environ)
            except streams_file.StreamsFileError as exc:
                log.error("streams file not reloaded, the streams stay as they were: %s", exc)
                return False
            except ManagerClosed:
                return False
        return True


def metric_samples(manager: StreamManager) -> Iterator[StreamSample]:
    """The manager's figures for ``/metrics`` (``Metrics.set_stream_source``)."""
    from server.metrics import StreamSample

    for info in manager.list():
        yield StreamSample(
            stream_id=info["id"],
            fps_in=info["fps_in"],
            fps_processed=info["fps_processed"],
            frames_in=info["frames_in"],
            frames_processed=info["frames_processed"],
            drops=info["drops"],
            publish_drops=info["publish_drops"],
            reconnects=info["reconnects"],
            frames_failed=info["frames_failed"],
            motion_skipped=info["motion_skipped"],
            skipped=info["skipped"],
            frames_decoded=info["frames_decoded"],
            frames_copied=info["frames_copied"],
            viewers=info["subscribers"],
            viewer_drops=info["viewer_drops"],
            state=info["state"],
            detections=info["detections"],
            objects=info["objects"],
            tracked=info["tracked"],
            crossings={
                (line, direction, name): n
                for line, ways in info["crossings"].items()
                for direction, by_class in ways.items()
                for name, n in by_class.items()
            },
            zone_objects=_zone_objects(info),
            zone_entries=_by_zone(info["zones"], "entered"),
            zone_exits=_by_zone(info["zones"], "exited"),
            zone_loiters=_by_zone(info["zones"], "loitered"),
        )


def _zone_objects(info: Mapping[str, Any]) -> dict[tuple[str, str], int]:
    """What stands in each of a stream's zones now by ``(zone, class)``, 0 for a class the
    stream has detected (and the zone counts) that stands in it no more, as its ``objects``
    are: the series went missing while a zone was empty (gaps in graphs, and an "empty for
    10 minutes" rule never fired)."""
    counted = {z["name"]: z.get("classes") for z in info["detect"]["zones"]}
    return {
        (zone, name): counts["now"].get(name, 0)
        for zone, counts in info["zones"].items()
        for name in sorted(set(info["detections"]) | set(counts["now"]))
        if counted.get(zone) is None or name in counted[zone]
    }


def _by_zone(
    zones: Mapping[str, Mapping[str, Mapping[str, int]]], count: str
) -> dict[tuple[str, str], int]:
    """One of a stream's zone counts (``now``, ``entered``, ``exited``) by ``(zone, class)``."""
    return {(zone, name): n for zone, counts in zones.items() for name, n in counts[count].items()}


def reader_options(settings: Settings, input_size: int | None = None) -> ReaderOptions:
    """What every stream's reader takes from ``settings`` (and the engine's ``input_size``,
    which frames are decoded at unless ``stream_decode_size`` says otherwise)."""
    return ReaderOptions(
        open_timeout_s=settings.stream_open_timeout_s,
        read_timeout_s=settings.stream_read_timeout_s,
        backoff_initial_s=settings.reconnect_initial_s,
        backoff_max_s=settings.reconnect_max_s,
        max_attempts=settings.reconnect_max_attempts,
        frame_deadline_ms=settings.stream_frame_deadline_ms,
        max_pixels=settings.max_image_pixels,
        keyframe_decode=settings.keyframe_decode,
        decode_max_side=settings.decode_side(input_size),
        codec_threads=settings.stream_codec_threads,
        decode_device=settings.device if settings.decode == "cuda" else "cpu",
        motion=MotionOptions(
            threshold=settings.motion_threshold,
            min_area=settings.motion_min_area,
            idle_fps=settings.motion_idle_fps,
        ),
    )


def build_manager(settings: Settings, pool: EnginePool) -> StreamManager:
    """The stream manager for ``settings``, feeding ``pool`` (not started yet)."""
    options = ManagerOptions(
        reader=reader_options(settings, pool.engine.input_size),
        allowed_file_dir=settings.allowed_file_dir,
        ws_queue_size=settings.ws_queue_size,
        max_streams=settings.max_streams,
        stop_timeout_s=settings.stream_open_timeout_s + settings.stream_read_timeout_s,
        event_log_size=settings.event_log_size,
        decode_processes=settings.decode_processes,
        streams_file=settings.streams_file is not None,
        clips=ClipOptions(
            settings.data_dir / "clips",
            pre_s=settings.event_clip_pre_s,
            post_s=settings.event_clip_post_s,
            max_s=settings.event_clip_max_s,
            max_bytes=settings.event_clips_max_mb * 1024 * 1024,
        ),
    )
    events = EventLog(
        settings.event_log_size, store=EventStore(settings.data_dir, settings.event_log_size)
    )
    return StreamManager(pool, StreamStore(settings.data_dir), options, events)
