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

Environment: ``STREAMDET_LOADTEST_WAIT_S`` (``min,max`` think time of a detect user),
``STREAMDET_LOADTEST_STREAMS`` (stream ids for live users), ``STREAMDET_LOADTEST_API_KEY``
(bearer token, when the server has keys), ``STREAMDET_SHARED_DIR`` (where the clips are).
"""

from __future__ import annotations

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
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from loadtest.frames import Payload, build_payloads

log = logging.getLogger(__name__)

WS_REQUEST_NAME = "frame"
WS_REQUEST_TYPE = "WS"
FRAME_TIMEOUT_S = 15.0
EVENT_REQUEST_NAME = "event"
EVENT_REQUEST_TYPE = "SSE"
EVENT_TYPES = "line_crossing,zone_enter,zone_exit"  # a frame's events (not stream states)

_payloads: list[Payload] = []
_next_payload = itertools.count()
_next_stream = itertools.count()


def _wait_range() -> tuple[float, float]:
    raw = os.environ.get("STREAMDET_LOADTEST_WAIT_S", "0.5,1.0")
    low, high = (float(v) for v in raw.split(","))
    return low, high


def _auth_headers() -> dict[str, str]:
    key = os.environ.get("STREAMDET_LOADTEST_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


@events.init.add_listener  # type: ignore[untyped-decorator]
def _load_frames(environment: Environment, **_: Any) -> None:
    """Decode the clips once per Locust process, before any user starts."""
    per_clip = int(os.environ.get("STREAMDET_LOADTEST_PER_CLIP", "6"))
    _payloads.extend(build_payloads(per_clip=per_clip))
    log.info("loadtest: %d JPEG payloads ready", len(_payloads))
    # gevent's loop caches "now"; after seconds of blocking decode it is stale, and the
    # --run-time timer Locust arms next would be due at once (seen on a busy machine: a
    # 4 s run stopped 6 ms after starting, with one request).
    gevent.get_hub().loop.update_now()


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
    """A client posting frames to ``/detect`` in a closed loop with think time."""

    wait_time = between(*_wait_range())

    @task
    def detect(self) -> None:
        payload = _payloads[next(_next_payload) % len(_payloads)]
        headers = {"Content-Type": "image/jpeg", **_auth_headers()}
        with self.client.post(
            "/detect",
            data=payload.jpeg,  # type: ignore[arg-type]  # geventhttpclient sends bytes as is
            headers=headers,
            name="/detect",
            catch_response=True,
        ) as resp:
            if resp.status_code == 200:
                resp.success()
            elif resp.status_code == 429:
                resp.failure(f"429 shed (Retry-After {resp.headers.get('Retry-After')})")
            else:
                resp.failure(f"{resp.status_code}: {(resp.text or '')[:200]}")


class LiveUser(User):
    """A viewer of one stream; every frame it receives is one Locust 'request'."""

    wait_time = constant(0)

    def __init__(self, environment: Environment) -> None:
        super().__init__(environment)
        self._ws: ClientConnection | None = None
        self._stack = ExitStack()

    def on_start(self) -> None:
        ids = [s for s in os.environ.get("STREAMDET_LOADTEST_STREAMS", "").split(",") if s]
        if not ids:
            raise RuntimeError(
                "LiveUser needs stream ids in STREAMDET_LOADTEST_STREAMS (streamdet loadtest"
                " adds the streams and sets it)"
            )
        stream_id = ids[next(_next_stream) % len(ids)]
        host = (self.host or "").replace("http://", "ws://").replace("https://", "wss://")
        self._ws = self._stack.enter_context(
            connect(
                f"{host}/ws/streams/{stream_id}",
                additional_headers=_auth_headers(),
                open_timeout=FRAME_TIMEOUT_S,
            )
        )

    def on_stop(self) -> None:
        self._ws = None
        self._stack.close()

    @task
    def receive_frame(self) -> None:
        if self._ws is None:
            return
        start = time.perf_counter()
        try:
            message = self._ws.recv(timeout=FRAME_TIMEOUT_S)
        except (TimeoutError, ConnectionClosed) as exc:
            self._fire(0.0, 0, exc)
            if isinstance(exc, ConnectionClosed):
                self._ws = None
            return
        received = time.time()
        text = message if isinstance(message, str) else message.decode()
        try:
            frame = json.loads(text)
            latency_ms = (received - float(frame["captured_at"])) * 1000.0
        except (ValueError, KeyError, TypeError) as exc:
            self._fire((time.perf_counter() - start) * 1000, len(text), exc)
            return
        self._fire(latency_ms, len(text), None)

    def _fire(self, ms: float, length: int, exc: BaseException | None) -> None:
        fire(self.environment, WS_REQUEST_TYPE, WS_REQUEST_NAME, ms=ms, length=length, exc=exc)


class EventUser(User):
    """A reader of every stream's events as server-sent events; each event it receives is
    one Locust 'request'."""

    wait_time = constant(0)

    def __init__(self, environment: Environment) -> None:
        super().__init__(environment)
        self._lines: Iterator[str] | None = None
        self._stack = ExitStack()

    def on_start(self) -> None:
        client = self._stack.enter_context(
            httpx.Client(base_url=self.host or "", timeout=httpx.Timeout(10.0, read=60.0))
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
        self._lines = response.iter_lines()

    def on_stop(self) -> None:
        self._lines = None
        self._stack.close()

    @task
    def receive_event(self) -> None:
        if self._lines is None:
            return
        try:
            for line in self._lines:  # comments (keep-alives) and ids pass by
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
