"""Event clips (``streams/clips.py``): the packets of the shared clips through the recorder, the
clips decoded back with PyAV; then a real server recording a real RTSP camera."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import av
import httpx
import pytest

from benchmarks.make_clip import make_clip
from engines.batching import WorkItem
from streams.clips import (
    ClipIndex,
    ClipOptions,
    ClipPlanner,
    ClipRecorder,
    list_clips,
    prune_clips,
)
from streams.decode_procs import DecodeHub
from streams.detect import StreamDetect
from streams.reader import ReaderOptions, StreamConfig
from streams.sources import open_options, parse_source
from tests.helpers import BOTTLE_CLIP, CAR_CLIP, GATE, clip_server

BASE = 1000.0  # monotonic time of each clip's first packet, in these tests

pytestmark = pytest.mark.skipif(not CAR_CLIP.is_file(), reason="needs ../shared/videos")


class Source:
    """A shared clip's video packets, fed to a recorder as a camera would send them: each at
    ``BASE`` + its time in the clip."""

    def __init__(self, path: Path) -> None:
        self.container = av.open(str(path))
        self.stream = self.container.streams.video[0]
        self.packets = [p for p in self.container.demux(self.stream) if p.size]
        self.fed = 0

    def at(self, index: int) -> float:
        packet = self.packets[index]
        assert self.stream.time_base is not None
        return BASE + float((packet.dts or 0) * self.stream.time_base)

    def feed_until(self, recorder: ClipRecorder, seconds: float) -> None:
        while self.fed < len(self.packets) and self.at(self.fed) <= BASE + seconds:
            recorder.packet(self.packets[self.fed], self.stream, self.at(self.fed))
            self.fed += 1

    def index_of(self, data: bytes) -> int:
        return next(i for i, p in enumerate(self.packets) if bytes(p) == data)

    def close(self) -> None:
        self.container.close()


def clip_packets(path: Path) -> list[bytes]:
    with av.open(str(path)) as clip:
        return [bytes(p) for p in clip.demux(clip.streams.video[0]) if p.size]


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def clip_frames(path: Path) -> list[Any]:
    with av.open(str(path)) as clip:
        return list(clip.decode(video=0))


class Done:
    def __init__(self) -> None:
        self.calls: list[tuple[int, Path | None, str | None]] = []

    def __call__(self, clip_id: int, path: Path | None, error: str | None) -> None:
        self.calls.append((clip_id, path, error))


def record_around(
    source: Source, directory: Path, clip_id: int, *, event_s: float, pre_s: float, until_s: float
) -> Done:
    """``source`` fed to a recorder (``pre_s`` before and after each event) up to just past
    ``event_s``, a clip asked for at ``event_s``, then fed on to ``until_s``."""
    done = Done()
    recorder = ClipRecorder("cam", ClipOptions(directory, pre_s=pre_s, post_s=pre_s), done)
    source.feed_until(recorder, event_s + 0.1)
    recorder.request(BASE + event_s, clip_id)
    source.feed_until(recorder, until_s)
    return done


@pytest.fixture
def car() -> Iterator[Source]:
    source = Source(CAR_CLIP)
    yield source
    source.close()


def test_a_clip_is_the_cameras_own_video_from_the_keyframe_before_to_after_its_events(
    tmp_path: Path, car: Source
) -> None:
    done = Done()
    options = ClipOptions(tmp_path, pre_s=5.0, post_s=3.0, max_s=60.0)
    recorder = ClipRecorder("cam", options, done)
    car.feed_until(recorder, 20.1)  # the event's frame decoded, then inferred: it comes late
    assert recorder.request(BASE + 20.0, 7) == 7
    car.feed_until(recorder, 21.5)
    assert recorder.request(BASE + 21.0, 8) == 7  # during the clip: it shares it, extended
    car.feed_until(recorder, 26.0)
    assert done.calls == [(7, tmp_path / "7.mp4", None)]
    # Bit for bit the camera's packets: from the keyframe at or before 20 - 5 s (14.4 s: the
    # clip has one every 4.8 s) through the first packet past 21 + 3 s.
    packets = clip_packets(tmp_path / "7.mp4")
    first = car.index_of(packets[0])
    assert car.packets[first].is_keyframe and car.at(first) == BASE + 14.4
    assert packets == [bytes(p) for p in car.packets[first : first + len(packets)]]
    assert car.at(first + len(packets) - 1) == pytest.approx(BASE + 24.08)
    frames = clip_frames(tmp_path / "7.mp4")
    assert len(frames) == len(packets) == 122
    assert frames[0].time == 0.0 and frames[-1].time == pytest.approx(121 / 12.5)
    assert not list(tmp_path.glob("*.part"))

    # An event after the clip ended has its own; the buffer still held its pre-roll.
    car.feed_until(recorder, 27.0)
    assert recorder.request(BASE + 26.5, 9) == 9
    car.feed_until(recorder, 30.0)
    assert done.calls[-1] == (9, tmp_path / "9.mp4", None)
    again = clip_packets(tmp_path / "9.mp4")
    assert car.at(car.index_of(again[0])) == BASE + 19.2  # keyframe at or before 21.5 s


def test_events_extend_a_clip_only_up_to_its_longest(tmp_path: Path, car: Source) -> None:
    done = Done()
    recorder = ClipRecorder("cam", ClipOptions(tmp_path, pre_s=1.0, post_s=2.0, max_s=6.0), done)
    ids = []
    for second in range(5, 20):  # an event every second
        car.feed_until(recorder, second + 0.1)
        ids.append(recorder.request(BASE + second, 100 + second))
    car.feed_until(recorder, 25.0)
    # The events of 5 to 10 s extend the first clip up to 6 s after the first (11 s); the
    # event of 11 s comes once it has ended and starts the next one, and so on.
    assert ids == [105] * 6 + [111] * 6 + [117] * 3
    assert [call[:2] for call in done.calls] == [
        (clip_id, tmp_path / f"{clip_id}.mp4") for clip_id in (105, 111, 117)
    ]
    for clip_id in (105, 111):
        frames = clip_frames(tmp_path / f"{clip_id}.mp4")
        start = 0.0 if clip_id == 105 else 9.6  # the keyframe at or before 1 s ahead of it
        assert frames[-1].time == pytest.approx(clip_id - 100 + 6 - start + 0.04)


def test_a_planned_recorder_writes_the_same_clips_as_one_asked_directly(
    tmp_path: Path, car: Source
) -> None:
    """A stream in a decode process: the server's planner decides each event's clip, the
    process's recorder takes the plan (``reserve``); same ids, same files as ``request``."""
    options = ClipOptions(tmp_path / "asked", pre_s=1.0, post_s=2.0, max_s=6.0)
    asked_done, planned_done = Done(), Done()
    asked = ClipRecorder("cam", options, asked_done)
    planned = ClipRecorder(
        "cam", ClipOptions(tmp_path / "planned", pre_s=1.0, post_s=2.0, max_s=6.0), planned_done
    )
    planner = ClipPlanner(options, planned.reserve)
    other = Source(CAR_CLIP)
    try:
        asked_ids, planned_ids = [], []
        for second in (*range(5, 20), 19.5):
            car.feed_until(asked, second + 0.1)
            other.feed_until(planned, second + 0.1)
            asked_ids.append(asked.request(BASE + second, 100 + round(second)))
            now = BASE + second + 0.1
            planned_ids.append(planner.request(BASE + second, 100 + round(second), now))
        car.feed_until(asked, 25.0)
        other.feed_until(planned, 25.0)
    finally:
        other.close()
    assert planned_ids == asked_ids == [105] * 6 + [111] * 6 + [117] * 4
    assert [c[0] for c in planned_done.calls] == [c[0] for c in asked_done.calls]
    for clip_id in (105, 111, 117):
        assert clip_packets(tmp_path / "planned" / f"{clip_id}.mp4") == clip_packets(
            tmp_path / "asked" / f"{clip_id}.mp4"
        )
    # A plan for a clip that has ended (the planner could not know yet) adds nothing.
    planned.reserve(105, BASE + 4, BASE + 30, BASE + 30, 999)
    assert [c[0] for c in planned_done.calls] == [105, 111, 117]


def test_a_lost_source_ends_the_clip_there_and_fails_one_not_begun(
    tmp_path: Path, car: Source
) -> None:
    done = Done()
    recorder = ClipRecorder("cam", ClipOptions(tmp_path, pre_s=1.0, post_s=5.0), done)
    car.feed_until(recorder, 10.0)
    recorder.request(BASE + 9.9, 1)
    car.feed_until(recorder, 11.0)
    recorder.source_closed("camera gone")  # 4 s early
    assert done.calls == [(1, tmp_path / "1.mp4", None)]
    assert len(clip_frames(tmp_path / "1.mp4")) == 78  # 4.8 s to 10.96 s, every 0.08 s

    # A new connection: no keyframe yet, so a clip cannot begin; the source drops again.
    fresh = Source(CAR_CLIP)
    try:
        recorder.packet(fresh.packets[1], fresh.stream, BASE + 50.0)  # not a keyframe
        recorder.request(BASE + 50.0, 2)
        recorder.packet(fresh.packets[2], fresh.stream, BASE + 50.1)
        recorder.source_closed("camera gone")
    finally:
        fresh.close()
    assert done.calls[-1][:2] == (2, None)
    assert "the source was lost before the clip began (camera gone)" in str(done.calls[-1][2])
    assert not list(tmp_path.glob("*.part"))


def test_a_clip_of_a_source_with_b_frames_plays_in_order(tmp_path: Path) -> None:
    """The bottle clip reorders frames (B-frames: dts before pts): the clip keeps both."""
    source = Source(BOTTLE_CLIP)
    try:
        done = record_around(source, tmp_path, 3, event_s=20.0, pre_s=2.0, until_s=23.0)
    finally:
        source.close()
    assert done.calls == [(3, tmp_path / "3.mp4", None)]
    frames = clip_frames(tmp_path / "3.mp4")
    times = [f.time for f in frames]
    assert times == sorted(times) and 0.0 < times[0] < 0.1  # the reordering delay: 2 frames
    # From the keyframe of 16.8 s (one every 250 frames at 29.8 fps) to 22 s.
    assert len(frames) == len(clip_packets(tmp_path / "3.mp4"))
    assert 5.0 <= times[-1] <= 5.4


def test_a_clip_of_an_h265_camera_is_its_own_h265(tmp_path: Path) -> None:
    """H.265 cameras' packets go into the clip as they are (no re-encoding), tagged ``hvc1``
    as Apple's players and Safari want, and decode back frame for frame."""
    hevc = tmp_path / "car-hevc.mp4"
    make_clip(CAR_CLIP, hevc, width=384, height=216, fps=25, gop=25, frames=60, codec="hevc")
    source = Source(hevc)
    try:
        done = record_around(source, tmp_path, 4, event_s=2.0, pre_s=1.0, until_s=4.0)
        packets = clip_packets(tmp_path / "4.mp4")
        first = source.index_of(packets[0])
        assert packets == [bytes(p) for p in source.packets[first : first + len(packets)]]
    finally:
        source.close()
    assert done.calls == [(4, tmp_path / "4.mp4", None)]
    assert source.at(first) == BASE + 1.0  # the keyframe at 1 s (one a second)
    with av.open(str(tmp_path / "4.mp4")) as clip:
        stream = clip.streams.video[0]
        assert (stream.codec_context.name, stream.codec_tag) == ("hevc", "hvc1")
    frames = clip_frames(tmp_path / "4.mp4")
    assert len(frames) == len(packets) >= 50  # 1 s to past 3 s at 25 fps
    assert (frames[0].width, frames[0].height) == (384, 216)


def test_the_oldest_clips_go_first_once_they_weigh_too_much(tmp_path: Path) -> None:
    for clip_id, size in ((30, 400), (10, 300), (20, 200)):
        (tmp_path / f"{clip_id}.mp4").write_bytes(b"x" * size)
        (tmp_path / f"{clip_id}.json").write_text(json.dumps({"id": clip_id, "stream_id": "s"}))
    (tmp_path / "notes.txt").write_bytes(b"x" * 5000)  # not a clip: never touched
    assert [c["id"] for c in list_clips(tmp_path, None, 10)] == [30, 20, 10]  # newest first
    assert [c["id"] for c in list_clips(tmp_path, "s", 2)] == [30, 20]
    assert list_clips(tmp_path, "other", 10) == []
    assert prune_clips(tmp_path, 650) == 600
    names = ["20.json", "20.mp4", "30.json", "30.mp4", "notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == names
    assert prune_clips(tmp_path, 100) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


async def test_the_index_waits_for_a_clip_being_written_and_says_why_one_is_missing(
    tmp_path: Path, car: Source
) -> None:
    outcomes: list[str] = []
    index = ClipIndex(ClipOptions(tmp_path, pre_s=1.0, post_s=1.0), outcomes.append)
    recorder = index.recorder("cam")
    car.feed_until(recorder, 5.1)
    clip_id = index.request(recorder, BASE + 5.0, 42)
    assert index.writing(42)
    # Still being written: find() waits for it (the decode thread finishes it meanwhile).
    feeding = asyncio.get_running_loop().run_in_executor(None, car.feed_until, recorder, 7.0)
    found = await index.find(clip_id, 10.0)
    await feeding
    assert found == tmp_path / "42.mp4" and outcomes == ["made"]
    assert not index.writing(42)

    assert await index.find(43, 0.1) == (
        "no clip 43: unknown, or deleted to keep clips under 2048 MB"
        " (setting STREAMDET_EVENT_CLIPS_MAX_MB), by a DELETE or for its age before the server"
        " last started, or not made then (its log says why)"
    )
    late = index.request(recorder, BASE + 40.0, 44)  # will never begin: the source goes
    recorder.source_closed("camera gone")
    why = await index.find(late, 5.0)
    assert isinstance(why, str) and why.startswith("clip 44 could not be made: the source")
    assert outcomes == ["made", "failed"]
    started = time.monotonic()
    never = index.request(index.recorder("other"), BASE, 45)
    assert await index.find(never, 0.2) == (
        "clip 45 is still being written (events keep extending it)"
    )
    assert time.monotonic() - started < 2.0


# ---- a real server and a real camera ----------------------------------------------------------


@pytest.mark.rtsp
@pytest.mark.parametrize("decode_processes", [0, 1], ids=["decode-threads", "decode-process"])
def test_a_camera_with_clips_on_serves_each_events_clip_and_snapshot_across_a_restart(
    tmp_path: Path, decode_processes: int
) -> None:
    from tests.rtsp_camera import RtspCamera

    camera = RtspCamera({"car": CAR_CLIP}).start()
    server = clip_server(
        tmp_path, event_clip_pre_s=1, event_clip_post_s=1, decode_processes=decode_processes
    )
    body = {"url": camera.url("car"), "max_fps": 8, "track": True, "clips": True, "lines": [GATE]}
    try:
        with server, httpx.Client(base_url=server.base_url, timeout=60) as c:
            resp = c.post("/streams", json=body)
            assert resp.status_code == 201, resp.text
            assert resp.json()["detect"]["clips"] is True
            sid = resp.json()["id"]
            crossing = wait_for_crossing(c)
            assert crossing["clip"].startswith("/clips/")
            started = time.monotonic()
            clip = c.get(crossing["clip"])  # answered once the second after it is recorded
            waited = time.monotonic() - started
            snapshot = c.get(crossing["snapshot"])
            assert snapshot.status_code == 200
            assert clip.status_code == 200, clip.text
            assert clip.headers["content-type"] == "video/mp4"
            head = c.head(crossing["clip"])  # players ask first (it was 405)
            assert head.status_code == 200 and head.headers["content-type"] == "video/mp4"
            assert int(head.headers["content-length"]) == len(clip.content) and not head.content
            part = c.get(crossing["clip"], headers={"Range": "bytes=0-99"})
            assert part.status_code == 206 and part.content == clip.content[:100]
            resp = c.patch(f"/streams/{sid}", json={"clips": False})
            assert resp.status_code == 200 and resp.json()["detect"]["clips"] is False
            metrics = c.get("/metrics").text
            missing = c.get("/clips/12345.mp4")
            assert missing.status_code == 404
            assert "STREAMDET_EVENT_CLIPS_MAX_MB" in missing.json()["detail"]
            assert c.get("/clips/abc.mp4").status_code == 422
        assert 'streamdet_event_clips_total{outcome="made"}' in metrics
        path = tmp_path / "clip.mp4"
        path.write_bytes(clip.content)
        frames = clip_frames(path)
        # The camera sends 12.5 fps with a keyframe every 4.8 s: from the keyframe at or before
        # 1 s ahead of the crossing to 1 s after it; the RTSP source's first packet has no
        # timestamp, the clip has them all.
        seconds = len(frames) / 12.5
        assert 2.0 <= seconds <= 1 + 4.8 + 1 + 0.5, seconds
        times = [f.time for f in frames]
        assert times == sorted(times) and times[0] == 0.0
        assert frames[0].width == 768 and frames[0].height == 432
        assert waited < 1 + 10

        # After a restart the event still names its clip, and the clip is still there.
        with server, httpx.Client(base_url=server.base_url, timeout=60) as c:
            events = c.get("/events", params={"limit": 1000}).json()["events"]
            assert crossing in events
            assert c.get(crossing["clip"]).content == clip.content
            assert c.get(crossing["snapshot"]).content == snapshot.content
            c.delete(f"/streams/{sid}")
    finally:
        camera.kill()


def wait_for_crossing(c: httpx.Client, timeout_s: float = 90.0) -> dict[str, Any]:
    cursor, deadline = 0, time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        page = c.get("/events", params={"after": cursor, "wait_s": 5}).json()
        for event in page["events"]:
            if event["type"] == "line_crossing":
                return dict(event)
        cursor = page["next"]
    raise AssertionError("no line crossing within the time given")


@pytest.mark.parametrize("decode_processes", [0, 1], ids=["decode-threads", "decode-process"])
def test_an_event_created_from_outside_gets_the_latest_frame_and_the_video_around_it(
    tmp_path: Path, decode_processes: int
) -> None:
    """With a decode process the clip is written there, planned here."""
    server = clip_server(
        tmp_path, event_clip_pre_s=1, event_clip_post_s=2, decode_processes=decode_processes
    )
    body = {"url": f"file://{CAR_CLIP}", "max_fps": 5, "clips": True}
    with server, httpx.Client(base_url=server.base_url, timeout=60) as c:
        sid = c.post("/streams", json=body).json()["id"]
        plain = c.post("/streams", json={**body, "clips": False}).json()["id"]
        deadline = time.monotonic() + 60
        while c.get(f"/streams/{sid}/latest.jpg").status_code != 200:
            assert time.monotonic() < deadline, "the stream never had a frame"
            time.sleep(0.2)
        time.sleep(1.5)  # a second of video kept before the event
        created = c.post(
            f"/streams/{sid}/events", json={"label": "doorbell", "data": {"button": 1}}
        )
        assert created.status_code == 201, created.text
        event = created.json()
        assert event["type"] == "manual" and event["label"] == "doorbell"
        assert event["data"] == {"button": 1} and event["stream_id"] == sid
        assert event["frame"] > 0 and abs(event["captured_at"] - time.time()) < 5
        assert event["clip"] == f"/clips/{event['id']}.mp4"
        listed = c.get("/events", params={"type": "manual"}).json()["events"]
        assert listed == [event]
        snapshot = c.get(event["snapshot"])
        assert snapshot.status_code == 200 and snapshot.headers["content-type"] == "image/jpeg"
        clip = c.get(event["clip"])
        assert clip.status_code == 200, clip.text
        # Listed with what it shows, then deleted.
        [listed_clip] = c.get("/clips", params={"stream_id": sid}).json()["clips"]
        assert listed_clip["id"] == event["id"] and listed_clip["events"] == [event["id"]]
        assert listed_clip["bytes"] == len(clip.content) and listed_clip["stream_id"] == sid
        assert listed_clip["url"] == event["clip"] and listed_clip["duration_s"] > 2.5
        assert abs(listed_clip["started_at"] - event["captured_at"]) < 7
        assert c.get("/clips", params={"stream_id": plain}).json()["clips"] == []
        manual = {"type": "manual", "stream_id": sid}
        with_clip = c.get("/events", params={**manual, "has_clip": True}).json()["events"]
        assert [e["id"] for e in with_clip] == [event["id"]]
        assert c.delete(event["clip"]).status_code == 204
        # The event no longer names it, nor passes has_clip=true (it did: each link a 404).
        assert c.get("/events", params={**manual, "has_clip": True}).json()["events"] == []
        [without] = c.get("/events", params={**manual, "has_clip": False}).json()["events"]
        assert without["id"] == event["id"] and "clip" not in without and "snapshot" in without
        gone = c.get(event["clip"])  # it blamed the size limit
        assert gone.status_code == 404 and "it was deleted (DELETE" in gone.text, gone.text
        assert c.delete(event["clip"]).status_code == 404
        assert c.get("/clips").json()["clips"] == []
        # Without a clip: asked not to, or on a stream that keeps none (409 when asked to).
        quiet = c.post(f"/streams/{sid}/events", json={"label": "x", "clip": False}).json()
        assert "clip" not in quiet and "snapshot" in quiet
        assert "clip" not in c.post(f"/streams/{plain}/events", json={"label": "x"}).json()
        refused = c.post(f"/streams/{plain}/events", json={"label": "x", "clip": True})
        assert refused.status_code == 409 and '{"clips": true}' in refused.json()["detail"]
        for bad, field in (
            ({"label": ""}, "label"),
            ({"label": "x", "colour": "red"}, "colour"),
            ({"label": "x", "data": {"blob": "y" * 5000}}, "4096 bytes"),
            ({"label": "x", "data": [1, 2]}, "data"),
        ):
            resp = c.post(f"/streams/{sid}/events", json=bad)
            assert resp.status_code == 422 and field in resp.text, resp.text
        assert c.post("/streams/nope/events", json={"label": "x"}).status_code == 404
        # Switched off: no video comes to clip (asked for, it was dropped without a word),
        # and the event is at its last frame (it said frame 0).
        assert c.patch(f"/streams/{sid}", json={"enabled": False}).status_code == 200
        off = c.post(f"/streams/{sid}/events", json={"label": "x", "clip": True})
        assert off.status_code == 409 and "is disabled: no video comes" in off.text, off.text
        later = c.post(f"/streams/{sid}/events", json={"label": "x"})
        assert later.status_code == 201 and "clip" not in later.json(), later.text
        assert later.json()["frame"] >= event["frame"] > 0, later.text
    path = tmp_path / "manual.mp4"
    path.write_bytes(clip.content)
    seconds = len(clip_frames(path)) / 12.5
    # From the keyframe at or before 1 s ahead of it (one every 4.8 s) to 2 s after.
    assert 3.0 - 0.3 <= seconds <= 1 + 4.8 + 2 + 0.3, seconds


# ---- clips that end early, fail late, or outlive a restart ----------------------------------


class Frames:
    """A decode process's frame sink that keeps nothing, only counts."""

    def __init__(self) -> None:
        self.count = 0
        self.arrived = threading.Condition()

    def __call__(self, stream_id: str, item: WorkItem) -> WorkItem | None:
        with self.arrived:
            self.count += 1
            self.arrived.notify_all()
        return None

    def wait_for(self, n: int, timeout_s: float = 60.0) -> None:
        with self.arrived:
            assert self.arrived.wait_for(lambda: self.count >= n, timeout_s), self.count


async def test_with_a_decode_process_an_event_after_a_clip_ended_early_gets_a_new_clip(
    tmp_path: Path,
) -> None:
    """The process's recorder ends a clip before its planned end (here clips are turned off;
    a source lost or reopened, a file that loops do the same): the server's planner hears of
    it, so the next event starts its own clip. It used to get the ended clip's id, a clip
    the server then waited for forever (503, 409 on delete, never pruned)."""
    options = ClipOptions(tmp_path / "clips", pre_s=1.0, post_s=60.0, max_s=60.0)
    index = ClipIndex(options)
    hub = DecodeHub(1, ReaderOptions(open_timeout_s=5, read_timeout_s=5), 8, options)
    frames = Frames()
    config = StreamConfig("cam", parse_source(f"file://{CAR_CLIP}", CAR_CLIP.parent))
    reader = hub.reader(config, frames, lambda frame: None, on_clip_done=index.done_threadsafe)
    reader.detect = StreamDetect(clips=True)
    planner = reader.clip_requests
    assert isinstance(planner, ClipPlanner)
    try:
        reader.start()
        await asyncio.to_thread(frames.wait_for, 15)
        assert index.request(planner, time.monotonic(), 7) == 7  # planned for 60 s
        await asyncio.sleep(0.5)
        reader.detect = StreamDetect(clips=False)  # the recorder ends it now
        assert await index.find(7, 10.0) == options.path(7)
        reader.detect = StreamDetect(clips=True)
        await asyncio.to_thread(frames.wait_for, frames.count + 15)
        assert index.request(planner, time.monotonic(), 8) == 8  # its own clip
        assert planner.request(time.monotonic(), 9) == 8  # the planner knows (no index)
        await asyncio.sleep(0.5)
    finally:
        await asyncio.to_thread(hub.shutdown, 10.0)  # the source closes: clip 8 ends there
    # Written, or failed where no keyframe came after clips were on again: not waited for.
    eight = await index.find(8, 10.0)
    assert eight == options.path(8) or "before the clip began" in str(eight), eight
    assert not index.writing(8)
    assert await index.find(7, 0.1) == options.path(7)  # not "still being written"
    assert await index.delete(7) is None  # not "being written" (409)


async def test_the_index_never_waits_on_a_clip_it_saw_end(tmp_path: Path, car: Source) -> None:
    """A planner that has not heard yet that its recorder ended a clip names it again: the
    index starts the event's own clip instead of waiting for one that nothing will finish."""
    # Planned to last for ever: the planner counts it as ended only once the recorder says.
    index = ClipIndex(ClipOptions(tmp_path, pre_s=1.0, post_s=1e12, max_s=1e12))
    recorder = index.recorder("cam")
    planner = ClipPlanner(index.options, recorder.reserve)
    car.feed_until(recorder, 5.1)
    assert index.request(planner, BASE + 5.0, 42) == 42
    car.feed_until(recorder, 6.0)
    recorder.source_closed("the file looped")  # ended early; the planner is not told
    assert await index.find(42, 5.0) == tmp_path / "42.mp4"
    fresh = Source(CAR_CLIP)
    try:
        fresh.feed_until(recorder, 2.1)
        assert index.request(planner, BASE + 2.0, 43) == 43
        assert not index.writing(42)
        assert await index.delete(42) is None
        fresh.feed_until(recorder, 3.0)
        recorder.source_closed("camera gone")
    finally:
        fresh.close()
    assert await index.find(43, 5.0) == tmp_path / "43.mp4"


async def test_a_clip_that_cannot_be_saved_fails_saying_where_and_leaves_nothing(
    tmp_path: Path, car: Source
) -> None:
    """Saving a closed clip fails (a full disk, an I/O error; here a folder in the way of
    its sidecar): the clip fails with the path, counted, and no ``.part`` is left. It used
    to stay "being written" for ever (503, 409 on delete) with its ``.mp4.part`` on disk."""
    outcomes: list[str] = []
    index = ClipIndex(ClipOptions(tmp_path, pre_s=1.0, post_s=1.0), outcomes.append)
    recorder = index.recorder("cam")
    (tmp_path / "42.json.part").mkdir()
    car.feed_until(recorder, 5.1)
    assert index.request(recorder, BASE + 5.0, 42) == 42
    car.feed_until(recorder, 7.0)
    why = await index.find(42, 5.0)
    assert isinstance(why, str) and why.startswith("clip 42 could not be made: saving it as")
    assert str(tmp_path / "42.mp4") in why and "STREAMDET_DATA_DIR" in why
    assert outcomes == ["failed"] and not index.writing(42)
    assert await index.delete(42) == "no clip 42"
    assert names(tmp_path) == ["42.json.part"]  # the folder in the way only


def test_a_restart_deletes_unfinished_clips_and_applies_a_lower_size_cap(tmp_path: Path) -> None:
    """A crash mid-clip leaves ``<id>.mp4.part`` (and maybe its sidecar's part): nothing
    lists or prunes those, so the next start deletes them. A lower
    ``--event-clips-max-mb`` applies at start too, not only once a new clip is written."""
    mb = 1024 * 1024
    for clip_id in (10, 20, 30):
        (tmp_path / f"{clip_id}.mp4").write_bytes(b"x" * mb)
        (tmp_path / f"{clip_id}.json").write_text(json.dumps({"id": clip_id, "stream_id": "s"}))
    (tmp_path / "40.mp4.part").write_bytes(b"x" * 100)
    (tmp_path / "40.json.part").write_text("{}")
    ClipIndex(ClipOptions(tmp_path, max_bytes=2 * mb))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["20.json", "20.mp4", "30.json", "30.mp4"]


def test_a_clip_lasts_at_most_its_longest_even_when_that_is_below_the_seconds_after(
    tmp_path: Path, car: Source
) -> None:
    """``max_s`` below ``post_s``: the clip ends ``max_s`` after its event, as the setting
    promises (it used to run ``post_s``)."""
    done = Done()
    options = ClipOptions(tmp_path, pre_s=1.0, post_s=8.0, max_s=2.0)
    recorder = ClipRecorder("cam", options, done)
    car.feed_until(recorder, 10.1)
    assert recorder.request(BASE + 10.0, 5) == 5
    car.feed_until(recorder, 20.0)
    assert done.calls == [(5, tmp_path / "5.mp4", None)]
    frames = clip_frames(tmp_path / "5.mp4")
    # From the keyframe of 4.8 s (at or before 9 s) to the first packet past 12 s (not 18 s).
    assert frames[-1].time == pytest.approx(12.08 - 4.8)
    planned: list[tuple[float, ...]] = []
    planner = ClipPlanner(options, lambda *plan: planned.append(plan))
    planner.request(BASE + 10.0, 6, BASE + 10.1)
    assert planned == [(6, BASE + 9.0, BASE + 12.0, BASE + 12.0, 6)]


async def test_after_a_crash_a_clip_cut_short_says_so_and_no_description_is_left_alone(
    tmp_path: Path,
) -> None:
    """A crash mid-clip: its ``.mp4.part`` is deleted at the next start, and ``GET
    /clips/{id}.mp4`` said "unknown, or deleted to keep clips under 2048 MB": it says the
    server stopped while recording it. A crash between a clip's sidecar and its rename left
    the sidecar alone (nothing deleted it): the clip, whole, is put in place; a sidecar
    without any clip (a crash mid-DELETE) is deleted."""
    (tmp_path / "7.mp4.part").write_bytes(b"x" * 100)  # cut short
    (tmp_path / "8.json").write_text(json.dumps({"id": 8, "stream_id": "s", "bytes": 10}))
    (tmp_path / "9.mp4.part").write_bytes(b"x" * 300)  # closed, described, not renamed
    (tmp_path / "9.json").write_text(json.dumps({"id": 9, "stream_id": "s", "bytes": 300}))
    (tmp_path / "10.mp4.part").write_bytes(b"x" * 50)  # not the size its sidecar says
    (tmp_path / "10.json").write_text(json.dumps({"id": 10, "stream_id": "s", "bytes": 300}))
    (tmp_path / "notes.json").write_text("{}")  # not a clip's: left alone
    index = ClipIndex(ClipOptions(tmp_path))
    assert names(tmp_path) == ["9.json", "9.mp4", "notes.json"]
    assert [c["id"] for c in list_clips(tmp_path, None, 10)] == [9]
    for clip_id in (7, 10):
        assert await index.find(clip_id, 0.1) == (
            f"clip {clip_id} could not be made: the server stopped while it was being recorded"
        )
    assert await index.find(9, 0.1) == tmp_path / "9.mp4"
    assert "unknown" in str(await index.find(8, 0.1))  # described, but never a clip


@pytest.fixture(scope="module")
def untimed_h265_camera(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """An H.265 camera with no timing in its SPS stating no frame rate (no a=framerate):
    FFmpeg knows no rate but its 90 kHz clock's (``guessed_rate`` 90000), and the first
    packet it hands out has no timestamp."""
    from tests.rtsp_camera import RtspCamera, camera_clip

    clip = camera_clip(
        tmp_path_factory.mktemp("untimed") / "h265.mp4",
        "libx265",
        frames=25,
        options={"x265-params": "vui-timing-info=0:hrd=0:keyint=25:bframes=0:log-level=error"},
    )
    camera = RtspCamera({"cam": clip}, rate=False).start()
    yield camera.url("cam")
    camera.stop()


@pytest.mark.rtsp
@pytest.mark.parametrize(
    ("arrival_s", "first_s"),
    [(0.04, 0.04), (0.1, 0.1), (0.0, 0.04)],
    ids=["arriving-at-25-fps", "arriving-at-10-fps", "arriving-at-once"],
)
def test_a_clip_beginning_untimed_takes_no_absurd_rate_for_its_first_frame(
    tmp_path: Path, untimed_h265_camera: str, arrival_s: float, first_s: float
) -> None:
    """A clip that begins with its source's first packets (none timed but one) times the
    untimed one a frame before the next: that frame's length came from ``average_rate or
    guessed_rate``, for this camera 90000 fps, so the clip's first frame lasted one tick of
    90 kHz (a player skips it). A rate outside 0.1-120 fps is now unknown: the frame lasts
    one interval of the packets' arrival, or of 25 fps where they came at once."""
    url = untimed_h265_camera
    done = Done()
    recorder = ClipRecorder("cam", ClipOptions(tmp_path, pre_s=0.0, post_s=60.0), done)
    with av.open(url, options=open_options(parse_source(url, None)), timeout=(10, 10)) as camera:
        stream = camera.streams.video[0]
        assert stream.average_rate is None and stream.guessed_rate == 90000  # as described
        for index, packet in enumerate(camera.demux(stream)):
            if index == 0:
                assert packet.pts is None  # as described
            recorder.packet(packet, stream, BASE + index * arrival_s)
            if index == 0:  # the clip begins at the next packet: the first two its own
                recorder.request(BASE, 1)
            if index == 30:
                break
        recorder.source_closed("the test is done")  # the clip ends there
    assert done.calls == [(1, tmp_path / "1.mp4", None)], done.calls
    frames = clip_frames(tmp_path / "1.mp4")
    times = [f.time for f in frames]
    assert times[0] == 0.0 and times[1] == pytest.approx(first_s, abs=0.002), times[:4]
    assert [b - a for a, b in itertools.pairwise(times[1:])] == pytest.approx(
        [0.04] * (len(times) - 2), abs=0.002
    )


async def test_clips_gone_are_gone_for_the_events_that_named_them(tmp_path: Path) -> None:
    """Clips go oldest first (``--event-clips-max-mb``, their age), by a DELETE, or fail: an
    event of a clip that is not on disk (nor being written) no longer claims one
    (``has_clip``, its link), before a restart too (those deleted or failed then were
    claimed again after it: they were known only to the run they happened in)."""
    from streams.events import EventFilter, has_clip

    directory = tmp_path / "clips"
    directory.mkdir()
    index = ClipIndex(ClipOptions(directory))
    assert await index.presence() == frozenset()  # none: every clip named went
    for clip_id in (5, 9):
        (directory / f"{clip_id}.mp4").write_bytes(b"\x00" * 10)
    wanted = EventFilter(has_clip=True, clips_present=await index.presence(), clips_new_from=20)
    named = [{"id": i, "clip": f"/clips/{i}.mp4"} for i in (3, 5, 7, 9, 11, 20)]
    # 3: pruned; 7: deleted or failed in an earlier run; 11: not made; 20: of an event logged
    # since the clips were looked at (a long poll's)
    claimed = [has_clip(event, wanted) for event in named]
    assert claimed == [False, True, False, True, False, True]
    assert not has_clip({"id": 1}, wanted)
    assert has_clip(named[0], EventFilter())  # no clip index: as logged


def test_a_damaged_clip_description_is_not_listed_and_is_named_in_the_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A description that was [1, 2] was listed as a clip, and broke GET /clips?stream_id=
    (500); one cut short vanished from the list without a word."""
    for clip_id, text in ((1, json.dumps({"id": 1, "stream_id": "s"})), (2, "[1, 2]"), (3, "{cut")):
        (tmp_path / f"{clip_id}.mp4").write_bytes(b"x")
        (tmp_path / f"{clip_id}.json").write_text(text)
    assert [c["id"] for c in list_clips(tmp_path, None, 10)] == [1]
    assert [c["id"] for c in list_clips(tmp_path, "s", 10)] == [1]
    said = [r.getMessage() for r in caplog.records if "is not listed" in r.getMessage()]
    assert len(said) == 2 and str(tmp_path / "2.json") in said[1], said  # once each
