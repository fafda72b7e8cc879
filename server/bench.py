"""``streamdet bench``: /detect goodput against the engine-only ceiling and the seed design.

All three run on this machine in one run:

1. engine ceiling: ONNX Runtime alone, batch 1, a 640x640 input, no HTTP;
2. streamdet: a real ``streamdet serve`` process, N concurrent clients posting real JPEG
   frames for a fixed time;
3. seed: a FastAPI handler calling Ultralytics' predictor directly, same clients, same frames.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import av
import httpx

from engines.registry import load_backend, prepare_model, usable_cores
from engines.types import Image, ModelError
from engines.yolo import preprocess, rect_shape
from loadtest.client import Phase, closed_loop
from loadtest.frames import shared_dir
from loadtest.server import ServerError, ServerProcess, free_port
from server.argtypes import positive
from server.runtime import engine_config
from server.settings import Settings
from streams.files import encode_jpeg, sample_video_frames


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--videos", nargs="+", default=None, help="clips to take frames from")
    parser.add_argument("--frames", type=positive(int), default=40, help="frames per clip")
    parser.add_argument("--clients", type=positive(int), default=8, help="concurrent clients")
    parser.add_argument(
        "--seconds", type=positive(float), default=20.0, help="load time per server"
    )
    parser.add_argument("--warmup-seconds", type=positive(float), default=3.0)
    parser.add_argument("--skip-seed", action="store_true", help="skip the seed design")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON")


def run_load(base: str, jpegs: list[bytes], args: argparse.Namespace) -> Phase:
    """``args.clients`` closed-loop clients posting multipart form uploads (what the seed
    design accepts), the same for both servers."""
    return asyncio.run(
        closed_loop(
            base,
            jpegs,
            clients=args.clients,
            seconds=args.seconds,
            warmup=args.warmup_seconds,
            multipart=True,
        )
    )


# Never handed to the bench's server: ServerProcess gives it the address and the log level its
# readiness is read at, and a temporary data dir; and no cameras (the user's persisted ones
# or their streams file), which would compete with the /detect load being measured.
NOT_BENCHED = frozenset({"host", "port", "log_level", "data_dir", "streams_file"})


def serve_settings(settings: Settings) -> dict[str, object]:
    """``settings`` as the bench's ``streamdet serve`` gets them (``STREAMDET_*`` variables):
    only those given (flags or environment), none of :data:`NOT_BENCHED`. Everything dumped
    made None "None" (STREAMDET_MQTT_URL=None, an MQTT broker named None) and always passed the
    user's data dir, so the bench opened their cameras and ran beside their jobs."""
    given = settings.model_fields_set - NOT_BENCHED
    chosen: dict[str, object] = settings.model_dump(include=set(given), exclude_none=True)
    chosen["access_log"] = False  # a log line per request is not what is measured
    # Set, and empty (unset), so an exported STREAMDET_STREAMS_FILE is not inherited.
    chosen["streams_file"] = ""
    return chosen


def run_streamdet_load(settings: Settings, jpegs: list[bytes], args: argparse.Namespace) -> Phase:
    """A real ``streamdet serve`` with ``settings`` under the closed loop; its log goes to a
    temporary folder, kept only when the server fails.

    Raises:
        ServerError: the server did not start (the message says where its log is).
    """
    log_dir = Path(tempfile.mkdtemp(prefix="streamdet-bench-"))
    try:
        with ServerProcess(
            serve_settings(settings), log_path=log_dir / "server.log", cwd=Path.cwd()
        ) as server:
            phase = run_load(server.base_url, jpegs, args)
    except ServerError as exc:
        raise ServerError(f"{exc}\n(the whole log: {log_dir / 'server.log'})") from None
    shutil.rmtree(log_dir, ignore_errors=True)
    return phase


def run_seed_load(settings: Settings, jpegs: list[bytes], args: argparse.Namespace) -> Phase:
    """The seed design (``server.bench_seed``, which logs nothing at its level: readiness is
    polled at ``/readyz``) under the closed loop."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {"SEED_MODEL": settings.model, "SEED_IMGSZ": str(settings.imgsz), "SEED_PORT": str(port)}
    proc = subprocess.Popen([sys.executable, "-m", "server.bench_seed"], env={**os.environ, **env})
    try:
        _wait_seed_ready(base, proc)
        return run_load(base, jpegs, args)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _wait_seed_ready(base: str, proc: subprocess.Popen[bytes], timeout_s: float = 300.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"seed server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{base}/readyz", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"seed server not ready within {timeout_s:.0f} s")


def engine_ceiling(settings: Settings, frame: Image, seconds: float, rect: bool = False) -> float:
    """Images/s of ONNX Runtime alone at batch 1 on a 640x640 input (or the frame's rect
    shape, the shape streamdet itself runs the frame at): one session on every core, the
    fastest single engine, whatever worker split the server uses."""
    model = prepare_model(settings.model, settings.cache_dir, settings.imgsz)
    config = dataclasses.replace(engine_config(settings, model), threads=usable_cores())
    engine = load_backend("onnxruntime")(config)
    engine.load()
    engine.warmup()
    size = engine.input_size  # a fixed-shape model (a TorchScript export) dictates its own
    shape = (size, size)
    if rect and model.dynamic_hw:  # else the frame runs square too
        shape = rect_shape(frame.shape[0], frame.shape[1], size, model.stride)
    blob, _ = preprocess([frame], size, shape)
    run = engine.run_raw  # type: ignore[attr-defined]
    for _ in range(3):
        run(blob)
    count, start = 0, time.monotonic()
    while time.monotonic() - start < seconds:
        run(blob)
        count += 1
    rate = count / (time.monotonic() - start)
    engine.close()
    return rate


def default_videos() -> list[str]:
    """The shared clips, found as ``streamdet loadtest`` finds them (``STREAMDET_SHARED_DIR``
    or ``../shared`` beside the repository: it was from the current directory, so a bench run
    from elsewhere found none)."""
    return [str(p) for p in sorted((shared_dir() / "videos").glob("*.mp4"))]


def run_bench(settings: Settings, args: argparse.Namespace) -> int:
    videos = args.videos or default_videos()
    if not videos:
        print("bench: no videos found; pass --videos CLIP.mp4 ...", file=sys.stderr)
        return 2
    try:  # the model first: it was found missing after the frames were sampled, a traceback
        prepare_model(settings.model, settings.cache_dir, settings.imgsz)
    except ModelError as exc:
        print(f"streamdet bench: {exc}", file=sys.stderr)
        return 2
    frames: list[Image] = []
    for video in videos:
        try:
            frames += sample_video_frames(video, args.frames)
        except (av.error.FFmpegError, OSError, ValueError) as exc:  # a traceback, exit 1
            print(
                f"streamdet bench: --videos: {video}: not a video FFmpeg can read: {exc}",
                file=sys.stderr,
            )
            return 2
    if not frames:
        print(f"streamdet bench: --videos: no frame decodes in {videos}", file=sys.stderr)
        return 2
    jpegs = [encode_jpeg(f) for f in frames]
    print(f"bench: {len(jpegs)} JPEG frames from {len(videos)} clip(s), {args.clients} clients")

    logging.getLogger("httpx").setLevel(logging.WARNING)
    ceiling = engine_ceiling(settings, frames[0], max(5.0, args.seconds / 2))
    print(f"engine ceiling (onnxruntime, batch 1, 640x640): {ceiling:.2f} img/s")
    rect = engine_ceiling(settings, frames[0], max(5.0, args.seconds / 2), rect=True)
    print(f"engine at the frames' rect shape (batch 1): {rect:.2f} img/s")

    try:
        ours = run_streamdet_load(settings, jpegs, args)
    except ServerError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 1
    print(
        f"streamdet: {ours.goodput:.2f} img/s, p50 {ours.pct(50):.0f} ms,"
        f" p99 {ours.pct(99):.0f} ms, errors {ours.errors}"
    )

    figures: dict[str, Any] = {
        "machine_cores": os.cpu_count(),
        "model": Path(settings.model).name,
        "backend": settings.backend,
        "clients": args.clients,
        "seconds": args.seconds,
        "engine_ceiling_img_s": round(ceiling, 3),
        "engine_rect_img_s": round(rect, 3),
        "streamdet": ours.summary(),
        "streamdet_over_ceiling": round(ours.goodput / ceiling, 3),
        "streamdet_over_rect_engine": round(ours.goodput / rect, 3),
    }
    if not args.skip_seed:
        seed = run_seed_load(settings, jpegs, args)
        print(
            f"seed (FastAPI + Ultralytics predictor): {seed.goodput:.2f} img/s,"
            f" p50 {seed.pct(50):.0f} ms, p99 {seed.pct(99):.0f} ms, errors {seed.errors}"
        )
        figures["seed"] = seed.summary()
        figures["streamdet_over_seed"] = round(ours.goodput / max(seed.goodput, 1e-9), 3)
    print(json.dumps({k: v for k, v in figures.items() if k.endswith(("ceiling", "seed"))}))
    print(
        f"ratio streamdet / engine ceiling: {figures['streamdet_over_ceiling']:.2f} (target >= 0.9)"
    )
    print(
        f"ratio streamdet / engine at rect shape: {figures['streamdet_over_rect_engine']:.2f}"
        " (same pixels per frame as streamdet runs)"
    )
    if "streamdet_over_seed" in figures:
        print(
            f"ratio streamdet / seed design:    {figures['streamdet_over_seed']:.2f}"
            " (target >= 1.3)"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(figures, indent=2, default=float))
    return 0
