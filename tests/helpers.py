"""Shared test helpers: where the shared model and clips are, and how to compare results."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import socket
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from engines.pool import EnginePool
from engines.registry import EngineConfig
from engines.types import Detections, DetectParams, Engine, Image, ModelInfo
from engines.yolo import box_iou

if TYPE_CHECKING:
    from fastapi import FastAPI

    from loadtest.server import ServerProcess
    from streams.fanout import ProcessedFrame, Subscriber
    from streams.manager import StreamManager

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("STREAMDET_SHARED_DIR", REPO.parent / "shared")).resolve()
MODEL_PT = SHARED / "models" / "yolov8n.pt"
MODEL_TS = SHARED / "models" / "yolov8n.torchscript"  # the same weights, traced at 640x640
VIDEOS = sorted((SHARED / "videos").glob("*.mp4"))
BOTTLE_CLIP = next((v for v in VIDEOS if v.name.startswith("bottle")), Path("missing"))
CAR_CLIP = next((v for v in VIDEOS if v.name.startswith("car")), Path("missing"))
GATE = {"name": "gate", "points": [[0.0, 0.5], [1.0, 0.5]]}
"""A counting line across the middle of the picture, which the car clip's cars cross."""
SHELF = {"name": "shelf", "points": [[0.6, 0.0], [1.0, 0.0], [1.0, 1.0], [0.6, 1.0]]}
"""A zone over the right 40% of the bottle clip, where one of its three bottles stands."""
SHELF_STREAM = {
    "url": f"file://{BOTTLE_CLIP}",
    "max_fps": 8,
    "classes": "bottle",
    "zones": [SHELF],
}
"""``POST /streams``: the bottle clip looping, its bottles counted in :data:`SHELF`."""
CACHE_DIR = REPO / ".cache" / "streamdet"


def detect_json(**changed: Any) -> dict[str, Any]:
    """A stream's ``detect`` as the API shows it: every default, then ``changed``."""
    shown: dict[str, Any] = {
        "conf": 0.25,
        "iou": 0.7,
        "classes": None,
        "max_det": 300,
        "roi": None,
        "track": False,
        "lines": [],
        "zones": [],
        "clips": False,
        "motion": False,
        "motion_mask": [],
        "motion_min_area": None,
        "motion_threshold": None,
        "filters": {},
        "stationary_s": None,
    }
    unknown = changed.keys() - shown.keys()
    assert not unknown, f"not detect settings: {unknown}"
    return shown | changed


# The keys of one WebSocket frame message (``/ws/streams/{id}``).
MESSAGE_KEYS = {
    "stream_id",
    "frame",
    "pts",
    "captured_at",
    "width",
    "height",
    "detections",
    "latency_ms",
}


def ultralytics_assets() -> Path:
    os.environ.setdefault("YOLO_OFFLINE", "true")
    os.environ.setdefault("YOLO_AUTOINSTALL", "false")
    os.environ.setdefault("YOLO_VERBOSE", "false")
    from ultralytics.utils import ASSETS

    return Path(ASSETS)


def match_reference(
    ours: Detections,
    ref_boxes: np.ndarray,
    ref_scores: np.ndarray,
    ref_classes: np.ndarray,
    min_iou: float = 0.9,
    conf_tol: float = 0.02,
    edge_conf: float = 0.3,
) -> list[str]:
    """Problems found matching ``ours`` against reference detections (empty list: match).

    Each reference box must have a box of the same class with IoU >= ``min_iou`` and a
    confidence within ``conf_tol``, and vice versa. Detections whose confidence lies within
    ``conf_tol`` of the threshold may appear on one side only (they sit on the cut-off); the
    caller passes ``edge_conf`` = threshold + tolerance.
    """
    problems: list[str] = []

    def one_way(
        a_boxes: np.ndarray,
        a_scores: np.ndarray,
        a_cls: np.ndarray,
        b_boxes: np.ndarray,
        b_scores: np.ndarray,
        b_cls: np.ndarray,
        label: str,
    ) -> None:
        ious = box_iou(a_boxes, b_boxes) if len(b_boxes) else np.zeros((len(a_boxes), 0))
        for i in range(len(a_boxes)):
            same = np.flatnonzero(b_cls == a_cls[i])
            if same.size == 0 or ious[i, same].max() < min_iou:
                if a_scores[i] >= edge_conf:
                    best = ious[i, same].max() if same.size else 0.0
                    problems.append(
                        f"{label} class {a_cls[i]} conf {a_scores[i]:.3f} box {a_boxes[i].round(1)}"
                        f" unmatched (best IoU {best:.3f})"
                    )
                continue
            j = same[np.argmax(ious[i, same])]
            if abs(float(a_scores[i]) - float(b_scores[j])) > conf_tol:
                problems.append(
                    f"{label} class {a_cls[i]} conf {a_scores[i]:.3f} vs {b_scores[j]:.3f}"
                )

    one_way(
        ref_boxes, ref_scores, ref_classes, ours.boxes, ours.scores, ours.class_ids, "reference"
    )
    one_way(ours.boxes, ours.scores, ours.class_ids, ref_boxes, ref_scores, ref_classes, "ours")
    return problems


def ort_factory(model: ModelInfo) -> Callable[[], Engine]:
    """Builds the real ONNX Runtime engine (one per pool worker)."""
    from engines.onnxruntime import OrtEngine

    config = EngineConfig(model=model, imgsz=640, max_batch=4, threads=2, cache_dir=CACHE_DIR)

    def make() -> Engine:
        return OrtEngine(config)

    return make


def start_ort_pool(
    model: ModelInfo, max_wait_ms: float, max_batch: int = 4, max_queue: int = 8
) -> EnginePool:
    """A started one-worker pool on the real ONNX Runtime engine; the caller stops it."""
    pool = EnginePool(
        ort_factory(model),
        workers=1,
        max_batch=max_batch,
        max_wait_ms=max_wait_ms,
        max_queue=max_queue,
    )
    pool.start()
    return pool


def file_stream_app(tmp_path: Path, **settings: Any) -> FastAPI:
    """The real app on the shared model, its stream list under ``tmp_path``, ``file://``
    sources of the shared clips allowed, admission's latency target off; ``settings``
    override. (Imports the server only when called: the GPU check imports this module where
    FastAPI is not installed.)"""
    from server.app import create_app
    from server.settings import Settings

    given: dict[str, Any] = {
        "model": str(MODEL_PT),
        "cache_dir": CACHE_DIR,
        "data_dir": tmp_path / "data",
        "allowed_file_dir": VIDEOS[0].parent,
        "admission_deadline_ms": 0,
        **settings,
    }
    return create_app(Settings(**given))


SYNTHETIC_NAMES = {0: "person", 2: "car", 7: "truck"}


def synthetic_detections(
    boxes: Sequence[Sequence[float]], classes: Sequence[int] | None = None
) -> Detections:
    """Detections of a 1000x1000 frame at ``boxes`` (xyxy), cars unless ``classes`` says
    otherwise, confidences descending."""
    n = len(boxes)
    return Detections(
        boxes=np.asarray(boxes, np.float32).reshape(n, 4),
        scores=np.linspace(0.9, 0.5, n).astype(np.float32),
        class_ids=np.asarray(classes if classes is not None else [2] * n, np.int32),
        names=SYNTHETIC_NAMES,
        width=1000,
        height=1000,
    )


def infer_frames(
    engine: Engine, frames: Sequence[Image], params: DetectParams, batch: int = 4
) -> list[Detections]:
    """``frames`` through ``engine`` in batches, their detections in order."""
    out: list[Detections] = []
    for i in range(0, len(frames), batch):
        chunk = frames[i : i + batch]
        out += engine.infer(chunk, [params] * len(chunk))
    return out


def decode_jpeg(data: bytes) -> npt.NDArray[np.int16]:
    """A JPEG as an RGB array (int16: differences of pixels do not wrap)."""
    from PIL import Image as PILImage

    return np.asarray(PILImage.open(io.BytesIO(data)).convert("RGB"), np.int16)


def clip_server(tmp_path: Path, **settings: object) -> ServerProcess:
    """A real ``streamdet serve`` (not started) on the shared model, its streams and events
    under ``tmp_path``, ``file://`` streams of the shared clips allowed, quick to shut down;
    ``settings`` add to or override these."""
    from loadtest.server import ServerProcess

    return ServerProcess(
        {
            "model": str(MODEL_PT),
            "cache_dir": str(CACHE_DIR),
            "data_dir": str(tmp_path / "data"),
            "allowed_file_dir": str(VIDEOS[0].parent),
            "shutdown_timeout_s": 5,
            **settings,
        },
        log_path=tmp_path / "server.log",
        ready_timeout_s=180,
    )


async def published_frames(
    manager: StreamManager, stream_id: str, n: int, after: int = 0
) -> list[ProcessedFrame]:
    """The next ``n`` frames ``manager`` publishes of a stream, numbered above ``after``."""

    sub = manager.subscribe(stream_id)
    assert sub is not None
    frames: list[ProcessedFrame] = []
    try:
        while len(frames) < n:
            item = await next_frame(sub, 60)
            if item.frame > after:
                frames.append(item)
    finally:
        manager.unsubscribe(sub)
    return frames


async def eventually(check: Callable[[], object], timeout_s: float = 10) -> None:
    """Wait on the event loop (which what is checked may need) until ``check()`` holds; fail
    after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "not within the time"
        await asyncio.sleep(0.05)


def numbered(manager: StreamManager, stream_id: str) -> int:
    """The number of the stream's newest frame: a frame numbered above it, read after its
    settings changed, carries the new ones (those numbered before may still be in flight with
    the old: a fixed few frames later was not enough under load)."""
    return manager._readers[stream_id].frame_no


async def next_frame(
    sub: Subscriber, timeout_s: float = 30, states: list[dict[str, Any]] | None = None
) -> ProcessedFrame:
    """The next frame ``sub`` gets, its stream's state changes before it put in ``states``
    (a viewer is sent them between frames)."""
    from streams.fanout import ProcessedFrame, StateMessage

    async with asyncio.timeout(timeout_s):
        while isinstance(item := await sub.get(), StateMessage):
            if states is not None:
                states.append(json.loads(item.text))
    assert isinstance(item, ProcessedFrame), f"subscription closed: {item}"
    return item


@contextlib.asynccontextmanager
async def file_manager(
    pool: EnginePool,
    data: Path,
    *,
    decode_processes: int = 0,
    allowed_dir: Path = VIDEOS[0].parent,
    **reader: Any,
) -> AsyncIterator[StreamManager]:
    """A started stream manager feeding ``pool``, its stream list under ``data``, ``file://``
    sources under ``allowed_dir`` (the shared clips') allowed, 5 s timeouts (``reader``: other
    :class:`~streams.reader.ReaderOptions`); stopped on the way out."""
    from streams.manager import ManagerOptions, StreamManager
    from streams.reader import ReaderOptions
    from streams.store import StreamStore

    options = ManagerOptions(
        reader=ReaderOptions(**{"open_timeout_s": 5, "read_timeout_s": 5, **reader}),
        allowed_file_dir=allowed_dir,
        decode_processes=decode_processes,
    )
    manager = StreamManager(pool, StreamStore(data), options)
    await manager.start()
    try:
        yield manager
    finally:
        await manager.stop(10)


def silent_camera() -> socket.socket:
    """A listening socket on loopback whose connections the kernel accepts and nothing ever
    answers: a camera that hangs (close it when done)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    return sock


class SnapshotCamera:
    """A camera's snapshot URL on 127.0.0.1: ``GET /snapshot`` answers ``jpeg`` while
    ``status`` is 200 (no file extension, as a camera's CGI answers), else that error;
    ``requests`` counts the GETs. ``close()`` stops it."""

    def __init__(self, jpeg: bytes, status: int = 200) -> None:
        import http.server
        import threading

        camera = self
        self.jpeg, self.status, self.requests = jpeg, status, 0

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                camera.requests += 1
                if camera.status != 200:
                    self.send_error(camera.status)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "image/jpeg")
                self.send_header("Content-Length", str(len(camera.jpeg)))
                self.end_headers()
                self.wfile.write(camera.jpeg)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/snapshot"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def wait_until(check: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    """Poll ``check`` (every 20 ms) until it holds; fail saying ``what`` after ``timeout_s``."""
    import time

    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:g} s"
        time.sleep(0.02)


def turned_video(path: Path, image: npt.NDArray[np.uint8], frames: int = 1) -> Path:
    """An H.264 MP4 of ``frames`` copies of ``image`` whose track's display matrix turns it
    90 degrees clockwise, as a phone held upright records (``frame.rotation`` -90)."""
    import struct

    import av

    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=10)
        assert isinstance(stream, av.VideoStream)
        stream.height, stream.width = image.shape[:2]
        stream.pix_fmt = "yuv420p"
        picture = av.VideoFrame.from_ndarray(image, format="rgb24").reformat(format="yuv420p")
        for index in range(frames):
            picture.pts = index
            for packet in stream.encode(picture):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    data = bytearray(path.read_bytes())
    at = data.index(b"tkhd")  # its matrix after the box's times, ids and volume
    matrix = at + 4 + 4 + (32 if data[at + 4] == 1 else 20) + 16
    data[matrix : matrix + 36] = struct.pack(">9i", 0, 0x10000, 0, -0x10000, 0, 0, 0, 0, 1 << 30)
    path.write_bytes(bytes(data))
    return path
