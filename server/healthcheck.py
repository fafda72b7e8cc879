"""The container's health check (the Dockerfile's ``HEALTHCHECK``): ``/readyz`` of the server
that is the container's first process, at the port and host its own flags give (``--port``,
``--host``), else ``STREAMDET_PORT`` and ``STREAMDET_HOST``: a port given as a flag
(``docker run ... --port 9000``) was polled at 8000, and the container marked unhealthy.

``python3 -m server.healthcheck``: exit 0 when ready, else 1.
"""

from __future__ import annotations

import os
import sys
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

ANY_ADDRESS = {"", "0.0.0.0", "::", "[::]"}


def _flag(argv: Sequence[str], name: str) -> str | None:
    """The last value of ``--name`` in ``argv`` (``--name V`` or ``--name=V``), as argparse
    takes it."""
    found = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            found = argv[i + 1]
        elif arg.startswith(name + "="):
            found = arg.split("=", 1)[1]
    return found


def ready_url(argv: Sequence[str], env: Mapping[str, str]) -> str:
    """Where the server started with ``argv`` (and ``env``) answers ``/readyz``."""
    port = _flag(argv, "--port") or env.get("STREAMDET_PORT") or "8000"
    host = _flag(argv, "--host") or env.get("STREAMDET_HOST") or "127.0.0.1"
    if host in ANY_ADDRESS:
        host = "127.0.0.1"
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 address
    return f"http://{host}:{port}/readyz"


def main(cmdline: Path = Path("/proc/1/cmdline")) -> int:
    """0 when the server the container runs (its command line at ``cmdline``) is ready."""
    try:
        argv = cmdline.read_bytes().decode(errors="replace").split("\0")
    except OSError:
        argv = []
    try:
        url = ready_url(argv, os.environ)  # http:// always
        with urllib.request.urlopen(url, timeout=2) as answer:  # noqa: S310
            return 0 if answer.status == 200 else 1
    except OSError:
        return 1


if __name__ == "__main__":
    sys.exit(main())
