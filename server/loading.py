"""The server's port while the model loads: bound at once, and answering the probes.

Loading a model takes seconds (ONNX Runtime on the CPU), a first export a minute, a TensorRT
build minutes. The port was bound only after that, so ``/healthz`` and ``/readyz`` refused
connections for as long: a Kubernetes liveness probe without a startup probe killed the pod
mid-load, Prometheus' ``up`` was 0 (``StreamdetDown``, critical, on every cold start) and
``StreamdetNotReady`` could never fire. Now the socket is bound before the model loads (a
port taken fails at once, exit 2) and, until uvicorn takes it over, a small server on a
thread answers as the app will once it runs: ``/healthz`` 200 (alive), ``/readyz`` 503
(``Retry-After``), ``/metrics`` ``streamdet_ready 0`` (a key needed where keys are set), and
every other request 503 naming why. Connections waiting when the model is ready are taken
by uvicorn, on the same socket.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from server.auth import Access, ApiKeys, AuthFailure

log = logging.getLogger(__name__)

BACKLOG = 2048
"""uvicorn's own (``--backlog``): connections waiting to be accepted."""
RETRY_S = 5
DRAINED_BYTES = 64 * 1024 * 1024
LOADING = "the model is loading: GET /readyz answers 200 once it is ready"


def bind_listener(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``, bound as uvicorn binds (``SO_REUSEADDR``: a port
    left in TIME_WAIT is free; IPv6 where the host has a colon).

    Raises:
        OSError: it cannot be bound (another server holds the port, a host this machine
            lacks).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    keys = ApiKeys()


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.0"  # one request a connection: none is left open at handover
    timeout = 10.0  # a client that sends nothing holds a thread no longer

    def log_message(self, format: str, *args: object) -> None:
        log.debug("while loading: " + format, *args)

    def _drain(self) -> None:
        """Read the request's body (up to :data:`DRAINED_BYTES`) before answering: a socket
        closed with a body unread is reset, and the client sees no answer, not the 503."""
        try:
            left = min(int(self.headers.get("Content-Length") or 0), DRAINED_BYTES)
            while left > 0 and (chunk := self.rfile.read(min(left, 65536))):
                left -= len(chunk)
        except (ValueError, OSError):
            pass

    def _answer(
        self,
        status: int,
        body: bytes,
        media_type: str,
        retry: bool = False,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self._drain()
        self.send_response(status)
        self.send_header("Content-Type", media_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        if retry:
            self.send_header("Retry-After", str(RETRY_S))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, body: dict[str, str], retry: bool = False) -> None:
        self._answer(status, json.dumps(body).encode(), "application/json", retry)

    def _refused(self) -> AuthFailure | None:
        """Why the request may not read ``/metrics``, or None: any key may, where keys are set,
        sent as the app takes it there (a bearer token; not ``access_token``, which it
        refuses)."""
        keys = self.server.keys
        if not keys.enabled:
            return None
        scheme, _, token = (self.headers.get("Authorization") or "").partition(" ")
        if scheme.lower() == "bearer" and keys.check(token.strip()) is not Access.NONE:
            return None
        return AuthFailure(401, "missing or unknown API key", presented=bool(token.strip()))

    def do_GET(self) -> None:
        # Paths as the app takes them: a proxy strips --root-path (the app answers 404
        # under it), so nor are they answered under it here.
        path = urlsplit(self.path).path
        if path == "/healthz":
            self._json(200, {"status": "ok", "model": "loading"})
        elif path == "/v2/health/live":  # KServe's liveness: as the app, an empty 200
            self._answer(200, b"", "text/plain")
        elif path == "/readyz":
            self._json(503, {"status": "not ready", "detail": LOADING}, retry=True)
        elif path == "/metrics" and self.command in ("GET", "HEAD"):
            if (refused := self._refused()) is not None:  # WWW-Authenticate as the app's
                body = json.dumps({"detail": refused.detail}).encode()
                self._answer(401, body, "application/json", headers=refused.headers)
                return
            text = (
                "# HELP streamdet_ready 1 once the model is loaded and warmed, else 0\n"
                "# TYPE streamdet_ready gauge\nstreamdet_ready 0.0\n"
            )
            self._answer(200, text.encode(), "text/plain; version=0.0.4; charset=utf-8")
        elif path.startswith("/v2/"):  # KServe's errors are {"error"}: tritonclient reads it
            self._json(503, {"error": LOADING}, retry=True)
        else:
            self._json(503, {"detail": LOADING}, retry=True)

    do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = do_OPTIONS = do_GET  # noqa: N815


class LoadingResponder:
    """Answers on ``sock`` (see module) until :meth:`stop`, which leaves the socket open.

    Args:
        sock: the listening socket uvicorn serves on once the model is ready.
        keys: the API keys: ``/metrics`` needs one where any is set.
    """

    def __init__(self, sock: socket.socket, keys: ApiKeys | None = None):
        server = _Server(sock.getsockname()[:2], _Handler, bind_and_activate=False)
        server.socket.close()  # its own, unbound: the listening one serves instead
        server.socket = sock
        server.keys = keys or ApiKeys()
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.1}, name="loading-http"
        )
        self._thread.daemon = True

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop answering (the request being answered ends first); the socket stays open."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(5)
