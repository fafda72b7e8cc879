"""Optional API keys: bearer tokens on every REST and WebSocket route except health checks.

Off until keys are configured. ``STREAMDET_API_KEYS`` grants everything;
``STREAMDET_API_KEYS_READONLY`` grants reading, ``POST /detect`` and watching streams, but
not changing them (adding or removing a stream answers 403).

* No token, a malformed header, or an unknown token: **401** with
  ``WWW-Authenticate: Bearer`` (the client has not proven who it is).
* A known read-only token on a route that changes state: **403** (known, not allowed).

The decision is made on the path as the router matches it (``scope["path"]``), and a
read-only key is refused only where the router would run a handler that writes: where no
handler runs (a ``404``, a ``405``, or the ``307`` to the path's other slash form that the
router answers, e.g. ``POST /detect/``) it gets the router's answer, as a full key does (it
got 403 there, saying a full key was needed, where a full key got 404, 405 or the redirect).
A path whose other slash form is open (``/healthz/``, ``/docs/``) is redirected for anyone.

Tokens are compared in constant time: each candidate is hashed to a fixed length and checked
against every configured key with :func:`hmac.compare_digest`, without stopping at the first
match, so timing reveals neither which key matched nor how much of a guess was right.

The check is one function, :func:`authorize`, used by :class:`ApiKeyMiddleware` for HTTP and
WebSocket alike, so any route added later is covered without doing anything. A WebSocket
route that wants to check again, or a server that runs without the middleware, calls::

    from server.auth import websocket_allowed

    @router.websocket("/ws/streams/{stream_id}")
    async def watch(websocket: WebSocket, stream_id: str) -> None:
        if not await websocket_allowed(websocket):   # closes with 1008 when refused
            return
        await websocket.accept()

Browsers cannot set headers on a WebSocket, an ``EventSource`` or an ``<img>``, so there the
token may also come as the ``access_token`` query parameter (RFC 6750 §2.3): WebSockets,
``GET /events``, and a stream's ``mjpeg`` and ``latest.jpg``; other HTTP routes accept only
the header. The access log shows such a token masked (:class:`TokenFilter`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any
from urllib.parse import unquote_plus, urlsplit

from starlette.datastructures import Headers, QueryParams
from starlette.requests import HTTPConnection
from starlette.routing import BaseRoute, Match, Mount, Router
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocket

from server.request_ids import request_id
from server.routes.paths import app_path, is_v2_path
from streams.fanout import close_reason

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/healthz", "/readyz", "/v2/health/live", "/v2/health/ready"})
"""Load balancers and orchestrators probe these without credentials (Kubernetes probes of a
Triton deployment ask KServe's ``/v2/health/*``); they say nothing but up or ready."""
OPEN_PAGES = frozenset({"/", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
OPEN_PREFIXES = ("/static/",)
"""The viewer page and its static files, and the API's schema and its ``/docs`` and
``/redoc`` pages, hold no data; a browser navigating to them cannot send a bearer header
(``/docs`` answered 401, and ``/redoc`` did while ``/docs`` was open). The pages' own API
calls and WebSockets still need a key: ``/docs`` has an Authorize button for it
(:func:`with_bearer_scheme`); ``/redoc`` only reads the open schema."""
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
READONLY_WRITES = frozenset({("POST", "/detect"), ("POST", "/v2/repository/index")})
"""Non-safe calls a read-only key may still make: running detection changes nothing, and
KServe's repository index is a read sent as a POST (``tritonclient``'s
``get_model_repository_index``)."""
WS_POLICY_VIOLATION = 1008


class Access(Enum):
    """What a presented token grants."""

    NONE = "none"
    READONLY = "readonly"
    FULL = "full"


class Routed(Enum):
    """How the router answers a request, as far as keys are concerned."""

    HANDLER = "handler"
    """A route's handler runs for this method and path."""
    REDIRECT = "redirect"
    """No route has the path, its other slash form has one: the router answers ``307``."""
    NONE = "none"
    """No handler runs: the router answers ``404``, or ``405`` (the path has other methods)."""


RouteLookup = Callable[[], tuple[Routed, str]]
"""How the router answers the request being checked, and the path it redirects to (else the
request's own); looked up only where a refusal depends on it."""

EVENTS_PATH = "/events"
PICTURE_ROUTES = frozenset({"mjpeg", "latest.jpg"})


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


class ApiKeys:
    """The configured keys, kept only as SHA-256 digests.

    Args:
        full: tokens with full access.
        readonly: tokens that may read, detect and watch, but not change streams.
    """

    def __init__(self, full: Iterable[str] = (), readonly: Iterable[str] = ()) -> None:
        self._full = [_digest(k) for k in full if k]
        self._readonly = [_digest(k) for k in readonly if k]

    @property
    def counts(self) -> tuple[int, int]:
        """Full and read-only keys configured (the start's log says so)."""
        return len(self._full), len(self._readonly)

    @property
    def enabled(self) -> bool:
        """Whether any key is configured (no keys: everything is open)."""
        return bool(self._full or self._readonly)

    def check(self, token: str) -> Access:
        """The access ``token`` grants, compared in constant time against every key."""
        candidate = _digest(token)
        full = False
        readonly = False
        for key in self._full:
            full |= hmac.compare_digest(candidate, key)
        for key in self._readonly:
            readonly |= hmac.compare_digest(candidate, key)
        if full:
            return Access.FULL
        return Access.READONLY if readonly else Access.NONE


@dataclass(frozen=True, slots=True)
class AuthFailure:
    """Why a request was refused: ``status`` is 401 or 403."""

    status: int
    detail: str
    presented: bool = True  # a key came with the request (an unknown one, or read-only)

    @property
    def headers(self) -> dict[str, str]:
        if self.status != 401:
            return {}
        # RFC 6750 §3.1: a request without credentials gets no error code.
        error = ', error="invalid_token"' if self.presented else ""
        return {"WWW-Authenticate": f'Bearer realm="streamdet"{error}'}


def bearer_token(headers: Headers) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, or ``None``."""
    value = headers.get("authorization")
    if not value:
        return None
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def authorize(
    keys: ApiKeys,
    method: str,
    path: str,
    headers: Headers,
    query: QueryParams | None = None,
    *,
    route: RouteLookup | None = None,
) -> AuthFailure | None:
    """Check one request; ``None`` means allowed.

    Args:
        keys: the configured keys.
        method: HTTP method, or ``"WEBSOCKET"`` for a WebSocket handshake.
        path: the request path, as the router matches it.
        headers: request headers.
        query: query parameters; only consulted for WebSockets, ``GET /events`` and a
            stream's ``mjpeg`` and ``latest.jpg`` (``access_token``), which browsers and
            cameras' integrations open without headers.
        route: how the router answers the request (:func:`route_of`); without it every
            path is taken as served by a handler.
    """
    if not keys.enabled or is_open(method, path):
        return None
    twin = _slash_twin(path)
    if (
        twin is not None
        and route is not None
        and is_open(method, twin)
        and route() == (Routed.REDIRECT, twin)
    ):
        return None  # the router only redirects to an open page (/docs/ to /docs)
    token = bearer_token(headers)
    # HEAD as GET: a checker asks first with the same URL (it was 401 where GET was 200).
    headerless = method == "WEBSOCKET" or (
        method in ("GET", "HEAD") and _opened_without_headers(path)
    )
    if token is None and headerless and query is not None:
        token = query.get("access_token") or None
    if token is None:
        return AuthFailure(
            401,
            "missing API key: send 'Authorization: Bearer <key>' (keys are set with"
            " STREAMDET_API_KEYS)",
            presented=False,
        )
    access = keys.check(token)
    if access is Access.NONE:
        return AuthFailure(401, "unknown API key (keys are set with STREAMDET_API_KEYS)")
    if (
        access is Access.READONLY
        and not _readonly_allowed(method, path)
        and (route is None or route()[0] is Routed.HANDLER)
    ):
        return AuthFailure(
            403,
            f"this API key is read-only; {method} {path} needs a key from STREAMDET_API_KEYS",
        )
    return None


def _slash_twin(path: str) -> str | None:
    """The path the router redirects to where no route has ``path``: without its trailing
    slashes, or with one (none for ``/``)."""
    if path in ("", "/"):
        return None
    return path.rstrip("/") if path.endswith("/") else path + "/"


def route_path(scope: Scope) -> str:
    """The request's path as the router matches it: ``scope["path"]`` less the root path
    (Starlette's own rule), never re-parsed from a URL."""
    return app_path(scope)


def route_of(scope: Scope) -> tuple[Routed, str]:
    """How the app's router answers the request of ``scope``, by its own matching rules
    (first full match, else a partial one's ``405``, else the redirect to the other slash
    form, else ``404``). A scope without a Starlette app is taken as served by a handler."""
    router = getattr(scope.get("app"), "router", None)
    path = route_path(scope)
    if not isinstance(router, Router):
        return Routed.HANDLER, path
    partial = False
    for candidate in router.routes:
        match, _ = candidate.matches(scope)
        if match is Match.FULL and _static_refuses(candidate, scope):
            return Routed.NONE, path  # a mount matches every method; its files answer 405
        if match is Match.FULL:
            return Routed.HANDLER, path
        partial = partial or match is Match.PARTIAL
    twin = _slash_twin(path)
    if not partial and twin is not None and scope["type"] == "http" and router.redirect_slashes:
        redirect = {**scope, "path": _slash_twin(scope["path"]) or scope["path"]}
        if any(c.matches(redirect)[0] is not Match.NONE for c in router.routes):
            return Routed.REDIRECT, twin
    return Routed.NONE, path


def _static_refuses(route: BaseRoute, scope: Scope) -> bool:
    """Whether ``route`` is a mount of static files (the viewer's) and the request a method
    they answer ``405``: nothing is written, so a read-only key gets the ``405`` too."""
    return (
        isinstance(route, Mount)
        and isinstance(route.app, StaticFiles)
        and scope.get("method") not in ("GET", "HEAD")
    )


def _opened_without_headers(path: str) -> bool:
    """Routes that browsers and cameras' integrations open without headers: the event
    stream (``EventSource``) and a stream's pictures (``<img src>``, Home Assistant's MJPEG
    and still-image cameras), which take the key as ``?access_token=``."""
    if path == EVENTS_PATH:
        return True
    parts = path.split("/")
    return len(parts) == 4 and parts[1] == "streams" and parts[3] in PICTURE_ROUTES


def is_open(method: str, path: str) -> bool:
    """Whether ``path`` is served without a key (health checks, the viewer's static page)."""
    if path in OPEN_PATHS:
        return True
    return method in ("GET", "HEAD") and (path in OPEN_PAGES or path.startswith(OPEN_PREFIXES))


def _readonly_allowed(method: str, path: str) -> bool:
    return (
        method in SAFE_METHODS
        or method == "WEBSOCKET"
        or (method, path) in READONLY_WRITES
        or (method == "POST" and path.startswith("/v2/models/") and path.endswith("/infer"))
    )


def check_connection(conn: HTTPConnection, keys: ApiKeys) -> AuthFailure | None:
    """:func:`authorize` for a Starlette ``Request`` or ``WebSocket``."""
    scope = conn.scope
    method = "WEBSOCKET" if scope["type"] == "websocket" else scope["method"]
    return authorize(
        keys,
        method,
        route_path(scope),
        conn.headers,
        conn.query_params,
        route=lambda: route_of(scope),
    )


def sent_path(scope: Scope) -> str:
    """The request's path as the client sent it, for logs (``raw_path``, else ``path``), a
    key in it (``;access_token=``) masked."""
    raw = scope.get("raw_path")
    path = raw.decode("latin-1") if isinstance(raw, bytes) and raw else str(scope["path"])
    return TokenFilter.masked(path)


def get_api_keys(conn: HTTPConnection) -> ApiKeys:
    """The app's keys (set by ``create_app``); no keys when the app has none."""
    keys = getattr(conn.app.state, "api_keys", None)
    return keys if isinstance(keys, ApiKeys) else ApiKeys()


async def websocket_allowed(websocket: WebSocket) -> bool:
    """Check a WebSocket handshake; on refusal close it (1008) and return ``False``.

    Call before ``websocket.accept()``.
    """
    failure = check_connection(websocket, get_api_keys(websocket))
    if failure is None:
        return True
    log.info("websocket %s refused: %s", sent_path(websocket.scope), failure.detail)
    await websocket.close(code=WS_POLICY_VIOLATION, reason=close_reason(failure.detail))
    return False


class TokenFilter(logging.Filter):
    """Masks ``access_token=...`` in uvicorn's request lines (``uvicorn.access``, and
    ``uvicorn.error`` for WebSocket handshakes), where a key given in the query would
    otherwise be written out."""

    # A query's parameters, its name as sent: ``access%5Ftoken=`` is ``access_token`` too
    # (the server decodes the name, and took the key; the log showed it in clear).
    # Any spelling of it too (``ACCESS_TOKEN``, ``access-token``, ``;access_token=``): the
    # server refuses those, but the key in them was logged in clear all the same.
    _PARAM = re.compile(r"([?&;])([^=&?;\s\"']+)=([^&;\s\"']*)")
    _NAME = re.compile(r"\s*access\W?_?token\W*", re.IGNORECASE)

    @classmethod
    def _mask(cls, match: re.Match[str]) -> str:
        lead, name, value = match.groups()
        if value and cls._NAME.fullmatch(unquote_plus(name)):
            return f"{lead}{name}=***"
        return match.group(0)

    @classmethod
    def masked(cls, text: str) -> str:
        """``text`` with the values of its ``access_token`` parameters ``***``."""
        return cls._PARAM.sub(cls._mask, text) if "=" in text else text

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and any(
            isinstance(a, str) and "=" in a for a in record.args
        ):
            record.args = tuple(self.masked(a) if isinstance(a, str) else a for a in record.args)
        return True


SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def _site(url: str) -> tuple[str, int] | None:
    """``url``'s host (lower case) and port (80 or 443 where it names none); None if it has
    neither (an Origin of ``null``, a malformed one)."""
    try:
        parts = urlsplit(url)
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    except ValueError:
        return None
    if not parts.hostname or port is None:
        return None
    return parts.hostname.lower(), port


def cross_site(
    conn: HTTPConnection, origins: Sequence[str], public_url: str | None
) -> AuthFailure | None:
    """Without keys, a WebSocket handshake or a call that changes something sent by a page of
    another site (its ``Origin``): 403. A page anywhere could otherwise watch the cameras and
    post jobs through the operator's browser (a multipart POST needs no CORS preflight).
    Allowed: this server's own pages (``Origin`` naming the ``Host`` it was reached at, or
    ``X-Forwarded-Host``, or ``--public-url``), the origins of ``--cors-origins``, and
    clients that send no ``Origin`` (scripts, curl, Triton's clients)."""
    scope = conn.scope
    if scope["type"] == "http" and scope["method"] in SAFE_METHODS:
        return None
    origin = conn.headers.get("origin")
    if origin is None or "*" in origins or origin in origins:
        return None
    came = _site(origin)
    forwarded = conn.headers.get("x-forwarded-host", "").split(",")[0].strip()
    # A Host without a port is either default one: behind a proxy the scheme seen here may
    # not be the browser's (TLS ended at the proxy).
    own = {
        _site(f"{scheme}://{host}")
        for host in (conn.headers.get("host"), forwarded)
        if host
        for scheme in ("http", "https")
    }
    if public_url is not None:
        own.add(_site(public_url))
    if came is not None and came in own:
        return None
    return AuthFailure(
        403,
        f"a call from the page of another site ({origin[:100]!r}) is refused: without API keys"
        " only this server's own pages may make it; allow that origin with"
        " STREAMDET_CORS_ORIGINS, or set keys (STREAMDET_API_KEYS)",
        presented=False,
    )


class ApiKeyMiddleware:
    """Applies :func:`authorize` to every HTTP request and WebSocket handshake; without keys,
    :func:`cross_site`.

    A refused WebSocket gets a plain HTTP 401/403 when the server supports the ASGI
    ``websocket.http.response`` extension (uvicorn does), otherwise a close with code 1008.
    """

    def __init__(
        self,
        app: ASGIApp,
        keys: ApiKeys,
        origins: Sequence[str] = (),
        public_url: str | None = None,
    ) -> None:
        self.app = app
        self.keys = keys
        self.origins = tuple(origins)
        self.public_url = public_url

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        conn = HTTPConnection(scope)
        if self.keys.enabled:
            failure = check_connection(conn, self.keys)
        else:
            failure = cross_site(conn, self.origins, self.public_url)
        if failure is None:
            await self.app(scope, receive, send)
            return
        rid = request_id(conn.headers.get("x-request-id"))
        log.info(
            "request %s: %s %s refused with %d: %s",
            rid,
            scope.get("method", "WEBSOCKET"),
            sent_path(scope),
            failure.status,
            failure.detail,
        )
        # Under /v2 as KServe's errors are (tritonclient reads "error"), elsewhere FastAPI's.
        key = "error" if is_v2_path(app_path(scope)) else "detail"
        body = json.dumps({key: failure.detail}).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"x-request-id", rid.encode()),  # the one its log line carries
        ]
        headers += [(k.lower().encode(), v.encode()) for k, v in failure.headers.items()]
        if scope["type"] == "http":
            await send(
                {"type": "http.response.start", "status": failure.status, "headers": headers}
            )
            await send({"type": "http.response.body", "body": body})
            return
        await receive()  # the websocket.connect message
        if "websocket.http.response" in scope.get("extensions", {}):
            await send(
                {
                    "type": "websocket.http.response.start",
                    "status": failure.status,
                    "headers": headers,
                }
            )
            await send({"type": "websocket.http.response.body", "body": body})
        else:
            await send(
                {
                    "type": "websocket.close",
                    "code": WS_POLICY_VIOLATION,
                    "reason": close_reason(failure.detail),
                }
            )


def with_bearer_scheme(schema: dict[str, Any]) -> dict[str, Any]:
    """The OpenAPI ``schema`` saying every call takes ``Authorization: Bearer <key>``, so
    ``/docs`` asks for the key once (its Authorize button) and sends it with each try."""
    components = schema.setdefault("components", {})
    components.setdefault("securitySchemes", {})["apiKey"] = {
        "type": "http",
        "scheme": "bearer",
        "description": "a key of STREAMDET_API_KEYS (or STREAMDET_API_KEYS_READONLY)",
    }
    schema["security"] = [{"apiKey": []}]
    return schema
