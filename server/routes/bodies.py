"""Request bodies that are no JSON Python can read, and what to tell their sender.

``json.loads`` raises more than ``JSONDecodeError``: ``UnicodeDecodeError`` for bytes that are
not UTF-8 (or UTF-16/32), ``RecursionError`` for arrays or objects nested deeper than its
parser recurses (about 1,000 here), and ``ValueError`` for an integer of more than 4,300
digits (CPython's int/str limit). Each was a 500 where a route read JSON itself, and FastAPI's
"There was an error parsing the body" (400, naming nothing) where it read a model's body.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import HTTPException
from fastapi.responses import JSONResponse

from server.request_ids import REQUEST_ID
from server.routes.paths import app_path, is_v2_path

# What json.loads raises for a body it cannot read (JSONDecodeError and UnicodeDecodeError are
# ValueErrors).
log = logging.getLogger(__name__)

UNREADABLE = (ValueError, RecursionError)

# FastAPI's answer to a model's body that json.loads raised anything but JSONDecodeError on.
FASTAPI_PARSE_ERROR = "There was an error parsing the body"


def why_unreadable(exc: BaseException) -> str:
    """What is wrong with a body ``json.loads`` raised ``exc`` on, in words for its sender."""
    if isinstance(exc, UnicodeDecodeError):
        byte = exc.object[exc.start : exc.start + 1]
        return f"not UTF-8 text: byte {exc.start} ({byte!r}): {exc.reason}"
    if isinstance(exc, RecursionError):
        return "arrays or objects nested too deeply to read"
    if isinstance(exc, json.JSONDecodeError):
        return f"not JSON: {exc}"
    if "digits" in str(exc):
        return f"an integer of more than {sys.get_int_max_str_digits()} digits"
    return f"not JSON: {exc}"


def load_json(data: bytes | str) -> Any:
    """``json.loads(data)``; ``ValueError`` saying why (``why_unreadable``) where it cannot."""
    try:
        return json.loads(data)
    except UNREADABLE as exc:
        raise ValueError(why_unreadable(exc)) from None


MAX_JSON_BYTES = 1 << 20
"""The largest body of a route that takes JSON settings (streams, their events, webhooks):
a stream of 64 zones of 64 points each is about 60 kB. Those bodies were read whole and
parsed before any check (a 200 MB ``POST /webhooks`` took 6 s and its size in memory)."""

UPLOAD_PREFIXES = ("/detect", "/jobs")
"""Routes whose bodies are uploads, each capped by its own setting (STREAMDET_MAX_UPLOAD_MB,
STREAMDET_MAX_JOB_UPLOAD_MB), as KServe v2's infer calls are (:func:`is_upload`)."""


def is_upload(path: str) -> bool:
    """Whether a body sent to ``path`` (within the app) is an upload with a limit of its own:
    ``UPLOAD_PREFIXES``, and KServe v2's ``.../infer``. (All of ``/v2`` was: a 400 MB
    ``POST /v2/repository/index`` was read whole, 800 MB of the server's memory.)"""
    return path.startswith(UPLOAD_PREFIXES) or (
        path.startswith("/v2/models/") and path.endswith("/infer")
    )


Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
App = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]


class JsonBodyLimit:
    """ASGI middleware: a body sent to a settings route (any POST, PUT or PATCH outside
    :func:`is_upload`) is refused with 413 once past ``limit`` bytes, at once where its
    declared length says so, else as it arrives."""

    def __init__(self, app: App, limit: int = MAX_JSON_BYTES) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        path = app_path(scope)  # without a --root-path prefix
        if (
            scope["type"] != "http"
            or scope["method"] not in ("POST", "PUT", "PATCH")
            or is_upload(path)
        ):
            await self.app(scope, receive, send)
            return
        too_large = f"body larger than {self.limit // 1024} kB: a settings body is JSON of a few kB"
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            key = "error" if is_v2_path(path) else "detail"  # KServe's form under /v2
            await JSONResponse({key: too_large}, status_code=413)(scope, receive, send)
            return
        size = 0

        async def capped() -> MutableMapping[str, Any]:
            nonlocal size
            message = await receive()
            size += len(message.get("body", b""))
            if size > self.limit:
                raise HTTPException(413, too_large)
            return message

        await self.app(scope, capped, send)


DRAIN_MAX_BYTES = 64 << 20
"""At most this much of a body left unread by its answer is read and dropped before the
connection closes (nginx's lingering close reads for up to 30 s; Go's server 256 kB)."""
DRAIN_MAX_S = 30.0
"""... for at most this long."""
DRAIN_IDLE_S = 5.0
"""... stopping once the sender pauses this long."""


CLOSE = (b"connection", b"close")


def declares_body(scope: MutableMapping[str, Any]) -> bool:
    """Whether the request says a body follows (a length over 0, or a transfer encoding)."""
    headers = dict(scope.get("headers") or [])
    length = headers.get(b"content-length", b"")
    return (length.isdigit() and int(length) > 0) or b"transfer-encoding" in headers


class RequestBody:
    """ASGI middleware over every request's body: a deadline between its parts while the
    server reads it, and the rest read and dropped after an answer given before it was read.

    **Deadline.** A body that sends nothing for ``idle_s`` while a route waits for it is
    answered 408 naming ``STREAMDET_BODY_TIMEOUT_S``, its connection closed, as nginx's
    ``client_body_timeout``: a client sending a byte every few seconds held its call (an
    admission slot, a decode thread's turn) and its connection for ever.

    **Drain.** An answer given before its request's body was read whole (a 413 from the
    declared length, a 401, a refusal part way through an upload) is sent, then the rest of
    the body is read and dropped (``DRAIN_MAX_BYTES``, ``DRAIN_MAX_S``, ``DRAIN_IDLE_S``)
    before the answer ends, as nginx's lingering close does. uvicorn closed such a
    connection (``Connection: close``, which README's nginx sends) with the body's rest
    unread: the kernel answers unread data with a reset, and a proxy still sending the body
    (nginx with ``proxy_request_buffering off``) got the reset in place of the answer and
    told its client 502. A client that sends ``Expect: 100-continue`` and has sent nothing
    is not waited for (it sends no body after a final answer), nor one past its deadline.

    Args:
        app: the app inside.
        idle_s: the body's deadline between parts (``STREAMDET_BODY_TIMEOUT_S``).
    """

    def __init__(self, app: App, idle_s: float = 60.0) -> None:
        self.app = app
        self.idle_s = idle_s

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not declares_body(scope):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        waits_for_continue = headers.get(b"expect", b"").lower() == b"100-continue"
        started = ended = late = responded = pending = False

        async def tracked() -> MutableMapping[str, Any]:
            nonlocal started, ended, late
            if ended or responded:  # a disconnect's watch (no 408 can be answered now)
                return await receive()
            waiting = asyncio.ensure_future(receive())
            try:
                done, _ = await asyncio.wait((waiting,), timeout=self.idle_s)
                late = not done and not responded
                if not late:  # it came, or an answer began meanwhile (SSE): a watch from now
                    message = await waiting
            finally:
                waiting.cancel()
            if late:
                log.info(
                    "request %s: %s %s: the body sent nothing for %g s; answered 408 (setting"
                    " STREAMDET_BODY_TIMEOUT_S)",
                    REQUEST_ID.get() or "-",
                    scope["method"],
                    scope["path"],
                    self.idle_s,
                )
                raise HTTPException(
                    408,
                    f"the request's body sent nothing for {self.idle_s:g} s (setting"
                    " STREAMDET_BODY_TIMEOUT_S)",
                    headers={"Connection": "close"},
                ) from None
            started = True
            if message["type"] != "http.request" or not message.get("more_body", False):
                ended = True
            return message

        async def answering(message: MutableMapping[str, Any]) -> None:
            nonlocal responded, pending
            unsent = waits_for_continue and not started and not ended
            if message["type"] == "http.response.start":
                responded = True
                if unsent:  # it may never send its body: the connection cannot be reused
                    message = {**message, "headers": [*message.get("headers", []), CLOSE]}
            last = message["type"] == "http.response.body" and not message.get("more_body")
            if not last or ended or late or unsent:
                await send(message)
                return
            # The answer whole now; the body's rest is read once the app (and the metrics
            # inside, which time the answer, not the drain) has returned.
            await send({**message, "more_body": True})
            pending = True

        await self.app(scope, tracked, answering)
        if pending:
            await self._drain(receive)
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    @staticmethod
    async def _drain(receive: Receive) -> None:
        loop = asyncio.get_running_loop()
        until = loop.time() + DRAIN_MAX_S
        dropped = 0
        while dropped <= DRAIN_MAX_BYTES and (left := until - loop.time()) > 0:
            try:
                async with asyncio.timeout(min(DRAIN_IDLE_S, left)):
                    message = await receive()
            except TimeoutError:
                return
            if message["type"] != "http.request" or not message.get("more_body", False):
                return
            dropped += len(message.get("body", b""))
