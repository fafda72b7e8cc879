"""``GET /``: the viewer page, and the static files it loads from ``/static``.

The page is plain HTML, CSS and an ES module in ``server/static`` (shipped as package data), so
it needs no build step and no internet: everything it loads comes from this server.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"
"""Where the viewer's files live inside the installed package."""

STATIC_PATH = "/static"

router = APIRouter()

# The page and its script change together on upgrade; revalidating costs one 304 per load.
_NO_CACHE = {"Cache-Control": "no-cache"}


@router.get("/", include_in_schema=False)
async def index() -> FileResponse:
    """Serve the viewer page."""
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html", headers=_NO_CACHE)


def static_files() -> StaticFiles:
    """The app mounts this at :data:`STATIC_PATH` for the page's script and stylesheet.

    Raises:
        RuntimeError: the package was installed without its static files.
    """
    if not (STATIC_DIR / "index.html").is_file():
        raise RuntimeError(
            f"viewer files missing from {STATIC_DIR}; reinstall streamdet with its package data"
            " (pip install -e . from the repository)"
        )
    return StaticFiles(directory=STATIC_DIR)
