"""The RTSP test camera: ``tests/rtsp_server.py`` (GStreamer's RTSP server, run by the system
python3 with python3-gi) looping the shared clips at ``rtsp://127.0.0.1:PORT/NAME``."""

from __future__ import annotations

import fractions
import subprocess
from pathlib import Path

import av
import pytest

from loadtest.server import free_port
from tests.helpers import REPO, VIDEOS

SYSTEM_PYTHON = "/usr/bin/python3"
RTSP_SCRIPT = REPO / "tests" / "rtsp_server.py"
CAR = next((v for v in VIDEOS if v.name.startswith("car")), None)
BOTTLE = next((v for v in VIDEOS if v.name.startswith("bottle")), None)


def camera_clip(
    out: Path,
    codec: str,
    *,
    rate: int = 25,
    frames: int = 50,
    size: tuple[int, int] = (640, 360),
    options: dict[str, str] | None = None,
    source: Path | None = None,
) -> Path:
    """The first ``frames`` of ``source`` (the car clip) as an MP4 for the camera to serve:
    ``codec`` (``mjpeg``, ``libx264``, ``libx265``) at ``rate`` frames a second, ``size``,
    with the encoder's ``options``."""
    source = source or CAR
    if source is None:
        pytest.fail("shared clips missing (set STREAMDET_SHARED_DIR)")
    pix_fmt = "yuvj420p" if codec == "mjpeg" else "yuv420p"
    with av.open(str(source)) as src, av.open(str(out), "w") as dst:
        stream = dst.add_stream(codec, rate=rate)
        if not isinstance(stream, av.VideoStream):
            raise TypeError(f"{codec} is no video codec")
        encoder: dict[str, object] = dict(options or {})
        stream.options = encoder
        stream.width, stream.height, stream.pix_fmt = *size, pix_fmt
        for index, frame in enumerate(src.decode(video=0)):
            if index == frames:
                break
            picture = frame.reformat(*size, pix_fmt)
            picture.pts, picture.time_base = index, fractions.Fraction(1, rate)
            for packet in stream.encode(picture):
                dst.mux(packet)
        for packet in stream.encode():
            dst.mux(packet)
    return out


class RtspCamera:
    """``tests/rtsp_server.py`` in a child process, serving clips at ``rtsp://127.0.0.1:PORT/NAME``.

    Args:
        mounts: mount name to clip.
        port: fixed port (to restart the same camera), else a free one.
        session_timeout_s: the RTSP session timeout clients must keep alive (0: the server's).
        auth: ``USER:PASSWORD`` the camera requires (Basic auth), or empty for none.
        rate: state each clip's frame rate (``a=framerate`` in the SDP); False: state none,
            as many real cameras do (``--no-rate``).

    A clip may be H.264, H.265 or MJPEG (an MP4 of JPEG frames: served as RTP/JPEG).
    """

    def __init__(
        self,
        mounts: dict[str, Path],
        port: int | None = None,
        session_timeout_s: int = 0,
        auth: str = "",
        rate: bool = True,
    ) -> None:
        self.mounts = mounts
        self.auth = auth
        self.rate = rate
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
        if not self.rate:
            cmd.append("--no-rate")
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
