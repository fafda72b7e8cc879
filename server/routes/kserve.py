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
import math
import struct
import time
import zlib
from collections.abc import Mapping, Sequence
from pathlib import PurePath
from typing import Any

import numpy as np
import numpy.typing as npt
from fastapi import APIRouter, HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from engines.batching import WorkResult
from engines.types import Detections, DetectParams, Image
from server.admission import AdmissionTicket
from server.images import ImageError, decode_upload, decoded_pixels
from server.routes.bodies import FASTAPI_PARSE_ERROR, UNREADABLE, load_json, why_unreadable
from server.routes.detect import (
    check_queue_room,
    megabytes,
    parse_classes,
    read_body_capped,
    run_admitted,
)
from server.state import AppState, get_state

router = APIRouter(prefix="/v2", tags=["KServe v2"])
PREFIX = "/v2"
VERSION = "1"
HEADER_LENGTH = "Inference-Header-Content-Length"
MAX_IMAGES = 256  # images in one request
CALL_PIXELS = 2
"""A call's images together decode to at most this many times ``max_image_pixels``."""
NP_TYPES: dict[str, npt.DTypeLike] = {
    "UINT8": np.uint8,
    "INT32": np.int32,
    "FP32": np.float32,
}
INPUTS: list[dict[str, Any]] = [
    {"name": "image_bytes", "datatype": "BYTES", "shape": [-1]},
    {"name": "images", "datatype": "UINT8", "shape": [-1, -1, -1, 3]},
]
OUTPUTS: list[dict[str, Any]] = [
    {"name": "num_detections", "datatype": "INT32", "shape": [-1, 1]},
    {"name": "detection_boxes", "datatype": "FP32", "shape": [-1, -1, 4]},
    {"name": "detection_scores", "datatype": "FP32", "shape": [-1, -1]},
    {"name": "detection_classes", "datatype": "INT32", "shape": [-1, -1]},
]


def is_v2(request: Request) -> bool:
    path: str = request.url.path
    return path == PREFIX or path.startswith(PREFIX + "/")


async def v2_http_error(request: Request, exc: Exception) -> Response:
    """The app's HTTP errors under ``/v2``: ``{"error": "..."}`` as the protocol (and
    tritonclient) expects; elsewhere FastAPI's own."""
    from fastapi.encoders import jsonable_encoder
    from fastapi.exception_handlers import http_exception_handler

    if isinstance(exc, RequestValidationError):
        if not is_v2(request):
            # FastAPI's own answer, less its failure on a non-finite number or a lone
            # surrogate it echoes (``{"conf": NaN}`` was refused, then could not be written
            # back: a 500), and with each refused value cut short (it was echoed whole).
            errors = [
                {**e, "input": _clipped(e["input"])} if "input" in e else e for e in exc.errors()
            ]
            detail = _json_safe(jsonable_encoder(errors))
            return JSONResponse({"detail": detail}, status_code=422)
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'][1:])}: {e['msg']}" for e in exc.errors()
        )
        return JSONResponse({"error": _json_safe(problems)}, status_code=422)
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 405:
        exc.headers = {**(exc.headers or {}), "Allow": allowed_methods(request)}
    cause = exc.__cause__
    if exc.detail == FASTAPI_PARSE_ERROR and isinstance(cause, UNREADABLE):
        # FastAPI's 400 for a model's body json.loads raised other than JSONDecodeError on
        # (not UTF-8, nested too deep, a 5,000-digit integer): named as its own JSON errors are.
        problem = {"type": "json_invalid", "loc": ["body"], "msg": why_unreadable(cause)}
        if is_v2(request):
            return JSONResponse({"error": f"body: {problem['msg']}"}, status_code=400)
        return JSONResponse({"detail": [problem]}, status_code=422)
    if not is_v2(request):
        return await http_exception_handler(request, exc)
    detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
    return JSONResponse({"error": detail}, status_code=exc.status_code, headers=exc.headers)


HTTP_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")


def allowed_methods(request: Request) -> str:
    """Every method the request's path answers, for a 405's ``Allow``: Starlette's names only
    those of the first route of the path (``GET /streams`` and ``POST /streams`` are two), so
    ``Allow: POST`` left ``GET`` out (RFC 9110 asks for all of them)."""
    methods = []
    for method in HTTP_METHODS:
        scope = {**request.scope, "method": method}
        if "fastapi" in scope:  # FastAPI's routers note their matching there
            scope["fastapi"] = dict(scope["fastapi"])
        if any(route.matches(scope)[0] == Match.FULL for route in request.app.router.routes):
            methods.append(method)
    return ", ".join(methods)


ECHO_CHARS = 200
ECHO_ITEMS = 20


def _clipped(value: Any, depth: int = 0) -> Any:
    """A refused value as a 422 echoes it: a string cut to its first ``ECHO_CHARS``
    characters, a list or object of more than ``ECHO_ITEMS`` items (or nested deeper than 4)
    named by its size. FastAPI echoed each whole: a 20 MB ``url`` came back as 20 MB."""
    if isinstance(value, str) and len(value) > ECHO_CHARS:
        return f"{value[:ECHO_CHARS]}... ({len(value)} characters)"
    if isinstance(value, list | tuple | dict):
        if len(value) > ECHO_ITEMS or (value and depth >= 4):
            kind = "an object" if isinstance(value, dict) else "a list"
            return f"({kind} of {len(value)} items)"
        if isinstance(value, dict):
            return {_clipped(k): _clipped(v, depth + 1) for k, v in value.items()}
        return [_clipped(v, depth + 1) for v in value]
    return value


def _json_safe(value: Any) -> Any:
    """``value`` with every NaN or infinity (JSON has neither) as its text: ``"nan"``, and
    every lone surrogate (``"\\ud800"`` in a body's JSON: no UTF-8 can carry it, and echoing
    it back was a 500) as its escape."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return value.encode("utf-8", "backslashreplace").decode()
        return value
    if isinstance(value, dict):
        return {_json_safe(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def _model_name(state: AppState) -> str:
    """The served model's name without its file's suffix (``yolov8n``)."""
    return PurePath(state.pool.engine.model_name).stem


def _check_model(state: AppState, name: str, version: str | None) -> None:
    served = _model_name(state)
    if name not in {served, state.pool.engine.model_name}:
        raise HTTPException(404, f"unknown model {name!r}; this server serves {served!r}")
    if version not in (None, "", VERSION):
        raise HTTPException(404, f"model {name!r} has no version {version!r}; it has {VERSION!r}")


EXTENSIONS = [
    "binary_tensor_data",
    "parameters",
    "model_configuration",
    "statistics",
]
"""The protocol extensions served (Triton's names). The repository's index is answered too,
but not its loads (so not ``model_repository``)."""


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


class InferStats:
    """Triton's statistics of the model (``get_inference_statistics``), as the v2 calls over
    HTTP and gRPC add to them: ``success`` and ``fail`` count calls and their whole time,
    ``queue`` and ``compute_infer`` each image's wait and its batch's inference,
    ``inference_count`` the images, ``execution_count`` the batches they ran in."""

    KINDS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")

    def __init__(self) -> None:
        self.last_ms = 0
        self.images = 0
        self.times: dict[str, list[int]] = {kind: [0, 0] for kind in (*self.KINDS, "cache_hit")}
        self.times["cache_miss"] = [0, 0]
        self.batches: dict[int, list[float]] = {}  # size: [executions, inference ns]

    def _add(self, kind: str, ns: float, count: int = 1) -> None:
        self.times[kind][0] += count
        self.times[kind][1] += int(ns)

    def failed(self, started_ns: int) -> None:
        self._add("fail", time.monotonic_ns() - started_ns)

    def succeeded(self, started_ns: int, results: Sequence[WorkResult]) -> None:
        self._add("success", time.monotonic_ns() - started_ns)
        self.last_ms = time.time_ns() // 1_000_000
        self.images += len(results)
        for result in results:
            self._add("queue", result.queue_ms * 1e6)
            self._add("compute_infer", result.inference_ms * 1e6)
            # Each image of a batch of n is one n-th of its execution.
            size = max(result.batch_size, 1)
            batch = self.batches.setdefault(size, [0.0, 0.0])
            batch[0] += 1 / size
            batch[1] += result.inference_ms * 1e6 / size

    def json(self, name: str) -> dict[str, Any]:
        """The model's entry of ``model_stats``, as Triton writes it."""

        def duration(count: float, ns: float) -> dict[str, int]:
            return {"count": round(count), "ns": int(ns)}

        return {
            "name": name,
            "version": VERSION,
            "last_inference": self.last_ms,
            "inference_count": self.images,
            "execution_count": round(sum(b[0] for b in self.batches.values())),
            "inference_stats": {kind: duration(*t) for kind, t in self.times.items()},
            "batch_stats": [
                {
                    "batch_size": size,
                    "compute_input": duration(count, 0),
                    "compute_infer": duration(count, ns),
                    "compute_output": duration(count, 0),
                }
                for size, (count, ns) in sorted(self.batches.items())
            ],
        }


def infer_stats(app: Any) -> InferStats:
    """The app's :class:`InferStats` (HTTP and gRPC add to the same)."""
    stats: InferStats | None = getattr(app.state, "kserve_stats", None)
    if stats is None:
        stats = app.state.kserve_stats = InferStats()
    return stats


def statistics_json(app: Any, state: AppState, name: str, version: str | None) -> dict[str, Any]:
    """``get_inference_statistics``'s answer: the served model's (``name`` empty: every
    model's, which is the one), or 404."""
    if name:
        _check_model(state, name, version)
    return {"model_stats": [infer_stats(app).json(name or _model_name(state))]}


def repository_index_json(state: AppState) -> list[dict[str, str]]:
    """The model repository's index: the one model, its version and its state."""
    ready = "READY" if state.ready else "LOADING"
    return [{"name": _model_name(state), "version": VERSION, "state": ready, "reason": ""}]


UNSUPPORTED = {
    "shared memory": "shared memory is not supported by streamdet (it may run on another"
    " machine than its clients): send the tensors in the request (set_data_from_numpy),"
    " as binary data",
    "load": "loading and unloading models is not supported: streamdet serves the one model it"
    " started with; restart it with another (setting STREAMDET_MODEL, --model)",
    "trace": "trace settings are not supported by streamdet; see GET /metrics and its logs",
    "log": "log settings are not supported by streamdet over the protocol; restart it with"
    " --log-level (setting STREAMDET_LOG_LEVEL)",
}
"""Why each Triton extension streamdet lacks is refused (501 here, UNIMPLEMENTED over gRPC)."""


def refuse(what: str) -> HTTPException:
    return HTTPException(501, UNSUPPORTED[what])


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


@router.post("/repository/index")
async def repository_index(request: Request) -> list[dict[str, str]]:
    """Triton's model repository index: the one model served."""
    return repository_index_json(get_state(request))


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
    _check_model(state, model_name, version)
    return model_metadata_json(state, model_name)


def model_metadata_json(state: AppState, name: str) -> dict[str, Any]:
    """The model's metadata as the protocol's JSON (the gRPC service parses the same)."""
    return {
        "name": name,
        "versions": [VERSION],
        "platform": f"streamdet_{state.settings.backend}",
        "inputs": INPUTS,
        "outputs": OUTPUTS,
    }


CONFIG_TYPES = {"BYTES": "TYPE_STRING", "UINT8": "TYPE_UINT8", "INT32": "TYPE_INT32"}
CONFIG_TYPES["FP32"] = "TYPE_FP32"
"""Tensor datatypes as Triton's model configuration names them (BYTES is TYPE_STRING)."""


@router.get("/models/{model_name}/config")
@router.get("/models/{model_name}/versions/{version}/config")
async def model_config(
    request: Request, model_name: str, version: str | None = None
) -> dict[str, Any]:
    """Triton's model configuration, as far as it applies: the largest batch an engine runs,
    dynamic batching's wait, and the class names."""
    state = get_state(request)
    _check_model(state, model_name, version)
    return model_config_json(state, model_name)


def model_config_json(state: AppState, name: str) -> dict[str, Any]:
    """Triton's model configuration as JSON (the gRPC service parses the same)."""
    return {
        "name": name,
        "platform": f"streamdet_{state.settings.backend}",
        "max_batch_size": state.pool.max_batch,
        "input": [{"name": i["name"], "data_type": CONFIG_TYPES[i["datatype"]]} for i in INPUTS],
        "output": [{"name": o["name"], "data_type": CONFIG_TYPES[o["datatype"]]} for o in OUTPUTS],
        "dynamic_batching": {
            "max_queue_delay_microseconds": int(state.settings.max_wait_ms * 1000)
        },
        "instance_group": [{"count": state.pool.workers}],
        "parameters": {"names": {"string_value": json.dumps(state.pool.engine.names)}},
    }


@router.get("/models/{model_name}/ready")
@router.get("/models/{model_name}/versions/{version}/ready")
async def model_ready(request: Request, model_name: str, version: str | None = None) -> Response:
    state = get_state(request)
    _check_model(state, model_name, version)
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
        if not (header.isascii() and header.isdigit()) or int(header) > size:
            raise HTTPException(
                400, f"{HEADER_LENGTH}: {header!r} is not a length within the {size}-byte body"
            )
        size = int(header)
    try:
        request = load_json(body[:size])
    except ValueError as exc:
        raise HTTPException(400, f"the inference request's body: {exc}") from None
    if not isinstance(request, dict):
        raise HTTPException(400, "the inference request must be a JSON object")
    return request, body[size:]


def _shape(tensor: Mapping[str, Any], name: str) -> list[int]:
    shape = tensor.get("shape")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise HTTPException(400, f"input {name!r}: shape must be a list of sizes, not {shape!r}")
    return shape


def _raw(tensor: Mapping[str, Any], name: str, binary: bytes) -> bytes:
    """The one input's binary data (binary tensor data extension): the body after the JSON."""
    size = _parameters(tensor, f"input {name!r}").get("binary_data_size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise HTTPException(400, f"input {name!r}: binary_data_size must be a byte count")
    if size > len(binary):
        raise HTTPException(
            400, f"input {name!r}: binary_data_size {size} runs past the end of the body"
        )
    return binary[:size]


def _bytes_elements(raw: bytes, name: str) -> list[bytes]:
    """BYTES elements: each a 4-byte little-endian length and its bytes."""
    items: list[bytes] = []
    at = 0
    while at < len(raw):
        if at + 4 > len(raw):
            raise HTTPException(400, f"input {name!r}: a BYTES element's length is cut off")
        (length,) = struct.unpack_from("<I", raw, at)
        at += 4
        if at + length > len(raw):
            raise HTTPException(400, f"input {name!r}: a BYTES element runs past its data")
        items.append(raw[at : at + length])
        at += length
    return items


async def _images(
    state: AppState, request: dict[str, Any], binary: bytes, loop: asyncio.AbstractEventLoop
) -> list[tuple[Image, tuple[int, int]]]:
    """The request's images, each with its width and height as sent (a large JPEG is decoded
    smaller for the engine: :func:`server.images.decode_upload`)."""
    inputs = request.get("inputs")
    if not isinstance(inputs, list) or len(inputs) != 1 or not isinstance(inputs[0], dict):
        raise HTTPException(
            400,
            "give exactly one input: 'image_bytes' (BYTES, encoded images) or 'images'"
            " (UINT8 [N, H, W, 3], RGB)",
        )
    tensor = inputs[0]
    name, datatype = tensor.get("name"), tensor.get("datatype")
    _no_shared_memory(tensor, f"input {name!r}")
    shape = _shape(tensor, str(name))
    binary_given = "binary_data_size" in _parameters(tensor, f"input {name!r}")
    if name == "image_bytes":
        if datatype != "BYTES" or len(shape) != 1:
            raise HTTPException(400, f"input 'image_bytes': BYTES [N], not {datatype} {shape}")
        if not binary_given:
            raise HTTPException(
                400,
                "input 'image_bytes': send the encoded images as binary data"
                " (tritonclient's binary_data=True)",
            )
        items = _bytes_elements(_raw(tensor, name, binary), name)
        if len(items) != shape[0]:
            raise HTTPException(
                400, f"input 'image_bytes': shape says {shape[0]} images, the data has {len(items)}"
            )
        _check_count(len(items), state)
        decode = state.decode_executor
        limit, side = state.settings.max_image_pixels, state.pool.engine.input_size
        try:
            # From their headers first: a few kB of PNGs decode to gigabytes (24 of 19 MP
            # took 2 GB and 18 s of the decode threads, then the call was refused anyway).
            total = sum(decoded_pixels(item, limit, side) for item in items)
            if total > CALL_PIXELS * limit:
                raise HTTPException(
                    413,
                    f"input 'image_bytes': {len(items)} images of {total / 1e6:.1f} MP"
                    f" together, over a call's {CALL_PIXELS * limit / 1e6:.0f} MP"
                    f" ({CALL_PIXELS} x setting STREAMDET_MAX_IMAGE_PIXELS; large JPEGs count"
                    " at the size they are decoded to)",
                )
            return list(
                await asyncio.gather(
                    *(
                        loop.run_in_executor(decode, decode_upload, item, limit, side)
                        for item in items
                    )
                )
            )
        except ImageError as exc:
            raise HTTPException(exc.status_code, f"input 'image_bytes': {exc.message}") from None
    if name == "images":
        if datatype != "UINT8" or len(shape) != 4 or shape[3] != 3:
            raise HTTPException(400, f"input 'images': UINT8 [N, H, W, 3], not {datatype} {shape}")
        n, height, width = shape[:3]
        _check_count(n, state)
        if height * width > state.settings.max_image_pixels or not height or not width:
            raise HTTPException(
                413 if height * width else 400,
                f"input 'images': {width}x{height} images; at most"
                f" {state.settings.max_image_pixels} pixels (setting STREAMDET_MAX_IMAGE_PIXELS)",
            )
        if binary_given:
            raw = _raw(tensor, name, binary)
            pixels = np.frombuffer(raw, np.uint8)
        else:
            try:
                pixels = np.asarray(tensor.get("data"), np.uint8).reshape(-1)
            except (TypeError, ValueError, OverflowError) as exc:
                raise HTTPException(400, f"input 'images': data is not UINT8: {exc}") from None
        if pixels.size != n * height * width * 3:
            raise HTTPException(
                400,
                f"input 'images': {pixels.size} values for shape {shape}"
                f" ({n * height * width * 3} expected)",
            )
        batch = pixels.reshape(n, height, width, 3)
        return [(np.ascontiguousarray(batch[i]), (width, height)) for i in range(n)]
    raise HTTPException(
        400, f"unknown input {name!r}: give 'image_bytes' (BYTES) or 'images' (UINT8)"
    )


def _check_count(n: int, state: AppState) -> None:
    """Before any image is decoded: a count the protocol allows, and no more than may wait
    at once (a call of more was decoded, then refused 429 for ever: :func:`run_admitted`)."""
    if not 1 <= n <= MAX_IMAGES:
        raise HTTPException(400, f"1 to {MAX_IMAGES} images a request, not {n}")
    check_queue_room(state, n)


def _params(request: dict[str, Any], names: Mapping[int, str]) -> DetectParams:
    given = _parameters(request, "the request")

    def number(key: str, default: float, low: float, high: float) -> float:
        value = given.get(key, default)
        if (
            not isinstance(value, int | float)
            or isinstance(value, bool)
            or not low <= value <= high
        ):
            raise HTTPException(400, f"parameter {key!r}: a number from {low} to {high}")
        return float(value)

    max_det = number("max_det", 300, 1, 1000)
    if max_det != int(max_det):
        raise HTTPException(400, "parameter 'max_det': a whole number from 1 to 1000")
    classes = given.get("classes")
    if classes is not None and not isinstance(classes, str | list):
        raise HTTPException(400, "parameter 'classes': ids or names, comma-separated")
    try:
        wanted = parse_classes(classes, names)
    except HTTPException as exc:
        raise HTTPException(400, f"parameter 'classes': {exc.detail}") from None
    return DetectParams(
        conf=number("conf", 0.25, 0, 1),
        iou=number("iou", 0.7, 0, 1),
        classes=wanted,
        max_det=int(max_det),
    )


def _found(
    results: Sequence[WorkResult], images: Sequence[tuple[Image, tuple[int, int]]]
) -> list[Detections]:
    """Each image's detections, in its own pixels (as sent, however it was decoded)."""
    return [
        result.detections.rescaled(*size)
        for result, (_, size) in zip(results, images, strict=True)
        if result.detections is not None
    ]


def _outputs(results: Sequence[Detections]) -> dict[str, npt.NDArray[Any]]:
    n = len(results)
    k = max((len(r) for r in results), default=0)
    counts = np.array([[len(r)] for r in results], np.int32)
    boxes = np.zeros((n, k, 4), np.float32)
    scores = np.zeros((n, k), np.float32)
    classes = np.zeros((n, k), np.int32)
    for i, r in enumerate(results):
        boxes[i, : len(r)] = r.boxes
        scores[i, : len(r)] = r.scores
        classes[i, : len(r)] = r.class_ids
    return {
        "num_detections": counts,
        "detection_boxes": boxes,
        "detection_scores": scores,
        "detection_classes": classes,
    }


def _parameters(holder: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``holder``'s ``parameters`` (a JSON object; none: empty), or 400 naming ``where``."""
    params = holder.get("parameters")
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise HTTPException(400, f"{where}: parameters must be a JSON object, not {params!r}")
    return params


def _no_shared_memory(holder: Mapping[str, Any], where: str) -> None:
    """400 for a tensor in (or for) shared memory (tritonclient's ``set_shared_memory``): an
    input's data was read as missing, an output was sent in the answer, the region ignored."""
    region = _parameters(holder, where).get("shared_memory_region")
    if region is not None:
        raise HTTPException(
            400, f"{where}: shared memory region {region!r}: {UNSUPPORTED['shared memory']}"
        )


def _chosen(request: dict[str, Any]) -> list[tuple[str, bool]]:
    """The outputs asked for, each with whether it goes as binary data; checked before any
    image is run (a bad one answered 400 only after the inference, or 500)."""
    names = [o["name"] for o in OUTPUTS]
    wanted = request.get("outputs")
    all_binary = bool(_parameters(request, "the request").get("binary_data_output", False))
    if wanted is None:
        return [(name, all_binary) for name in names]
    if not isinstance(wanted, list):
        raise HTTPException(400, "outputs must be a list")
    chosen: list[tuple[str, bool]] = []
    for item in wanted:
        name = item.get("name") if isinstance(item, dict) else None
        if name not in names:
            raise HTTPException(400, f"unknown output {name!r}; the model has {', '.join(names)}")
        assert isinstance(item, dict) and isinstance(name, str)
        where = f"output {name!r}"
        _no_shared_memory(item, where)
        if "classification" in _parameters(item, where):  # tritonclient's class_count
            raise HTTPException(
                400,
                f"{where}: class_count (Triton's classification extension) is not supported:"
                " the detections come as the four outputs; leave class_count out",
            )
        binary = _parameters(item, where).get("binary_data", all_binary)
        chosen.append((name, bool(binary)))
    return chosen


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
    _check_model(state, model_name, version)
    engine = state.pool.engine
    stats, started_ns = infer_stats(request.app), time.monotonic_ns()
    try:
        limit = state.settings.max_upload_bytes
        body = await read_body_capped(request, limit)
        ticket.body_read()  # decoding now: ahead of calls that arrive after this
        body = _inflated(body, request.headers.get("content-encoding"), limit)
        inference, binary = _split(body, request.headers.get(HEADER_LENGTH))
        params = _params(inference, engine.names)
        chosen = _chosen(inference)
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        images = await _images(state, inference, binary, loop)
        ticket.decoded(time.monotonic() - started, len(images))  # admission checks it again
        results = await run_admitted(state, ticket, [im for im, _ in images], params, request)
    except Exception:
        stats.failed(started_ns)
        raise
    stats.succeeded(started_ns, results)
    return _response(inference, model_name, _outputs(_found(results, images)), chosen)
