"""The KServe v2 / Open Inference Protocol over gRPC: Triton's ``GRPCInferenceService``, so
``tritonclient.grpc`` (and any client of that service) detects with streamdet unchanged.

It serves on ``--grpc-port`` (Triton's is 8001; 0, the default, leaves it off) beside the HTTP
port, in the same event loop, and answers exactly as ``/v2`` over HTTP does
(:mod:`server.routes.kserve`): the same model metadata, inputs (``image_bytes`` BYTES or
``images`` UINT8 ``[N, H, W, 3]``), EfficientNMS-style outputs and ``/detect`` parameters,
through the same admission control and deadline, the call's gRPC deadline taking the place of
``X-Request-Deadline-Ms``. Errors carry the HTTP side's message with the matching gRPC status
(400 ``INVALID_ARGUMENT``, 404 ``NOT_FOUND``, 429 ``RESOURCE_EXHAUSTED`` for a full queue
or a busy server, 503 ``UNAVAILABLE``, 504 ``DEADLINE_EXCEEDED`` for a deadline shorter than
the call takes alone on an idle server). Triton's ``timeout`` request parameter tightens the
call's deadline as over HTTP.

The service's messages come with ``tritonclient[grpc]`` (its generated ``service_pb2``), an
extra: ``pip install -e ".[grpc]"``; a server asked for a gRPC port without it stops at
start, saying so.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import numpy as np
from fastapi import FastAPI, HTTPException
from starlette.datastructures import Headers

from server.admission import DEADLINE_HEADER, AdmissionController
from server.auth import Access, ApiKeys, bearer_token
from server.request_ids import client_request_id
from server.routes.v2_model import (
    EXTENSIONS,
    NP_TYPES,
    OUTPUTS,
    UNSUPPORTED,
    VERSION,
    check_model,
    infer_stats,
    model_config_json,
    model_metadata_json,
    repository_index_json,
    served_name,
    statistics_json,
)
from server.routes.v2_tensors import output_tensors, run_infer
from server.settings import Settings
from server.state import AppState

log = logging.getLogger(__name__)

STATUS_CODES = {400: "INVALID_ARGUMENT", 404: "NOT_FOUND", 413: "INVALID_ARGUMENT"}
STATUS_CODES |= {415: "INVALID_ARGUMENT"}  # an image format it does not take
STATUS_CODES |= {422: "INVALID_ARGUMENT", 429: "RESOURCE_EXHAUSTED", 503: "UNAVAILABLE"}
STATUS_CODES |= {501: "UNIMPLEMENTED"}  # a Triton extension streamdet does not have
STATUS_CODES |= {504: "DEADLINE_EXCEEDED"}  # a deadline shorter than the call takes alone


def grpc_key_failure(keys: ApiKeys, metadata: Any) -> str | None:
    """Why a call with gRPC ``metadata`` (``authorization: Bearer <key>``) is refused, or
    None: any configured key, full or read-only, may call every method (they read or
    detect, as read-only keys may over HTTP)."""
    value = next((v for k, v in metadata or () if k.lower() == "authorization"), None)
    token = bearer_token(Headers({"authorization": value})) if isinstance(value, str) else None
    if token is None:
        return (
            "missing API key: send the metadata 'authorization: Bearer <key>' (keys are set"
            " with STREAMDET_API_KEYS)"
        )
    if keys.check(token) is Access.NONE:
        return "unknown API key (keys are set with STREAMDET_API_KEYS)"
    return None


def key_interceptor(grpc: Any, keys: ApiKeys) -> Any:
    """A ``grpc.aio`` server interceptor refusing calls without a configured key
    (``UNAUTHENTICATED``, the detail saying what to send)."""

    class KeyInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
        async def intercept_service(self, continuation: Any, details: Any) -> Any:
            handler = await continuation(details)
            why = grpc_key_failure(keys, details.invocation_metadata)
            if why is None or handler is None:
                return handler
            log.info("gRPC %s refused: %s", details.method, why)

            async def refuse(request: Any, context: Any) -> Any:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

            if handler.unary_unary is None:  # a streaming method: refused all the same
                return grpc.stream_stream_rpc_method_handler(
                    refuse,
                    request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer,
                )
            return grpc.unary_unary_rpc_method_handler(
                refuse,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )

    return KeyInterceptor()


class GrpcUnavailable(RuntimeError):
    """gRPC was asked for and its packages are missing; the message says what to install."""


def grpc_modules() -> tuple[Any, Any, Any, Any]:
    """grpc and Triton's generated service modules, or :class:`GrpcUnavailable`."""
    try:
        import grpc
        from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc
    except ImportError as exc:
        raise GrpcUnavailable(
            f"setting STREAMDET_GRPC_PORT needs gRPC and Triton's service definitions ({exc}):"
            ' pip install -e ".[grpc]", or leave the gRPC port at 0'
        ) from None
    return grpc, service_pb2, service_pb2_grpc, model_config_pb2


def _parameter(value: Any) -> Any:
    """An ``InferParameter``'s value, whichever of its kinds it holds."""
    kind = value.WhichOneof("parameter_choice")
    return None if kind is None else getattr(value, kind)


def _as_v2_json(request: Any) -> tuple[dict[str, Any], bytes]:
    """A ``ModelInferRequest`` as the HTTP protocol's JSON and binary body, so one reading of
    the inputs serves both: raw contents (what ``tritonclient.grpc`` sends) become binary
    data, typed contents become ``data`` (BYTES as length-prefixed binary)."""
    inputs: list[dict[str, Any]] = []
    binary = b""
    for i, tensor in enumerate(request.inputs):
        entry: dict[str, Any] = {
            "name": tensor.name,
            "datatype": tensor.datatype,
            "shape": list(tensor.shape),
        }
        if i < len(request.raw_input_contents):
            raw = request.raw_input_contents[i]
        elif tensor.datatype == "BYTES":
            raw = b"".join(
                struct.pack("<I", len(item)) + item for item in tensor.contents.bytes_contents
            )
        else:
            raw = None
            entry["data"] = list(tensor.contents.uint_contents)
        # Its own parameters too: a shared-memory region is refused saying so.
        entry["parameters"] = {k: _parameter(v) for k, v in tensor.parameters.items()}
        if raw is not None:
            entry["parameters"]["binary_data_size"] = len(raw)
            binary = raw if i == 0 else binary
        inputs.append(entry)
    parameters = {key: _parameter(value) for key, value in request.parameters.items()}
    v2: dict[str, Any] = {"inputs": inputs, "parameters": parameters}
    if request.outputs:
        v2["outputs"] = [
            {"name": o.name, "parameters": {k: _parameter(v) for k, v in o.parameters.items()}}
            for o in request.outputs
        ]
    return v2, binary


def make_servicer(app: FastAPI) -> Any:
    """The ``GRPCInferenceService`` servicer answering for ``app``'s model and pool."""
    grpc, pb, pb_grpc, config_pb = grpc_modules()
    from google.protobuf import json_format

    def answers(
        method: Callable[[Any, Any, Any], Awaitable[Any]],
    ) -> Callable[[Any, Any, Any], Awaitable[Any]]:
        """HTTP errors raised by the shared v2 code become the gRPC status of the same
        meaning, with the same message."""

        @functools.wraps(method)
        async def call(self: Any, request: Any, context: Any) -> Any:
            try:
                return await method(self, request, context)
            except HTTPException as exc:
                name = STATUS_CODES.get(exc.status_code, "INTERNAL")
                await context.abort(getattr(grpc.StatusCode, name), str(exc.detail))

        return call

    base: Any = pb_grpc.GRPCInferenceServiceServicer

    def _refusing(what: str) -> Callable[[Any, Any, Any], Awaitable[None]]:
        """A servicer method that answers ``UNIMPLEMENTED`` naming ``what`` is not served."""

        async def refuse(self: Any, request: Any, context: Any) -> None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, UNSUPPORTED[what])

        return refuse

    class Servicer(base):  # type: ignore[misc]
        def _state(self) -> AppState:
            state: AppState = app.state.streamdet
            return state

        @answers
        async def ServerLive(self, request: Any, context: Any) -> Any:  # noqa: N802
            return pb.ServerLiveResponse(live=True)

        @answers
        async def ServerReady(self, request: Any, context: Any) -> Any:  # noqa: N802
            return pb.ServerReadyResponse(ready=self._state().ready)

        @answers
        async def ServerMetadata(self, request: Any, context: Any) -> Any:  # noqa: N802
            return pb.ServerMetadataResponse(
                name="streamdet",
                version=app.version,
                extensions=[e for e in EXTENSIONS if e != "binary_tensor_data"],  # HTTP's
            )

        @answers
        async def ModelReady(self, request: Any, context: Any) -> Any:  # noqa: N802
            state = self._state()
            try:
                check_model(state, request.name, request.version)
            except HTTPException:
                # Not ready, as Triton answers for a model or version it does not have (and
                # as over HTTP, its 400): NOT_FOUND raised out of is_model_ready.
                return pb.ModelReadyResponse(ready=False)
            return pb.ModelReadyResponse(ready=state.ready)

        @answers
        async def RepositoryIndex(self, request: Any, context: Any) -> Any:  # noqa: N802
            answer = pb.RepositoryIndexResponse()
            models = repository_index_json(self._state(), ready_only=request.ready)
            return json_format.ParseDict({"models": models}, answer)

        @answers
        async def ModelStatistics(self, request: Any, context: Any) -> Any:  # noqa: N802
            stats = statistics_json(app, self._state(), request.name, request.version)
            return json_format.ParseDict(stats, pb.ModelStatisticsResponse())

        # Triton's methods of what streamdet does not have: UNIMPLEMENTED, saying so.
        RepositoryModelLoad = RepositoryModelUnload = _refusing("load")
        SystemSharedMemoryStatus = SystemSharedMemoryRegister = _refusing("shared memory")
        SystemSharedMemoryUnregister = CudaSharedMemoryStatus = _refusing("shared memory")
        CudaSharedMemoryRegister = CudaSharedMemoryUnregister = _refusing("shared memory")
        TraceSetting = _refusing("trace")
        LogSettings = _refusing("log")

        @answers
        async def ModelMetadata(self, request: Any, context: Any) -> Any:  # noqa: N802
            state = self._state()
            check_model(state, request.name, request.version)
            answer = pb.ModelMetadataResponse()
            return json_format.ParseDict(model_metadata_json(state, request.name), answer)

        @answers
        async def ModelConfig(self, request: Any, context: Any) -> Any:  # noqa: N802
            state = self._state()
            check_model(state, request.name, request.version)
            config = json_format.ParseDict(
                model_config_json(state, request.name), config_pb.ModelConfig()
            )
            return pb.ModelConfigResponse(config=config)

        @answers
        async def ModelInfer(self, request: Any, context: Any) -> Any:  # noqa: N802
            return await self._infer(request, context)

        async def ModelStreamInfer(  # noqa: N802
            self, requests: AsyncIterator[Any], context: Any
        ) -> AsyncIterator[Any]:
            """Each request of the stream answered on it as it is done (they run at once,
            as Triton's do), an error in its ``error_message``, the stream left open."""
            done: asyncio.Queue[Any] = asyncio.Queue()  # one answer a request, then None
            running: set[asyncio.Task[None]] = set()
            asked = 0  # requests read (each puts exactly one answer)

            async def answer(request: Any) -> None:
                try:
                    response = pb.ModelStreamInferResponse(
                        infer_response=await self._infer(request, context)
                    )
                except Exception as exc:  # one failed request: the stream goes on
                    if isinstance(exc, HTTPException):
                        message = str(exc.detail)
                    else:
                        log.exception("gRPC stream request %r failed", request.id)
                        message = f"internal error: {exc}"
                    # Its id with the error, as Triton's, so that the client knows which
                    # request failed (answers come out of order).
                    response = pb.ModelStreamInferResponse(
                        error_message=message,
                        infer_response=pb.ModelInferResponse(
                            model_name=request.model_name, id=request.id
                        ),
                    )
                await done.put(response)

            unreadable: str | None = None

            async def read() -> None:
                nonlocal asked, unreadable
                try:
                    async for request in requests:
                        asked += 1
                        task = asyncio.create_task(answer(request))
                        running.add(task)
                        task.add_done_callback(running.discard)
                except Exception as exc:  # a message that is no ModelInferRequest
                    # Nothing after it can be read: the stream ends with the error, once
                    # what came before is answered (it hung, open and silent, for good).
                    unreadable = f"a message of the stream is not a ModelInferRequest: {exc}"
                    log.info("gRPC stream ended: %s", unreadable)
                await done.put(None)  # the client closed its side, or it cannot be read on

            reader = asyncio.create_task(read())
            answered, closed = 0, False
            try:
                while not closed or answered < asked:
                    response = await done.get()
                    if response is None:
                        closed = True
                    else:
                        answered += 1
                        yield response
            finally:
                reader.cancel()
                for task in running:
                    task.cancel()
            if unreadable is not None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, unreadable)

        async def _infer(self, request: Any, context: Any) -> Any:
            """One ``ModelInferRequest``'s answer, or the HTTP error of the same meaning."""
            state = self._state()
            check_model(state, request.model_name, request.model_version)
            controller: AdmissionController | None = getattr(app.state, "admission", None)
            if controller is None or not state.ready:
                app.state.metrics.refuse_unready(state.shutting_down)
                raise HTTPException(503, "model not loaded yet")
            stats, started_ns = infer_stats(app), time.monotonic_ns()
            left_s = context.time_remaining()  # the call's gRPC deadline, if it has one
            headers = Headers(
                {} if left_s is None else {DEADLINE_HEADER: f"{max(left_s, 0.001) * 1000:.0f}"}
            )
            metadata = dict(context.invocation_metadata() or ())
            request_id = client_request_id(str(metadata.get("x-request-id") or request.id or ""))
            ticket = controller.admit(
                time.monotonic(), headers, request_id, client_deadline="the call's gRPC deadline"
            )
            try:
                # In a decode thread: 10 million typed values held the event loop 2.4 s.
                inference, binary = await asyncio.get_running_loop().run_in_executor(
                    state.decode_executor, _as_v2_json, request
                )
                results, found, chosen = await run_infer(state, ticket, inference, binary)
            except Exception:
                stats.failed(started_ns)
                raise
            finally:
                ticket.release()
            stats.succeeded(started_ns, results)
            wanted = [name for name, _ in chosen]
            outputs = output_tensors(found)
            datatypes = {o["name"]: o["datatype"] for o in OUTPUTS}
            return pb.ModelInferResponse(
                model_name=request.model_name,
                model_version=VERSION,
                id=request.id,
                outputs=[
                    pb.ModelInferResponse.InferOutputTensor(
                        name=name, datatype=datatypes[name], shape=list(outputs[name].shape)
                    )
                    for name in wanted
                ],
                raw_output_contents=[
                    np.ascontiguousarray(outputs[name], NP_TYPES[datatypes[name]]).tobytes()
                    for name in wanted
                ],
            )

    return Servicer()


SERVICE = "/inference.GRPCInferenceService/"


def start_loading(settings: Settings, keys: ApiKeys) -> Any:
    """gRPC's port while the model loads, as HTTP's (:mod:`server.loading`): bound before
    the model loads, ``ServerLive`` true, ``ServerReady`` and ``ModelReady`` false, every
    other call ``UNAVAILABLE`` saying why (API keys asked for as the app asks). The port
    refused connections until the model had loaded: a gRPC liveness probe killed a server
    mid-load (a TensorRT build takes minutes). Returns the server: ``stop(None)`` it before
    the app's takes the port (:func:`start`).

    Raises:
        RuntimeError: the port cannot be bound (the message names the setting).
    """
    from concurrent import futures

    grpc, pb, _, _ = grpc_modules()
    from server.loading import LOADING

    def answer(response: Any, request_type: Any) -> Any:
        return grpc.unary_unary_rpc_method_handler(
            lambda request, context: response,
            request_deserializer=request_type.FromString,
            response_serializer=type(response).SerializeToString,
        )

    def refused(code: Any, why: str, streaming: bool) -> Any:
        def refuse(request: Any, context: Any) -> Any:
            context.abort(code, why)

        if streaming:
            return grpc.stream_stream_rpc_method_handler(refuse)
        return grpc.unary_unary_rpc_method_handler(refuse)

    class Loading(grpc.GenericRpcHandler):  # type: ignore[misc,name-defined]
        def service(self, details: Any) -> Any:
            if not details.method.startswith(SERVICE):
                return None  # UNIMPLEMENTED, as the app answers
            method = details.method.removeprefix(SERVICE)
            streaming = method == "ModelStreamInfer"
            if keys.enabled and (why := grpc_key_failure(keys, details.invocation_metadata)):
                return refused(grpc.StatusCode.UNAUTHENTICATED, why, streaming)
            if method == "ServerLive":
                return answer(pb.ServerLiveResponse(live=True), pb.ServerLiveRequest)
            if method == "ServerReady":
                return answer(pb.ServerReadyResponse(ready=False), pb.ServerReadyRequest)
            if method == "ModelReady":
                return answer(pb.ModelReadyResponse(ready=False), pb.ModelReadyRequest)
            return refused(grpc.StatusCode.UNAVAILABLE, LOADING, streaming)

    server = grpc.server(
        futures.ThreadPoolExecutor(2, thread_name_prefix="grpc-loading"),
        handlers=[Loading()],
        options=[("grpc.so_reuseport", 0)],
    )
    _bind(server, settings)
    server.start()
    return server


def _bind(server: Any, settings: Settings) -> str:
    """Bind ``server`` (sync or aio) to ``--grpc-port``; its address.

    Raises:
        RuntimeError: the port cannot be bound (the message names the setting).
    """
    address = f"{settings.host}:{settings.grpc_port}"
    try:
        server.add_insecure_port(address)
    except RuntimeError as exc:
        raise RuntimeError(
            f"cannot serve gRPC on {address} (setting STREAMDET_GRPC_PORT): {exc}"
        ) from None
    return address


async def start(app: FastAPI, settings: Settings) -> Any:
    """Serve ``GRPCInferenceService`` on ``settings.grpc_port``; returns the server (stop it
    with ``await server.stop(grace_s)``).

    Raises:
        GrpcUnavailable: the packages are not installed.
        RuntimeError: the port cannot be bound (the message names the setting).
    """
    grpc, _, pb_grpc, _ = grpc_modules()
    # The images, and the request around them; gRPC takes a C int (a larger one failed the
    # start: --max-upload-mb 2048), so 2 GiB is its most whatever the setting says.
    limit = min(settings.max_upload_bytes + 64 * 1024, 2**31 - 1)
    keys: ApiKeys = app.state.api_keys
    server = grpc.aio.server(
        # API keys as over HTTP (any key: every method reads or detects). Without it the
        # gRPC port answered everyone while HTTP asked for a key.
        interceptors=[key_interceptor(grpc, keys)] if keys.enabled else [],
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", 64 * 1024 * 1024),
            # gRPC sets SO_REUSEPORT by default: a port another process serves was bound
            # again without a word (the two shared its calls) instead of refused below.
            ("grpc.so_reuseport", 0),
        ],
    )
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(make_servicer(app), server)
    loading = getattr(app.state, "grpc_loading", None)
    if loading is not None:  # the port's, while the model loaded: this one takes it now
        app.state.grpc_loading = None
        loading.stop(None)
    address = _bind(server, settings)
    await server.start()
    log.info("KServe v2 gRPC on %s (model %s)", address, served_name(app.state.streamdet))
    return server
