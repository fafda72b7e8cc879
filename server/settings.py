"""The one settings object: environment variables (``STREAMDET_*``) and ``serve`` flags."""

from __future__ import annotations

import difflib
import functools
import ipaddress
import json
import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


@functools.lru_cache(maxsize=1)
def _warn_small_shm(size: int, procs: int) -> None:
    """Said once per process, however often settings are made."""
    logging.getLogger(__name__).warning(
        "shared memory (/dev/shm) holds %d MiB: too little for decode processes' frames (a"
        " 1080p stream decoded whole takes 47 MB, at 640 pixels 5 MB: setting"
        " STREAMDET_STREAM_DECODE_SIZE), so streams decode in the server process; for the %d"
        " decode processes a GPU engine gets by default, give it more (docker run --shm-size"
        " 2g) or choose with setting STREAMDET_DECODE_PROCESSES",
        size // 2**20,
        procs,
    )


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "streamdet"


def _default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "streamdet"


def check_webhook_url(
    url: str, field: str = "webhooks", setting: str = " (setting STREAMDET_WEBHOOKS)"
) -> str:
    """``url`` if it is an absolute http(s) URL with a host and port a request can go to.

    Raises:
        ValueError: naming ``field`` and the ``setting`` (its password and token masked).
    """
    from streams.sources import redact  # its password and token: the error is shown

    try:
        parts = urlsplit(url)
        port = parts.port  # raises on a port that is no number or out of range
    except ValueError as exc:
        raise ValueError(f"{field}: {redact(url)!r}: {exc}{setting}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{field}: {redact(url)!r} is not an http:// or https:// URL{setting}")
    # Accepted, then failed on every try for ever ("Invalid port", "All connection attempts
    # failed"): a port of 0, a host with a space or other characters no host name has.
    if port == 0 or not _HOST.fullmatch(parts.hostname):
        raise ValueError(
            f"{field}: {redact(url)!r}: not a host and port a request can go to{setting}"
        )
    return url


_HOST = re.compile(r"[A-Za-z0-9._~%!$&'()*+,;=:-]+")
"""What a URL's host may hold (RFC 3986's reg-name, an IPv4 or an IPv6 address)."""


def check_public_url(url: str) -> str:
    """``url`` without its final ``/`` if it is an http(s) URL with a host and nothing a base
    cannot carry (no query, fragment or credentials, which every receiver would be sent).

    Raises:
        ValueError: naming the setting.
    """
    text = url.strip()
    setting = "(setting STREAMDET_PUBLIC_URL)"
    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 - raises on a port that is no number or out of range
    except ValueError as exc:
        raise ValueError(f"{text[:80]!r}: {exc} {setting}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"{text[:80]!r} is not an http:// or https:// URL with a host, such as"
            f" https://cams.example.com/streamdet {setting}"
        )
    if "?" in text or "#" in text:
        raise ValueError(
            f"{text[:80]!r} has a query or a fragment: give the address the app"
            f" is reached at, paths are added after it {setting}"
        )
    if parts.username is not None or parts.password is not None:
        raise ValueError(
            f"{parts.scheme}://...@{parts.hostname}: credentials in it would go to"
            f" every webhook, MQTT and callback receiver; leave them out {setting}"
        )
    return text.rstrip("/")


def public_url_mismatch(public_url: str | None, root_path: str) -> str | None:
    """Why ``public_url`` and ``root_path`` disagree, or None: the proxy strips the root path
    from what it forwards, so the public URL's path should end with it (URLs pushed out
    would answer 404 at the proxy otherwise)."""
    if public_url is None or not root_path:
        return None
    path = urlsplit(public_url).path.rstrip("/")
    if path.endswith(root_path):
        return None
    return (
        f"public_url {public_url!r} does not end with root_path {root_path!r}: the URLs sent"
        " to webhooks, MQTT and job callbacks start with the public URL, while the proxy"
        f" serves the app under {root_path}; give a public URL ending with it (setting"
        " STREAMDET_PUBLIC_URL) or correct the root path (setting STREAMDET_ROOT_PATH)"
    )


DEFAULT_MAX_BATCH = {"onnxruntime": 1, "torch": 32, "tensorrt": 32}


class Settings(BaseSettings):
    """Server settings. Every field is ``STREAMDET_<NAME>`` in the environment and
    ``--<name>`` (dashes for underscores) on ``streamdet serve``."""

    # allow_inf_nan=False: "inf" or "nan" parse as floats, and passed every ge= bound to
    # crash later (math.ceil(inf) at shutdown, int(inf) on every upload). extra="ignore":
    # other STREAMDET_* variables (tests', scripts') are not settings; serve warns of
    # misspelt ones (unknown_env_settings).
    model_config = SettingsConfigDict(
        env_prefix="STREAMDET_", extra="ignore", frozen=True, allow_inf_nan=False
    )

    # Model and engine
    model: str = Field(
        "yolov8n.pt", description="Ultralytics .pt checkpoint, .torchscript export or .onnx file"
    )
    backend: str = Field("onnxruntime", description="onnxruntime | torch | tensorrt")
    device: str = Field("cpu", description="cpu, cuda or cuda:N (GPU backends)")
    decode: Literal["cpu", "cuda"] = Field(
        "cpu",
        description="stream video decode: cpu, or cuda (NVDEC on --device, frames stay on the"
        " GPU; GPU backends only; falls back to cpu where NVDEC is unavailable)",
    )
    imgsz: int = Field(640, ge=32, le=4096, description="engine input size in pixels")
    max_batch: int = Field(
        0,
        ge=0,
        le=256,
        description="largest batch a worker runs; 0 = the backend's default (onnxruntime 1,"
        " torch/tensorrt 32)",
    )
    max_wait_ms: float = Field(
        4.0, ge=0.0, le=1000.0, description="how long a batch waits to fill after its first item"
    )
    workers: int = Field(
        0,
        ge=0,
        le=64,
        description="engine workers (sessions / CUDA streams); 0 = the backend's default"
        " (onnxruntime one per core, at most 4; torch/tensorrt 2)",
    )
    threads_per_worker: int = Field(
        0, ge=0, le=256, description="intra-op threads per CPU worker; 0 = cores / workers"
    )
    cache_dir: Path = Field(
        default_factory=_default_cache_dir,
        description="exported models (default $XDG_CACHE_HOME/streamdet, ~/.cache/streamdet)",
    )

    # HTTP
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    grpc_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="KServe v2 gRPC (Triton's GRPCInferenceService, its clients' port 8001);"
        " 0: off. Needs the grpc extra",
    )
    root_path: str = Field(
        "",
        max_length=200,
        description="the path prefix a reverse proxy serves the app under, which it strips"
        " (nginx: location /streamdet/ { proxy_pass http://127.0.0.1:8000/; }): /streamdet;"
        " the docs, redirects, Location headers and the viewer carry it. Empty: at the root",
    )
    public_url: str | None = Field(
        None,
        max_length=2000,
        description="the address receivers reach the app at, through the proxy"
        " (https://cams.example.com/streamdet): what the server pushes out (webhooks, MQTT"
        " events, job callbacks) carries absolute URLs under it, and Home Assistant gets it"
        " as each device's configuration_url; HTTP answers keep paths. Empty: paths",
    )
    forwarded_allow_ips: str = Field(
        "127.0.0.1",
        max_length=2000,
        description="comma-separated addresses or networks of the proxies whose"
        " X-Forwarded-For/-Proto are trusted (the client's address and scheme in logs); *: any",
    )
    max_upload_mb: float = Field(
        20.0,
        gt=0,
        le=4096,
        description="largest accepted upload (gRPC messages stop at 2 GiB whatever this says)",
    )
    max_image_pixels: int = Field(
        50_000_000,
        ge=1,
        le=1_000_000_000,
        description="largest decoded image (width x height), of an upload or a stream's frame",
    )
    max_queue: int = Field(
        64, ge=1, le=100_000, description="interactive requests waiting for an engine"
    )
    request_timeout_ms: float = Field(
        10_000.0, gt=0, le=3_600_000, description="deadline of a /detect call, from arrival"
    )
    decode_threads: int = Field(2, ge=1, le=64, description="threads decoding uploads")
    shutdown_timeout_s: float = Field(10.0, ge=0, le=3600, description="drain time on shutdown")
    keep_alive_s: int = Field(
        75,
        ge=1,
        le=3600,
        description="seconds an idle HTTP connection is kept for its client's next request:"
        " longer than a load balancer's idle timeout (AWS ALB's is 60 s, nginx keeps 75 s)"
        " and clients' pools (httpx 5 s), so no request is sent on a connection the server"
        " is closing (uvicorn's own 5 s meets httpx's 5 s: a reset now and then)",
    )
    body_timeout_s: float = Field(
        60.0,
        gt=0,
        le=3600,
        description="seconds a request's body may send nothing while the server reads it"
        " (nginx's client_body_timeout): past it the call is answered 408 and its connection"
        " closed (a client trickling a body held its call and connection for ever)",
    )
    head_timeout_s: float = Field(
        20.0,
        gt=0,
        le=3600,
        description="seconds a request's line and headers may take to arrive (from the"
        " connection's opening or the request's first byte): past it a begun head is"
        " answered 408 and the connection closed, one that sent nothing closed (a client"
        " trickling header bytes held its connection for ever)",
    )
    gil_switch_ms: float = Field(
        1.0,
        gt=0,
        le=100,
        description="how long a Python thread keeps the GIL before handing it over"
        " (sys.setswitchinterval); shorter lets decode threads win it back from busy workers",
    )
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    access_log: bool = Field(True, description="one uvicorn log line per HTTP request")

    # Live streams (streams/, server/routes/streams.py, server/routes/ws.py)
    data_dir: Path = Field(
        default_factory=_default_data_dir,
        description="the server's own data: its streams, events and their snapshots and clips,"
        " video jobs, webhooks (default $XDG_DATA_HOME/streamdet, ~/.local/share/streamdet)",
    )
    allowed_file_dir: Path | None = Field(
        None, description="directory file:// streams may come from; unset = no file streams"
    )
    streams_file: Path | None = Field(
        None,
        description="YAML file declaring streams (ids, URLs with ${ENV} variables, settings):"
        " made to match it at start; the API cannot change them",
    )
    max_streams: int = Field(64, ge=1, le=4096, description="most streams at once")
    stream_codec_threads: int = Field(
        0,
        ge=0,
        le=64,
        description="FFmpeg threads decoding each stream (slice threads, no frame delay);"
        " 0: FFmpeg's choice, one per core (many streams on few cores: 1 spares the switching)",
    )
    decode_processes: int = Field(
        -1,
        ge=-1,
        le=256,
        description="processes that decode streams outside the server's interpreter lock"
        " (frames come back in shared memory); 0: decode threads in the server process;"
        " -1: the backend's default (onnxruntime 0, torch/tensorrt half the cores, 1..8;"
        " 0 where /dev/shm cannot hold 5 streams' rings of 8 frames at the decode size: 5.3"
        " MiB each at 640 pixels, 47.5 MiB decoded whole at 1080p, so Docker's default 64 MB"
        " holds 12 at 640 but only one whole)."
        " NVDEC streams decode in the server process",
    )
    stream_decode_size: int | None = Field(
        None,
        ge=0,
        le=16384,
        description="live streams' and video jobs' frames are decoded scaled down (aspect"
        " kept) so their longer side is at most this many pixels: the engine sees the same"
        " detail, and less is converted, copied and held per frame; detections stay in the"
        " video's pixels. Default: the engine input size (imgsz); 0: as the camera sends them"
        " (full-size snapshots and thumbnails). NVDEC streams are scaled on the GPU instead,"
        " and a job that draws its video decodes whole",
    )
    keyframe_decode: bool = Field(
        True,
        description="decode only the keyframes of a stream whose keyframes come at least as"
        " often as its max_fps samples (no B-frames): the same frames for a fraction of the CPU",
    )
    stream_open_timeout_s: float = Field(
        10.0, gt=0, le=3600, description="time to connect to a source before retrying"
    )
    stream_read_timeout_s: float = Field(
        5.0, gt=0, le=3600, description="time without data before a source counts as lost"
    )
    reconnect_initial_s: float = Field(0.5, gt=0, le=3600, description="first reconnect backoff")
    reconnect_max_s: float = Field(30.0, gt=0, le=86_400, description="longest reconnect backoff")
    reconnect_max_attempts: int = Field(
        0,
        ge=0,
        le=1_000_000,
        description="failed reconnects before a stream is 'failed'; 0 = retry forever",
    )
    stream_frame_deadline_ms: float = Field(
        1000.0, gt=0, le=3_600_000, description="a stream frame not run within this is dropped"
    )
    ws_queue_size: int = Field(
        4, ge=1, le=1024, description="messages kept per WebSocket viewer (oldest dropped)"
    )
    ws_send_timeout_s: float = Field(
        10.0,
        gt=0,
        le=3600,
        description="time one message may take to go out to a WebSocket viewer; a viewer that"
        " stops reading (its socket's buffers full) is dropped after it, and at once when its"
        " stream is removed or the server shuts down",
    )

    # Events: GET /events and webhooks (streams/events.py, server/webhooks.py)
    event_log_size: int = Field(
        10_000,
        ge=1,
        le=1_000_000,
        description="events (line crossings, zone entries and exits) kept for GET /events and"
        " webhooks; a reader further behind is told how many it missed",
    )
    event_snapshots: int = Field(
        256,
        ge=0,
        le=100_000,
        description="frames with events kept as JPEGs for GET /events/{id}/snapshot.jpg"
        " (about 40 kB each at 640 px); 0 = no snapshots",
    )
    event_retain_days: float = Field(
        0.0,
        ge=0.0,
        le=36_500,
        description="delete events, their snapshots, thumbnails and clips older than this many"
        " days (a data-protection policy); 0: kept until the counting limits push them out",
    )
    event_snapshot_width: int = Field(
        640, ge=32, le=3840, description="event snapshots wider than this are scaled down"
    )
    motion_threshold: int = Field(
        25,
        ge=1,
        le=255,
        description="streams with motion on: grey levels a pixel must change by to move",
    )
    motion_min_area: float = Field(
        0.002,
        gt=0.0,
        le=1.0,
        description="streams with motion on: share of the picture that must move for a frame"
        " to be inferred",
    )
    motion_idle_fps: float = Field(
        2.0,
        ge=1.1,
        le=60.0,
        description="streams with motion on: still frames are inferred this often, so still"
        " objects keep their tracks (which end after 1 s unseen)",
    )
    event_clip_pre_s: float = Field(
        5.0,
        ge=0.0,
        le=60.0,
        description="seconds of video before an event in its clip (streams with clips on;"
        " from the keyframe at or before)",
    )
    event_clip_post_s: float = Field(
        5.0, ge=0.0, le=60.0, description="seconds of video after an event in its clip"
    )
    event_clip_max_s: float = Field(
        60.0,
        ge=1.0,
        le=600.0,
        description="longest event clip: events keep extending a clip up to this, then start"
        " a new one",
    )
    event_clips_max_mb: int = Field(
        2048,
        ge=1,
        le=10_000_000,
        description="event clips (<data-dir>/clips) kept up to this size; the oldest go first",
    )
    mqtt_url: str | None = Field(
        None,
        repr=False,
        description="MQTT broker every event is published to: mqtt://[user:password@]host[:port]"
        " (mqtts:// for TLS); none = no MQTT",
    )
    mqtt_topic: str = Field(
        "streamdet",
        min_length=1,
        max_length=128,
        description="first level of the MQTT topics: <topic>/events, <topic>/<stream id>/events,"
        " <topic>/available",
    )
    mqtt_discovery: bool = Field(
        True,
        description="announce each stream's switch, sensors and cameras to Home Assistant"
        " (MQTT discovery), which creates them by itself",
    )
    mqtt_discovery_prefix: str = Field(
        "homeassistant",
        min_length=1,
        max_length=128,
        pattern=r"^[^#+]+$",
        description="Home Assistant's discovery prefix (its MQTT integration's setting)",
    )
    webhooks: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="comma-separated http(s) URLs each sent every event as it happens,"
        ' POST {"events": [...]} in batches, retried with backoff; none = no webhooks',
    )
    webhook_secret: str | None = Field(
        None,
        repr=False,
        description="signs each webhook body: X-Streamdet-Signature: sha256=<HMAC-SHA256 hex>",
    )
    webhook_timeout_s: float = Field(
        5.0, gt=0, le=300, description="time a webhook receiver has to answer one POST"
    )

    # Video jobs: POST /jobs (streams/jobs.py, server/jobs.py)
    max_jobs: int = Field(
        100,
        ge=1,
        le=100_000,
        description="video jobs kept (<data-dir>/jobs): a new one deletes the oldest finished,"
        " and is refused (429) when every kept job is still waiting or running",
    )
    jobs_max_mb: int = Field(
        20_480,
        ge=1,
        le=100_000_000,
        description="video jobs' files (<data-dir>/jobs: uploads, results, drawn videos) kept up"
        " to about this size; the oldest finished go first",
    )
    max_job_upload_mb: float = Field(
        2048.0, gt=0, le=1_048_576, description="largest video a POST /jobs may upload"
    )
    job_concurrency: int = Field(
        1, ge=1, le=64, description="video jobs run at once (the others wait their turn)"
    )
    job_inflight: int = Field(
        0,
        ge=0,
        le=1024,
        description="frames a job keeps at the engines; 0 = workers x max batch (one batch"
        " each). A live frame arriving behind them waits at most for the batch running",
    )

    # Admission control, access and metrics (server/admission.py, server/auth.py)
    admission_deadline_ms: float = Field(
        1000.0,
        ge=0,
        le=3_600_000,
        description="latency a /detect call is admitted for: calls predicted to finish later"
        " get 429 + Retry-After (clients may ask for less with X-Request-Deadline-Ms; 0 = only"
        " request_timeout_ms)",
    )
    api_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        repr=False,
        description="comma-separated bearer tokens with full access; none = no authentication",
    )
    api_keys_readonly: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        repr=False,
        description="comma-separated bearer tokens that may detect and watch streams but not"
        " add or remove them",
    )
    cors_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="comma-separated origins allowed to call the API from a browser"
        " (e.g. https://app.example.com, or * for any); none = no CORS headers",
    )

    @field_validator("root_path")
    @classmethod
    def _root_path(cls, value: str) -> str:
        path = value.strip().rstrip("/")
        if path and (not path.startswith("/") or "?" in path or "#" in path or "//" in path):
            raise ValueError(
                f"{value[:60]!r}: a path prefix such as /streamdet (setting STREAMDET_ROOT_PATH)"
            )
        return path

    @field_validator("public_url")
    @classmethod
    def _public_url(cls, value: str | None) -> str | None:
        return None if value is None or not value.strip() else check_public_url(value)

    @field_validator("api_keys", "api_keys_readonly", "cors_origins", "webhooks", mode="before")
    @classmethod
    def _comma_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                return json.loads(text)
            return [item.strip() for item in text.split(",") if item.strip()]
        return value

    @field_validator("api_keys", "api_keys_readonly", mode="before")
    @classmethod
    def _some_key(cls, value: Any) -> Any:
        # Set to "," (or '[""]'), it gave no key, and the server ran open without a word to
        # the operator who had asked for keys. Empty or blank is unset, as for paths.
        text = value.strip() if isinstance(value, str) else None
        if text and text[0] != "[" and not [k for k in text.split(",") if k.strip()]:
            raise ValueError("no key in it: give comma-separated keys, or leave it unset")
        keys = json.loads(text) if text and text[0] == "[" else value
        if isinstance(keys, list) and any(not (isinstance(k, str) and k.strip()) for k in keys):
            raise ValueError("an empty key: every key must have characters")
        return value

    @field_validator("forwarded_allow_ips")
    @classmethod
    def _proxies(cls, value: str) -> str:
        # A typo ("127.0.0.1/8", "a;b") was kept as text: no proxy was trusted, without a word.
        items = [i.strip() for i in value.split(",") if i.strip()]
        if "*" in items and len(items) > 1:  # uvicorn trusts any only for "*" alone
            raise ValueError(
                f"{value[:60]!r}: * trusts every proxy only on its own; give * alone, or the"
                " proxies' addresses (setting STREAMDET_FORWARDED_ALLOW_IPS)"
            )
        for item in items:
            if item.startswith(("unix:", "/")):  # a Unix socket's path: taken as it is
                continue
            try:
                ipaddress.ip_network(item)  # an address is a network of one
            except ValueError as exc:
                raise ValueError(
                    f"{item[:60]!r}: {exc}; give comma-separated addresses or networks"
                    " (127.0.0.1, 10.0.0.0/8), or * (setting STREAMDET_FORWARDED_ALLOW_IPS)"
                ) from None
        return value

    @field_validator("cors_origins")
    @classmethod
    def _origins(cls, value: list[str]) -> list[str]:
        # A browser sends its Origin as scheme://host[:port], nothing after: one given with a
        # path or a trailing "/" matched no call, and no CORS header was sent.
        for origin in value:
            parts = urlsplit(origin)
            if origin != "*" and (
                parts.scheme not in ("http", "https")
                or not parts.netloc
                or origin != f"{parts.scheme}://{parts.netloc}"
            ):
                raise ValueError(
                    f"{origin[:80]!r} is not an origin: scheme://host[:port], no path or"
                    " trailing '/' (e.g. https://app.example.com), or * (setting"
                    " STREAMDET_CORS_ORIGINS)"
                )
        return value

    @field_validator("device")
    @classmethod
    def _device_name(cls, value: str) -> str:
        # Checked as a setting, before the model loads (after it, and without the flag's
        # name, --device gpu was refused).
        if not re.fullmatch(r"cpu|cuda(:[0-9]+)?", value.strip()):
            raise ValueError(f"{value!r}: give cpu, cuda or cuda:N (setting STREAMDET_DEVICE)")
        return value.strip()

    @field_validator("allowed_file_dir", "streams_file", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: Any) -> Any:
        # A compose file's `STREAMDET_ALLOWED_FILE_DIR=` (or --allowed-file-dir "") means
        # "not set"; Path("") is Path("."), which allowed file streams from the cwd.
        if isinstance(value, str) and not value.strip():
            return None
        return value

    @field_validator("data_dir", "cache_dir", mode="before")
    @classmethod
    def _not_empty(cls, value: Any, info: ValidationInfo) -> Any:
        # Path("") is the cwd: streams, events and jobs would be written wherever the server
        # happened to start. An empty value is more likely a template left unfilled.
        if isinstance(value, str) and not value.strip():
            name = str(info.field_name)
            raise ValueError(
                f"empty: give a directory, or unset STREAMDET_{name.upper()} for the default"
            )
        return value

    @field_validator("webhooks")
    @classmethod
    def _webhook_urls(cls, value: list[str]) -> list[str]:
        return [check_webhook_url(url) for url in value]

    @field_validator("mqtt_url")
    @classmethod
    def _mqtt_url(cls, value: str | None) -> str | None:
        from server.mqtt import check_mqtt_url

        return None if not value else check_mqtt_url(value)

    @field_validator("mqtt_topic")
    @classmethod
    def _mqtt_topic(cls, value: str) -> str:
        from server.mqtt import check_topic_prefix

        return check_topic_prefix(value, "mqtt_topic")

    @field_validator("mqtt_discovery_prefix")
    @classmethod
    def _mqtt_discovery_prefix(cls, value: str) -> str:
        from server.mqtt import check_topic_prefix

        return check_topic_prefix(value, "mqtt_discovery_prefix")

    @model_validator(mode="after")
    def _backend_batch(self) -> Settings:
        if self.backend == "onnxruntime" and self.device != "cpu":
            raise ValueError(  # it ran on the CPU without a word
                f"device {self.device!r} is for the GPU backends: the onnxruntime engine runs"
                " on the CPU; pick --backend torch or tensorrt, or leave --device cpu (setting"
                " STREAMDET_DEVICE)"
            )
        if both := sorted(set(self.api_keys) & set(self.api_keys_readonly)):
            raise ValueError(  # it had full access: a key moved to the read-only list kept it
                f"{len(both)} key(s) in both api_keys and api_keys_readonly: give each key one"
                " kind of access (setting STREAMDET_API_KEYS_READONLY)"
            )
        if self.decode == "cuda" and (
            self.backend == "onnxruntime" or not self.device.startswith("cuda")
        ):
            raise ValueError(
                "decode cuda keeps frames on the GPU for a GPU engine: it needs --backend torch"
                " or tensorrt with --device cuda[:N] (setting STREAMDET_DECODE / --decode)"
            )
        if self.stream_decode_size and self.stream_decode_size < self.imgsz:
            raise ValueError(
                f"stream_decode_size {self.stream_decode_size} is under the engine's input size"
                f" imgsz {self.imgsz}: the engine would enlarge every frame back with less"
                f" detail; for a smaller, faster engine set imgsz {self.stream_decode_size}"
                " instead (setting STREAMDET_STREAM_DECODE_SIZE: 0, or at least imgsz)"
            )
        # On a CPU a batch buys no throughput for single-thread workers (yolov8n, 2 cores,
        # 2 workers x 1 thread, 8 clients: 21.15 img/s at batch 1, 20.9 at 2) but couples
        # latencies: the first image of a batch of 2 waits for the second (idle 98 ms with
        # its 4 ms fill wait against 88 ms; queued calls wait ~190 ms batches instead of
        # ~90 ms). A GPU gains throughput up to large batches.
        if self.max_batch == 0:
            object.__setattr__(self, "max_batch", DEFAULT_MAX_BATCH.get(self.backend, 8))
        # Several single-thread CPU sessions instead of one session on every core: a call
        # arriving while one batch runs starts on the next worker instead of queueing behind
        # it. 2 cores, Poisson arrivals at half capacity: p99 2.9-3.8x the idle latency with
        # 2 workers x 1 thread (60 s runs), 4.3x with 1 worker x 2 threads (idle 85-95 vs
        # 60 ms; benchmarks/queueing_sim.py gives the floors, 2.6x and 4.4x); same capacity.
        from engines.registry import usable_cores

        # On a GPU, two workers are two CUDA streams: one worker's host side (the memcpy into
        # staging, kernel launches, NMS's one sync) runs while the other's model does, as
        # engines/gpu.py is built for and as the H200 run measured (gpu_bench --workers 2).
        cpu = self.backend == "onnxruntime"
        if self.workers == 0:
            object.__setattr__(self, "workers", min(4, usable_cores()) if cpu else 2)
        # The CPU engine runs outside the interpreter lock and needs the cores itself: decode
        # processes bought nothing there (16 cameras on 2 cores: 55.6 vs 63.0 frames/s out,
        # benchmarks/streams_bench.py). A GPU engine's host side is Python that holds the
        # lock, and decode threads beside it starve (benchmarks/gil_bench.py: 22 frames/s
        # beside one busy thread against 339 from a decode process).
        if self.decode_processes == -1:
            procs = 0 if cpu else max(1, min(8, usable_cores() // 2))
            if procs:
                from streams.decode_child import SLOTS, STREAMS_NEEDED, rings_that_fit, shm_size

                side = self.decode_side()  # before the engine is loaded: imgsz's
                shm = shm_size()
                if shm is not None and rings_that_fit(shm, SLOTS, side) < STREAMS_NEEDED:
                    # Rings would not fit (Docker's default /dev/shm, 64 MB, holds one of a
                    # 1080p stream decoded whole): decode threads work everywhere, if slower
                    # beside a GPU engine.
                    _warn_small_shm(shm, procs)
                    procs = 0
            object.__setattr__(self, "decode_processes", procs)
        return self

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, value: str) -> str:
        from engines.registry import BACKENDS

        if value not in BACKENDS:
            known = ", ".join(sorted(BACKENDS))
            raise ValueError(f"unknown backend {value!r}; choose one of: {known}")
        return value

    @field_validator("imgsz")
    @classmethod
    def _stride_multiple(cls, value: int) -> int:
        if value % 32:
            raise ValueError(f"imgsz must be a multiple of 32 (the model stride), got {value}")
        return value

    @property
    def max_upload_bytes(self) -> int:
        return int(self.max_upload_mb * 1024 * 1024)

    def decode_side(self, input_size: int | None = None) -> int:
        """The longest side streams' and jobs' frames are decoded at (0: as sent):
        ``stream_decode_size``, else the engine's ``input_size`` where it is known (a model
        served at its own size, 320 say, decoded at ``imgsz``'s 640), else ``imgsz``."""
        if self.stream_decode_size is not None:
            return self.stream_decode_size
        return input_size or self.imgsz


# STREAMDET_* variables that are not settings: the tests' and scripts' own.
NOT_SETTINGS = frozenset(
    {
        "STREAMDET_SHARED_DIR",
        "STREAMDET_TEST_DEVICE",
        "STREAMDET_GPU_TEST_DEVICE",
        "STREAMDET_CHROMIUM",
    }
)
NOT_SETTINGS_PREFIXES = ("STREAMDET_LOADTEST_",)


def unknown_env_settings(environ: Mapping[str, str]) -> list[tuple[str, str | None]]:
    """``STREAMDET_*`` variables in ``environ`` that name no setting (pydantic-settings
    ignores them, so a misspelt one silently left its setting at the default), each with the
    closest setting's variable (None where none is close)."""
    prefix = "STREAMDET_"
    fields = list(Settings.model_fields)
    unknown = []
    for variable in sorted(environ):
        name = variable.upper()  # pydantic-settings reads them case-insensitively
        if not name.startswith(prefix) or name in NOT_SETTINGS:
            continue
        field = name[len(prefix) :].lower()
        if field in fields or name.startswith(NOT_SETTINGS_PREFIXES):
            continue
        # Matched without the prefix, which every name shares (with it, FOO was "close" to
        # PORT).
        close = difflib.get_close_matches(field, fields, n=1, cutoff=0.7)
        unknown.append((variable, prefix + close[0].upper() if close else None))
    return unknown
