"""``HEAD`` for every ``GET`` route: its answer's status and headers, without the body
(RFC 9110 asks every GET resource to answer HEAD). FastAPI's routes took only the methods
they named, so ``HEAD /streams`` or ``HEAD /streams/{id}/latest.jpg`` was a 405: uptime
checkers, link checkers and download tools that ask first were refused.

Routes that declare ``HEAD`` themselves (``/healthz``, clips, snapshots: they skip the work
of a body) keep theirs. The ``GET`` route runs as it would; its body is dropped at its first
part, and the request then reads as disconnected, so an endless answer (MJPEG, server-sent
events) stops there as it does when a viewer leaves."""

from __future__ import annotations

from typing import Any

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
        ended = False

        async def head_send(message: Message) -> None:
            nonlocal ended
            if ended:
                return  # an endless answer's later parts, until it sees the disconnect
            if message["type"] == "http.response.body":
                ended = True
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        async def head_receive() -> Message:
            if ended:
                return {"type": "http.disconnect"}
            return await receive()

        as_get = {**scope, "method": "GET"}
        try:
            await self.app(as_get, head_receive, head_send)
        finally:
            if "route" in as_get:  # the route matched, for the metrics' label
                scope["route"] = as_get["route"]
