"""Webhooks added at run time (``POST/GET /webhooks``, ``GET/DELETE /webhooks/{id}``): each
with its own secret and filters, shown with how it is doing, kept across a restart; against
a real ``streamdet serve``, a real clip and a real HTTP receiver on loopback."""

from __future__ import annotations

import hmac
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from benchmarks.events_bench import WebhookReceiver
from server.webhooks import label, sign
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
                ({"url": receiver.url, "filter": {"type": "zone_enter,bogus"}}, "['bogus']"),
                ({"url": receiver.url, "filter": {"classes": ["unicorn"]}}, "'unicorn'"),
                ({"url": receiver.url, "filter": {"colour": "red"}}, "colour"),
                ({"url": receiver.url, "sekret": "x"}, "sekret"),
            ):
                refused = c.post("/webhooks", json=body)
                assert refused.status_code == 422 and words in refused.text, refused.text
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
            assert hook["url"] == receiver.url.split("?")[0]  # no query: it may hold a token
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
