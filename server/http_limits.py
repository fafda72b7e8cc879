"""A request's head (its request line and headers) held to :data:`MAX_HEAD_BYTES`.

uvicorn's httptools protocol, the one ``uvicorn[standard]`` runs, takes a head of any size:
it gathers the URL and each header's value piece by piece on the event loop, copying what it
has at each piece, so a client sending one header of 60 MB held ``/healthz`` up to 2 s, and
one of 400 MB took 285 s of the loop and 500 MB of memory before it was answered ``200``.
(Its h11 protocol stops at 16 kB, but parses every request in Python.) Here the bytes of a
head are counted before the parser sees them, and past the limit the client gets ``431`` and
its connection is closed, as nginx's ``large_client_header_buffers`` (4 x 8 kB) and Node's 16 kB
do.

And a head has :data:`HEAD_TIMEOUT_S` (``--head-timeout-s``) to arrive whole: uvicorn has no
such deadline (its ``timeout_keep_alive`` runs only between requests and is cancelled by any
byte, ``limit_concurrency`` only caps how many connections such clients hold), so a client
sending a header byte every few seconds held its connection for ever (a few hundred of them
hold every file descriptor: slowloris). Past it, a head begun is answered ``408`` and its
connection closed; a connection that sent nothing is closed without a word (as nginx's
``client_header_timeout`` does), the client may have opened it ahead of a request.
"""

from __future__ import annotations

import asyncio
import json
import logging

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 64 * 1024
LINE_KEPT = 256
"""Bytes of a head kept to tell its path by (a refusal under ``/v2`` is KServe's form)."""
"""The most bytes a request line and its headers may take: browsers send a few kB (cookies
included), API keys and proxies' ``X-Forwarded-*`` add a few hundred bytes."""


HEAD_TIMEOUT_S = 20.0
"""Seconds a request line and its headers may take to arrive, from the connection's opening
or the request's first byte (nginx's ``client_header_timeout`` is 60 s, Go's servers
commonly set ``ReadHeaderTimeout`` to 5-30 s); a body is the routes' own to time."""


LINGER_S = 2.0
"""How long a refused client's connection stays open after its answer, for it to read it."""


class HeadLimitedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol, refusing a head over :data:`MAX_HEAD_BYTES` with 431
    and one not complete within :attr:`head_timeout_s` with 408."""

    head_timeout_s = HEAD_TIMEOUT_S
    """Set by :func:`head_limited` from ``--head-timeout-s``."""
    _head_pending = False
    _head_bytes = 0
    _line = b""  # the start of the head being read: its request line's path
    _awaiting_head = True  # a head is the next thing the client sends (not a body)
    _tail = b""  # the last bytes of a head's last chunk (its end may span two chunks)
    _refused = False
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()  # the first request's head, from the connection's opening

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        self._head_pending = True
        if self._head_timer is None:  # a request after the first, from its first byte
            self._arm()
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._head_pending = self._awaiting_head = False
        self._disarm()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._awaiting_head, self._head_bytes, self._tail, self._line = True, 0, b"", b""
        super().on_message_complete()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # what it still sends after its 431, read and dropped until the close
        if self._awaiting_head and self._head_too_large(data):
            self._head_pending = self._awaiting_head = False
            self._disarm()
            self._refuse(
                b"431 Request Header Fields Too Large",
                f"request line and headers larger than {MAX_HEAD_BYTES // 1024} kB",
            )
            return  # not parsed: no request runs
        super().data_received(data)

    def _head_too_large(self, data: bytes) -> bool:
        """Counts the head's bytes in ``data`` (up to its blank line, found across chunks),
        before the parser sees them: a head that ended in the chunk it was sent in was not
        counted (one of 200 kB sent in one write was answered 200)."""
        if len(self._line) < LINE_KEPT:
            self._line += data[: LINE_KEPT - len(self._line)]
        end = (self._tail + data).find(b"\r\n\r\n")
        if end < 0:
            self._head_bytes += len(data)
            self._tail = (self._tail + data)[-3:]
        else:
            self._head_bytes += end + 4 - len(self._tail)
            self._tail = b""
        return self._head_bytes > MAX_HEAD_BYTES

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_late)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if self._refused or self.transport.is_closing():
            return
        where = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        if not self._head_pending:  # nothing sent: no request to answer
            log.debug("%s: connection closed, no request within %g s", where, self.head_timeout_s)
            self.transport.close()
            return
        self._head_pending = False
        log.warning(
            "%s: request line and headers not received within %g s; answered 408 (setting"
            " STREAMDET_HEAD_TIMEOUT_S)",
            where,
            self.head_timeout_s,
        )
        self._refuse(
            b"408 Request Timeout",
            f"request line and headers not received within {self.head_timeout_s:g} s"
            " (setting STREAMDET_HEAD_TIMEOUT_S)",
        )

    def _refuse(self, status: bytes, text: str) -> None:
        # As every other 4XX of the API; under /v2 KServe's {"error"}, which tritonclient
        # reads (it failed on "error" missing).
        parts = self._line.split(b" ", 2)
        v2 = len(parts) > 1 and parts[1].split(b"?")[0].startswith(b"/v2/")
        message = json.dumps({"error" if v2 else "detail": text}).encode()
        self.transport.write(
            b"HTTP/1.1 " + status + b"\r\n"
            b"content-type: application/json\r\n"
            b"content-length: " + str(len(message)).encode("ascii") + b"\r\n"
            b"connection: close\r\n\r\n" + message
        )
        # Closed at once with the client's bytes unread, the kernel resets the connection
        # and the client may lose the answer: its bytes are read and dropped a while first.
        self._refused = True
        self.loop.call_later(LINGER_S, self.transport.close)


def head_limited(head_timeout_s: float) -> type[HeadLimitedHttpTools]:
    """The protocol class for uvicorn's ``http``, heads given ``head_timeout_s`` seconds."""
    return type("HeadLimitedHttpTools", (HeadLimitedHttpTools,), {"head_timeout_s": head_timeout_s})
