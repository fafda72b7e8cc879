"""Files served with range requests as RFC 9110 asks of a Range header the server cannot use.

Starlette's ``FileResponse`` answers ``400`` to a range in another unit (``items=0-1``) or
one that does not parse (``bytes=abc``, ``bytes=50-10``); RFC 9110 (14.2) says a server
ignores such a header and answers the whole file, ``200``, which is what players and download
tools expect. :class:`RangedFile` drops such a header before Starlette reads it; a range that
parses but lies past the end is still ``416``.
"""

from __future__ import annotations

import re

from starlette.responses import FileResponse
from starlette.types import Receive, Scope, Send

# Positions of at most 18 digits (an exabyte): one of thousands of digits made ``int`` raise
# (Python's 4300-digit limit), a 500; such a header is unusable, so ignored.
_SPEC = re.compile(r"\s*(?:(\d{1,18})-(\d{0,18})|-(\d{1,18}))\s*")


def usable_range(value: str) -> bool:
    """Whether a ``Range`` header's value is a byte range this server can use."""
    unit, eq, spec = value.partition("=")
    if not eq or unit.strip().lower() != "bytes" or not spec.strip():
        return False
    for part in spec.split(","):
        match = _SPEC.fullmatch(part)
        if match is None:
            return False
        first, last = match.group(1), match.group(2)
        if first is not None and last and int(last) < int(first):
            return False
    return True


class RangedFile(FileResponse):
    """A :class:`FileResponse` that ignores a ``Range`` header it cannot use (see module)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = scope.get("headers") or []
        if any(k == b"range" and not usable_range(v.decode("latin-1")) for k, v in headers):
            scope = {**scope, "headers": [(k, v) for k, v in headers if k != b"range"]}
        await super().__call__(scope, receive, send)
