"""The OpenAPI document says what the routes answer besides their success.

FastAPI documents a route's success and, where it has parameters, a ``422`` whose ``detail``
is a list. The routes also answer ``422`` with a message naming the field (``"roi: 0 points;
a polygon needs 3 to 64"``), ``404`` for an unknown id, ``400``/``409``/``413``/``415``/``429``
with a message, ``503``/``507``, and under ``/v2`` every error as ``{"error": ...}``;
``GET /streams?format=yaml``, the CSV and NDJSON answers and ``/v2/health/*``'s empty 200
were not in the document either, and with API keys on, the health probes were said to need
one. A client generated from it (or a schema fuzzer checking the
answers against it) took each as a broken server.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

from server.auth import is_open
from server.routes.paths import is_v2_path

ERROR = {
    "title": "Error",
    "type": "object",
    "required": ["detail"],
    "properties": {
        "detail": {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"$ref": "#/components/schemas/ValidationError"}},
            ],
            "description": "what is wrong, and the setting to change (a 422: a message naming"
            " the field, or a list)",
        }
    },
}
V2_ERROR = {
    "title": "V2Error",
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "string", "description": "what is wrong"}},
    "description": "KServe v2's error answer (tritonclient reads ``error``)",
}
CLIENT_ERRORS = (
    "refused: 400 unreadable input, 401/403 API key, 404 unknown id, 405 method not allowed"
    " (Allow), 409 conflict, 413 too large, 415 wrong media type, 429 overloaded (Retry-After),"
    " 499 the client closed the connection; the message names the problem"
)
SERVER_ERRORS = (
    "503 not ready or not in time (Retry-After), 504 the client's deadline is shorter than the"
    " call takes alone on an idle server (no Retry-After: raise the deadline), 507 the data"
    " directory cannot be written (setting STREAMDET_DATA_DIR)"
)
# Answers of other media types than FastAPI documents, by (method, path): format=yaml,
# format=csv, NDJSON, server-sent events.
EXTRA_CONTENT: dict[tuple[str, str], tuple[str, ...]] = {
    ("get", "/streams"): ("application/yaml",),
    ("get", "/events"): ("text/event-stream",),
    ("get", "/events/counts"): ("text/csv",),
    ("get", "/jobs/{job_id}/counts"): ("text/csv",),
    ("get", "/jobs/{job_id}/frames"): ("application/x-ndjson", "text/csv"),
    ("get", "/jobs/{job_id}/events"): ("application/x-ndjson", "text/csv"),
}
# Answers with no body: KServe's health (200 or 503, as its protocol says).
NO_BODY = frozenset({("get", "/v2/health/live"), ("get", "/v2/health/ready")})


def _ref(name: str) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}


def document_errors(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` (FastAPI's document, changed in place; twice changes nothing more) with
    every operation's error answers, ``422``'s message form and the other media types."""
    schemas = schema.setdefault("components", {}).setdefault("schemas", {})
    schemas["Error"], schemas["V2Error"] = ERROR, V2_ERROR
    validation = schemas.get("HTTPValidationError")
    if validation is not None:
        listed = {"items": {"$ref": "#/components/schemas/ValidationError"}, "type": "array"}
        validation["properties"]["detail"] = {
            "title": "Detail",
            "anyOf": [{"type": "string"}, listed],
            "description": "the field and what is wrong with it: a message, or a list",
        }
    for path, operations in schema.get("paths", {}).items():
        v2 = is_v2_path(path)
        error = "V2Error" if v2 else "Error"
        for method, operation in operations.items():
            if is_open(method.upper(), path):  # health probes: no key, whatever is set
                operation["security"] = []
            responses = operation.setdefault("responses", {})
            if v2 and "422" in responses:
                responses["422"]["content"] = _ref("V2Error")
            responses.setdefault("4XX", {"description": CLIENT_ERRORS, "content": _ref(error)})
            responses.setdefault("5XX", {"description": SERVER_ERRORS, "content": _ref(error)})
            success = next((code for code in responses if code.startswith("2")), None)
            if success is None:
                continue
            if (method, path) in NO_BODY:
                responses[success].pop("content", None)
                continue
            content = responses[success].setdefault("content", {})
            for media_type in EXTRA_CONTENT.get((method, path), ()):
                content.setdefault(media_type, {})
    return schema


def install(app: FastAPI) -> None:
    """``app``'s ``/openapi.json`` documents its error answers (:func:`document_errors`)."""
    schema_of: Callable[[], dict[str, Any]] = app.openapi
    app.openapi = lambda: document_errors(schema_of())  # type: ignore[method-assign]
