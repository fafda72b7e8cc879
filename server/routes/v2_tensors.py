"""The KServe v2 infer call's tensors, over HTTP (:mod:`server.routes.kserve`) and gRPC
(:mod:`server.grpc_v2`) alike: the request's one input (``image_bytes`` BYTES ``[N]`` of encoded
images, or ``images`` UINT8 ``[N, H, W, 3]``) decoded to images, its ``parameters`` to
:class:`~engines.types.DetectParams`, and the detections to the outputs asked for."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
from fastapi import HTTPException, Request

from engines.batching import WorkResult
from engines.types import Detections, DetectParams, Image
from server.admission import Ticket
from server.images import ImageError, decode_upload, decoded_pixels
from server.routes.detect import check_queue_room, parse_classes, run_admitted, timed
from server.routes.v2_model import OUTPUTS, UNSUPPORTED
from server.state import AppState

MAX_IMAGES = 256  # images in one request
CALL_PIXELS = 2
"""A call's images together decode to at most this many times ``max_image_pixels``."""


def tensor_shape(tensor: Mapping[str, Any], name: str) -> list[int]:
    shape = tensor.get("shape")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise HTTPException(400, f"input {name!r}: shape must be a list of sizes, not {shape!r}")
    return shape


def tensor_bytes(tensor: Mapping[str, Any], name: str, binary: bytes) -> bytes:
    """The one input's binary data (binary tensor data extension): the body after the JSON."""
    size = parameters_of(tensor, f"input {name!r}").get("binary_data_size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise HTTPException(400, f"input {name!r}: binary_data_size must be a byte count")
    if size > len(binary):
        raise HTTPException(
            400, f"input {name!r}: binary_data_size {size} runs past the end of the body"
        )
    return binary[:size]


def bytes_elements(raw: bytes, name: str) -> list[bytes]:
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


T = TypeVar("T")


def _uint8(data: Any) -> npt.NDArray[np.uint8]:
    """A JSON tensor's ``data`` as flat UINT8 values: whole numbers 0-255 only, as Triton
    reads them (1.7 and true were taken as 1, -1 as 255).

    Raises:
        ValueError: no data, or a value that is not one.
    """
    if data is None:
        raise ValueError("no 'data' given (nor binary_data_size)")
    values = np.asarray(data)
    if not values.size:  # an empty list reads as floats: it was "a fraction among the values"
        raise ValueError("no values given (over gRPC, UINT8 values go in uint_contents)")
    if values.dtype.kind not in "iu":  # floats, true/false, text, numbers past 64 bits
        kinds = {"f": "a fraction", "b": "true/false", "U": "text"}
        raise ValueError(f"{kinds.get(values.dtype.kind, 'a value')} among the values")
    if values.size and (int(values.min()) < 0 or int(values.max()) > 255):
        raise ValueError(f"values from {values.min()} to {values.max()}: UINT8 is 0 to 255")
    return values.astype(np.uint8).reshape(-1)


def _of_element(exc: ImageError, index: int, count: int) -> ImageError:
    """``exc`` naming the batch element it is about (from 0, as the tensor's first axis)."""
    if count == 1:
        return exc
    return ImageError(exc.status_code, f"element {index} of {count}: {exc.message}")


async def request_images(
    state: AppState, request: dict[str, Any], binary: bytes, loop: asyncio.AbstractEventLoop
) -> tuple[list[tuple[Image, tuple[int, int]]], float]:
    """The request's images, each with its width and height as sent (a large JPEG is decoded
    smaller for the engine: :func:`server.images.decode_upload`), and the seconds their
    decoding took in a decode thread (the longest image's; a wait for a free decode thread
    not counted, as :func:`server.routes.detect.timed` does for ``/detect``)."""
    inputs = request.get("inputs")
    if not isinstance(inputs, list) or len(inputs) != 1 or not isinstance(inputs[0], dict):
        raise HTTPException(
            400,
            "give exactly one input: 'image_bytes' (BYTES, encoded images) or 'images'"
            " (UINT8 [N, H, W, 3], RGB)",
        )
    tensor = inputs[0]
    name, datatype = tensor.get("name"), tensor.get("datatype")
    no_shared_memory(tensor, f"input {name!r}")
    shape = tensor_shape(tensor, str(name))
    binary_given = "binary_data_size" in parameters_of(tensor, f"input {name!r}")
    if name == "image_bytes":
        if datatype != "BYTES" or len(shape) != 1:
            raise HTTPException(400, f"input 'image_bytes': BYTES [N], not {datatype} {shape}")
        if not binary_given:
            raise HTTPException(
                400,
                "input 'image_bytes': send the encoded images as binary data"
                " (tritonclient's binary_data=True)",
            )
        # Before its elements are read, and those read in a decode thread: 5 million empty
        # ones held the event loop (every stream, viewer and /healthz) 4 s, then were refused.
        check_count(shape[0], state)
        decode = state.decode_executor
        raw = tensor_bytes(tensor, name, binary)
        items = await loop.run_in_executor(decode, bytes_elements, raw, name)
        if len(items) != shape[0]:
            raise HTTPException(
                400, f"input 'image_bytes': shape says {shape[0]} images, the data has {len(items)}"
            )
        limit, side = state.settings.max_image_pixels, state.pool.engine.input_size

        def element(index: int, read: Callable[[bytes, int, int], T]) -> T:
            """``read`` of the ``index``-th image, its error naming that element."""
            try:
                return read(items[index], limit, side)
            except ImageError as exc:
                raise _of_element(exc, index, len(items)) from None

        def header_pixels() -> int:
            return sum(element(index, decoded_pixels) for index in range(len(items)))

        try:
            # From their headers first: a few kB of PNGs decode to gigabytes (24 of 19 MP
            # took 2 GB and 18 s of the decode threads, then the call was refused anyway). In
            # a decode thread too: a PNG's text chunks are inflated as its header is read
            # (64 of them, 0.4 s each, held the event loop 31 s).
            total = await loop.run_in_executor(decode, header_pixels)
            if total > CALL_PIXELS * limit:
                raise HTTPException(
                    413,
                    f"input 'image_bytes': {len(items)} images of {total / 1e6:.1f} MP"
                    f" together, over a call's {CALL_PIXELS * limit / 1e6:.0f} MP"
                    f" ({CALL_PIXELS} x setting STREAMDET_MAX_IMAGE_PIXELS; large JPEGs count"
                    " at the size they are decoded to)",
                )
            decoded = await asyncio.gather(
                *(
                    loop.run_in_executor(decode, timed, element, index, decode_upload)
                    for index in range(len(items))
                )
            )
            return [image for image, _ in decoded], max(seconds for _, seconds in decoded)
        except ImageError as exc:
            raise HTTPException(exc.status_code, f"input 'image_bytes': {exc.message}") from None
    if name == "images":
        if datatype != "UINT8" or len(shape) != 4 or shape[3] != 3:
            raise HTTPException(400, f"input 'images': UINT8 [N, H, W, 3], not {datatype} {shape}")
        n, height, width = shape[:3]
        check_count(n, state)
        if not height or not width:  # it was told the pixel limit
            raise HTTPException(400, f"input 'images': {width}x{height} images have no pixels")
        if height * width > state.settings.max_image_pixels:
            raise HTTPException(
                413,
                f"input 'images': {width}x{height} images; at most"
                f" {state.settings.max_image_pixels} pixels (setting STREAMDET_MAX_IMAGE_PIXELS)",
            )
        seconds = 0.0  # nothing to decode
        if binary_given:
            raw = tensor_bytes(tensor, name, binary)
            pixels = np.frombuffer(raw, np.uint8)
        else:
            data = tensor.get("data")
            expected = n * height * width * 3
            if isinstance(data, list) and data and not isinstance(data[0], list):
                given = len(data)  # a flat list, counted before any conversion
                if given != expected:
                    raise HTTPException(
                        400,
                        f"input 'images': {given} values for shape {shape} ({expected} expected)",
                    )
            try:  # in a decode thread: 10 million values took 2 s
                pixels, seconds = await loop.run_in_executor(
                    state.decode_executor, timed, _uint8, data
                )
            except (TypeError, ValueError, OverflowError) as exc:
                raise HTTPException(400, f"input 'images': data is not UINT8: {exc}") from None
        if pixels.size != n * height * width * 3:
            raise HTTPException(
                400,
                f"input 'images': {pixels.size} values for shape {shape}"
                f" ({n * height * width * 3} expected)",
            )
        batch = pixels.reshape(n, height, width, 3)
        return [(np.ascontiguousarray(batch[i]), (width, height)) for i in range(n)], seconds
    raise HTTPException(
        400, f"unknown input {name!r}: give 'image_bytes' (BYTES) or 'images' (UINT8)"
    )


def check_count(n: int, state: AppState) -> None:
    """Before any image is decoded: a count the protocol allows, and no more than may wait
    at once (a call of more was decoded, then refused 429 for ever: :func:`run_admitted`)."""
    if not 1 <= n <= MAX_IMAGES:
        raise HTTPException(400, f"1 to {MAX_IMAGES} images a request, not {n}")
    check_queue_room(state, n)


DETECT_PARAMETERS = ("conf", "iou", "classes", "max_det")
PROTOCOL_PARAMETERS = frozenset(
    {
        "timeout",
        "binary_data_output",
        # Triton's, which tritonclient sends where given; a detector has no sequences and
        # one priority: read and let be.
        "priority",
        "sequence_id",
        "sequence_start",
        "sequence_end",
        "triton_enable_empty_final_response",
    }
)


def request_params(request: dict[str, Any], names: Mapping[int, str]) -> DetectParams:
    """The request's detection parameters; HTTP 400 for one out of range, or one that is
    none of them nor the protocol's (``cof`` ran the call with the default, as ``/detect``
    refuses it)."""
    given = parameters_of(request, "the request")
    unknown = sorted(k for k in given if k not in DETECT_PARAMETERS + tuple(PROTOCOL_PARAMETERS))
    if unknown:
        raise HTTPException(
            400,
            f"parameter {unknown[0][:64]!r}: not one this model reads (it takes"
            f" {', '.join(DETECT_PARAMETERS)}; and the protocol's timeout)",
        )

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


TIMEOUT_SOURCE = "the request's timeout parameter"
"""Where a deadline from Triton's ``timeout`` came from, in errors."""


def request_timeout_ms(request: dict[str, Any]) -> float | None:
    """Triton's ``timeout`` request parameter (whole microseconds, what ``tritonclient``'s
    ``infer(timeout=...)`` sends; 0 is none, as in Triton) in milliseconds, or None; a
    malformed one is a 400. The call's deadline is the earliest of it, the client's own
    (``X-Request-Deadline-Ms``, or the gRPC deadline) and the settings'."""
    value = parameters_of(request, "the request").get("timeout")
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**64:
        shown = repr(value) if len(repr(value)) <= 40 else f"{repr(value)[:37]}..."
        raise HTTPException(
            400,
            "parameter 'timeout': whole microseconds, 0 (none) to 2**64 - 1 (Triton's"
            f" uint64), not {shown}",
        )
    return value / 1000.0 if value else None


def rescaled_to_sent(
    results: Sequence[WorkResult], images: Sequence[tuple[Image, tuple[int, int]]]
) -> list[Detections]:
    """Each image's detections, in its own pixels (as sent, however it was decoded)."""
    return [
        result.detections.rescaled(*size)
        for result, (_, size) in zip(results, images, strict=True)
        if result.detections is not None
    ]


def output_tensors(results: Sequence[Detections]) -> dict[str, npt.NDArray[Any]]:
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


def parameters_of(holder: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``holder``'s ``parameters`` (a JSON object; none: empty), or 400 naming ``where``."""
    params = holder.get("parameters")
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise HTTPException(400, f"{where}: parameters must be a JSON object, not {params!r}")
    return params


def no_shared_memory(holder: Mapping[str, Any], where: str) -> None:
    """400 for a tensor in (or for) shared memory (tritonclient's ``set_shared_memory``): an
    input's data was read as missing, an output was sent in the answer, the region ignored."""
    region = parameters_of(holder, where).get("shared_memory_region")
    if region is not None:
        raise HTTPException(
            400, f"{where}: shared memory region {region!r}: {UNSUPPORTED['shared memory']}"
        )


def chosen_outputs(request: dict[str, Any]) -> list[tuple[str, bool]]:
    """The outputs asked for, each with whether it goes as binary data; checked before any
    image is run (a bad one answered 400 only after the inference, or 500)."""
    names = [o["name"] for o in OUTPUTS]
    wanted = request.get("outputs")
    all_binary = bool(parameters_of(request, "the request").get("binary_data_output", False))
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
        no_shared_memory(item, where)
        if "classification" in parameters_of(item, where):  # tritonclient's class_count
            raise HTTPException(
                400,
                f"{where}: class_count (Triton's classification extension) is not supported:"
                " the detections come as the four outputs; leave class_count out",
            )
        binary = parameters_of(item, where).get("binary_data", all_binary)
        chosen.append((name, bool(binary)))
    return chosen


InferRun = tuple[list[WorkResult], list[Detections], list[tuple[str, bool]]]
"""The pool's results, each image's detections in its pixels as sent, the outputs chosen."""


async def run_infer(
    state: AppState,
    ticket: Ticket,
    inference: dict[str, Any],
    binary: bytes,
    request: Request | None = None,
) -> InferRun:
    """Run one v2 infer request (its JSON and binary data) under ``ticket``, over HTTP or
    gRPC alike: its parameters and ``timeout``, the outputs asked for (checked before any
    image runs), its images decoded and run (:data:`InferRun`). ``request``: the HTTP call,
    whose client may go away."""
    params = request_params(inference, state.pool.engine.names)
    if (timeout_ms := request_timeout_ms(inference)) is not None:
        ticket.tighten(timeout_ms, TIMEOUT_SOURCE)
    chosen = chosen_outputs(inference)
    images, seconds = await request_images(state, inference, binary, asyncio.get_running_loop())
    largest = max((image.shape[0] * image.shape[1] for image, _ in images), default=0)
    raw = inference["inputs"][0]["name"] == "images"  # pixels sent: nothing decoded
    ticket.decoded(seconds, len(images), pixels=largest, raw=raw)  # admission checks it again
    results = await run_admitted(state, ticket, [im for im, _ in images], params, request)
    return results, rescaled_to_sent(results, images), chosen
