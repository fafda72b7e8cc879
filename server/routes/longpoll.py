"""Waiting on a client's behalf, unless it has gone: a long poll (``GET /events?wait_s``,
``GET /jobs/{id}?wait_s``) or a queued call (``POST /detect``) whose client hangs up stops
waiting for nobody (a dropped long poll held its task for up to a minute)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from fastapi import Request


async def disconnected(request: Request) -> None:
    """Return once the client of ``request`` (its body read) has closed the connection."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def wait_unless_gone(request: Request, waiting: Awaitable[object]) -> bool:
    """Await ``waiting`` unless the client of ``request`` goes first (then it is cancelled);
    whether the client went."""
    work = asyncio.ensure_future(waiting)
    gone = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, gone):
            task.cancel()
    if work.done() and not work.cancelled():
        work.result()  # the wait's own error, if any, is the caller's (not dropped)
    if gone.done() and not gone.cancelled():
        gone.result()  # the watch's error (a body past its deadline: 408) is not a hang-up
        return True
    return False
