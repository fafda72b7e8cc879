"""Retention by age (``--event-retain-days``): events, their snapshots and thumbnails, and
their clips older than that are deleted, as Frigate's ``retain: days`` deletes them and as a
deployment under a data-protection policy must ("kept 7 days, then deleted").

A task of the event loop checks every :func:`period_s` (a minute, or sooner for a short
retention): events captured before the cutoff leave the log and its store, and their
snapshots, thumbnails and clips are deleted with them. Those of events that had left the log
earlier by its size (``--event-log-size``), whose age the log no longer knows, go by the age
of their files, so a full log never deletes the pictures and clips of recent events.
Counting limits (``--event-log-size``, ``--event-snapshots``, ``--event-clips-max-mb``) still
apply; whichever comes first deletes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from server.snapshots import SnapshotStore
from streams.clips import ClipIndex
from streams.events import EventLog

log = logging.getLogger(__name__)
DAY_S = 86_400.0


@dataclass(frozen=True, slots=True)
class Forgotten:
    """What one pass deleted."""

    events: int
    snapshots: int
    clips: int


def period_s(retain_s: float) -> float:
    """How often retention is checked: every minute, or every tenth of a shorter retention
    (at least every second)."""
    return max(1.0, min(60.0, retain_s / 10.0))


async def forget_older_than(
    cutoff: float, events: EventLog, snapshots: SnapshotStore | None, clips: ClipIndex | None
) -> Forgotten:
    """Delete the events captured before ``cutoff`` (Unix seconds) and the snapshots,
    thumbnails and clips of events older than that.

    Ids grow with time, so when this pass drops events for their age every id below the
    oldest event left is older than the cutoff; otherwise those ids left the log by its size
    (maybe a minute ago), and only their files' age tells."""
    dropped = events.forget_before(cutoff)
    oldest = events.oldest_id
    old = oldest if dropped else 0  # ids known to be older than the cutoff
    pictures = (
        0 if snapshots is None else snapshots.forget_before(old, cutoff=cutoff, dated_before=oldest)
    )
    videos = (
        0 if clips is None else await clips.forget_before(old, cutoff=cutoff, dated_before=oldest)
    )
    return Forgotten(dropped, pictures, videos)


async def keep_for(
    retain_s: float,
    events: EventLog,
    snapshots: SnapshotStore | None,
    clips: ClipIndex | None,
) -> None:
    """Forever (until cancelled): every :func:`period_s`, forget what is older than
    ``retain_s`` seconds."""
    every = period_s(retain_s)
    while True:
        try:
            gone = await forget_older_than(time.time() - retain_s, events, snapshots, clips)
        except Exception:  # a pass that fails (a disk error) is logged; the next one runs
            log.exception("retention: a pass failed; the next one runs in %.0f s", every)
            gone = Forgotten(0, 0, 0)
        if gone.events or gone.snapshots or gone.clips:
            log.info(
                "retention: deleted %d event(s), %d snapshot(s) and %d clip(s) older than"
                " %.6g days (setting STREAMDET_EVENT_RETAIN_DAYS)",
                gone.events,
                gone.snapshots,
                gone.clips,
                retain_s / DAY_S,
            )
        await asyncio.sleep(every)
