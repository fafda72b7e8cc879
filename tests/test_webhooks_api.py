"""Webhooks added at run time (``POST/GET /webhooks``, ``GET/DELETE /webhooks/{id}``): each
with its own secret and filters, shown with how it is doing, kept across a restart; against
a real ``streamdet serve``, a real clip and a real HTTP receiver on loopback."""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from benchmarks.events_bench import WebhookReceiver
from server.metrics import Metrics
from server.webhooks import (
    NAME_KEY_FILE,
    Webhooks,
    WebhookSender,
    http_client,
    label,
    load_name_key,
    name,
    name_digest,
    post_json,
    sign,
)
from streams.events import EventLog
from tests.helpers import SHELF_STREAM, clip_server


@pytest.fixture
def receiver() -> Iterator[WebhookReceiver]:
    r = WebhookReceiver()
    yield r
    r.close()


def wait_for(check: Any, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f} s"
        time.sleep(0.2)


def test_a_webhook_added_at_run_time_gets_only_its_events_signed_across_a_restart(
    tmp_path: Path, receiver: WebhookReceiver
) -> None:
    everything = WebhookReceiver()  # the setting's webhook: every event
    server = clip_server(tmp_path, webhooks=everything.url)
    try:
        with server, httpx.Client(base_url=server.base_url, timeout=60) as c:
            for body, words in (
                ({"url": "ftp://x/hook"}, "is not an http:// or https:// URL"),
                # Accepted, kept and tried for ever: "Invalid port", "All connection attempts"
                ({"url": "http://127.0.0.1:abc/x"}, "url: 'http://127.0.0.1:abc/x': Port could"),
                ({"url": "http://127.0.0.1:99999/x"}, "Port out of range"),
                ({"url": "http://exa mple.com/x"}, "not a host and port a request can go to"),
                # A mistyped scheme's error echoed the password
                ({"url": "https:/hookuser:pwSECRET@hooks.example.com/x"}, ":***@hooks.example"),
                ({"url": receiver.url, "filter": {"type": "zone_enter,bogus"}}, "['bogus']"),
                ({"url": receiver.url, "filter": {"classes": ["unicorn"]}}, "'unicorn'"),
                ({"url": receiver.url, "filter": {"classes": [True]}}, "classes"),  # not 1
                ({"url": receiver.url, "filter": {"colour": "red"}}, "colour"),
                ({"url": receiver.url, "sekret": "x"}, "sekret"),
                # Kept as no criterion, it was sent every event.
                ({"url": receiver.url, "filter": {"type": []}}, "filter.type: empty"),
                ({"url": receiver.url, "filter": {"zone": " , "}}, "filter.zone: empty"),
            ):
                refused = c.post("/webhooks", json=body)
                assert refused.status_code == 422 and words in refused.text, refused.text
                assert "pwSECRET" not in refused.text
            added = c.post(
                "/webhooks",
                json={
                    "url": receiver.url,
                    "secret": "s3cret",
                    "filter": {"type": ["zone_enter"], "classes": "bottle,39"},
                },
            )
            assert added.status_code == 201, added.text
            hook = added.json()
            assert hook["filter"] == {"type": ["zone_enter"], "classes": ["bottle"]}
            assert hook["signed"] is True and "secret" not in hook and hook["source"] == "api"
            load_name_key(tmp_path / "data")  # the server's key, kept in its data directory
            assert hook["url"] == name(receiver.url)  # no query: it may hold a token
            assert hook["url"].startswith(receiver.url.split("?")[0] + " #")
            listed = c.get("/webhooks").json()["webhooks"]
            assert [h["source"] for h in listed] == ["setting", "api"]
            assert c.post("/streams", json={**SHELF_STREAM, "track": True}).status_code == 201
            wait_for(receiver.events, "the webhook's first event")
            wait_for(
                lambda: any(e["type"] == "stream_state" for e in everything.events()),
                "the setting's webhook",
            )
            # The receiver has the event before the server has its answer and counts it sent.
            wait_for(
                lambda: c.get(f"/webhooks/{hook['id']}").json()["sent"] >= 1,
                "the webhook's delivery counted",
            )
            status = c.get(f"/webhooks/{hook['id']}").json()
            assert status["last_sent_at"] is not None and status["last_error"] is None
    finally:
        everything.close()
    got = receiver.events()
    assert got and all((e["type"], e["class_name"]) == ("zone_enter", "bottle") for e in got)
    for _, headers, sent in receiver.calls:
        assert hmac.compare_digest(headers["X-Streamdet-Signature"], sign("s3cret", sent))

    # After a restart it is still there, and it can be deleted; a setting's one cannot.
    with server, httpx.Client(base_url=server.base_url, timeout=60) as c:
        again = c.get(f"/webhooks/{hook['id']}")
        assert again.status_code == 200 and again.json()["filter"] == hook["filter"]
        series = f'streamdet_webhook_failures_total{{webhook="{hook["url"]}"}}'
        assert series in c.get("/metrics").text
        assert c.delete(f"/webhooks/{hook['id']}").status_code == 204
        assert series not in c.get("/metrics").text  # its metric series go with it
        assert everything.url.split("?")[0] in c.get("/metrics").text  # the others stay
        assert c.get(f"/webhooks/{hook['id']}").status_code == 404
        gone = c.delete("/webhooks/nope")
        assert gone.status_code == 404 and "webhooks setting" in gone.text
    with server, httpx.Client(base_url=server.base_url, timeout=60) as c:
        left = c.get("/webhooks").json()["webhooks"]
        assert [h["source"] for h in left] == ["setting"]  # deleted for good


def test_a_webhook_urls_secret_path_is_masked_where_it_is_shown() -> None:
    """Slack's and Discord's webhook URLs carry their secret in the path: ``GET /webhooks`` and
    ``/metrics`` showed it to any read-only key. Token-like segments are masked (their last
    4 characters kept, to tell two apart); credentials and queries were already gone."""
    slack = "https://hooks.slack.com/services/T0001ABCD/B0002EFGH/abcdEFGH1234ijklMNOP5678"
    assert label(slack) == "https://hooks.slack.com/services/T0001ABCD/B0002EFGH/***5678"
    token = "x" * 60 + "Zz_9"
    discord = f"https://discord.com/api/webhooks/123456789012345678/{token}"
    assert label(discord) == "https://discord.com/api/webhooks/123456789012345678/***Zz_9"
    plain = "http://user:pw@ha.local:8123/api/webhook/streamdet-front?token=abc"
    assert label(plain) == "http://ha.local:8123/api/webhook/streamdet-front"
    assert label(slack, masked=False) == slack  # the key its delivery cursor is kept under


async def test_webhook_urls_shown_alike_keep_their_own_metric_series() -> None:
    """Two Slack URLs whose secrets end alike were both ``.../***5678``: one ``/metrics``
    series counted for both, and deleting one left the other's counts under a name it shared.
    A URL with something hidden is named with a short hash of the whole URL beside it."""
    first = "https://hooks.slack.com/services/T0001ABCD/B0002EFGH/abcdEFGH1234ijklMNOP5678"
    second = "https://hooks.slack.com/services/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"
    query = ("https://example.com/hook?token=abc", "https://example.com/hook?token=xyz")
    metrics = Metrics()
    log = EventLog(size=10, start_id=1)
    senders = [
        WebhookSender(url, log, None, 5.0, metrics, webhook_id=str(n))
        for n, url in enumerate((first, second, *query))
    ]
    names = [s.name for s in senders]
    assert len(set(names)) == 4, names
    digest = name_digest(first)
    assert digest != hashlib.sha256(first.encode()).hexdigest()[:8]  # keyed: no guess-check
    assert names[0] == f"https://hooks.slack.com/services/T0001ABCD/B0002EFGH/***5678 #{digest}"
    assert names[2].startswith("https://example.com/hook #") and "abc" not in names[2]
    assert all("MNOP" not in n and "MLKJ" not in n for n in names)  # no more of the secret
    # Stable: the same URL has the same name after a restart (a new sender, a new process).
    assert WebhookSender(first, log, None, 5.0, webhook_id="9").name == names[0]
    # A URL with nothing hidden is named by itself, as before.
    plain = "http://ha.local:8123/api/webhook/streamdet-front"
    assert WebhookSender(plain, log, None, 5.0).name == plain

    def failures(name: str) -> float | None:
        return metrics.registry.get_sample_value(
            "streamdet_webhook_failures_total", {"webhook": name}
        )

    metrics.webhook_failures.labels(names[0]).inc(3)
    assert (failures(names[0]), failures(names[1])) == (3.0, 0.0)  # not added up
    webhooks = Webhooks(senders)
    assert await webhooks.remove("0")
    assert failures(names[0]) is None and failures(names[1]) == 0.0  # only its series went


def test_webhook_names_are_keyed_by_the_data_dirs_own_key(tmp_path: Path) -> None:
    """The hash in a webhook's name is keyed with a secret kept in the data directory: the
    same after a restart (the key read back), another server's different, and no one reading
    GET /webhooks can check guesses of a short hidden token against it (it was a plain
    SHA-256: a 4-digit ?token= fell to 10,000 hashes)."""
    url = "https://example.com/hook?token=4821"
    load_name_key(tmp_path / "a")
    key_file = tmp_path / "a" / NAME_KEY_FILE
    assert key_file.stat().st_mode & 0o777 == 0o600
    first = name(url)
    load_name_key(tmp_path / "b")
    other = name(url)
    load_name_key(tmp_path / "a")  # a restart on the first data directory
    assert name(url) == first != other
    candidates = (f"https://example.com/hook?token={n:04d}" for n in range(10_000))
    guesses = {hashlib.sha256(c.encode()).hexdigest()[:8] for c in candidates}
    assert first.rsplit("#", 1)[1] not in guesses  # the unkeyed hash of the right guess was


async def test_a_delivery_answered_with_a_redirect_fails_and_is_not_sent_on(
    receiver: WebhookReceiver,
) -> None:
    """A webhook's or callback's receiver answering 307 (which keeps the POST and its body)
    does not get the event and its signature sent to the address it names: the delivery
    fails as ``HTTP 307`` (README: where the server connects)."""
    import http.server
    import threading

    class Redirect(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", "0")))
            self.send_response(307)
            self.send_header("Location", receiver.url)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/hook"
        async with http_client(5.0) as client:
            error = await post_json(client, url, {"events": [{"id": 1}]}, "secret")
            assert error == "HTTP 307"
            # The same client delivers to the receiver itself: it was reachable all along.
            assert await post_json(client, receiver.url, {"events": [{"id": 2}]}, "s") is None
    finally:
        server.shutdown()
        server.server_close()
    assert receiver.events() == [{"id": 2}]


async def test_a_receiver_that_answers_too_slowly_is_said_to_with_the_setting() -> None:
    """A receiver slower than --webhook-timeout-s was reported as "ReadTimeout" alone (httpx's
    timeouts have no message): not told from a network fault, nor the setting to raise."""
    from server.webhooks import http_client, post_json
    from tests.helpers import silent_camera

    silent = silent_camera()  # accepts the connection, never answers
    try:
        async with http_client(0.3) as client:
            port = silent.getsockname()[1]
            why = await post_json(client, f"http://127.0.0.1:{port}/hook", {"events": []}, None)
    finally:
        silent.close()
    assert why == "ReadTimeout: no answer within 0.3 s (setting STREAMDET_WEBHOOK_TIMEOUT_S)"
