"""``POST /detect``: one image in, its detections out (DESIGN §4)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from typing import Annotated, Any, Literal, ParamSpec, TypeVar

from fastapi import APIRouter, HTTPException, Query, Request, Response
from starlette.datastructures import UploadFile

from engines.batching import DeadlineExceeded, PoolClosed, QueueFull, WorkResult
from engines.types import DetectParams, Image, class_ids
from server.admission import AdmissionTicket, Ticket
from server.images import IMAGE_CONTENT_TYPES, ImageError, decode_upload
from server.metrics import get_metrics
from server.render import render_jpeg
from server.routes.longpoll import disconnected
from server.routes.query import check_query
from server.state import AppState, get_state

log = logging.getLogger(__name__)
router = APIRouter()
JPEG_QUALITY = 90  # format=jpeg: the picture as sent, boxes drawn


def parse_classes(
    raw: str | Sequence[str | int] | None, names: Mapping[int, str]
) -> frozenset[int] | None:
    """``"0,car,5"`` (or a list of ids and names) to class ids, None (every class) for None or a
    blank string (``","`` too: it dropped every detection); raises HTTP 422 naming the unknown
    entry, or for a list of none (``[]`` kept nothing: a whole video's job found nothing)."""
    if raw is None or (isinstance(raw, str) and not raw.replace(",", "").strip()):
        return None
    try:
        ids = class_ids(raw.split(",") if isinstance(raw, str) else raw, names)
    except ValueError as exc:
        raise HTTPException(422, str(exc)) from None
    if not ids:
        raise HTTPException(422, "classes: give at least one class, or null for every")
    return ids


async def capped_stream(
    request: Request, limit: int, too_large: str
) -> AsyncGenerator[bytes, None]:
    """The request body's chunks, refused with 413 ``too_large`` once they pass ``limit``
    bytes (at once where the declared length does)."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise HTTPException(413, too_large)
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HTTPException(413, too_large)
        yield chunk


def megabytes(limit: int) -> str:
    """``limit`` bytes as the setting gave them in MB (``0.1``, ``3.5``: not ``0.0999994`` or,
    rounded whole, ``4``)."""
    return f"{round(limit / 2**20, 3):g}"


P = ParamSpec("P")
R = TypeVar("R")


def timed(function: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> tuple[R, float]:
    """``function(*args)`` and the seconds it took (in the thread that ran it)."""
    started = time.monotonic()
    result = function(*args, **kwargs)
    return result, time.monotonic() - started


async def read_body_capped(request: Request, limit: int) -> bytes:
    """Read the request body, refusing (413) once it passes ``limit`` bytes."""
    too_large = f"upload larger than {megabytes(limit)} MB (setting STREAMDET_MAX_UPLOAD_MB)"
    body = b"".join([chunk async for chunk in capped_stream(request, limit, too_large)])
    request._body = body  # lets request.form() parse what we already read
    return body


async def read_image_bytes(request: Request, limit: int) -> bytes:
    """The image bytes of a multipart field ``image`` or a raw image body."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    body = await read_body_capped(request, limit)
    if ctype == "multipart/form-data":
        form = await request.form()
        try:
            fields = form.getlist("image")
            if len(fields) > 1:  # one was answered for, the others dropped
                raise HTTPException(
                    422, f"multipart form has {len(fields)} fields 'image'; send one a call"
                )
            field = fields[0] if fields else None
            if field is None:
                got = ", ".join(sorted(form.keys())) or "none"
                raise HTTPException(422, f"multipart form needs a file field 'image' (got: {got})")
            if not isinstance(field, UploadFile):
                raise HTTPException(
                    422,
                    "multipart field 'image' came as a text value: send it as a file part, with"
                    ' a filename in its Content-Disposition (curl -F "image=@photo.jpg")',
                )
            others = sorted(set(form.keys()) - {"image"})
            if others:  # options as form fields (Ultralytics HUB's way) were dropped unread
                raise HTTPException(
                    422,
                    f"multipart field {others[0]!r}: send only the file field 'image'; options"
                    " go in the query string (/detect?conf=0.5&classes=person)",
                )
            return await field.read()
        finally:
            await form.close()
    if ctype and ctype not in IMAGE_CONTENT_TYPES and not ctype.startswith("image/"):
        raise HTTPException(
            415,
            f"Content-Type {ctype!r} is not an image; send image/jpeg, image/png or image/webp,"
            " or multipart/form-data with a file field 'image'",
        )
    return body


def check_queue_room(state: AppState, images: int) -> None:
    """HTTP 413 for a call of more images than may ever wait at once (queued all or none,
    it could only be refused 429, on every retry)."""
    most = state.pool.queue.max_interactive
    if images > most:
        raise HTTPException(
            413,
            f"{images} images in one call; at most {most} may wait at once"
            " (setting STREAMDET_MAX_QUEUE)",
        )


async def run_admitted(
    state: AppState,
    ticket: Ticket,
    images: Sequence[Image],
    params: DetectParams,
    request: Request | None = None,
) -> list[WorkResult]:
    """Run ``images`` as interactive calls under ``ticket``'s deadline, each with detections,
    queued all or none; raises the HTTP error ``/detect`` answers otherwise: 413 (more images
    than may ever wait), 429 (queue full), 503 (shutting down, or not served within the
    deadline), 500 (the engine failed). With ``request``, a client that goes away takes its
    images back from the queue (they ran for nobody)."""
    rid = ticket.request_id
    try:
        check_queue_room(state, len(images))
    except HTTPException:
        ticket.abandon()
        raise
    work = asyncio.ensure_future(state.pool.detect_many(images, params, ticket.hard_deadline, rid))
    try:
        if request is not None:
            gone = asyncio.ensure_future(disconnected(request))
            try:
                await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
            if not work.done():  # the client went away: its images come back out
                await _take_back(work)
                ticket.abandon()
                log.info("request %s: the client went away before its answer", rid)
                raise HTTPException(499, "the client closed the connection")
        results = await work
    except asyncio.CancelledError as exc:
        await _take_back(work)  # whoever cancelled, its images would run for nobody
        if request is None or not cancelled_by_shutdown(request, exc):
            # Its caller cancelled it: a gRPC call cancelled or past its deadline, an outer
            # timeout, a middleware. Not a refusal, and no calibration from a call that did
            # not run (it was calibrated as if it had; over HTTP it was the shutdown's 503).
            ticket.abandon()
            log.info("request %s: cancelled while queued, its images taken back", rid)
            raise
        # The server cancels the calls still open when its graceful shutdown runs out
        # (uvicorn, STREAMDET_SHUTDOWN_TIMEOUT_S): the images come back out and the call
        # is refused as shutting down (it was uvicorn's bare 500 with a traceback a call,
        # and its images ran on for nobody).
        ticket.reject("shutting_down")
        if (task := asyncio.current_task()) is not None:
            task.uncancel()  # answered instead: the cancellation is handled
        log.info("request %s: cancelled by the server's shutdown while queued", rid)
        raise HTTPException(
            503,
            "server shutting down: the call was not served within the graceful"
            " shutdown (setting STREAMDET_SHUTDOWN_TIMEOUT_S)",
            headers={"Retry-After": "5"},
        ) from None
    except QueueFull as exc:
        ticket.reject("queue_full")
        raise HTTPException(429, f"server busy: {exc}", headers=ticket.retry_after()) from None
    except PoolClosed:
        ticket.reject("shutting_down")
        raise HTTPException(503, "server shutting down", headers={"Retry-After": "5"}) from None
    for result in results:
        if isinstance(result.error, DeadlineExceeded):
            ticket.reject("expired")
            raise HTTPException(
                503,
                f"request not served within {(ticket.hard_deadline - ticket.arrived) * 1000:.0f}"
                f" ms ({result.error}; {ticket.hard_source})",
                headers=ticket.retry_after(),
            )
        if result.error is not None or result.detections is None:
            raise HTTPException(500, f"inference failed for request {rid}: {result.error}")
    # Admission calibrates on the worker's own figures (queued, then its batch).
    alone = len(results) == 1 and results[0].batch_size == 1
    ticket.served(
        max(r.queue_ms + r.inference_ms for r in results) / 1000.0,
        results[0].inference_ms / 1000.0 if alone else None,
    )
    return results


UVICORN_SHUTDOWN_CANCEL = "Task cancelled, timeout graceful shutdown exceeded"
"""The message uvicorn cancels the calls still open with once its graceful shutdown runs out."""


def cancelled_by_shutdown(request: Request, exc: asyncio.CancelledError) -> bool:
    """Whether ``exc`` is the server's shutdown cancelling the call: uvicorn's message, or a
    cancellation once the server is exiting (``streamdet serve`` notes its exit signal in
    ``app.state.exiting``) or shutting down. Any other is its caller's."""
    if exc.args and exc.args[0] == UVICORN_SHUTDOWN_CANCEL:
        return True
    state = get_state(request)
    return bool(getattr(request.app.state, "exiting", False) or state.shutting_down)


async def _take_back(work: asyncio.Future[list[WorkResult]]) -> None:
    """Cancel the pool's call ``work``: what of it still waits in the queue comes back out."""
    work.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await work


IMAGE_BODY = {"schema": {"type": "string", "format": "binary"}}


@router.post(
    "/detect",
    response_model=None,
    responses={200: {"content": {"application/json": {}, "image/jpeg": {}}}},
    # The body is read by hand (streamed under its size limit): declared here, so a client
    # made from the schema can call the main route (it had no body at all).
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "multipart/form-data": {
                    "schema": {
                        "type": "object",
                        "required": ["image"],
                        "properties": {"image": {"type": "string", "format": "binary"}},
                    }
                },
                "image/jpeg": IMAGE_BODY,
                "image/png": IMAGE_BODY,
                "image/webp": IMAGE_BODY,
            },
        }
    },
)
async def detect(
    request: Request,
    ticket: AdmissionTicket,
    *,
    conf: Annotated[float, Query(ge=0.0, le=1.0, description="minimum confidence")] = 0.25,
    iou: Annotated[float, Query(ge=0.0, le=1.0, description="NMS IoU threshold")] = 0.7,
    # A list: ``classes=0&classes=car`` (what requests and httpx send for a list) is both
    # (the last alone was kept, silently), as ``classes=0,car`` is.
    classes: Annotated[
        list[str] | None,
        Query(description="class ids or names: comma list, or the parameter repeated"),
    ] = None,
    max_det: Annotated[int, Query(ge=1, le=1000, description="most detections")] = 300,
    output: Annotated[
        Literal["json", "jpeg"],
        Query(alias="format", description="json, or jpeg: the image with its boxes drawn"),
    ] = "json",
) -> dict[str, Any] | Response:
    check_query(request, lists=("classes",))  # a list: classes=0&classes=car
    arrived = ticket.arrived
    state = get_state(request)
    request_id = ticket.request_id
    settings = state.settings  # readiness was checked by the admission dependency
    engine = state.pool.engine
    params = DetectParams(
        conf=conf,
        iou=iou,
        classes=parse_classes(None if classes is None else ",".join(classes), engine.names),
        max_det=max_det,
    )
    pre_start = time.monotonic()
    data = await read_image_bytes(request, settings.max_upload_bytes)
    ticket.body_read()  # decoding now: ahead of calls that arrive after this
    loop = asyncio.get_running_loop()
    # A large JPEG is decoded smaller by libjpeg where only detections are wanted (the engine
    # shrinks it to its input size anyway); drawn, it keeps its own size.
    max_side = engine.input_size if output == "json" else 0
    try:
        (image, source), decode_s = await loop.run_in_executor(
            state.decode_executor, timed, decode_upload, data, settings.max_image_pixels, max_side
        )
    except ImageError as exc:
        log.info("request %s: rejected image: %s", request_id, exc.message)
        raise HTTPException(exc.status_code, exc.message) from None
    decoded_at = time.monotonic()
    preprocess_s = decoded_at - pre_start
    # The decode alone: the upload's time is the client's link, and the wait for a decode
    # thread is the load's, not the work of one call (one slow upload took the decode
    # estimate to seconds, refusing client deadlines for good).
    ticket.decoded(decode_s, pixels=image.shape[0] * image.shape[1])  # checked again: 429
    (result,) = await run_admitted(state, ticket, [image], params, request)
    assert result.detections is not None  # run_admitted answered every error
    det = result.detections.rescaled(*source)  # in the image's own pixels
    post_start = time.monotonic()
    answer: dict[str, Any] | Response
    if output == "jpeg":  # drawn at the image's own size, off the event loop
        jpeg, _, _ = await loop.run_in_executor(
            state.decode_executor,
            functools.partial(render_jpeg, image, det.width, JPEG_QUALITY, detections=det),
        )
        answer = Response(
            jpeg,
            media_type="image/jpeg",
            headers={
                "X-Detections": str(len(det)),
                "X-Inference-Ms": f"{result.inference_ms:.2f}",
                "X-Request-Id": request_id,
            },
        )
        done = time.monotonic()
    else:
        answer = {
            "detections": det.to_json(),
            "image": {"width": det.width, "height": det.height},
            "model": engine.model_name,
        }
        done = time.monotonic()
        answer["timing_ms"] = {
            "queue": round(result.queue_ms, 2),
            "inference": round(result.inference_ms, 2),
            "total": round((done - arrived) * 1000, 2),
        }
    get_metrics(request).observe_stages(
        {
            "queue": result.queue_ms / 1000,
            "preprocess": preprocess_s,
            "inference": result.inference_ms / 1000,
            "postprocess": done - post_start,
            "total": done - arrived,
        }
    )
    return answer
