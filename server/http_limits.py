"""A request's head (its request line and headers) held to :data:`MAX_HEAD_BYTES`.

uvicorn's httptools protocol, the one ``uvicorn[standard]`` runs, takes a head of any size:
it gathers the URL and each header's value piece by piece on the event loop, copying what it
has at each piece, so a client sending one header of 60 MB held ``/healthz`` up to 2 s, and
one of 400 MB took 285 s of the loop and 500 MB of memory before it was answered ``200``.
(Its h11 protocol stops at 16 kB, but parses every request in Python.) Here the bytes of a
head not yet complete are counted, and past the limit the client gets ``431`` and its
connection is closed, as nginx's ``large_client_header_buffers`` (4 x 8 kB) and Node's 16 kB
do.
"""

from __future__ import annotations

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

MAX_HEAD_BYTES = 64 * 1024
"""The most bytes a request line and its headers may take: browsers send a few kB (cookies
included), API keys and proxies' ``X-Forwarded-*`` add a few hundred bytes."""


LINGER_S = 2.0
"""How long a refused client's connection stays open after its answer, for it to read it."""


class HeadLimitedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol, refusing a head over :data:`MAX_HEAD_BYTES` with 431."""

    _head_pending = False
    _head_bytes = 0
    _refused = False

    def on_message_begin(self) -> None:
        self._head_pending = True
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._head_pending = False
        self._head_bytes = 0
        super().on_headers_complete()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # what it still sends after its 431, read and dropped until the close
        super().data_received(data)
        if not self._head_pending or self.transport.is_closing():
            return
        # Bytes after a head that completes in this chunk are not counted; a chunk that
        # leaves a head incomplete is head (a pipelined request's body end at most before it).
        self._head_bytes += len(data)
        if self._head_bytes > MAX_HEAD_BYTES:
            self._head_pending = False
            self._refuse()

    def _refuse(self) -> None:
        message = f"request line and headers larger than {MAX_HEAD_BYTES // 1024} kB".encode()
        self.transport.write(
            b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
            b"content-type: text/plain; charset=utf-8\r\n"
            b"content-length: " + str(len(message)).encode("ascii") + b"\r\n"
            b"connection: close\r\n\r\n" + message
        )
        # Closed at once with the client's bytes unread, the kernel resets the connection
        # and the client may lose the answer: its bytes are read and dropped a while first.
        self._refused = True
        self.loop.call_later(LINGER_S, self.transport.close)
