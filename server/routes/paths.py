"""The request's path within the app, as its router matches it.

Under an ASGI ``root_path`` (``--root-path``, behind a proxy's path prefix) ``scope["path"]``
starts with the prefix (Starlette's and uvicorn's convention: ``/streamdet/v2/models``);
every decision made on a path (the KServe v2 error form, the key check, the settings bodies'
limit) is made on the path without it, as the router's own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

V2_PREFIX = "/v2"


def is_v2_path(path: str) -> bool:
    """Whether ``path`` (within the app) is the KServe v2 protocol's (``/v2`` and below),
    whose errors answer ``{"error": ...}``: the app's handlers, the key check's refusals, the
    settings bodies' limit and the document alike."""
    return path == V2_PREFIX or path.startswith(V2_PREFIX + "/")


def app_path(scope: Mapping[str, Any]) -> str:
    """``scope["path"]`` less the root path where it starts with it (Starlette's rule)."""
    path: str = scope.get("path", "")
    root: str = scope.get("root_path", "")
    if not root or not path.startswith(root):
        return path
    if path == root:
        return ""
    return path[len(root) :] if path[len(root)] == "/" else path


EVENT_PATHS = ("snapshot", "thumbnail", "clip")
"""An event's members that are paths of this app (``/events/{id}/snapshot.jpg``, ...)."""


def root_of(scope: Mapping[str, Any]) -> str:
    """The request's root path (``--root-path``, the proxy's prefix), without a final ``/``:
    what every path the API hands out starts with."""
    root: str = scope.get("root_path", "")
    return root.rstrip("/")


def served_event(event: dict[str, Any], root: str) -> dict[str, Any]:
    """``event`` as the API hands it out, its paths (``snapshot``, ``thumbnail``, ``clip``)
    under ``root``. The log keeps them app-relative, so the events logged before a restart,
    or under another prefix, are served with the prefix the server has now."""
    if not root or not any(isinstance(event.get(key), str) for key in EVENT_PATHS):
        return event
    paths = {key: root + event[key] for key in EVENT_PATHS if isinstance(event.get(key), str)}
    return {**event, **paths}


def link_base(root_path: str, public_url: str | None = None) -> str:
    """What the paths the server pushes out (webhooks, MQTT, job callbacks: no request in
    scope) start with: the public URL (``--public-url``, its path holding the proxy's prefix
    already) where one is set, so a receiver gets URLs it can fetch; else the root path."""
    return public_url if public_url else root_path
