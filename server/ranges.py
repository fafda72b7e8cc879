"""Files served with range requests as RFC 9110 asks of a Range header the server cannot use.

Starlette's ``FileResponse`` answers ``400`` to a range in another unit (``items=0-1``) or
one that does not parse (``bytes=abc``, ``bytes=50-10``); RFC 9110 (14.2) says a server
ignores such a header and answers the whole file, ``200``, which is what players and download
tools expect. :class:`RangedFile` drops such a header before Starlette reads it; a range that
parses but lies past the end is still ``416`` (in a set with one that does not, it is left
out: the rest are served). A GET whose ``If-None-Match`` or ``If-Modified-Since`` says the
client has the file is ``304``.
"""

from __future__ import annotations

import os
import re
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.types import Receive, Scope, Send

# Positions of at most 18 digits (an exabyte): one of thousands of digits made ``int`` raise
# (Python's 4300-digit limit), a 500; such a header is unusable, so ignored.
_SPEC = re.compile(r"\s*(?:(\d{1,18})-(\d{0,18})|-(\d{1,18}))\s*")


def satisfiable_part(value: str, size: int) -> str:
    """A usable ``Range`` header's value less its ranges past the end of a file of ``size``
    bytes, where one at least is left (RFC 9110 14.1.1: a set is satisfiable if any range
    in it is; Starlette answered ``416`` to ``bytes=0-9,99999999-``); else as it was."""
    unit, _, spec = value.partition("=")
    kept = []
    for part in spec.split(","):
        match = _SPEC.fullmatch(part)
        if match is None:
            return value
        first, suffix = match.group(1), match.group(3)
        if (first is not None and int(first) < size) or (suffix is not None and int(suffix) > 0):
            kept.append(part.strip())
    return f"{unit}={','.join(kept)}" if kept else value


def not_modified(request: Headers, etag: str | None, last_modified: str | None) -> bool:
    """Whether a GET's validators say the client has this very file (RFC 9110 13.1.2):
    ``If-None-Match`` naming its ETag (weakly compared) or ``*``; without one,
    ``If-Modified-Since`` at or after its ``Last-Modified``. A player or browser fetched the
    whole clip again each time."""
    if (tags := request.get("if-none-match")) is not None:
        if etag is None:
            return False
        wanted = {tag.strip().removeprefix("W/") for tag in tags.split(",")}
        return "*" in wanted or etag.removeprefix("W/") in wanted
    since = request.get("if-modified-since")
    if since is None or last_modified is None:
        return False
    try:
        return parsedate_to_datetime(last_modified) <= parsedate_to_datetime(since)
    except (TypeError, ValueError):  # a date that does not parse is ignored
        return False


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
            asked = Headers(scope=scope)
            if not_modified(asked, self.headers.get("etag"), self.headers.get("last-modified")):
                kept = ("etag", "last-modified", "cache-control")
                same = {k: v for k, v in self.headers.items() if k in kept}
                await Response(status_code=304, headers=same)(scope, receive, send)
                return
            if (wanted := asked.get("range")) is not None:
                satisfiable = satisfiable_part(wanted, self.stat_result.st_size)
                if satisfiable != wanted:
                    headers = [(k, v) for k, v in scope["headers"] if k != b"range"]
                    headers.append((b"range", satisfiable.encode("latin-1")))
                    scope = {**scope, "headers": headers}
            self.path = _OPEN_FILES / str(fd)
            await super().__call__(scope, receive, send)
        finally:
            os.close(fd)
