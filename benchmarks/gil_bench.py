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
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
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


def beside_spinners(
    clip: Path, seconds: float, threads: str, spinners: int, *, process: bool = False
) -> float:
    """:func:`decode_fps` (:func:`process_fps` with ``process``) while ``spinners`` threads
    run pure Python."""
    stop = threading.Event()

    def spin() -> None:
        count = 0
        while not stop.is_set():
            count += 1

    busy = [threading.Thread(target=spin, daemon=True) for _ in range(spinners)]
    for t in busy:
        t.start()
    try:
        return process_fps(clip, seconds) if process else decode_fps(clip, seconds, threads)
    finally:
        stop.set()
        for t in busy:
            t.join()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gil_bench", description=__doc__)
    parser.add_argument("--clip", type=Path, default=VIDEOS[-1])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--spinners", type=int, default=1)
    parser.add_argument("--switch-ms", type=float, nargs="+", default=[5.0, 1.0, 0.5])
    parser.add_argument("--threads", nargs="+", default=["one", "auto"])
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
