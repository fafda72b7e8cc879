"""Files served with range requests as RFC 9110 asks of a Range header the server cannot use.

Starlette's ``FileResponse`` answers ``400`` to a range in another unit (``items=0-1``) or
one that does not parse (``bytes=abc``, ``bytes=50-10``); RFC 9110 (14.2) says a server
ignores such a header and answers the whole file, ``200``, which is what players and download
tools expect. :class:`RangedFile` drops such a header before Starlette reads it; a range that
parses but lies past the end is still ``416``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from starlette.responses import FileResponse, JSONResponse
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


_OPEN_FILES = Path("/proc/self/fd")
"""Where Linux names this process's open files: each opens again as the file it was opened
as, deleted since or not."""
_BY_FD = _OPEN_FILES.is_dir()


class RangedFile(FileResponse):
    """A :class:`FileResponse` that ignores a ``Range`` header it cannot use (see module), and
    holds its file open from the start: one deleted meanwhile (a clip pruned, retention, a
    ``DELETE``) is a ``404`` saying ``gone`` before the answer starts, and served whole once it
    has started. Starlette read its size, then opened it by name later: a 500, or a 200 cut off
    part way with its Content-Length unmet."""

    def __init__(self, path: str | Path, *, gone: str = "deleted meanwhile", **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self._gone = gone

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = scope.get("headers") or []
        if any(k == b"range" and not usable_range(v.decode("latin-1")) for k, v in headers):
            scope = {**scope, "headers": [(k, v) for k, v in headers if k != b"range"]}
        if not _BY_FD:  # not Linux: by name, as Starlette does
            await super().__call__(scope, receive, send)
            return
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            await JSONResponse({"detail": self._gone}, 404)(scope, receive, send)
            return
        try:
            self.stat_result = os.fstat(fd)
            self.set_stat_headers(self.stat_result)
            self.path = _OPEN_FILES / str(fd)
            await super().__call__(scope, receive, send)
        finally:
            os.close(fd)
