"""``HEAD`` for every ``GET`` route: its answer's status and headers, without the body
(RFC 9110 asks every GET resource to answer HEAD). FastAPI's routes took only the methods
they named, so ``HEAD /streams`` or ``HEAD /streams/{id}/latest.jpg`` was a 405: uptime
checkers, link checkers and download tools that ask first were refused.

Routes that declare ``HEAD`` themselves (``/healthz``, clips, snapshots: they skip the work
of a body) keep theirs. The ``GET`` route runs as it would; its body is dropped at its first
part, and the request then reads as disconnected, so an endless answer (MJPEG, server-sent
events) stops there as it does when a viewer leaves."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import ClientDisconnect
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send


def answers(routes: list[BaseRoute], scope: Scope, method: str) -> bool:
    """Whether one of ``routes`` takes ``scope``'s path with ``method``."""
    asked: dict[str, Any] = {**scope, "method": method}
    if "fastapi" in asked:  # FastAPI's routers note their matching there
        asked["fastapi"] = dict(asked["fastapi"])
    return any(route.matches(asked)[0] == Match.FULL for route in routes)


class HeadAsGet:
    """Answers ``HEAD`` with the ``GET`` route of its path where no route takes ``HEAD``."""

    def __init__(self, app: ASGIApp, routes: list[BaseRoute]) -> None:
        self.app = app
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] != "HEAD"
            or answers(self.routes, scope, "HEAD")
            or not answers(self.routes, scope, "GET")
        ):
            await self.app(scope, receive, send)
            return
        ended = asyncio.Event()

        async def head_send(message: Message) -> None:
            if ended.is_set():  # an endless answer's next part: it ends here
                raise HeadSent("HEAD: only the headers are sent")
            if message["type"] == "http.response.body":
                ended.set()
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        async def head_receive() -> Message:
            """The client's messages, and a disconnect once the headers are sent: a wait
            begun before (a streaming answer's watch for the client leaving) is woken too;
            behind a pipelined request the server never woke it, and the answer ran on."""
            if ended.is_set():
                return DISCONNECT
            received = asyncio.ensure_future(receive())
            sent = asyncio.ensure_future(ended.wait())
            await asyncio.wait((received, sent), return_when=asyncio.FIRST_COMPLETED)
            sent.cancel()
            if received.done():
                return received.result()
            received.cancel()
            return DISCONNECT

        as_get = {**scope, "method": "GET"}
        try:
            await self.app(as_get, head_receive, head_send)
        except (HeadSent, ClientDisconnect):
            if not ended.is_set():
                raise
        finally:
            if "route" in as_get:  # the route matched, for the metrics' label
                scope["route"] = as_get["route"]


class HeadSent(OSError):
    """Raised to an answer that sends more after a ``HEAD``'s headers went out (an OSError:
    as a client gone, which Starlette's streaming answers end on)."""


DISCONNECT: Message = {"type": "http.disconnect"}
