"""The request's path within the app, as its router matches it.

Under an ASGI ``root_path`` (``--root-path``, behind a proxy's path prefix) ``scope["path"]``
starts with the prefix (Starlette's and uvicorn's convention: ``/streamdet/v2/models``);
every decision made on a path (the KServe v2 error form, the key check, the settings bodies'
limit) is made on the path without it, as the router's own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def app_path(scope: Mapping[str, Any]) -> str:
    """``scope["path"]`` less the root path where it starts with it (Starlette's rule)."""
    path: str = scope.get("path", "")
    root: str = scope.get("root_path", "")
    if not root or not path.startswith(root):
        return path
    if path == root:
        return ""
    return path[len(root) :] if path[len(root)] == "/" else path
