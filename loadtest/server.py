"""A real ``streamdet serve`` process for load tests, benchmarks and end-to-end tests.

Readiness is an event, not a poll: uvicorn logs ``Uvicorn running on`` once the lifespan
(model load and warm-up) has finished and the port is bound, and a reader thread sets an
event when it sees that line. The same thread copies the server's log to a file.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import IO

log = logging.getLogger(__name__)

# Logged after the lifespan startup *and* the bind ("Application startup complete" comes
# before the bind, so a client could still be refused).
READY_LINE = "Uvicorn running on"
REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class ServerError(RuntimeError):
    """The server exited or did not become ready; the message holds its last log lines."""


class ServerProcess:
    """Start ``python -m server.cli serve`` on a free port and stop it on exit.

    ``start`` may be called again after ``stop``: the server comes back on the same port and
    its log is appended to the same file.

    Args:
        settings: ``streamdet serve`` settings as ``{name: value}`` (e.g. ``{"max_batch": 2}``);
            passed as ``STREAMDET_*`` environment variables (a None value is left out).
        log_path: where the server's output goes; a temporary name beside the cwd if omitted.
        ready_timeout_s: how long model export, load and warm-up may take.
        args: extra ``streamdet serve`` flags (they override ``settings``); the log level must
            stay ``info`` or lower, since readiness is read from the log.
        cwd: the server's working directory (relative paths in ``settings`` start there).

    Where neither ``settings`` nor ``args`` name a ``data_dir``, the server keeps its streams,
    events and jobs in a temporary folder of its own (the same across restarts, removed
    with this object), never the user's: a benchmark would open their cameras, and what a
    test added would still be there for the next run.
    """

    def __init__(
        self,
        settings: dict[str, object],
        log_path: Path | None = None,
        ready_timeout_s: float = 300.0,
        args: Sequence[str] = (),
        cwd: Path = REPO,
    ) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.ws_url = f"ws://127.0.0.1:{self.port}"
        self.log_path = log_path or Path(f"streamdet-server-{self.port}.log")
        self._settings = settings
        self._args = list(args)
        self._cwd = cwd
        self._timeout = ready_timeout_s
        self._ready = threading.Event()
        self._saw_ready = False
        self._signalled = False
        self._tail: list[str] = []
        self._proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None
        self._data: str | None = None
        if "data_dir" not in settings and all(a.split("=")[0] != "--data-dir" for a in args):
            self._data = tempfile.mkdtemp(prefix="streamdet-data-")
            weakref.finalize(self, shutil.rmtree, self._data, ignore_errors=True)

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise ServerError("server not started")
        return self._proc.pid

    def start(self) -> None:
        """Start the process and block until it is ready.

        Raises:
            ServerError: the server exited first, or was not ready within the timeout.
        """
        restart = self._proc is not None
        self._ready.clear()
        self._saw_ready = False
        self._signalled = False
        self._tail = []
        env = dict(os.environ)
        # None is "not set": str(None) gave e.g. STREAMDET_MQTT_URL=None, a broker named None.
        env.update(
            {
                f"STREAMDET_{k.upper()}": _env_value(v)
                for k, v in self._settings.items()
                if v is not None
            }
        )
        env.update({"STREAMDET_HOST": "127.0.0.1", "STREAMDET_PORT": str(self.port)})
        if self._data is not None:
            env["STREAMDET_DATA_DIR"] = self._data
        env.setdefault("STREAMDET_LOG_LEVEL", "info")  # the ready line is an info log
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "server.cli", "serve", *self._args],
            cwd=self._cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )
        stdout = self._proc.stdout
        if stdout is None:
            raise ServerError("server started without an output pipe")
        mode = "a" if restart else "w"  # a restart keeps the earlier run's log
        self._reader = threading.Thread(
            target=self._read, args=(stdout, mode), name="server-log", daemon=True
        )
        self._reader.start()
        self._ready.wait(self._timeout)
        if not self._saw_ready:
            code = self._proc.poll()
            self.stop()
            tail = "".join(self._tail[-20:])
            state = (
                f"exited with {code}" if code is not None else f"not ready in {self._timeout:.0f} s"
            )
            raise ServerError(f"streamdet serve {state}; last log lines:\n{tail}")
        log.info("server %s ready (pid %d, log %s)", self.base_url, self._proc.pid, self.log_path)

    def _read(self, stdout: IO[str], mode: str) -> None:
        with stdout, self.log_path.open(mode, buffering=1) as out:  # lines: log_text() sees them
            for line in stdout:
                out.write(line)
                self._tail = [*self._tail[-49:], line]
                if READY_LINE in line:
                    out.flush()
                    self._saw_ready = True
                    self._ready.set()
        self._ready.set()  # the process closed its output: wake start(), which checks why

    def signal_stop(self) -> None:
        """SIGTERM once, without waiting: uvicorn starts its graceful shutdown (a second
        SIGTERM would make it quit at once, skipping the shutdown)."""
        proc = self._proc
        if proc is not None and proc.poll() is None and not self._signalled:
            self._signalled = True
            proc.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM, wait up to ``timeout_s`` for a graceful exit, then SIGKILL.

        Returns:
            The exit code: 0 or ``-SIGTERM`` after a graceful shutdown (uvicorn re-raises the
            signal it caught), ``-SIGKILL`` if it had to be killed; None if never started.
        """
        proc = self._proc
        if proc is None:
            return None
        self.signal_stop()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("server pid %d ignored SIGTERM for %.0f s; killing", proc.pid, timeout_s)
            proc.kill()
            proc.wait()
        if self._reader is not None:
            self._reader.join(5)
        return proc.returncode

    def log_text(self) -> str:
        """The server's log so far (all of it once :meth:`stop` has returned)."""
        return self.log_path.read_text() if self.log_path.exists() else ""

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _env_value(value: object) -> str:
    if isinstance(value, list | tuple):
        return ",".join(str(v) for v in value)
    return str(value)
