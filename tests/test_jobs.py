"""Video jobs (``POST /jobs``): a recorded video read through on the engines' background
lane, against the real model, the real clips and the real app; no timing is asserted."""

from __future__ import annotations

import asyncio
import csv
import errno
import io
import itertools
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import av
import numpy as np
import pytest
import uvicorn
from fastapi.testclient import TestClient
from starlette.applications import Starlette
from starlette.routing import Mount
from starlette.staticfiles import StaticFiles

from benchmarks.events_bench import WebhookReceiver
from benchmarks.make_clip import make_clip
from engines.batching import DeadlineExceeded, WorkItem, WorkResult
from engines.types import DetectParams, Engine, ModelInfo
from engines.yolo import resize
from loadtest.server import free_port
from server.job_video import VIDEO_FILE, AnnotatedVideo
from server.jobs import Job, JobManager, JobState
from server.webhooks import sign
from streams.detect import StreamDetect
from streams.files import iter_video_frames
from streams.frames import decoded_size
from streams.jobs import (
    EVENTS_FILE,
    FRAMES_FILE,
    FrameSource,
    JobProgress,
    JobSpec,
    Sampler,
    local_frames,
    lower_priority,
    run_job,
    sampled_frames,
)
from tests.helpers import (
    BOTTLE_CLIP,
    CACHE_DIR,
    CAR_CLIP,
    GATE,
    MODEL_PT,
    SHELF,
    file_stream_app,
    start_ort_pool,
    turned_video,
)


def test_sampling_keeps_a_grid_of_the_videos_own_time() -> None:
    every = Sampler(None)
    assert all(every.keep(i / 25) for i in range(50))
    ten = Sampler(10.0)
    kept = [i for i in range(250) if ten.keep(i / 25)]  # 10 s of 25 fps
    assert len(kept) == 100  # 10 a second, not every third frame's 8.3
    assert kept[:6] == [0, 3, 5, 8, 10, 13]
    gap = Sampler(1.0)
    assert gap.keep(0.0) and not gap.keep(0.5) and gap.keep(1.0)
    assert gap.keep(100.0) and not gap.keep(100.5) and gap.keep(101.0)  # on from the jump


def test_a_job_thread_yields_the_cpu_and_no_other_thread_does() -> None:
    seen: list[int] = []

    def job_thread() -> None:
        lower_priority(10)
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    thread = threading.Thread(target=job_thread)
    thread.start()
    thread.join()
    assert seen == [10]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) < 10


@pytest.mark.parametrize("decode_max_side", [0, 320], ids=["whole", "decoded-at-320"])
def test_a_jobs_frames_are_those_the_engine_gives_for_the_same_pictures(
    tmp_path: Path, model_info: ModelInfo, ort_engine: Engine, decode_max_side: int
) -> None:
    """Decoded whole, or at most 320 pixels a side (``stream_decode_size``), the boxes in the
    video's own pixels."""
    pool = start_ort_pool(model_info, max_wait_ms=2, max_batch=4)
    try:
        progress = JobProgress()
        detect = StreamDetect(DetectParams(conf=0.25))
        counts = run_job(
            JobSpec(str(BOTTLE_CLIP), detect, fps=1.0, decode_max_side=decode_max_side),
            pool.submit_background,
            tmp_path,
            lambda c: ort_engine.names[c],
            inflight=4,
            cancel=threading.Event(),
            interrupt=threading.Event(),
            progress=progress,
        )
    finally:
        pool.stop(5)
    lines = [json.loads(line) for line in (tmp_path / "frames.ndjson").read_text().splitlines()]
    assert len(lines) == progress.frames_processed == 40  # a 39.9 s clip at 1 frame a second
    assert progress.frames_failed == 0 and progress.frames_read == 1189
    assert [line["pts"] for line in lines[:3]] == [0.0, 1.0056, 2.0112]
    # The same frames decoded on their own and run through the engine directly.
    step = [line["frame"] for line in lines]
    frames = [f for i, f in enumerate(iter_video_frames(BOTTLE_CLIP)) if i in set(step)]
    size = decoded_size(640, 360, decode_max_side)
    assert size == ((640, 360) if decode_max_side == 0 else (320, 180))
    pictures = [frame if size == (640, 360) else resize(frame, size) for frame in frames]
    direct = [
        ort_engine.infer([picture], [detect.params])[0].rescaled(640, 360) for picture in pictures
    ]
    total = 0
    for line, ours in zip(lines, direct, strict=True):
        assert (line["width"], line["height"]) == (640, 360)
        got = line["detections"]
        assert [d["class_name"] for d in got] == [ours.name_of(c) for c in ours.class_ids]
        if got:
            np.testing.assert_allclose([d["box"] for d in got], ours.boxes, atol=0.5)
        total += len(got)
    assert total > 40  # three bottles stand in every frame
    assert counts["detections"]["bottle"] == sum(
        1 for line in lines for d in line["detections"] if d["class_name"] == "bottle"
    )


def test_a_running_jobs_files_hold_each_frame_as_soon_as_it_is_done(
    tmp_path: Path, model_info: ModelInfo
) -> None:
    """Held at its sixth frame, a job's ``frames.ndjson`` already has the five before it (the
    files were written through an 8 kB buffer: followers and "the lines so far" got them
    in bursts, a job's events only at its end)."""
    pool = start_ort_pool(model_info, max_wait_ms=2, max_batch=4)
    held, release, sent = threading.Event(), threading.Event(), [0]

    def submit(item: WorkItem) -> None:
        sent[0] += 1
        if sent[0] != 6:
            pool.submit_background(item)
            return
        held.set()

        def later() -> None:
            release.wait(60)
            pool.submit_background(item)

        threading.Thread(target=later).start()

    progress = JobProgress()
    spec = JobSpec(str(BOTTLE_CLIP), StreamDetect(), fps=2.0)
    job = threading.Thread(
        target=run_job,
        args=(spec, submit, tmp_path, str),
        kwargs={
            "inflight": 1,
            "cancel": threading.Event(),
            "interrupt": threading.Event(),
            "progress": progress,
        },
    )
    job.start()
    try:
        assert held.wait(60)
        time.sleep(0.2)  # the fifth frame's line written, if it ever is before the end
        lines = (tmp_path / "frames.ndjson").read_text().splitlines()
        assert [json.loads(line)["pts"] for line in lines] == [0.0, 0.5028, 1.0056, 1.5084, 2.0112]
    finally:
        release.set()
        job.join(60)
        pool.stop(5)
    assert progress.frames_processed == 80  # the whole clip, 2 a second


def _decoded(mp4: bytes) -> list[tuple[float, np.ndarray]]:
    """Every frame of an MP4 (its time and RGB picture)."""
    import av

    with av.open(io.BytesIO(mp4), "r") as container:
        return [
            (float(frame.time or 0.0), frame.to_ndarray(format="rgb24"))
            for frame in container.decode(video=0)
        ]


def _wait_state(
    c: TestClient, job_id: str, states: set[str], timeout_s: float = 60
) -> dict[str, Any]:
    end = time.monotonic() + timeout_s
    while True:
        job: dict[str, Any] = c.get(f"/jobs/{job_id}", params={"wait_s": 1}).json()
        if job["state"] in states or time.monotonic() > end:
            return job
        time.sleep(0.05)


def test_a_job_counts_a_videos_crossings_while_a_live_stream_goes_on(tmp_path: Path) -> None:
    with TestClient(file_stream_app(tmp_path)) as c:
        live = c.post("/streams", json={"url": f"file://{BOTTLE_CLIP}", "max_fps": 4}).json()
        settings = {"name": "gate footage", "classes": "car", "track": True, "lines": [GATE]}
        created = c.post(
            "/jobs",
            files={"video": ("car.mp4", CAR_CLIP.read_bytes(), "video/mp4")},
            data={"settings": json.dumps({**settings, "fps": 4, "render": True})},
        )
        assert created.status_code == 202, created.text
        job = created.json()
        assert created.headers["location"] == f"/jobs/{job['id']}"
        assert job["source"] == {"upload": "car.mp4", "bytes": CAR_CLIP.stat().st_size}
        assert job["video"]["width"] == 768 and job["video"]["duration_s"] == 30.16
        assert job["settings"]["classes"] == ["car"] and "clips" not in job["settings"]
        assert "queue_position" in job  # the job as GET gives it (0 queued, null running)
        processed_before = c.get(f"/streams/{live['id']}").json()["frames_processed"]
        done = c.get(f"/jobs/{job['id']}", params={"wait_s": 60}).json()
        assert done["state"] == "done", done
        # The camera was served all along: its frames go first, the job's on what is left.
        assert c.get(f"/streams/{live['id']}").json()["frames_processed"] > processed_before
        progress = done["progress"]
        assert progress["frames_read"] == 377 and progress["progress"] == 1.0  # read whole
        frames = c.get(f"/jobs/{job['id']}/frames")
        assert frames.headers["content-type"] == "application/x-ndjson"
        lines = [json.loads(text) for text in frames.text.splitlines()]
        assert len(lines) == progress["frames_processed"] == 121  # 30.16 s at 4 a second
        assert all(b["pts"] - a["pts"] > 0.23 for a, b in itertools.pairwise(lines))
        assert {d["class_name"] for line in lines for d in line["detections"]} == {"car"}
        assert all("track_id" in d for line in lines for d in line["detections"])
        events = [json.loads(t) for t in c.get(f"/jobs/{job['id']}/events").text.splitlines()]
        crossings = done["counts"]["crossings"]["gate"]
        assert (
            len(events)
            == progress["events"]
            == sum(n for side in crossings.values() for n in side.values())
        )
        assert events and all(e["type"] == "line_crossing" and e["pts"] > 0 for e in events)
        in_frames = [e for line in lines for e in line.get("events", ())]
        assert in_frames == events
        # Counted per 10 s of video, by line and direction: a traffic count of the footage.
        counted = c.get(
            f"/jobs/{job['id']}/counts", params={"by": "line,direction", "interval_s": 10}
        ).json()
        assert counted["by"] == ["line", "direction"] and counted["state"] == "done"
        expected_rows: dict[tuple[float, str], int] = {}
        for e in events:
            key = (e["pts"] // 10 * 10, e["direction"])
            expected_rows[key] = expected_rows.get(key, 0) + 1
        assert {
            (row["start"], row["direction"]): row["count"] for row in counted["counts"]
        } == expected_rows
        assert all(row["end"] - row["start"] == 10 for row in counted["counts"])
        as_csv = c.get(f"/jobs/{job['id']}/counts", params={"format": "csv", "by": "line"})
        assert as_csv.text.splitlines() == ["start,end,line,count", f",,gate,{len(events)}"]
        refused = c.get(f"/jobs/{job['id']}/counts", params={"by": "stream_id"})
        assert refused.status_code == 422 and "stream_id" in refused.text
        # The same as CSV: a row per detection, a row per event.
        table = c.get(f"/jobs/{job['id']}/frames", params={"format": "csv"})
        assert table.headers["content-type"].startswith("text/csv")
        rows = list(csv.DictReader(io.StringIO(table.text)))
        assert len(rows) == sum(len(line["detections"]) for line in lines)
        first = next(line for line in lines if line["detections"])
        assert rows[0]["frame"] == str(first["frame"]) and rows[0]["class_name"] == "car"
        assert float(rows[0]["x1"]) == first["detections"][0]["box"][0]
        event_rows = list(
            csv.DictReader(io.StringIO(c.get(f"/jobs/{job['id']}/events?format=csv").text))
        )
        assert [(r["line"], r["direction"], r["pts"]) for r in event_rows] == [
            (e["line"], e["direction"], str(e["pts"])) for e in events
        ]
        assert list(event_rows[0])[-2:] == ["dwell_s", "lost"]  # a zone exit's lost was left out
        assert done["counts"]["tracked"]["car"] >= 2
        # The frames drawn into an MP4: one picture per processed frame, at its own time.
        video = c.get(done["video_url"])
        head = c.head(done["video_url"])  # a player's or a download tool's first call (405)
        assert head.status_code == 200 and head.content == b"", head
        assert head.headers["content-length"] == video.headers["content-length"]
        assert video.status_code == 200 and video.headers["content-type"] == "video/mp4"
        drawn = _decoded(video.content)
        assert len(drawn) == 121 and drawn[0][1].shape == (432, 768, 3)
        assert [round(t, 2) for t, _ in drawn] == [round(line["pts"], 2) for line in lines]
        sources = {i: f for i, f in enumerate(iter_video_frames(CAR_CLIP))}
        for (_, picture), line in zip(drawn, lines, strict=True):
            source = sources[line["frame"]].astype(np.int16)
            # The gate is drawn across the middle of every frame; a car's box where one is.
            gate_row = np.abs(picture[215:217].astype(np.int16) - source[215:217]).mean()
            assert gate_row > 30, (line["frame"], gate_row)
            for d in line["detections"]:
                x1, y1 = (int(v) for v in d["box"][:2])
                edge = picture[y1 + 2 : y1 + 40, max(x1, 1) - 1 : max(x1, 1) + 1]
                ref = source[y1 + 2 : y1 + 40, max(x1, 1) - 1 : max(x1, 1) + 1]
                assert np.abs(edge.astype(np.int16) - ref).mean() > 20, (line["frame"], d)
        ranged = c.get(done["video_url"], headers={"range": "bytes=0-99"})
        assert ranged.status_code == 206 and len(ranged.content) == 100

        # The video as the body, its settings in the query; and a video on the server by URL.
        raw = c.post(
            "/jobs",
            params={"settings": json.dumps({"fps": 0.5, "classes": ["bottle"]})},
            content=BOTTLE_CLIP.read_bytes(),
            headers={"content-type": "video/mp4"},
        )
        by_url = c.post("/jobs", json={"url": f"file://{BOTTLE_CLIP}", "fps": 0.5})
        assert raw.status_code == by_url.status_code == 202, (raw.text, by_url.text)
        assert by_url.json()["source"] == {"url": f"file://{BOTTLE_CLIP}"}
        undrawn = c.get(f"/jobs/{raw.json()['id']}/video.mp4")
        assert (
            undrawn.status_code in {404, 409} and "render" in undrawn.text
        ) or "ends" in undrawn.text
        for other in (raw.json(), by_url.json()):
            finished = c.get(f"/jobs/{other['id']}", params={"wait_s": 60}).json()
            assert finished["state"] == "done" and finished["progress"]["frames_processed"] == 20
            assert finished["counts"]["detections"]["bottle"] >= 40
        listed = c.get("/jobs").json()["jobs"]
        assert [j["id"] for j in listed] == [by_url.json()["id"], raw.json()["id"], job["id"]]
        assert [j["id"] for j in c.get("/jobs", params={"state": "running"}).json()["jobs"]] == []
        metrics = c.get("/metrics").text
        assert 'streamdet_jobs{state="done"} 3.0' in metrics

        assert c.delete(f"/jobs/{job['id']}").status_code == 204
        assert c.get(f"/jobs/{job['id']}").status_code == 404
        assert c.get(f"/jobs/{job['id']}/frames").status_code == 404
        assert not (tmp_path / "data" / "jobs" / job["id"]).exists()
        assert c.delete(f"/jobs/{job['id']}").status_code == 404


def test_bad_jobs_get_clear_errors_and_a_full_server_refuses_more(tmp_path: Path) -> None:
    video = ("car.mp4", CAR_CLIP.read_bytes(), "video/mp4")
    with TestClient(file_stream_app(tmp_path, max_jobs=1, max_job_upload_mb=3)) as c:
        cases: list[tuple[dict[str, Any], int, str]] = [
            (
                {"content": b"\x00garbage" * 100, "headers": {"content-type": "video/mp4"}},
                415,
                "video: not a video FFmpeg can read: Invalid data",
            ),
            ({"files": {"image": video}}, 422, "needs a file field 'video' (got: image)"),
            ({"files": {"video": video}, "data": {"settings": "{"}}, 422, "settings: not JSON"),
            (  # each named (it named the first)
                {"files": {"video": video}, "data": {"settings": '{"clips":true,"motion":true}'}},
                422,
                "clips, motion: a live stream's settings",
            ),
            (
                {"files": {"video": video}, "data": {"settings": '{"classes": "unicorn"}'}},
                422,
                "unicorn",
            ),
            ({"files": {"video": video}, "data": {"settings": '{"fps": 0}'}}, 422, "fps"),
            (  # it was 400 "Too many files" from the parser, before the field was looked at
                {"files": {"video": video, "settings": ("s.json", b"{}", "application/json")}},
                422,
                "'settings' must be JSON text, not a file",
            ),
            (  # 413 as the same JSON as a body is (it was 400)
                {
                    "files": {"video": ("v.mp4", b"x", "video/mp4")},
                    "data": {"settings": " " * (1 << 20) + "{}"},
                },
                413,
                "exceeded maximum size",
            ),
            ({"json": {"url": "rtsp://camera/stream"}}, 422, "a live camera is a stream"),
            ({"json": {"url": "file:///etc/passwd"}}, 422, "outside the allowed directory"),
            ({"json": {"fps": 1}}, 422, "give the video's url, or upload it"),
            ({"content": b"x", "headers": {"content-type": "text/plain"}}, 415, "multipart"),
            (
                {"content": b"\x00" * (4 << 20), "headers": {"content-type": "video/mp4"}},
                413,
                "STREAMDET_MAX_JOB_UPLOAD_MB",
            ),
        ]
        for kwargs, status, words in cases:
            got = c.post("/jobs", **kwargs)
            assert got.status_code == status and words in got.text, (kwargs.keys(), got.text)
        assert c.get("/jobs").json() == {"jobs": []}  # nothing half-made is kept
        assert list((tmp_path / "data" / "jobs").iterdir()) == []

        first = c.post("/jobs", files={"video": video}, data={"settings": '{"render": true}'})
        assert first.status_code == 202  # every frame, drawn: it runs a while
        job_id = first.json()["id"]
        running = _wait_state(c, job_id, {"running"})
        assert running["state"] == "running"
        early = c.get(f"/jobs/{job_id}/video.mp4")
        assert early.status_code == 409 and "ready once it ends" in early.text
        refused = c.post("/jobs", json={"url": f"file://{BOTTLE_CLIP}"})
        assert refused.status_code == 429 and "STREAMDET_MAX_JOBS" in refused.text
        assert refused.headers["retry-after"]
        # Deleting a running job cancels it; its files go once its thread has stopped.
        assert c.delete(f"/jobs/{job_id}").status_code == 204
        assert c.get(f"/jobs/{job_id}").status_code == 404
        end = time.monotonic() + 10
        while (tmp_path / "data" / "jobs" / job_id).exists() and time.monotonic() < end:
            time.sleep(0.1)
        assert not (tmp_path / "data" / "jobs" / job_id).exists()
        # A finished job makes room for a new one: the oldest finished goes.
        small = c.post("/jobs", json={"url": f"file://{BOTTLE_CLIP}", "fps": 0.25})
        assert c.get(f"/jobs/{small.json()['id']}", params={"wait_s": 60}).json()["state"] == "done"
        again = c.post("/jobs", json={"url": f"file://{BOTTLE_CLIP}", "fps": 0.25})
        assert again.status_code == 202
        assert [j["id"] for j in c.get("/jobs").json()["jobs"]] == [again.json()["id"]]


def test_a_full_disk_neither_keeps_a_refused_job_nor_stops_the_jobs_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A full disk: a job refused 507 was kept listed as queued (it never ran, and held a
    place under --max-jobs); a job whose run could not be saved raised out of the runner,
    and every later job stayed queued for ever."""
    full: set[JobState] = set()
    save = JobManager._save

    def saved(self: JobManager, job: Job) -> None:
        if job.state in full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        save(self, job)

    monkeypatch.setattr(JobManager, "_save", saved)
    with TestClient(file_stream_app(tmp_path)) as c:
        full.add(JobState.QUEUED)
        refused = c.post("/jobs", json={"url": f"file://{BOTTLE_CLIP}", "fps": 0.25})
        assert refused.status_code == 507 and "STREAMDET_DATA_DIR" in refused.text
        assert c.get("/jobs").json() == {"jobs": []}
        full.clear()
        full.update({JobState.RUNNING, JobState.DONE})  # its run's saves fail
        unsaved = c.post("/jobs", json={"url": f"file://{BOTTLE_CLIP}", "fps": 0.25}).json()
        job = c.get(f"/jobs/{unsaved['id']}", params={"wait_s": 60}).json()
        assert job["state"] == "done", job  # what the API says; the disk could not keep it
        full.clear()
        after = c.post("/jobs", json={"url": f"file://{BOTTLE_CLIP}", "fps": 0.25}).json()
        job = c.get(f"/jobs/{after['id']}", params={"wait_s": 60}).json()
        assert job["state"] == "done", job  # the runner went on
    unsaved_logs = [r.getMessage() for r in caplog.records if unsaved["id"] in r.getMessage()]
    assert any("cannot save its state" in m and "STREAMDET_DATA_DIR" in m for m in unsaved_logs)


def test_a_job_interrupted_by_a_restart_runs_again_from_the_start(tmp_path: Path) -> None:
    with TestClient(file_stream_app(tmp_path)) as c:
        created = c.post("/jobs", json={"url": f"file://{CAR_CLIP}", "classes": "car"})
        job_id = created.json()["id"]
        end = time.monotonic() + 60
        while c.get(f"/jobs/{job_id}").json()["progress"]["frames_processed"] < 5:
            assert time.monotonic() < end
            time.sleep(0.05)
    # The server stopped with it half done: it waits again, and runs whole at the next start.
    with TestClient(file_stream_app(tmp_path)) as c:
        job = c.get(f"/jobs/{job_id}", params={"wait_s": 60}).json()
        assert job["state"] == "done", job
        assert job["progress"]["frames_processed"] == job["progress"]["frames_read"] == 377
        lines = c.get(f"/jobs/{job_id}/frames").text.splitlines()
        assert [json.loads(line)["frame"] for line in lines] == list(range(377))
    with TestClient(file_stream_app(tmp_path)) as c:  # kept as it ended
        kept = c.get(f"/jobs/{job_id}").json()
        assert kept["state"] == "done" and kept["progress"] == job["progress"]
        assert kept["counts"] == job["counts"]


def test_streamdet_analyze_runs_a_job_without_a_server(tmp_path: Path) -> None:
    streamdet = Path(sys.executable).parent / "streamdet"
    common = ["--model", str(MODEL_PT), "--cache-dir", str(CACHE_DIR)]
    settings = json.dumps({"classes": "bottle", "fps": 0.5, "render": True, "zones": [SHELF]})
    out = tmp_path / "shelf"
    run = subprocess.run(
        [streamdet, "analyze", str(BOTTLE_CLIP), *common, "--settings", settings, "--out", out],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout)
    assert summary == json.loads((out / "job.json").read_text())
    assert summary["progress"]["frames_processed"] == 20
    assert summary["counts"]["detections"]["bottle"] >= 40
    lines = [json.loads(line) for line in (out / "frames.ndjson").read_text().splitlines()]
    assert len(lines) == 20
    assert any(d["zones"] == ["shelf"] for line in lines for d in line["detections"])
    assert len(_decoded((out / "video.mp4").read_bytes())) == 20
    for args, words in (
        ([str(tmp_path / "shelf" / "job.json")], "not a video FFmpeg can read"),
        ([str(BOTTLE_CLIP), "--settings", '{"motion": true}'], "motion: a live stream's setting"),
        ([str(BOTTLE_CLIP), "--settings", '{"classes": "unicorn"}'], "unicorn"),
        (  # it was ignored, the VIDEO argument read
            [str(BOTTLE_CLIP), "--settings", '{"url": "file:///tmp/x.mp4"}'],
            "url: for POST /jobs",
        ),
        ([str(BOTTLE_CLIP), "--out", str(tmp_path / ("x" * 300))], "File name too long"),
        (  # refused before it is read, naming the setting (exit 1, "Invalid argument")
            [str(BOTTLE_CLIP), "--max-image-pixels", "10000"],
            "exceed 10000 pixels (setting STREAMDET_MAX_IMAGE_PIXELS)",
        ),
    ):
        out_args = [] if "--out" in args else ["--out", str(tmp_path / "bad")]
        bad = subprocess.run(
            [streamdet, "analyze", *args, *common, *out_args],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert bad.returncode == 2 and words in bad.stderr, bad.stderr
        assert "Value error" not in bad.stderr  # pydantic's prefix


def test_objects_still_in_a_zone_when_the_video_ends_leave_it(tmp_path: Path) -> None:
    """Bottles on the shelf at the clip's last frame entered the zone and never left it (27
    entries, 23 exits): at a job's end they exit, ``lost``, at the last frame, in its line of
    ``frames.ndjson`` as in ``events.ndjson``."""
    streamdet = Path(sys.executable).parent / "streamdet"
    whole = {"name": "all", "points": [[0, 0], [1, 0], [1, 1], [0, 1]]}
    settings = json.dumps({"track": True, "fps": 5, "zones": [whole]})
    out = tmp_path / "shelf"
    common = ["--model", str(MODEL_PT), "--cache-dir", str(CACHE_DIR), "--settings", settings]
    run = subprocess.run(
        [streamdet, "analyze", str(BOTTLE_CLIP), *common, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    moves = json.loads(run.stdout)["counts"]["zones"]["all"]
    assert sum(moves["entered"].values()) == sum(moves["exited"].values()) > 0, moves
    events = [json.loads(line) for line in (out / "events.ndjson").read_text().splitlines()]
    last = max(e["frame"] for e in events)
    at_end = [e for e in events if e["frame"] == last]
    assert at_end and all(e["type"] == "zone_exit" and e["lost"] for e in at_end), at_end
    frames = [json.loads(line) for line in (out / "frames.ndjson").read_text().splitlines()]
    assert last == frames[-1]["frame"]  # the video's last frame read
    # Its line carries them too: the frames' events are the events file's, line for line.
    assert [e for e in frames[-1].get("events", []) if e["lost"]] == [
        e for e in at_end if e["lost"]
    ]
    assert [e for f in frames for e in f.get("events", [])] == events


def test_a_job_calls_back_when_it_ends_signed_and_retried(tmp_path: Path) -> None:
    receiver = WebhookReceiver(refuse=1)  # the first try fails: the callback is retried
    try:
        with TestClient(file_stream_app(tmp_path, webhook_secret="s3cret")) as c:
            bad = c.post("/jobs", json={"url": f"file://{BOTTLE_CLIP}", "callback_url": "ftp://x"})
            assert bad.status_code == 422 and "callback_url" in bad.text
            port = c.post(  # accepted, then failed on every try: "Invalid port"
                "/jobs", json={"url": f"file://{BOTTLE_CLIP}", "callback_url": "http://h:abc/"}
            )
            assert port.status_code == 422 and "Port could not be cast" in port.text, port.text
            created = c.post(
                "/jobs",
                json={"url": f"file://{BOTTLE_CLIP}", "fps": 0.25, "callback_url": receiver.url},
            )
            assert created.status_code == 202
            job_id = created.json()["id"]
            end = time.monotonic() + 60
            while not receiver.calls:
                assert time.monotonic() < end, "no callback"
                time.sleep(0.1)
            _, headers, body = receiver.calls[0]
            assert headers["X-Streamdet-Signature"] == sign("s3cret", body)
            sent = json.loads(body)["job"]
            assert sent["id"] == job_id and sent["state"] == "done"
            assert sent["counts"]["detections"]["bottle"] >= 20
            while c.get(f"/jobs/{job_id}").json()["callback"]["state"] == "pending":
                assert time.monotonic() < end
                time.sleep(0.1)
            callback = c.get(f"/jobs/{job_id}").json()["callback"]
            assert callback == {
                "url": receiver.url.split("?")[0],  # its token is not shown
                "state": "sent",
                "attempts": 2,
                "last_error": None,
            }
            assert len(receiver.calls) == 1
    finally:
        receiver.close()


def test_jobs_keep_their_files_under_the_size_they_may_take(tmp_path: Path) -> None:
    car = {"video": ("car.mp4", CAR_CLIP.read_bytes(), "video/mp4")}
    jobs_dir = tmp_path / "data" / "jobs"
    with TestClient(file_stream_app(tmp_path, jobs_max_mb=4)) as c:
        first = c.post("/jobs", files=car, data={"settings": '{"fps": 0.5}'}).json()
        done = c.get(f"/jobs/{first['id']}", params={"wait_s": 60}).json()
        assert done["state"] == "done" and done["bytes"] > CAR_CLIP.stat().st_size
        # An upload that would need its room but is refused (not a video) deletes nothing
        # (the finished job went before its probe refused it), nor does a refused request.
        garbage = b"\x00" * CAR_CLIP.stat().st_size
        refused = c.post("/jobs", content=garbage, headers={"content-type": "video/mp4"})
        assert refused.status_code == 415, refused.text
        assert (
            c.post("/jobs", content=b"x", headers={"content-type": "text/plain"}).status_code == 415
        )
        assert [j["id"] for j in c.get("/jobs").json()["jobs"]] == [first["id"]]
        # A second car clip does not fit beside the first: the oldest finished job goes.
        second = c.post("/jobs", files=car)  # every frame: it runs a while
        assert second.status_code == 202
        assert [j["id"] for j in c.get("/jobs").json()["jobs"]] == [second.json()["id"]]
        assert _wait_state(c, second.json()["id"], {"running"})["state"] == "running"
        # A third does not fit beside one still running, and is not kept.
        third = c.post("/jobs", files=car)
        assert third.status_code == 507 and "STREAMDET_JOBS_MAX_MB" in third.text
        huge = c.post("/jobs", content=b"\0" * (5 << 20), headers={"content-type": "video/mp4"})
        assert huge.status_code == 413 and "STREAMDET_JOBS_MAX_MB" in huge.text
        assert [p.name for p in jobs_dir.iterdir()] == [second.json()["id"]]
        assert c.delete(f"/jobs/{second.json()['id']}").status_code == 204


def test_a_job_reads_a_video_served_over_http(tmp_path: Path) -> None:
    # A web server that answers range requests, as nginx or object storage do: FFmpeg seeks
    # an MP4 whose index is at its end.
    port = free_port()
    files = Starlette(routes=[Mount("/", StaticFiles(directory=BOTTLE_CLIP.parent))])
    web = uvicorn.Server(uvicorn.Config(files, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=web.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}/{BOTTLE_CLIP.name}"
    try:
        end = time.monotonic() + 30
        while not web.started:
            assert time.monotonic() < end, "web server did not start"
            time.sleep(0.05)
        with TestClient(file_stream_app(tmp_path)) as c:
            created = c.post("/jobs", json={"url": url, "fps": 0.5, "classes": "bottle"})
            assert created.status_code == 202, created.text
            assert created.json()["video"]["duration_s"] == 39.855
            job = c.get(f"/jobs/{created.json()['id']}", params={"wait_s": 60}).json()
            assert job["state"] == "done" and job["progress"]["frames_processed"] == 20
            assert job["source"] == {"url": url}
            missing = c.post("/jobs", json={"url": url.replace(BOTTLE_CLIP.name, "gone.mp4")})
            assert missing.status_code == 422 and "video: not a video FFmpeg can read" in (
                missing.text
            )
    finally:
        web.should_exit = True
        thread.join(10)


def test_following_a_jobs_frames_streams_each_as_it_is_done(tmp_path: Path) -> None:
    """``GET /jobs/{id}/frames?follow=true`` against a real server: lines arrive while the
    job runs, the response ends by itself when the job does, and holds every frame."""
    import httpx

    from loadtest.server import ServerProcess

    settings: dict[str, object] = {
        "model": str(MODEL_PT),
        "imgsz": 640,
        "cache_dir": str(CACHE_DIR),
        "data_dir": str(tmp_path / "data"),
        "shutdown_timeout_s": 5,
    }
    server = ServerProcess(settings, log_path=tmp_path / "server.log", ready_timeout_s=180)
    server.start()
    try:
        with httpx.Client(base_url=server.base_url, timeout=120) as client:
            created = client.post(
                "/jobs",
                files={"video": ("car.mp4", CAR_CLIP.read_bytes(), "video/mp4")},
                data={"settings": json.dumps({"fps": 8, "classes": "car"})},
            )
            assert created.status_code == 202, created.text
            job_id = created.json()["id"]
            refused = client.get(f"/jobs/{job_id}/frames?follow=true&format=csv")
            assert refused.status_code == 422 and "format=csv" in refused.text
            followed: list[dict[str, Any]] = []
            state_at_first = ""
            with client.stream("GET", f"/jobs/{job_id}/frames", params={"follow": True}) as r:
                assert r.status_code == 200
                assert r.headers["content-type"] == "application/x-ndjson"
                for text in r.iter_lines():
                    followed.append(json.loads(text))
                    if len(followed) == 1:
                        state_at_first = client.get(f"/jobs/{job_id}").json()["state"]
            done = client.get(f"/jobs/{job_id}").json()
            whole = client.get(f"/jobs/{job_id}/frames").text.splitlines()
    finally:
        server.stop(30)
    assert state_at_first == "running"  # streamed while the job ran, not after
    assert done["state"] == "done"
    assert len(followed) == done["progress"]["frames_processed"] == 241  # 30.16 s at 8 a second
    assert followed == [json.loads(text) for text in whole]


# ---- what a crash leaves: a fresh JobManager on the files ------------------------------------

NAMES = {0: "person", 2: "car"}


def _manager(directory: Path, frames: FrameSource | None = None) -> JobManager:
    return JobManager(
        directory,
        lambda item: None,
        NAMES,
        max_jobs=10,
        concurrency=1,
        inflight=1,
        max_pixels=1 << 30,
        frames=frames,
    )


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _kept(manager: JobManager, state: JobState, **changed: Any) -> Job:
    """A job as ``job.json`` keeps it, with a 1000-byte video beside it."""
    job = Job(
        id=manager.new_id(),
        name="footage",
        created_at=time.time(),
        source={"upload": "car.mp4", "bytes": 1000},
        target=str(CAR_CLIP),
        options={},
        video={},
        detect=StreamDetect(),
        fps=None,
        state=state,
        **changed,
    )
    manager.directory_of(job.id).mkdir(parents=True)
    (manager.directory_of(job.id) / "source.mp4").write_bytes(b"x" * 1000)
    manager._save(job)
    return job


async def test_a_running_job_deleted_just_before_a_crash_stays_deleted(tmp_path: Path) -> None:
    """``DELETE`` answered 204, the server was killed before the job's thread stopped: its
    ``job.json`` still said running, and the next start ran it again (and called back)."""
    manager = _manager(tmp_path)
    job = _kept(manager, JobState.RUNNING, callback_url="http://127.0.0.1:9/done")
    manager._jobs[job.id] = job
    assert await manager.delete(job.id)
    assert manager.directory_of(job.id).is_dir()  # its thread would delete it: the crash
    # A save under way when DELETE came writes job.json again: the job stays deleted.
    job.deleted = False
    manager._save(job)
    fresh = _manager(tmp_path)
    await fresh.start()
    try:
        assert fresh.get(job.id) is None and fresh.all() == []
        assert _names(tmp_path) == []
    finally:
        await fresh.stop(1)


async def test_a_start_deletes_uploads_a_crash_cut_off_and_keeps_unreadable_jobs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An upload cut off by a crash left ``jobs/<id>/source.mp4`` and no ``job.json``: never
    listed, never counted in ``--jobs-max-mb``, never deleted. A job whose ``job.json``
    cannot be read keeps its files (someone may want them)."""
    manager = _manager(tmp_path)
    kept = _kept(manager, JobState.DONE)
    (tmp_path / "cutoff").mkdir()
    (tmp_path / "cutoff" / "source.mp4").write_bytes(b"x" * 4096)
    (tmp_path / "empty").mkdir()
    (tmp_path / "unreadable").mkdir()
    (tmp_path / "unreadable" / "job.json").write_text("{")
    (tmp_path / "unreadable" / "source.mp4").write_bytes(b"x" * 10)
    # A field of another type (a callback as a string) failed the whole start.
    (tmp_path / "mistyped").mkdir()
    record = json.loads((tmp_path / kept.id / "job.json").read_text())
    (tmp_path / "mistyped" / "job.json").write_text(json.dumps({**record, "callback": "x"}))
    (tmp_path / "notes.txt").write_text("not a job")
    fresh = _manager(tmp_path)
    await fresh.start()
    try:
        assert [job.id for job in fresh.all()] == [kept.id]
        size = (tmp_path / kept.id / "job.json").stat().st_size + 1000
        assert fresh.bytes_used() == size
    finally:
        await fresh.stop(1)
    assert _names(tmp_path) == sorted([kept.id, "mistyped", "notes.txt", "unreadable"])
    assert f"{tmp_path / 'mistyped' / 'job.json'}" in caplog.text
    assert _names(tmp_path / "unreadable") == ["job.json", "source.mp4"]
    assert f"{tmp_path / 'cutoff'} (4096 bytes)" in caplog.text
    assert f"{tmp_path / 'empty'} (0 bytes)" in caplog.text


async def test_a_job_still_in_a_frame_when_the_server_stops_is_not_counted_a_crash(
    tmp_path: Path,
) -> None:
    """A graceful stop whose wait ends while a job's thread is inside a slow frame (a remote
    video, a large HEVC frame): the run was left counted as crashed, and three restarts
    failed a good job as one that kills the server."""
    release = threading.Event()

    def slow(
        spec: JobSpec, progress: JobProgress, stopped: Callable[[], None], max_side: int
    ) -> Generator[tuple[int, float, Any, tuple[int, int]], None, None]:
        release.wait(30)  # a frame that takes longer than the shutdown waits
        stopped()
        yield from ()

    job = _kept(_manager(tmp_path), JobState.QUEUED)
    try:
        for _ in range(3):
            manager = _manager(tmp_path, slow)
            await manager.start()
            running = manager.get(job.id)
            assert running is not None
            deadline = time.monotonic() + 10
            while running.state is not JobState.RUNNING:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            await manager.stop(0.2)  # the thread is still in its frame
            on_disk = json.loads((tmp_path / job.id / "job.json").read_text())
            assert (on_disk["state"], on_disk["crashed_runs"]) == ("queued", 0), on_disk
    finally:
        release.set()
    fresh = _manager(tmp_path, slow)
    await fresh.start()
    try:
        again = fresh.get(job.id)
        assert again is not None
        await fresh.wait(again, 30)
        assert again.state is JobState.DONE, again.error
    finally:
        await fresh.stop(1)


async def test_a_job_the_server_keeps_dying_during_fails_instead_of_running_again(
    tmp_path: Path,
) -> None:
    """A job that kills the server (out of memory, a decoder crash) ran again at every start:
    the server crash-looped. Each run is counted in ``job.json`` before it begins, and back
    to 0 when it ends; after 3 runs the server died during, the job fails saying so."""
    seen: list[dict[str, Any]] = []

    def frames(
        spec: JobSpec, progress: JobProgress, stopped: Callable[[], None], max_side: int
    ) -> Generator[tuple[int, float, Any, tuple[int, int]], None, None]:
        seen.extend(json.loads(p.read_text()) for p in tmp_path.glob("*/job.json"))
        yield from ()

    manager = _manager(tmp_path)
    twice = _kept(manager, JobState.RUNNING, crashed_runs=2)
    thrice = _kept(manager, JobState.RUNNING, crashed_runs=3, callback_url="http://127.0.0.1:9/")
    for partial in (FRAMES_FILE, EVENTS_FILE):  # what its last run wrote before the crash
        (tmp_path / thrice.id / partial).write_text('{"frame": 0}\n' * 125)
    (tmp_path / thrice.id / VIDEO_FILE).write_bytes(b"\0\0\0\x20ftypisom" + bytes(36))
    fresh = _manager(tmp_path, frames)
    await fresh.start()
    try:
        failed = fresh.get(thrice.id)
        assert failed is not None and failed.state is JobState.FAILED
        assert failed.error is not None and "during each of its last 3 runs" in failed.error
        assert failed.callback is not None  # called back, as any job that ends
        # No results of a run its progress does not count (it ran no frame).
        assert failed.progress.frames_processed == 0
        assert not (tmp_path / thrice.id / FRAMES_FILE).exists()
        assert not (tmp_path / thrice.id / EVENTS_FILE).exists()
        assert not (tmp_path / thrice.id / VIDEO_FILE).exists()  # a 48-byte 200 video/mp4
        again = fresh.get(twice.id)
        assert again is not None
        await fresh.wait(again, 30)
        assert again.state is JobState.DONE, again.error
        # While it ran, its job.json counted the run: a crash then would have made it 3.
        assert [r["crashed_runs"] for r in seen if r["id"] == twice.id] == [3]
        assert [r["state"] for r in seen if r["id"] == twice.id] == ["running"]
    finally:
        await fresh.stop(1)
    on_disk = json.loads((tmp_path / twice.id / "job.json").read_text())
    assert on_disk["state"] == "done" and on_disk["crashed_runs"] == 0
    on_disk = json.loads((tmp_path / thrice.id / "job.json").read_text())
    assert on_disk["state"] == "failed" and "3 runs" in on_disk["error"]


def test_a_failed_frame_is_logged_under_the_jobs_id_never_its_urls_password(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A frame the engines answered with an error is logged as ``job <id>: frame N failed``,
    once at WARNING and the rest at DEBUG: it named the job by its URL, password and token
    and all, one WARNING a frame."""
    url = "https://admin:Pw4711secret@cam.example/v.mp4?token=Tok0815secret"

    def clip_frames(
        spec: JobSpec, progress: JobProgress, stopped: Callable[[], None], max_side: int
    ) -> Generator[tuple[int, float, Any, tuple[int, int]], None, None]:
        real = JobSpec(str(BOTTLE_CLIP), spec.detect, fps=spec.fps)  # the clip, on disk
        yield from local_frames(real, progress, stopped, max_side)

    def expire(item: WorkItem) -> None:
        item.on_done(WorkResult(None, DeadlineExceeded("expired in the queue"), 0.0, 0.0, 0))

    caplog.set_level(logging.DEBUG, "streams.jobs")
    progress = JobProgress()
    run_job(
        JobSpec(url, StreamDetect(DetectParams()), fps=1.0),
        expire,
        tmp_path,
        str,
        inflight=2,
        cancel=threading.Event(),
        interrupt=threading.Event(),
        progress=progress,
        job_id="j0b1d",
        frames=clip_frames,
    )
    assert progress.frames_failed == 40
    failed = [r for r in caplog.records if "failed" in r.getMessage()]
    assert len(failed) == 40
    assert all(r.getMessage().startswith("job j0b1d: frame ") for r in failed)
    assert [r.levelno for r in failed] == [logging.WARNING] + [logging.DEBUG] * 39
    assert "Pw4711secret" not in caplog.text and "Tok0815secret" not in caplog.text


def test_a_video_cut_short_fails_its_job_with_its_results_so_far(tmp_path: Path) -> None:
    """The car clip's first 1.4 MB of 2.8 (an upload or copy interrupted): its index says
    30.16 s, its frames end at 13.6 s, and the job was "done" as if it were whole. It fails
    saying where the video ends, its frames so far kept."""
    cut = CAR_CLIP.read_bytes()[:1_400_000]
    with TestClient(file_stream_app(tmp_path, job_inflight=8)) as c:
        created = c.post("/jobs", content=cut, headers={"content-type": "video/mp4"})
        assert created.status_code == 202, created.text
        job = c.get(f"/jobs/{created.json()['id']}", params={"wait_s": 60}).json()
        assert job["state"] == "failed", job
        assert "ends at 13.6" in job["error"] and "of the 30.16 s its index states" in job["error"]
        assert "cut short" in job["error"]
        assert job["progress"]["frames_processed"] > 100, job
        # Every frame read is kept: those sent to run when the end was found were lost.
        assert job["progress"]["frames_processed"] == job["progress"]["frames_read"], job
        frames = c.get(f"/jobs/{job['id']}/frames").text.splitlines()
        assert len(frames) == job["progress"]["frames_processed"]
        # Their counts too (null: the totals of 140 frames were lost).
        counts = job["counts"]
        assert counts is not None, job
        assert sum(counts["detections"].values()) == sum(
            len(json.loads(line)["detections"]) for line in frames
        )
        whole = c.post("/jobs", json={"url": f"file://{BOTTLE_CLIP}", "fps": 0.5})
        done = c.get(f"/jobs/{whole.json()['id']}", params={"wait_s": 60}).json()
        assert done["state"] == "done" and done["error"] is None, done


def test_a_queued_jobs_file_whose_directory_became_a_link_out_is_not_read(
    tmp_path: Path,
) -> None:
    """A ``file://`` job is checked when sent and read when its turn comes: a directory on
    its path swapped for a link to one outside meanwhile made it read the file there."""
    allowed, outside = tmp_path / "videos", tmp_path / "private"
    (allowed / "sub").mkdir(parents=True)
    outside.mkdir()
    shutil.copy(CAR_CLIP, allowed / "long.mp4")
    make_clip(CAR_CLIP, allowed / "sub" / "a.mp4", width=320, height=240, fps=25, gop=25, frames=10)
    make_clip(CAR_CLIP, outside / "a.mp4", width=384, height=216, fps=25, gop=25, frames=10)
    app = file_stream_app(tmp_path, allowed_file_dir=allowed, job_concurrency=1)
    with TestClient(app) as c:
        first = c.post("/jobs", json={"url": f"file://{allowed}/long.mp4"}).json()["id"]
        queued = c.post("/jobs", json={"url": f"file://{allowed}/sub/a.mp4"})
        assert queued.status_code == 202 and queued.json()["state"] == "queued", queued.text
        (allowed / "sub").rename(allowed / "old")
        (allowed / "sub").symlink_to(outside)
        assert c.delete(f"/jobs/{first}").status_code == 204
        job = c.get(f"/jobs/{queued.json()['id']}", params={"wait_s": 60}).json()
        assert job["state"] == "failed" and "a link now stands on its path" in job["error"], job
        assert job["progress"]["frames_read"] == 0, job


def _shifted(source: Path, out: Path, by_s: float, length_s: float, from_s: float = 0.0) -> None:
    """The first ``length_s`` of ``source``'s video, its times from ``from_s`` on ``by_s``
    later (a recording cut from a longer one, or an MPEG-TS that starts at 1.4 s; a part
    missing), copied without decoding."""
    with av.open(str(source)) as given, av.open(str(out), "w") as copy:
        video = given.streams.video[0]
        base = video.time_base
        assert base is not None
        copied = copy.add_stream_from_template(video)
        shift = round(by_s / base)
        for packet in given.demux(video):
            if packet.dts is None:
                continue
            if packet.pts is not None and packet.pts * base > length_s:
                break
            if packet.dts * base >= from_s:
                packet.pts = None if packet.pts is None else packet.pts + shift
                packet.dts += shift
            packet.stream = copied
            copy.mux(packet)


@pytest.mark.parametrize("container", ["mp4", "ts"])
def test_a_video_that_starts_later_than_0_s_is_timed_from_its_start(
    tmp_path: Path, container: str
) -> None:
    """A video whose first frame is at 100 s: its frames' times, position and progress from
    its start, as players show them (its progress was 1.0 from the first frame, its position
    past its length, and its count rows started at 100 s)."""
    video = tmp_path / f"late.{container}"
    _shifted(CAR_CLIP, video, 100.0, 4.0)
    progress = JobProgress()
    seen: list[tuple[float, float | None]] = []
    spec = JobSpec(str(video), StreamDetect(), fps=1.0)
    times = []
    for _, t, _ in sampled_frames(spec, progress, lambda: None):
        times.append(t)
        seen.append((progress.position_s, progress.to_json()["progress"]))
    assert times[0] < 0.2 and 3.0 < times[-1] <= 4.1, times
    assert [round(b - a, 1) for a, b in itertools.pairwise(times)] == [1.0] * (len(times) - 1)
    shares = [share for _, share in seen]
    assert all(share is not None and share < 1.0 for share in shares[:-1]), seen
    assert progress.position_s <= 4.2 and progress.to_json()["progress"] == 1.0, progress


def _one_frame(path: Path, codec: str, size: tuple[int, int]) -> bytes:
    """A one-frame video of ``codec`` at ``size``, its bytes."""
    with av.open(str(path), "w") as out:
        stream = out.add_stream(codec, rate=1)
        assert isinstance(stream, av.VideoStream)
        stream.width, stream.height = size
        stream.pix_fmt = "yuvj420p" if codec == "mjpeg" else "yuv420p"
        black = av.VideoFrame.from_ndarray(np.zeros((size[1], size[0], 3), np.uint8), "rgb24")
        for packet in [*stream.encode(black.reformat(format=stream.pix_fmt)), *stream.encode()]:
            out.mux(packet)
    return path.read_bytes()


def test_frames_over_the_pixel_limit_are_refused_as_too_large_whatever_their_codec(
    tmp_path: Path,
) -> None:
    """MPEG-4 Part 2, MJPEG, a PNG: FFmpeg learns their size by decoding a frame, which the
    bound decoders refused; the job was refused 415 "not a video FFmpeg can read: Invalid
    argument" where an H.264 video of the same size got 413 naming the setting."""
    import io

    from PIL import Image as PILImage

    png = io.BytesIO()
    PILImage.new("RGB", (800, 600)).save(png, "PNG")
    videos = {
        "big.avi": _one_frame(tmp_path / "big.avi", "mpeg4", (800, 600)),
        "big.mkv": _one_frame(tmp_path / "big.mkv", "mjpeg", (800, 600)),
        "big.png": png.getvalue(),
    }
    with TestClient(file_stream_app(tmp_path, max_image_pixels=300_000)) as c:
        for name, data in videos.items():
            answer = c.post("/jobs", files={"video": (name, data, "application/octet-stream")})
            assert answer.status_code == 413, (name, answer.text)
            assert "800x600" in answer.text and "STREAMDET_MAX_IMAGE_PIXELS" in answer.text
        small = _one_frame(tmp_path / "small.avi", "mpeg4", (320, 240))
        fits = c.post("/jobs", files={"video": ("small.avi", small, "video/x-msvideo")})
        assert fits.status_code == 202, fits.text


def test_a_video_whose_server_stalls_mid_read_fails_naming_the_read_timeout(
    tmp_path: Path,
) -> None:
    """A web server that sends half the video, then nothing: the job fails saying no data
    came for the read timeout, and its setting (it said FFmpeg's "Immediate exit
    requested")."""
    import http.server

    data = CAR_CLIP.read_bytes()
    release = threading.Event()

    class Stalling(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "video/mp4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            release.wait(60)

        def log_message(self, format: str, *args: object) -> None:
            pass

    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Stalling)
    web.daemon_threads = True
    threading.Thread(target=web.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{web.server_address[1]}/car.mp4"
    try:
        with TestClient(file_stream_app(tmp_path, stream_read_timeout_s=1.0)) as c:
            created = c.post("/jobs", json={"url": url, "fps": 2})
            assert created.status_code == 202, created.text
            job = c.get(f"/jobs/{created.json()['id']}", params={"wait_s": 60}).json()
            assert job["state"] == "failed", job
            assert job["error"].startswith("reading the video failed at "), job["error"]
            assert "no data for 1 s (setting STREAMDET_STREAM_READ_TIMEOUT_S)" in job["error"]
    finally:
        release.set()
        web.shutdown()
        web.server_close()


def test_a_video_its_container_turns_is_read_as_players_show_it(tmp_path: Path) -> None:
    """A phone's video: landscape frames and a display matrix turning them a quarter
    clockwise. Its job's frames, size and boxes are those of the upright picture (they were
    the sideways frames': a zone drawn on the picture the user sees landed elsewhere)."""
    from streams.jobs import probe

    image = np.zeros((96, 160, 3), np.uint8)
    image[:24, :24] = 255  # top left, stored: top right, shown
    video = turned_video(tmp_path / "phone.mp4", image, frames=5)
    about = probe(str(video))
    assert (about["width"], about["height"]) == (96, 160), about
    spec = JobSpec(str(video), StreamDetect())
    frames = [frame for _, _, frame in sampled_frames(spec, JobProgress(), lambda: None)]
    assert len(frames) == 5
    for frame in frames:
        picture = frame.to_ndarray(format="rgb24")
        assert picture.shape == (160, 96, 3)
        assert picture[:24, -24:].mean() > 200 and picture[:24, :24].mean() < 50
    assert [frame.time for frame in frames] == [0.0, 0.1, 0.2, 0.3, 0.4]


def test_a_bad_job_is_refused_for_what_is_wrong_with_it_even_when_the_server_is_full(
    tmp_path: Path,
) -> None:
    """With every job place taken, a request that could never run was told 429 and to retry
    in 60 s: its settings are checked first (422), as an upload's query settings are."""
    with TestClient(file_stream_app(tmp_path, max_jobs=1)) as c:
        running = c.post("/jobs", json={"url": f"file://{BOTTLE_CLIP}"})
        assert running.status_code == 202, running.text
        bad = c.post("/jobs", json={"url": f"file://{BOTTLE_CLIP}", "bogus": 1})
        assert bad.status_code == 422 and "bogus" in bad.text, bad.text
        scheme = c.post("/jobs", json={"url": "ftp://host/x.mp4"})
        assert scheme.status_code == 422 and "ftp" in scheme.text, scheme.text
        query = c.post(
            "/jobs",
            content=b"\x00" * 100,
            params={"settings": '{"fps": -1}'},
            headers={"content-type": "video/mp4"},
        )
        assert query.status_code == 422 and "fps" in query.text, query.text
        # A misspelt or repeated option is named (setting= ran the job on every class,
        # settings twice took the last, wait= did not wait).
        for pairs, named in (
            ([("setting", '{"classes": "person"}')], "'setting': not an option here"),
            ([("settings", '{"fps": 1}'), ("settings", '{"fps": 50}')], "'settings' given more"),
        ):
            misspelt = c.post(
                f"/jobs?{urlencode(pairs)}",  # params= keeps one of a name given twice
                content=b"\x00" * 100,
                headers={"content-type": "video/mp4"},
            )
            assert misspelt.status_code == 422 and named in misspelt.text, misspelt.text
        waited = c.get(f"/jobs/{running.json()['id']}", params={"wait": 30})
        assert waited.status_code == 422 and "'wait': not an option" in waited.text, waited.text
        assert "wait_s" in waited.text
        full = c.post("/jobs", json={"url": f"file://{BOTTLE_CLIP}", "fps": 1})
        assert full.status_code == 429 and "STREAMDET_MAX_JOBS" in full.text, full.text
        assert c.delete(f"/jobs/{running.json()['id']}").status_code == 204
        # Settings where they are not read: the job ran on every class and every frame.
        video = {"video": ("car.mp4", b"\x00" * 100, "video/mp4")}
        queried = c.post("/jobs", files=video, params={"settings": '{"fps": 1}'})
        assert queried.status_code == 422 and "query: settings: read only" in queried.text
        for field in ("fps", "setting"):
            form = c.post("/jobs", files=video, data={field: "3"})
            assert form.status_code == 422, form.text
            assert f"multipart field {field!r}: send only" in form.text, form.text
        unnamed = c.post("/jobs", json={"url": f"file://{BOTTLE_CLIP}"}, params={"filename": "x"})
        assert unnamed.status_code == 422, unnamed.text
        assert "query: filename: read only beside the video itself" in unnamed.text
        assert c.get("/jobs").json()["jobs"] == []  # none was made


def test_a_video_with_a_part_missing_says_how_much(tmp_path: Path) -> None:
    """FFmpeg reads past a missing part (an HLS segment the web server no longer has, a
    recording's break) without a word, and the job was done as if whole: its progress
    says how many seconds are missing (``gaps_s``)."""
    video = tmp_path / "gap.ts"
    _shifted(CAR_CLIP, video, 5.0, 6.0, from_s=3.0)
    progress = JobProgress()
    spec = JobSpec(str(video), StreamDetect(), fps=2.0)
    times = [t for _, t, _ in sampled_frames(spec, progress, lambda: None)]
    assert 4.5 < progress.gaps_s < 5.5, (progress.gaps_s, times)
    assert progress.to_json()["gaps_s"] == round(progress.gaps_s, 3)
    whole = JobProgress()
    list(sampled_frames(JobSpec(str(CAR_CLIP), StreamDetect(), fps=2.0), whole, lambda: None))
    assert whole.gaps_s == 0.0


def test_a_rendered_video_that_grows_keeps_its_whole_picture(tmp_path: Path) -> None:
    """A video whose frames grow part way (a stream may change size at a keyframe) is drawn
    whole, scaled to the size the rendered video opened at: every later frame was cut to its
    top-left corner."""
    small = np.zeros((72, 128, 3), np.uint8)
    large = np.zeros((144, 256, 3), np.uint8)
    large[:, 128:] = 255  # its right half white: cut to 128x72, nothing white was left
    video = AnnotatedVideo(tmp_path / VIDEO_FILE, StreamDetect(), None, {"fps": 10.0})
    counts: dict[str, Any] = {"crossings": {}, "zones": {}}
    for i, image in enumerate((small, small, large, large)):
        video.write(image, None, i / 10, counts)
    video.close()
    frames = _decoded((tmp_path / VIDEO_FILE).read_bytes())
    assert len(frames) == 4
    last = frames[-1][1]
    assert last.shape[:2] == (72, 128)
    assert last[:, 80:].mean() > 200 and last[:, :48].mean() < 50, last.mean(axis=(0, 2))


def test_analyze_names_its_results_by_a_url_s_path_without_its_query() -> None:
    """A signed URL's token was written to disk as the results folder's name (and one too
    long to make was a traceback)."""
    from server.analyze_cli import default_out

    signed = "https://cam.example/rec/car.mp4?X-Amz-Signature=" + "f" * 300
    assert default_out(signed) == Path("car.mp4.streamdet")
    assert default_out("clips/car.mp4") == Path("car.mp4.streamdet")
    assert default_out("https://cam.example/") == Path("video.streamdet")
