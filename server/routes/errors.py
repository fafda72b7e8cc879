"""The app's HTTP errors: FastAPI's own answers, made safe to write and to read back
(refused values cut short, NaN and lone surrogates escaped, a 405's whole ``Allow``), and
under ``/v2`` the KServe v2 protocol's ``{"error": "..."}``, which tritonclient reads."""

from __future__ import annotations

import json
import math
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.head import answers
from server.routes.bodies import FASTAPI_PARSE_ERROR, UNREADABLE, why_unreadable
from server.routes.paths import app_path, is_v2_path


def is_v2(request: Request) -> bool:
    return is_v2_path(app_path(request.scope))  # without a --root-path prefix


async def http_error(request: Request, exc: Exception) -> Response:
    """The app's HTTP errors under ``/v2``: ``{"error": "..."}`` as the protocol (and
    tritonclient) expects; elsewhere FastAPI's own."""
    from fastapi.encoders import jsonable_encoder
    from fastapi.exception_handlers import http_exception_handler

    if isinstance(exc, RequestValidationError):
        if not is_v2(request):
            # FastAPI's own answer, less its failure on a non-finite number or a lone
            # surrogate it echoes (``{"conf": NaN}`` was refused, then could not be written
            # back: a 500), and with each refused value cut short (it was echoed whole).
            errors = [
                {**e, "input": clipped(e["input"])} if "input" in e else e for e in exc.errors()
            ]
            detail = json_safe(jsonable_encoder(errors))
            return JSONResponse({"detail": detail}, status_code=422)
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'][1:])}: {e['msg']}" for e in exc.errors()
        )
        return JSONResponse({"error": json_safe(problems)}, status_code=422)
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 405:
        exc.headers = {**(exc.headers or {}), "Allow": allowed_methods(request)}
    cause = exc.__cause__
    if exc.detail == FASTAPI_PARSE_ERROR and isinstance(cause, UNREADABLE):
        # FastAPI's 400 for a model's body json.loads raised other than JSONDecodeError on
        # (not UTF-8, nested too deep, a 5,000-digit integer): named as its own JSON errors are.
        problem = {"type": "json_invalid", "loc": ["body"], "msg": why_unreadable(cause)}
        if is_v2(request):
            return JSONResponse({"error": f"body: {problem['msg']}"}, status_code=400)
        return JSONResponse({"detail": [problem]}, status_code=422)
    if not is_v2(request):
        return await http_exception_handler(request, exc)
    detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
    return JSONResponse({"error": detail}, status_code=exc.status_code, headers=exc.headers)


HTTP_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")


def allowed_methods(request: Request) -> str:
    """Every method the request's path answers, for a 405's ``Allow``: Starlette's names only
    those of the first route of the path (``GET /streams`` and ``POST /streams`` are two), so
    ``Allow: POST`` left ``GET`` out (RFC 9110 asks for all of them)."""
    routes = request.app.router.routes
    methods = [m for m in HTTP_METHODS if answers(routes, request.scope, m)]
    if "GET" in methods and "HEAD" not in methods:  # server.head answers it
        methods.insert(methods.index("GET") + 1, "HEAD")
    return ", ".join(methods)


ECHO_CHARS = 200
ECHO_ITEMS = 20


def clipped(value: Any, depth: int = 0) -> Any:
    """A refused value as a 422 echoes it: a string cut to its first ``ECHO_CHARS``
    characters, a list or object of more than ``ECHO_ITEMS`` items (or nested deeper than 4)
    named by its size. FastAPI echoed each whole: a 20 MB ``url`` came back as 20 MB."""
    if isinstance(value, str) and len(value) > ECHO_CHARS:
        return f"{value[:ECHO_CHARS]}... ({len(value)} characters)"
    if isinstance(value, list | tuple | dict):
        if len(value) > ECHO_ITEMS or (value and depth >= 4):
            kind = "an object" if isinstance(value, dict) else "a list"
            return f"({kind} of {len(value)} items)"
        if isinstance(value, dict):
            return {clipped(k): clipped(v, depth + 1) for k, v in value.items()}
        return [clipped(v, depth + 1) for v in value]
    return value


def json_safe(value: Any) -> Any:
    """``value`` with every NaN or infinity (JSON has neither) as its text: ``"nan"``, and
    every lone surrogate (``"\\ud800"`` in a body's JSON: no UTF-8 can carry it, and echoing
    it back was a 500) as its escape."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return value.encode("utf-8", "backslashreplace").decode()
        return value
    if isinstance(value, dict):
        return {json_safe(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    return value
