"""How much a decode thread loses to Python threads holding the GIL, by switch interval.

A PyAV decode thread releases the interpreter lock around each FFmpeg call (read a packet,
decode it, convert the frame) and has to win it back each time. A thread running Python
(an engine worker launching kernels, a busy event loop) keeps it for a whole switch interval
before handing it over, so every frame can wait several intervals: the convoy effect. This
measures one decode thread's frames/s alone and beside ``--spinners`` pure-Python threads, at
each switch interval, and the same stream decoded in a decode process
(:mod:`streams.decode_procs`: the frames reach this process as shared-memory arrays through
the server's own reader, which takes the lock once per batch of messages, not per FFmpeg
call)::

    python -m benchmarks.gil_bench --out benchmarks/results/<date>-cpu2-gil.json

``--job-clip CLIP`` adds a video job's frames/s (an engine that answers at once), its video
decoded in the job's thread here or in a decode process (``DecodeHub.job_frames``), alone and
beside the spinners::

    python -m benchmarks.gil_bench --threads one --switch-ms 1 --job-clip /tmp/car-1080p.mp4 \\
        --out benchmarks/results/<date>-cpu2-gil-jobs.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.helpers import VIDEOS


def decode_fps(clip: Path, seconds: float, threads: str) -> float:
    """Frames/s one thread decodes to RGB arrays, looping over ``clip`` for ``seconds``."""
    from engines.nvdec import VideoDecoder

    frames, start = 0, time.monotonic()
    while time.monotonic() - start < seconds:
        for _ in VideoDecoder(clip, threads=threads):
            frames += 1
            if time.monotonic() - start >= seconds:
                break
    return frames / (time.monotonic() - start)


def process_fps(clip: Path, seconds: float) -> float:
    """Frames/s that reach this process from ``clip`` decoded (unpaced, looping) in a decode
    process, through the server's :class:`~streams.decode_procs.RemoteReader`."""
    from engines.batching import WorkItem
    from streams.decode_procs import DecodeHub
    from streams.reader import ReaderOptions, StreamConfig, StreamState
    from streams.sources import parse_source

    frames = [0]

    def submit(stream_id: str, item: WorkItem) -> WorkItem | None:
        frames[0] += 1  # and dropped: its slot goes back to the process
        return None

    hub = DecodeHub(1, ReaderOptions(file_fps=0))
    config = StreamConfig("gil", parse_source(clip.resolve().as_uri(), clip.resolve().parent))
    reader = hub.reader(config, submit, lambda frame: None)
    reader.start()
    try:
        if not reader.wait_state({StreamState.LIVE}, 30.0):
            raise RuntimeError(f"the decode process did not open {clip}: {reader.last_error}")
        time.sleep(1.0)
        before, start = frames[0], time.monotonic()
        time.sleep(seconds)
        return (frames[0] - before) / (time.monotonic() - start)
    finally:
        hub.shutdown(5.0)


def job_fps(clip: Path, hub: Any | None) -> float:
    """Frames/s a video job (:func:`streams.jobs.run_job`, every frame, decoded at 640) reads
    through an engine that answers at once: decoded in this process's job thread, or with
    ``hub`` (a :class:`~streams.decode_procs.DecodeHub`) in a decode process."""
    import tempfile

    from engines.batching import WorkItem, WorkResult
    from engines.types import Detections
    from streams.detect import StreamDetect
    from streams.jobs import JobProgress, JobSpec, local_frames, run_job

    def answer(item: WorkItem) -> None:
        height, width = item.image.shape[:2]
        item.on_done(WorkResult(Detections.empty({}, width, height), None, 0.0, 0.0, 1))

    progress = JobProgress()
    with tempfile.TemporaryDirectory() as out:
        start = time.monotonic()
        run_job(
            JobSpec(str(clip), StreamDetect(), decode_max_side=640),
            answer,
            Path(out),
            str,
            inflight=4,
            cancel=threading.Event(),
            interrupt=threading.Event(),
            progress=progress,
            frames=local_frames if hub is None else hub.job_frames,
        )
        return progress.frames_processed / (time.monotonic() - start)


def beside_spinners(
    clip: Path,
    seconds: float,
    threads: str,
    spinners: int,
    *,
    process: bool = False,
    job: Callable[[], float] | None = None,
) -> float:
    """:func:`decode_fps` (:func:`process_fps` with ``process``; ``job`` where given) while
    ``spinners`` threads run pure Python."""
    stop = threading.Event()

    def spin() -> None:
        count = 0
        while not stop.is_set():
            count += 1

    busy = [threading.Thread(target=spin, daemon=True) for _ in range(spinners)]
    for t in busy:
        t.start()
    try:
        if job is not None:
            return job()
        return process_fps(clip, seconds) if process else decode_fps(clip, seconds, threads)
    finally:
        stop.set()
        for t in busy:
            t.join()


def job_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """A video job's frames/s, read in this process and in a decode process, alone and
    beside the spinners, at each switch interval."""
    from streams.decode_procs import DecodeHub
    from streams.reader import ReaderOptions

    hub = DecodeHub(1, ReaderOptions())
    rows: list[dict[str, Any]] = []
    default_s = sys.getswitchinterval()
    try:
        job_fps(args.job_clip, hub)  # the process started, the clip in the page cache
        for switch_ms in args.switch_ms:
            sys.setswitchinterval(switch_ms / 1000)
            row: dict[str, Any] = {"job": args.job_clip.name, "switch_ms": switch_ms}
            for where, via in (("here", None), ("process", hub)):
                run = functools.partial(job_fps, args.job_clip, via)
                row[f"job_{where}_alone_fps"] = round(run(), 1)
                row[f"job_{where}_beside_spinners_fps"] = round(
                    beside_spinners(args.job_clip, 0, "auto", args.spinners, job=run), 1
                )
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        sys.setswitchinterval(default_s)
        hub.shutdown(5.0)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gil_bench", description=__doc__)
    parser.add_argument("--clip", type=Path, default=VIDEOS[-1])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--spinners", type=int, default=1)
    parser.add_argument("--switch-ms", type=float, nargs="+", default=[5.0, 1.0, 0.5])
    parser.add_argument("--threads", nargs="+", default=["one", "auto"])
    parser.add_argument(
        "--job-clip",
        type=Path,
        default=None,
        help="also a video job of this clip, read here and in a decode process",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    default_s = sys.getswitchinterval()
    rows: list[dict[str, Any]] = []
    try:
        for threads in args.threads:
            for switch_ms in args.switch_ms:
                sys.setswitchinterval(switch_ms / 1000)
                alone = decode_fps(args.clip, args.seconds, threads)
                contended = beside_spinners(args.clip, args.seconds, threads, args.spinners)
                row = {
                    "threads": threads,
                    "switch_ms": switch_ms,
                    "alone_fps": round(alone, 1),
                    "beside_spinners_fps": round(contended, 1),
                }
                if threads == "auto":  # what a decode process uses
                    row["process_alone_fps"] = round(process_fps(args.clip, args.seconds), 1)
                    row["process_beside_spinners_fps"] = round(
                        beside_spinners(
                            args.clip, args.seconds, threads, args.spinners, process=True
                        ),
                        1,
                    )
                rows.append(row)
                print(json.dumps(rows[-1]), flush=True)
        if args.job_clip is not None:
            rows += job_rows(args)
    finally:
        sys.setswitchinterval(default_s)
    report = {
        "clip": args.clip.name,
        "spinners": args.spinners,
        "seconds": args.seconds,
        "cpus": len(os.sched_getaffinity(0)),
        "rows": rows,
    }
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
