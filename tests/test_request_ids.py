"""The request id's middleware and log filter, in process: what a line logged while a request
is served begins with, the error line of an app that raised among them."""

from __future__ import annotations

import logging

import pytest

from server.request_ids import REQUEST_ID, RequestIdFilter, RequestIdMiddleware


def _record(msg: str, args: object) -> logging.LogRecord:
    return logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, msg, args, None)  # type: ignore[arg-type]


async def test_an_apps_error_is_logged_with_its_requests_id() -> None:
    """The id was reset as the error left the middleware, before uvicorn logged it (in the
    same task): ``Exception in ASGI application`` had none."""
    seen: list[str | None] = []

    async def app(scope: object, receive: object, send: object) -> None:
        seen.append(REQUEST_ID.get())
        raise RuntimeError("boom")

    scope = {"type": "http", "headers": [(b"x-request-id", b"call 9")]}
    with pytest.raises(RuntimeError):
        await RequestIdMiddleware(app)(scope, None, None)  # type: ignore[arg-type]
    assert seen == ["call_9"]
    record = _record("Exception in ASGI application\n", ())
    RequestIdFilter().filter(record)
    assert record.getMessage() == "request call_9: Exception in ASGI application\n"


def test_the_filter_keeps_a_lines_arguments_and_percent_signs() -> None:
    token = REQUEST_ID.set("a1")
    try:
        access = _record('%s - "%s %s HTTP/%s" %d', ("127.0.0.1:5", "GET", "/x?q=5%", "1.1", 200))
        RequestIdFilter().filter(access)
        assert access.getMessage() == 'request a1: 127.0.0.1:5 - "GET /x?q=5% HTTP/1.1" 200'
        plain = _record("100% done", ())
        RequestIdFilter().filter(plain)
        assert plain.getMessage() == "request a1: 100% done"
    finally:
        REQUEST_ID.reset(token)
    outside = _record("Started server process [%d]", (7,))
    RequestIdFilter().filter(outside)
    assert outside.getMessage() == "Started server process [7]"
