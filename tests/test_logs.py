"""What a real server writes to its log and its data directory: no secret (a webhook's token,
a password in a URL), a request id on each request's lines, one format for every line."""

from __future__ import annotations

import http.server
import re
import stat
import threading
import time
from pathlib import Path

import httpx
import pytest

from loadtest.server import ServerProcess, free_port
from server.cli import main
from tests.helpers import CAR_CLIP, MODEL_PT, clip_server

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
