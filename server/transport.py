"""Dropping a client that stopped reading: aborting the connection under an ASGI ``send``.

A WebSocket viewer or an MJPEG client whose socket buffers are full makes every send wait
for ever; closing it waits for its unsent bytes to go out, for ever too, and the server's
shutdown with it. ASGI has no message that aborts a connection, so the transport is found on
uvicorn's protocol object and aborted (``server/routes/ws.py``, ``server/routes/viewer.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from typing import Protocol, cast

CLOSE_GRACE_S = 1.0
"""How long a client's last message (its stream removed, the server going away) may take to
go out before it counts as stalled; under the 2 s the CLI's shutdown gives viewers."""
MAX_WRAPPERS = 64
"""Callables looked through for the transport under a ``send``."""


MAX_UNSENT_BYTES = 16 * 1024
"""About what a viewer's connection may hold not yet sent, in the system's socket buffer
(``TCP_NOTSENT_LOWAT``) and again in the event loop's, before its sends wait (the message
being written goes in whole): bytes sent and not yet acknowledged do not count, so a fast
link far away is not slowed."""


class Transport(Protocol):
    """What of an asyncio or uvloop transport dropping a viewer takes."""

    def abort(self) -> None: ...
    def get_write_buffer_size(self) -> int: ...
    def get_extra_info(self, name: str, default: object = None) -> object: ...
    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None: ...


def hold_little_unsent(send: object) -> None:
    """Let the connection under the ASGI ``send`` hold at most :data:`MAX_UNSENT_BYTES` not yet
    sent (Linux's ``TCP_NOTSENT_LOWAT``; elsewhere nothing changes), so a viewer that stops
    reading makes the server's sends wait, and its queue drop old messages, within that. The
    system's socket buffer grows to a few MB: a viewer that stopped reading for 30 s (5 fps
    of JSON) got 331 messages when it read again, 281 over 2 s old, the oldest 30 s, none
    counted dropped."""
    transport = transport_of(send)
    if transport is None:
        return
    with contextlib.suppress(AttributeError, ValueError):  # no such limits on this transport
        transport.set_write_buffer_limits(high=MAX_UNSENT_BYTES)  # the loop's: 64 KiB
    sock = transport.get_extra_info("socket")
    option = getattr(socket, "TCP_NOTSENT_LOWAT", None)
    if sock is None or option is None:
        return
    with contextlib.suppress(OSError, AttributeError):  # not TCP (a Unix socket), or closed
        sock.setsockopt(socket.IPPROTO_TCP, option, MAX_UNSENT_BYTES)  # type: ignore[attr-defined]


def abort_later(send: object, delay_s: float) -> None:
    """Abort the connection under the ASGI ``send`` callable now (``delay_s`` 0), or in
    ``delay_s`` if it still holds unsent bytes then: closing a socket whose peer stopped
    reading waits for ever for those bytes to go out (a close frame that fitted in the buffer
    of a viewer that stalled then)."""
    transport = transport_of(send)
    if transport is None:
        return
    if delay_s <= 0:
        _reset(transport)
    elif transport.get_write_buffer_size():
        asyncio.get_running_loop().call_later(delay_s, _abort_if_unsent, transport)


def _abort_if_unsent(transport: Transport) -> None:
    if transport.get_write_buffer_size():
        _reset(transport)


def _reset(transport: Transport) -> None:
    """Abort, with a reset (``SO_LINGER`` 0): a plain close left the kernel trying to send a
    stalled viewer the bytes in its socket for minutes (FIN-WAIT-1), the viewer none the
    wiser, its connection still open to it."""
    sock = transport.get_extra_info("socket")
    if isinstance(sock, socket.socket) or hasattr(sock, "setsockopt"):
        sock = cast(socket.socket, sock)  # asyncio's TransportSocket wraps one
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def transport_of(send: object) -> Transport | None:
    """The server's transport under the ASGI ``send`` callable: ASGI has no message that
    aborts a connection, so it is found on uvicorn's protocol, the owner of the ``send``
    callable at the bottom of the middlewares' wrappers (closures); None where there is
    none."""
    todo: list[object] = [send]
    seen: set[int] = set()
    while todo and len(seen) < MAX_WRAPPERS:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        owner = getattr(obj, "__self__", None)
        transport = getattr(owner, "transport", None)
        if callable(getattr(transport, "abort", None)) and callable(
            getattr(transport, "get_write_buffer_size", None)
        ):  # duck-typed: uvloop's transports are no asyncio.WriteTransport
            return cast(Transport, transport)
        for cell in getattr(obj, "__closure__", None) or ():
            with contextlib.suppress(ValueError):  # an empty cell
                if callable(cell.cell_contents):
                    todo.append(cell.cell_contents)
        if owner is not None:  # a middleware's responder object keeping the send it wraps
            todo.extend(v for v in getattr(owner, "__dict__", {}).values() if callable(v))
    return None
