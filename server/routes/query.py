"""A route's query string checked against what it declares: a parameter it does not take, or
one given twice, is a ``422`` naming it. FastAPI drops an unknown parameter and keeps the last
of a repeated one without a word, so a misspelt option (``cof=0.9``, ``stream=door``) ran the
call on the defaults: every image's detections, every stream's events."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import HTTPException, Request

ALWAYS = ("access_token", "_")
"""Taken on every route: the API key (:mod:`server.auth`), and jQuery's cache-buster."""


def declared_query(request: Request) -> tuple[str, ...]:
    """The query parameters the request's route (and its dependencies) declare, by the
    names clients send."""
    names: dict[str, None] = {}

    def walk(dependant: Any) -> None:
        names.update((str(param.alias), None) for param in dependant.query_params)
        for sub in dependant.dependencies:
            walk(sub)

    dependant = getattr(request.scope.get("route"), "dependant", None)
    if dependant is not None:
        walk(dependant)
    return tuple(names)


def query_problem(
    items: Sequence[tuple[str, str]], options: Sequence[str], lists: Sequence[str] = ()
) -> str | None:
    """What is wrong with query ``items`` for a route taking ``options`` (and :data:`ALWAYS`):
    a parameter it does not take, or one given more than once that is not one of ``lists``;
    None where nothing is. The HTTP routes' check and the WebSocket's options share it."""
    names = [name for name, _ in items if name not in ALWAYS]
    unknown = sorted({name for name in names if name not in options})
    if unknown:
        return (
            f"query: {', '.join(map(repr, unknown))}: not an option here; the options are"
            f" {', '.join(options)}"
        )
    twice = sorted({n for n in names if names.count(n) > 1 and n not in lists})
    if twice:
        return f"query: {', '.join(map(repr, twice))} given more than once"
    return None


def check_query(request: Request, *, lists: Sequence[str] = (), extra: Sequence[str] = ()) -> None:
    """HTTP 422 for a query parameter the route does not declare (nor ``extra``: one it reads
    itself), or one given more than once that is not one of ``lists`` (:func:`query_problem`).

    Raises:
        HTTPException: 422 naming the parameters and the route's options.
    """
    options = (*declared_query(request), *extra)
    problem = query_problem(request.query_params.multi_items(), options, lists)
    if problem is not None:
        raise HTTPException(422, problem)


def check_query_and_body_type(request: Request) -> None:
    """A router's dependency: :func:`check_query`, and a ``POST``/``PUT``/``PATCH`` body sent
    as anything but JSON refused with a ``415`` naming its type (curl's ``-d`` sends a form:
    FastAPI took its text as the body and answered a 422 that named no type)."""
    check_query(request)
    headers = request.headers
    sent = headers.get("content-length", "0") != "0" or "transfer-encoding" in headers
    if request.method not in ("POST", "PUT", "PATCH") or not sent:
        return
    media = headers.get("content-type", "").split(";")[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        given = f"Content-Type {media[:64]!r}" if media else "no Content-Type"
        raise HTTPException(
            415,
            f"{given}: send the body as JSON (Content-Type: application/json; curl: --json,"
            " or -H 'Content-Type: application/json')",
        )
