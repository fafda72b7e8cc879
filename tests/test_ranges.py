"""Range requests on served files (job videos and results, event clips): what RFC 9110 asks
of a Range header the server cannot use (ignore it, answer the whole file), the rest as
Starlette serves ranges."""

from __future__ import annotations

from pathlib import Path

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


def test_a_range_the_server_cannot_use_gets_the_whole_file(tmp_path: Path) -> None:
    """``items=0-1``, ``bytes=abc`` and ``bytes=50-10`` answered 400; RFC 9110 asks for the
    whole file. A usable range is still 206, one past the end 416."""
    data = bytes(range(256)) * 4
    path = tmp_path / "clip.mp4"
    path.write_bytes(data)
    app = FastAPI()

    @app.get("/clip.mp4")
    async def clip() -> RangedFile:
        return RangedFile(path, media_type="video/mp4")

    with TestClient(app) as c:
        for ignored in ("items=0-1", "bytes=abc", "bytes=50-10"):
            whole = c.get("/clip.mp4", headers={"Range": ignored})
            assert (whole.status_code, whole.content) == (200, data), ignored
        part = c.get("/clip.mp4", headers={"Range": "bytes=10-19"})
        assert (part.status_code, part.content) == (206, data[10:20])
        assert part.headers["content-range"] == f"bytes 10-19/{len(data)}"
        past = c.get("/clip.mp4", headers={"Range": f"bytes={len(data)}-"})
        assert past.status_code == 416
