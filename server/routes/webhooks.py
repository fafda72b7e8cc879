"""``POST/GET /webhooks``, ``GET/DELETE /webhooks/{id}``: webhooks added at run time, each
with its own secret and filters (the events of some streams, types, classes, zones or
lines), as GitHub's and Stripe's webhook APIs let integrations subscribe to what they need;
and how each webhook is doing (events pending, sent, missed, its last error), those of the
``webhooks`` setting too.

A webhook added here sends the events that come after it, is kept across restarts with its
cursor (a receiver that was down gets what it missed, as far back as the log reaches) and
is removed with ``DELETE``. Its secret is never shown again.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Mapping
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Request, Response
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from server.metrics import Metrics, get_metrics
from server.routes.detect import parse_classes
from server.routes.events import names, parse_types
from server.routes.query import check_query_and_body_type
from server.routes.streams import get_manager
from server.settings import check_webhook_url
from server.state import get_state
from server.webhook_store import WebhookRecord, WebhookStore
from server.webhooks import Webhooks, WebhookSender
from streams.events import EventFilter, EventLog

router = APIRouter(dependencies=[Depends(check_query_and_body_type)])
MAX_WEBHOOKS = 64
Names = list[str] | str | None


class WebhookFilterIn(BaseModel):
    """The events a webhook sends; each criterion given narrows it (lists or comma strings,
    as ``GET /events``' query)."""

    model_config = ConfigDict(extra="forbid")

    stream_id: Annotated[Names, Field(description="stream ids")] = None
    type: Annotated[Names, Field(description="event types")] = None
    classes: Annotated[
        list[StrictStr | StrictInt] | str | None,
        Field(description="class names or ids of the object"),
    ] = None
    zone: Annotated[Names, Field(description="zone names")] = None
    line: Annotated[Names, Field(description="line names")] = None


class WebhookIn(BaseModel):
    """Body of ``POST /webhooks``."""

    model_config = ConfigDict(extra="forbid")

    url: Annotated[str, Field(min_length=1, max_length=2048, description="http(s):// URL")]
    secret: Annotated[
        str | None,
        Field(
            min_length=1,
            max_length=256,
            description="signs each body (X-Streamdet-Signature: sha256=<HMAC, hex>)",
        ),
    ] = None
    filter: WebhookFilterIn | None = None


def filter_spec(body: WebhookFilterIn | None, class_names: Mapping[int, str]) -> dict[str, Any]:
    """A filter as it is kept: lists of names (classes by name), None where not given.

    Raises:
        HTTPException: 422 naming an unknown type or class.
    """
    if body is None:
        return {}
    for key in ("stream_id", "type", "classes", "zone", "line"):
        raw = getattr(body, key)
        if raw is not None and not any(str(item).strip(" ,") for item in _items(raw)):
            # It was kept as no criterion: the webhook was sent every event.
            raise HTTPException(
                422,
                f"filter.{key}: empty, which would pass no event; leave it out to pass every one",
            )

    def listed(raw: Names) -> list[str] | None:
        text = raw if isinstance(raw, str) or raw is None else ",".join(raw)
        found = names(text)
        return None if found is None else sorted(found)

    ids = parse_classes(body.classes, class_names)
    types = parse_types(None if body.type is None else ",".join(listed(body.type) or []))
    spec = {
        "stream_id": listed(body.stream_id),
        "type": None if types is None else sorted(types),
        "classes": None if ids is None else sorted(class_names[i] for i in ids),
        "zone": listed(body.zone),
        "line": listed(body.line),
    }
    return {key: value for key, value in spec.items() if value is not None}


def _items(raw: str | list[str] | list[str | int]) -> list[str | int]:
    return [raw] if isinstance(raw, str) else list(raw)


def event_filter(spec: Mapping[str, Any]) -> EventFilter:
    """The :class:`EventFilter` of a kept filter."""

    def as_set(key: str) -> frozenset[str] | None:
        value = spec.get(key)
        return None if value is None else frozenset(value)

    return EventFilter(
        streams=as_set("stream_id"),
        types=as_set("type"),
        classes=as_set("classes"),
        zones=as_set("zone"),
        lines=as_set("line"),
    )


def make_sender(
    record: WebhookRecord,
    events: EventLog,
    timeout_s: float,
    metrics: Metrics | None,
    *,
    root_path: str = "",
    public_url: str | None = None,
) -> WebhookSender:
    """The sender of a webhook added at run time (now, or before a restart); its events'
    paths under ``root_path`` (the setting), absolute URLs under ``public_url`` where set."""
    about = {
        "filter": record.filter,
        "signed": record.secret is not None,
        "created_at": record.created_at,
    }
    return WebhookSender(
        record.url,
        events,
        record.secret,
        timeout_s,
        metrics,
        webhook_id=record.id,
        wanted=event_filter(record.filter),
        about=about,
        root_path=root_path,
        public_url=public_url,
    )


def _webhooks(request: Request) -> tuple[Webhooks, WebhookStore]:
    state = get_state(request)
    get_manager(request)  # 503 while starting or stopping
    if state.webhooks is None or state.webhook_store is None:
        raise HTTPException(503, "server not ready", headers={"Retry-After": "1"})
    return state.webhooks, state.webhook_store


@router.post("/webhooks", status_code=201)
async def add_webhook(body: WebhookIn, request: Request) -> dict[str, Any]:
    """Send the events that pass ``filter`` from now on to ``url``."""
    webhooks, store = _webhooks(request)
    try:
        check_webhook_url(body.url[:2000], "url", "")
    except ValueError as exc:
        raise HTTPException(422, str(exc)) from None
    added = [s for s in webhooks.senders if s.id is not None]
    if len(added) >= MAX_WEBHOOKS:
        raise HTTPException(409, f"already {len(added)} webhooks, the most; delete one first")
    spec = filter_spec(body.filter, get_state(request).pool.engine.names)
    record = WebhookRecord(uuid.uuid4().hex[:12], body.url, body.secret, spec, time.time())
    state = get_state(request)
    sender = make_sender(
        record,
        get_manager(request).events,
        state.settings.webhook_timeout_s,
        get_metrics(request),
        root_path=state.settings.root_path,
        public_url=state.settings.public_url,
    )
    # Counted at once, before the store's write is awaited: calls at the same moment each
    # see the others (a hundred at once were all let past the limit).
    webhooks.add(sender)
    try:
        await asyncio.to_thread(store.add, record)
    except BaseException:
        await webhooks.remove(record.id)
        raise
    return sender.describe()


@router.get("/webhooks")
async def list_webhooks(request: Request) -> dict[str, Any]:
    """Every webhook (the setting's and those added here) and how it is doing."""
    webhooks, _ = _webhooks(request)
    return {"webhooks": [sender.describe() for sender in webhooks.senders]}


@router.get("/webhooks/{webhook_id}")
async def get_webhook(webhook_id: str, request: Request) -> dict[str, Any]:
    webhooks, _ = _webhooks(request)
    sender = webhooks.find(webhook_id)
    if sender is None:
        raise HTTPException(404, f"no webhook {webhook_id[:64]!r}; list them with GET /webhooks")
    return sender.describe()


@router.delete("/webhooks/{webhook_id}", status_code=204)
async def delete_webhook(webhook_id: str, request: Request) -> Response:
    """Stop sending to a webhook added at run time and forget it."""
    webhooks, store = _webhooks(request)
    unknown = HTTPException(
        404,
        f"no webhook {webhook_id[:64]!r} (those of the webhooks setting are changed there);"
        " list them with GET /webhooks",
    )
    if webhooks.find(webhook_id) is None:
        raise unknown
    # From the store first: a removal it refuses (a full disk: 507) changes nothing. It was
    # stopped, and back at the next start.
    await asyncio.to_thread(store.remove, webhook_id)
    if not await webhooks.remove(webhook_id):
        raise unknown  # another DELETE of it came first
    return Response(status_code=204)
