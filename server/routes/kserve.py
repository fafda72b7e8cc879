"""The KServe v2 / Open Inference Protocol over HTTP (``/v2/...``), as Triton Inference Server
and KServe speak it, so Triton's own clients (``tritonclient.http``) and any other v2 client
detect with streamdet unchanged: server and model metadata, health, readiness, and ``infer``
with the binary tensor data extension.

The served model takes one of two inputs: ``image_bytes`` (BYTES ``[N]``: encoded JPEG, PNG or
WebP images, as Triton ensembles that decode on the server take them) or ``images`` (UINT8
``[N, H, W, 3]``: RGB pixels). It answers as TensorRT's EfficientNMS plugin does, the outputs
Triton users of YOLO read: ``num_detections`` (INT32 ``[N, 1]``), ``detection_boxes`` (FP32
``[N, K, 4]``, ``x1, y1, x2, y2`` in the image's pixels), ``detection_scores`` (FP32 ``[N, K]``)
and ``detection_classes`` (INT32 ``[N, K]``), ``K`` the most detections of any image in the
request (the others padded with zeros). The request's ``parameters`` take ``/detect``'s
``conf``, ``iou``, ``classes`` and ``max_det``.

Each image runs through the same admission control, interactive lane and deadline as a
``POST /detect`` call. Errors answer ``{"error": "..."}``, the protocol's form.
"""

from __future__ import annotations

import asyncio
import json
import time
import zlib
from typing import Any

import numpy as np
import numpy.typing as npt
from fastapi import APIRouter, HTTPException, Request, Response

from server.admission import AdmissionTicket
from server.routes.bodies import load_json
from server.routes.detect import (
    megabytes,
    read_body_capped,
)
from server.routes.paths import V2_PREFIX
from server.routes.v2_model import (
    EXTENSIONS,
    NP_TYPES,
    OUTPUTS,
    VERSION,
    check_model,
    infer_stats,
    model_config_json,
    model_metadata_json,
    refuse,
    repository_index_json,
    statistics_json,
)
from server.routes.v2_tensors import output_tensors, run_infer
from server.state import get_state

router = APIRouter(prefix=V2_PREFIX, tags=["KServe v2"])
HEADER_LENGTH = "Inference-Header-Content-Length"


@router.get("")
async def server_metadata(request: Request) -> dict[str, Any]:
    """The server: name, version and the protocol extensions it speaks."""
    return {
        "name": "streamdet",
        "version": request.app.version,
        "extensions": EXTENSIONS,
    }


@router.get("/health/live")
@router.head("/health/live", include_in_schema=False)
async def live() -> Response:
    return Response(status_code=200)


@router.get("/health/ready")
@router.head("/health/ready", include_in_schema=False)
async def ready(request: Request) -> Response:
    state = get_state(request)
    return Response(status_code=200 if state.ready else 503)


@router.get("/models/stats")
async def all_statistics(request: Request) -> dict[str, Any]:
    """Triton's inference statistics of every model: the one served (before
    ``/models/{model_name}``, which took ``stats`` for a model's name)."""
    return statistics_json(request.app, get_state(request), "", None)


@router.get("/models/{model_name}/stats")
@router.get("/models/{model_name}/versions/{version}/stats")
async def model_statistics(
    request: Request, model_name: str, version: str | None = None
) -> dict[str, Any]:
    """Triton's inference statistics of the model."""
    return statistics_json(request.app, get_state(request), model_name, version)


INDEX_BODY = {
    "requestBody": {
        "required": False,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "properties": {"ready": {"type": "boolean", "default": False}},
                }
            }
        },
    }
}


@router.post("/repository/index", openapi_extra=INDEX_BODY)
async def repository_index(request: Request) -> list[dict[str, str]]:
    """Triton's model repository index: the one model served (``{"ready": true}``: only
    if it is ready)."""
    body = await request.body()
    try:
        asked = load_json(body) if body.strip() else {}
    except ValueError as exc:
        raise HTTPException(400, f"body: {exc}") from None
    if not isinstance(asked, dict) or not isinstance(asked.get("ready", False), bool):
        raise HTTPException(400, 'body: {"ready": true|false} or nothing')
    return repository_index_json(get_state(request), ready_only=asked.get("ready", False))


@router.post("/repository/models/{model_name}/load", include_in_schema=False)
@router.post("/repository/models/{model_name}/unload", include_in_schema=False)
async def repository_load(model_name: str) -> Response:
    raise refuse("load")


SHM_PATHS = [
    f"/{kind}sharedmemory{path}"
    for kind in ("system", "cuda")
    for path in (
        "/status",
        "/unregister",
        "/region/{name}/status",
        "/region/{name}/register",
        "/region/{name}/unregister",
    )
]


async def shared_memory() -> Response:
    raise refuse("shared memory")


async def trace_settings() -> Response:
    raise refuse("trace")


async def log_settings() -> Response:
    raise refuse("log")


for _path in SHM_PATHS:
    router.add_api_route(_path, shared_memory, methods=["GET", "POST"], include_in_schema=False)
for _path in ("/trace/setting", "/models/{model_name}/trace/setting"):
    router.add_api_route(_path, trace_settings, methods=["GET", "POST"], include_in_schema=False)
router.add_api_route("/logging", log_settings, methods=["GET", "POST"], include_in_schema=False)


@router.get("/models/{model_name}")
@router.get("/models/{model_name}/versions/{version}")
async def model_metadata(
    request: Request, model_name: str, version: str | None = None
) -> dict[str, Any]:
    """The model: its versions, platform, inputs (give one of them) and outputs."""
    state = get_state(request)
    check_model(state, model_name, version)
    return model_metadata_json(state, model_name)


@router.get("/models/{model_name}/config")
@router.get("/models/{model_name}/versions/{version}/config")
async def model_config(
    request: Request, model_name: str, version: str | None = None
) -> dict[str, Any]:
    """Triton's model configuration, as far as it applies: the largest batch an engine runs,
    dynamic batching's wait, and the class names."""
    state = get_state(request)
    check_model(state, model_name, version)
    return model_config_json(state, model_name)


@router.get("/models/{model_name}/ready")
@router.get("/models/{model_name}/versions/{version}/ready")
async def model_ready(request: Request, model_name: str, version: str | None = None) -> Response:
    """200 once the model is ready, 503 before; 400 for a model or version this server does
    not have, as Triton answers (its "not ready" for what it does not have: it was 404)."""
    state = get_state(request)
    try:
        check_model(state, model_name, version)
    except HTTPException as exc:
        raise HTTPException(400, f"{exc.detail}: not ready") from None
    return Response(status_code=200 if state.ready else 503)


# ---------------------------------------------------------------------------- infer


ENCODINGS = {"gzip": 31, "x-gzip": 31, "deflate": 15}
"""Request Content-Encodings (tritonclient's ``request_compression_algorithm``) as zlib's
window bits; deflate is zlib's format (what tritonclient sends), raw deflate also taken."""


def _inflated(body: bytes, encoding: str | None, limit: int) -> bytes:
    """The request's body, inflated if it came compressed, to at most ``limit`` bytes (a few
    kB of zeros inflate to gigabytes)."""
    name = (encoding or "").strip().lower()
    if name in ("", "identity"):
        return body
    bits = ENCODINGS.get(name)
    if bits is None:
        raise HTTPException(
            415,
            f"Content-Encoding {encoding!r} is not taken: send gzip, deflate or none"
            " (tritonclient's request_compression_algorithm)",
        )
    problem: zlib.error | None = None
    for window in (bits, -15) if name == "deflate" else (bits,):
        inflater = zlib.decompressobj(window)
        try:
            out = inflater.decompress(body, limit + 1)
        except zlib.error as exc:
            problem = exc
            continue
        if len(out) > limit:
            raise HTTPException(
                413,
                f"the {name}-compressed request inflates past {megabytes(limit)} MB"
                " (setting STREAMDET_MAX_UPLOAD_MB)",
            )
        if not inflater.eof:
            raise HTTPException(400, f"the {name}-compressed request body is cut short")
        return out
    raise HTTPException(400, f"the request body is not {name}-compressed data: {problem}")


def _split(body: bytes, header: str | None) -> tuple[dict[str, Any], bytes]:
    """The request's JSON and the binary data after it."""
    size = len(body)
    if header is not None:
        if not (header.isascii() and header.isdigit() and len(header) <= 18) or int(header) > size:
            raise HTTPException(
                400,
                f"{HEADER_LENGTH}: {header[:40]!r} is not a length within the {size}-byte body",
            )
        size = int(header)
    try:
        request = load_json(body[:size])
    except ValueError as exc:
        raise HTTPException(400, f"the inference request's body: {exc}") from None
    if not isinstance(request, dict):
        raise HTTPException(400, "the inference request must be a JSON object")
    return request, body[size:]


def _parsed(
    body: bytes, encoding: str | None, header: str | None, limit: int
) -> tuple[dict[str, Any], bytes]:
    """The request's JSON and binary data, from its body as sent."""
    return _split(_inflated(body, encoding, limit), header)


def _response(
    request: dict[str, Any],
    model: str,
    outputs: dict[str, npt.NDArray[Any]],
    chosen: list[tuple[str, bool]],
) -> Response:
    described: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for name, binary in chosen:
        array = outputs[name]
        datatype: str = next(o["datatype"] for o in OUTPUTS if o["name"] == name)
        entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
        if binary:
            blob = np.ascontiguousarray(array, NP_TYPES[datatype]).tobytes()
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            entry["data"] = array.reshape(-1).tolist()
        described.append(entry)
    answer: dict[str, Any] = {"model_name": model, "model_version": VERSION, "outputs": described}
    if isinstance(request.get("id"), str):
        answer["id"] = request["id"]
    header = json.dumps(answer, separators=(",", ":")).encode()
    if not blobs:
        return Response(header, media_type="application/json")
    return Response(
        header + b"".join(blobs),
        media_type="application/octet-stream",
        headers={HEADER_LENGTH: str(len(header))},
    )


INFER_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "required": ["inputs"],
                    "description": "KServe v2 inference request: one input, image_bytes"
                    " (BYTES [N], encoded images) or images (UINT8 [N, H, W, 3]); parameters"
                    " conf, iou, classes, max_det",
                    "properties": {
                        "id": {"type": "string"},
                        "parameters": {"type": "object"},
                        "inputs": {"type": "array", "items": {"type": "object"}},
                        "outputs": {"type": "array", "items": {"type": "object"}},
                    },
                }
            },
            "application/octet-stream": {
                "schema": {"type": "string", "format": "binary"},
                "description": "binary tensor data: the JSON request (its length in the"
                " Inference-Header-Content-Length header), then the tensors' bytes",
            },
        },
    }
}


@router.post("/models/{model_name}/infer", openapi_extra=INFER_BODY)
@router.post("/models/{model_name}/versions/{version}/infer", openapi_extra=INFER_BODY)
async def infer(
    request: Request, ticket: AdmissionTicket, model_name: str, version: str | None = None
) -> Response:
    """Detect objects in a batch of images (see the module's description)."""
    state = get_state(request)
    check_model(state, model_name, version)
    stats, started_ns = infer_stats(request.app), time.monotonic_ns()
    try:
        limit = state.settings.max_upload_bytes
        body = await read_body_capped(request, limit)
        ticket.body_read()  # decoding now: ahead of calls that arrive after this
        # Inflated and parsed in a decode thread: 20 MB of JSON (20 kB gzipped) held the event
        # loop, every stream's viewers and /healthz for about a second a call.
        inference, binary = await asyncio.get_running_loop().run_in_executor(
            state.decode_executor,
            _parsed,
            body,
            request.headers.get("content-encoding"),
            request.headers.get(HEADER_LENGTH),
            limit,
        )
        results, found, chosen = await run_infer(state, ticket, inference, binary, request)
    except Exception:
        stats.failed(started_ns)
        raise
    stats.succeeded(started_ns, results)
    return _response(inference, model_name, output_tensors(found), chosen)
