"""Live streams from a real camera: GStreamer's RTSP server on 127.0.0.1 looping the shared
clips, decoded by the stream manager and run through the real engine pool."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fractions
import http.server
import itertools
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import av
import pytest

from benchmarks.make_clip import make_clip
from engines.pool import EnginePool
from engines.types import ModelInfo
from loadtest.server import free_port
from streams.clips import CLIP_PATH, ClipOptions
from streams.detect import StreamDetect
from streams.events import EventFilter
from streams.fanout import ProcessedFrame
from streams.manager import ManagerOptions, StreamManager
from streams.reader import ReaderOptions, StreamState
from streams.sources import Transport, rtsp_answer
from streams.store import StreamStore
from tests.helpers import VIDEOS, eventually, next_frame, silent_camera, start_ort_pool
from tests.rtsp_camera import BOTTLE, CAR, RtspCamera, camera_clip

pytestmark = pytest.mark.rtsp


@pytest.fixture(scope="module")
def camera() -> Iterator[RtspCamera]:
    if CAR is None or BOTTLE is None:
        pytest.fail(f"shared clips missing: {VIDEOS} (set STREAMDET_SHARED_DIR)")
    cam = RtspCamera({"car": CAR, "bottle": BOTTLE}).start()
    yield cam
    cam.stop()


@pytest.fixture(scope="module")
def pool(model_info: ModelInfo) -> Iterator[EnginePool]:
    # A long fill window so frames of both cameras reliably meet in one batch.
    p = start_ort_pool(model_info, max_wait_ms=150)
    yield p
    p.stop(5)


def manager_options(decode_processes: int = 0, **changed: Any) -> ManagerOptions:
    """Short timeouts and backoff; ``changed``: other :class:`ReaderOptions`."""
    reader = ReaderOptions(
        **{
            "open_timeout_s": 3,
            "read_timeout_s": 2,
            "backoff_initial_s": 0.2,
            "backoff_max_s": 1.0,
            "frame_deadline_ms": 5000,
            **changed,
        }
    )
    return ManagerOptions(
        reader=reader,
        allowed_file_dir=None,
        ws_queue_size=4,
        stop_timeout_s=10,
        decode_processes=decode_processes,
    )


@pytest.fixture(params=[0, 1], ids=["decode-threads", "decode-processes"])
async def manager(
    pool: EnginePool, tmp_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[StreamManager]:
    """Streams decoded on threads of this process, and in a decode process."""
    m = StreamManager(pool, StreamStore(tmp_path / "data"), manager_options(request.param))
    await m.start()
    yield m
    await m.stop(10)


async def test_detections_arrive_with_capture_time_and_latency(
    manager: StreamManager, camera: RtspCamera
) -> None:
    info = await manager.add(camera.url("car"))
    sub = manager.subscribe(info["id"])
    assert sub is not None
    # The clip has stretches of empty road up to ~7 s long: read on (bounded) until a car.
    frames = [await next_frame(sub) for _ in range(30)]
    while not any(len(f.detections) for f in frames) and len(frames) < 250:
        frames.append(await next_frame(sub))
    assert all(f.stream_id == info["id"] and f.image.shape == (432, 768, 3) for f in frames)
    assert any(len(f.detections) for f in frames), "no detections in 250 frames of car-detection"
    assert all(f.latency_ms > 0 and f.captured_at > 0 for f in frames)
    names = {n for f in frames for n in (d["class_name"] for d in f.to_message()["detections"])}
    assert "car" in names
    stats = manager.describe(info["id"])
    assert stats is not None
    assert stats["state"] == "live"
    assert stats["frames_processed"] >= 30
    assert stats["last_frame_age_s"] is not None


@pytest.fixture(scope="module")
def hevc_camera(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RtspCamera]:
    """An H.265 camera (as many are by default): 4.8 s of the car clip where cars pass
    (its frames 180-240), encoded by x265 at 25 fps, a keyframe a second, looped by the RTSP
    server."""
    if CAR is None:
        pytest.fail(f"shared clips missing: {VIDEOS} (set STREAMDET_SHARED_DIR)")
    clip = tmp_path_factory.mktemp("hevc") / "car-hevc.mp4"
    make_clip(CAR, clip, width=768, height=432, fps=25, gop=25, frames=60, codec="hevc", start=180)
    cam = RtspCamera({"car": clip}).start()
    yield cam
    cam.stop()


async def test_an_h265_camera_is_decoded_and_detected_as_an_h264_one(
    manager: StreamManager, hevc_camera: RtspCamera
) -> None:
    """Every frame (``max_fps`` unset), then one a second: keyframes only are decoded then,
    as for H.264 (a keyframe a second)."""
    info = await manager.add(hevc_camera.url("car"))
    sub = manager.subscribe(info["id"])
    assert sub is not None
    names: set[str] = set()
    frames: list[ProcessedFrame] = []
    while "car" not in names and len(frames) < 150:  # a loop and a half of the clip
        frames.append(await next_frame(sub))
        names |= {d["class_name"] for d in frames[-1].to_message()["detections"]}
    assert all(f.image.shape == (432, 768, 3) for f in frames)
    assert "car" in names, names
    await manager.update(info["id"], {"max_fps": 1.0})

    def keyframes_only() -> bool:  # from the next group of pictures on (a keyframe a second)
        stats = manager.describe(info["id"])
        return stats is not None and stats["keyframes_only"]

    await eventually(keyframes_only, 20)
    await asyncio.sleep(1.0)  # a second of frames: read, not decoded
    stats = manager.describe(info["id"])
    assert stats is not None
    assert stats["state"] == "live" and stats["keyframes_only"], stats
    assert stats["frames_decoded"] < stats["frames_in"], stats


PLAIN_CAMERAS = {
    # name: (frames a second, width x height)
    "h264-no-rate": (12.5, (768, 432)),
    "mjpeg": (25.0, (640, 360)),
    "mjpeg-no-rate": (25.0, (640, 360)),
}


@pytest.fixture(scope="module")
def plain_cameras(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Cameras as many real ones are, by name (:data:`PLAIN_CAMERAS`): one stating no frame
    rate (no ``a=framerate``; the car clip's H.264, 12.5 fps), and an MJPEG one (RTP/JPEG,
    2 s of the car clip at 25 fps, looped) stating its rate or not; the URL of each."""
    if CAR is None:
        pytest.fail(f"shared clips missing: {VIDEOS} (set STREAMDET_SHARED_DIR)")
    mjpeg = camera_clip(tmp_path_factory.mktemp("mjpeg") / "car-mjpeg.mp4", "mjpeg", rate=25)
    stating = RtspCamera({"mjpeg": mjpeg}).start()
    silent = RtspCamera({"h264": CAR, "mjpeg": mjpeg}, rate=False).start()
    yield {
        "h264-no-rate": silent.url("h264"),
        "mjpeg": stating.url("mjpeg"),
        "mjpeg-no-rate": silent.url("mjpeg"),
    }
    stating.stop()
    silent.stop()


@pytest.mark.parametrize("camera_name", list(PLAIN_CAMERAS))
@pytest.mark.parametrize("decode_processes", [0, 1], ids=["decode-threads", "decode-processes"])
async def test_a_camera_stating_no_rate_or_sending_mjpeg_is_live_at_its_rate_and_clipped(
    pool: EnginePool,
    plain_cameras: dict[str, str],
    tmp_path: Path,
    camera_name: str,
    decode_processes: int,
) -> None:
    """A camera that states no frame rate, and an MJPEG one (which FFmpeg takes for 90000
    fps, its RTP clock, where the SDP says nothing): each opens at its first try within a
    2 s open timeout, is live, measures the camera's own rate from its frames, and records
    an event's clip at that rate, every frame a frame interval long, lasting as long as it
    was recorded."""
    rate, size = PLAIN_CAMERAS[camera_name]
    options = dataclasses.replace(
        manager_options(decode_processes, open_timeout_s=2),
        clips=ClipOptions(tmp_path / "clips", pre_s=1.0, post_s=1.0),
    )
    manager = StreamManager(pool, StreamStore(tmp_path / "data"), options)
    await manager.start()
    try:
        info = await manager.add(
            plain_cameras[camera_name], max_fps=5, detect=StreamDetect(clips=True)
        )
        sid = info["id"]
        sub = manager.subscribe(sid)
        assert sub is not None
        frames = [await next_frame(sub, 10) for _ in range(10)]  # 2 s of the camera at 5 fps
        assert all(f.image.shape[:2] == size[::-1] for f in frames)
        stats = manager.describe(sid)
        assert stats is not None
        assert stats["state"] == "live" and stats["reconnects"] == 0, stats
        assert stats["last_error"] is None, stats
        assert (stats["width"], stats["height"]) == size, stats
        assert 0.7 * rate <= stats["fps_in"] <= 1.3 * rate, stats
        event = manager.trigger(sid, "doorbell", clip=True)
        assert event is not None and manager.clips is not None
        clip_id = int(event["id"])
        assert event["clip"] == CLIP_PATH.format(id=clip_id), event
        path = await manager.clips.find(clip_id, 10.0)
        assert isinstance(path, Path), path
        [listed] = await manager.clips.listing(sid, 10)
    finally:
        await manager.stop(10)
    with av.open(str(path)) as clip:
        stream = clip.streams.video[0]
        times = [frame.time for frame in clip.decode(stream)]
        assert stream.average_rate is not None
        assert float(stream.average_rate) == pytest.approx(rate, rel=0.05), stream.average_rate
    assert times[0] == 0.0 and len(times) > 1, times
    steps = [b - a for a, b in itertools.pairwise(times)]
    assert steps == pytest.approx([1 / rate] * len(steps), abs=0.002), steps
    # From the keyframe at or before 1 s ahead of the event (MJPEG: every frame; the car
    # clip: one every 4.8 s, the stream's first here) to 1 s after it.
    seconds = len(times) / rate
    assert 2.0 - 0.3 <= seconds <= 1 + 4.8 + 1 + 0.5, seconds
    assert listed["duration_s"] == pytest.approx(seconds - 1 / rate, abs=0.5), (listed, seconds)


def slow_clip(source: Path, out: Path, rate: fractions.Fraction, frames: int, gop: int) -> Path:
    """``frames`` of ``source`` at 640x360, ``rate`` frames a second (below 1: a camera set
    to save bandwidth), H.264 with a keyframe every ``gop`` frames."""
    with av.open(str(source)) as src, av.open(str(out), "w") as dst:
        stream = dst.add_stream("libx264", rate=rate)
        stream.options = {"g": str(gop), "keyint_min": str(gop), "sc_threshold": "0", "bf": "0"}
        stream.width, stream.height, stream.pix_fmt = 640, 360, "yuv420p"
        for index, frame in enumerate(src.decode(video=0)):
            if index == frames:
                break
            picture = av.VideoFrame.from_ndarray(
                frame.reformat(640, 360, "yuv420p").to_ndarray(), format="yuv420p"
            )
            picture.pts, picture.time_base = index, 1 / rate
            for packet in stream.encode(picture):
                dst.mux(packet)
        for packet in stream.encode():
            dst.mux(packet)
    return out


@pytest.mark.parametrize("decode_processes", [0, 1], ids=["decode-threads", "decode-processes"])
async def test_a_camera_at_a_frame_every_2_5_s_opens_and_sends_frames_as_they_come(
    pool: EnginePool, tmp_path: Path, decode_processes: int
) -> None:
    """A 0.4 fps camera's open waited for 3 more of its frames (7.5 s: FFmpeg's probe, whose
    analyzeduration RTP's packets never reach, read for a frame rate and a first timestamp),
    or, slower, to the open timeout, and its first frames then came at once (the second
    replaced in the stream's lane by the third); now the open ends one frame interval in
    (the SDP and the first frame give codec and size), and frames come as the camera sends
    them, a frame interval apart."""
    assert CAR is not None
    clip = slow_clip(CAR, tmp_path / "slow.mp4", fractions.Fraction(2, 5), frames=8, gop=4)
    cam = RtspCamera({"slow": clip}).start()
    # The defaults' timeouts (a read's must outlast the camera's 2.5 s between frames).
    options = manager_options(decode_processes, open_timeout_s=10, read_timeout_s=10)
    manager = StreamManager(pool, StreamStore(tmp_path / "data"), options)
    await manager.start()
    try:
        info = await manager.add(cam.url("slow"))
        sub = manager.subscribe(info["id"])
        assert sub is not None
        first, second = await next_frame(sub), await next_frame(sub)
        assert (first.image.shape, second.frame) == ((360, 640, 3), first.frame + 1)
        # The camera paces them 2.5 s apart; those the probe held were decoded together
        # (milliseconds apart): a fifth of the interval leaves a loaded machine its stalls.
        assert second.captured_at - first.captured_at > 0.5, (first, second)
        stats = manager.describe(info["id"])
        assert stats is not None and stats["reconnects"] == 0, stats
    finally:
        await manager.stop(10)
        cam.stop()


async def test_two_streams_share_batches(manager: StreamManager, camera: RtspCamera) -> None:
    a = await manager.add(camera.url("car"))
    b = await manager.add(camera.url("bottle"))
    subs = [manager.subscribe(a["id"]), manager.subscribe(b["id"])]
    assert subs[0] is not None and subs[1] is not None
    shared = 0
    for _ in range(20):
        frames = [await next_frame(s) for s in subs if s is not None]
        # The stream lane holds one frame per stream and nothing else is queued, so a batch
        # of two is a frame of each camera.
        shared += sum(f.batch_size >= 2 for f in frames)
    assert shared > 0, "no batch held frames of both cameras"
    for info in (a, b):
        stats = manager.describe(info["id"])
        assert stats is not None and stats["frames_processed"] >= 20


async def test_camera_killed_and_restarted_reconnects_by_itself(
    manager: StreamManager, tmp_path: Path
) -> None:
    assert CAR is not None
    cam = RtspCamera({"car": CAR}).start()
    try:
        info = await manager.add(cam.url("car"))
        sid = info["id"]
        sub = manager.subscribe(sid, {"states": "true"})
        assert sub is not None
        seen: list[dict[str, Any]] = []  # state changes its viewers are sent
        before = await next_frame(sub, states=seen)
        cam.kill()
        assert await manager.wait_state(sid, {StreamState.RECONNECTING}, 30)
        lost = manager.describe(sid)
        assert lost is not None and lost["last_error"]
        cam = RtspCamera({"car": CAR}, port=cam.port).start()  # same camera comes back
        assert await manager.wait_state(sid, {StreamState.LIVE}, 60)
        # Skip the frames published before the plug was pulled (under load, frames read up to
        # the kill, well after ``before``, were still on their way): take one after the viewer
        # was told the stream is live again.
        back = ("reconnecting", "live")
        while not any((s["previous"], s["state"]) == back for s in seen):
            await next_frame(sub, states=seen)
        after = await next_frame(sub, states=seen)
        assert after.frame > before.frame
        stats = manager.describe(sid)
        assert stats is not None
        assert stats["reconnects"] == 1, stats  # one outage, one reopening: not each attempt
        assert stats["state"] == "live"
        # Each change is an event, for webhooks and MQTT to raise a "camera down" alert.
        await asyncio.sleep(0.1)  # the last one comes through the event loop
        page = manager.events.read(
            0, 100, EventFilter(streams=frozenset({sid}), types=frozenset({"stream_state"}))
        )
        changes = [(e["previous"], e["state"]) for e in page.events]
        assert changes[:2] == [("connecting", "live"), ("live", "reconnecting")], changes
        assert changes[-1] == ("reconnecting", "live"), changes
        lost_at = page.events[1]
        assert lost_at["error"] and lost_at["frame"] >= before.frame, lost_at
        # A viewer is told between the frames, with the events as logged.
        assert page.events[1] in seen and page.events[-1] in seen, (seen, page.events)
        assert seen.index(page.events[1]) < seen.index(page.events[-1])
    finally:
        cam.stop()


async def test_unreachable_and_missing_cameras_report_their_error(
    manager: StreamManager, camera: RtspCamera
) -> None:
    refused = await manager.add(f"rtsp://127.0.0.1:{free_port()}/cam")
    missing = await manager.add(camera.url("no-such-mount"))
    for info, expected in ((refused, "refused"), (missing, "404")):
        assert await manager.wait_state(info["id"], {StreamState.RECONNECTING}, 30)
        stats = manager.describe(info["id"])
        assert stats is not None
        assert expected in stats["last_error"].lower(), stats["last_error"]
        assert "Errno" not in stats["last_error"]  # FFmpeg's code is no OS errno
    good = await manager.add(camera.url("bottle"))  # the broken ones do not affect it
    sub = manager.subscribe(good["id"])
    assert sub is not None
    await next_frame(sub)


class _Answering:
    """A TCP server on loopback that answers each connection's first request with
    ``answer(request)`` and then keeps the connection open, saying nothing (a port of another
    protocol, or an RTSP server with a broken reply); ``None`` leaves it silent."""

    def __init__(self, answer: Callable[[bytes], bytes | None]) -> None:
        self._answer = answer
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._conns: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    @property
    def port(self) -> int:
        return int(self._sock.getsockname()[1])

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            self._conns.append(conn)
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            request = b""
            while b"\r\n\r\n" not in request:
                if not (chunk := conn.recv(4096)):
                    return
                request += chunk
            while (reply := self._answer(request)) is not None:
                conn.sendall(reply)
                request = b""
                while b"\r\n\r\n" not in request:
                    if not (chunk := conn.recv(4096)):
                        return
                    request += chunk

    def close(self) -> None:
        self._sock.close()
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()
        for thread in self._threads:
            thread.join(5)


class _WebPage(http.server.BaseHTTPRequestHandler):
    """A web server's refusal of an RTSP request: a 400 with its status line, as nginx's or
    a camera's web page's (Python's answers such a request bare, as to HTTP/0.9)."""

    default_request_version = "HTTP/1.0"

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _ssh(request: bytes) -> bytes | None:
    """An SSH server's banner (it sends it whatever comes), then nothing."""
    return b"SSH-2.0-OpenSSH_9.6\r\n" if request else None


def _rtsp_empty_sdp(request: bytes) -> bytes | None:
    """An RTSP server that answers OPTIONS, and DESCRIBE with an empty stream description."""
    method, cseq = request.split(b" ", 1)[0], b"0"
    for line in request.split(b"\r\n"):
        if line.lower().startswith(b"cseq:"):
            cseq = line.split(b":", 1)[1].strip()
    if method == b"OPTIONS":
        return b"RTSP/1.0 200 OK\r\nCSeq: " + cseq + b"\r\nPublic: OPTIONS, DESCRIBE\r\n\r\n"
    if method == b"DESCRIBE":
        return (
            b"RTSP/1.0 200 OK\r\nCSeq: " + cseq + b"\r\nContent-Type: application/sdp\r\n"
            b"Content-Length: 0\r\n\r\n"
        )
    return None


async def test_a_port_that_answers_another_protocol_says_so_not_that_it_timed_out(
    manager: StreamManager,
) -> None:
    """A web server on the URL's port (it refuses RTSP at once), an SSH server (its banner,
    then FFmpeg waits for an RTSP reply to the open timeout) and an RTSP server whose stream
    description is empty: FFmpeg said "Invalid data found" for each (the SSH one "no answer
    within 3 s (setting STREAMDET_STREAM_OPEN_TIMEOUT_S)", which no timeout would help);
    each says what answered and what to check. A silent camera still names the timeout
    (test_a_stalled_camera_says_which_wait_ran_out_and_each_return_starts_afresh)."""
    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _WebPage)
    web.daemon_threads = True
    serving = threading.Thread(target=web.serve_forever, daemon=True)
    serving.start()
    ssh, rtsp = _Answering(_ssh), _Answering(_rtsp_empty_sdp)
    try:
        expected = {
            web.server_address[1]: "the camera answered, but not with RTSP (first bytes:"
            " \"HTTP/1.0 400 Bad request version ('RTSP/\"): check the URL's scheme and port",
            ssh.port: "the camera answered, but not with RTSP (first bytes:"
            " 'SSH-2.0-OpenSSH_9.6\\r\\n'): check the URL's scheme and port",
            rtsp.port: "the camera answered RTSP, but FFmpeg could not use its answer",
        }
        added = {
            port: await manager.add(f"rtsp://admin:s3cret-pw@127.0.0.1:{port}/cam")
            for port in expected
        }
        for port, info in added.items():
            assert await manager.wait_state(info["id"], {StreamState.RECONNECTING}, 30)
            stats = manager.describe(info["id"])
            assert stats is not None
            error = stats["last_error"]
            assert expected[port] in error, error
            assert "STREAMDET_STREAM_OPEN_TIMEOUT_S" not in error, error
            assert "s3cret-pw" not in error, error
        assert "SDP" in manager.describe(added[rtsp.port]["id"])["last_error"]  # type: ignore[index]
        for info in added.values():
            assert await manager.remove(info["id"])
    finally:
        web.shutdown()
        web.server_close()
        serving.join(5)
        ssh.close()
        rtsp.close()


def test_the_answer_probe_bounds_a_slow_name_lookup_by_its_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The probe after a failed open resolved the camera's name with no bound (a resolver
    that does not answer held the stream's thread for its own retries, 5 s each, before the
    probe's 2 s began); now the lookup counts in the probe's limit, and a name that resolves
    in time is asked as before."""
    ssh = _Answering(_ssh)
    entered, released, resolved = threading.Event(), threading.Event(), threading.Event()
    resolve = socket.getaddrinfo

    def slow_resolver(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host == "slow-dns.camera.test":
            entered.set()
            released.wait(10)  # a resolver that answers late (then with this machine)
            resolved.set()
            host = "127.0.0.1"
        return resolve(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", slow_resolver)
    try:
        assert rtsp_answer(f"rtsp://slow-dns.camera.test:{ssh.port}/cam", 0.5) is None
        assert entered.is_set() and not resolved.is_set()  # given up on, still resolving
        released.set()
        answer = rtsp_answer(f"rtsp://localhost:{ssh.port}/cam", 5.0)
        assert answer == b"SSH-2.0-OpenSSH_9.6\r\n", answer
    finally:
        released.set()
        ssh.close()


async def test_add_remove_cycles_leak_no_threads_or_sockets(
    manager: StreamManager, camera: RtspCamera
) -> None:
    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    def threads() -> list[str]:
        # asyncio's default executor (asyncio.to_thread) grows lazily up to its fixed bound;
        # that is not a leak. Every other thread must be gone after each cycle.
        return [t.name for t in threading.enumerate() if not t.name.startswith("asyncio_")]

    async def cycle() -> None:
        info = await manager.add(camera.url("bottle"))
        assert await manager.wait_state(info["id"], {StreamState.LIVE}, 30)
        assert await manager.remove(info["id"])

    await cycle()  # first use loads codec tables and thread pools once
    before, files = threads(), fds()
    for _ in range(8):
        await cycle()
    assert manager.threads_alive() == 0
    assert len(threads()) <= len(before), threads()
    assert not [name for name in threads() if name.startswith("stream-")]
    assert fds() <= files + 2  # small slack: the event loop may open a socket pair lazily
    assert manager.list() == []


async def test_streams_survive_a_restart(
    pool: EnginePool, camera: RtspCamera, tmp_path: Path
) -> None:
    first = StreamManager(pool, StreamStore(tmp_path / "data"), manager_options())
    await first.start()
    info = await first.add(camera.url("car"), name="gate", max_fps=5)
    await first.stop(10)

    second = StreamManager(pool, StreamStore(tmp_path / "data"), manager_options())
    await second.start()
    try:
        again = second.describe(info["id"])
        assert again is not None
        assert (again["name"], again["max_fps"], again["url"]) == ("gate", 5, camera.url("car"))
        assert await second.wait_state(info["id"], {StreamState.LIVE}, 30)
    finally:
        await second.stop(10)


async def test_a_stalled_camera_says_which_wait_ran_out_and_each_return_starts_afresh(
    pool: EnginePool, tmp_path: Path
) -> None:
    """A camera that accepts the connection and never answers, and one that stops sending
    mid-stream, say which wait ran out and its setting (they said "Invalid data found" and
    "Immediate exit requested"); a camera that sent frames before it stalled starts its
    backoff afresh each time, so one that stalls now and then is never given up on (each
    stall counted one more attempt, up to --reconnect-max-attempts: failed for good)."""
    import signal

    assert CAR is not None
    # Two attempts a stall: the first reopen may run while the test is still to resume the
    # camera (1.5 s under load); three stalls, so counting on across them would fail it.
    options = manager_options(
        open_timeout_s=1.5, read_timeout_s=1.5, backoff_max_s=0.5, max_attempts=2
    )
    silent = silent_camera()
    cam = RtspCamera({"car": CAR}).start()
    m = StreamManager(pool, StreamStore(tmp_path / "data"), options)
    await m.start()
    try:
        mute = await m.add(f"rtsp://127.0.0.1:{silent.getsockname()[1]}/cam")
        info = await m.add(cam.url("car"))
        sid = info["id"]
        assert cam.proc is not None
        for _ in range(3):
            assert await m.wait_state(sid, {StreamState.LIVE}, 30)
            cam.proc.send_signal(signal.SIGSTOP)
            try:
                assert await m.wait_state(sid, {StreamState.RECONNECTING}, 30)
                stats = m.describe(sid)
                assert stats is not None
                assert (
                    "no data for 1.5 s (setting STREAMDET_STREAM_READ_TIMEOUT_S)"
                    in (stats["last_error"])
                ), stats["last_error"]
            finally:
                cam.proc.send_signal(signal.SIGCONT)
        assert await m.wait_state(sid, {StreamState.LIVE}, 30)  # not failed: it came back
        assert await m.wait_state(mute["id"], {StreamState.FAILED}, 30)  # it never sent
        gone = m.describe(mute["id"])
        assert gone is not None
        assert (
            "no answer within 1.5 s (setting STREAMDET_STREAM_OPEN_TIMEOUT_S)"
            in (gone["last_error"])
        ), gone["last_error"]
    finally:
        await m.stop(10)
        cam.stop()
        silent.close()


async def test_cameras_that_never_answer_do_not_hold_the_shutdown(
    pool: EnginePool, tmp_path: Path
) -> None:
    """Shutting down with cameras that accepted the connection and say nothing waited for
    FFmpeg's open timeout (10 s by default, Docker's whole stop grace), each in turn: they
    are let go, as DELETE lets one go."""
    silent = silent_camera()
    m = StreamManager(pool, StreamStore(tmp_path / "data"), manager_options(open_timeout_s=20))
    await m.start()
    try:
        for _ in range(3):
            await m.add(f"rtsp://127.0.0.1:{silent.getsockname()[1]}/cam")
        await asyncio.sleep(1.0)  # each in FFmpeg's open, waiting
        started = time.monotonic()
        await m.stop(30)
        stopped_s = time.monotonic() - started
    finally:
        silent.close()
    assert stopped_s < 10, stopped_s  # the open's timeout is 20 s, and there are 3


async def test_a_camera_frozen_while_live_is_removed_at_once_and_sends_no_stale_frame(
    pool: EnginePool, tmp_path: Path
) -> None:
    """A camera that freezes mid-stream (SIGSTOP): removing a stream of it answers at once, not
    at the end of FFmpeg's read (which no stop cuts short: it took the read timeout); and
    the other stream publishes nothing of the freeze's time, goes reconnecting at the read
    timeout, and counts one reconnect when the camera is back. FFmpeg's read, cut at the
    timeout, handed back the packet its RTP depacketizer held, and PyAV's timer started
    again: the stream stayed live for twice the timeout and published that frame as captured
    at the timeout."""
    import signal

    assert CAR is not None
    cam = RtspCamera({"car": CAR}).start()
    m = StreamManager(pool, StreamStore(tmp_path / "data"), manager_options(read_timeout_s=4))
    await m.start()
    try:
        kept, gone = await m.add(cam.url("car")), await m.add(cam.url("car"))
        sub = m.subscribe(kept["id"])
        assert sub is not None
        for info in (kept, gone):
            assert await m.wait_state(info["id"], {StreamState.LIVE}, 30)
        assert cam.proc is not None
        cam.proc.send_signal(signal.SIGSTOP)
        stopped_at = time.time()
        try:
            await asyncio.sleep(1.0)  # both readers in FFmpeg's read, waiting
            started = time.monotonic()
            assert await m.remove(gone["id"])
            removed_s = time.monotonic() - started
            assert await m.wait_state(kept["id"], {StreamState.RECONNECTING}, 30)
            stats = m.describe(kept["id"])
            assert stats is not None
            assert (
                "no data for 4 s (setting STREAMDET_STREAM_READ_TIMEOUT_S)" in (stats["last_error"])
            ), stats["last_error"]
            published = []
            with contextlib.suppress(TimeoutError):
                while True:
                    published.append(await next_frame(sub, 0.2))
        finally:
            cam.proc.send_signal(signal.SIGCONT)
        assert removed_s < 2, removed_s  # the read's timeout is 4 s
        # What was decoded before the freeze may still come through; nothing from 3 s later.
        late = [f for f in published if f.captured_at > stopped_at + 3]
        assert not late, [(f.frame, f.captured_at - stopped_at) for f in late]
        assert await m.wait_state(kept["id"], {StreamState.LIVE}, 60)
        back = m.describe(kept["id"])
        assert back is not None and back["reconnects"] == 1, back
    finally:
        await m.stop(10)
        cam.stop()


@pytest.mark.parametrize("transport", ["tcp", "udp"])
async def test_a_camera_with_a_short_session_timeout_is_kept_alive(
    manager: StreamManager, transport: Transport
) -> None:
    """Cameras end an RTSP session nothing renewed within its timeout (60 s, often): one of
    2 s stays live three times as long, with no reconnect, over TCP and UDP. FFmpeg sends
    GET_PARAMETER/OPTIONS keep-alives; GStreamer's server also keeps a session alive while
    its TCP connection is open or RTCP comes, so this shows the stream lasts, not which of
    them kept it."""
    assert CAR is not None
    cam = RtspCamera({"car": CAR}, session_timeout_s=2).start()
    try:
        info = await manager.add(cam.url("car"), transport=transport)
        sub = manager.subscribe(info["id"])
        assert sub is not None
        assert await manager.wait_state(info["id"], {StreamState.LIVE}, 30)
        await asyncio.sleep(6)
        before = await next_frame(sub)
        while (after := await next_frame(sub)).frame <= before.frame + 5:
            pass
        stats = manager.describe(info["id"])
        assert stats is not None
        assert stats["state"] == "live" and stats["reconnects"] == 0, stats
        assert stats["last_error"] is None, stats
        assert after.captured_at > before.captured_at
    finally:
        cam.stop()
