"""Retention by age (``server/retention.py``, ``--event-retain-days``): events, their
snapshots, thumbnails and clips older than the retention are deleted, from the log, its
store and the disk; against a real ``streamdet serve`` with a real stream too."""

from __future__ import annotations

import asyncio
import functools
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
