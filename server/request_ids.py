"""Each request's id: taken from the client's ``X-Request-ID`` or made, carried by every log
line said while the request is served (uvicorn's request line too) and sent back.

uvicorn's request lines carried no id, so a refused or slow call's own lines (``request
3f2a...: 429 ...``) could not be matched with its line in the access log; a call without an
``X-Request-ID`` got a different made-up id in each place that asked for one.
"""

from __future__ import annotations

import logging
import re
import uuid
from contextvars import ContextVar

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

MAX_REQUEST_ID = 64
"""Characters of a client's ``X-Request-ID`` kept (a UUID is 36, a W3C trace parent 55)."""
_NOT_ID = re.compile(r"[^A-Za-z0-9._:-]")

REQUEST_ID: ContextVar[str | None] = ContextVar("streamdet_request_id", default=None)
"""The id of the request being served (None outside one)."""


def client_request_id(sent: str | None) -> str:
    """The id a call's log lines carry: the client's ``X-Request-ID`` (gRPC: its
    ``x-request-id`` metadata), any character outside ``A-Za-z0-9._:-`` as ``_`` and at
    most :data:`MAX_REQUEST_ID` of them; 12 random hex digits where it sent none. It went
    into the log as sent, of any length (a 300-character id, spaces and quotes that forge a
    line's fields, in each line of the call)."""
    kept = _NOT_ID.sub("_", (sent or "").strip()[:MAX_REQUEST_ID])
    return kept or uuid.uuid4().hex[:12]


def request_id(sent: str | None) -> str:
    """The id of the request being served (:class:`RequestIdMiddleware`'s), else one made
    from ``sent`` (a request served outside the middleware: in-process tests, gRPC)."""
    return REQUEST_ID.get() or client_request_id(sent)


class RequestIdMiddleware:
    """ASGI middleware: gives each HTTP request and WebSocket its id, sets it for the lines
    logged while it is served, and answers it back as ``X-Request-ID`` (on every answer: a
    client that sent none learns the id its lines carry)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        rid = client_request_id(Headers(scope=scope).get("x-request-id"))
        header = (b"x-request-id", rid.encode())

        async def answering(message: Message) -> None:
            if message["type"] in _ANSWERS:
                kept = [h for h in message.get("headers", []) if h[0].lower() != b"x-request-id"]
                message = {**message, "headers": [*kept, header]}
            await send(message)

        token = REQUEST_ID.set(rid)
        await self.app(scope, receive, answering)
        # Not reset where the app raised: uvicorn logs the error after, in this task (each
        # request has its own), and its line carries the id too.
        REQUEST_ID.reset(token)


_ANSWERS = ("http.response.start", "websocket.accept", "websocket.http.response.start")
"""The messages that open an answer, whose headers get the request's id."""


class RequestIdFilter(logging.Filter):
    """Begins a line logged while a request is served with ``request <id>: ``, as our own
    lines begin (for uvicorn's: its request line, a WebSocket's accept or close, the error
    of an application that raised)."""

    def filter(self, record: logging.LogRecord) -> bool:
        rid = REQUEST_ID.get()
        if rid is None:
            return True
        if isinstance(record.args, tuple) and record.args:
            record.msg, record.args = f"request %s: {record.msg}", (rid, *record.args)
        else:  # no arguments (no %-formatting) or a mapping: the id has no % to escape
            record.msg = f"request {rid}: {record.msg}"
        return True
