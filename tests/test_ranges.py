"""Range requests on served files (job videos and results, event clips): what RFC 9110 asks
of a Range header the server cannot use (ignore it, answer the whole file), the rest as
Starlette serves ranges."""

from __future__ import annotations

import asyncio
import json
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from server.ranges import RangedFile, usable_range


@pytest.mark.parametrize(
    ("value", "usable"),
    [
        ("bytes=0-99", True),
        ("bytes=100-", True),
        ("bytes=-100", True),
        ("bytes=0-0, 5-9", True),
        ("Bytes = 0-1", True),
        ("items=0-1", False),
        ("bytes=abc", False),
        ("bytes=50-10", False),
        ("bytes=", False),
        ("bytes", False),
        ("bytes=0-1,x", False),
        ("bytes=0-" + "9" * 5000, False),  # int() raised: a 500
        ("bytes=" + "9" * 5000 + "-", False),
        ("bytes=-" + "9" * 5000, False),
        ("bytes=0-" + "9" * 18, True),
    ],
)
def test_usable_ranges(value: str, usable: bool) -> None:
    assert usable_range(value) is usable


def _clip_client(tmp_path: Path, data: bytes) -> TestClient:
    """A client of an app serving ``data`` as ``/clip.mp4``."""
    path = tmp_path / "clip.mp4"
    path.write_bytes(data)
    app = FastAPI()

    @app.get("/clip.mp4")
    async def clip() -> RangedFile:
        return RangedFile(path, media_type="video/mp4")

    return TestClient(app)


def test_a_range_the_server_cannot_use_gets_the_whole_file(tmp_path: Path) -> None:
    """``items=0-1``, ``bytes=abc`` and ``bytes=50-10`` answered 400; RFC 9110 asks for the
    whole file. A usable range is still 206, one past the end 416."""
    data = bytes(range(256)) * 4
    with _clip_client(tmp_path, data) as c:
        for ignored in ("items=0-1", "bytes=abc", "bytes=50-10"):
            whole = c.get("/clip.mp4", headers={"Range": ignored})
            assert (whole.status_code, whole.content) == (200, data), ignored
        part = c.get("/clip.mp4", headers={"Range": "bytes=10-19"})
        assert (part.status_code, part.content) == (206, data[10:20])
        assert part.headers["content-range"] == f"bytes 10-19/{len(data)}"
        past = c.get("/clip.mp4", headers={"Range": f"bytes={len(data)}-"})
        assert past.status_code == 416


async def test_a_file_deleted_while_it_is_served_is_served_whole_or_404_before_it_starts(
    tmp_path: Path,
) -> None:
    """A clip pruned (or deleted) while a player downloads it: Starlette read its size, then
    opened it by name, so the download was a 500, or a 200 cut off part way. It is held open
    from the start: deleted once the answer started, it is served whole; deleted before, a
    404 saying so."""
    data = bytes(range(256)) * 1024
    path = tmp_path / "clip.mp4"
    path.write_bytes(data)
    scope = {"type": "http", "method": "GET", "headers": [], "asgi": {"spec_version": "2.3"}}
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(60)  # the client stays connected
        return {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(dict(message))
        if message["type"] == "http.response.start":
            path.unlink(missing_ok=True)  # gone as the answer starts

    response = RangedFile(path, media_type="video/mp4", gone="no clip 7: gone")
    response.chunk_size = 4096  # many chunks
    await response(scope, receive, send)
    assert sent[0]["status"] == 200
    assert b"".join(m.get("body", b"") for m in sent[1:]) == data
    sent.clear()
    late = RangedFile(path, media_type="video/mp4", gone="no clip 7: gone")  # made, then gone
    await late(scope, receive, send)
    assert sent[0]["status"] == 404
    assert json.loads(sent[1]["body"]) == {"detail": "no clip 7: gone"}


def test_a_range_set_is_served_for_what_it_can_and_a_client_s_copy_is_not_sent_again(
    tmp_path: Path,
) -> None:
    """A set with a range past the end was 416 whole (RFC 9110: satisfiable if any range in
    it is); If-None-Match and If-Modified-Since were ignored, the whole clip sent again."""
    data = bytes(range(256)) * 4
    with _clip_client(tmp_path, data) as c:
        part = c.get("/clip.mp4", headers={"Range": "bytes=0-9, 99999999-"})
        assert (part.status_code, part.content) == (206, data[:10])
        assert part.headers["content-range"] == f"bytes 0-9/{len(data)}"
        assert c.get("/clip.mp4", headers={"Range": "bytes=5000-,6000-"}).status_code == 416
        whole = c.get("/clip.mp4")
        etag, modified = whole.headers["etag"], whole.headers["last-modified"]
        for asked in (
            {"If-None-Match": etag},
            {"If-None-Match": f'"x", W/{etag}'},
            {"If-None-Match": "*"},
            {"If-Modified-Since": modified},
        ):
            same = c.get("/clip.mp4", headers=asked)
            assert (same.status_code, same.content) == (304, b""), asked
            assert same.headers["etag"] == etag
        for asked in (
            {"If-None-Match": '"other"'},
            {"If-Modified-Since": "Mon, 01 Jan 2001 00:00:00 GMT"},
            {"If-Modified-Since": "yesterday"},
        ):
            again = c.get("/clip.mp4", headers=asked)
            assert (again.status_code, again.content) == (200, data), asked
