"""Reading Locust's ``*_stats.csv`` and checking it against a profile's targets."""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

from loadtest.profiles import Target


@dataclass(frozen=True, slots=True)
class Row:
    """One Locust request name's figures (times in ms)."""

    name: str
    requests: int
    failures: int
    p50_ms: float
    p99_ms: float
    rps: float
    failures_per_s: float

    @property
    def error_rate(self) -> float:
        return self.failures / self.requests if self.requests else 0.0

    def goodput_rps(self, duration_s: float | None = None) -> float:
        """Successful requests per second: over ``duration_s`` (the configured run time) when
        given, else Locust's own rate (which divides by the time since the first request)."""
        if duration_s:
            return (self.requests - self.failures) / duration_s
        return max(0.0, self.rps - self.failures_per_s)


@dataclass(frozen=True, slots=True)
class Verdict:
    """One checked figure: ``ok`` is ``None`` when skipped (``note`` says why)."""

    name: str
    metric: str
    target: str
    actual: str
    ok: bool | None
    note: str = ""


def _float(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        return math.nan


def read_stats(csv_path: Path) -> dict[str, Row]:
    """Rows of a Locust ``<prefix>_stats.csv`` keyed ``"<Type> <Name>"`` (``"Aggregated"``)."""
    rows: dict[str, Row] = {}
    with csv_path.open(newline="") as f:
        for rec in csv.DictReader(f):
            key = f"{rec['Type']} {rec['Name']}".strip() if rec["Type"] else rec["Name"]
            rows[key] = Row(
                name=key,
                requests=int(rec["Request Count"]),
                failures=int(rec["Failure Count"]),
                p50_ms=_float(rec["50%"]),
                p99_ms=_float(rec["99%"]),
                rps=_float(rec["Requests/s"]),
                failures_per_s=_float(rec["Failures/s"]),
            )
    return rows


def evaluate(
    rows: dict[str, Row],
    targets: dict[str, Target],
    skipped: dict[str, str] | None = None,
    duration_s: float | None = None,
) -> list[Verdict]:
    """Check every target; a name in ``skipped`` (name -> reason) is reported, not failed.

    Goodput is successful requests over ``duration_s`` (see :meth:`Row.goodput_rps`).
    """
    skipped = skipped or {}
    verdicts: list[Verdict] = []
    for name, target in targets.items():
        if name in skipped:
            verdicts.append(Verdict(name, "all", "-", "-", None, skipped[name]))
            continue
        row = rows.get(name)
        if row is None or row.requests == 0:
            verdicts.append(Verdict(name, "requests", "> 0", "0", False, "no requests recorded"))
            continue
        checks: list[tuple[str, float | None, float, bool]] = [
            ("p50_ms", target.p50_ms, row.p50_ms, True),
            ("p99_ms", target.p99_ms, row.p99_ms, True),
            ("error_rate", target.max_error_rate, row.error_rate, True),
            ("goodput_rps", target.min_goodput_rps, row.goodput_rps(duration_s), False),
        ]
        for metric, limit, actual, upper in checks:
            if limit is None:
                continue
            ok = actual <= limit if upper else actual >= limit
            verdicts.append(
                Verdict(name, metric, f"{'<=' if upper else '>='} {limit:g}", f"{actual:.4g}", ok)
            )
    return verdicts


def passed(verdicts: list[Verdict]) -> bool:
    """No checked figure failed (skipped ones do not count)."""
    return all(v.ok is not False for v in verdicts)


def format_table(
    rows: dict[str, Row], verdicts: list[Verdict], duration_s: float | None = None
) -> str:
    """A short plain-text summary: figures per request name, then each target's verdict."""
    lines = [
        f"{'request':<24} {'reqs':>7} {'fails':>6} {'p50 ms':>8} {'p99 ms':>8} {'good/s':>8}",
    ]
    for row in rows.values():
        lines.append(
            f"{row.name[:24]:<24} {row.requests:>7} {row.failures:>6} {row.p50_ms:>8.0f}"
            f" {row.p99_ms:>8.0f} {row.goodput_rps(duration_s):>8.2f}"
        )
    lines.append("")
    lines.append(f"{'target':<24} {'metric':<12} {'want':>10} {'got':>10}  verdict")
    for v in verdicts:
        verdict = "SKIP" if v.ok is None else ("ok" if v.ok else "MISSED")
        note = f"  ({v.note})" if v.note else ""
        lines.append(
            f"{v.name[:24]:<24} {v.metric:<12} {v.target:>10} {v.actual:>10}  {verdict}{note}"
        )
    return "\n".join(lines)
