"""The ``streamdet`` command: a SIGHUP from the process's first moment does not end a server
that is starting.

A reload signal sent just after ``streamdet serve`` was launched (a config-management tool
reloading what it started) killed it: Python's default for SIGHUP ends the process, and the
command's imports (pydantic, numpy: about 0.6 s) came before :func:`server.cli.serve` set its
handler. This module imports nothing heavy: it sets a handler that does nothing, then hands
over to :func:`server.cli.main`, whose ``serve`` logs any later one until the app installs
its reload.
"""

from __future__ import annotations

import signal
import sys
from types import FrameType


def _starting(sig: int, frame: FrameType | None) -> None:
    """SIGHUP before the settings are even read: nothing to reload, nothing to log to yet."""


def main() -> int:
    if sys.argv[1:2] == ["serve"] and hasattr(signal, "SIGHUP"):
        signal.signal(signal.SIGHUP, _starting)
    from server.cli import main as cli_main

    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
