"""Video jobs: ``POST /jobs`` (a recorded video, uploaded or by URL, and the detection
settings of a stream), ``GET /jobs``, ``GET /jobs/{id}`` (long-polled with ``wait_s``),
``GET /jobs/{id}/frames`` and ``/events`` (NDJSON), ``DELETE /jobs/{id}``.

A job runs on what calls and live streams leave of the engines (their background lane), so
footage is analysed as fast as the hardware allows without costing the cameras their latency.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, HTTPException, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, StreamingResponse
from pydantic import Field, StrictBool, ValidationError, field_validator, model_validator
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser

from server.csv_cells import csv_text
from server.jobs import (
    EVENTS_FILE,
    FRAMES_FILE,
    LIVE_ONLY,
    VIDEO_FILE,
    Job,
    JobLimitError,
    JobManager,
    JobsClosed,
    JobStorageError,
)
from server.ranges import RangedFile
from server.routes.bodies import MAX_JSON_BYTES, load_json
from server.routes.detect import capped_stream, megabytes
from server.routes.events import MAX_INTERVAL_S, count_members, counts_answer
from server.routes.longpoll import wait_unless_gone
from server.routes.paths import root_of
from server.routes.query import check_query
from server.routes.streams import DetectIn, printable
from server.settings import check_webhook_url
from server.state import AppState, get_state
from streams.detect import StreamDetect
from streams.events import COUNT_KEYS, count_events
from streams.files import VIDEO_SUFFIXES
from streams.geometry import check_text
from streams.jobs import FramesTooLarge, JobError
from streams.sources import SourceError, open_options, parse_source, redact, upload_options
from streams.store import private_dir

log = logging.getLogger(__name__)


def _no_unread_query(request: Request, ctype: str) -> None:
    """HTTP 422 for ``settings`` or ``filename`` in the query of a ``POST /jobs`` whose body
    is not the video itself: read only there, the job ran on every class and frame."""
    if ctype in VIDEO_TYPES or ctype.startswith("video/"):
        return
    for name in ("settings", "filename"):
        if name in request.query_params:
            where = (
                "the uploaded file's name is the job's"
                if name == "filename"
                else "send the settings as the multipart field 'settings'"
            )
            if ctype != "multipart/form-data":
                where = "a url's job takes its settings as the JSON body's own fields"
            raise HTTPException(
                422,
                f"query: {name}: read only beside the video itself as the body (video/mp4,"
                f" ...); {where}",
            )


def _checked_query(request: Request) -> None:
    """Every job route's query checked (:mod:`server.routes.query`): ``setting=`` (for
    ``settings``) ran a job on every class, ``wait=`` (for ``wait_s``) did not wait."""
    # POST /jobs reads its video's settings and name from the query itself.
    check_query(request, extra=("settings", "filename") if request.method == "POST" else ())


router = APIRouter(dependencies=[Depends(_checked_query)])

VIDEO_TYPES = {
    "video/mp4": ".mp4",
    "video/quicktime": ".mov",
    "video/x-matroska": ".mkv",
    "video/webm": ".webm",
    "video/mp2t": ".ts",
    "video/x-msvideo": ".avi",
    "application/octet-stream": ".video",
}
WRITE_CHUNK = 4 << 20  # bytes gathered before a write to disk, off the event loop
NDJSON = "application/x-ndjson"


class JobIn(DetectIn):
    """A job's settings: a stream's detection settings (``conf``, ``iou``, ``classes``,
    ``max_det``, ``roi``, ``track``, ``lines``, ``zones``), a ``name``, ``fps``, and, for a
    video already reachable from the server, its ``url``."""

    name: Annotated[str, Field(max_length=200), printable("name")] = ""
    fps: Annotated[
        float | None,
        Field(
            gt=0,
            le=1000,
            description="at most this many frames per second of video; null: every frame",
        ),
    ] = None
    render: Annotated[
        StrictBool,
        Field(
            description="draw the processed frames (boxes, track ids, region, zones, lines and"
            " their counts) into an MP4 at GET /jobs/{id}/video.mp4"
        ),
    ] = False
    callback_url: Annotated[
        str | None,
        Field(
            max_length=2048,
            description='an http(s) URL sent POST {"job": ...} once the job ends, signed'
            " with --webhook-secret as webhooks are, retried with backoff",
        ),
    ] = None
    url: Annotated[
        str | None,
        Field(
            min_length=1,
            max_length=2048,
            description="the video, when not uploaded: file:// under --allowed-file-dir or"
            " http(s)://",
        ),
    ] = None

    @field_validator("callback_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is not None:  # a port or host no request can reach failed every try
            check_webhook_url(value, "callback_url", "")
        return value

    @model_validator(mode="after")
    def _no_live_settings(self) -> JobIn:
        live = sorted(LIVE_ONLY & self.model_fields_set)  # each named, not the first alone
        if live:
            raise ValueError(
                f"{', '.join(live)}: a live stream's setting{'s' if len(live) > 1 else ''};"
                " a job reads all of a recorded video (sample fewer frames with fps)"
            )
        return self


def job_body_schema() -> dict[str, Any]:
    """``JobIn``'s JSON schema for the OpenAPI document: its shapes referred to where the
    document keeps them (its own ``#/$defs/...`` resolved nowhere there), and without the
    live streams' settings it inherits and refuses (``clips``, ``motion``, ...)."""
    schema = JobIn.model_json_schema(ref_template="#/components/schemas/{model}")
    schema.pop("$defs", None)
    for key in LIVE_ONLY:
        schema["properties"].pop(key, None)
    return schema


def _jobs(state: AppState) -> JobManager:
    if state.jobs is None or state.shutting_down:
        raise HTTPException(503, "server shutting down", headers={"Retry-After": "5"})
    return state.jobs


def _job(state: AppState, job_id: str) -> Job:
    job = _jobs(state).get(job_id)
    if job is None:
        raise HTTPException(404, f"no job {job_id[:64]!r}")
    return job


def settings_of(raw: str | dict[str, Any] | None, where: str) -> JobIn:
    """The settings object from JSON text or a parsed body; 422 naming what is wrong."""
    if isinstance(raw, str):
        try:
            raw = load_json(raw) if raw.strip() else {}
        except ValueError as exc:
            raise HTTPException(422, f"{where}: {exc}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise HTTPException(422, f"{where}: a JSON object of settings, not {type(raw).__name__}")
    try:
        return JobIn.model_validate(raw)
    except ValidationError as exc:
        errors = [{**error, "loc": (where, *error["loc"])} for error in exc.errors()]
        raise RequestValidationError(errors) from None


def _capped(request: Request, limit: int) -> AsyncGenerator[bytes, None]:
    """The request body, refused (413) once it passes ``limit`` bytes."""
    mb = megabytes(limit)
    too_large = f"video larger than {mb} MB (setting STREAMDET_MAX_JOB_UPLOAD_MB)"
    return capped_stream(request, limit, too_large)


async def _save_body(request: Request, limit: int, path: Path) -> int:
    """A raw video body to ``path``; its size."""
    size, buffered = 0, bytearray()
    with path.open("wb") as out:
        async for chunk in _capped(request, limit):
            buffered += chunk
            size += len(chunk)
            if len(buffered) >= WRITE_CHUNK:
                await asyncio.to_thread(out.write, bytes(buffered))
                buffered.clear()
        await asyncio.to_thread(out.write, bytes(buffered))
    return size


async def _save_upload(upload: UploadFile, path: Path) -> int:
    def copy() -> int:
        upload.file.seek(0)
        with path.open("wb") as out:
            shutil.copyfileobj(upload.file, out, WRITE_CHUNK)
            return out.tell()

    return await asyncio.to_thread(copy)


async def _receive(
    request: Request, state: AppState, directory: Path, ctype: str
) -> tuple[JobIn, dict[str, Any], str, dict[str, str]]:
    """The job's settings and video from the request (its media type ``ctype``):
    ``(settings, source, target, options)``, an uploaded video saved under ``directory``."""
    settings = state.settings
    limit = int(settings.max_job_upload_mb * 1024 * 1024)
    if ctype == "application/json":
        # Settings and a URL: capped as the settings routes are (it was read whole, however
        # large: 300 MB took 4.7 s and 1.2 GB of the server's memory before its 422).
        too_large = (
            f"body larger than {MAX_JSON_BYTES // 1024} kB: a job's JSON is its settings and"
            " url; upload a video as multipart/form-data or as the body (video/mp4, ...)"
        )
        raw = b"".join([chunk async for chunk in capped_stream(request, MAX_JSON_BYTES, too_large)])
        try:
            body = load_json(raw)
        except ValueError as exc:
            raise HTTPException(422, f"body: {exc}") from None
        job_in = settings_of(body, "body")
        if job_in.url is None:
            raise HTTPException(
                422,
                "body: url: give the video's url, or upload it (multipart field 'video', or"
                " the video as the body with its settings in the query's 'settings')",
            )
        try:
            spec = parse_source(job_in.url, settings.allowed_file_dir, loop=False)
        except SourceError as exc:
            raise HTTPException(422, f"url: {exc}") from None
        if spec.scheme in ("rtsp", "rtsps"):
            raise HTTPException(
                422,
                "url: a job reads a recorded video (file:// or http(s)://); a live camera is a"
                " stream (POST /streams)",
            )
        return job_in, {"url": redact(job_in.url)}, spec.target, open_options(spec)
    await asyncio.to_thread(private_dir, directory)  # 0700: the upload is the caller's
    if ctype == "multipart/form-data":
        # Two files: a settings field sent as a file is refused below saying so.
        parser = MultiPartParser(request.headers, _capped(request, limit), max_files=2)
        try:
            form = await parser.parse()
        except MultiPartException as exc:
            # A part over its size is too large, as the same JSON as a body is (413); too
            # many parts is a form that is not the one asked for (422); the rest is malformed.
            status = 413 if "maximum size" in exc.message else 400
            status = 422 if exc.message.startswith("Too many") else status
            raise HTTPException(status, f"multipart body: {exc.message}") from None
        try:
            video = form.get("video")
            if not isinstance(video, UploadFile):
                got = ", ".join(sorted(form.keys())) or "none"
                raise HTTPException(422, f"multipart form needs a file field 'video' (got: {got})")
            unread = sorted(set(form.keys()) - {"video", "settings"})
            if unread:  # fps=3 or setting={...} beside the video: a job on everything
                raise HTTPException(
                    422,
                    f"multipart field {unread[0][:64]!r}: send only the file field 'video' and"
                    " the field 'settings' (JSON text: classes, fps, ...)",
                )
            text = form.get("settings")
            if text is not None and not isinstance(text, str):
                raise HTTPException(422, "multipart field 'settings' must be JSON text, not a file")
            job_in = settings_of(text, "settings")
            _check_filename(video.filename, "multipart field 'video': filename")
            suffix = Path(video.filename or "").suffix.lower()
            path = directory / f"source{suffix if suffix in VIDEO_SUFFIXES else '.video'}"
            size = await _save_upload(video, path)
            filename = video.filename or path.name
        finally:
            await form.close()
    elif ctype in VIDEO_TYPES or ctype.startswith("video/"):
        job_in = settings_of(request.query_params.get("settings"), "settings")
        _check_filename(request.query_params.get("filename"), "query: filename")
        path = directory / f"source{VIDEO_TYPES.get(ctype, '.video')}"
        size = await _save_body(request, limit, path)
        filename = request.query_params.get("filename") or path.name
    else:
        raise HTTPException(
            415,
            f"Content-Type {ctype or '(none)'!r}: send multipart/form-data with a file field"
            " 'video', the video itself (video/mp4, ...), or application/json with a 'url'",
        )
    if job_in.url is not None:
        raise HTTPException(422, "url: give a url or upload a video, not both")
    if size == 0:
        raise HTTPException(400, "video: the upload is empty")
    return job_in, {"upload": filename[:200], "bytes": size}, str(path), upload_options()


@router.post(
    "/jobs",
    status_code=202,
    openapi_extra={
        "requestBody": {
            "content": {
                "multipart/form-data": {
                    "schema": {
                        "type": "object",
                        "required": ["video"],
                        "properties": {
                            "video": {"type": "string", "format": "binary"},
                            "settings": {"type": "string", "description": "JobIn as JSON"},
                        },
                    }
                },
                "video/mp4": {"schema": {"type": "string", "format": "binary"}},
                "application/json": {"schema": job_body_schema()},
            }
        },
        "parameters": [
            {
                "name": "settings",
                "in": "query",
                "required": False,
                "description": "with the video as the body (video/mp4, ...): its settings"
                " (JobIn) as JSON",
                "schema": {"type": "string"},
            },
            {
                "name": "filename",
                "in": "query",
                "required": False,
                "description": "with the video as the body: its name, as the job shows it",
                "schema": {"type": "string"},
            },
        ],
    },
)
async def create_job(request: Request, response: Response) -> dict[str, Any]:
    """A video job: the video uploaded (multipart field ``video`` with a ``settings`` field of
    JSON, or the video as the body with ``settings`` in the query) or, with
    ``application/json``, a ``url``; ``202`` with the job, which waits its turn."""
    state = get_state(request)
    jobs = _jobs(state)
    job_id = jobs.new_id()
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    uploaded = ctype == "multipart/form-data" or ctype in VIDEO_TYPES or ctype.startswith("video/")
    _no_unread_query(request, ctype)
    if uploaded:  # room held before the upload arrives; its query's settings checked first
        if ctype != "multipart/form-data":
            settings_of(request.query_params.get("settings"), "settings")
        await _make_room(jobs, 0, state.settings.jobs_max_mb, job_id)
    directory = jobs.directory_of(job_id)
    names = state.pool.engine.names
    try:
        job_in, source, target, options = await _receive(request, state, directory, ctype)
        if not uploaded:  # settings and a url, checked first: a bad one is 422, never 429
            await _make_room(jobs, 0, state.settings.jobs_max_mb, job_id)
        if "bytes" in source:  # room for the upload beside what is kept
            try:
                await jobs.make_room(source["bytes"], job_id)
            except JobStorageError as exc:
                too_large = source["bytes"] > state.settings.jobs_max_mb * 1024 * 1024
                raise HTTPException(413 if too_large else 507, str(exc)) from None
            except JobLimitError as exc:
                raise HTTPException(
                    429, f"too many jobs: {exc}", headers={"Retry-After": "60"}
                ) from None
        detect = job_in.detect(names, StreamDetect())
        timeout = (state.settings.stream_open_timeout_s, state.settings.stream_read_timeout_s)
        most = state.settings.max_image_pixels
        try:
            # Refused from the codec's parameters, before a frame is decoded (a first frame
            # of 8192x8192 took 360 MB of a probe); a size known only from the first frame
            # (a header that said none) is checked below.
            video = await jobs.probe(target, options, timeout)
        except FramesTooLarge as exc:
            raise HTTPException(413, _too_large(exc.width, exc.height, most)) from None
        except JobError as exc:
            raise HTTPException(415 if "upload" in source else 422, f"video: {exc}") from None
        if video["width"] * video["height"] > most:  # it was queued, then failed at frame 1
            raise HTTPException(413, _too_large(video["width"], video["height"], most))
        job = Job(
            id=job_id,
            name=job_in.name,
            created_at=time.time(),
            source=source,
            target=target,
            options=options,
            video=video,
            detect=detect,
            fps=job_in.fps,
            render=job_in.render,
            callback_url=job_in.callback_url,
        )
        await jobs.add(job)
    except BaseException:
        jobs.release(job_id)
        with contextlib.suppress(OSError):
            await asyncio.to_thread(shutil.rmtree, directory, True)
        raise
    response.headers["Location"] = f"{root_of(request.scope)}/jobs/{job_id}"
    return _describe(request, jobs, job, names)  # as GET /jobs/{id} (it had no queue_position)


def _check_filename(filename: str | None, where: str) -> None:
    """An upload's name with a control character (a newline, an escape sequence) is refused
    422, as a job's or a stream's name is: it was kept and shown as it came (GET /jobs,
    job.json, the log)."""
    if filename:
        try:
            check_text(filename, where)
        except ValueError as exc:
            raise HTTPException(422, str(exc)) from None


def _too_large(width: int, height: int, most: int) -> str:
    return (
        f"video: frames of {width}x{height} = {width * height / 1e6:.1f} MP, over the limit"
        f" of {most / 1e6:.1f} MP (setting STREAMDET_MAX_IMAGE_PIXELS)"
    )


async def _make_room(jobs: JobManager, incoming: int, max_mb: int, job_id: str) -> None:
    """Room for one more job with ``incoming`` bytes, held for ``job_id``, or the HTTP error
    saying why not."""
    try:
        await jobs.make_room(incoming, job_id)
    except JobStorageError as exc:
        raise HTTPException(413 if incoming > max_mb * 1024 * 1024 else 507, str(exc)) from None
    except JobLimitError as exc:
        raise HTTPException(429, f"too many jobs: {exc}", headers={"Retry-After": "60"}) from None
    except JobsClosed:
        raise HTTPException(503, "server shutting down", headers={"Retry-After": "5"}) from None


def _describe(
    request: Request, jobs: JobManager, job: Job, names: Mapping[int, str]
) -> dict[str, Any]:
    data = job.to_json(names, root_of(request.scope))
    data["queue_position"] = jobs.position(job)
    return data


@router.get("/jobs")
async def list_jobs(
    request: Request,
    state_: Annotated[
        Literal["queued", "running", "done", "failed", "cancelled"] | None,
        Query(alias="state", description="only jobs in this state"),
    ] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> dict[str, Any]:
    """The kept jobs, newest first."""
    state = get_state(request)
    jobs = _jobs(state)
    names = state.pool.engine.names
    kept = [job for job in jobs.all() if state_ is None or job.state == state_]
    return {"jobs": [_describe(request, jobs, job, names) for job in kept[:limit]]}


@router.get("/jobs/{job_id}")
async def get_job(
    request: Request,
    job_id: str,
    wait_s: Annotated[
        float, Query(ge=0, le=60, description="wait up to this long for the job to finish")
    ] = 0,
) -> dict[str, Any]:
    """A job: its state, progress (frames, position in the video, fps), and once done the
    counts (``detections`` and ``tracked`` by class, ``crossings``, ``zones``)."""
    state = get_state(request)
    job = _job(state, job_id)
    if wait_s:
        if await wait_unless_gone(request, _jobs(state).wait(job, wait_s)):
            raise HTTPException(499, "the client closed the connection")
        job = _job(state, job_id)  # 404 once deleted meanwhile
    return _describe(request, _jobs(state), job, state.pool.engine.names)


Output = Annotated[
    Literal["ndjson", "csv"],
    Query(alias="format", description="ndjson, or csv for a spreadsheet"),
]
FRAME_COLUMNS = [
    "frame", "pts", "class_name", "confidence", "x1", "y1", "x2", "y2", "track_id", "zones",
]  # fmt: skip
EVENT_COLUMNS = [
    "frame", "pts", "type", "line", "zone", "direction", "class_name", "track_id",
    "confidence", "x1", "y1", "x2", "y2", "dwell_s", "lost",
]  # fmt: skip


def _frame_rows(line: dict[str, Any]) -> list[dict[str, Any]]:
    """A frame's detections, a row each."""
    return [
        {
            "frame": line["frame"],
            "pts": line["pts"],
            **{k: d.get(k) for k in ("class_name", "confidence", "track_id")},
            **dict(zip(("x1", "y1", "x2", "y2"), d["box"], strict=True)),
            "zones": " ".join(d.get("zones", ())),
        }
        for d in line["detections"]
    ]


def _event_rows(event: dict[str, Any]) -> list[dict[str, Any]]:
    box = dict(zip(("x1", "y1", "x2", "y2"), event.get("box") or (), strict=False))
    return [{**{k: v for k, v in event.items() if k in EVENT_COLUMNS}, **box}]


FOLLOW_CHECK_S = 0.25
"""How often a followed result file is read for new lines while its job runs."""

Follow = Annotated[
    bool,
    Query(
        description="stream the lines as the job writes them (NDJSON) and end when it ends,"
        " like tail -f; without it a running job gives the lines so far"
    ),
]


def _whole_lines(path: Path, offset: int) -> bytes:
    """The complete lines of ``path`` from byte ``offset`` (none if it is gone)."""
    try:
        with path.open("rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return b""
    return data[: data.rfind(b"\n") + 1]


async def _follow(request: Request, jobs: JobManager, job: Job, path: Path) -> AsyncIterator[bytes]:
    """Each batch of new whole lines of ``path`` until ``job`` has ended (and its last lines
    are out), is deleted, the client has gone, or the server begins to stop (its lines so
    far out: the client reads on with ``follow`` once the server is back)."""
    offset = 0
    while True:
        # Read before the file: no line written after is lost.
        ended = job.finished.is_set() or jobs.leaving
        chunk = await asyncio.to_thread(_whole_lines, path, offset)
        if chunk:
            offset += len(chunk)
            yield chunk
        if ended or jobs.get(job.id) is None or await request.is_disconnected():
            return
        with contextlib.suppress(TimeoutError):  # wakes at the end, or to read what is new
            await asyncio.wait_for(job.finished.wait(), FOLLOW_CHECK_S)


async def _results(
    request: Request, job_id: str, name: str, output: str, follow: bool = False
) -> Response:
    state = get_state(request)
    job = _job(state, job_id)
    jobs = _jobs(state)
    path = jobs.directory_of(job.id) / name
    headers = {"X-Job-State": str(job.state)}
    if follow:
        if output != "ndjson":
            raise HTTPException(422, "follow streams NDJSON: leave out format=csv")
        # Each line as it is written, as MJPEG and server-sent events: nginx otherwise
        # buffers a proxied answer (proxy_buffering on, its default) until it fills a buffer.
        streamed = {**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(
            _follow(request, jobs, job, path), media_type=NDJSON, headers=streamed
        )
    if output == "ndjson" and job.finished.is_set() and path.is_file():
        return RangedFile(
            path, media_type=NDJSON, headers=headers, gone=f"no job {job_id!r}: deleted meanwhile"
        )

    def as_csv() -> str:
        columns, rows = (
            (FRAME_COLUMNS, _frame_rows) if name == FRAMES_FILE else (EVENT_COLUMNS, _event_rows)
        )
        lines = _whole_lines(path, 0).splitlines()  # a running job: those written
        return csv_text(columns, (row for raw in lines for row in rows(json.loads(raw))))

    if output == "csv":
        headers["Content-Disposition"] = f'attachment; filename="{job.id}-{name[:-7]}.csv"'
        return Response(await asyncio.to_thread(as_csv), media_type="text/csv", headers=headers)
    lines = await asyncio.to_thread(_whole_lines, path, 0)
    return Response(lines, media_type=NDJSON, headers=headers)


@router.get("/jobs/{job_id}/frames", response_class=Response)
async def job_frames(
    request: Request, job_id: str, output: Output = "ndjson", follow: Follow = False
) -> Response:
    """Every processed frame, a JSON line each: ``frame`` (its number in the video, from 0),
    ``pts`` (seconds), ``width``, ``height``, ``detections`` (with ``track_id`` and
    ``zones`` as the stream's WebSocket sends them) and ``events``; while the job runs, the
    frames so far (``X-Job-State``), or with ``follow=true`` each frame as it is done.
    ``format=csv``: a row per detection."""
    return await _results(request, job_id, FRAMES_FILE, output, follow)


@router.get("/jobs/{job_id}/events", response_class=Response)
async def job_events(
    request: Request, job_id: str, output: Output = "ndjson", follow: Follow = False
) -> Response:
    """The job's events (line crossings, zone entries, exits and loiters), a JSON line each,
    as ``GET /events`` gives a stream's, with the ``pts`` of their frame; ``follow=true``
    streams them as they happen. ``format=csv``: a row each."""
    return await _results(request, job_id, EVENTS_FILE, output, follow)


JOB_COUNT_KEYS = tuple(key for key in COUNT_KEYS if key not in ("stream_id", "label"))


@router.get("/jobs/{job_id}/counts", response_model=None)
async def job_counts(
    request: Request,
    job_id: str,
    interval_s: Annotated[
        float | None,
        Query(
            ge=0.1, le=MAX_INTERVAL_S, description="seconds of video a row covers; absent: totals"
        ),
    ] = None,
    by: Annotated[
        str, Query(description=f"comma-separated members, of {', '.join(JOB_COUNT_KEYS)}")
    ] = "type,class_name",
    output: Annotated[
        Literal["json", "csv"], Query(alias="format", description="json or csv")
    ] = "json",
) -> dict[str, Any] | Response:
    """The job's events counted per combination of ``by`` and per ``interval_s`` of video
    (rows from 0 s of the video): people in and out each minute of the footage."""
    state = get_state(request)
    job = _job(state, job_id)
    members = count_members(by, JOB_COUNT_KEYS)
    path = _jobs(state).directory_of(job.id) / EVENTS_FILE

    def count() -> list[dict[str, Any]]:
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            lines = []
        # Timed by the video's own clock: captured_at is the event's pts here.
        timed = ({**event, "captured_at": event["pts"]} for event in map(json.loads, lines))
        return count_events(timed, members, interval_s)

    rows = await asyncio.to_thread(count)
    return counts_answer(rows, members, interval_s, output, {"state": str(job.state)})


# HEAD too: players and download tools ask a video's length and type first (it was 405).
@router.head("/jobs/{job_id}/video.mp4", include_in_schema=False)
@router.get(
    "/jobs/{job_id}/video.mp4",
    response_class=FileResponse,
    responses={200: {"content": {"video/mp4": {}}}},
)
async def job_video(request: Request, job_id: str) -> FileResponse:
    """The processed frames drawn, as an MP4 (jobs with ``render``), once the job has ended;
    range requests served."""
    state = get_state(request)
    job = _job(state, job_id)
    if not job.render:
        raise HTTPException(404, f'job {job_id!r} draws no video: give it "render": true')
    if not job.finished.is_set():
        raise HTTPException(
            409,
            f"job {job_id!r} is {job.state}: its video is ready once it ends"
            f" (GET /jobs/{job_id}?wait_s=60)",
        )
    path = _jobs(state).directory_of(job.id) / VIDEO_FILE
    if not await asyncio.to_thread(path.is_file):
        raise HTTPException(404, f"job {job_id!r} ended ({job.state}) before any frame was drawn")
    return RangedFile(
        path,
        media_type="video/mp4",
        headers={"X-Job-State": str(job.state)},
        gone=f"no job {job_id!r}: deleted meanwhile",
    )


@router.delete("/jobs/{job_id}", status_code=204)
async def delete_job(request: Request, job_id: str) -> Response:
    """Cancel a job that waits or runs, and delete it with its video and results."""
    state = get_state(request)
    if not await _jobs(state).delete(job_id):
        raise HTTPException(404, f"no job {job_id[:64]!r}")
    return Response(status_code=204)
