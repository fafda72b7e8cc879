"""The /detect load clients of ``streamdet bench`` and ``benchmarks.overload``: closed-loop
clients (post, wait for the answer, post the next) and open-loop Poisson arrivals, on a lean
HTTP/1.1 keep-alive connection.

64 httpx clients cost the 2 cores the server runs on enough CPU to show up in the latencies
they measure; a :class:`Connection` sends pre-built requests and parses a status line and a
few headers.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

CLIENT_TIMEOUT_S = 30.0
BOUNDARY = "streamdet-load-boundary"
# Statuses after which a polite client waits Retry-After (1 s if absent) before its next call.
BACK_OFF = ("429", "503")


@dataclass
class Phase:
    """What one load phase saw: every status (an exception's name when no response came)
    and the latencies of the 200s."""

    seconds: float
    statuses: dict[str, int] = field(default_factory=dict)
    latencies_ms: list[float] = field(default_factory=list)

    def add(self, status: str, ms: float) -> None:
        self.statuses[status] = self.statuses.get(status, 0) + 1
        if status == "200":
            self.latencies_ms.append(ms)

    @property
    def goodput(self) -> float:
        """200s per second."""
        return len(self.latencies_ms) / self.seconds if self.seconds else 0.0

    def pct(self, q: float) -> float:
        return float(np.percentile(self.latencies_ms, q)) if self.latencies_ms else float("nan")

    @property
    def errors(self) -> dict[str, int]:
        return {s: n for s, n in self.statuses.items() if s != "200"}

    @property
    def server_errors(self) -> int:
        return sum(n for s, n in self.statuses.items() if s.startswith("5"))

    @property
    def timeouts(self) -> int:
        return sum(n for s, n in self.statuses.items() if "Timeout" in s)

    def summary(self) -> dict[str, Any]:
        return {
            "seconds": self.seconds,
            "statuses": self.statuses,
            "goodput_img_s": round(self.goodput, 3),
            "p50_ms": round(self.pct(50), 1),
            "p99_ms": round(self.pct(99), 1),
        }


class Connection:
    """One HTTP/1.1 keep-alive connection (asyncio streams) posting pre-built requests."""

    def __init__(self, base: str) -> None:
        url = httpx.URL(base)
        self.host, self.port = url.host, url.port or 80
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    @staticmethod
    def request(jpeg: bytes, *, multipart: bool = False) -> bytes:
        """A POST of ``jpeg`` to /detect: the raw body (``Content-Type: image/jpeg``), or an
        ``image`` form field (``multipart/form-data``, what a browser form or ``curl -F``
        sends)."""
        if multipart:
            body = (
                (
                    f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="image";'
                    ' filename="frame.jpg"\r\nContent-Type: image/jpeg\r\n\r\n'
                ).encode()
                + jpeg
                + f"\r\n--{BOUNDARY}--\r\n".encode()
            )
            kind = f"multipart/form-data; boundary={BOUNDARY}"
        else:
            body, kind = jpeg, "image/jpeg"
        head = (
            f"POST /detect HTTP/1.1\r\nHost: bench\r\nContent-Type: {kind}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        return head.encode() + body

    async def _exchange(self, request: bytes) -> tuple[str, str | None]:
        if self._writer is None or self._reader is None:
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        self._writer.write(request)
        await self._writer.drain()
        head = await self._reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = lines[0].split(" ", 2)[1]
        headers = {
            k.strip().lower(): v.strip()
            for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)
        }
        await self._reader.readexactly(int(headers.get("content-length", "0")))
        if headers.get("connection", "").lower() == "close":
            await self.close()
        return status, headers.get("retry-after")

    async def post(self, request: bytes) -> tuple[str, float, str | None]:
        """One call: (status or exception name, milliseconds, Retry-After). A kept-alive
        connection the server has since closed (uvicorn's keep-alive timeout is 5 s) is
        reopened and the call sent again, as HTTP clients do."""
        t0 = time.monotonic()
        for attempt in (0, 1):
            reused = self._writer is not None
            try:
                status, retry = await asyncio.wait_for(self._exchange(request), CLIENT_TIMEOUT_S)
                break
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
                await self.close()
                status, retry = type(exc).__name__, None
                if not (reused and attempt == 0):
                    break
            except TimeoutError:
                await self.close()
                status, retry = "ReadTimeout", None
                break
        return status, (time.monotonic() - t0) * 1000, retry

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(OSError):
                await self._writer.wait_closed()
        self._reader = self._writer = None


async def closed_loop(
    base: str,
    jpegs: list[bytes],
    *,
    clients: int,
    seconds: float,
    warmup: float,
    impatient: bool = False,
    multipart: bool = False,
) -> Phase:
    """``clients`` tasks: post, wait for the answer, post the next; after a 429 or 503, wait
    Retry-After (``impatient``: 50 ms). Calls that start after ``warmup`` and end within the
    following ``seconds`` are counted."""
    phase = Phase(seconds)
    start = time.monotonic()
    measure_from, stop_at = start + warmup, start + warmup + seconds
    requests = [Connection.request(j, multipart=multipart) for j in jpegs]

    async def client(k: int) -> None:
        conn = Connection(base)
        i = k
        while time.monotonic() < stop_at:
            t0 = time.monotonic()
            status, ms, retry = await conn.post(requests[i % len(requests)])
            i += clients
            if t0 >= measure_from and time.monotonic() <= stop_at:
                phase.add(status, ms)
            if status in BACK_OFF:
                pause = 0.05 if impatient else float(retry or 1)
                await asyncio.sleep(min(pause, max(0.0, stop_at - time.monotonic())))
        await conn.close()

    await asyncio.gather(*(client(k) for k in range(clients)))
    return phase


async def open_loop(base: str, jpegs: list[bytes], rate: float, seconds: float) -> Phase:
    """Poisson arrivals at ``rate``/s, each its own request, whatever the server's pace."""
    phase = Phase(seconds)
    rng = random.Random(5)
    requests = [Connection.request(j) for j in jpegs]
    idle: list[Connection] = []  # keep-alive connections free for the next arrival
    tasks: list[asyncio.Task[None]] = []

    async def one(request: bytes) -> None:
        conn = idle.pop() if idle else Connection(base)
        status, ms, _ = await conn.post(request)
        phase.add(status, ms)
        idle.append(conn)

    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        tasks.append(asyncio.create_task(one(requests[i % len(requests)])))
        i += 1
        await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks)
    for conn in idle:
        await conn.close()
    return phase


async def one_at_a_time(base: str, jpegs: list[bytes], count: int) -> Phase:
    """``count`` requests sent one after another on one connection."""
    phase = Phase(1.0)
    conn = Connection(base)
    for i in range(count):
        status, ms, _ = await conn.post(Connection.request(jpegs[i % len(jpegs)]))
        phase.add(status, ms)
    await conn.close()
    return phase
