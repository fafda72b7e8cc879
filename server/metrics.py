"""Prometheus metrics: one registry per app, exposed at ``GET /metrics``.

Names follow Prometheus conventions: base units in the name (``_seconds``, ``_bytes``,
``_ratio``), ``_total`` on counters, and only bounded label values (route templates, not raw
paths; a fixed set of stages and rejection reasons; stream ids, bounded by how many streams
the server runs).

Two things are read at scrape time through hooks rather than pushed:

* the engine pool (queue depth per lane, estimated wait): :meth:`Metrics.bind_pool`;
* live streams (fps in/processed, frames, drops, reconnects):
  :meth:`Metrics.set_stream_source` takes a callable returning :class:`StreamSample` items,
  so the stream manager plugs in without this module importing it::

      metrics = get_metrics(app)            # or request.app / websocket.app
      metrics.set_stream_source(manager.metric_samples)

GPU utilisation and memory come from NVML when ``pynvml`` (``nvidia-ml-py``) is installed
and a GPU answers; otherwise those series are simply absent.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import APIRouter, Request, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engines.pool import EnginePool
from server.routes.paths import app_path, is_v2_path
from streams.fanout import ProcessedFrame

log = logging.getLogger(__name__)

# The `_created` series double the exposition and no dashboard reads them.
disable_created_metrics()  # type: ignore[no-untyped-call]

# Seconds. Spans a GPU batch (a few ms) to a CPU request under load (seconds).
LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0,
    1.1, 1.25, 1.5, 2.0, 2.5, 5.0, 10.0,
)  # fmt: skip
LOOP_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
LOOP_LAG_INTERVAL_S = 0.1
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
STAGES = ("queue", "preprocess", "inference", "postprocess", "total")
"""``preprocess`` is reading and decoding the upload; ``inference`` is the engine's batch
time, which includes letterbox and NMS (they run inside the engine, on the device for GPU
backends); ``postprocess`` is building the response."""
REJECTION_REASONS = ("deadline", "queue_full", "expired", "not_ready", "shutting_down")
UNROUTED = "<unrouted>"


@dataclass(frozen=True, slots=True)
class StreamSample:
    """One stream's figures at scrape time, from the stream manager.

    Attributes:
        stream_id: the stream's id (a label value; the set of streams is bounded).
        fps_in: frames/s decoded from the source, recent average.
        fps_processed: frames/s that went through the engine, recent average.
        frames_in: frames received since the stream was added.
        frames_decoded: of those, frames decoded (all but where only keyframes are).
        frames_copied: frames copied out of a decode process's shared memory because
            something kept more than half the stream's slots (``--decode-processes``).
        state: connecting, live, reconnecting, failed, stopped or disabled.
        frames_processed: frames run through the engine since the stream was added.
        drops: frames replaced by a newer one before the engine took them.
        publish_drops: frames run through the engine (counted in ``frames_processed``) but not
            published to the stream's viewers and observers: the event loop fell behind and
            a newer frame took its place (frames with events are always published).
        reconnects: times the source was reopened after a failure.
        frames_failed: frames the engine failed on (each also logged).
        motion_skipped: frames not inferred because nothing moved (streams with motion on).
        skipped: frames left out by the stream's ``max_fps`` (where only keyframes are
            decoded, the others too): with the counts above, every frame received.
        detections: detections since the stream was added, by class name.
        objects: detections in the last processed frame, by class name.
        tracked: objects counted once each by the stream's tracker, by class name.
        crossings: objects that crossed the stream's counting lines, by ``(line, direction,
            class name)``.
        zone_objects: detections standing in each zone in the last frame, by ``(zone, class
            name)``.
        zone_entries: tracked objects that entered each zone, by ``(zone, class name)``.
        zone_exits: tracked objects that exited each zone (or were lost in it), by ``(zone,
            class name)``.
        zone_loiters: tracked objects that stayed in each zone its ``loiter_s``, by ``(zone,
            class name)``.
        viewers: WebSocket and MJPEG viewers attached now.
        viewer_drops: messages dropped for the stream's viewers (each a frame a slow viewer
            did not get; its events went with the next one), since the stream was added.
    """

    stream_id: str
    fps_in: float
    fps_processed: float
    frames_in: int
    frames_processed: int
    drops: int
    reconnects: int
    frames_failed: int = 0
    motion_skipped: int = 0
    skipped: int = 0
    frames_decoded: int = 0
    frames_copied: int = 0
    publish_drops: int = 0
    state: str = ""
    detections: Mapping[str, int] = field(default_factory=dict)
    objects: Mapping[str, int] = field(default_factory=dict)
    tracked: Mapping[str, int] = field(default_factory=dict)
    crossings: Mapping[tuple[str, str, str], int] = field(default_factory=dict)
    zone_objects: Mapping[tuple[str, str], int] = field(default_factory=dict)
    zone_entries: Mapping[tuple[str, str], int] = field(default_factory=dict)
    zone_exits: Mapping[tuple[str, str], int] = field(default_factory=dict)
    zone_loiters: Mapping[tuple[str, str], int] = field(default_factory=dict)
    viewers: int = 0
    viewer_drops: int = 0


StreamSource = Callable[[], Iterable[StreamSample]]


class _Nvml(Protocol):
    """The part of ``pynvml`` the GPU collector uses (a fake can stand in for tests)."""

    def nvmlDeviceGetCount(self) -> int: ...  # noqa: N802

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any: ...  # noqa: N802

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any: ...  # noqa: N802

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any: ...  # noqa: N802


class NvmlCollector(Collector):
    """GPU utilisation and memory per device, read from NVML at scrape time."""

    def __init__(self, nvml: _Nvml) -> None:
        self._nvml = nvml
        count = nvml.nvmlDeviceGetCount()
        self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]

    def collect(self) -> Iterator[Metric]:
        util = GaugeMetricFamily(
            "streamdet_gpu_utilization_ratio",
            "Fraction of the last sample period the GPU was busy (NVML), 0..1",
            labels=["gpu"],
        )
        used = GaugeMetricFamily(
            "streamdet_gpu_memory_used_bytes", "GPU memory in use (NVML)", labels=["gpu"]
        )
        total = GaugeMetricFamily(
            "streamdet_gpu_memory_total_bytes", "GPU memory installed (NVML)", labels=["gpu"]
        )
        for index, handle in enumerate(self._handles):
            try:
                rates = self._nvml.nvmlDeviceGetUtilizationRates(handle)
                mem = self._nvml.nvmlDeviceGetMemoryInfo(handle)
            except Exception as exc:  # a GPU fallen off the bus must not break /metrics
                log.warning("NVML read of gpu %d failed: %s", index, exc)
                continue
            util.add_metric([str(index)], float(rates.gpu) / 100.0)
            used.add_metric([str(index)], float(mem.used))
            total.add_metric([str(index)], float(mem.total))
        yield from (util, used, total)


def nvml_collector() -> NvmlCollector | None:
    """An NVML collector when ``pynvml`` imports and reports at least one GPU, else ``None``."""
    try:
        import pynvml

        pynvml.nvmlInit()
        if pynvml.nvmlDeviceGetCount() < 1:
            return None
        return NvmlCollector(pynvml)
    except Exception as exc:  # no package, no driver, no device: no GPU series
        log.debug("no NVML GPU metrics: %s", exc)
        return None


class _ScrapeCollector(Collector):
    """Queue depth and stream figures, read from their owners when Prometheus scrapes."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        pool = self._metrics.pool
        if pool is not None:
            yield GaugeMetricFamily(
                "streamdet_ready",
                "1 once the model is loaded and warmed and the engines take work, 0 again"
                " while it shuts down (as GET /readyz)",
                value=1.0
                if (ready() if (ready := self._metrics.ready_source) else pool.ready)
                else 0.0,
            )
            interactive, streams = pool.queue.depth()
            depth = GaugeMetricFamily(
                "streamdet_queue_depth", "Items waiting for an engine, by lane", labels=["lane"]
            )
            depth.add_metric(["interactive"], interactive)
            depth.add_metric(["stream"], streams)
            depth.add_metric(["background"], pool.queue.background_depth())
            yield depth
        wait = self._metrics.wait_source
        if wait is not None:
            yield GaugeMetricFamily(
                "streamdet_estimated_wait_seconds",
                "Expected queueing delay of a new /detect call (admission control's estimate)",
                value=wait(),
            )
        decode = self._metrics.decode_source
        if decode is not None and (stats := decode()) is not None:
            running, exits = stats
            yield GaugeMetricFamily(
                "streamdet_decode_processes",
                "Decode processes running (--decode-processes; started at the first stream)",
                value=running,
            )
            yield CounterMetricFamily(
                "streamdet_decode_process_exits",
                "Decode processes that died; each is started again and its streams reopen,"
                " unless it died right after starting",
                value=exits,
            )
        jobs = self._metrics.job_source
        if jobs is not None:
            kept = GaugeMetricFamily(
                "streamdet_jobs", "Video jobs kept, by state", labels=["state"]
            )
            for job_state, n in jobs().items():
                kept.add_metric([job_state], n)
            yield kept
        source = self._metrics.stream_source
        if source is None:
            return
        try:
            samples = list(source())
        except Exception:
            log.exception("stream metrics source failed")
            return
        fps = GaugeMetricFamily(
            "streamdet_stream_fps",
            "Recent frames/s per stream: decoded from the source (in) or run through the engine"
            " (processed)",
            labels=["stream", "direction"],
        )
        counters = {
            "frames_received": CounterMetricFamily(
                "streamdet_stream_frames_received",
                "Frames the source sent (decoded or not: see"
                " streamdet_stream_frames_decoded_total); each ends processed, dropped,"
                " skipped, motion-skipped or failed",
                labels=["stream"],
            ),
            "frames_processed": CounterMetricFamily(
                "streamdet_stream_frames_processed",
                "Frames run through the engine",
                labels=["stream"],
            ),
            "frames_dropped": CounterMetricFamily(
                "streamdet_stream_frames_dropped",
                "Frames that were not run or published: replaced by a newer one before the"
                " engine took them, past their deadline, or answered after a newer frame",
                labels=["stream"],
            ),
            "publish_dropped": CounterMetricFamily(
                "streamdet_stream_frames_publish_dropped",
                "Frames run through the engine (so counted as processed) but not published:"
                " the event loop fell behind and newer frames took their place",
                labels=["stream"],
            ),
            "reconnects": CounterMetricFamily(
                "streamdet_stream_reconnects",
                "Times the source was reopened after a failure",
                labels=["stream"],
            ),
            "frames_skipped": CounterMetricFamily(
                "streamdet_stream_frames_skipped",
                "Frames left out by the stream's max_fps (never sent to the engine)",
                labels=["stream"],
            ),
            "frames_failed": CounterMetricFamily(
                "streamdet_stream_frames_failed",
                "Frames the engine failed on",
                labels=["stream"],
            ),
            "motion_skipped": CounterMetricFamily(
                "streamdet_stream_frames_motion_skipped",
                "Frames not inferred because nothing moved (streams with motion on)",
                labels=["stream"],
            ),
            "frames_decoded": CounterMetricFamily(
                "streamdet_stream_frames_decoded",
                "Frames decoded (the others left in their packets: keyframes only)",
                labels=["stream"],
            ),
            "viewer_drops": CounterMetricFamily(
                "streamdet_stream_viewer_messages_dropped",
                "Frames a slow WebSocket or MJPEG viewer did not get (its queue full; their"
                " events went with the next frame), over all the stream's viewers",
                labels=["stream"],
            ),
            "frames_copied": CounterMetricFamily(
                "streamdet_stream_frames_copied",
                "Frames copied out of a decode process's shared memory (its slots were kept:"
                " slow viewers)",
                labels=["stream"],
            ),
        }
        detections = CounterMetricFamily(
            "streamdet_stream_detections",
            "Detections per stream and class since the stream was added",
            labels=["stream", "class"],
        )
        objects = GaugeMetricFamily(
            "streamdet_stream_objects",
            "Detections per stream and class in its last processed frame (classes seen so far)",
            labels=["stream", "class"],
        )
        tracked = CounterMetricFamily(
            "streamdet_stream_tracked_objects",
            "Objects per stream and class, each counted once by the stream's tracker (streams"
            " with track on)",
            labels=["stream", "class"],
        )
        crossings = CounterMetricFamily(
            "streamdet_stream_line_crossings",
            "Tracked objects that crossed a stream's counting line, by line, direction and class",
            labels=["stream", "line", "direction", "class"],
        )
        zone_objects = GaugeMetricFamily(
            "streamdet_stream_zone_objects",
            "Detections standing in a stream's zone in its last processed frame, by class",
            labels=["stream", "zone", "class"],
        )
        zone_entries = CounterMetricFamily(
            "streamdet_stream_zone_entries",
            "Tracked objects that entered a stream's zone, by class",
            labels=["stream", "zone", "class"],
        )
        zone_exits = CounterMetricFamily(
            "streamdet_stream_zone_exits",
            "Tracked objects that exited a stream's zone (or were lost in it), by class",
            labels=["stream", "zone", "class"],
        )
        zone_loiters = CounterMetricFamily(
            "streamdet_stream_zone_loiters",
            "Tracked objects that stayed in a stream's zone its loiter_s, by class",
            labels=["stream", "zone", "class"],
        )
        viewers = GaugeMetricFamily(
            "streamdet_stream_viewers",
            "WebSocket and MJPEG viewers attached to each stream",
            labels=["stream"],
        )
        state = GaugeMetricFamily(
            "streamdet_stream_state",
            "1 for the state each stream is in (connecting, live, reconnecting, failed, stopped,"
            " disabled): alert on reconnecting or failed",
            labels=["stream", "state"],
        )
        for s in samples:
            if s.state:
                state.add_metric([s.stream_id, s.state], 1)
            fps.add_metric([s.stream_id, "in"], s.fps_in)
            fps.add_metric([s.stream_id, "processed"], s.fps_processed)
            counters["frames_received"].add_metric([s.stream_id], s.frames_in)
            counters["frames_processed"].add_metric([s.stream_id], s.frames_processed)
            counters["frames_dropped"].add_metric([s.stream_id], s.drops)
            counters["publish_dropped"].add_metric([s.stream_id], s.publish_drops)
            counters["reconnects"].add_metric([s.stream_id], s.reconnects)
            counters["frames_failed"].add_metric([s.stream_id], s.frames_failed)
            counters["motion_skipped"].add_metric([s.stream_id], s.motion_skipped)
            counters["frames_skipped"].add_metric([s.stream_id], s.skipped)
            counters["frames_decoded"].add_metric([s.stream_id], s.frames_decoded)
            counters["frames_copied"].add_metric([s.stream_id], s.frames_copied)
            counters["viewer_drops"].add_metric([s.stream_id], s.viewer_drops)
            viewers.add_metric([s.stream_id], s.viewers)
            for name, count in s.detections.items():
                detections.add_metric([s.stream_id, name], count)
                objects.add_metric([s.stream_id, name], s.objects.get(name, 0))
            for name, count in s.tracked.items():
                tracked.add_metric([s.stream_id, name], count)
            for (line, direction, name), count in s.crossings.items():
                crossings.add_metric([s.stream_id, line, direction, name], count)
            for (zone, name), count in s.zone_objects.items():
                zone_objects.add_metric([s.stream_id, zone, name], count)
            for (zone, name), count in s.zone_entries.items():
                zone_entries.add_metric([s.stream_id, zone, name], count)
            for (zone, name), count in s.zone_exits.items():
                zone_exits.add_metric([s.stream_id, zone, name], count)
            for (zone, name), count in s.zone_loiters.items():
                zone_loiters.add_metric([s.stream_id, zone, name], count)
        yield state
        yield fps
        yield viewers
        yield from counters.values()
        yield detections
        yield objects
        yield tracked
        yield crossings
        yield zone_objects
        yield zone_entries
        yield zone_exits
        yield zone_loiters


class Metrics:
    """Every metric streamdet exports, on its own registry (so tests can build many apps).

    Args:
        gpu: add NVML GPU metrics when a GPU is present (``None``: detect).
    """

    def __init__(self, gpu: NvmlCollector | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.pool: EnginePool | None = None
        self.ready_source: Callable[[], bool] | None = None
        self.stream_source: StreamSource | None = None
        self.wait_source: Callable[[], float] | None = None
        self.job_source: Callable[[], dict[str, int]] | None = None
        self.decode_source: Callable[[], tuple[int, int] | None] | None = None
        self.requests = Counter(
            "streamdet_http_requests",
            "HTTP requests answered, by route template, method and status code",
            ["route", "method", "status"],
            registry=reg,
        )
        self.request_duration = Histogram(
            "streamdet_http_request_duration_seconds",
            "Time from request arrival to the end of the response, by route template",
            ["route", "method"],
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.stage_duration = Histogram(
            "streamdet_detect_stage_duration_seconds",
            "Time a successful /detect call spent in each stage (queue, preprocess, inference,"
            " postprocess, total)",
            ["stage"],
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.stream_latency = Histogram(
            "streamdet_stream_frame_latency_seconds",
            "Time from a stream frame's decode to its publication to viewers, events and MQTT"
            " (queue, inference, tracking and analytics), every stream",
            registry=reg,
            buckets=LATENCY_BUCKETS,
        )
        self.batch_size = Histogram(
            "streamdet_batch_size",
            "Images per engine batch",
            buckets=BATCH_BUCKETS,
            registry=reg,
        )
        self.batch_duration = Histogram(
            "streamdet_batch_duration_seconds",
            "Engine time per batch (pre-processing, inference and NMS)",
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.rejections = Counter(
            "streamdet_rejections",
            "Requests refused instead of served, by reason (deadline: predicted to miss it;"
            " queue_full; expired: deadline passed in the queue; not_ready; shutting_down)",
            ["reason"],
            registry=reg,
        )
        self.calls = Counter(
            "streamdet_inference_calls",
            "Calls for inference (/detect, KServe v2 over HTTP and gRPC) that asked to be"
            " admitted, refused ones included: what streamdet_rejections_total is a share of",
            registry=reg,
        )
        self.loop_lag = Histogram(
            "streamdet_event_loop_lag_seconds",
            "How late the event loop ran a timer (sampled every 100 ms): time every HTTP and"
            " WebSocket step waits behind other work",
            buckets=LOOP_LAG_BUCKETS,
            registry=reg,
        )
        self.admission_budget_scale = Gauge(
            "streamdet_admission_budget_ratio",
            "Share of a /detect deadline admission plans for; below 1 when recent calls ran"
            " late (it tracks the 99th percentile)",
            registry=reg,
        )
        self.admission_budget_scale.set(1.0)
        self.admission_probes = Counter(
            "streamdet_admission_probes",
            "Calls the corrected prediction refused but admission let through to measure the"
            " server again: nothing interactive was queued or running and the model alone"
            " said they fit (a refused call measures nothing, so a lesson of a burst only"
            " faded on a timer)",
            registry=reg,
        )
        self.webhook_events = Counter(
            "streamdet_webhook_events",
            "Events a webhook took (sent), or that left the event log before it could"
            " (missed), by webhook: its URL as GET /webhooks shows it (credentials, query and"
            " token-like path segments hidden, then a hash of the whole URL)",
            ["webhook", "outcome"],
            registry=reg,
        )
        self.event_snapshots = Counter(
            "streamdet_event_snapshots",
            "Frames with events drawn as JPEG snapshots (made), or not because too many were"
            " being drawn (skipped), or that could not be written (failed)",
            ["outcome"],
            registry=reg,
        )
        self.event_clips = Counter(
            "streamdet_event_clips",
            "Event clips written (made), or not (failed: the source was lost before one began,"
            " or writing it failed)",
            ["outcome"],
            registry=reg,
        )
        # Exported once an MQTT publisher starts (show_mqtt): a server without a broker
        # showed streamdet_mqtt_connected 0, and an alert on it fired on each such server.
        self.mqtt_events = Counter(
            "streamdet_mqtt_events",
            "Events published to the MQTT broker (sent), or that left the event log before it"
            " could take them (missed)",
            ["outcome"],
            registry=None,
        )
        self.mqtt_connected = Gauge(
            "streamdet_mqtt_connected",
            "1 while the MQTT broker (setting STREAMDET_MQTT_URL) is connected, else 0",
            registry=None,
        )
        self._mqtt_shown = False
        self.webhook_failures = Counter(
            "streamdet_webhook_failures",
            "Webhook POSTs that failed (no answer in time, or not 2xx); each is retried",
            ["webhook"],
            registry=reg,
        )
        for stage in STAGES:
            self.stage_duration.labels(stage)
        for reason in REJECTION_REASONS:
            self.rejections.labels(reason)
        ProcessCollector(registry=reg)
        reg.register(_ScrapeCollector(self))
        if gpu is not None:
            reg.register(gpu)

    def show_mqtt(self) -> None:
        """Export the MQTT publisher's metrics (once; only a server with a broker has them)."""
        if not self._mqtt_shown:
            self._mqtt_shown = True
            self.registry.register(self.mqtt_events)
            self.registry.register(self.mqtt_connected)

    def bind_pool(self, pool: EnginePool, ready: Callable[[], bool] | None = None) -> None:
        """Read queue depth from ``pool`` and record every batch it runs; ``ready`` says what
        ``GET /readyz`` says (the pool's readiness by default)."""
        self.pool = pool
        self.ready_source = ready
        pool.batch_observers.append(self.observe_batch)

    def set_wait_source(self, source: Callable[[], float] | None) -> None:
        """Plug in the admission controller's wait estimate (seconds) for a new call."""
        self.wait_source = source

    def set_job_source(self, source: Callable[[], dict[str, int]] | None) -> None:
        """Plug in the job manager's kept jobs by state."""
        self.job_source = source

    def set_decode_source(self, source: Callable[[], tuple[int, int] | None] | None) -> None:
        """Plug in the stream manager's decode processes (running, died)."""
        self.decode_source = source

    def set_stream_source(self, source: StreamSource | None) -> None:
        """Plug in (or remove) the stream manager's per-stream figures."""
        self.stream_source = source

    def observe_stream_frame(self, frame: ProcessedFrame) -> None:
        """A stream frame published (a stream manager's frame observer)."""
        self.stream_latency.observe(frame.latency_ms / 1000.0)

    def observe_batch(self, size: int, elapsed_s: float) -> None:
        """A batch observer for :attr:`EnginePool.batch_observers` (runs on a worker thread)."""
        self.batch_size.observe(size)
        self.batch_duration.observe(elapsed_s)

    def observe_stages(self, stages: dict[str, float]) -> None:
        """Record one successful /detect call; keys are :data:`STAGES`, values seconds."""
        for stage, seconds in stages.items():
            self.stage_duration.labels(stage).observe(seconds)

    def refuse_unready(self, shutting_down: bool) -> None:
        """A call for inference refused before admission: no model yet, or going away."""
        self.calls.inc()
        self.reject("shutting_down" if shutting_down else "not_ready")

    def reject(self, reason: str) -> None:
        """Count one refused request; ``reason`` is one of :data:`REJECTION_REASONS`."""
        if reason not in REJECTION_REASONS:
            raise ValueError(f"unknown rejection reason {reason!r}; add it to REJECTION_REASONS")
        self.rejections.labels(reason).inc()

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)


async def watch_loop_lag(metrics: Metrics, interval_s: float = LOOP_LAG_INTERVAL_S) -> None:
    """Sample the event loop's lag forever (run it as a task; cancel it to stop)."""
    loop = asyncio.get_running_loop()
    while True:
        start = loop.time()
        await asyncio.sleep(interval_s)
        metrics.loop_lag.observe(max(0.0, loop.time() - start - interval_s))


def get_metrics(conn: HTTPConnection) -> Metrics:
    """The app's :class:`Metrics` (set by ``create_app``)."""
    metrics: Metrics = conn.app.state.metrics
    return metrics


def route_template(scope: Scope) -> str:
    """The matched route's path template (``/streams/{stream_id}``), never the raw path.

    Requests answered before routing (refused by the API-key check) or matching no route
    share the label :data:`UNROUTED` (their status code tells them apart).
    """
    path = getattr(scope.get("route"), "path", None)
    return path if isinstance(path, str) else UNROUTED


SHUTDOWN_DETAIL = (
    "server shutting down: the call was not answered within the graceful shutdown"
    " (setting STREAMDET_SHUTDOWN_TIMEOUT_S)"
)


def shutdown_body(scope: Scope) -> bytes:
    """The middleware's answer to a call the shutdown cancelled: under ``/v2`` as KServe's
    errors are (tritonclient reads "error"), elsewhere FastAPI's."""
    key = "error" if is_v2_path(app_path(scope)) else "detail"
    return json.dumps({key: SHUTDOWN_DETAIL}).encode()


def _cancelled_by_shutdown(scope: Scope, exc: asyncio.CancelledError) -> bool:
    """Whether the server's shutdown cancelled the call (the routes' own test of it)."""
    # The routes import this module: theirs is imported when first needed.
    from server.routes.detect import UVICORN_SHUTDOWN_CANCEL, cancelled_by_shutdown

    app = scope.get("app")
    if getattr(getattr(app, "state", None), "streamdet", None) is None:
        return bool(exc.args and exc.args[0] == UVICORN_SHUTDOWN_CANCEL)
    return cancelled_by_shutdown(Request(scope), exc)


class RequestMetricsMiddleware:
    """Counts and times every HTTP request by route template, method and status."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500  # what the client gets if the app raises before answering
        started = gone = False

        async def receive_wrapper() -> Message:
            nonlocal gone
            message = await receive()
            gone = gone or message["type"] == "http.disconnect"
            return message

        async def send_wrapper(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = int(message["status"]), True
            await send(message)

        try:
            await self.app(scope, receive_wrapper, send_wrapper)
        except asyncio.CancelledError as exc:
            # Cancelled before any answer: it was counted 500 whatever it was. The client
            # gone, nothing is answered (uvicorn logs no line): 499, as the routes answer a
            # client that left. The shutdown's cancel is answered 503 here, which uvicorn's
            # access log shows (it answered and logged its own 500); any other stays 500.
            if started:
                raise
            if gone:
                status = 499
                raise
            if not _cancelled_by_shutdown(scope, exc):
                raise
            status = 503
            if (task := asyncio.current_task()) is not None:
                task.uncancel()  # answered instead: the cancellation is handled
            await send_wrapper(
                {
                    "type": "http.response.start",
                    "status": 503,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"retry-after", b"5"),
                        (b"connection", b"close"),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": shutdown_body(scope)})
        finally:
            route = route_template(scope)
            method = str(scope.get("method", "GET"))
            self.metrics.requests.labels(route, method, str(status)).inc()
            self.metrics.request_duration.labels(route, method).observe(time.perf_counter() - start)


router = APIRouter()


@router.get("/metrics", include_in_schema=False)
async def metrics_endpoint(request: Request) -> Response:
    """Prometheus text exposition of every streamdet metric."""
    return Response(get_metrics(request).render(), media_type=CONTENT_TYPE_LATEST)
