"""The latency tail that queueing alone leaves at half capacity: p99 sojourn time, in
service times, of Poisson arrivals on ``c`` workers that share a fixed throughput (each of
``c`` single-thread workers takes ``c`` x the time one worker on every core would)::

    .venv/bin/python -m benchmarks.queueing_sim --workers 1 2 3 4

No server runs here: it is the floor under ``benchmarks.overload``'s below-capacity figure
(M/D/2 at load 0.5 gives about 2.6 S, so a 2.5x target is out of reach on 2 cores whatever the
implementation; M/D/4 gives 1.7 S).
"""

from __future__ import annotations

import argparse
import heapq
import sys

import numpy as np


def p99_sojourn(
    workers: int, load: float, arrivals: int, jitter: float = 0.0, seed: int = 1
) -> tuple[float, float]:
    """(p50, p99) sojourn of FCFS M/D/c (M/G/c with ``jitter``, the relative standard
    deviation of service times) in units of one worker's service time."""
    rng = np.random.default_rng(seed)
    service = float(workers)  # c workers, each c times slower than one on every core
    rate = load  # total capacity is 1 job per unit time
    times = np.cumsum(rng.exponential(1.0 / rate, arrivals))
    free = [0.0] * workers
    sojourn = np.empty(arrivals)
    for i, arrived in enumerate(times):
        start = max(arrived, heapq.heappop(free))
        took = service * (1.0 + jitter * rng.standard_normal()) if jitter else service
        heapq.heappush(free, start + took)
        sojourn[i] = start + took - arrived
    p50, p99 = np.percentile(sojourn, [50, 99]) / service
    return float(p50), float(p99)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--load", type=float, default=0.5)
    parser.add_argument("--arrivals", type=int, default=400_000)
    parser.add_argument("--jitter", type=float, default=0.0)
    args = parser.parse_args(argv)
    for c in args.workers:
        p50, p99 = p99_sojourn(c, args.load, args.arrivals, args.jitter)
        print(f"{c} worker(s), load {args.load}: p50 {p50:.2f} S, p99 {p99:.2f} S")
    return 0


if __name__ == "__main__":
    sys.exit(main())
