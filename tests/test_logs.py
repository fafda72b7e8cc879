"""What a real server writes to its log and its data directory: no secret (a webhook's token,
a password in a URL), a request id on each request's lines, one format for every line."""

from __future__ import annotations

import http.server
import itertools
import logging
import re
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import av
import cv2
import httpx
import pytest

from loadtest.server import ServerProcess, free_port
from server.cli import main
from streams.decode_procs import DecodeHub
from streams.reader import OutageLog, ReaderOptions, StreamConfig, StreamReader, StreamState
from streams.sources import parse_source
from tests.helpers import (
    CAR_CLIP,
    MODEL_PT,
    SnapshotCamera,
    clip_server,
    silent_camera,
    wait_until,
)

KEY = "LogsKey4711full"
HOOK_TOKEN = "HookTok0815secret"
HOOK_PASSWORD = "HookPw2323secret"


class Receiver:
    """A webhook receiver on 127.0.0.1 that keeps the paths it was sent to."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        got = self.paths

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", 0)))
                got.append(self.path)
                self.send_response(200)
                self.end_headers()

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.port = free_port()
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> tuple[ServerProcess, Path]:
    """A server with API keys and a webhook whose URL holds a password and a token; a file
    stream added, an event made and sent, then the server stopped: its whole log to read."""
    tmp = tmp_path_factory.mktemp("logs")
    receiver = Receiver()
    hook = f"http://hooks:{HOOK_PASSWORD}@127.0.0.1:{receiver.port}/door?token={HOOK_TOKEN}"
    server = clip_server(tmp, api_keys=KEY, webhooks=hook, imgsz=320)
    server.start()
    try:
        auth = {"Authorization": f"Bearer {KEY}"}
        with httpx.Client(base_url=server.base_url, timeout=30) as client:
            added = client.post(
                "/streams", headers=auth, json={"id": "cam", "url": f"file://{CAR_CLIP}"}
            )
            assert added.status_code == 201, added.text
            made = client.post("/streams/cam/events", headers=auth, json={"label": "door"})
            assert made.status_code == 201, made.text
            deadline = time.monotonic() + 30
            while not receiver.paths and time.monotonic() < deadline:
                time.sleep(0.1)
            assert receiver.paths, "the webhook was not sent the event"
            for name, call in {
                "refused_hook": client.post(
                    "/webhooks",
                    headers=auth,
                    json={"url": f"ftp://hooks:{HOOK_PASSWORD}@127.0.0.1/door?token={HOOK_TOKEN}"},
                ),
                "bad_image": client.post(
                    "/detect",
                    headers={**auth, "X-Request-ID": 'forged id "level=ERROR" ' + "z" * 300},
                    content=b"not an image",
                ),
                "no_key": client.get("/streams"),
                "health": client.get("/healthz"),
            }.items():
                (tmp / f"{name}.txt").write_text(
                    f"{call.status_code}\n{call.headers.get('x-request-id', '')}\n{call.text}"
                )
    finally:
        server.stop()
        receiver.server.shutdown()
        receiver.server.server_close()
    return server, tmp


def test_a_webhooks_token_and_password_are_never_logged(
    served: tuple[ServerProcess, Path],
) -> None:
    """httpx logged every webhook POST at INFO with its URL, token and password in clear."""
    server, _ = served
    text = server.log_text()
    assert "webhook" in text
    assert HOOK_TOKEN not in text and HOOK_PASSWORD not in text


def test_a_refused_webhook_urls_password_is_not_echoed(served: tuple[ServerProcess, Path]) -> None:
    """POST /webhooks' 422 quoted the URL whole, password and token."""
    _, tmp = served
    status, _, body = (tmp / "refused_hook.txt").read_text().split("\n", 2)
    assert status == "422" and "ftp://" in body
    assert HOOK_TOKEN not in body and HOOK_PASSWORD not in body


def test_the_stores_holding_secrets_are_readable_by_their_owner_only(
    served: tuple[ServerProcess, Path],
) -> None:
    """streams.sqlite3 (cameras' URLs, passwords and all) and webhooks.sqlite3 were 0644."""
    _, tmp = served
    for name in ("streams.sqlite3", "webhooks.sqlite3"):
        mode = stat.S_IMODE((tmp / "data" / name).stat().st_mode)
        assert mode == 0o600, f"{name}: {mode:o}"


def test_a_clients_request_id_is_bounded_and_cleaned_and_a_refusal_gets_one(
    served: tuple[ServerProcess, Path],
) -> None:
    """A 300-character X-Request-ID with spaces and quotes went into the log as sent, and a
    refused call's line said ``request -``."""
    server, tmp = served
    text = server.log_text()
    status, _, _ = (tmp / "bad_image.txt").read_text().split("\n", 2)
    assert status == "400"
    assert "zzzz" * 70 not in text and '"level=ERROR"' not in text
    clean = "forged_id__level_ERROR__" + "z" * 40
    assert f"request {clean}: rejected image" in text
    status, refused_id, _ = (tmp / "no_key.txt").read_text().split("\n", 2)
    assert status == "401" and re.fullmatch(r"[0-9a-f]{12}", refused_id), refused_id
    assert f"request {refused_id}: GET /streams refused with 401" in text
    assert "request -:" not in text


def test_uvicorns_request_lines_carry_the_request_id_sent_back(
    served: tuple[ServerProcess, Path],
) -> None:
    """uvicorn's request line had no id, so a call's own lines (``request <id>: rejected
    image``) could not be matched with it; every answer now says its id (made where the
    client sent none), which that call's lines all carry."""
    server, tmp = served
    text = server.log_text()
    for name, client_id in (("bad_image", "forged_id__level_ERROR__" + "z" * 40), ("health", None)):
        status, rid, _ = (tmp / f"{name}.txt").read_text().split("\n", 2)
        if client_id is None:
            assert re.fullmatch(r"[0-9a-f]{12}", rid), rid
        else:
            assert rid == client_id
        path = "/detect" if name == "bad_image" else "/healthz"
        access = [line for line in text.splitlines() if f" {path} HTTP/1.1" in line]
        line = re.compile(
            rf"uvicorn\.access: request {rid}: 127\.0\.0\.1:\d+ - \"\w+ {path} HTTP/1\.1\" {status}"
        )
        assert any(line.search(a) for a in access), (rid, access)
    _, refused_id, _ = (tmp / "no_key.txt").read_text().split("\n", 2)
    assert f"request {refused_id}: 127.0.0.1" in text  # its refusal's line and its request line


def test_uvicorns_lines_have_the_servers_format(served: tuple[ServerProcess, Path]) -> None:
    """uvicorn's own format (``INFO:     127.0.0.1:... "GET /streams"``) had no time."""
    server, _ = served
    lines = server.log_text().splitlines()
    access = [line for line in lines if '"GET /streams HTTP/1.1" 401' in line]
    assert access and all(
        re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO uvicorn\.access: ", line)
        for line in access
    ), access
    assert not [line for line in lines if line.startswith("INFO:")]


def test_a_secret_given_as_a_flag_is_warned_of_naming_the_variable(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A key on the command line is in ``ps`` for every user of the machine."""
    taken = tmp_path / "a-file"
    taken.write_text("")
    code = main(["serve", "--model", str(MODEL_PT), "--api-keys", KEY, "--data-dir", str(taken)])
    assert code == 2  # the data dir is a file: it stops before the model loads
    warned = [r.getMessage() for r in caplog.records if "--api-keys" in r.getMessage()]
    assert len(warned) == 1 and "STREAMDET_API_KEYS" in warned[0], warned
    assert KEY not in caplog.text


@pytest.fixture
def camera() -> Iterator[SnapshotCamera]:
    with av.open(str(CAR_CLIP)) as clip:
        frame = next(clip.decode(video=0)).to_ndarray(format="bgr24")
    ok, jpeg = cv2.imencode(".jpg", frame)
    assert ok
    cam = SnapshotCamera(jpeg.tobytes(), status=404)
    yield cam
    cam.close()


FAST = ReaderOptions(open_timeout_s=5, read_timeout_s=5, backoff_initial_s=0.01, backoff_max_s=0.02)
"""Retries every 10-20 ms: a weekend of a dead camera's retries in seconds."""


def _reader_lines(
    mode: str, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> list[str]:
    """``LEVEL message`` of each line ``streams.reader`` logged: here (caplog), or in the
    decode process (its stderr, which it shares with the tests)."""
    if mode == "decode-thread":
        return [
            f"{r.levelname} {r.getMessage()}" for r in caplog.records if r.name == "streams.reader"
        ]
    found = re.findall(r" (\w+) \[decode \d+\] streams\.reader: (.*)", capfd.readouterr().err)
    return [f"{level} {message}" for level, message in found]


@pytest.mark.parametrize("mode", ["decode-thread", "decode-process"])
def test_a_failing_camera_warns_once_per_error_and_says_when_it_is_back(
    mode: str,
    camera: SnapshotCamera,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """A camera that kept failing (a wrong password, a snapshot URL answering 404) logged a
    WARNING and a "reconnect attempt" INFO at every retry: a weekend's flood for one dead
    camera. Now a WARNING at its first failure and when the error changes, an INFO when it
    is back; ``last_error`` says as before, and ``reconnects`` counts none: the camera was
    never live, so it was never reopened (it counted each attempt)."""
    caplog.set_level(logging.INFO)  # before the decode process starts: it takes the level
    config = StreamConfig("door", parse_source(camera.url, None), max_fps=2.0)
    hub = DecodeHub(1, FAST, 8) if mode == "decode-process" else None
    if hub is not None:
        reader: StreamReader = hub.reader(config, lambda sid, item: None, lambda frame: None)
    else:
        reader = StreamReader(config, FAST, lambda sid, item: None, lambda frame: None)
    reader.start()
    try:
        wait_until(lambda: camera.requests >= 6, "the 404s were not retried")
        camera.status = 401
        wait_until(lambda: "401" in (reader.snapshot()["last_error"] or ""), "no 401 said")
        now = camera.requests
        wait_until(lambda: camera.requests >= now + 3, "the 401s were not retried")
        failed = reader.snapshot()
        camera.status = 200
        assert reader.wait_state({StreamState.LIVE}, 30), reader.snapshot()
        time.sleep(0.5)  # the decode process's last lines reach its stderr
    finally:
        reader.stop()
        assert reader.join(10)
        if hub is not None:
            hub.shutdown(10)
    assert failed["state"] == "reconnecting" and "401" in failed["last_error"], failed
    lines = _reader_lines(mode, caplog, capfd)
    warnings = [line for line in lines if line.startswith("WARNING stream door:")]
    assert len(warnings) == 2, lines  # the 404, then the 401
    assert "404" in warnings[0] and "401" in warnings[1] and "failed" in warnings[1], warnings
    retries = [line for line in lines if "reconnect attempt" in line]
    assert len(retries) == 1, lines  # the outage's first; the others at DEBUG
    assert re.fullmatch(r"INFO stream door: reconnect attempt 1 in [\d.]+ s", retries[0]), lines
    back = [line for line in lines if "reconnected after" in line]
    assert len(back) == 1 and back[0].startswith("INFO stream door: reconnected after"), lines
    attempts = int(re.findall(r"after (\d+) attempts", back[0])[0])
    assert attempts >= 8, back
    assert failed["reconnects"] == 0, failed


def test_a_camera_failing_for_long_is_summed_up_every_five_minutes(
    camera: SnapshotCamera, caplog: pytest.LogCaptureFixture
) -> None:
    """Its repeats at DEBUG, a WARNING ``still failing after N attempts over M min`` at most
    every 5 minutes says it is still down (a clock injected: 100 s pass at each failure)."""
    caplog.set_level(logging.INFO)
    reader = StreamReader(
        StreamConfig("door", parse_source(camera.url, None)),
        FAST,
        lambda sid, item: None,
        lambda frame: None,
    )
    ticks = itertools.count(100, 100)
    reader.outage.clock = lambda: float(next(ticks))
    reader.start()
    try:
        wait_until(lambda: reader.outage.failures >= 10, "the 404s were not retried")
    finally:
        reader.stop()
        assert reader.join(10)
    failures = reader.outage.failures
    lines = [r.getMessage() for r in caplog.records if r.name == "streams.reader"]
    summaries = [line for line in lines if "still failing" in line]
    # Failures at 100, 200, ... s: the first warned, each third one after summed up.
    assert len(summaries) == (failures - 1) // 3, lines
    assert summaries[0].startswith("stream door: still failing after 4 attempts over 5 min: ")
    assert "404" in summaries[0], summaries
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1 + len(summaries)


def test_an_outage_after_frames_is_timed_from_the_last_frame_and_its_errors_warned_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A camera lost while live (its stream ended) never began the outage: its first two
    retries were INFO, its attempts were counted one short and its time from the first failed
    retry (the read timeout's seconds missing). Errors alternating (A, B, A) warned at each."""
    caplog.set_level(logging.DEBUG, logger="streams.reader")
    clock = [100.0]
    outage = OutageLog("door", clock=lambda: clock[0])
    outage.lost(last_frame=95.0)  # the last frame 5 s before the loss was seen
    for error in ("refused", "timed out", "refused", "timed out"):
        clock[0] += 1
        outage.retrying(outage.attempts + 1, 1.0)
        outage.failed("rtsp://cam/1", error)
    outage.retrying(5, 1.0)
    clock[0] = 110.0
    outage.recovered()
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert [m for level, m in lines if level == "INFO"] == [
        "stream door: reconnect attempt 1 in 1.00 s",
        "stream door: reconnected after 5 attempts, down 15.0 s",
    ], lines
    warned = [m for level, m in lines if level == "WARNING"]
    assert warned == [
        "stream door: rtsp://cam/1: refused",
        "stream door: rtsp://cam/1: timed out (failed 2 attempts)",
    ], lines
    outage.failed("rtsp://cam/1", "refused")  # the next outage warns afresh
    assert caplog.records[-1].levelname == "WARNING"


def test_a_camera_down_from_the_start_is_down_from_its_first_attempt(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Its outage began at its first failure, the open timeout after the attempt began: a
    camera live 16 s after it was added said "down 4.0 s"."""
    caplog.set_level(logging.INFO, logger="streams.reader")
    clock = [110.0]
    outage = OutageLog("door", clock=lambda: clock[0])
    outage.failed("rtsp://cam/1", "no answer within 10 s", attempt_s=10.0)  # began at 100
    outage.retrying(1, 1.0)
    clock[0] = 116.0
    outage.failed("rtsp://cam/1", "no answer within 10 s", attempt_s=5.0)  # no new outage
    clock[0] = 120.0
    outage.recovered()
    assert caplog.records[-1].getMessage() == (
        "stream door: reconnected after 1 attempts, down 20.0 s"
    )


def test_a_stream_removed_while_it_opens_logs_no_failure_after(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Stopped during an open (a camera that does not answer), the cut-short open was taken
    for a new error: a WARNING and a retry line after the stream was removed."""
    caplog.set_level(logging.DEBUG, logger="streams.reader")
    camera = silent_camera()
    try:
        url = f"rtsp://127.0.0.1:{camera.getsockname()[1]}/cam"
        options = ReaderOptions(open_timeout_s=3, read_timeout_s=3)
        reader = StreamReader(
            StreamConfig("door", parse_source(url, None)),
            options,
            lambda sid, item: None,
            lambda frame: None,
        )
        reader.start()
        wait_until(lambda: reader.snapshot()["state"] == "connecting", "it did not open")
        time.sleep(0.5)  # its open under way, waiting on the camera
        reader.stop()
        assert reader.join(20)  # once the open gives up
    finally:
        camera.close()
    assert reader.snapshot()["state"] == "stopped" and reader.snapshot()["last_error"] is None
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not said and not [r for r in caplog.records if "reconnect attempt" in r.getMessage()]
