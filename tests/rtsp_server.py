"""A real RTSP camera for tests and benchmarks: GStreamer's RTSP server serving MP4 clips.

Runs under the SYSTEM python (``/usr/bin/python3``) with python3-gi and
gir1.2-gst-rtsp-server-1.0 (see scripts/system-deps.sh), not the project venv::

    /usr/bin/python3 tests/rtsp_server.py --port 8554 --mount cam0=../shared/videos/car.mp4

Each mount serves its clip's H.264, H.265 or MJPEG (an MP4 of ``image/jpeg`` frames, sent as
RTP/JPEG, payload type 26, as cheap cameras and old encoders do) as it is (no re-encoding, so a
camera costs almost no CPU) and loops it forever: the clip's access units are demuxed once into
memory and pushed through an ``appsrc`` with timestamps that keep growing across loops, so
clients see one endless live-like stream paced at the clip's own frame rate. Every client gets
its own pipeline starting at the clip's first (key) frame.

Options (besides ``--port``, ``--host`` and the repeatable ``--mount NAME=CLIP.mp4``):

- ``--no-loop``: end each stream after one pass of its clip.
- ``--no-rate``: state no frame rate, as many real cameras do: the clip's rate is dropped from
  the ``appsrc`` caps, so the SDP has no ``a=framerate`` (an H.264/H.265 clip's SPS may still
  carry its timing; an MJPEG stream has nothing else to say it). Frames are still paced at
  the clip's own rate.
- ``--session-timeout-s S``: the RTSP session timeout a client must keep alive.
- ``--auth USER:PASSWORD``: require Basic auth.

Once listening it prints ``READY <port>`` on stdout, so a parent waits on that line.
"""

from __future__ import annotations

import argparse
import signal
import sys
from dataclasses import dataclass
from typing import Any

import gi

gi.require_version("Gst", "1.0")
gi.require_version("GstRtspServer", "1.0")
from gi.repository import GLib, Gst, GstRtspServer  # noqa: E402


@dataclass
class AccessUnit:
    data: bytes
    pts: int
    dts: int
    duration: int
    delta: bool


@dataclass
class Clip:
    caps: Any
    units: list[AccessUnit]
    period_ns: int  # one loop of the clip
    codec: str  # h264, h265 or jpeg


def clip_codec(path: str) -> str:
    """``h264``, ``h265`` or ``jpeg``: the video codec of an MP4 clip (from its demuxed caps)."""
    pipeline = Gst.parse_launch(
        f'filesrc location="{path}" ! qtdemux ! video/x-h264;video/x-h265;image/jpeg ! '
        "appsink name=sink sync=false"
    )
    sink = pipeline.get_by_name("sink")
    pipeline.set_state(Gst.State.PLAYING)
    sample = sink.emit("pull-sample")
    pipeline.set_state(Gst.State.NULL)
    if sample is None:
        raise RuntimeError(f"{path}: no H.264, H.265 or MJPEG video found")
    name = str(sample.get_caps().get_structure(0).get_name())
    return "jpeg" if name == "image/jpeg" else name.removeprefix("video/x-")


def load_clip(path: str) -> Clip:
    """Demux a clip's H.264 or H.265 into byte-stream access units (an MJPEG clip into its
    JPEG frames) held in memory."""
    codec = clip_codec(path)
    parse = (
        "jpegparse"
        if codec == "jpeg"
        else f"{codec}parse config-interval=-1 ! "
        f"video/x-{codec},stream-format=byte-stream,alignment=au"
    )
    pipeline = Gst.parse_launch(
        f'filesrc location="{path}" ! qtdemux ! {parse} ! appsink name=sink sync=false'
    )
    sink = pipeline.get_by_name("sink")
    pipeline.set_state(Gst.State.PLAYING)
    units: list[AccessUnit] = []
    caps = None
    while True:
        sample = sink.emit("pull-sample")
        if sample is None:
            break
        caps = caps or sample.get_caps()
        buf = sample.get_buffer()
        ok, info = buf.map(Gst.MapFlags.READ)
        if not ok:
            raise RuntimeError(f"cannot map a buffer of {path}")
        data = bytes(info.data)
        buf.unmap(info)
        units.append(
            AccessUnit(
                data,
                buf.pts,
                buf.dts,
                buf.duration,
                bool(buf.get_flags() & Gst.BufferFlags.DELTA_UNIT),
            )
        )
    pipeline.set_state(Gst.State.NULL)
    if not units or caps is None:
        raise RuntimeError(f"{path}: no {codec} video found")
    first = min(u.dts if u.dts != Gst.CLOCK_TIME_NONE else u.pts for u in units)
    for u in units:
        u.pts -= first
        u.dts = u.dts - first if u.dts != Gst.CLOCK_TIME_NONE else u.pts
    frame_ns = units[1].dts - units[0].dts if len(units) > 1 else 40_000_000
    # jpegparse leaves a frame's duration unset (CLOCK_TIME_NONE, 2**64 - 1): taken as a
    # duration it put the second loop ~584 years on, and the stream stopped after one pass.
    last = units[-1].duration
    period = max(u.pts for u in units) + (
        last if last and last != Gst.CLOCK_TIME_NONE else frame_ns
    )
    return Clip(caps=caps, units=units, period_ns=period, codec=codec)


def without_rate(caps: Any) -> Any:
    """``caps`` with no ``framerate`` field (a camera that states no frame rate)."""
    stripped = Gst.Caps.new_empty()
    for i in range(caps.get_size()):
        structure = caps.get_structure(i).copy()
        structure.remove_field("framerate")
        stripped.append_structure(structure)
    return stripped


class LoopingFactory(GstRtspServer.RTSPMediaFactory):  # type: ignore[misc]
    def __init__(self, clip: Clip, loop: bool, rate: bool = True) -> None:
        super().__init__()
        self.clip = clip
        self.loop = loop
        self.caps = clip.caps if rate else without_rate(clip.caps)
        if clip.codec == "jpeg":
            pay = "jpegparse ! rtpjpegpay name=pay0 pt=26"
        else:
            # h264parse/h265parse put the rate of the SPS's timing back in the caps, so the
            # SDP stated it all the same: a camera stating none gets its access units (already
            # byte-stream, one a buffer) straight to the payloader.
            parse = f"{clip.codec}parse ! " if rate else ""
            pay = f"{parse}rtp{clip.codec}pay name=pay0 pt=96 config-interval=1"
        self.set_launch(f"( appsrc name=src format=time is-live=false max-bytes=2000000 ! {pay} )")
        self.set_shared(False)
        self.connect("media-configure", self._configure)

    def _configure(self, _factory: Any, media: Any) -> None:
        src = media.get_element().get_child_by_name("src")
        src.set_property("caps", self.caps)
        state = {"index": 0}
        src.connect("need-data", self._need_data, state)

    def _need_data(self, src: Any, _length: int, state: dict[str, int]) -> None:
        units = self.clip.units
        index = state["index"]
        lap, pos = divmod(index, len(units))
        if lap and not self.loop:
            src.emit("end-of-stream")
            return
        unit = units[pos]
        buf = Gst.Buffer.new_wrapped(unit.data)
        offset = lap * self.clip.period_ns
        buf.pts = unit.pts + offset
        buf.dts = unit.dts + offset
        buf.duration = unit.duration
        if unit.delta:
            buf.set_flags(Gst.BufferFlags.DELTA_UNIT)
        state["index"] = index + 1
        src.emit("push-buffer", buf)


def _timeout_sessions(_server: Any, client: Any, timeout_s: int) -> None:
    client.connect("new-session", lambda _client, session: session.set_timeout(timeout_s))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument(
        "--mount",
        action="append",
        required=True,
        metavar="NAME=CLIP.mp4",
        help="serve CLIP at rtsp://HOST:PORT/NAME (repeatable)",
    )
    parser.add_argument("--no-loop", action="store_true", help="end each stream after one pass")
    parser.add_argument(
        "--no-rate",
        action="store_true",
        help="state no frame rate (no a=framerate in the SDP), as many cameras do",
    )
    parser.add_argument(
        "--session-timeout-s",
        type=int,
        default=0,
        help="RTSP session timeout a client must keep alive (as cameras' 60 s); 0: the server's",
    )
    parser.add_argument(
        "--auth", default="", metavar="USER:PASSWORD", help="require Basic auth (as cameras do)"
    )
    args = parser.parse_args()
    Gst.init(None)
    clips: dict[str, Clip] = {}
    server = GstRtspServer.RTSPServer()
    server.set_address(args.host)
    server.set_service(str(args.port))
    mounts = server.get_mount_points()
    for spec in args.mount:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            parser.error(f"--mount wants NAME=CLIP.mp4, got {spec!r}")
        if path not in clips:
            clips[path] = load_clip(path)
        factory = LoopingFactory(clips[path], not args.no_loop, not args.no_rate)
        if args.auth:
            factory.add_role_from_structure(
                Gst.Structure.from_string(
                    "camera, media.factory.access=(boolean)true,"
                    " media.factory.construct=(boolean)true"
                )[0]
            )
        mounts.add_factory("/" + name.strip("/"), factory)
    if args.auth:
        user, _, password = args.auth.partition(":")
        auth = GstRtspServer.RTSPAuth()
        token = GstRtspServer.RTSPToken()
        token.set_string("media.factory.role", "camera")
        auth.add_basic(GstRtspServer.RTSPAuth.make_basic(user, password), token)
        server.set_auth(auth)
    if args.session_timeout_s:
        server.connect("client-connected", _timeout_sessions, args.session_timeout_s)
        # The server removes expired sessions only when asked: as a camera does, once a second.
        pool = server.get_session_pool()
        GLib.timeout_add_seconds(1, lambda: pool.cleanup() >= 0)
    if server.attach(None) == 0:
        print(f"cannot listen on {args.host}:{args.port}", file=sys.stderr)
        return 1
    loop = GLib.MainLoop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        GLib.unix_signal_add(GLib.PRIORITY_DEFAULT, sig, loop.quit)
    print(f"READY {args.port}", flush=True)
    loop.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
