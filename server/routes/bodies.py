"""Request bodies that are no JSON Python can read, and what to tell their sender.

``json.loads`` raises more than ``JSONDecodeError``: ``UnicodeDecodeError`` for bytes that are
not UTF-8 (or UTF-16/32), ``RecursionError`` for arrays or objects nested deeper than its
parser recurses (about 1,000 here), and ``ValueError`` for an integer of more than 4,300
digits (CPython's int/str limit). Each was a 500 where a route read JSON itself, and FastAPI's
"There was an error parsing the body" (400, naming nothing) where it read a model's body.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import HTTPException
from fastapi.responses import JSONResponse

from server.routes.paths import app_path

# What json.loads raises for a body it cannot read (JSONDecodeError and UnicodeDecodeError are
# ValueErrors).
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

UPLOAD_PREFIXES = ("/detect", "/jobs", "/v2")
"""Routes whose bodies are uploads, each capped by its own setting (STREAMDET_MAX_UPLOAD_MB,
STREAMDET_MAX_JOB_UPLOAD_MB)."""

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
App = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]


class JsonBodyLimit:
    """ASGI middleware: a body sent to a settings route (any POST, PUT or PATCH outside
    ``UPLOAD_PREFIXES``) is refused with 413 once past ``limit`` bytes, at once where its
    declared length says so, else as it arrives."""

    def __init__(self, app: App, limit: int = MAX_JSON_BYTES) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        path = app_path(scope)  # without a --root-path prefix
        if (
            scope["type"] != "http"
            or scope["method"] not in ("POST", "PUT", "PATCH")
            or path.startswith(UPLOAD_PREFIXES)
        ):
            await self.app(scope, receive, send)
            return
        too_large = f"body larger than {self.limit // 1024} kB: a settings body is JSON of a few kB"
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            await JSONResponse({"detail": too_large}, status_code=413)(scope, receive, send)
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
