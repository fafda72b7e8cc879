"""Stream ingest without a camera: URL rules, backoff, the store, fan-out, and a file source
through the real engine pool."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import random
import re
import shutil
import sqlite3
import threading
import time
from collections.abc import AsyncIterator
from contextlib import closing
from fractions import Fraction
from pathlib import Path
from typing import Any

import av
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.make_clip import make_clip
from engines.batching import WorkItem, WorkResult
from engines.nvdec import nvdec_unavailable
from engines.pool import EnginePool
from engines.types import Detections, DetectParams
from loadtest.server import free_port
from server.metrics import Metrics
from server.routes.streams import metric_samples
from streams.detect import Roi, StreamDetect
from streams.events import EventFilter
from streams.fanout import MAX_CARRIED, Closed, ProcessedFrame, StateMessage, Subscriber
from streams.frames import keyframes_suffice
from streams.jobs import JobError, probe
from streams.lines import Crossing
from streams.manager import (
    ManagerOptions,
    StreamExistsError,
    StreamLimitError,
    StreamManager,
)
from streams.outbox import OUTBOX_PER_STREAM, Outbox
from streams.pacing import FilePacer, RateSampler, frame_interval
from streams.reader import (
    FILE_ENDED,
    RateMeter,
    ReaderOptions,
    StreamConfig,
    StreamReader,
    StreamState,
)
from streams.sources import (
    FILE_FORMAT_REFUSED,
    SourceError,
    backoff_delay,
    check_unmoved,
    open_options,
    parse_source,
    redact,
    redact_in,
    upload_options,
)
from streams.store import StreamStore, new_record
from tests.helpers import (
    BOTTLE_CLIP,
    CAR_CLIP,
    MESSAGE_KEYS,
    VIDEOS,
    SnapshotCamera,
    detect_json,
    eventually,
    next_frame,
    numbered,
    published_frames,
    silent_camera,
    turned_video,
    ultralytics_assets,
)
from tests.helpers import file_manager as started_file_manager

# ---- URL rules ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "rtsp://127.0.0.1:8554/cam0",
        "rtsps://camera.local/stream",
        "rtsp://user:secret@10.0.0.5/h264",
        "http://camera.local/mjpeg",
        "https://example.com/live/index.m3u8",
    ],
)
def test_network_sources_are_accepted(url: str) -> None:
    spec = parse_source(url, None)
    assert spec.target == url
    assert not spec.is_file


def test_a_scheme_in_capitals_reaches_ffmpeg_in_small_letters() -> None:
    """``HTTP://`` is ``http://`` (RFC 3986); FFmpeg knows only the latter ("Protocol not
    found" after the URL was accepted)."""
    spec = parse_source("HTTP://Camera.local/Clip.mp4", None)
    assert spec.target == "http://Camera.local/Clip.mp4"
    assert parse_source("Rtsp://cam/Live", None).target == "rtsp://cam/Live"


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("ftp://host/clip.mp4", "scheme 'ftp' is not allowed"),
        ("javascript:alert(1)", "scheme 'javascript' is not allowed"),
        ("/etc/passwd", r"scheme '\(none\)' is not allowed"),
        ("rtsp:///no-host", "has no host"),
        ("rtsp://host:99999/x", "malformed url"),
        ("rtsp://host/a b", "spaces"),
        ("", "1..2048"),
    ],
)
def test_bad_urls_are_refused_with_the_reason(url: str, expected: str) -> None:
    with pytest.raises(SourceError, match=expected):
        parse_source(url, None)


def test_file_sources_only_under_the_allowed_dir(tmp_path: Path) -> None:
    allowed = tmp_path / "clips"
    allowed.mkdir()
    clip = allowed / "a.mp4"
    clip.write_bytes(b"not really a video")
    (allowed / "escape.mp4").symlink_to("/etc/passwd")
    assert parse_source(f"file://{clip}", allowed).path == clip.resolve()
    with pytest.raises(SourceError, match="STREAMDET_ALLOWED_FILE_DIR"):
        parse_source(f"file://{clip}", None)  # file sources off by default
    with pytest.raises(SourceError, match="outside the allowed directory"):
        parse_source("file:///etc/passwd", allowed)
    with pytest.raises(SourceError, match="outside the allowed directory"):
        parse_source(f"file://{allowed}/../../etc/passwd", allowed)
    with pytest.raises(SourceError, match="outside the allowed directory"):
        parse_source(f"file://{allowed}/escape.mp4", allowed)  # a symlink out
    with pytest.raises(SourceError, match="does not exist"):
        parse_source(f"file://{allowed}/missing.mp4", allowed)
    (allowed / "cam1").mkdir()
    with pytest.raises(SourceError, match="is a directory, not a video file"):
        parse_source(f"file://{allowed}/cam1", allowed)  # it said "does not exist"
    assert parse_source("http://cam/clip.mp4", None, loop=True).loop  # a recording may loop
    assert not parse_source("rtsp://cam/live", None, loop=True).loop  # a camera does not end
    with pytest.raises(SourceError, match="must be local"):
        parse_source(f"file://otherhost{clip}", allowed)
    with pytest.raises(SourceError, match="NUL"):
        parse_source(f"file://{clip}%00.txt", allowed)  # Path.resolve's ValueError: a 500
    (allowed / "list.m3u8").write_text("#EXTM3U\n")
    with pytest.raises(SourceError, match="playlist"):
        parse_source(f"file://{allowed}/list.m3u8", allowed)


@pytest.mark.parametrize("decode_processes", [0, 1], ids=["decode-thread", "decode-process"])
async def test_a_list_of_files_under_the_allowed_dir_reaches_no_video_outside_it(
    pool: EnginePool, tmp_path: Path, decode_processes: int
) -> None:
    """A file FFmpeg reads other files from (a concat list, named like a video) under the
    allowed directory played a video from anywhere on the disk through a link beside it (the
    list's own path is the only one checked), as a stream and as a job; uploaded lists and
    playlists were read too. Only demuxers of one file read local files now."""
    secret = tmp_path / "private" / "secret.ts"
    secret.parent.mkdir()
    make_clip(CAR_CLIP, secret, width=384, height=216, fps=25, gop=25, frames=25)
    allowed = tmp_path / "videos"
    allowed.mkdir()
    (allowed / "link.ts").symlink_to(secret)
    listed = allowed / "evil.mp4"
    listed.write_text("ffconcat version 1.0\nfile link.ts\n")
    with av.open(str(listed), options={"protocol_whitelist": "file"}) as container:
        assert container.format.name == "concat"  # what it did: the secret's frames
        assert next(container.decode(video=0)).width == 384
    spec = parse_source(f"file://{listed}", allowed, loop=False)
    for options in (open_options(spec), upload_options()):
        with pytest.raises(JobError, match=re.escape(FILE_FORMAT_REFUSED)):
            probe(str(listed), options)
    async with started_file_manager(
        pool, tmp_path / "data", allowed_dir=allowed, decode_processes=decode_processes
    ) as m:
        info = await m.add(f"file://{listed}", loop=False)
        deadline = time.monotonic() + 30
        while not (stats := m.describe(info["id"]) or {}).get("last_error"):
            assert time.monotonic() < deadline, stats
            await asyncio.sleep(0.1)
    assert FILE_FORMAT_REFUSED in stats["last_error"], stats
    assert stats["frames_in"] == 0


@pytest.mark.parametrize("decode_processes", [0, 1], ids=["decode-thread", "decode-process"])
async def test_a_video_its_container_turns_is_streamed_as_players_show_it(
    pool: EnginePool, tmp_path: Path, decode_processes: int
) -> None:
    """A phone's recording (landscape frames, a display matrix turning them a quarter): the
    stream's frames, size and boxes are the upright picture's, as a job's are."""
    allowed = tmp_path / "videos"
    allowed.mkdir()
    image = np.zeros((96, 160, 3), np.uint8)
    image[:24, :24] = 255  # top left, stored: top right, shown
    video = turned_video(allowed / "phone.mp4", image, frames=20)
    async with started_file_manager(
        pool, tmp_path / "data", allowed_dir=allowed, decode_processes=decode_processes
    ) as m:
        info = await m.add(f"file://{video}")
        (frame,) = await published_frames(m, info["id"], 1)
    assert frame.image.shape == (160, 96, 3)
    assert frame.image[:24, -24:].mean() > 200 and frame.image[:24, :24].mean() < 50
    assert (frame.detections.width, frame.detections.height) == (96, 160)


@pytest.mark.parametrize("decode_processes", [0, 1], ids=["decode-thread", "decode-process"])
async def test_a_file_that_is_no_video_fails_its_stream_at_once(
    pool: EnginePool, tmp_path: Path, decode_processes: int
) -> None:
    """A text file under the allowed directory: the stream fails saying why (it reconnected
    for ever, "reconnecting" with FFmpeg's InvalidDataError)."""
    allowed = tmp_path / "videos"
    allowed.mkdir()
    notes = allowed / "notes.mp4"
    notes.write_text("not a video\n" * 100)
    async with started_file_manager(
        pool, tmp_path / "data", allowed_dir=allowed, decode_processes=decode_processes
    ) as m:
        info = await m.add(f"file://{notes}")
        assert await m.wait_state(info["id"], {StreamState.FAILED}, 30)
        stats = m.describe(info["id"])
        assert stats is not None and "Invalid data" in stats["last_error"], stats
        assert stats["reconnects"] == 0 and stats["frames_in"] == 0


@pytest.mark.parametrize("decode_processes", [0, 1], ids=["decode-thread", "decode-process"])
@pytest.mark.parametrize("loop", [False, True])
async def test_a_file_whose_frames_do_not_decode_fails_its_stream(
    pool: EnginePool, tmp_path: Path, decode_processes: int, loop: bool
) -> None:
    """The car clip with its header whole and its frames' bytes zeroed: it opens, then ends
    without a frame. It was reopened as a lost camera is, "reconnecting" with "source ended",
    for ever (``loop`` false too); it fails, saying that no frame decodes."""
    allowed = tmp_path / "videos"
    allowed.mkdir()
    data = bytearray(CAR_CLIP.read_bytes())
    media = data.index(b"mdat") + 4
    data[media:] = bytes(len(data) - media)
    zeroed = allowed / "zeroed.mp4"
    zeroed.write_bytes(bytes(data))
    async with started_file_manager(
        pool, tmp_path / "data", allowed_dir=allowed, decode_processes=decode_processes
    ) as m:
        info = await m.add(f"file://{zeroed}", loop=loop)
        assert await m.wait_state(info["id"], {StreamState.FAILED}, 30), m.describe(info["id"])
        stats = m.describe(info["id"])
        assert stats is not None and "not one frame of its video decodes" in stats["last_error"]
        assert stats["reconnects"] == 0 and stats["frames_processed"] == 0, stats


@pytest.mark.parametrize("decode_processes", [0, 1], ids=["decode-thread", "decode-process"])
async def test_a_directory_swapped_for_a_link_out_after_the_check_is_not_played(
    pool: EnginePool, tmp_path: Path, decode_processes: int
) -> None:
    """A looping file checked when added, then its directory swapped for a link to one
    outside: its next loop played the file outside (it was checked once, then reopened by
    path at each loop and reconnect). Now it fails, saying so; a job queued alike fails."""
    allowed, outside = tmp_path / "videos", tmp_path / "private"
    (allowed / "sub").mkdir(parents=True)
    outside.mkdir()
    make_clip(CAR_CLIP, allowed / "sub" / "a.mp4", width=320, height=240, fps=25, gop=25, frames=10)
    make_clip(CAR_CLIP, outside / "a.mp4", width=384, height=216, fps=25, gop=25, frames=10)
    checked = parse_source(f"file://{allowed}/sub/a.mp4", allowed)
    assert checked.path is not None
    check_unmoved(checked.path)
    async with started_file_manager(
        pool, tmp_path / "data", allowed_dir=allowed, decode_processes=decode_processes
    ) as m:
        info = await m.add(f"file://{allowed}/sub/a.mp4", loop=True)
        [frame] = await published_frames(m, info["id"], 1)
        assert frame.image.shape[:2] == (240, 320)
        (allowed / "sub").rename(allowed / "old")
        (allowed / "sub").symlink_to(outside)
        with pytest.raises(SourceError, match="a link now stands on its path"):
            check_unmoved(checked.path)
        deadline = time.monotonic() + 30
        while (stats := m.describe(info["id"]) or {}).get("state") != "failed":
            assert time.monotonic() < deadline, stats
            await asyncio.sleep(0.1)
        assert "a link now stands on its path" in stats["last_error"], stats
        latest = m.latest(info["id"])
        assert latest is None or latest.image.shape[:2] == (240, 320)  # never the one outside


@pytest.mark.parametrize("decode_processes", [0, 1], ids=["decode-thread", "decode-process"])
async def test_every_frame_taken_in_is_counted_once_across_disables_and_new_sources(
    pool: EnginePool, tmp_path: Path, decode_processes: int
) -> None:
    """Frames in flight when a stream is disabled or given a new source ended in the old
    reader's counters, thrown away, and its frame waiting for the engine in none: after 8
    disables 16 frames of frames_in were in no counter, for good."""
    async with started_file_manager(
        pool, tmp_path / "data", decode_processes=decode_processes
    ) as m:
        info = await m.add(f"file://{CAR_CLIP}", loop=True)
        sid = info["id"]
        for n in range(8):
            await published_frames(m, sid, 2)
            if n % 2:
                await m.update(sid, {"enabled": False})
                await m.update(sid, {"enabled": True})
            else:  # a new source (the other clip, then back)
                clip = BOTTLE_CLIP if n % 4 == 0 else CAR_CLIP
                await m.put(sid, f"file://{clip}", detect=StreamDetect())
        await published_frames(m, sid, 2)
        await m.update(sid, {"enabled": False})
        deadline = time.monotonic() + 20
        while True:  # what was in flight ends
            stats = m.describe(sid) or {}
            ended = sum(
                stats[k]
                for k in ("frames_processed", "drops", "skipped", "motion_skipped", "frames_failed")
            )
            if ended == stats["frames_in"] or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        assert stats["frames_in"] >= 18 and ended == stats["frames_in"], stats


async def test_a_stream_added_disabled_or_failing_at_its_start_says_so_on_every_channel(
    pool: EnginePool, tmp_path: Path
) -> None:
    """A stream added disabled, or whose file is gone when the server starts again, logged no
    state event: no webhook, MQTT state or ``?states=true`` viewer heard of it (MQTT's state
    topic kept "live")."""
    allowed = tmp_path / "videos"
    allowed.mkdir()
    shutil.copy(CAR_CLIP, allowed / "c.mp4")
    states = EventFilter(types=frozenset({"stream_state"}))
    async with started_file_manager(pool, tmp_path / "data", allowed_dir=allowed) as m:
        off = await m.add(f"file://{allowed}/c.mp4", enabled=False, stream_id="off")
        assert off["state"] == "disabled"
        on = await m.add(f"file://{allowed}/c.mp4", stream_id="on")
        await published_frames(m, on["id"], 1)
        changes = [
            (e["stream_id"], e["previous"], e["state"]) for e in m.events.read(0, 9, states).events
        ]
        assert ("off", "connecting", "disabled") in changes, changes
        late = m.subscribe("off", {"states": "true"})
        assert late is not None and late.qsize() == 1  # told why no frames come
    (allowed / "c.mp4").unlink()
    async with started_file_manager(pool, tmp_path / "data", allowed_dir=allowed) as m:
        stats = m.describe("on") or {}
        assert stats["state"] == "failed" and "does not exist" in stats["last_error"], stats
        [failed] = [e for e in m.events.read(0, 9, states).events if e["stream_id"] == "on"]
        assert (failed["state"], failed["error"]) == ("failed", stats["last_error"]), failed
        assert (m.describe("off") or {})["state"] == "disabled"  # no event at each start
        assert all(e["stream_id"] != "off" for e in m.events.read(0, 9, states).events)


async def test_a_failed_stream_is_tried_again_when_switched_on_or_given_its_settings_again(
    pool: EnginePool, tmp_path: Path
) -> None:
    """A failed stream (a file that was no video, a camera given up on) stayed failed when
    sent its settings again (a configuration tool's PUT, the streams file applied again) or
    ``PATCH {"enabled": true}``; only switching it off and on again tried it again."""
    allowed = tmp_path / "videos"
    allowed.mkdir()
    url = f"file://{allowed}/c.mp4"
    (allowed / "c.mp4").write_bytes(b"not a video " * 100)
    async with started_file_manager(pool, tmp_path / "data", allowed_dir=allowed) as m:
        for sid in ("patched", "put"):
            await m.add(url, stream_id=sid, loop=True)
            assert await m.wait_state(sid, {StreamState.FAILED}, 30)
        shutil.copy(CAR_CLIP, allowed / "c.mp4")
        await m.update("patched", {"enabled": True})
        await m.put("put", url, loop=True, detect=StreamDetect())
        for sid in ("patched", "put"):
            assert await m.wait_state(sid, {StreamState.LIVE}, 30), m.describe(sid)
        # Given again while live, a stream goes on as it is (a PUT twice changes nothing).
        before = (m.describe("put") or {})["frames_in"]
        await m.put("put", url, loop=True, detect=StreamDetect())
        assert (m.describe("put") or {})["frames_in"] >= before


def test_ffmpeg_options_pin_protocols_and_transport() -> None:
    udp = open_options(parse_source("rtsp://cam/x", None, transport="udp"))
    assert udp["rtsp_transport"] == "udp"
    # The probe ends at the first frame (test_streams_rtsp's 0.4 fps camera).
    assert (udp["fpsprobesize"], udp["max_ts_probe"]) == ("0", "0")
    assert "file" not in udp["protocol_whitelist"].split(",")
    hls = open_options(parse_source("https://cam/x.m3u8", None))
    assert "file" not in hls["protocol_whitelist"].split(",")
    assert "rtsp_transport" not in hls and "fpsprobesize" not in hls


def test_passwords_are_redacted() -> None:
    # A token given as the user name, a path parameter, a name with a secret's stem in it.
    assert redact("http://TOKENONLYUSER4@cam:1/a.mp4") == "http://***@cam:1/a.mp4"
    assert redact("http://cam/c;password=Secret6x/a.mp4") == "http://cam/c;password=***/a.mp4"
    assert redact("http://cam/a.mp4?user=admin&passw=S7&keyframe=1") == (
        "http://cam/a.mp4?user=admin&passw=***&keyframe=1"
    )
    for url, secret in (
        ("http://TOKENONLYUSER4@cam:1/a.mp4", "TOKENONLYUSER4"),
        ("http://cam/c;password=Secret6x/a.mp4", "Secret6x"),
        ("http://cam/a.mp4?userPass=Secret7x", "Secret7x"),
    ):
        said = redact_in(f"401 on {url} ({secret} refused)", url)
        assert secret not in said and "***" in said, said
    # Names that only begin or end like a secret's are kept (the YAML export lost them).
    kept = "http://cam/x?bypass=1&author=me&passthrough=yes&keyframe=2"
    assert redact(kept) == kept
    assert redact("http://cam/x?userToken=abcd&clientSecret=efgh") == (
        "http://cam/x?userToken=***&clientSecret=***"
    )
    said = redact_in("tcp://camera.local refused", "rtsp://camera@camera.local/x")
    assert said == "tcp://camera.local refused"  # a short user name is no token
    assert redact("rtsp://admin:hunter2@cam:554/x") == "rtsp://admin:***@cam:554/x"
    assert redact("rtsp://cam/x") == "rtsp://cam/x"
    # In the query, as cameras' CGI URLs and tokened streams carry them (they were shown).
    assert (
        redact("http://admin:pw@cam/cgi-bin/snapshot.cgi?user=admin&pwd=hunter2&res=0")
        == "http://admin:***@cam/cgi-bin/snapshot.cgi?user=admin&pwd=***&res=0"
    )
    assert redact("rtsp://cam/live?token=abc&channel=1") == "rtsp://cam/live?token=***&channel=1"
    assert (
        redact("https://h/s?api_key=1&X-Amz-Signature=2&keyframe=3&monkey=4&flag")
        == "https://h/s?api_key=***&X-Amz-Signature=***&keyframe=3&monkey=4&flag"
    )


async def test_a_cameras_password_stays_out_of_its_errors_and_events(
    pool: EnginePool, tmp_path: Path
) -> None:
    """FFmpeg's error names the URL it failed on, password and token included: the stream's
    ``last_error``, its state event (webhooks, MQTT) and the log show it redacted."""
    port = free_port()  # nothing listens there
    url = f"rtsp://admin:hunter2@127.0.0.1:{port}/live?channel=1&token=s3cr3tT0ken"
    async with started_file_manager(pool, tmp_path / "data") as m:
        info = await m.add(url)
        assert await m.wait_state(info["id"], {StreamState.RECONNECTING}, 30)
        stats = m.describe(info["id"])
        events = m.events.read(0, 10).events
    assert stats is not None
    error = stats["last_error"]
    assert "Connection refused" in error and f"admin:***@127.0.0.1:{port}" in error, error
    shown = json.dumps([stats, events])
    assert "hunter2" not in shown and "s3cr3tT0ken" not in shown, shown
    assert redact_in("bad 'x?pwd=p%40ss' p@ss", "http://h/x?pwd=p%40ss") == "bad 'x?pwd=***' ***"


def test_backoff_grows_is_capped_and_jittered() -> None:
    rng = random.Random(7)
    delays = [backoff_delay(n, 0.5, 8.0, rng) for n in range(1, 12)]
    for n, delay in enumerate(delays, start=1):
        cap = min(8.0, 0.5 * 2 ** (n - 1))
        assert cap / 2 <= delay <= cap
    assert max(delays) <= 8.0
    assert len({round(d, 6) for d in delays[5:]}) > 1  # capped delays still differ
    with pytest.raises(ValueError, match="1-based"):
        backoff_delay(0, 0.5, 8.0, rng)


# ---- store and fan-out -------------------------------------------------------------------


def test_store_keeps_streams_across_instances(tmp_path: Path) -> None:
    store = StreamStore(tmp_path / "data")
    store.add(
        new_record("a1", "rtsp://cam/1", name="door", max_fps=5.0, transport="udp", loop=False)
    )
    store.add(new_record("b2", "rtsp://cam/2", name="", max_fps=None, transport="tcp", loop=True))
    assert StreamStore(tmp_path / "data").remove("a1")
    assert not store.remove("a1")
    (only,) = StreamStore(tmp_path / "data").load()
    assert (only.id, only.url, only.max_fps, only.transport) == ("b2", "rtsp://cam/2", None, "tcp")


def test_store_adds_new_columns_to_an_older_file(tmp_path: Path) -> None:
    # The table as the first release wrote it, with one stream in it.
    (tmp_path / "data").mkdir()
    with closing(sqlite3.connect(tmp_path / "data" / "streams.sqlite3")) as db, db:
        db.execute(
            "CREATE TABLE streams (id TEXT PRIMARY KEY, url TEXT NOT NULL, name TEXT NOT NULL"
            " DEFAULT '', max_fps REAL, transport TEXT NOT NULL DEFAULT 'tcp', loop INTEGER NOT"
            " NULL DEFAULT 1, created_at REAL NOT NULL)"
        )
        db.execute("INSERT INTO streams VALUES ('old1', 'rtsp://cam/1', 'gate', 2, 'tcp', 1, 1)")
    store = StreamStore(tmp_path / "data")
    (old,) = store.load()
    assert (old.id, old.name, old.max_fps, old.detect) == ("old1", "gate", 2.0, "{}")
    assert store.update(dataclasses.replace(old, name="gate 2", detect='{"conf": 0.5}'))
    assert not store.update(dataclasses.replace(old, id="nope"))
    (again,) = StreamStore(tmp_path / "data").load()
    assert (again.name, again.max_fps, again.detect) == ("gate 2", 2.0, '{"conf": 0.5}')
    assert again.from_file is False  # a column added since, with its default
    assert store.replace(dataclasses.replace(again, url="rtsp://cam/9", from_file=True))
    (replaced,) = StreamStore(tmp_path / "data").load()
    assert (replaced.url, replaced.from_file, replaced.name) == ("rtsp://cam/9", True, "gate 2")


def _frame(n: int) -> ProcessedFrame:
    det = Detections.empty({0: "person"}, 64, 48)
    return ProcessedFrame("s1", n, n / 10, 1.0, 0.0, np.zeros((48, 64, 3), np.uint8), det, 1)


async def test_slow_subscriber_keeps_only_the_newest_messages() -> None:
    sub = Subscriber("s1", maxsize=3)
    for n in range(1, 11):
        sub.offer(_frame(n))  # never blocks, whatever the reader does
    assert sub.qsize() == 3
    assert sub.dropped == 7
    got = [await sub.get() for _ in range(3)]
    assert [f.frame for f in got if isinstance(f, ProcessedFrame)] == [8, 9, 10]


async def test_a_state_change_pushed_out_of_a_slow_viewers_queue_is_still_sent_first() -> None:
    sub = Subscriber("s1", maxsize=3)
    sub.offer(_frame(1))
    sub.offer(StateMessage('{"type":"stream_state","state":"reconnecting"}'))
    for n in range(2, 8):
        sub.offer(_frame(n))
    assert sub.dropped == 4  # frames only: the state change is kept
    got = [await sub.get() for _ in range(4)]
    assert isinstance(got[0], StateMessage) and "reconnecting" in got[0].text
    assert [f.frame for f in got[1:] if isinstance(f, ProcessedFrame)] == [5, 6, 7]
    # A state change behind a frame is no newer picture: the frame (and its events) goes out.
    sub.offer(_frame(8))
    sub.offer(StateMessage('{"type":"stream_state","state":"disabled"}'))
    assert isinstance(await sub.get(), ProcessedFrame) and not sub.frames_waiting()
    sub.offer(_frame(9))
    assert sub.frames_waiting()
    sub.offer(StateMessage('{"type":"stream_state","state":"live"}'))
    sub.close(1000, "stream removed")  # a closing viewer needs no backlog
    assert await sub.get() == Closed(1000, "stream removed")


async def test_events_of_frames_a_viewer_loses_come_with_the_next_frame() -> None:
    sub = Subscriber("s1", maxsize=3)
    for n in range(1, 11):
        crossing = Crossing("gate", "in" if n % 2 else "out", track_id=n, class_id=0, frame=n)
        sub.offer(dataclasses.replace(_frame(n), events=(crossing,)))
    got = [await sub.get() for _ in range(3)]
    frames = [f for f in got if isinstance(f, ProcessedFrame)]
    # Frames 1-7 were dropped for this slow viewer; their events ride on frame 8.
    assert [f.frame for f in frames] == [8, 9, 10]
    assert [c.frame for c in frames[0].events] == list(range(1, 9))
    assert [c.frame for c in frames[1].events] == [9]
    events = frames[0].to_message()["events"]
    assert [e["frame"] for e in events] == list(range(1, 9))
    assert events[0] == {
        "type": "line_crossing",
        "line": "gate",
        "direction": "in",
        "track_id": 1,
        "class_id": 0,
        "class_name": "person",
        "frame": 1,
    }
    assert "events" not in _frame(1).to_message()  # absent where nothing happened
    # A stalled viewer keeps a bounded number of them.
    stalled = Subscriber("s1", maxsize=1)
    many = tuple(Crossing("gate", "in", i, 0, 1) for i in range(MAX_CARRIED))
    for n in range(3):
        stalled.offer(dataclasses.replace(_frame(n), events=many))
    last = await stalled.get()
    assert isinstance(last, ProcessedFrame)
    assert len(last.events) == MAX_CARRIED + len(many)  # the kept ones and its own
    assert stalled.dropped_events == MAX_CARRIED


def test_a_file_plays_at_its_timestamps_across_loops_cuts_and_still_images() -> None:
    interval = frame_interval(Fraction(25))
    assert interval == pytest.approx(0.04)
    pacer = FilePacer()
    assert pacer.due(0.0, 100.0, interval) == 100.0  # the first frame: at once
    assert pacer.due(0.1, 100.0, interval) == pytest.approx(100.1)  # decoded early, it waits
    assert pacer.due(0.2, 100.05, interval) == pytest.approx(100.2)
    # Looped (back to 0), or a still image looped: one frame interval each, not at once.
    assert pacer.due(0.0, 100.1, interval) == pytest.approx(100.24)
    assert pacer.due(0.0, 100.1, interval) == pytest.approx(100.28)
    assert pacer.due(900.0, 100.1, interval) == pytest.approx(100.32)  # a cut: a leap of 15 min
    assert pacer.due(None, 100.1, interval) == pytest.approx(100.36)  # no timestamp
    assert pacer.due(904.8, 100.1, interval) == pytest.approx(105.16)  # a keyframe group: waited
    assert pacer.due(904.84, 200.0, interval) == 200.0  # far behind (a reconnect): afresh
    fixed = FilePacer(file_fps=10.0)  # a benchmark's rate, whatever the timestamps
    assert [fixed.due(t, 5.0, interval) for t in (0.0, 3.0, 0.0)] == pytest.approx([5, 5.1, 5.2])
    assert frame_interval(None) == pytest.approx(1 / 25)  # a video stating no rate
    assert frame_interval(Fraction(90000)) == pytest.approx(1 / 120)  # kept to 1..120 frames/s
    assert frame_interval(0.2) == 1.0


@pytest.mark.parametrize(
    ("camera_fps", "max_fps", "expected"),
    [(12.5, 10, 10), (12.5, 8, 8), (30, 20, 20), (30, 15, 15), (5, 10, 5), (25, 1, 1)],
)
def test_max_fps_takes_max_fps_frames_a_second(
    camera_fps: float, max_fps: float, expected: float
) -> None:
    """As many frames a second as ``max_fps`` asks where the camera sends more (a 12.5 fps
    camera at max_fps 10 gave 6.25: frames spaced at least 0.95/max_fps apart), every frame
    where it sends fewer; with a little jitter."""
    rng = np.random.default_rng(7)
    sampler = RateSampler()
    seconds = 60
    times = np.arange(0, seconds, 1 / camera_fps) + rng.uniform(0, 0.004, int(seconds * camera_fps))
    taken = sum(sampler.take(100.0 + float(t), max_fps) for t in times)
    assert taken / seconds == pytest.approx(expected, rel=0.03)
    assert all(RateSampler().take(t, None) for t in (0.0, 0.0, 0.001))  # no max_fps: all
    gap = RateSampler()
    assert gap.take(0.0, 10) and not gap.take(0.01, 10)
    assert gap.take(50.0, 10) and not gap.take(50.01, 10)  # after a gap: no burst
    # A new max_fps (PATCH) counts from the next frame: 0.05 a second, then 10.
    patched = RateSampler()
    assert patched.take(0.0, 0.05) and not patched.take(0.08, 0.05)
    after = [0.16 + 0.08 * k for k in range(25)]  # 2 s of a 12.5 fps camera
    kept = [t for t in after if patched.take(t, 10)]
    assert kept[0] == 0.16 and 19 <= len(kept) <= 21, kept


def test_outbox_keeps_a_bounded_number_of_frames_of_each_stream_and_every_event() -> None:
    box = Outbox(per_stream=3)
    token = object()
    crossing = Crossing("gate", "in", track_id=1, class_id=0, frame=2)
    woken = []
    for n in range(1, 8):
        frame = _frame(n)
        if n == 2:
            frame = dataclasses.replace(frame, events=(crossing,))
        wake, dropped = box.put(frame, token)
        woken.append(wake)
        if n <= 3:
            assert dropped is None
        else:  # the oldest without events goes, with its token; frame 2 stays
            assert dropped is not None and dropped[1] is token
            assert dropped[0].frame == (1 if n == 4 else n - 2), n
    assert woken == [True] + [False] * 6  # one wake-up for all until the loop takes them
    other = dataclasses.replace(_frame(9), stream_id="s2")
    assert box.put(other, token) == (False, None)  # another stream's room is its own
    assert [f.frame for f, _ in box.take()] == [2, 6, 7, 9]
    assert len(box) == 0
    assert box.put(_frame(10), token)[0]  # the next frame wakes the loop again
    # A stream whose every waiting frame carries events keeps them all.
    box.take()
    for n in range(5):
        assert box.put(dataclasses.replace(_frame(n), events=(crossing,)), token)[1] is None
    assert len(box) == 5
    with pytest.raises(ValueError, match="per_stream must be >= 1"):
        Outbox(per_stream=0)


async def test_closing_a_subscriber_delivers_the_close_code_next() -> None:
    sub = Subscriber("s1", maxsize=2)
    sub.offer(_frame(1))
    sub.close(1001, "server shutting down")
    sub.offer(_frame(2))  # after close: ignored
    assert await sub.get() == Closed(1001, "server shutting down")
    message = _frame(5).to_message()
    assert set(message) == MESSAGE_KEYS


# ---- a file source through the real pool -------------------------------------------------


@pytest.fixture(params=[0, 2], ids=["decode-threads", "decode-processes"])
async def file_manager(
    pool: EnginePool, tmp_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[StreamManager]:
    # In decode processes, one FFmpeg thread per stream (--stream-codec-threads 1): the
    # same pixels.
    async with started_file_manager(
        pool,
        tmp_path / "data",
        decode_processes=request.param,
        codec_threads=request.param // 2,
    ) as manager:
        yield manager


async def test_file_stream_is_sampled_at_max_fps_and_published(
    file_manager: StreamManager,
) -> None:
    clip = next(v for v in VIDEOS if v.name.startswith("bottle"))
    info = await file_manager.add(f"file://{clip}", name="bottles", max_fps=4.0)
    sub = file_manager.subscribe(info["id"])
    assert sub is not None
    frames = []
    for _ in range(4):
        frames.append(await next_frame(sub, 60))
    assert all(f.image.shape == (360, 640, 3) for f in frames)
    assert sum(len(f.detections) for f in frames) > 0  # the clip shows bottles
    assert [f.frame for f in frames] == sorted(f.frame for f in frames)
    stats = file_manager.describe(info["id"])
    assert stats is not None
    assert stats["state"] == StreamState.LIVE
    assert stats["skipped"] > 0  # ~30 fps clip sampled at 4 fps
    assert file_manager.latest(info["id"]) is not None
    assert await file_manager.remove(info["id"])
    assert file_manager.describe(info["id"]) is None


def _counted_twice(stats: dict[str, Any]) -> str | None:
    """What is wrong with a stream's counts (None: nothing): a frame taken in ends in one
    counter at most (processed, dropped, skipped, motion skipped or failed; none while in
    flight), so together they never exceed ``frames_in``."""
    ended = stats["frames_processed"] + stats["drops"] + stats["skipped"]
    ended += stats["motion_skipped"] + stats["frames_failed"]
    if ended > stats["frames_in"]:
        return f"processed + dropped + skipped + failed {ended} > frames_in {stats['frames_in']}"
    return None


def _exported(manager: StreamManager, stream_id: str) -> dict[str, float]:
    """The stream's samples as ``/metrics`` gives them, by name."""
    metrics = Metrics()
    metrics.set_stream_source(functools.partial(metric_samples, manager))
    return {
        s.name: s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
        if s.labels.get("stream") == stream_id
    }


async def test_a_held_up_event_loop_costs_a_stream_its_oldest_frames_not_memory(
    file_manager: StreamManager, pool: EnginePool
) -> None:
    """While the loop is held (here: asleep on it until the engine has detected a dozen
    frames more than the outbox keeps), the engine goes on detecting the stream's frames; at
    most OUTBOX_PER_STREAM of them wait for the loop, the older ones are counted as
    ``publish_drops`` (processed, not delivered), not as ``drops`` too (a frame dropped before
    the engine): each frame counts once, in GET /streams and in /metrics; and the stream goes
    on once the loop does."""
    info = await file_manager.add(f"file://{CAR_CLIP}")
    sid = info["id"]
    await published_frames(file_manager, sid, 2)
    before = file_manager.describe(sid)
    assert before is not None
    depths: list[int] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.005):
            depths.append(len(file_manager._outbox))

    sampler = threading.Thread(target=sample)
    sampler.start()
    give_up = time.monotonic() + 60
    while time.monotonic() < give_up:  # holds the event loop
        now = file_manager.describe(sid)
        assert now is not None
        if now["frames_processed"] - before["frames_processed"] > OUTBOX_PER_STREAM + 12:
            break
        time.sleep(0.05)  # noqa: ASYNC251
    done.set()
    sampler.join()
    after = file_manager.describe(sid)
    assert after is not None
    exported = _exported(file_manager, sid)
    detected = after["frames_processed"] - before["frames_processed"]
    assert detected > OUTBOX_PER_STREAM, detected  # the engine went on meanwhile
    assert max(depths) == OUTBOX_PER_STREAM
    assert _counted_twice(after) is None, after
    # Each worker may have counted one frame processed that it has not handed over yet.
    published_at_most = OUTBOX_PER_STREAM + pool.workers
    assert after["publish_drops"] - before["publish_drops"] >= detected - published_at_most
    ended = exported["streamdet_stream_frames_processed_total"]
    ended += exported["streamdet_stream_frames_dropped_total"]
    assert ended <= exported["streamdet_stream_frames_received_total"], exported
    unpublished = exported["streamdet_stream_frames_publish_dropped_total"]
    assert unpublished >= after["publish_drops"], exported
    frames = await published_frames(file_manager, sid, 3)
    assert [f.frame for f in frames] == sorted(f.frame for f in frames)


async def test_a_looped_still_image_is_a_camera_of_that_picture_at_its_rate(
    pool: EnginePool, tmp_path: Path
) -> None:
    """A JPEG as a looped file: each pass is one frame; the passes come at the picture's rate
    (25 frames/s), not as fast as the file reopens (about 80 a second here before), and its
    frames are detected like any other."""
    still = tmp_path / "videos" / "bus.jpg"
    still.parent.mkdir()
    still.write_bytes((ultralytics_assets() / "bus.jpg").read_bytes())
    async with started_file_manager(pool, tmp_path / "data", allowed_dir=still.parent) as m:
        added = time.monotonic()
        info = await m.add(f"file://{still}", loop=True)
        frames = await published_frames(m, info["id"], 3)
        last = frames[-1].detections
        assert {last.name_of(int(c)) for c in last.class_ids} >= {"bus", "person"}
        await asyncio.sleep(2.0)
        stats = m.describe(info["id"])
        assert stats is not None
        played_s = time.monotonic() - added  # an upper bound of how long it has played
    assert stats["state"] == StreamState.LIVE and stats["reconnects"] == 0
    assert stats["frames_in"] <= 25 * played_s + 2, (stats["frames_in"], played_s)
    assert stats["frames_in"] >= 10  # it goes on, pass after pass


@pytest.mark.parametrize("decode_processes", [0, 1], ids=["decode-thread", "decode-process"])
async def test_a_file_without_loop_plays_once_and_stops_saying_so(
    pool: EnginePool, tmp_path: Path, decode_processes: int
) -> None:
    """``"loop": false``: the file plays to its end, then the stream stops with the reason
    (it was reopened after a reconnect's wait, again and again, as a camera is)."""
    clip = tmp_path / "videos" / "short.mp4"
    clip.parent.mkdir()
    make_clip(CAR_CLIP, clip, width=384, height=216, fps=25, gop=25, frames=12)  # 24 frames
    async with started_file_manager(
        pool, tmp_path / "data", allowed_dir=clip.parent, decode_processes=decode_processes
    ) as m:
        info = await m.add(f"file://{clip}", loop=False)
        assert await m.wait_state(info["id"], {StreamState.STOPPED}, 60)
        await asyncio.sleep(1.0)  # a reconnect would come within its first backoff
        stats = m.describe(info["id"])
    assert stats is not None
    assert stats["state"] == StreamState.STOPPED and stats["last_error"] == FILE_ENDED
    assert stats["frames_in"] == 24 and stats["reconnects"] == 0


@pytest.mark.parametrize("decode_processes", [0, 1], ids=["decode-thread", "decode-process"])
async def test_a_looped_file_decoded_keyframes_only_plays_at_its_rate_and_keeps_max_fps(
    pool: EnginePool, tmp_path: Path, decode_processes: int
) -> None:
    """A 3 s file with a keyframe a second, looped at ``max_fps`` 0.5: only its keyframes are
    decoded, and it still plays at 25 frames a second (the frames between, never decoded,
    went by at once: 37-49 a second) and gives 0.5 frames a second (each pass took its first
    frame: 1 a second)."""
    clip = tmp_path / "videos" / "short.mp4"
    clip.parent.mkdir()
    make_clip(BOTTLE_CLIP, clip, width=320, height=180, fps=25, gop=25, frames=75)
    async with started_file_manager(
        pool, tmp_path / "data", allowed_dir=clip.parent, decode_processes=decode_processes
    ) as m:
        info = await m.add(f"file://{clip}", loop=True, max_fps=0.5)
        await published_frames(m, info["id"], 1)
        first = m.describe(info["id"])
        started = time.monotonic()
        await asyncio.sleep(8.0)
        stats = m.describe(info["id"])
        played_s = time.monotonic() - started
    assert first is not None and stats is not None
    assert stats["keyframes_only"] is True, stats
    came = stats["frames_in"] - first["frames_in"]
    assert 25 * played_s - 30 <= came <= 25 * played_s + 30, (came, played_s)
    taken = stats["frames_processed"] - first["frames_processed"]
    assert taken <= 0.5 * played_s + 1.5, (taken, played_s)


@pytest.mark.parametrize("decode_processes", [0, 1], ids=["decode-thread", "decode-process"])
async def test_a_looped_file_that_fails_to_open_again_is_lost_and_its_return_a_reconnect(
    pool: EnginePool, tmp_path: Path, decode_processes: int
) -> None:
    """A looped file is live between its passes: moved away, it is lost at its next pass,
    and its coming back is a reconnect (the failed reopen had sent no frame yet, so it was
    not counted: ``reconnects`` stayed 0)."""
    clip = tmp_path / "videos" / "short.mp4"
    clip.parent.mkdir()
    make_clip(CAR_CLIP, clip, width=384, height=216, fps=25, gop=25, frames=12)  # 24 frames
    away = tmp_path / "away.mp4"
    async with started_file_manager(
        pool, tmp_path / "data", allowed_dir=clip.parent, decode_processes=decode_processes
    ) as m:
        info = await m.add(f"file://{clip}", loop=True)
        await published_frames(m, info["id"], 1)
        clip.rename(away)
        assert await m.wait_state(info["id"], {StreamState.RECONNECTING}, 30)
        away.rename(clip)
        assert await m.wait_state(info["id"], {StreamState.LIVE}, 30)
        stats = m.describe(info["id"])
    assert stats is not None and stats["reconnects"] == 1, stats


@pytest.mark.parametrize("decode_processes", [0, 1], ids=["decode-thread", "decode-process"])
@pytest.mark.parametrize("suffix", ["mp4", "ts"])
async def test_a_video_file_over_http_plays_at_its_rate_and_ends_as_a_file(
    pool: EnginePool, tmp_path: Path, decode_processes: int, suffix: str
) -> None:
    """An MP4 served over HTTP is a recording: it plays at its own frame rate and, with
    ``"loop": false``, stops at its end. (It decoded at 35x real time, then went reconnecting
    and live again at each end, two state events a pass, for ever.) So is an MPEG-TS file
    from a server without range requests (``python -m http.server``), which states no
    duration, only its size: it was read as a camera."""
    import functools
    import http.server

    clip = tmp_path / "site" / f"short.{suffix}"
    clip.parent.mkdir()
    make_clip(CAR_CLIP, clip, width=384, height=216, fps=25, gop=25, frames=12)  # 24 frames
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=clip.parent)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/short.{suffix}"
    try:
        async with started_file_manager(
            pool, tmp_path / "data", decode_processes=decode_processes
        ) as m:
            started = time.monotonic()
            info = await m.add(url, loop=False)
            assert info["loop"] is False
            assert await m.wait_state(info["id"], {StreamState.STOPPED}, 60)
            played_s = time.monotonic() - started
            await asyncio.sleep(1.0)  # a reconnect would come within its first backoff
            stats = m.describe(info["id"])
            looped = await m.add(url)  # "loop" (the default): again and again, at its rate
            added = time.monotonic()
            # Past the 24 frames of one play (it took 1-1.7 s under load, with the open).
            while (again := m.describe(looped["id"])) is not None and again["frames_in"] <= 24:
                assert time.monotonic() - added < 30, again
                await asyncio.sleep(0.1)
            looped_s = time.monotonic() - added
            events = m.events.read(0, 100).events
    finally:
        server.shutdown()
        server.server_close()
    assert stats is not None and again is not None
    assert stats["state"] == StreamState.STOPPED and stats["last_error"] == FILE_ENDED
    assert stats["frames_in"] == 24 and stats["reconnects"] == 0
    assert played_s > 0.7  # 24 frames at 25 frames/s, not as fast as they decode
    assert again["state"] == StreamState.LIVE and again["reconnects"] == 0, again
    assert 24 < again["frames_in"] <= 25 * looped_s + 26, (again["frames_in"], looped_s)
    states = [e["state"] for e in events if e["stream_id"] == looped["id"]]
    assert states == ["live"], states


@pytest.mark.parametrize("decode_processes", [0, 1], ids=["decode-thread", "decode-process"])
async def test_a_snapshot_url_is_polled_at_max_fps_and_stays_live(
    pool: EnginePool, tmp_path: Path, decode_processes: int
) -> None:
    """A URL that answers one picture a request (a camera's snapshot URL) is fetched again at
    the stream's ``max_fps``, the stream live throughout, with no reconnects and no state
    events (each picture was "source ended", a reconnect's wait and two state events); when
    the URL fails, the stream reconnects as a camera does, and is live again once it
    answers."""
    camera = SnapshotCamera((ultralytics_assets() / "bus.jpg").read_bytes())
    try:
        async with started_file_manager(
            pool, tmp_path / "data", decode_processes=decode_processes
        ) as m:
            info = await m.add(camera.url, max_fps=4.0)
            sid = info["id"]
            still = await m.add(camera.url, max_fps=4.0, detect=StreamDetect(motion=True))
            frames = await published_frames(m, sid, 3)
            last = frames[-1].detections
            assert {last.name_of(int(c)) for c in last.class_ids} >= {"bus", "person"}
            requests, started = camera.requests, time.monotonic()
            await asyncio.sleep(2.0)
            polled = camera.requests - requests
            elapsed = time.monotonic() - started
            stats = m.describe(sid)
            assert stats is not None
            assert stats["state"] == StreamState.LIVE, stats
            assert stats["reconnects"] == 0 and stats["last_error"] is None, stats
            assert 4 <= polled <= 2 * (4 * elapsed + 1), (polled, elapsed)  # max_fps each
            # The same picture again and again: motion compared across fetches, so it is
            # inferred only as often as motion_idle_fps (2/s) asks.
            unmoved = m.describe(still["id"])
            assert unmoved is not None and unmoved["motion_skipped"] >= 2, unmoved
            events = m.events.read(0, 100).events
            states = [e["state"] for e in events if e["stream_id"] == sid]
            assert states == ["live"], events

            camera.status = 404
            assert await m.wait_state(sid, {StreamState.RECONNECTING}, 30)
            camera.status = 200
            assert await m.wait_state(sid, {StreamState.LIVE}, 30)
            await published_frames(m, sid, 1, after=frames[-1].frame)
            back = m.describe(sid)  # live between fetches, so its return is a reconnect
            assert back is not None and back["reconnects"] == 1, back
    finally:
        camera.close()


def _decode_threads(stream_id: str) -> int:
    return sum(t.name == f"stream-{stream_id}" for t in threading.enumerate())


async def test_calls_on_one_stream_at_once_leave_it_as_the_last_one_said(
    pool: EnginePool, tmp_path: Path
) -> None:
    """Calls that add, change and remove the same stream at the same moment (scripts, a
    dashboard and MQTT at once) take their turns: one of twenty PUTs of a new id creates it,
    the rest replace it; the stream decodes the source it reports and is stored with it; and
    however enable, disable, PUT and DELETE interleave, one decode thread runs while the
    stream exists and none once it is removed. (Interleaved, they answered 500, left decode
    threads running that nothing would stop, and GET naming another source than the one
    decoded.)"""
    clips = [f"file://{CAR_CLIP}", f"file://{BOTTLE_CLIP}"]
    async with started_file_manager(pool, tmp_path / "data") as m:
        puts = await asyncio.gather(
            *(m.put("cam", clips[i % 2], detect=StreamDetect(), name=f"n{i}") for i in range(20))
        )
        assert sorted(added for _, added in puts) == [False] * 19 + [True]
        last = m.describe("cam")
        assert last is not None
        assert last["name"] == puts[-1][0]["name"] == "n19"  # the last call's settings hold
        assert m._readers["cam"].config.spec.url == last["url"] == clips[1]
        assert m._store.load()[0].url == clips[1]
        rng = random.Random(7)
        for _ in range(3):
            calls = []
            for i in range(8):
                on = rng.random() < 0.5
                calls += [
                    m.update("cam", {"enabled": on}),
                    m.put("cam", clips[i % 2], detect=StreamDetect(), enabled=not on),
                    m.update("cam", {"name": f"r{i}"}),
                ]
            await asyncio.gather(*calls)
            info = m.describe("cam")
            assert info is not None and info["url"] == m._readers["cam"].config.spec.url
            # The last PUT, then the last name: as the calls came.
            assert (info["url"], info["enabled"], info["name"]) == (clips[1], not on, "r7")
            # A reader stopped while it opened is let go of after a short wait; its thread
            # ends once FFmpeg's open returns.
            running = int(info["enabled"])
            await eventually(lambda: _decode_threads("cam") == running)  # noqa: B023
            if not info["enabled"]:
                assert info["state"] == StreamState.DISABLED, info
        removed = await asyncio.gather(
            m.remove("cam"), m.update("cam", {"enabled": True}), m.remove("cam")
        )
        assert removed == [True, None, False]
        assert m.describe("cam") is None
        await eventually(lambda: _decode_threads("cam") == 0)


async def test_streams_added_at_once_keep_to_the_limit_and_each_id_once(
    pool: EnginePool, tmp_path: Path
) -> None:
    """Ten POSTs at once under a limit of three: three streams, seven refused with the limit
    named; ten POSTs of one id: one stream, nine refused as taken (they answered 201 past
    the limit, and 500 for the taken id)."""
    options = ManagerOptions(
        reader=ReaderOptions(open_timeout_s=5, read_timeout_s=5),
        allowed_file_dir=CAR_CLIP.parent,
        max_streams=3,
    )
    m = StreamManager(pool, StreamStore(tmp_path / "data"), options)
    await m.start()
    try:
        url = f"file://{CAR_CLIP}"
        got = await asyncio.gather(*(m.add(url) for _ in range(10)), return_exceptions=True)
        refused = [r for r in got if isinstance(r, Exception)]
        assert len(m.list()) == 3 and len(refused) == 7
        assert all(isinstance(r, StreamLimitError) for r in refused), refused
        assert "limit 3 (setting STREAMDET_MAX_STREAMS)" in str(refused[0])
        with pytest.raises(SourceError, match="scheme 'ftp'"):  # what is wrong with it first
            await m.add("ftp://nowhere/x")
        for info in m.list():
            await m.remove(info["id"])
        got = await asyncio.gather(
            *(m.add(url, stream_id="same") for _ in range(10)), return_exceptions=True
        )
        assert sum(isinstance(r, dict) for r in got) == 1
        assert all(isinstance(r, StreamExistsError) for r in got if not isinstance(r, dict))
        assert [r.id for r in m._store.load()] == ["same"] and len(m._held) == 0
    finally:
        await m.stop(10)


def test_keyframes_suffice_where_they_come_as_often_as_the_samples() -> None:
    assert keyframes_suffice(1.0, 1.0, reorders=False)  # a keyframe a second, one sample
    assert keyframes_suffice(1.04, 1.0, reorders=False)  # within the slack
    assert not keyframes_suffice(2.0, 1.0, reorders=False)  # samples between keyframes
    assert not keyframes_suffice(0.5, 1.0, reorders=True)  # B-frames hold pictures back
    assert not keyframes_suffice(1.0, None, reorders=False)  # every frame sampled
    assert not keyframes_suffice(None, 1.0, reorders=False)  # no group measured yet


async def test_only_keyframes_are_decoded_where_the_sampling_takes_no_more(
    file_manager: StreamManager,
) -> None:
    """The car clip has a keyframe every 4.8 s (60 frames at 12.5 fps): sampled every 5 s,
    only its keyframes are decoded once the first group is measured; sampled every second, or
    the bottle clip (B-frames) every 10 s, every frame is."""
    slow = await file_manager.add(f"file://{CAR_CLIP}", max_fps=0.2)
    every_s = await file_manager.add(f"file://{CAR_CLIP}", max_fps=1.0)
    bottles = await file_manager.add(f"file://{BOTTLE_CLIP}", max_fps=0.1)
    frames = await published_frames(file_manager, slow["id"], 3)
    pts = [round(f.pts or 0, 2) for f in frames]
    # Its keyframes, one after another; under load the first (0.0) may be out before the
    # subscription, which the other two adds keep waiting.
    assert pts in ([0.0, 4.8, 9.6], [4.8, 9.6, 14.4]), pts
    sampled = round(pts[-1] / 4.8) + 1  # the keyframes up to the last one seen
    # Whole pictures, the very ones a decoder fed every frame gives.
    with av.open(str(CAR_CLIP)) as clip:
        every = {round(f.time, 2): f.to_ndarray(format="rgb24") for f in clip.decode(video=0)}
    for frame in frames:
        assert np.array_equal(frame.image, every[round(frame.pts or 0, 2)]), frame.pts
    stats = {s["id"]: s for s in file_manager.list()}
    assert stats[slow["id"]]["keyframes_only"] is True
    decoded, came = stats[slow["id"]]["frames_decoded"], stats[slow["id"]]["frames_in"]
    # Each keyframe taken in is sampled, the others counted as sampled out (counted by the
    # keyframes taken in: under load one past the last seen may not be published yet).
    keyframes = sum(i % 377 % 60 == 0 for i in range(came))  # 377 frames a pass
    # The first group, then keys (the frames between paced as the file plays: 9.6 s in); the
    # counts are read after the frames: under load a keyframe past the last seen is decoded.
    assert came >= 120 and decoded <= 60 + max(sampled, keyframes), (decoded, came)
    assert stats[slow["id"]]["skipped"] == came - keyframes, (came, sampled)
    # /metrics accounts for every frame received too (it had no skipped series: 95 % of a
    # max_fps stream's frames were in none of its counters).
    exported = _exported(file_manager, slow["id"])
    ended = sum(
        exported[f"streamdet_stream_frames_{kind}_total"]
        for kind in ("processed", "dropped", "skipped", "motion_skipped", "failed")
    )
    assert 0 <= exported["streamdet_stream_frames_received_total"] - ended <= 2, exported
    for other in (every_s, bottles):
        assert stats[other["id"]]["keyframes_only"] is False
        assert stats[other["id"]]["frames_decoded"] == stats[other["id"]]["frames_in"] > 0


async def test_a_camera_whose_keyframes_come_unevenly_is_decoded_whole(
    pool: EnginePool, tmp_path: Path
) -> None:
    """Keyframes every second and one more at 1.4 s (a camera adds one at a change of
    scene), sampled twice a second: the short group made the next, a whole second, decoded
    keyframe only, one sample where two were due (a real camera's stream at max_fps 2 took
    1.3 frames a second). Decided from the longest of the last groups, every frame is
    decoded."""
    allowed = tmp_path / "videos"
    allowed.mkdir()
    clip = allowed / "uneven.mp4"
    make_clip(CAR_CLIP, clip, width=320, height=180, fps=10, gop=10, frames=60, keyframes={14})
    async with started_file_manager(pool, tmp_path / "data", allowed_dir=allowed) as m:
        info = await m.add(f"file://{clip}", max_fps=2.0, loop=True)
        await published_frames(m, info["id"], 8)  # past the short group, 4 s in
        stats = m.describe(info["id"])
        assert stats is not None and stats["frames_in"] >= 30, stats
        assert stats["keyframes_only"] is False
        assert stats["frames_decoded"] == stats["frames_in"], stats


async def test_each_stream_has_its_own_detection_parameters(
    pool: EnginePool, tmp_path: Path
) -> None:
    options = ManagerOptions(
        reader=ReaderOptions(open_timeout_s=5, read_timeout_s=5), allowed_file_dir=VIDEOS[0].parent
    )
    clip = next(v for v in VIDEOS if v.name.startswith("bottle"))  # bottles and people
    manager = StreamManager(pool, StreamStore(tmp_path / "data"), options)
    await manager.start()
    try:
        bottles = StreamDetect(DetectParams(conf=0.4, classes=frozenset({39})))
        info = await manager.add(f"file://{clip}", max_fps=6.0, detect=bottles)
        sid = info["id"]
        want = detect_json(conf=0.4, classes=["bottle"])
        assert info["detect"] == want
        frames = await published_frames(manager, sid, 6)
        dets = [d for f in frames for d in f.detections.to_json()]
        assert dets, "the clip shows bottles"
        assert {d["class_name"] for d in dets} == {"bottle"}
        assert min(d["confidence"] for d in dets) >= 0.4
        counted = manager.describe(sid)
        assert counted is not None and counted["frames_failed"] == 0
        assert set(counted["detections"]) == {"bottle"}  # counted by class, filter applied
        assert counted["detections"]["bottle"] >= len(dets)
        assert set(counted["objects"]) <= {"bottle"}

        # Changed while it runs, without reopening the source: later frames follow.
        one = StreamDetect(DetectParams(conf=0.25, max_det=1))
        changed = await manager.update(sid, {"detect": one})
        assert changed is not None and changed["detect"]["max_det"] == 1
        assert changed["reconnects"] == 0
        later = await published_frames(manager, sid, 4, after=numbered(manager, sid))
        assert all(len(f.detections) <= 1 for f in later)
        assert any(len(f.detections) == 1 for f in later)
        assert await manager.update("nope", {"detect": one}) is None

        # A region: the right 40% of the frame, where one of the three bottles stands.
        right = Roi(((0.6, 0.0), (1.0, 0.0), (1.0, 1.0), (0.6, 1.0)))
        changed = await manager.update(sid, {"detect": StreamDetect(bottles.params, right)})
        assert changed is not None and changed["detect"]["roi"] == [
            [0.6, 0],
            [1, 0],
            [1, 1],
            [0.6, 1],
        ]
        later = await published_frames(manager, sid, 4, after=numbered(manager, sid))
        kept = [d for f in later for d in f.detections.to_json()]
        assert kept and all((d["box"][0] + d["box"][2]) / 2 >= 0.6 * 640 for d in kept)

        # Rate and name, also live: frames now come at most 2 a second.
        changed = await manager.update(sid, {"max_fps": 2.0, "name": "shelf"})
        assert changed is not None and (changed["name"], changed["max_fps"]) == ("shelf", 2.0)
        assert changed["detect"]["roi"] is not None  # what was not given stays
        later = await published_frames(manager, sid, 3, after=numbered(manager, sid))
        gaps = np.diff([f.captured_at for f in later])
        assert gaps.min() >= 0.4, gaps  # 0.5 s apart, give or take the sampler's 5%
    finally:
        await manager.stop(10)

    # Persisted, classes by name: a restart keeps them; a model without the class shows why
    # the stream cannot start, and a PATCH with parameters that fit starts it.
    again = StreamManager(pool, StreamStore(tmp_path / "data"), options)
    await again.start()
    try:
        (listed,) = again.list()
        assert (listed["name"], listed["max_fps"]) == ("shelf", 2.0)
        assert listed["detect"]["roi"] == [[0.6, 0], [1, 0], [1, 1], [0.6, 1]]
        await again.update(sid, {"detect": bottles})
    finally:
        await again.stop(10)
    store = StreamStore(tmp_path / "data")
    (stored,) = store.load()
    store.update(dataclasses.replace(stored, detect=json.dumps({"classes": ["unicorn"]})))
    third = StreamManager(pool, store, options)
    await third.start()
    try:
        (failed,) = third.list()
        assert failed["state"] == StreamState.FAILED
        assert "unknown class name 'unicorn'" in failed["last_error"]
        renamed = await third.update(sid, {"name": "kept"})  # the stored classes stay stored
        assert renamed is not None and renamed["state"] == StreamState.FAILED
        assert "unicorn" in StreamStore(tmp_path / "data").load()[0].detect
        await third.update(sid, {"detect": bottles})
        assert await third.wait_state(sid, {StreamState.LIVE}, 30)
        assert (await published_frames(third, sid, 1))[0].detections is not None
    finally:
        await third.stop(10)


@pytest.mark.skipif(nvdec_unavailable() is None, reason="NVDEC here: tests/test_gpu_cuda.py")
async def test_tracked_stream_gives_steady_ids_and_counts_each_object_once(
    file_manager: StreamManager,
) -> None:
    clip = next(v for v in VIDEOS if v.name.startswith("bottle"))  # three bottles stand still
    detect = StreamDetect(DetectParams(classes=frozenset({39})), track=True)
    info = await file_manager.add(f"file://{clip}", max_fps=6.0, detect=detect)
    sid = info["id"]
    assert info["detect"]["track"] is True
    frames = await published_frames(file_manager, sid, 8)
    per_frame = [f.detections.to_json() for f in frames]
    assert all("track_id" in d for dets in per_frame for d in dets)
    # The bottles do not move: each keeps one id, so a few ids cover every frame's bottles.
    ids = {d["track_id"] for dets in per_frame for d in dets}
    most = max(len(dets) for dets in per_frame)
    assert most >= 2 and len(ids) <= most + 1, per_frame
    stats = file_manager.describe(sid)
    assert stats is not None
    assert 1 <= stats["tracked"]["bottle"] <= len(ids)  # objects, not detections
    assert stats["detections"]["bottle"] > stats["tracked"]["bottle"]

    # Off again, live: later frames carry no ids, and the counts stay.
    changed = await file_manager.update(sid, {"detect": StreamDetect(detect.params)})
    assert changed is not None and changed["detect"]["track"] is False
    later = await published_frames(file_manager, sid, 3, after=numbered(file_manager, sid))
    assert all("track_id" not in d for f in later for d in f.detections.to_json())


async def test_gpu_decode_falls_back_to_the_cpu_where_nvdec_is_missing(
    pool: EnginePool, tmp_path: Path
) -> None:
    options = ManagerOptions(
        reader=ReaderOptions(open_timeout_s=5, read_timeout_s=5, decode_device="cuda"),
        allowed_file_dir=VIDEOS[0].parent,
    )
    manager = StreamManager(pool, StreamStore(tmp_path / "data"), options)
    await manager.start()
    try:
        info = await manager.add(f"file://{VIDEOS[0]}", max_fps=5.0)
        (frame,) = await published_frames(manager, info["id"], 1)
        assert isinstance(frame.image, np.ndarray)  # decoded on the CPU, run all the same
        described = manager.describe(info["id"])
        assert described is not None and described["decode"] == "cpu"
    finally:
        await manager.stop(10)


def test_frames_the_engine_fails_on_are_counted_and_the_stream_goes_on(tmp_path: Path) -> None:
    failures: list[str] = []

    def failing_engine(stream_id: str, item: WorkItem) -> None:
        failures.append(item.request_id)
        item.on_done(WorkResult(None, RuntimeError("engine fault"), 0.0, 0.0, 1))

    spec = parse_source(f"file://{VIDEOS[0]}", VIDEOS[0].parent)
    reader = StreamReader(
        StreamConfig("s1", spec, max_fps=10.0), ReaderOptions(), failing_engine, lambda f: None
    )
    reader.start()
    try:
        assert reader.wait_state({StreamState.LIVE}, 30)
        deadline = time.monotonic() + 30
        while reader.snapshot()["frames_failed"] < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        snap = reader.snapshot()
        assert snap["frames_failed"] >= 3 and snap["frames_processed"] == 0
        assert snap["state"] == StreamState.LIVE  # a failing engine does not stop the stream
        assert len(failures) >= snap["frames_failed"]
    finally:
        reader.stop()
        assert reader.join(10)


def test_results_that_come_back_out_of_order_never_go_back_in_time() -> None:
    """Two workers can finish one stream's frames out of order: the older one is dropped, so
    subscribers (and the tracker) only ever see a stream move forward."""
    held: list[WorkItem] = []
    four = threading.Event()

    def holding_engine(stream_id: str, item: WorkItem) -> None:
        if len(held) < 4:
            held.append(item)
            if len(held) == 4:
                four.set()

    published: list[ProcessedFrame] = []
    spec = parse_source(f"file://{VIDEOS[0]}", VIDEOS[0].parent)
    detect = StreamDetect(track=True)
    reader = StreamReader(
        StreamConfig("s1", spec, max_fps=10.0, detect=detect),
        ReaderOptions(),
        holding_engine,
        published.append,
    )
    reader.start()
    try:
        assert four.wait(30)
        numbers = [int(item.request_id.rsplit(":", 1)[1]) for item in held]
        assert numbers == sorted(numbers)
        person = Detections(
            boxes=np.array([[10, 10, 50, 90]], np.float32),
            scores=np.array([0.9], np.float32),
            class_ids=np.array([0], np.int32),
            names={0: "person"},
            width=640,
            height=360,
        )
        for i in (1, 0, 3, 2):  # the second frame finishes before the first, and so on
            held[i].on_done(WorkResult(person, None, 0.0, 1.0, 1))
        assert [f.frame for f in published] == [numbers[1], numbers[3]]
        assert [f.detections.to_json()[0]["track_id"] for f in published] == [1, 1]
        snap = reader.snapshot()
        assert snap["frames_processed"] == 2 and snap["drops"] >= 2
    finally:
        reader.stop()
        assert reader.join(10)


def test_a_frames_captured_at_is_when_it_was_decoded_not_handed_over() -> None:
    """A frame from a decode process reaches the reader a while after it was decoded: its
    ``captured_at`` (what clients and the load tests measure latency from) is the decode's
    wall time; it was the hand-over's, leaving the hand-over out of every latency."""
    held: list[WorkItem] = []
    published: list[ProcessedFrame] = []
    spec = parse_source(f"file://{VIDEOS[0]}", VIDEOS[0].parent)
    reader = StreamReader(
        StreamConfig("s1", spec),
        ReaderOptions(),
        lambda _, item: held.append(item),
        published.append,
    )
    image = np.zeros((360, 640, 3), np.uint8)
    reader._offer(image, 0.0, time.monotonic() - 0.5, (640, 360))  # decoded 0.5 s ago
    nothing = Detections(
        boxes=np.zeros((0, 4), np.float32),
        scores=np.zeros(0, np.float32),
        class_ids=np.zeros(0, np.int32),
        names={0: "person"},
        width=640,
        height=360,
    )
    held[0].on_done(WorkResult(nothing, None, 0.0, 0.0, 1))
    (frame,) = published
    assert 0.45 < time.time() - frame.captured_at < 5.0, time.time() - frame.captured_at


# ---- regions of interest -------------------------------------------------------------------


def test_roi_keeps_boxes_whose_bottom_centre_is_inside() -> None:
    # A concave "L": the left column and the bottom row of a 2x2 grid.
    ell = Roi(((0.0, 0.0), (0.5, 0.0), (0.5, 0.5), (1.0, 0.5), (1.0, 1.0), (0.0, 1.0)))
    boxes = np.array(
        [
            [10, 10, 30, 40],  # anchor (20, 40) of 100x100: top-left cell, inside
            [60, 10, 80, 40],  # anchor (70, 40): top-right cell, outside
            [60, 60, 80, 90],  # anchor (70, 90): bottom-right cell, inside
            [40, 0, 100, 45],  # box mostly outside, anchor (70, 45): outside
        ],
        np.float32,
    )
    dets = Detections(
        boxes,
        np.array([0.9, 0.8, 0.7, 0.6], np.float32),
        np.array([0, 1, 2, 3], np.int32),
        {0: "a", 1: "b", 2: "c", 3: "d"},
        100,
        100,
    )
    kept = ell.filter(dets)
    assert list(kept.class_ids) == [0, 2] and list(kept.scores) == pytest.approx([0.9, 0.7])
    assert (kept.width, kept.height) == (100, 100)
    whole = Roi(((0.0, 0.0), (1.0, 0.0), (1.0, 1.0), (0.0, 1.0)))
    assert whole.filter(dets) is dets  # nothing dropped: the same object


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ([[0, 0], [1, 1]], "2 points"),
        ([[0, 0], [1, 0], [1.5, 1]], "outside [0, 1]"),
        ([[0, 0], [1, 0], [1]], "list of [x, y]"),
        ([[0, 0], [1, 0], ["a", 1]], "list of [x, y]"),
    ],
)
def test_bad_regions_are_refused_with_the_reason(raw: list[list[object]], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        Roi.parse(raw)  # type: ignore[arg-type]


@pytest.mark.parametrize("decode_processes", [0, 1], ids=["decode-thread", "decode-process"])
async def test_a_stream_still_opening_its_source_is_removed_or_replaced_at_once(
    pool: EnginePool, tmp_path: Path, decode_processes: int
) -> None:
    """A camera that accepted the connection and says nothing holds FFmpeg's open (which no
    stop interrupts) for the whole open timeout: removing the stream, disabling it or giving
    it a new source answered only then (10 s by default); now in well under a second, the
    thread left to end by itself when the open returns (in a decode process too)."""
    silent = silent_camera()
    url = f"rtsp://127.0.0.1:{silent.getsockname()[1]}/cam"
    try:
        async with started_file_manager(
            pool, tmp_path / "data", decode_processes=decode_processes, open_timeout_s=8
        ) as m:
            gone = await m.add(url)
            off = await m.add(url)
            await asyncio.sleep(0.5)  # both in their open
            started = time.monotonic()
            assert await m.remove(gone["id"])
            removed_s = time.monotonic() - started
            started = time.monotonic()
            info = await m.update(off["id"], {"enabled": False})
            disabled_s = time.monotonic() - started
            assert info is not None and info["state"] == StreamState.DISABLED
            started = time.monotonic()
            await m.put(off["id"], f"file://{CAR_CLIP}", detect=StreamDetect())
            assert await m.wait_state(off["id"], {StreamState.LIVE}, 30)
            replaced_s = time.monotonic() - started
    finally:
        silent.close()
    assert removed_s < 2 and disabled_s < 2, (removed_s, disabled_s)
    assert replaced_s < 10, replaced_s


async def test_streams_stored_past_a_lowered_limit_are_kept_not_opened(
    pool: EnginePool, tmp_path: Path
) -> None:
    """Restarted with a lower --max-streams than it has streams: every stored stream was
    opened. Those past the limit are kept, failed, saying why and which setting."""
    options = ManagerOptions(
        reader=ReaderOptions(open_timeout_s=5, read_timeout_s=5), allowed_file_dir=VIDEOS[0].parent
    )
    manager = StreamManager(pool, StreamStore(tmp_path / "data"), options)
    await manager.start()
    try:
        ids = [(await manager.add(f"file://{CAR_CLIP}", max_fps=1.0))["id"] for _ in range(3)]
    finally:
        await manager.stop(5.0)
    lowered = dataclasses.replace(options, max_streams=2)
    again = StreamManager(pool, StreamStore(tmp_path / "data"), lowered)
    await again.start()
    try:
        states = {s["id"]: s for s in again.list()}
        assert set(states) == set(ids)  # kept
        assert await again.wait_state(ids[0], {StreamState.LIVE}, 30)
        assert states[ids[2]]["state"] == StreamState.FAILED
        assert "limit 2 (setting STREAMDET_MAX_STREAMS)" in states[ids[2]]["last_error"]
    finally:
        await again.stop(5.0)


def _first_seconds(clip: Path, seconds: float, out: Path) -> Path:
    """The first ``seconds`` of ``clip`` (its packets copied) as ``out``."""
    with av.open(str(clip)) as source, av.open(str(out), "w") as target:
        video = source.streams.video[0]
        copy = target.add_stream_from_template(video)
        assert video.time_base is not None
        for packet in source.demux(video):
            if packet.pts is None or packet.pts * video.time_base > seconds:
                continue
            packet.stream = copy
            target.mux(packet)
    return out


@pytest.mark.parametrize("how", ["disabled", "removed", "ended"])
async def test_objects_in_zones_leave_them_lost_when_the_stream_shows_nothing(
    pool: EnginePool, tmp_path: Path, how: str
) -> None:
    """A stream switched off (or removed) with cars in a zone left their stays open: its
    ``now`` was empty while entries outnumbered exits, and the exits came, dated then, when
    it was switched on again, or never. They leave, ``lost``, when it stops showing them,
    logged before the change that stopped it."""
    from streams.zones import Zone

    whole = Zone("all", ((0.0, 0.0), (1.0, 0.0), (1.0, 1.0), (0.0, 1.0)), inertia=1)
    detect = StreamDetect(DetectParams(classes=frozenset({2})), track=True, zones=(whole,))
    clip = _first_seconds(CAR_CLIP, 5.6, tmp_path / "cut.mp4") if how == "ended" else CAR_CLIP
    async with started_file_manager(pool, tmp_path / "data", allowed_dir=clip.parent) as m:
        info = await m.add(
            f"file://{clip}",
            max_fps=None if how == "ended" else 5,
            detect=detect,
            stream_id="road",
            loop=how != "ended",
        )

        def inside() -> int:
            zone = (m.describe("road") or {}).get("zones", {}).get("all", {})
            return int(sum(zone.get("entered", {}).values())) - int(
                sum(zone.get("exited", {}).values())
            )

        if how != "ended":
            await eventually(lambda: inside() > 0, 60)  # a car in the zone
        if how == "disabled":
            await m.update("road", {"enabled": False})
        elif how == "removed":
            await m.remove("road")
        else:  # played once to its end, with cars in it
            assert await m.wait_state("road", {StreamState.STOPPED}, 60)
            await asyncio.sleep(1.0)  # its last frames, in the engine as it ended
        logged = m.events.read(0, 500, EventFilter(streams=frozenset({"road"}))).events
        kinds = [(e["type"], e.get("lost"), e.get("state")) for e in logged]
        last_state = max(i for i, k in enumerate(kinds) if k[0] == "stream_state")
        enters = sum(1 for t, _, _ in kinds if t == "zone_enter")
        exits = sum(1 for t, _, _ in kinds if t == "zone_exit")
        lost = [i for i, (t, gone, _) in enumerate(kinds) if t == "zone_exit" and gone]
        assert enters == exits and lost and enters, kinds
        if how != "ended":  # there: in its last frames, processed after it ended
            assert all(i < last_state for i in lost), kinds  # before the change
        if how != "removed":
            assert inside() == 0
            # Its zone removed while it shows nothing: its counts go now (with no next
            # frame, they stayed, and their metric series, until it ran again).
            await m.update("road", {"detect": StreamDetect(track=True)})
            assert (m.describe("road") or {})["zones"] == {}
        assert info["id"] == "road"


def test_a_slow_stream_s_rate_is_read_from_its_last_frames_until_the_next_is_overdue() -> None:
    """A stream processing a frame every 4 s (max_fps 0.25) read 0 frames a second: fewer
    than two frames fell in the 3 s the rate was taken over."""
    meter = RateMeter()
    assert meter.rate(0.0) == 0.0
    for t in (0.0, 4.0, 8.0, 12.0):
        meter.tick(t)
    assert meter.rate(12.5) == pytest.approx(0.25)
    assert meter.rate(19.9) == pytest.approx(0.25)  # the next is due at 16 s, not overdue
    assert meter.rate(20.5) == 0.0  # it stopped
    fast = RateMeter()
    for i in range(30):
        fast.tick(100 + i / 10)
    assert fast.rate(103.0) == pytest.approx(10.0)
    assert fast.rate(106.0) == 0.0  # stopped: its last 3 s are empty and the next overdue
    # Stopped, as its last frames age out of the 3 s: 0 from a second on, not their rate
    # rising (a camera killed at 25 fps read 25, then 93 frames a second, reconnecting).
    camera = RateMeter()
    for i in range(100):
        camera.tick(200 + i / 25 + (0.02 if i % 2 else 0.0))  # jittered, 25 a second
    assert camera.rate(204.0) == pytest.approx(25, rel=0.05)
    assert [camera.rate(204 + s) for s in (1.1, 2.0, 2.9)] == [0.0, 0.0, 0.0]
