"""Locust scenarios for streamdet. Run through ``streamdet loadtest`` (which sets the
environment below), or by hand::

    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000 DetectUser

* ``DetectUser`` (scenario ``detect``): posts real frames from the shared clips, at four
  sizes (thumbnail to 720p), as raw JPEG bodies to ``POST /detect``. A ``429`` counts as a
  failure: the profile's error-rate ceiling says how much shedding is acceptable.
* ``LiveUser`` (scenario ``live``): subscribes to ``WS /ws/streams/{id}`` and records each
  frame's latency as the client sees it (receive time minus the frame's ``captured_at``)
  under the request name ``WS frame``.
* ``EventUser`` (with live streams, ``event_users`` in the profile): reads ``GET /events`` as
  server-sent events and records each line crossing's and zone entry's or exit's latency
  (receive time minus its frame's ``captured_at``) under the request name ``SSE event``.
* ``mixed``: both user classes at once.

Every call has a timeout well under the run (``STREAMDET_LOADTEST_TIMEOUT_S``, which
``streamdet loadtest`` sets to a quarter of the run time, 1-30 s): an unanswered ``/detect``
call is a failure at that time, and one still unanswered when the run stops is recorded as a
failure then (with the time it waited), never dropped. A viewer or reader whose connection
closes (or never opens) records a failure and reconnects after a back-off (0.5 s, doubling to
5 s), never spinning.

Environment: ``STREAMDET_LOADTEST_WAIT_S`` (``min,max`` think time of a detect user),
``STREAMDET_LOADTEST_TIMEOUT_S`` (seconds a call, a frame or an event may take; 15),
``STREAMDET_LOADTEST_FINAL_CSV`` (where to write the final figures as a Locust
``*_stats.csv``, with ``_failures`` added to the stem for the failures: Locust's own
``--csv`` files are rewritten once a second and miss what is recorded as the run stops),
``STREAMDET_LOADTEST_STREAMS`` (stream ids for live users), ``STREAMDET_LOADTEST_API_KEY``
(bearer token, when the server has keys), ``STREAMDET_SHARED_DIR`` (where the clips are).
"""

from __future__ import annotations

import csv
import itertools
import json
import logging
import os
import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import gevent  # type: ignore[import-untyped]  # no stubs; Locust depends on it
import httpx
from locust import FastHttpUser, User, between, constant, events, task
from locust.env import Environment
from locust.stats import PERCENTILES_TO_REPORT, StatsCSV
from websockets.exceptions import ConnectionClosed, WebSocketException
from websockets.sync.client import ClientConnection, connect

from loadtest.frames import Payload, build_payloads

log = logging.getLogger(__name__)

WS_REQUEST_NAME = "frame"
WS_REQUEST_TYPE = "WS"
DETECT_NAME = "/detect"
DEFAULT_TIMEOUT_S = 15.0
RECONNECT_FIRST_S = 0.5  # back-off before reconnecting a closed viewer or reader...
RECONNECT_MAX_S = 5.0  # ...doubling up to this
EVENT_REQUEST_NAME = "event"
EVENT_REQUEST_TYPE = "SSE"
EVENT_TYPES = "line_crossing,zone_enter,zone_exit"  # a frame's events (not stream states)

_payloads: list[Payload] = []
_stopping_at: list[float] = []  # perf_counter() when the run began to stop
_environment: list[Environment] = []  # this process's, for the quit listener
_next_payload = itertools.count()
_next_stream = itertools.count()


def _wait_range() -> tuple[float, float]:
    raw = os.environ.get("STREAMDET_LOADTEST_WAIT_S", "0.5,1.0")
    low, high = (float(v) for v in raw.split(","))
    return low, high


def _timeout_s() -> float:
    """Seconds a /detect call, a WebSocket frame or an event may take before it is a failure."""
    return float(os.environ.get("STREAMDET_LOADTEST_TIMEOUT_S", DEFAULT_TIMEOUT_S))


def _auth_headers() -> dict[str, str]:
    key = os.environ.get("STREAMDET_LOADTEST_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


@events.init.add_listener  # type: ignore[untyped-decorator]
def _load_frames(environment: Environment, **_: Any) -> None:
    """Decode the clips once per Locust process, before any user starts."""
    _environment.append(environment)
    per_clip = int(os.environ.get("STREAMDET_LOADTEST_PER_CLIP", "6"))
    _payloads.extend(build_payloads(per_clip=per_clip))
    log.info("loadtest: %d JPEG payloads ready", len(_payloads))
    # gevent's loop caches "now"; after seconds of blocking decode it is stale, and the
    # --run-time timer Locust arms next would be due at once (seen on a busy machine: a
    # 4 s run stopped 6 ms after starting, with one request).
    gevent.get_hub().loop.update_now()


@events.test_stopping.add_listener  # type: ignore[untyped-decorator]
def _mark_stopping(**_: Any) -> None:
    """When the run began to stop: a call a user starts after it (a wait ending in the same
    instant) never had a chance to be answered, and is not counted as unanswered."""
    if not _stopping_at:
        _stopping_at.append(time.perf_counter())


@events.quit.add_listener  # type: ignore[untyped-decorator]
def _write_final_stats(**_: Any) -> None:
    """The figures once every user has stopped (what was recorded as they stopped included)
    to ``STREAMDET_LOADTEST_FINAL_CSV``, in the format of Locust's ``*_stats.csv``."""
    path = os.environ.get("STREAMDET_LOADTEST_FINAL_CSV")
    if not path or not _environment:
        return
    writer = StatsCSV(_environment[0], PERCENTILES_TO_REPORT)
    with open(path, "w", newline="") as f:
        writer.requests_csv(csv.writer(f))
    stem, dot, ext = path.rpartition(".")
    with open(f"{stem}_failures{dot}{ext}", "w", newline="") as f:
        writer.failures_csv(csv.writer(f))


def fire(
    environment: Environment,
    kind: str,
    name: str,
    *,
    ms: float,
    length: int,
    exc: BaseException | None,
) -> None:
    """Record one received message (a WebSocket frame, an event) as a Locust request."""
    environment.events.request.fire(  # type: ignore[no-untyped-call]  # Locust: untyped
        request_type=kind,
        name=name,
        response_time=ms,
        response_length=length,
        exception=exc,
        context={},
    )


class DetectUser(FastHttpUser):
    """A client posting frames to ``/detect`` in a closed loop with think time. A call that
    gets no answer within the timeout is a failure; one still unanswered when the run stops
    is recorded as a failure when the user is stopped."""

    wait_time = between(*_wait_range())
    network_timeout = _timeout_s()
    connection_timeout = _timeout_s()

    def __init__(self, environment: Environment) -> None:
        super().__init__(environment)
        self._in_flight: float | None = None  # perf_counter() when the unanswered call began

    @task
    def detect(self) -> None:
        payload = _payloads[next(_next_payload) % len(_payloads)]
        headers = {"Content-Type": "image/jpeg", **_auth_headers()}
        self._in_flight = time.perf_counter()
        with self.client.post(
            "/detect",
            data=payload.jpeg,  # type: ignore[arg-type]  # geventhttpclient sends bytes as is
            headers=headers,
            name=DETECT_NAME,
            catch_response=True,
        ) as resp:
            self._in_flight = None
            if resp.status_code == 200:
                resp.success()
            elif resp.status_code == 429:
                resp.failure(f"429 shed (Retry-After {resp.headers.get('Retry-After')})")
            elif resp.status_code == 0:  # no answer: timed out, refused, dropped
                resp.failure(f"no response: {resp.error!r}")
            else:
                resp.failure(f"{resp.status_code}: {(resp.text or '')[:200]}")

    def on_stop(self) -> None:
        """The run stopped this user with its call unanswered: Locust drops such a call
        silently; it is a failure (and its wait so far a latency) when it was sent before
        the run began to stop."""
        began, self._in_flight = self._in_flight, None
        if began is not None and (not _stopping_at or began < _stopping_at[0]):
            waited = time.perf_counter() - began
            exc = TimeoutError("no answer when the run stopped")
            fire(self.environment, "POST", DETECT_NAME, ms=waited * 1000, length=0, exc=exc)


class _Backoff:
    """Reconnect delays: none before the first connection, then :data:`RECONNECT_FIRST_S`,
    doubling to :data:`RECONNECT_MAX_S` while connections deliver nothing."""

    def __init__(self) -> None:
        self.delay = 0.0

    def wait(self) -> None:
        if self.delay:
            gevent.sleep(self.delay)
        self.delay = min(RECONNECT_MAX_S, max(RECONNECT_FIRST_S, self.delay * 2))

    def reset(self) -> None:
        self.delay = RECONNECT_FIRST_S


class LiveUser(User):
    """A viewer of one stream; every frame it receives is one Locust 'request'. A closed or
    refused connection is a failure, and the viewer reconnects after a back-off."""

    wait_time = constant(0)

    def __init__(self, environment: Environment) -> None:
        super().__init__(environment)
        self._ws: ClientConnection | None = None
        self._stack = ExitStack()
        self._url = ""
        self._backoff = _Backoff()

    def on_start(self) -> None:
        ids = [s for s in os.environ.get("STREAMDET_LOADTEST_STREAMS", "").split(",") if s]
        if not ids:
            raise RuntimeError(
                "LiveUser needs stream ids in STREAMDET_LOADTEST_STREAMS (streamdet loadtest"
                " adds the streams and sets it)"
            )
        stream_id = ids[next(_next_stream) % len(ids)]
        host = (self.host or "").replace("http://", "ws://").replace("https://", "wss://")
        self._url = f"{host}/ws/streams/{stream_id}"

    def on_stop(self) -> None:
        self._ws = None
        self._stack.close()

    def _connect(self) -> None:
        self._backoff.wait()
        self._stack.close()
        try:
            self._ws = self._stack.enter_context(
                connect(self._url, additional_headers=_auth_headers(), open_timeout=_timeout_s())
            )
        except (OSError, TimeoutError, WebSocketException) as exc:
            self._fire(0.0, 0, exc)

    @task
    def receive_frame(self) -> None:
        if self._ws is None:
            self._connect()
            if self._ws is None:
                return
        start = time.perf_counter()
        try:
            message = self._ws.recv(timeout=_timeout_s())
        except (TimeoutError, ConnectionClosed) as exc:
            self._fire(0.0, 0, exc)
            if isinstance(exc, ConnectionClosed):
                self._ws = None
            return
        received = time.time()
        self._backoff.reset()
        text = message if isinstance(message, str) else message.decode()
        try:
            frame = json.loads(text)
            if isinstance(frame, dict) and "type" in frame:
                return  # a stream_state event, not a frame
            latency_ms = (received - float(frame["captured_at"])) * 1000.0
        except (ValueError, KeyError, TypeError) as exc:
            self._fire((time.perf_counter() - start) * 1000, len(text), exc)
            return
        self._fire(latency_ms, len(text), None)

    def _fire(self, ms: float, length: int, exc: BaseException | None) -> None:
        fire(self.environment, WS_REQUEST_TYPE, WS_REQUEST_NAME, ms=ms, length=length, exc=exc)


class EventUser(User):
    """A reader of every stream's events as server-sent events; each event it receives is
    one Locust 'request'. A stream that ends, fails or cannot open is a failure, and the
    reader reconnects after a back-off."""

    wait_time = constant(0)

    def __init__(self, environment: Environment) -> None:
        super().__init__(environment)
        self._lines: Iterator[str] | None = None
        self._stack = ExitStack()
        self._backoff = _Backoff()

    def on_stop(self) -> None:
        self._lines = None
        self._stack.close()

    def _connect(self) -> None:
        self._backoff.wait()
        self._stack.close()
        try:
            timeout = httpx.Timeout(10.0, read=max(60.0, _timeout_s()))  # keep-alives: 15 s
            client = self._stack.enter_context(
                httpx.Client(base_url=self.host or "", timeout=timeout)
            )
            response = self._stack.enter_context(
                client.stream(
                    "GET",
                    "/events",
                    params={"type": EVENT_TYPES},
                    headers={"Accept": "text/event-stream", **_auth_headers()},
                )
            )
            response.raise_for_status()
        except httpx.HTTPError as exc:
            self._stack.close()
            self._fire(0.0, 0, exc)
            return
        self._lines = response.iter_lines()

    @task
    def receive_event(self) -> None:
        if self._lines is None:
            self._connect()
            if self._lines is None:
                return
        try:
            for line in self._lines:  # comments (keep-alives) and ids pass by
                self._backoff.reset()
                if line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "captured_at" in event:  # not a "missed" notice
                        latency_ms = (time.time() - float(event["captured_at"])) * 1000.0
                        self._fire(latency_ms, len(line), None)
                        return
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            self._fire(0.0, 0, exc)
            self._lines = None
            return
        self._fire(0.0, 0, RuntimeError("the server ended the event stream"))
        self._lines = None

    def _fire(self, ms: float, length: int, exc: BaseException | None) -> None:
        fire(
            self.environment, EVENT_REQUEST_TYPE, EVENT_REQUEST_NAME, ms=ms, length=length, exc=exc
        )


# `streamdet loadtest` fixes how many users of each class run (Locust otherwise splits
# the user count by weight); by hand, without these variables, weights apply.
if os.environ.get("STREAMDET_LOADTEST_DETECT_USERS") is not None:
    DetectUser.fixed_count = int(os.environ["STREAMDET_LOADTEST_DETECT_USERS"])
if os.environ.get("STREAMDET_LOADTEST_LIVE_USERS") is not None:
    LiveUser.fixed_count = int(os.environ["STREAMDET_LOADTEST_LIVE_USERS"])
if os.environ.get("STREAMDET_LOADTEST_EVENT_USERS") is not None:
    EventUser.fixed_count = int(os.environ["STREAMDET_LOADTEST_EVENT_USERS"])
