"""``GET /events``: line crossings, zone entries and exits, and state changes of every stream,
from the event log (``streams/events.py``).

Two ways to read it:

- JSON pages with a cursor: ``?after=<id>`` (from the oldest event kept when absent), filters
  (``stream_id``, ``type``, ``classes``, ``zone``, ``line``, ``since``, ``until``,
  ``has_clip``, ``has_snapshot``: an audit's "cars that entered the dock yesterday"),
  ``limit``, and ``wait_s`` to long-poll: the call answers as soon as an event passes the
  filters, or after ``wait_s`` with none. The answer's ``next`` is the
  cursor for the next call, ``missed`` the events that left the log before they were read.
  ``?latest=true`` answers the newest ``limit`` events instead, and the cursor after them (a
  dashboard's history, before it follows new ones).
- Server-sent events (``Accept: text/event-stream``, a browser's ``EventSource``): one
  ``data:`` message per event with its ``id``, from new events on (or after ``after``, or
  after the ``Last-Event-ID`` a reconnecting ``EventSource`` sends), a comment every 15 s to
  keep proxies from closing it, and ``{"type": "missed", "missed": n}`` where events were lost.

Each event's frame as a JPEG (``/events/{id}/snapshot.jpg``) and, for streams with ``clips``
on, the video around it (``/clips/{id}.mp4``) are served here too.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, Sequence
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.responses import FileResponse, Response, StreamingResponse

from server.csv_cells import csv_text
from server.ranges import RangedFile
from server.routes.detect import parse_classes
from server.routes.longpoll import wait_unless_gone
from server.routes.paths import root_of, served_event
from server.routes.query import check_query, check_query_and_body_type
from server.routes.streams import get_manager
from server.state import get_state
from streams.events import (
    COUNT_KEYS,
    EVENT_TYPES,
    EventFilter,
    EventLog,
    count_events,
    has_clip,
    has_snapshot,
)
from streams.storage import DATA_DIR_HINT

router = APIRouter(dependencies=[Depends(check_query_and_body_type)])
HEARTBEAT_S = 15.0
MAX_LIMIT = 1000
MAX_WAIT_S = 60.0
CLIP_WAIT_S = 10.0
MAX_INTERVAL_S = 366 * 86400.0


def parse_types(raw: str | None) -> frozenset[str] | None:
    """``type=line_crossing,zone_enter`` as a set; ``None`` (every type) when absent.

    Raises:
        HTTPException: 422 naming an unknown type and the known ones.
    """
    types = frozenset(t.strip() for t in (raw or "").split(",") if t.strip())
    if not types:  # "," too, as classes=, zone= and stream_id= (it matched nothing, silently)
        return None
    unknown = types - EVENT_TYPES
    if unknown:
        raise HTTPException(
            422,
            f"type: unknown event type(s) {sorted(unknown)}; choose from {sorted(EVENT_TYPES)}",
        )
    return types


def names(raw: str | None) -> frozenset[str] | None:
    """``"dock,gate"`` as a set; None (any) when absent or blank."""
    found = frozenset(n.strip() for n in (raw or "").split(",") if n.strip())
    return found or None


# A time in the query as its parser takes it: Unix seconds too, not only the date-time string
# the ``datetime`` type documents (a client generated from the document could not send 1.5e9).
UNIX_OR_ISO: dict[str, Any] = {
    "anyOf": [{"type": "number"}, {"type": "string", "format": "date-time"}, {"type": "null"}]
}


def unix_s(at: datetime | None) -> float | None:
    """A query's date and time as Unix seconds; one without a zone is UTC."""
    if at is None:
        return None
    return (at if at.tzinfo is not None else at.replace(tzinfo=UTC)).timestamp()


async def wanted_events(
    request: Request,
    *,
    stream_id: Annotated[
        str | None, Query(description="comma-separated stream ids: their events only")
    ] = None,
    event_type: Annotated[
        str | None,
        Query(
            alias="type",
            description="comma-separated: line_crossing, zone_enter, zone_exit, zone_loiter,"
            " stream_state, manual",
        ),
    ] = None,
    classes: Annotated[
        str | None, Query(description="comma-separated class names or ids of the object")
    ] = None,
    zone: Annotated[
        str | None, Query(description="comma-separated zone names: entries, exits, loiters")
    ] = None,
    line: Annotated[
        str | None, Query(description="comma-separated line names: their crossings")
    ] = None,
    since: Annotated[
        datetime | None,
        Query(
            description="captured at or after: Unix seconds or ISO 8601 (no zone: UTC)",
            json_schema_extra=UNIX_OR_ISO,
        ),
    ] = None,
    until: Annotated[
        datetime | None,
        Query(
            description="captured before: Unix seconds or ISO 8601 (no zone: UTC)",
            json_schema_extra=UNIX_OR_ISO,
        ),
    ] = None,
    has_clip: Annotated[bool | None, Query(description="with (true) or without a clip")] = None,
    has_snapshot: Annotated[
        bool | None, Query(description="with (true) or without a snapshot")
    ] = None,
) -> EventFilter:
    """The event filters of a call (``GET /events``, ``GET /events/counts``).

    Raises:
        HTTPException: 422 naming an unknown type or class or an empty time range; 404 for
            a stream id that is neither a stream nor in the log (unless the call reads on
            from a cursor).
    """
    check_query(request)  # a misspelt filter (stream=, types=) read or counted every event
    manager = get_manager(request)
    streams = names(stream_id)
    # A reader with a cursor read this stream's events before: a removed stream whose events
    # have all left the log since is an empty page (with what it missed), not a 404.
    reading_on = "after" in request.query_params or "last-event-id" in request.headers
    for sid in () if reading_on else sorted(streams or ()):
        if manager.describe(sid) is None and not manager.events.has_stream(sid):
            raise HTTPException(
                404, f"no stream {sid!r} and no event of one; list streams with GET /streams"
            )
    class_names = get_state(request).pool.engine.names
    ids = parse_classes(classes, class_names)
    start, end = unix_s(since), unix_s(until)
    if start is not None and end is not None and end <= start:
        raise HTTPException(422, "until: must be after since")
    clips_new_from = manager.events.last_id + 1  # events logged from now on: their clips are
    clips_present = None if manager.clips is None else await manager.clips.presence()
    return EventFilter(
        streams=streams,
        types=parse_types(event_type),
        classes=None if ids is None else frozenset(class_names[i] for i in ids),
        zones=names(zone),
        lines=names(line),
        since=start,
        until=end,
        has_clip=has_clip,
        has_snapshot=has_snapshot,
        snapshots_from=snapshots.kept_from() if (snapshots := get_state(request).snapshots) else 0,
        snapshots_lost=snapshots.lost() if snapshots else frozenset(),
        clips_present=clips_present,
        clips_new_from=clips_new_from,
    )


Wanted = Annotated[EventFilter, Depends(wanted_events)]


@router.get("/events", response_model=None)
async def read_events(
    request: Request,
    wanted: Wanted,
    *,
    after: Annotated[
        int | None,
        Query(description="the cursor: events with ids above it (default: the oldest kept)"),
    ] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT, description="most events")] = 100,
    wait_s: Annotated[
        float, Query(ge=0.0, le=MAX_WAIT_S, description="long-poll up to this long for one")
    ] = 0.0,
    latest: Annotated[
        bool,
        Query(description="the newest `limit` events instead (oldest first), and the cursor"),
    ] = False,
) -> dict[str, Any] | StreamingResponse:
    log = get_manager(request).events
    root = root_of(request.scope)
    if "text/event-stream" in request.headers.get("accept", ""):
        if latest:  # it streamed from the newest on, limit unused: as the JSON form says
            raise HTTPException(
                422, "latest: reads the newest events once; a stream of events takes after"
            )
        cursor = _resume_from(request.headers.get("last-event-id"), after, log)
        return StreamingResponse(
            _event_stream(log, cursor, wanted, root),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    if latest:
        if after is not None or wait_s:
            raise HTTPException(422, "latest: reads the newest events; drop after and wait_s")
        page = log.latest(limit, wanted)
        return _page(page.events, page.next, page.missed, root, wanted)
    # Without a cursor: from the oldest kept, none of which it missed (it was told it had
    # missed every event that left the log before it first asked).
    cursor = log.oldest_id - 1 if after is None else after
    deadline = time.monotonic() + wait_s
    while True:
        page = log.read(cursor, limit, wanted)
        left = deadline - time.monotonic()
        if page.events or page.missed or left <= 0 or log.closed:
            break
        cursor = page.next
        if await wait_unless_gone(request, log.wait(cursor, left)):
            raise HTTPException(499, "the client closed the connection")
    return _page(page.events, page.next, page.missed, root, wanted)


def _page(
    events: list[dict[str, Any]], after: int, missed: int, root: str, wanted: EventFilter
) -> dict[str, Any]:
    """A page of events as ``GET /events`` answers it, their paths under ``root``."""
    served = [_served(event, root, wanted) for event in events]
    return {"events": served, "next": after, "missed": missed}


def _served(event: dict[str, Any], root: str, wanted: EventFilter) -> dict[str, Any]:
    """``event`` as handed out, without the links to a snapshot, thumbnail or clip deleted
    (or failed) since it was logged (they answered 404, and ``has_snapshot=true`` or
    ``has_clip=true`` listed it)."""
    if "snapshot" in event and not has_snapshot(event, wanted):
        event = {k: v for k, v in event.items() if k not in ("snapshot", "thumbnail")}
    if "clip" in event and not has_clip(event, wanted):
        event = {k: v for k, v in event.items() if k != "clip"}
    return served_event(event, root)


@router.get("/events/counts", response_model=None)
async def count_logged_events(
    request: Request,
    wanted: Wanted,
    *,
    interval_s: Annotated[
        float | None,
        Query(
            ge=1.0,
            le=MAX_INTERVAL_S,
            description="seconds a row covers, from multiples of it since the Unix epoch"
            " (3600: hours, 86400: UTC days); absent: totals",
        ),
    ] = None,
    by: Annotated[
        str,
        Query(description=f"comma-separated members to count by, of {', '.join(COUNT_KEYS)}"),
    ] = "stream_id,type,class_name",
    output: Annotated[
        Literal["json", "csv"], Query(alias="format", description="json or csv")
    ] = "json",
) -> dict[str, Any] | Response:
    """How many events passed the filters, per combination of ``by`` and per ``interval_s``
    of capture time: a traffic count's table (cars each way across a line per 15 minutes)."""
    members = count_members(by, COUNT_KEYS)
    log = get_manager(request).events
    held = log.held()
    # 0.3 s for 100 000 events: a worker thread's, not the event loop's, which runs streams.
    rows = await asyncio.to_thread(count_events, filter(wanted.matches, held), members, interval_s)
    kept_since = log.kept_since
    complete = kept_since is None or (wanted.since is not None and wanted.since >= kept_since)
    about = {"complete": complete, "kept_since": kept_since}
    return counts_answer(rows, members, interval_s, output, about)


def count_members(by: str, allowed: Sequence[str]) -> list[str]:
    """``by``'s comma-separated members, each one of ``allowed`` at most once (else 422)."""
    members = [m.strip() for m in by.split(",") if m.strip()]
    unknown = sorted(set(members) - set(allowed))
    if unknown or len(set(members)) != len(members):
        raise HTTPException(
            422,
            f"by: {unknown or 'a member twice'}: choose each at most once of {tuple(allowed)}",
        )
    return members


def counts_answer(
    rows: list[dict[str, Any]],
    members: list[str],
    interval_s: float | None,
    output: str,
    about: dict[str, Any],
) -> dict[str, Any] | Response:
    """Counted rows as JSON (``interval_s``, ``by``, what ``about`` says, ``counts``) or, for
    ``output`` csv, as CSV (``about`` in ``X-`` headers)."""
    if output == "csv":
        text = csv_text(["start", "end", *members, "count"], rows)
        headers = {"X-Complete": str(about["complete"]).lower()} if "complete" in about else {}
        return Response(text, media_type="text/csv", headers=headers)
    return {"interval_s": interval_s, "by": members, **about, "counts": rows}


def _resume_from(last_event_id: str | None, after: int | None, log: EventLog) -> int:
    if last_event_id:
        try:
            return int(last_event_id)
        except ValueError:
            raise HTTPException(
                422, f"Last-Event-ID: expected an event id, got {last_event_id[:40]!r}"
            ) from None
    return log.last_id if after is None else after


async def _event_stream(
    log: EventLog, cursor: int, wanted: EventFilter, root: str = ""
) -> AsyncGenerator[str, None]:
    """The event stream from ``cursor`` on.

    The cursor goes out as an ``id:`` with the opening ``retry:`` and with each keep-alive
    too (an ``id:`` alone sets an ``EventSource``'s ``lastEventId``): a browser that got no
    event yet, or none for a while (a filter that passes few), reconnects with it as
    ``Last-Event-ID`` and gets what happened meanwhile, where without it the stream started
    again from the newest. The keep-alive goes out whenever ``HEARTBEAT_S`` passed with
    nothing sent, whether events the filter passes over woke the stream meanwhile or not.
    """
    yield f"retry: 2000\nid: {cursor}\n\n"  # how soon an EventSource reconnects, and whence
    sent_at = time.monotonic()
    while not log.closed:
        page = log.read(cursor, MAX_LIMIT, wanted)
        cursor = page.next
        if page.missed:
            missed = {"type": "missed", "missed": page.missed}
            yield f"data: {json.dumps(missed)}\n\n"
        for event in (_served(logged, root, wanted) for logged in page.events):
            yield f"id: {event['id']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"
        now = time.monotonic()
        if page.events or page.missed:
            sent_at = now
            continue
        if now - sent_at >= HEARTBEAT_S:
            yield f": keep-alive\nid: {cursor}\n\n"
            sent_at = now
        await log.wait(cursor, sent_at + HEARTBEAT_S - now)


# HEAD too, as clips have (it was 405): a client may ask whether one is there first.
@router.head("/events/{event_id}/snapshot.jpg", include_in_schema=False)
@router.get(
    "/events/{event_id}/snapshot.jpg",
    response_class=Response,
    responses={200: {"content": {"image/jpeg": {}}}},
)
async def event_snapshot(event_id: int, request: Request) -> Response:
    """The frame an event happened in, as a JPEG with its boxes, zones and lines drawn;
    ``404`` once it is older than the last ``event_snapshots`` frames with events."""
    return await _picture(request, event_id, thumbnail=False)


@router.head("/events/{event_id}/thumbnail.jpg", include_in_schema=False)
@router.get(
    "/events/{event_id}/thumbnail.jpg",
    response_class=Response,
    responses={200: {"content": {"image/jpeg": {}}}},
)
async def event_thumbnail(event_id: int, request: Request) -> Response:
    """The event's object cut from its frame at full resolution (at most 320 pixels a side),
    for a notification; ``404`` for an event without one (a stream's state, a manual event)
    or once its snapshot is gone."""
    return await _picture(request, event_id, thumbnail=True)


async def _picture(request: Request, event_id: int, *, thumbnail: bool) -> Response:
    manager = get_manager(request)
    store = get_state(request).snapshots
    jpeg = None if store is None else await store.get(event_id, thumbnail=thumbnail)
    if jpeg is None:
        size = 0 if store is None else store.size
        event = manager.events.get(event_id)
        if thumbnail and event is not None and "box" not in event:
            why = f"event {event_id} ({event['type']}) has no object to cut out"
        elif event is not None and "snapshot" not in event:  # a state change has no frame
            why = f"event {event_id} ({event['type']}) has no snapshot: none was made for it"
        elif event is None:  # it blamed the snapshots' setting where the log's had let it go
            kept = manager.events.capacity
            why = (
                f"no event {event_id}: unknown, or older than the last {kept} events the log"
                " keeps (setting STREAMDET_EVENT_LOG_SIZE)"
            )
        elif store is not None and store.failed(event_id):
            why = (
                f"no {'thumbnail' if thumbnail else 'snapshot'} of event {event_id}: it could"
                f" not be written (the server log says why; {DATA_DIR_HINT})"
            )
        else:
            what = "thumbnail" if thumbnail else "snapshot"
            why = (
                f"no {what} of event {event_id}: snapshots are kept for the last {size} frames"
                " with events (setting STREAMDET_EVENT_SNAPSHOTS)"
            )
        raise HTTPException(404, why)
    return Response(jpeg, media_type="image/jpeg", headers={"Cache-Control": "max-age=3600"})


@router.get("/clips")
async def list_clips(
    request: Request,
    stream_id: Annotated[str | None, Query(description="one stream's clips")] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT, description="most clips")] = 100,
) -> dict[str, Any]:
    """The event clips on disk, newest first: ``id``, ``stream_id``, ``started_at`` (wall
    time of its first frame), ``duration_s``, ``bytes``, ``events`` (the ids of the events
    it shows) and ``url``."""
    manager = get_manager(request)
    if manager.clips is None:
        return {"clips": []}
    root = root_of(request.scope)
    clips = await manager.clips.listing(stream_id, limit)
    return {"clips": [{**c, "url": root + c["url"]} if "url" in c else c for c in clips]}


@router.delete("/clips/{clip_id}.mp4", status_code=204)
async def delete_clip(clip_id: int, request: Request) -> Response:
    """Delete a clip (``409`` while it is being written)."""
    manager = get_manager(request)
    why = f"no clip {clip_id}" if manager.clips is None else await manager.clips.delete(clip_id)
    if why is not None:
        raise HTTPException(404 if why.startswith("no clip") else 409, why)
    return Response(status_code=204)


# HEAD too: players and download tools ask a video's length and type first (it was 405).
@router.head("/clips/{clip_id}.mp4", include_in_schema=False)
@router.get(
    "/clips/{clip_id}.mp4",
    response_class=FileResponse,
    responses={200: {"content": {"video/mp4": {}}}},
)
async def event_clip(clip_id: int, request: Request) -> FileResponse:
    """The video around one or more events of a stream with ``clips`` on (the ``clip`` member
    of its events), as MP4; one still being written is waited for, up to
    ``event_clip_post_s`` + 10 s. Range requests are served (a browser seeks in it)."""
    manager = get_manager(request)
    if manager.clips is None:
        raise HTTPException(404, f"no clip {clip_id}: this server keeps no event clips")
    found = await manager.clips.find(clip_id, manager.clips.options.post_s + CLIP_WAIT_S)
    if isinstance(found, str):
        if manager.clips.writing(clip_id):
            retry = str(max(1, round(manager.clips.options.post_s)))
            raise HTTPException(503, found, headers={"Retry-After": retry})
        raise HTTPException(404, found)
    return RangedFile(
        found,
        media_type="video/mp4",
        headers={"Cache-Control": "max-age=3600"},
        gone=f"no clip {clip_id}: deleted meanwhile (a DELETE, or kept clips pruned)",
    )
