"""``benchmarks.gil_bench``'s video-job rows on a short clip: a job read here and in a decode
process, alone and beside a busy thread."""

from __future__ import annotations

import argparse

from benchmarks import gil_bench
from tests.helpers import CAR_CLIP


def test_gil_bench_reads_a_job_here_and_in_a_decode_process() -> None:
    args = argparse.Namespace(job_clip=CAR_CLIP, switch_ms=[1.0], spinners=1)
    [row] = gil_bench.job_rows(args)
    assert row["job"] == CAR_CLIP.name and row["switch_ms"] == 1.0
    for where in ("here", "process"):
        assert row[f"job_{where}_alone_fps"] > 0
        assert row[f"job_{where}_beside_spinners_fps"] > 0
