"""Decode processes (:mod:`streams.decode_procs`): real child processes decoding the shared
clips, frames back through shared memory into the real engine pool and server."""

from __future__ import annotations

import asyncio
import errno
import itertools
import json
import multiprocessing
import os
import pickle
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import av
import numpy as np
import pytest
from fastapi.testclient import TestClient

from benchmarks.make_clip import make_clip
from engines.batching import WorkItem
from engines.pool import EnginePool
from streams import decode_child, decode_procs
from streams.clips import ClipOptions
from streams.decode_procs import DecodeHub
from streams.detect import StreamDetect
from streams.jobs import JobCancelled, JobError, JobProgress, JobSpec, run_job
from streams.manager import ManagerOptions, StreamManager
from streams.reader import ReaderOptions, StreamConfig, StreamState
from streams.sources import parse_source
from streams.store import StreamStore
from tests.helpers import (
    BOTTLE_CLIP,
    CAR_CLIP,
    VIDEOS,
    file_manager,
    file_stream_app,
    published_frames,
)

SLOTS = 8


def _config(clip: Path, stream_id: str = "cam", max_fps: float | None = None) -> StreamConfig:
    return StreamConfig(stream_id, parse_source(f"file://{clip}", clip.parent), max_fps=max_fps)


def _shm_files() -> set[str]:
    return {p.name for p in Path(decode_child.shm_dir()).glob("streamdet-frames-*")}


class Kept:
    """A frame sink that keeps every frame it is offered (as a slow consumer would)."""

    def __init__(self) -> None:
        self.items: list[WorkItem] = []
        self.arrived = threading.Condition()

    def __call__(self, stream_id: str, item: WorkItem) -> WorkItem | None:
        with self.arrived:
            self.items.append(item)
            self.arrived.notify_all()
        return None

    def wait_for(self, n: int, timeout_s: float = 60.0) -> None:
        with self.arrived:
            assert self.arrived.wait_for(lambda: len(self.items) >= n, timeout_s), len(self.items)


def _shared(image: np.ndarray) -> bool:
    """Whether ``image`` is a view of a ring's slot (not a copy)."""
    base = image.base
    while isinstance(base, np.ndarray):
        base = base.base
    return base is not None and not isinstance(base, bytes)


@pytest.fixture
def hub() -> Iterator[DecodeHub]:
    # Paced as a camera: one frame in flight at a time, however loaded the machine is.
    h = DecodeHub(1, ReaderOptions(open_timeout_s=5, read_timeout_s=5), SLOTS)
    yield h
    h.shutdown(10.0)


def test_frames_are_the_decoders_and_a_keeping_consumer_costs_copies_not_frames(
    hub: DecodeHub,
) -> None:
    kept = Kept()
    reader = hub.reader(_config(CAR_CLIP), kept, lambda frame: None)
    reader.start()
    kept.wait_for(3 * SLOTS)
    assert reader.state is StreamState.LIVE
    images = [item.image for item in kept.items[: 3 * SLOTS]]
    with av.open(str(CAR_CLIP)) as clip:
        decoded = clip.decode(video=0)
        first = [next(decoded).to_ndarray(format="rgb24") for _ in range(5)]
    for got, want in zip(images[:5], first, strict=True):  # every frame: the first ones
        assert np.array_equal(got, want)
    shared = [_shared(image) for image in images]
    # Views while at most half the ring is taken; then copies, and the stream goes on.
    assert sum(shared) == SLOTS // 2 and not shared[-1], shared
    kept.items.clear()  # let go: the slots come back and frames are views again
    images.clear()
    kept.wait_for(SLOTS)
    assert any(_shared(item.image) for item in kept.items[:SLOTS])
    end = time.monotonic() + 10  # the process sends its counts every REPORT_S
    while (snap := reader.snapshot())["frames_in"] < 4 * SLOTS:
        assert time.monotonic() < end, snap
        time.sleep(decode_child.REPORT_S)
    assert snap["decode_process"] == 0 and snap["decode"] == "cpu"
    assert snap["frames_decoded"] == snap["frames_in"] and snap["fps_in"] > 0
    assert snap["frames_copied"] >= len(shared) - sum(shared) > 0
    assert (snap["width"], snap["height"]) == (768, 432)
    reader.stop()
    assert reader.join(10.0) and not reader.alive
    time.sleep(decode_procs.STALE_S)
    assert reader.snapshot()["fps_in"] == 0.0  # no rate once the process stopped reporting


def test_frames_of_a_ring_the_server_cannot_map_are_counted_and_the_stream_says_why(
    hub: DecodeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    def cannot_map(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

    monkeypatch.setattr(decode_procs, "_Mapped", cannot_map)
    kept = Kept()
    reader = hub.reader(_config(CAR_CLIP), kept, lambda frame: None)
    reader.start()
    end = time.monotonic() + 30
    while (snap := reader.snapshot())["drops"] < 2 * SLOTS:  # the process's too, once full
        assert time.monotonic() < end, snap
        time.sleep(decode_child.REPORT_S)
    assert kept.items == []
    assert "cannot map its frames" in (snap["last_error"] or "") and "memory" in snap["last_error"]


def test_a_killed_decode_process_is_started_again_and_its_streams_reopen(
    hub: DecodeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(decode_procs, "QUICK_EXIT_S", 0.0)
    kept = Kept()
    reader = hub.reader(_config(BOTTLE_CLIP), kept, lambda frame: None)
    reader.start()
    kept.wait_for(5)
    (pid,) = hub.pids()
    assert hub.stats() == (1, 0)
    os.kill(pid, signal.SIGKILL)
    assert reader.wait_state({StreamState.RECONNECTING}, 30)
    assert f"exited with code {-signal.SIGKILL}" in (reader.last_error or "")
    assert reader.wait_state({StreamState.LIVE}, 30)
    (again,) = hub.pids()
    assert again != pid
    assert hub.stats() == (1, 1)  # running again, one death counted
    assert reader.snapshot()["reconnects"] == 1  # lost, and live again: it was not counted
    before = len(kept.items)
    kept.wait_for(before + 5)
    assert reader.alive


def test_a_stream_stopped_while_its_process_restarts_stays_stopped(
    hub: DecodeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream removed between its process's death and the reopen in the new process (a
    DELETE at the wrong moment, pinned here from the state change the restart reports)
    ends: its stop found no process to send to, and it used to be opened all the same,
    decoding for ever in the new process."""
    monkeypatch.setattr(decode_procs, "QUICK_EXIT_S", 0.0)
    holder: list[decode_procs.RemoteReader] = []

    def on_state(prev: StreamState, state: StreamState, error: str | None, frame: int) -> None:
        if state is StreamState.RECONNECTING and "started again" in (error or ""):
            holder[0].stop()

    kept = Kept()
    reader = hub.reader(_config(BOTTLE_CLIP), kept, lambda frame: None, on_state=on_state)
    holder.append(reader)
    reader.start()
    kept.wait_for(2)
    os.kill(hub.pids()[0], signal.SIGKILL)
    assert reader.join(10.0) and not reader.alive
    assert hub.pids() == []  # nothing to decode: no process started for it


def test_a_process_that_cannot_be_started_again_fails_its_streams_not_the_hub(
    hub: DecodeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Starting a dead process's replacement fails (fork: EAGAIN): its streams fail saying
    so, and the hub goes on reading the others and starting processes (the failure used to
    end its one receiving thread: no stream got a frame again)."""
    monkeypatch.setattr(decode_procs, "QUICK_EXIT_S", 0.0)
    real = decode_procs.DecodeHub._popen
    failures = [0]

    def flaky(cmd_r: Any, evt_w: Any) -> Any:
        if failures[0]:
            failures[0] -= 1
            raise OSError(errno.EAGAIN, "Resource temporarily unavailable")
        return real(cmd_r, evt_w)

    monkeypatch.setattr(decode_procs.DecodeHub, "_popen", staticmethod(flaky))
    first = hub.reader(_config(BOTTLE_CLIP, "a"), Kept(), lambda frame: None)
    first.start()
    assert first.wait_state({StreamState.LIVE}, 30)
    failures[0] = 1
    os.kill(hub.pids()[0], signal.SIGKILL)
    assert first.wait_state({StreamState.FAILED}, 30)
    assert "starting it again failed" in (first.last_error or ""), first.last_error
    assert first.join(5.0)
    kept = Kept()
    second = hub.reader(_config(CAR_CLIP, "b"), kept, lambda frame: None)
    second.start()
    kept.wait_for(3, 30)  # a new process, its frames read


def test_a_decode_process_that_dies_at_once_fails_its_streams_with_the_setting(
    hub: DecodeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(decode_procs, "QUICK_EXIT_S", 600.0)
    reader = hub.reader(_config(BOTTLE_CLIP), Kept(), lambda frame: None)
    reader.start()
    (pid,) = hub.pids()
    os.kill(pid, signal.SIGKILL)
    assert reader.wait_state({StreamState.FAILED}, 30)
    assert "right after it started" in (reader.last_error or "")
    assert "STREAMDET_DECODE_PROCESSES=0" in (reader.last_error or "")
    assert reader.join(5.0) and not reader.alive


def test_clips_are_written_in_the_process_and_fail_with_why_when_it_dies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(decode_procs, "QUICK_EXIT_S", 0.0)
    clips = ClipOptions(tmp_path / "clips", pre_s=1.0, post_s=60.0, max_s=60.0)
    hub = DecodeHub(1, ReaderOptions(open_timeout_s=5, read_timeout_s=5), SLOTS, clips)
    done: list[tuple[int, Path | None, str | None]] = []
    kept = Kept()
    reader = hub.reader(
        _config(CAR_CLIP), kept, lambda frame: None, on_clip_done=lambda *c: done.append(c)
    )
    reader.detect = StreamDetect(clips=True)
    try:
        reader.start()
        kept.wait_for(3)
        requests = reader.clip_requests
        assert requests is not None
        assert requests.request(time.monotonic(), 7) == 7
        part = clips.parts(7)[0]
        deadline = time.monotonic() + 20
        while not part.exists():  # being written from its first keyframe: 60 s to go
            assert time.monotonic() < deadline
            time.sleep(0.05)
        (pid,) = hub.pids()
        os.kill(pid, signal.SIGKILL)
        assert reader.wait_state({StreamState.RECONNECTING}, 30)
        assert done and done[0][:2] == (7, None), done
        assert f"exited with code {-signal.SIGKILL} while it was being made" in str(done[0][2])
        assert not part.exists()  # it stayed until the next start, counted by no limit
        assert reader.wait_state({StreamState.LIVE}, 30)
        kept.wait_for(len(kept.items) + 3)
        assert requests.request(time.monotonic(), 8) == 8  # a new clip, in the new process
        kept.wait_for(len(kept.items) + 15)  # frames into it (not a fixed time: under load)
    finally:
        hub.shutdown(10.0)  # the source closes: the clip ends there and is written
    assert done[1:] == [(8, clips.path(8), None)], done
    with av.open(str(clips.path(8))) as clip:
        assert clip.streams.video[0].frames >= 10  # its pre-roll and the frames after


ORPHAN = """
import os, sys, time
from pathlib import Path
from typing import Any
from streams.decode_procs import DecodeHub
from streams.jobs import JobCancelled, JobError, JobProgress, JobSpec, run_job
from streams.reader import ReaderOptions, StreamConfig, StreamState
from streams.sources import parse_source
clip = {clip!r}
hub = DecodeHub(1, ReaderOptions())
config = StreamConfig("cam", parse_source("file://" + clip, Path(clip).parent))
reader = hub.reader(config, lambda sid, item: None, lambda frame: None)
reader.start()
assert reader.wait_state({{StreamState.LIVE}}, 30)
time.sleep(0.5)
print(hub.pids()[0], flush=True)
os._exit(0)  # as if killed: no shutdown
"""


def test_a_decode_process_whose_server_dies_exits_and_leaves_no_shared_memory() -> None:
    before = _shm_files()
    server = subprocess.run(
        [sys.executable, "-c", ORPHAN.format(clip=str(CAR_CLIP))],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    pid = int(server.stdout.split()[-1])
    end = time.monotonic() + 20  # the process's stream closes within its read timeout
    while Path(f"/proc/{pid}").exists() and "Z" not in _proc_state(pid):
        assert time.monotonic() < end, f"decode process {pid} outlived its server"
        time.sleep(0.1)
    assert _shm_files() <= before


def _proc_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return "gone"


def test_full_shared_memory_is_refused_with_what_to_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int, offset: int, size: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError, match=r"--shm-size.*STREAMDET_DECODE_PROCESSES=0") as caught:
        decode_child._Ring(1, SLOTS, (1920, 1080), 0, str(tmp_path))
    assert "47 MiB" in str(caught.value) and "1920x1080" in str(caught.value)
    assert list(tmp_path.iterdir()) == []  # nothing left behind


def _room_of(monkeypatch: pytest.MonkeyPatch, size_bytes: int) -> dict[str, int]:
    """Shared memory with ``room["bytes"]`` left (change it to resize): a larger reservation
    fails as a full ``/dev/shm`` does."""
    room = {"bytes": size_bytes}
    reserve = os.posix_fallocate

    def limited(fd: int, offset: int, size: int) -> None:
        if size > room["bytes"]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        reserve(fd, offset, size)

    monkeypatch.setattr(os, "posix_fallocate", limited)
    return room


def test_short_shared_memory_gives_rings_fewer_slots_before_refusing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Docker's default /dev/shm (64 MB) holds one 1080p stream at 8 slots: the next ones get
    fewer slots (more copies) rather than failing, down to MIN_SLOTS."""
    room = _room_of(monkeypatch, 30 * 2**20)  # what is left of the directory

    def make(slots: int = SLOTS) -> decode_child._Ring:
        return decode_child.make_ring(1, slots, (1920, 1080), 0, str(tmp_path), owner="stream c")

    ring = make()  # 8 x 5.9 MiB do not fit 30 MiB; 4 do
    assert ring.slots == 4
    assert os.path.getsize(ring.path) == decode_child.HEADER + 4 * 1920 * 1080 * 3
    ring.retire()  # never announced: its file goes
    room["bytes"] = 5 * 2**20  # not even MIN_SLOTS frames
    with pytest.raises(decode_child.SharedMemoryFull, match=r"2 frames of 1920x1080.*--shm-size"):
        make()
    assert list(tmp_path.iterdir()) == []

    # Another error than a full directory is not retried with fewer slots.
    def failing(fd: int, offset: int, size: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "posix_fallocate", failing)
    with pytest.raises(OSError, match="8 frames") as caught:
        make()
    assert not isinstance(caught.value, decode_child.SharedMemoryFull)


def test_a_job_in_short_shared_memory_runs_on_fewer_slots_or_fails_saying_what_to_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job's ring falls back to fewer slots as a stream's does (the process runs fewer
    frames ahead of the job); where not even MIN_SLOTS fit, the job ends with the reason."""
    room = _room_of(monkeypatch, 3 * 2**20)  # 768x432 frames (the car clip): 2 slots fit
    server, events = multiprocessing.Pipe(duplex=False)
    child = decode_child._Child(events, ReaderOptions(), SLOTS, str(tmp_path), None)
    spec = JobSpec(str(CAR_CLIP), StreamDetect())

    def messages(job: decode_child._ChildJob) -> list[tuple[Any, ...]]:
        got: list[tuple[Any, ...]] = []
        while not got or got[-1][0] != "job-end":
            assert server.poll(30), got
            got.append(server.recv())
            if [m[0] for m in got].count("job-frame") == 2:
                job.stop()  # the server holds both slots: the job waits; stopped here
        return got

    job = decode_child._ChildJob("job#1", spec, 0, child)
    job.thread.start()
    got = messages(job)
    job.thread.join(10)
    ring = got[0]
    assert ring[0] == "ring" and ring[4:6] == (2, 432), ring  # 2 slots of 432 rows
    assert [m[0] for m in got[1:]] == ["job-frame", "job-frame", "job-end"]
    assert got[-1][2] is None  # stopped, not failed
    # Announced, the ring is the server's to unlink (it maps it, then unlinks it), however
    # soon the job ends: a job of a few frames can end before the server has mapped it.
    assert [p.name for p in tmp_path.iterdir()] == [Path(ring[3]).name]
    _, _, gen, path, slots, height, width, source = ring
    decode_procs._Mapped(gen, path, slots, height, width, source=source)
    assert list(tmp_path.iterdir()) == []

    room["bytes"] = 2**20  # not even 2 frames
    job = decode_child._ChildJob("job#2", spec, 0, child)
    job.thread.start()
    got = messages(job)
    assert [m[0] for m in got] == ["job-end"]
    assert re.search(r"2 frames of 768x432.*--shm-size", got[0][2]), got[0]
    server.close()


def _shm_of(monkeypatch: pytest.MonkeyPatch, size_bytes: int) -> dict[str, int]:
    """``/dev/shm`` seen as holding ``size["bytes"]`` (change it to resize): the one thing
    faked, since a small tmpfs takes a mount."""
    size = {"bytes": size_bytes}

    def statvfs(path: str) -> os.statvfs_result:
        assert path == decode_child.shm_dir(), path
        blocks = size["bytes"] // 4096
        return os.statvfs_result((4096, 4096, blocks, blocks, blocks, 0, 0, 0, 0, 255))

    monkeypatch.setattr(os, "statvfs", statvfs)
    return size


def test_a_small_shared_memory_is_warned_of_with_what_to_change(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    size = _shm_of(monkeypatch, 64 * 2**20)  # Docker's default /dev/shm
    # 1080p cameras decoded whole: 47 MiB a stream.
    warning = decode_child.shm_warning(decode_child.shm_dir(), SLOTS, 0)
    assert warning is not None and "holds 64 MiB" in warning
    assert "about 1 1080p streams decoded at 1920x1080 with 8 slots (47.5 MiB" in warning
    assert "--shm-size" in warning and "STREAMDET_DECODE_PROCESSES=0" in warning
    assert "STREAMDET_STREAM_DECODE_SIZE" in warning
    # Decoded at the engine's 640 (the default): 5.3 MiB a stream, 12 fit.
    assert decode_child.shm_warning(decode_child.shm_dir(), SLOTS, 640) is None
    size["bytes"] = 32 * 2**20
    warning = decode_child.shm_warning(decode_child.shm_dir(), SLOTS, 640)
    assert warning is not None and "about 6 1080p streams decoded at 640x360" in warning
    size["bytes"] = 2 * 2**30  # the Dockerfile's --shm-size 2g
    assert decode_child.shm_warning(decode_child.shm_dir(), SLOTS, 0) is None


def test_the_hub_refuses_a_ring_it_cannot_flag() -> None:
    with pytest.raises(ValueError, match=r"slots must be 1\.\.64"):
        DecodeHub(1, ReaderOptions(), slots=65)


# ---- through the stream manager and the real engine pool ----------------------------------


def _two_processes() -> ManagerOptions:
    return ManagerOptions(
        reader=ReaderOptions(open_timeout_s=5, read_timeout_s=5),
        allowed_file_dir=VIDEOS[0].parent,
        decode_processes=2,
    )


@pytest.fixture
async def manager(pool: EnginePool, tmp_path: Path) -> AsyncIterator[StreamManager]:
    async with file_manager(pool, tmp_path / "data", decode_processes=2) as m:
        yield m


async def _until(check: object, timeout_s: float = 30.0) -> None:
    end = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.1)


async def test_streams_spread_over_the_processes_and_are_detected(
    manager: StreamManager,
) -> None:
    car = await manager.add(f"file://{CAR_CLIP}", max_fps=5.0)
    bottles = await manager.add(f"file://{BOTTLE_CLIP}", max_fps=5.0)
    found = [await published_frames(manager, s["id"], 6) for s in (car, bottles)]
    assert "bottle" in {d["class_name"] for f in found[1] for d in f.detections.to_json()}
    assert all(f.image.shape == (360, 640, 3) for f in found[1])
    procs = {manager.describe(s["id"])["decode_process"] for s in (car, bottles)}  # type: ignore[index]
    assert procs == {0, 1}


async def test_changes_reach_the_decode_process(
    manager: StreamManager,
) -> None:
    info = await manager.add(f"file://{BOTTLE_CLIP}", max_fps=10.0)
    sid = info["id"]
    await published_frames(manager, sid, 2)

    def described() -> dict[str, object]:
        got = manager.describe(sid)
        assert got is not None
        return got

    # Motion that nothing reaches: the process skips every frame but the idle ones.
    still = StreamDetect(motion=True, motion_min_area=1.0)
    await manager.update(sid, {"detect": still})
    await _until(lambda: described()["motion_skipped"] > 5)  # type: ignore[operator]
    assert described()["decode_process"] is not None
    await manager.update(sid, {"detect": StreamDetect()})
    await published_frames(manager, sid, 4)  # those skipped before are counted by now
    skipped = described()["motion_skipped"]
    await published_frames(manager, sid, 4)
    assert described()["motion_skipped"] == skipped  # motion off there too
    assert described()["state"] == "live" and described()["reconnects"] == 0


def _inconsistent(stats: dict[str, Any]) -> str | None:
    """What is wrong with a stream's counts (None: nothing): every frame in is processed,
    dropped, skipped (sampled out, or still) or failed, or on its way (pending, >= 0)."""
    came, done = stats["frames_in"], stats["frames_processed"]
    gone = done + stats["drops"] + stats["skipped"] + stats["motion_skipped"]
    gone += stats["frames_failed"]
    if done > came:
        return f"frames_processed {done} > frames_in {came}"
    if gone > came:
        return f"processed + dropped + skipped + failed {gone} > frames_in {came}"
    return None


async def test_a_streams_counts_add_up_at_every_read_in_a_decode_process(
    manager: StreamManager,
) -> None:
    """The process sends a frame's counts with the frame: they came on a 0.2 s timer, the
    frame at once, so a frame processed before the next report had frames_processed lead
    frames_in (GET /streams/{id} showed more frames processed than came in)."""
    info = await manager.add(f"file://{CAR_CLIP}")  # every frame, at the clip's 25 fps
    sid = info["id"]
    reads = 0
    end = time.monotonic() + 60
    while (stats := manager.describe(sid)) is None or stats["frames_processed"] < 40:
        assert stats is not None
        assert (wrong := _inconsistent(stats)) is None, (wrong, reads, stats)
        assert time.monotonic() < end, stats
        reads += 1
        await asyncio.sleep(0.002)
    assert _inconsistent(stats) is None, stats
    assert stats["decode_process"] is not None


async def test_stopping_leaves_no_process_and_no_shared_memory(
    pool: EnginePool, tmp_path: Path
) -> None:
    before = _shm_files()
    options = _two_processes()
    manager = StreamManager(pool, StreamStore(tmp_path / "data"), options)
    await manager.start()
    ids = [(await manager.add(f"file://{clip}", max_fps=5.0))["id"] for clip in VIDEOS]
    for sid in ids:
        await published_frames(manager, sid, 2)
    pids = manager.decode_pids()
    assert len(pids) == 2
    await manager.stop(10)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # exited and reaped
    assert _shm_files() <= before
    assert not [t.name for t in threading.enumerate() if t.name == "decode-hub"]


def test_the_server_decodes_in_processes_when_told(tmp_path: Path) -> None:
    with TestClient(file_stream_app(tmp_path, decode_processes=1)) as c:
        sid = c.post("/streams", json={"url": f"file://{BOTTLE_CLIP}", "max_fps": 5}).json()["id"]
        with c.websocket_connect(f"/ws/streams/{sid}") as ws:
            message = ws.receive_json()
        assert message["stream_id"] == sid and message["width"] == 640
        stats = c.get(f"/streams/{sid}").json()
        assert stats["decode_process"] == 0 and stats["state"] == "live"
        exposed = c.get("/metrics").text
        assert "\nstreamdet_decode_processes 1.0\n" in exposed
        assert "\nstreamdet_decode_process_exits_total 0.0\n" in exposed
    with TestClient(file_stream_app(tmp_path, decode_processes=0)) as c:
        assert "streamdet_decode_process" not in c.get("/metrics").text  # none to count


def test_decode_processes_default_to_none_on_the_cpu_engine_and_some_for_a_gpu_one() -> None:
    from engines.registry import usable_cores
    from server.settings import Settings

    assert Settings().decode_processes == 0
    assert Settings(backend="torch").decode_processes == max(1, min(8, usable_cores() // 2))
    assert Settings(backend="tensorrt", decode_processes=0).decode_processes == 0
    assert Settings(decode_processes=3).decode_processes == 3


def test_a_gpu_engine_decodes_in_the_server_by_default_where_shared_memory_is_too_small(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from server import settings

    size = _shm_of(monkeypatch, 64 * 2**20)  # docker run without --shm-size
    settings._warn_small_shm.cache_clear()
    whole: dict[str, Any] = {"backend": "torch", "stream_decode_size": 0}  # decoded whole
    with caplog.at_level("WARNING", logger="server.settings"):
        assert settings.Settings(**whole).decode_processes == 0
    (said,) = [r.getMessage() for r in caplog.records if r.name == "server.settings"]
    assert "holds 64 MiB" in said and "--shm-size 2g" in said
    assert "STREAMDET_DECODE_PROCESSES" in said and "STREAMDET_STREAM_DECODE_SIZE" in said
    # Asked for, they are kept (rings then take fewer slots, and say so).
    assert settings.Settings(**whole, decode_processes=2).decode_processes == 2
    # Frames decoded at the engine's size (the default): 64 MiB holds 12 streams' rings.
    assert settings.Settings(backend="torch").decode_processes >= 1
    size["bytes"] = 16 * 2**20  # not even 5
    assert settings.Settings(backend="torch").decode_processes == 0
    size["bytes"] = 2 * 2**30
    assert settings.Settings(**whole).decode_processes >= 1


def test_the_inbox_takes_every_message_waiting_and_keeps_a_partial_one() -> None:
    reader, writer = multiprocessing.Pipe(duplex=False)
    inbox = decode_procs._Inbox(reader)
    try:
        assert inbox.read() == []  # nothing yet: no wait
        big = ("counts", "k", {"frames": 1}, ("x" * 40_000,))  # over one write's 16 KiB
        for message in [("frame", "k", 1, 3, 0.5, 12.0), big, ("exited", "k")]:
            writer.send(message)
        got: list[tuple[object, ...]] = []
        deadline = time.monotonic() + 5
        while len(got) < 3 and time.monotonic() < deadline:
            got += [pickle.loads(m) for m in inbox.read()]
        assert got == [("frame", "k", 1, 3, 0.5, 12.0), big, ("exited", "k")]
        # A message cut between two reads comes whole from the second.
        raw = pickle.dumps(("state", "k", "live", None))
        frame = decode_procs._LENGTH.pack(len(raw)) + raw
        os.write(writer.fileno(), frame[:7])
        assert inbox.read() == []
        os.write(writer.fileno(), frame[7:])
        assert [pickle.loads(m) for m in inbox.read()] == [("state", "k", "live", None)]
        writer.close()
        with pytest.raises(EOFError):
            inbox.read()
    finally:
        reader.close()


# ---- video jobs decoded in a decode process ------------------------------------------------


def _run_job(pool: EnginePool, directory: Path, **given: Any) -> tuple[dict[str, Any], JobProgress]:
    progress = JobProgress()
    spec = JobSpec(str(given.pop("source", BOTTLE_CLIP)), StreamDetect(), fps=2.0)
    counts = run_job(
        spec,
        given.pop("submit", pool.submit_background),
        directory,
        str,
        inflight=given.pop("inflight", 4),
        cancel=given.pop("cancel", threading.Event()),
        interrupt=threading.Event(),
        progress=progress,
        **given,
    )
    return counts, progress


def test_a_job_decoded_in_a_decode_process_gives_what_one_decoded_here_does(
    pool: EnginePool, hub: DecodeHub, tmp_path: Path
) -> None:
    before = _shm_files()
    here, here_progress = _run_job(pool, tmp_path / "here")
    # More frames in flight than the ring has slots (a GPU's inflight is 64): each is copied
    # out as the job takes it, so the process stays at most a ring ahead and never waits on
    # frames the job holds.
    there, there_progress = _run_job(
        pool, tmp_path / "there", frames=hub.job_frames, inflight=3 * SLOTS
    )
    assert there == here and there["detections"]["bottle"] > 0
    frames = [(tmp_path / d / "frames.ndjson").read_text().splitlines() for d in ("here", "there")]
    assert frames[0] == frames[1] and len(frames[0]) == 80  # 39.9 s at 2 a second, same lines
    for progress in (here_progress, there_progress):
        assert progress.frames_read == 1189 and progress.frames_processed == 80
        assert progress.duration_s == pytest.approx(39.85, abs=0.1)
    assert hub.pids() and _shm_files() == before  # its ring gone with the job


def test_a_jobs_missing_part_is_told_from_a_decode_process_too(
    pool: EnginePool, hub: DecodeHub, tmp_path: Path
) -> None:
    """``gaps_s`` comes back with the process's progress, as its position does."""
    from tests.test_jobs import _shifted

    video = tmp_path / "gap.ts"
    _shifted(CAR_CLIP, video, 5.0, 6.0, from_s=3.0)
    (tmp_path / "here").mkdir()
    (tmp_path / "there").mkdir()
    _, here = _run_job(pool, tmp_path / "here", source=video)
    _, there = _run_job(pool, tmp_path / "there", source=video, frames=hub.job_frames)
    assert 4.5 < here.gaps_s < 5.5 and there.gaps_s == here.gaps_s
    assert there.position_s == here.position_s


def test_a_job_in_a_decode_process_is_cancelled_and_refused_with_why(
    pool: EnginePool, hub: DecodeHub, tmp_path: Path
) -> None:
    cancel = threading.Event()

    submitted = itertools.count(1)

    def submit_then_cancel(item: WorkItem) -> None:  # cancelled at its third frame
        pool.submit_background(item)
        if next(submitted) == 3:
            cancel.set()

    with pytest.raises(JobCancelled) as stopped:
        _run_job(pool, tmp_path / "cancelled", frames=hub.job_frames, cancel=cancel,
                 submit=submit_then_cancel)  # fmt: skip
    assert not stopped.value.interrupted
    with pytest.raises(JobError, match="cannot open the video"):
        _run_job(pool, tmp_path / "missing", source=tmp_path / "no.mp4", frames=hub.job_frames)
    # The process stopped decoding the cancelled job: a new one runs at once, whole.
    _, progress = _run_job(pool, tmp_path / "after", frames=hub.job_frames)
    assert progress.frames_processed == 80


def test_a_job_whose_decode_process_dies_fails_saying_so(
    pool: EnginePool, hub: DecodeHub, tmp_path: Path
) -> None:
    def kill_soon() -> None:
        end = time.monotonic() + 30
        while not hub.pids():
            assert time.monotonic() < end
            time.sleep(0.05)
        time.sleep(0.5)
        os.kill(hub.pids()[0], signal.SIGKILL)

    killer = threading.Thread(target=kill_soon)
    killer.start()
    with pytest.raises(JobError, match=r"exited with code -9: run the job again"):
        _run_job(pool, tmp_path / "killed", source=CAR_CLIP, frames=hub.job_frames)
    killer.join()


def test_the_server_runs_jobs_in_its_decode_processes(tmp_path: Path) -> None:
    with TestClient(file_stream_app(tmp_path, decode_processes=1)) as c:
        created = c.post(
            "/jobs",
            files={"video": ("bottles.mp4", BOTTLE_CLIP.read_bytes(), "video/mp4")},
            data={"settings": json.dumps({"fps": 1})},
        )
        assert created.status_code == 202, created.text
        done = c.get(f"/jobs/{created.json()['id']}", params={"wait_s": 60}).json()
        assert done["state"] == "done", done
        assert done["progress"]["frames_read"] == 1189
        assert done["progress"]["frames_processed"] == 40
        assert c.get("/metrics").text.count("streamdet_decode_processes 1") == 1


def test_a_job_that_ends_before_the_server_maps_its_ring_loses_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A video of six frames is decoded and its job over before a busy server maps the
    ring (here 50 ms late): every frame arrives, and no file is left (the process used to
    unlink its ring as the job ended, and the job failed "cannot map its frames")."""
    short = tmp_path / "short.mp4"
    make_clip(CAR_CLIP, short, width=320, height=180, fps=25, gop=25, frames=3)  # 6 frames
    mapped = decode_procs._Mapped.__init__

    def late(self: decode_procs._Mapped, *args: Any, **kwargs: Any) -> None:
        time.sleep(0.05)
        mapped(self, *args, **kwargs)

    monkeypatch.setattr(decode_procs._Mapped, "__init__", late)
    before = _shm_files()
    hub = DecodeHub(1, ReaderOptions(), SLOTS)
    try:
        for _ in range(3):
            spec = JobSpec(str(short), StreamDetect())
            frames = list(hub.job_frames(spec, JobProgress(), lambda: None, 0))
            assert [index for index, *_ in frames] == list(range(6))
    finally:
        hub.shutdown(10.0)
    assert _shm_files() <= before


def test_a_stream_changing_size_keeps_one_ring_of_shared_memory(
    hub: DecodeHub, tmp_path: Path
) -> None:
    """Each change of frame size takes a new ring; the old one's memory goes once the
    server's frames of it do (the process kept every ring mapped until the stream ended:
    a ring of /dev/shm more per change)."""
    clip = tmp_path / "sizes.ts"
    with clip.open("wb") as joined:
        for part in range(6):  # MPEG-TS pieces of 10 frames, end to end: sizes alternate
            piece = tmp_path / f"{part}.ts"
            w, h = (320, 240) if part % 2 else (352, 288)
            with av.open(str(piece), "w", format="mpegts") as out:
                stream = out.add_stream("mpeg2video", rate=25)
                stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
                for i in range(10):
                    picture = np.full((h, w, 3), part * 40 + i, np.uint8)
                    frame = av.VideoFrame.from_ndarray(picture, format="rgb24")
                    frame.pts = part * 10 + i
                    for packet in stream.encode(frame):
                        out.mux(packet)
                for packet in stream.encode():
                    out.mux(packet)
            joined.write(piece.read_bytes())
    reader = hub.reader(_config(clip), lambda sid, item: None, lambda frame: None)
    reader.start()
    assert reader.wait_state({StreamState.LIVE}, 30)
    (pid,) = hub.pids()

    def rings_mapped() -> int:
        maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
        return len({line.split()[5] for line in maps if "streamdet-frames" in line})

    seen = []
    for _ in range(8):
        time.sleep(0.5)
        seen.append(rings_mapped())
    assert reader.snapshot()["frames_in"] > 60  # it looped: sizes changed a dozen times
    assert max(seen) <= 2, seen  # the ring of the size now (and, for a moment, the last)
    reader.stop()
    assert reader.join(10.0)


def test_a_job_whose_frames_cannot_be_mapped_fails_and_its_process_lets_it_go(
    pool: EnginePool, hub: DecodeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mapped = decode_procs._Mapped

    def cannot_map(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

    before = _shm_files()
    monkeypatch.setattr(decode_procs, "_Mapped", cannot_map)
    with pytest.raises(JobError, match="cannot map its frames"):
        _run_job(pool, tmp_path / "unmapped", frames=hub.job_frames)
    monkeypatch.setattr(decode_procs, "_Mapped", mapped)
    # Told to stop, the process's job thread ended and unlinked the ring the server could
    # not map (a job left waiting for slots never freed would keep it).
    end = time.monotonic() + 10
    while _shm_files() != before:
        assert time.monotonic() < end, _shm_files() - before
        time.sleep(0.05)
    _, progress = _run_job(pool, tmp_path / "next", frames=hub.job_frames)
    assert progress.frames_processed == 80
