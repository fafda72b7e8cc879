"""How much a decode thread loses to Python threads holding the GIL, by switch interval.

A PyAV decode thread releases the interpreter lock around each FFmpeg call (read a packet,
decode it, convert the frame) and has to win it back each time. A thread running Python
(an engine worker launching kernels, a busy event loop) keeps it for a whole switch interval
before handing it over, so every frame can wait several intervals: the convoy effect. This
measures one decode thread's frames/s alone and beside ``--spinners`` pure-Python threads, at
each switch interval::

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


def beside_spinners(clip: Path, seconds: float, threads: str, spinners: int) -> float:
    """:func:`decode_fps` while ``spinners`` threads run pure Python."""
    stop = threading.Event()

    def spin() -> None:
        count = 0
        while not stop.is_set():
            count += 1

    busy = [threading.Thread(target=spin, daemon=True) for _ in range(spinners)]
    for t in busy:
        t.start()
    try:
        return decode_fps(clip, seconds, threads)
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
                rows.append(
                    {
                        "threads": threads,
                        "switch_ms": switch_ms,
                        "alone_fps": round(alone, 1),
                        "beside_spinners_fps": round(contended, 1),
                    }
                )
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
