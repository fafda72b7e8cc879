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

# Under every window the clients run for (``streamdet bench``: 20 s, the overload phases:
# 8-60 s), and recorded as ``ReadTimeout`` when it fires, so a hung call is an error.
CLIENT_TIMEOUT_S = 10.0
# A kept-alive connection idle longer than this is reopened before a call rather than
# reused: uvicorn closes idle ones after 5 s, and a POST the server may have read is never
# sent twice.
KEEPALIVE_IDLE_S = 4.0
# Statuses an overloaded server may answer with: a result, or shed with Retry-After.
EXPECTED = ("200", "429")
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

    @property
    def unexpected(self) -> dict[str, int]:
        """Statuses other than 200 and 429: 5xx, 4xx, timeouts and dropped connections
        (``IncompleteReadError``, ``ConnectionResetError``, ...)."""
        return {s: n for s, n in self.statuses.items() if s not in EXPECTED}

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
        self._idle_since = time.monotonic()
        self._sent = False

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
        self._sent = False
        if self._writer is None or self._reader is None:
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        self._writer.write(request)
        await self._writer.drain()
        self._sent = True  # from here on the server may have read the request
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

    def _stale(self) -> bool:
        """The kept-alive connection is closed by the server, or idle long enough that it
        may close it while the request is on its way."""
        if self._writer is None or self._reader is None:
            return False
        idle = time.monotonic() - self._idle_since
        return self._reader.at_eof() or self._writer.is_closing() or idle > KEEPALIVE_IDLE_S

    async def post(
        self, request: bytes, timeout_s: float = CLIENT_TIMEOUT_S
    ) -> tuple[str, float, str | None]:
        """One call: (status or exception name, milliseconds, Retry-After); ``ReadTimeout``
        when no answer came within ``timeout_s``. A kept-alive connection the server closed
        (uvicorn's keep-alive timeout is 5 s), or idle for :data:`KEEPALIVE_IDLE_S`, is
        reopened first; the call is sent again only when sending it failed on a reused
        connection. Once the request is written a dropped connection is the call's result
        (``IncompleteReadError``, ``ConnectionResetError``): a POST is never sent twice."""
        t0 = time.monotonic()
        if self._stale():
            await self.close()
        for attempt in (0, 1):
            reused = self._writer is not None
            try:
                status, retry = await asyncio.wait_for(self._exchange(request), timeout_s)
                break
            except TimeoutError:  # before OSError: a TimeoutError is one
                await self.close()
                status, retry = "ReadTimeout", None
                break
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
                await self.close()
                status, retry = type(exc).__name__, None
                if self._sent or not (reused and attempt == 0):
                    break
        self._idle_since = time.monotonic()
        return status, (self._idle_since - t0) * 1000, retry

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
    timeout_s: float = CLIENT_TIMEOUT_S,
) -> Phase:
    """``clients`` tasks: post, wait for the answer, post the next; after a 429 or 503, wait
    Retry-After (``impatient``: 50 ms). Every call started in the ``seconds`` after ``warmup``
    is counted when it ends, the last ones after the window (waited for, at most
    ``timeout_s``, then counted as ``ReadTimeout``): the slowest calls are not left out."""
    phase = Phase(seconds)
    start = time.monotonic()
    measure_from, stop_at = start + warmup, start + warmup + seconds
    requests = [Connection.request(j, multipart=multipart) for j in jpegs]

    async def client(k: int) -> None:
        conn = Connection(base)
        i = k
        while time.monotonic() < stop_at:
            t0 = time.monotonic()
            status, ms, retry = await conn.post(requests[i % len(requests)], timeout_s)
            i += clients
            if t0 >= measure_from:
                phase.add(status, ms)
            if status in BACK_OFF:
                pause = 0.05 if impatient else float(retry or 1)
                await asyncio.sleep(min(pause, max(0.0, stop_at - time.monotonic())))
        await conn.close()

    await asyncio.gather(*(client(k) for k in range(clients)))
    return phase


async def open_loop(
    base: str,
    jpegs: list[bytes],
    rate: float,
    seconds: float,
    timeout_s: float = CLIENT_TIMEOUT_S,
) -> Phase:
    """Poisson arrivals at ``rate``/s, each its own request, whatever the server's pace.

    Arrivals are planned on one timeline from the start (a late wake-up does not push the
    later ones back, so the rate asked is the rate sent), and each call's latency is timed
    from its planned arrival: a send delayed by the client counts against the latency, not
    out of it (no coordinated omission)."""
    phase = Phase(seconds)
    rng = random.Random(5)
    requests = [Connection.request(j) for j in jpegs]
    idle: list[Connection] = []  # keep-alive connections free for the next arrival
    tasks: list[asyncio.Task[None]] = []

    async def one(request: bytes, planned: float) -> None:
        conn = idle.pop() if idle else Connection(base)
        status, _, _ = await conn.post(request, timeout_s)
        phase.add(status, (time.monotonic() - planned) * 1000)
        idle.append(conn)

    start = time.monotonic()
    end = start + seconds
    planned = start
    i = 0
    while planned < end:
        delay = planned - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(requests[i % len(requests)], planned)))
        i += 1
        planned += rng.expovariate(rate)
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
