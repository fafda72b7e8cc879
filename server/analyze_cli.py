"""``streamdet analyze VIDEO``: a video job without a server, for scripts and batch runs.

The same job as ``POST /jobs`` (the same settings, checked by the same model, and the same
results: ``frames.ndjson``, ``events.ndjson``, ``video.mp4`` with ``"render": true``, and
``job.json`` with the counts) on an engine pool of its own, every engine worker for this one
video. The counts go to stdout as JSON, progress to stderr.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from fastapi import HTTPException
from fastapi.exceptions import RequestValidationError

from engines.types import EngineError, class_name
from server.settings import Settings
from streams.detect import StreamDetect

if TYPE_CHECKING:
    from server.routes.jobs import JobIn
    from streams.jobs import JobProgress

log = logging.getLogger("streamdet")


def add_analyze_args(parser: argparse.ArgumentParser) -> None:
    # A string, not a Path: a Path folds the URL's "//" ("http:/host/x.mp4").
    parser.add_argument("video", help="the video file (or an http(s):// URL)")
    parser.add_argument(
        "--settings",
        default="{}",
        help='the job\'s settings as POST /jobs takes them, JSON: \'{"classes": "car",'
        ' "track": true, "fps": 5, "lines": [...], "render": true}\'',
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="where the results go (default: <video's file name>.streamdet/ in the current folder)",
    )


def run_analyze(settings: Settings, args: argparse.Namespace) -> int:
    from server.cli import unusable_dir
    from server.routes.jobs import settings_of
    from streams.jobs import FramesTooLarge, JobError, probe

    source = str(args.video)
    out: Path = args.out or default_out(source)
    try:
        job_in: JobIn = settings_of(args.settings, "--settings")
    except HTTPException as exc:
        print(f"streamdet analyze: {exc.detail}", file=sys.stderr)
        return 2
    except RequestValidationError as exc:
        for error in exc.errors():
            where = ".".join(str(p) for p in error["loc"])
            message = str(error["msg"]).removeprefix("Value error, ")  # pydantic's wording
            print(f"streamdet analyze: {where}: {message}", file=sys.stderr)
        return 2
    for field, why in (
        ("callback_url", "here the counts go to stdout"),
        ("url", "here the video is the VIDEO argument"),  # it was ignored
    ):
        if getattr(job_in, field) is not None:
            print(f"streamdet analyze: {field}: for POST /jobs; {why}", file=sys.stderr)
            return 2
    try:  # frames over the pixel limit refused here, from the codec's parameters (exit 2)
        video = probe(source, max_pixels=settings.max_image_pixels)
    except FramesTooLarge as exc:
        print(
            f"streamdet analyze: {source}: {exc} (setting STREAMDET_MAX_IMAGE_PIXELS)",
            file=sys.stderr,
        )
        return 2
    except JobError as exc:
        print(f"streamdet analyze: {source}: {exc}", file=sys.stderr)
        return 2
    # The folders made here, to remove again if nothing is written into them.
    try:
        made = _missing_dirs(out)
    except OSError as exc:  # a name too long: a traceback
        print(f"streamdet analyze: --out: {out}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    # Before the model loads (it was made after: a traceback once the model had loaded).
    unusable = unusable_dir(out)
    if unusable is not None:
        print(f"streamdet analyze: --out: {out}: {unusable}", file=sys.stderr)
        _remove_empty(made)
        return 2
    code = 1
    try:
        code = _run(settings, args, job_in, (source, video), out)
    finally:
        if code != 0:
            _remove_empty(made)
    return code


def default_out(source: str) -> Path:
    """``<video>.streamdet`` beside where it runs: a URL's last path segment, without its
    query (a signed URL's token was written to disk as a folder's name, too long to make)."""
    parts = urlsplit(source)
    name = Path(parts.path if parts.scheme and len(parts.scheme) > 1 else source).name
    return Path(f"{name or 'video'}.streamdet")


def _missing_dirs(out: Path) -> list[Path]:
    """``out`` and those of its parents that do not exist yet, deepest first."""
    missing: list[Path] = []
    path = out
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def _remove_empty(dirs: list[Path]) -> None:
    """Remove ``dirs`` (deepest first) where empty: a failed run leaves no folder it made
    behind, and never touches one that was there before or holds results."""
    for path in dirs:
        try:
            path.rmdir()
        except OSError:
            return


def _run(
    settings: Settings,
    args: argparse.Namespace,
    job_in: JobIn,
    probed: tuple[str, dict[str, Any]],
    out: Path,
) -> int:
    """Load the pool and run the job; the exit status."""
    from server.job_video import VIDEO_FILE, AnnotatedVideo
    from server.jobs import job_settings
    from server.runtime import build_pool
    from streams.jobs import JobError, JobProgress, JobSpec, run_job

    source, video = probed
    try:
        pool = build_pool(settings)
    except EngineError as exc:
        print(f"streamdet analyze: {exc}", file=sys.stderr)
        return 2
    try:
        names = pool.engine.names
        try:
            detect = job_in.detect(names, StreamDetect())
        except HTTPException as exc:
            print(f"streamdet analyze: --settings: {exc.detail}", file=sys.stderr)
            return 2
        sink = (
            AnnotatedVideo(out / VIDEO_FILE, detect, job_in.fps, video) if job_in.render else None
        )
        progress = JobProgress()
        done = threading.Event()
        reporter = threading.Thread(target=_report, args=(progress, done), daemon=True)
        reporter.start()
        try:
            counts = run_job(
                JobSpec(
                    source,
                    detect,
                    job_in.fps,
                    max_pixels=settings.max_image_pixels,
                    timeout_s=(settings.stream_open_timeout_s, settings.stream_read_timeout_s),
                    decode_max_side=settings.decode_side(pool.engine.input_size),
                ),
                pool.submit_background,
                out,
                functools.partial(class_name, names),
                inflight=settings.job_inflight or pool.workers * pool.max_batch,
                cancel=threading.Event(),
                interrupt=threading.Event(),
                progress=progress,
                sink=sink,
            )
        except JobError as exc:
            if exc.counts is None:  # before any frame: nothing to keep
                print(f"streamdet analyze: {source}: {exc}", file=sys.stderr)
                return 1
            # Part way: its results so far are kept, and job.json with their counts.
            failed: JobError | None = exc
            counts = exc.counts
        else:
            failed = None
        finally:
            done.set()
            progress.freeze()
        summary: dict[str, Any] = {
            "video": {"source": source, **video},
            "settings": job_settings(detect, names, job_in.fps, job_in.render),
            "progress": progress.to_json(),
            "counts": counts,
            "results": str(out),
            **({} if failed is None else {"error": str(failed)}),
        }
        try:
            (out / "job.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
        except OSError as exc:
            print(f"streamdet analyze: --out: {out}: {exc.strerror or exc}", file=sys.stderr)
            return 1
        if failed is not None:
            print(f"streamdet analyze: {source}: {failed}", file=sys.stderr)
            return 1
        print(json.dumps(summary, indent=2))
        return 0
    finally:
        pool.stop(settings.shutdown_timeout_s)


def _report(progress: JobProgress, done: threading.Event) -> None:
    """A progress line on stderr every few seconds."""
    while not done.wait(5.0):
        p = progress.to_json()
        total = "" if p["duration_s"] is None else f" of {p['duration_s']:.1f}"
        print(
            f"{p['position_s']:.1f}{total} s, {p['frames_processed']} frames,"
            f" {p['fps'] or 0:.1f} frames/s",
            file=sys.stderr,
            flush=True,
        )
