"""Webhooks: every event of the event log (``streams/events.py``) POSTed to each URL of the
``webhooks`` setting as it happens, as Roboflow Inference's webhook sink and Frigate's MQTT
events do.

Each webhook is a reader of the log with its own cursor, so a slow or failing receiver holds
no memory of its own and never delays a stream or another webhook. Events go in batches of up
to :data:`BATCH` (``{"events": [...]}``, the objects ``GET /events`` returns, ids growing), in
order. A POST that fails (no answer within ``webhook_timeout_s``, or a status other than 2xx)
is retried with the same events, backing off from 0.5 s to 30 s; events that leave the log
while a receiver is down are counted (``streamdet_webhook_events_total{outcome="missed"}``)
and logged, never dropped silently. With ``webhook_secret`` set each body is signed:
``X-Streamdet-Signature: sha256=<HMAC-SHA256 of the body, hex>``, as GitHub signs its hooks.
On shutdown, what is left is delivered within the drain time.

Webhooks come from the setting, or are added at run time (``POST /webhooks``,
``server/routes/webhooks.py``), each with its own secret and filters (only a door camera's
people, say), kept across restarts with their cursors.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from server.metrics import Metrics
from server.routes.paths import link_base, served_event
from server.settings import check_webhook_url
from streams.events import EVERY_EVENT, EventFilter, EventLog, LogReader

log = logging.getLogger(__name__)
BATCH = 100
BACKOFF_INITIAL_S = 0.5
BACKOFF_MAX_S = 30.0
SIGNATURE_HEADER = "X-Streamdet-Signature"


def label(url: str, *, masked: bool = True) -> str:
    """The URL as logs, metrics and the API show it: no credentials, query or fragment (they
    may hold tokens), and, ``masked``, no path segment that looks like a token: Slack's and
    Discord's webhook URLs, Home Assistant's webhook ids carry their secret in the path, which
    any read-only key saw (``GET /webhooks``, ``/metrics``). Such a segment (16 characters or
    more, letters with digits, or 32 or more) shows as ``***`` and its last 4 characters."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    path = parts.path
    if masked:
        path = "/".join(_masked(segment) for segment in path.split("/"))
    return f"{parts.scheme}://{host}{path}"


NAME_KEY_FILE = "webhook-names.key"
_name_key = bytearray(os.urandom(16))  # this process's until load_name_key reads the kept one


def load_name_key(data_dir: Path) -> None:
    """Key the hash in webhooks' names (:func:`name`) with this server's own secret, kept in
    ``data_dir`` (made once, readable by the server alone), so a name is the same after a
    restart. Unkeyed, anyone reading ``GET /webhooks`` or ``/metrics`` could check guesses
    of a short hidden secret (a 4-digit ``?token=``, a dictionary password) against it."""
    path = data_dir / NAME_KEY_FILE
    with contextlib.suppress(OSError):
        if len(key := path.read_bytes()) >= 16:
            _name_key[:] = key
            return
    key = os.urandom(16)
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning(
            "webhooks: cannot keep the key of their names in %s (%s): names with a hidden"
            " part change at each start (setting STREAMDET_DATA_DIR)",
            path,
            exc,
        )
    _name_key[:] = key


def name(url: str) -> str:
    """The webhook as ``GET /webhooks`` and ``/metrics``' ``webhook`` label show it: its
    :func:`label`, and where that hides something (credentials, a query, a fragment, a
    token-like segment) `` #`` and the first 8 hex digits of the whole URL's HMAC-SHA-256
    under the server's key (:func:`load_name_key`), as exporters name a secret they must tell
    apart: two URLs that differ only in what is hidden (two Slack hooks whose tokens end
    alike) had one series, their counts added up."""
    shown = label(url)
    if shown == url:
        return shown
    return f"{shown} #{name_digest(url)}"


def name_digest(url: str) -> str:
    """The 8 hex digits that tell ``url`` apart in its :func:`name`."""
    return hmac.new(_name_key, url.encode(), hashlib.sha256).hexdigest()[:8]


def _masked(segment: str) -> str:
    mixed = any(c.isdigit() for c in segment) and any(c.isalpha() for c in segment)
    if len(segment) >= 32 or (len(segment) >= 16 and mixed):
        return f"***{segment[-4:]}"
    return segment


def http_client(timeout_s: float) -> httpx.AsyncClient:
    """The client webhooks and job callbacks are POSTed with: it follows no redirect (a
    ``3xx`` is a failed delivery, ``HTTP 307``), so a receiver's answer cannot send the
    event, and its signature, to another address."""
    return httpx.AsyncClient(timeout=timeout_s, follow_redirects=False)


async def post_json(
    client: httpx.AsyncClient, url: str, payload: object, secret: str | None
) -> str | None:
    """POST ``payload`` as JSON, signed with ``secret`` if given; the reason it failed (an
    error, or a status outside 2xx), or None."""
    body = json.dumps(payload, separators=(",", ":")).encode()
    headers = {"Content-Type": "application/json", "User-Agent": "streamdet"}
    if secret:
        headers[SIGNATURE_HEADER] = sign(secret, body)
    try:
        response = await client.post(url, content=body, headers=headers)
    except httpx.TimeoutException as exc:  # httpx's have no message: it said "ReadTimeout"
        limits = client.timeout
        what, waited = {
            httpx.ConnectTimeout: ("no connection", limits.connect),
            httpx.WriteTimeout: ("the request not sent", limits.write),
            httpx.PoolTimeout: ("no connection free", limits.pool),
        }.get(type(exc), ("no answer", limits.read))
        within = f" within {waited:g} s" if waited else ""
        return f"{type(exc).__name__}: {what}{within} (setting STREAMDET_WEBHOOK_TIMEOUT_S)"
    except Exception as exc:  # any failure is the caller's to retry
        return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if not 200 <= response.status_code < 300:
        return f"HTTP {response.status_code}"
    return None


def sign(secret: str, body: bytes) -> str:
    """The signature header's value for ``body``."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


class WebhookSender:
    """Delivers the log's events to one URL, from the events after ``start`` on.

    Args:
        url: where to POST.
        events: the event log.
        secret: signs each body when set.
        timeout_s: time the receiver has to answer one POST.
        metrics: counts events sent and missed, and failed POSTs.
        webhook_id: the id of one added at run time (its cursor is kept under it); None for
            one of the setting (kept under its URL).
        wanted: the events it sends (the others are passed over).
        about: what ``GET /webhooks`` shows of one added at run time (its filter, whether
            it signs, when it was added).
        root_path: the events' paths (snapshot, thumbnail, clip) start with it, as
            ``GET /events`` gives them behind the proxy (``--root-path``): no request is in
            scope here.
        public_url: where receivers reach the app (``--public-url``): the events' paths
            are absolute URLs under it instead, which a receiver can fetch.
    """

    def __init__(
        self,
        url: str,
        events: EventLog,
        secret: str | None,
        timeout_s: float,
        metrics: Metrics | None = None,
        *,
        webhook_id: str | None = None,
        wanted: EventFilter = EVERY_EVENT,
        about: dict[str, Any] | None = None,
        root_path: str = "",
        public_url: str | None = None,
    ) -> None:
        self.url = check_webhook_url(url)
        self._base = link_base(root_path, public_url)
        self.name = name(url)
        self.id = webhook_id
        self.about = about or {"filter": {}, "signed": secret is not None, "created_at": None}
        # Its cursor is kept under its URL (unmasked: on the server's own disk), so a restart
        # carries on where it was; where the label leaves out a query or credentials, the
        # whole URL's SHA-256 tells it apart (two hooks differing only in ?token= shared one
        # row: the one behind lost its events at the restart).
        plain = label(url, masked=False)
        legacy = f"webhook {plain}"  # how such a hook's row was named before
        taken = None
        if webhook_id is not None:
            sink = f"webhook {webhook_id}"
        elif plain == url:
            sink = legacy
        else:
            sink = f"{legacy} #{hashlib.sha256(url.encode()).hexdigest()[:16]}"
            if events.store is not None and events.store.cursor(sink) is None:
                taken = events.store.cursor(legacy)
        # Logged by its masked name: the sink's name holds the URL, and a Slack, Discord
        # or Home Assistant hook's secret is in its path.
        self._reader = LogReader(sink, events, self._count, wanted, shown=f"webhook {self.name}")
        if taken is not None:  # carried on from the row it had before
            self._reader.cursor = min(taken, events.last_id)
            events.save_cursor(sink, self._reader.cursor)
        self._secret = secret
        self._timeout_s = timeout_s
        self._metrics = metrics
        if metrics is not None:  # its series from the start, at 0: rates and alerts see them
            metrics.webhook_failures.labels(self.name)
            for outcome in ("sent", "missed"):
                metrics.webhook_events.labels(self.name, outcome)
        self.failures = 0
        self.last_error: str | None = None
        self.last_error_at: float | None = None
        self.last_sent_at: float | None = None

    def forget(self) -> None:
        """Deleted: its cursor is no longer kept (one row a webhook ever added, before)."""
        self._reader.log.drop_cursor(self._reader.sink)

    def unlabel(self) -> None:
        """Deleted, and no other webhook has its URL: its metric series go (a series a
        webhook ever added stayed in ``/metrics`` until the restart)."""
        if self._metrics is None:
            return
        with contextlib.suppress(KeyError):
            self._metrics.webhook_failures.remove(self.name)
        for outcome in ("sent", "missed"):
            with contextlib.suppress(KeyError):
                self._metrics.webhook_events.remove(self.name, outcome)

    def describe(self) -> dict[str, Any]:
        """How it is doing, as ``GET /webhooks`` shows it."""
        return {
            "id": self.id,
            "source": "setting" if self.id is None else "api",
            "url": self.name,
            **self.about,
            "pending": self.pending,
            "sent": self.sent,
            "missed": self.missed,
            "failures": self.failures,
            "last_error": self.last_error,
            "last_error_at": self.last_error_at,
            "last_sent_at": self.last_sent_at,
        }

    @property
    def pending(self) -> int:
        """Events logged and not delivered yet."""
        return self._reader.pending

    @property
    def missed(self) -> int:
        """Events that left the log before they could be sent."""
        return self._reader.missed

    @property
    def sent(self) -> int:
        """Events delivered."""
        return self._reader.sent

    async def run(self) -> None:
        """Deliver until the log closes and everything in it was delivered (or cancelled)."""
        backoff = BACKOFF_INITIAL_S
        async with http_client(self._timeout_s) as client:
            while True:
                page = await self._reader.take(BATCH, 60.0)
                if page is None:
                    return
                if not page.events:
                    continue
                error = await self._post(client, page.events)
                if error is None:
                    self._reader.delivered(page.next, len(page.events))
                    self.last_sent_at = time.time()
                    backoff = BACKOFF_INITIAL_S
                    continue
                self.failures += 1
                self.last_error, self.last_error_at = error, time.time()
                if self._metrics is not None:
                    self._metrics.webhook_failures.labels(self.name).inc()
                log.warning(
                    "webhook %s: %d event(s) not delivered (%s); retrying in %.1f s",
                    self.name,
                    len(page.events),
                    error,
                    backoff,
                )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2.0, BACKOFF_MAX_S)

    async def _post(
        self, client: httpx.AsyncClient, events: Sequence[dict[str, Any]]
    ) -> str | None:
        """POST one batch; the reason it failed, or None."""
        served = [served_event(event, self._base) for event in events]
        return await post_json(client, self.url, {"events": served}, self._secret)

    def _count(self, outcome: str, n: int) -> None:
        if self._metrics is not None:
            self._metrics.webhook_events.labels(self.name, outcome).inc(n)


class Webhooks:
    """Every webhook's sender task, started and stopped with the app."""

    def __init__(self, senders: Sequence[WebhookSender]) -> None:
        self.senders = list(senders)
        self._tasks: dict[WebhookSender, asyncio.Task[None]] = {}
        self._started = False

    def start(self) -> None:
        self._started = True
        for sender in self.senders:
            self._start(sender)

    def _start(self, sender: WebhookSender) -> None:
        log.info("webhook %s: sending events", sender.id or sender.name)
        self._tasks[sender] = asyncio.create_task(sender.run(), name=f"webhook {sender.name}")

    def add(self, sender: WebhookSender) -> None:
        """One more webhook (added at run time), sending from now on."""
        self.senders.append(sender)
        if self._started:
            self._start(sender)

    def find(self, webhook_id: str) -> WebhookSender | None:
        return next((s for s in self.senders if s.id == webhook_id), None)

    async def remove(self, webhook_id: str) -> bool:
        """Stop and forget the webhook ``webhook_id`` (what it had not sent is not sent);
        False if unknown."""
        sender = self.find(webhook_id)
        if sender is None:
            return False
        self.senders.remove(sender)
        task = self._tasks.pop(sender, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        sender.forget()
        if not any(s.name == sender.name for s in self.senders):
            sender.unlabel()  # its metric series go with it (another of its URL keeps them)
        return True

    async def stop(self, timeout_s: float) -> None:
        """After the log finished: wait up to ``timeout_s`` for what is left to go out, then
        cancel."""
        if not self._tasks:
            return
        _, pending = await asyncio.wait(self._tasks.values(), timeout=timeout_s)
        for task in pending:
            task.cancel()
        for task in self._tasks.values():
            with contextlib.suppress(asyncio.CancelledError):
                await task
            if not task.cancelled() and task.exception() is not None:
                log.error("webhook task ended with %r", task.exception())
        for sender in self.senders:
            if sender.pending:
                log.warning(
                    "webhook %s: %d event(s) not delivered at shutdown (setting"
                    " STREAMDET_SHUTDOWN_TIMEOUT_S gives receivers longer)",
                    sender.name,
                    sender.pending,
                )
