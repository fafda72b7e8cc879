"""The FastAPI application: lifespan (engine pool up, then down in order) and routes."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import sqlite3
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from engines.pool import EnginePool
from server import metrics as metrics_module
from server.admission import AdmissionController
from server.auth import ApiKeyMiddleware, ApiKeys, TokenFilter, with_bearer_scheme
from server.head import HeadAsGet
from server.jobs import JobManager
from server.metrics import Metrics, RequestMetricsMiddleware, nvml_collector
from server.mqtt import MqttPublisher
from server.mqtt_discovery import Discovery
from server.request_ids import REQUEST_ID, RequestIdFilter, RequestIdMiddleware
from server.retention import DAY_S, keep_for
from server.routes import (
    detect,
    errors,
    events,
    health,
    jobs,
    kserve,
    openapi,
    streams,
    viewer,
    ws,
)
from server.routes import webhooks as webhooks_routes
from server.routes.bodies import JsonBodyLimit, RequestBody
from server.routes.webhooks import make_sender
from server.runtime import build_pool
from server.settings import Settings
from server.snapshots import SnapshotStore
from server.state import AppState
from server.streams_file import StreamsFileError
from server.webhook_store import WebhookStore
from server.webhooks import Webhooks, WebhookSender, load_name_key
from streams.manager import StreamManager
from streams.storage import DATA_DIR_HINT, storage_failure

log = logging.getLogger(__name__)
MIN_STOP_S = 0.5
"""What each part stopping gets at the least, its drain time spent (its threads to join)."""


async def client_went_away(request: Request, exc: Exception) -> Response:
    """A client that went away before its body was read (an upload cut off, or a client that
    gave up while its call waited to be read): logged as such,
    not as "Exception in ASGI application" with a traceback; what the route had made of the
    request is cleaned up by the route itself. The answer goes nowhere."""
    log.info(
        "%s %s: the client went away before its call was read", request.method, request.url.path
    )
    return Response(status_code=499)  # as /metrics counts any call whose client left (was 400)


async def storage_full(request: Request, exc: Exception) -> Response:
    """A call that had to write to a data directory that cannot take it: ``507`` saying so
    and naming the setting (it was a bare 500 and a traceback, on every write route); any
    other error of these types goes on to the server's own 500."""
    if not storage_failure(exc) or request.scope["type"] != "http":
        raise exc
    log.error(
        "%s %s: cannot write to the data directory: %s", request.method, request.url.path, exc
    )
    detail = f"the server cannot store this: {exc} ({DATA_DIR_HINT})"
    key = "error" if errors.is_v2(request) else "detail"
    return JSONResponse({key: detail}, status_code=507)


async def internal_error(request: Request, exc: Exception) -> Response:
    """A fault of the server's own (a bug): ``500`` as every other error is answered
    (``{"detail"}``, under ``/v2`` ``{"error"}``), naming the request id its traceback is
    logged under; Starlette's plain-text "Internal Server Error" was neither. The exception
    goes on to uvicorn, which logs it with its traceback."""
    rid = REQUEST_ID.get() or request.headers.get("x-request-id", "")
    detail = f"internal error ({type(exc).__name__}); the server's log has it as request {rid}"
    key = "error" if errors.is_v2(request) else "detail"
    return JSONResponse({key: detail}, status_code=500, headers={"X-Request-ID": rid})


def create_app(settings: Settings | None = None, pool: EnginePool | None = None) -> FastAPI:
    """Build the app. ``pool`` may be given already started (the CLI loads the model before
    binding the port, so a bad model fails fast with a clean message); otherwise the lifespan
    builds it from ``settings``. A pool passed in is stopped by the lifespan too."""
    settings = settings or Settings()
    metrics = Metrics(gpu=nvml_collector())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # After uvicorn has set its logging up: keys given as ?access_token= are masked in
        # its request lines (and its WebSocket ones, which it logs as errors' logger does).
        # And each line said while a request is served begins with its id, as ours do.
        for name in ("uvicorn.access", "uvicorn.error"):
            logger = logging.getLogger(name)
            for kind in (TokenFilter, RequestIdFilter):
                if not any(isinstance(f, kind) for f in logger.filters):
                    logger.addFilter(kind())
        engine_pool = pool if pool is not None else await asyncio.to_thread(build_pool, settings)
        executor = ThreadPoolExecutor(settings.decode_threads, thread_name_prefix="decode")
        state = AppState(settings=settings, pool=engine_pool, decode_executor=executor)
        app.state.streamdet = state
        metrics.bind_pool(engine_pool, lambda: state.ready)
        app.state.admission = AdmissionController(engine_pool, settings, metrics)
        # What has started, stopped again by stop(): after a run, and where the start
        # fails part way (a data dir's file in the way), whose streams' threads held the
        # process up for good, its port open and unanswered, its cameras still recorded.
        manager: StreamManager | None = None
        reloads: streams.StreamsFileReloads | None = None
        webhooks: Webhooks | None = None
        publisher: MqttPublisher | None = None
        job_manager: JobManager | None = None
        grpc_server: Any = None
        tasks: list[asyncio.Task[None]] = []

        async def stop() -> None:
            # Stop intake, drain within the timeout, then fail what is left. One drain time
            # from the signal (server/cli.py), or from now: each part gets what is left of
            # it (each took it whole, and a SIGTERM took twice the setting or more).
            stop_by = getattr(app.state, "stop_by", None)
            stop_by = time.monotonic() + settings.shutdown_timeout_s if stop_by is None else stop_by

            def left() -> float:
                return max(MIN_STOP_S, stop_by - time.monotonic())

            state.shutting_down = True
            if grpc_server is not None:
                await grpc_server.stop(min(left(), 5.0))
            for task in tasks:
                task.cancel()
            if reloads is not None:
                reloads.uninstall()
            if job_manager is not None:
                await job_manager.stop(left())  # they run again at start
            if manager is not None:
                await manager.stop(left())
                # The streams' last events are logged: webhooks and MQTT deliver them and end
                # (they ended as shutdown began, leaving those for the next start).
                manager.events.finish()
            if webhooks is not None:
                await webhooks.stop(left())  # the last events go out
            if publisher is not None:
                await publisher.stop(left())
            if manager is not None and manager.events.store is not None:
                await asyncio.to_thread(manager.events.store.close)  # events, cursors to disk
            await asyncio.to_thread(engine_pool.stop, left())
            executor.shutdown(wait=False, cancel_futures=True)

        try:
            # Streams start after the pool (they feed it) and stop before it.
            manager = streams.build_manager(settings, engine_pool)
            await manager.start()
            state.streams = manager
            names = engine_pool.engine.names
            if settings.streams_file is not None:
                await streams.apply_streams_file(manager, settings.streams_file, names, os.environ)
            reloads = streams.StreamsFileReloads(manager, settings.streams_file, names)
            reloads.install()  # SIGHUP applies the streams file again
            snapshots = SnapshotStore(
                settings.event_snapshots,
                settings.event_snapshot_width,
                executor,
                manager.detect,
                directory=settings.data_dir / "snapshots",
                events=manager.events,
                metrics=metrics,
            )
            if snapshots.enabled:
                manager.event_extras.append(snapshots.extra)
                manager.event_observers.append(snapshots.capture)
            state.snapshots = snapshots
            if manager.clips is not None:
                manager.clips.on_outcome = lambda outcome: metrics.event_clips.labels(outcome).inc()
            load_name_key(settings.data_dir)  # before any webhook is named
            webhooks = Webhooks(
                [
                    WebhookSender(
                        url,
                        manager.events,
                        settings.webhook_secret,
                        settings.webhook_timeout_s,
                        metrics,
                        root_path=settings.root_path,
                        public_url=settings.public_url,
                    )
                    for url in settings.webhooks
                ]
            )
            webhook_store = WebhookStore(settings.data_dir)
            for record in await asyncio.to_thread(webhook_store.load):  # added before a restart
                webhooks.add(
                    make_sender(
                        record,
                        manager.events,
                        settings.webhook_timeout_s,
                        metrics,
                        root_path=settings.root_path,
                        public_url=settings.public_url,
                    )
                )
            state.webhooks, state.webhook_store = webhooks, webhook_store
            webhooks.start()
            publisher = (
                None
                if settings.mqtt_url is None
                else MqttPublisher(
                    settings.mqtt_url,
                    settings.mqtt_topic,
                    manager.events,
                    metrics,
                    manager.detect,
                    thumbnail_of=functools.partial(snapshots.get, thumbnail=True),
                    enable=functools.partial(streams.set_enabled, manager),
                    roster=manager.roster,
                    name_of=manager.name_of,
                    discovery=Discovery(
                        settings.mqtt_topic,
                        settings.mqtt_discovery_prefix,
                        # The viewer, each device's "Visit" link in Home Assistant.
                        configuration_url=None
                        if settings.public_url is None
                        else settings.public_url + "/",
                    )
                    if settings.mqtt_discovery
                    else None,
                    root_path=settings.root_path,
                    public_url=settings.public_url,
                )
            )
            if publisher is not None:
                publisher.start()
                manager.frame_observers.append(publisher.observe_frame)
            job_manager = JobManager(
                settings.data_dir / "jobs",
                engine_pool.submit_background,
                names,
                max_jobs=settings.max_jobs,
                max_bytes=settings.jobs_max_mb * 1024 * 1024,
                concurrency=settings.job_concurrency,
                inflight=settings.job_inflight or engine_pool.workers * engine_pool.max_batch,
                max_pixels=settings.max_image_pixels,
                decode_max_side=settings.decode_side(engine_pool.engine.input_size),
                # A video over HTTP that stops answering: the streams' waits (they were 10 s and
                # 5 s whatever the settings, which its error named).
                source_timeout_s=(settings.stream_open_timeout_s, settings.stream_read_timeout_s),
                frames=manager.job_frames(),
                callback_secret=settings.webhook_secret,
                callback_timeout_s=settings.webhook_timeout_s,
                root_path=settings.root_path,
                public_url=settings.public_url,
            )
            await job_manager.start()
            state.jobs = job_manager
            metrics.set_job_source(job_manager.counts)
            metrics.set_stream_source(functools.partial(streams.metric_samples, manager))
            metrics.set_decode_source(manager.decode_stats)
            manager.frame_observers.append(metrics.observe_stream_frame)
            tasks.append(asyncio.create_task(metrics_module.watch_loop_lag(metrics)))
            if settings.event_retain_days > 0:
                retain_s = settings.event_retain_days * DAY_S
                tasks.append(
                    asyncio.create_task(
                        keep_for(retain_s, manager.events, snapshots, manager.clips)
                    )
                )
            keys = app.state.api_keys
            log.info(
                "API keys: %s",
                f"{keys.counts[0]} full, {keys.counts[1]} read-only"
                if keys.enabled
                else "none, every call is allowed (setting STREAMDET_API_KEYS)",
            )
            if settings.grpc_port:
                from server import grpc_v2

                grpc_server = await grpc_v2.start(app, settings)
        except BaseException as exc:
            if isinstance(exc, StreamsFileError):
                log.error("cannot start: %s", exc)
            await stop()
            raise
        try:
            yield
        finally:
            await stop()
            log.info("shutdown complete")

    # A proxy's prefix (--root-path) comes as the ASGI root_path uvicorn sets (server/cli.py):
    # FastAPI's own root_path is deprecated. /docs and /redoc are the viewer's (server/routes/
    # viewer.py): FastAPI's load their files from a CDN.
    app = FastAPI(
        title="streamdet", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None
    )
    app.include_router(health.router)
    app.include_router(detect.router)
    app.include_router(streams.router)
    app.include_router(ws.router)
    app.include_router(events.router)
    app.include_router(webhooks_routes.router)
    app.include_router(jobs.router)
    app.include_router(kserve.router)
    # Under /v2 errors answer {"error": ...}, as the KServe v2 protocol's clients expect.
    app.add_exception_handler(StarletteHTTPException, errors.http_error)
    app.add_exception_handler(RequestValidationError, errors.http_error)
    app.add_exception_handler(ClientDisconnect, client_went_away)
    app.add_exception_handler(sqlite3.OperationalError, storage_full)
    app.add_exception_handler(OSError, storage_full)
    app.add_exception_handler(Exception, internal_error)
    app.include_router(metrics_module.router)
    app.state.metrics = metrics
    app.state.api_keys = ApiKeys(settings.api_keys, settings.api_keys_readonly)
    openapi.install(app)  # its error answers, other media types
    if app.state.api_keys.enabled:  # /docs asks for the key, and sends it
        schema_of = app.openapi
        app.openapi = lambda: with_bearer_scheme(schema_of())  # type: ignore[method-assign]
    # Outermost last: CORS answers preflights and decorates 401s; metrics count refusals.
    app.add_middleware(HeadAsGet, routes=app.router.routes)  # innermost: HEAD is seen as HEAD
    app.add_middleware(JsonBodyLimit)  # inside the key check: a stranger gets 401 first
    app.add_middleware(
        ApiKeyMiddleware,
        keys=app.state.api_keys,
        origins=settings.cors_origins,
        public_url=settings.public_url,
    )
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics)
    # Outside all that may answer before a body is read, and the metrics: a refusal's time is
    # its answer's, not the drain's.
    app.add_middleware(RequestBody, idle_s=settings.body_timeout_s)
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"],
            allow_headers=[
                "Authorization",
                "Content-Type",
                "X-Request-Deadline-Ms",
                "X-Request-Id",
                "Inference-Header-Content-Length",  # KServe v2 binary tensors
                "Range",  # clips played from a point
                "Last-Event-ID",  # an EventSource resuming
            ],
            # What pictures carry besides the JPEG (/detect?format=jpeg, latest.jpg).
            expose_headers=[
                "Retry-After",
                "X-Detections",
                "X-Inference-Ms",
                "X-Request-Id",
                "X-Complete",
                "X-Job-State",
                "WWW-Authenticate",
                "X-Frame",
                "X-Captured-At",
                # A job's or a stream's address (201/202), a download's file name (CSV,
                # YAML, clips), a clip's range, KServe's binary answer.
                "Location",
                "Content-Disposition",
                "Content-Range",
                "Accept-Ranges",
                "Inference-Header-Content-Length",
            ],
        )
    app.add_middleware(RequestIdMiddleware)  # outermost: every answer and line carries it
    app.include_router(viewer.router)
    # Before /static, whose mount would take /static/docs/... too.
    app.mount(viewer.DOCS_STATIC_PATH, viewer.docs_files(), name="docs-static")
    app.mount(viewer.STATIC_PATH, viewer.static_files(), name="static")
    return app
