"""Retention by age (``server/retention.py``, ``--event-retain-days``): events, their
snapshots, thumbnails and clips older than the retention are deleted, from the log, its
store and the disk; against a real ``streamdet serve`` with a real stream too."""

from __future__ import annotations

import asyncio
import functools
import os
import time
from pathlib import Path

import httpx
import numpy as np

from engines.types import Detections
from loadtest.server import ServerProcess
from server.retention import forget_older_than, period_s
from server.snapshots import SnapshotStore
from streams.clips import ClipIndex, ClipOptions
from streams.event_store import EventStore
from streams.events import EventLog
from streams.fanout import ProcessedFrame
from streams.geometry import Seen
from streams.lines import Crossing
from tests.helpers import BOTTLE_CLIP, CACHE_DIR, MODEL_PT, SHELF


def test_retention_is_checked_every_minute_or_sooner_for_a_short_one() -> None:
    assert period_s(7 * 86_400) == 60.0 and period_s(30.0) == 3.0 and period_s(0.5) == 1.0


async def test_what_is_older_than_the_retention_is_deleted_everywhere(tmp_path: Path) -> None:
    store = EventStore(tmp_path / "data", size=100)
    log = EventLog(size=100, start_id=1, store=store)
    snapshots = SnapshotStore(
        10, 320, None, lambda _: None, directory=tmp_path / "snapshots", events=log
    )
    clips = ClipIndex(ClipOptions(tmp_path / "clips"))
    (tmp_path / "clips").mkdir()
    image = np.full((90, 160, 3), 60, np.uint8)
    seen = Seen((10.0, 10.0, 50.0, 50.0), 0.9)
    for at in (100.0, 200.0, 300.0):  # a frame with two events each: 1-2, 3-4, 5-6
        frame = ProcessedFrame(
            "s", int(at), None, at, 0.0, image, Detections.empty({2: "car"}, 160, 90), 1
        )
        crossings = [Crossing("gate", "in", 1, 2, int(at), seen)] * 2
        logged = log.add(
            "s", "", at, crossings, str, extra=functools.partial(snapshots.extra, frame)
        )
        snapshots.capture(frame, logged)
        (tmp_path / "clips" / f"{logged[0]['id']}.mp4").write_bytes(b"video")
        (tmp_path / "clips" / f"{logged[0]['id']}.json").write_text("{}")
    for first in (1, 3, 5):  # each frame drawn (in worker threads, in any order)
        assert await snapshots.get(first) is not None
    # A drawing done before its get() was awaited returns at once, its done-callback (which
    # files the frame as kept) still queued on the loop: let it run (a loaded CI saw 1 of 2).
    await asyncio.sleep(0)
    assert len(list((tmp_path / "snapshots").glob("*.jpg"))) == 9  # 3 frames, 6 thumbnails

    gone = await forget_older_than(250.0, log, snapshots, clips)
    assert (gone.events, gone.snapshots, gone.clips) == (4, 2, 2)
    assert [e["id"] for e in log.read(0, 10).events] == [5, 6] and log.oldest_id == 5
    left = sorted(p.name for p in (tmp_path / "snapshots").iterdir())
    assert left == ["5-5.jpg", "5-6.jpg", "5.jpg"]
    assert sorted(p.name for p in (tmp_path / "clips").iterdir()) == ["5.json", "5.mp4"]
    assert await snapshots.get(3) is None and await snapshots.get(5) is not None
    again = await forget_older_than(250.0, log, snapshots, clips)
    assert (again.events, again.snapshots, again.clips) == (0, 0, 0)  # nothing more
    store.close()
    reopened = EventStore(tmp_path / "data", size=100)
    kept, _ = reopened.load()
    assert [e["id"] for e in kept] == [5, 6]  # deleted on disk too
    reopened.close()


def test_a_server_with_a_retention_deletes_its_events_once_they_are_older(
    tmp_path: Path,
) -> None:
    retain_s = 3.0
    settings: dict[str, object] = {
        "model": str(MODEL_PT),
        "cache_dir": str(CACHE_DIR),
        "data_dir": str(tmp_path / "data"),
        "allowed_file_dir": str(BOTTLE_CLIP.parent),
        "event_retain_days": retain_s / 86_400,
        "workers": 1,
    }
    stream = {
        "url": f"file://{BOTTLE_CLIP}",
        "max_fps": 8,
        "classes": "bottle",
        "track": True,
        "zones": [SHELF],
        "loop": False,
    }
    server = ServerProcess(settings, log_path=tmp_path / "server.log")
    with server, httpx.Client(base_url=server.base_url, timeout=30) as c:
        assert c.post("/streams", json=stream).status_code == 201
        first = c.get("/events", params={"type": "zone_enter", "wait_s": 30}).json()["events"]
        assert first, "no zone entry in 30 s"
        event = first[0]
        assert c.get(event["snapshot"]).status_code == 200
        deadline = time.monotonic() + retain_s + 10
        while any(e["id"] == event["id"] for e in c.get("/events").json()["events"]):
            assert time.monotonic() < deadline, "the event outlived its retention"
            time.sleep(0.2)
        assert c.get(event["snapshot"]).status_code == 404
        assert c.get(event["thumbnail"]).status_code == 404
        kept = c.get("/events").json()["events"]
        assert all(e["captured_at"] >= time.time() - retain_s - 2 for e in kept), kept
        assert not list((tmp_path / "data" / "snapshots").glob(f"{event['id']}*.jpg"))
        assert c.get("/healthz").status_code == 200
    assert "retention: deleted" in server.log_text()


def _log_frame(
    log: EventLog, snapshots: SnapshotStore, at: float, clips: Path | None = None
) -> int:
    """One frame with one line crossing (an object: a thumbnail too), captured at ``at``,
    logged, drawn and, with ``clips``, given a clip file; returns its event's id."""
    image = np.full((90, 160, 3), 60, np.uint8)
    frame = ProcessedFrame("s", 1, None, at, 0.0, image, Detections.empty({2: "car"}, 160, 90), 1)
    crossing = Crossing("gate", "in", 1, 2, 1, Seen((10.0, 10.0, 50.0, 50.0), 0.9))
    logged = log.add("s", "", at, [crossing], str, extra=functools.partial(snapshots.extra, frame))
    snapshots.capture(frame, logged)
    event_id = int(logged[0]["id"])
    if clips is not None:
        (clips / f"{event_id}.mp4").write_bytes(b"video")
        (clips / f"{event_id}.json").write_text("{}")
    return event_id


def _snapshots_on_disk(directory: Path) -> int:
    return len([p for p in directory.glob("*.jpg") if "-" not in p.stem])


async def _drawn(directory: Path, frames: int) -> None:
    """Until ``frames`` snapshots are on disk and filed as kept."""
    deadline = time.monotonic() + 10
    while _snapshots_on_disk(directory) < frames:
        assert time.monotonic() < deadline, "snapshots not drawn in 10 s"
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)  # their done-callbacks, on the loop


async def test_a_full_event_log_does_not_make_retention_delete_recent_clips_or_snapshots(
    tmp_path: Path,
) -> None:
    """Events that left the log by its size (``--event-log-size``) are not old: their clips
    and snapshots go by the age of their files. They used to be deleted with everything
    below the log's oldest event at the next pass, a minute after they were made."""
    log = EventLog(size=2, start_id=1)
    snapshots = SnapshotStore(
        10, 320, None, lambda _: None, directory=tmp_path / "snapshots", events=log
    )
    (tmp_path / "clips").mkdir()
    clips = ClipIndex(ClipOptions(tmp_path / "clips"))
    now = time.time()
    ids = [_log_frame(log, snapshots, now - 40 + i, tmp_path / "clips") for i in range(4)]
    assert ids == [1, 2, 3, 4] and log.oldest_id == 3  # 1 and 2 left the log by its size
    await _drawn(tmp_path / "snapshots", 4)
    two_days_ago = now - 2 * 86_400
    for path in (*(tmp_path / "snapshots").glob("1*.jpg"), tmp_path / "clips" / "1.mp4"):
        os.utime(path, (two_days_ago, two_days_ago))  # event 1's files are old

    gone = await forget_older_than(now - 86_400, log, snapshots, clips)
    assert (gone.events, gone.snapshots, gone.clips) == (0, 1, 1)  # only event 1's
    left = sorted(p.name for p in (tmp_path / "snapshots").iterdir())
    assert left == ["2-2.jpg", "2.jpg", "3-3.jpg", "3.jpg", "4-4.jpg", "4.jpg"]
    names = sorted(p.name for p in (tmp_path / "clips").iterdir())
    assert names == ["2.json", "2.mp4", "3.json", "3.mp4", "4.json", "4.mp4"]

    # Once events leave the log for their age, everything below them goes with them.
    gone = await forget_older_than(now - 37.5, log, snapshots, clips)
    assert (gone.events, gone.snapshots, gone.clips) == (1, 2, 2)
    assert sorted(p.name for p in (tmp_path / "clips").iterdir()) == ["4.json", "4.mp4"]


async def test_snapshot_files_half_written_never_stay(tmp_path: Path) -> None:
    """A ``.part`` left by a crash goes at the next start, and a write that fails (a full
    disk; here a folder in the way) removes its own: nothing else ever deletes them."""
    directory = tmp_path / "snapshots"
    directory.mkdir()
    (directory / "7.part").write_bytes(b"half a jpeg")
    (directory / "7-8.part").write_bytes(b"half a thumbnail")
    log = EventLog(size=10, start_id=1)
    snapshots = SnapshotStore(10, 320, None, lambda _: None, directory=directory, events=log)
    assert list(directory.iterdir()) == []
    (directory / "1.jpg").mkdir()  # frame 1's snapshot cannot be written
    assert _log_frame(log, snapshots, time.time()) == 1
    assert await snapshots.get(1) is None  # drawing failed
    await asyncio.sleep(0.05)
    assert [p.name for p in directory.iterdir()] == ["1.jpg"]  # the folder only
