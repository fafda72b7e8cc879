"""The RTSP test camera: ``tests/rtsp_server.py`` (GStreamer's RTSP server, run by the system
python3 with python3-gi) looping the shared clips at ``rtsp://127.0.0.1:PORT/NAME``."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from loadtest.server import free_port
from tests.helpers import REPO, VIDEOS

SYSTEM_PYTHON = "/usr/bin/python3"
RTSP_SCRIPT = REPO / "tests" / "rtsp_server.py"
CAR = next((v for v in VIDEOS if v.name.startswith("car")), None)
BOTTLE = next((v for v in VIDEOS if v.name.startswith("bottle")), None)


class RtspCamera:
    """``tests/rtsp_server.py`` in a child process, serving clips at ``rtsp://127.0.0.1:PORT/NAME``.

    Args:
        mounts: mount name to clip.
        port: fixed port (to restart the same camera), else a free one.
        session_timeout_s: the RTSP session timeout clients must keep alive (0: the server's).
        auth: ``USER:PASSWORD`` the camera requires (Basic auth), or empty for none.
    """

    def __init__(
        self,
        mounts: dict[str, Path],
        port: int | None = None,
        session_timeout_s: int = 0,
        auth: str = "",
    ) -> None:
        self.mounts = mounts
        self.auth = auth
        self.port = port or free_port()
        self.session_timeout_s = session_timeout_s
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> RtspCamera:
        check = subprocess.run(
            [SYSTEM_PYTHON, "-c", "import gi; gi.require_version('GstRtspServer', '1.0')"],
            capture_output=True,
            check=False,
        )
        if check.returncode:
            pytest.fail(
                "the RTSP test camera needs python3-gi and gir1.2-gst-rtsp-server-1.0 for"
                " /usr/bin/python3: run `bash scripts/system-deps.sh` (or -m 'not rtsp')"
            )
        cmd = [SYSTEM_PYTHON, str(RTSP_SCRIPT), "--port", str(self.port)]
        if self.session_timeout_s:
            cmd += ["--session-timeout-s", str(self.session_timeout_s)]
        if self.auth:
            cmd += ["--auth", self.auth]
        for name, clip in self.mounts.items():
            cmd += ["--mount", f"{name}={clip}"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # blocks until it listens (or dies)
        if not line.startswith("READY"):
            self.proc.kill()
            _, err = self.proc.communicate()
            pytest.fail(f"RTSP test camera did not start on port {self.port}: {err[-2000:]}")
        return self

    def url(self, mount: str) -> str:
        return f"rtsp://127.0.0.1:{self.port}/{mount}"

    def kill(self) -> None:
        """Pull the plug: SIGKILL, no RTSP teardown."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.communicate()
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
            self.proc = None
