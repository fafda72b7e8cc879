"""Event snapshots: the frame each event happened in, as a JPEG with its boxes (and track
ids), the stream's zones and counting lines drawn, for ``GET /events/{id}/snapshot.jpg`` (as
Frigate keeps a snapshot per event). A webhook receiver or a notification fetches the picture
of what crossed the line.

A frame with several events is drawn once, into ``<directory>/<its first event's id>.jpg``;
an event finds its frame's file through the event log (the events of one frame are logged
together), so snapshots outlive a restart as the events do. Each event with an object (a
``box``) also gets a thumbnail, ``GET /events/{id}/thumbnail.jpg``: the object cut from the
frame at its full resolution, before it is scaled down, in ``<first>-<event id>.jpg``,
kept and deleted with its frame's snapshot. The JPEG is made in a worker
thread as soon as the frame's events are logged (the frame itself is not kept: at 1080p it
would weigh 6 MB), scaled to at most ``event_snapshot_width`` pixels wide; the files of the
last ``event_snapshots`` frames are kept (about 40 kB each at 640 px). A frame whose JPEG
cannot start because :data:`MAX_PENDING` others are still being drawn gets none (counted in
``streamdet_event_snapshots_total{outcome="skipped"}``): under a burst of events the CPU goes
to detection first.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import functools
import logging
import os
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

from engines.types import Detections, Image
from server.metrics import Metrics
from server.render import crop_jpeg, render_jpeg
from streams.clips import remove_parts
from streams.detect import StreamDetect
from streams.events import EventLog
from streams.fanout import ProcessedFrame, host_array
from streams.store import private_dir, write_private

log = logging.getLogger(__name__)
MAX_PENDING = 8
QUALITY = 80
SNAPSHOT_PATH = "/events/{id}/snapshot.jpg"
THUMBNAIL_PATH = "/events/{id}/thumbnail.jpg"
THUMBNAIL_SIDE = 320  # pixels, at most: a notification's picture
THUMBNAIL_QUALITY = 85


class SnapshotStore:
    """The JPEGs of the last ``size`` frames with events, in ``directory``.

    Args:
        size: frames kept (0: no snapshots).
        max_width: wider frames are scaled down to this.
        executor: where the JPEGs are drawn and written.
        detect_of: a stream's current settings (its zones and lines are drawn).
        directory: where the files go (created if missing).
        events: the event log (an event's frame is found through it).
        metrics: counts snapshots made and skipped.
    """

    def __init__(
        self,
        size: int,
        max_width: int,
        executor: Executor | None,
        detect_of: Callable[[str], StreamDetect | None],
        *,
        directory: Path,
        events: EventLog,
        metrics: Metrics | None = None,
    ) -> None:
        self.size = size
        self._max_width = max_width
        self._executor = executor
        self._detect_of = detect_of
        self._dir = directory
        self._log = events
        self._metrics = metrics
        self._drawing: dict[int, asyncio.Future[bytes]] = {}
        self._drawn_for: dict[int, list[int]] = {}  # the events of each frame being drawn
        # Events whose snapshot could not be written (a full disk, an unwritable folder):
        # listed without it, and their 404 says why (it stayed linked, its 404 blaming the
        # number of snapshots kept).
        self._lost: set[int] = set()
        private_dir(directory)  # snapshots of people: this user's only (they were 0644)
        # Made once, at startup (nothing is being drawn yet): a .part left by a crash, or by
        # a write that failed before _write cleaned up after itself, is no snapshot.
        remove_parts(directory)
        kept: set[int] = set()
        self._thumbnails: dict[int, list[int]] = {}  # a frame's thumbnails, by first event id
        for path in directory.glob("*.jpg"):
            first, _, event = path.stem.partition("-")
            with contextlib.suppress(ValueError):
                if event:
                    self._thumbnails.setdefault(int(first), []).append(int(event))
                else:
                    kept.add(int(first))
        for orphan in set(self._thumbnails) - kept:  # its frame's snapshot was deleted
            self._delete(orphan)
        self._kept = sorted(kept)  # frames on disk, by first event id, oldest first
        self._prune()
        self._lost_before_start()

    def _lost_before_start(self) -> None:
        """Events logged with a snapshot that is not on disk, above the oldest kept (one that
        failed before a restart, a file deleted by hand): lost, as if it failed now."""
        kept, since = set(self._kept), self.kept_from()
        for event in self._log.held():
            event_id = int(event.get("id", -1))
            if "snapshot" in event and event_id >= since:
                first = self._log.frame_start(event_id)
                if first is None or first not in kept:
                    self._lost.add(event_id)

    def lost(self) -> frozenset[int]:
        """Events whose snapshot could not be written, of those above :meth:`kept_from`."""
        since = self.kept_from()
        self._lost = {event_id for event_id in self._lost if event_id >= since}
        return frozenset(self._lost)

    def failed(self, event_id: int) -> bool:
        """Whether ``event_id``'s snapshot could not be written."""
        return event_id in self._lost

    @property
    def enabled(self) -> bool:
        return self.size > 0

    def extra(self, frame: ProcessedFrame, event: dict[str, Any]) -> dict[str, Any]:
        """What each logged event gets: the path of its snapshot, where its frame will have
        one (:meth:`capture` follows on the event loop, with nothing in between), and of its
        thumbnail where it has an object."""
        if not self.enabled or len(self._drawing) >= MAX_PENDING:
            return {}
        paths = {"snapshot": SNAPSHOT_PATH.format(id=event["id"])}
        if "box" in event:
            paths["thumbnail"] = THUMBNAIL_PATH.format(id=event["id"])
        return paths

    def kept_from(self) -> int:
        """The first event id whose snapshot may still be here: those below it lost theirs
        (deleted for ``--event-snapshots`` or their age) though their events still name it.
        Frames are kept newest first, so one id bounds them."""
        held = [*self._kept[:1], *self._drawing]
        return min(held) if held else self._log.last_id + 1

    def capture(self, frame: ProcessedFrame, events: list[dict[str, Any]]) -> None:
        """Event loop: start drawing ``frame`` for its ``events`` (as logged)."""
        if not self.enabled or not events:
            return
        if "snapshot" not in events[0]:
            self._count("skipped")
            return
        first = int(events[0]["id"])
        detect = self._detect_of(frame.stream_id) or StreamDetect()
        crops = [(int(e["id"]), e["box"]) for e in events if "thumbnail" in e]
        if crops:
            self._thumbnails[first] = [event_id for event_id, _ in crops]
        draw = functools.partial(
            self._draw,
            frame.image,
            first,
            crops,
            detections=frame.detections,
            lines=[(line, line.name) for line in detect.lines],
            zones=[(zone, zone.name) for zone in detect.zones],
        )
        drawn = asyncio.get_running_loop().run_in_executor(self._executor, draw)
        self._drawing[first] = drawn
        self._drawn_for[first] = [int(e["id"]) for e in events if "snapshot" in e]
        drawn.add_done_callback(functools.partial(self._drawn, frame.stream_id, first))

    def _draw(
        self, image: Image, first: int, crops: list[tuple[int, list[float]]], **shapes: Any
    ) -> bytes:
        """Worker thread: the thumbnails of the events ``crops`` names and the frame's JPEG,
        written to their files (each whole or not at all); returns the frame's."""
        image = host_array(image)  # a GPU frame is copied down once
        detections: Detections = shapes["detections"]
        # Boxes are in the camera's pixels; a stream's frames may be decoded smaller.
        height, width = image.shape[:2]
        sx, sy = width / (detections.width or width), height / (detections.height or height)
        for event_id, box in crops:
            x1, y1, x2, y2 = box
            scaled = [x1 * sx, y1 * sy, x2 * sx, y2 * sy]
            thumbnail = crop_jpeg(image, scaled, THUMBNAIL_SIDE, THUMBNAIL_QUALITY)
            _write(self._thumbnail_path(first, event_id), thumbnail)
        jpeg, _, _ = render_jpeg(image, self._max_width, QUALITY, **shapes)
        _write(self._path(first), jpeg)
        return jpeg

    def _drawn(self, stream_id: str, first: int, drawn: asyncio.Future[bytes]) -> None:
        self._drawing.pop(first, None)
        events = self._drawn_for.pop(first, [])
        if drawn.cancelled():
            return
        if (error := drawn.exception()) is not None:
            log.warning("stream %s: snapshot of event %d failed: %s", stream_id, first, error)
            self._delete(first)  # thumbnails written before it failed
            self._lost.update(events)
            self._count("failed")
            return
        self._count("made")
        bisect.insort(self._kept, first)  # drawings may finish out of order
        self._prune()

    def forget_before(
        self, event_id: int, *, cutoff: float | None = None, dated_before: int = 0
    ) -> int:
        """Retention: delete the snapshots (and thumbnails) of frames whose events have ids
        below ``event_id`` (a frame's events share its capture time, so they go together),
        and with ``cutoff`` (Unix seconds) those of frames below ``dated_before`` whose
        snapshot was written before it; returns how many frames'.

        Retention knows an event's age only while the log holds it (or has just dropped it
        for its age); one that left the log by its size (``--event-log-size``) may be a
        minute old, so its snapshot goes by the file's age (written once its events were
        logged: never older than they are). Ids grow with time: the first frame not old
        enough ends the pass (a file looked at for each frame deleted, on the event loop)."""
        gone = 0
        while self._kept:
            first = self._kept[0]
            dated = cutoff is not None and first < dated_before
            if first >= event_id and not (dated and self._older(first, cutoff or 0.0)):
                break
            self._delete(self._kept.pop(0))
            gone += 1
        return gone

    def _older(self, first: int, cutoff: float) -> bool:
        """Whether frame ``first``'s snapshot was written before ``cutoff`` (or is gone)."""
        try:
            return self._path(first).stat().st_mtime < cutoff
        except OSError:
            return True

    def _prune(self) -> None:
        while len(self._kept) > self.size:
            self._delete(self._kept.pop(0))

    def _delete(self, first: int) -> None:
        """Delete a frame's snapshot and its events' thumbnails."""
        paths = [self._path(first)]
        paths += [self._thumbnail_path(first, e) for e in self._thumbnails.pop(first, ())]
        for path in paths:
            with contextlib.suppress(OSError):
                path.unlink()

    async def get(self, event_id: int, *, thumbnail: bool = False) -> bytes | None:
        """The JPEG of ``event_id``'s frame, or with ``thumbnail`` of its object (waiting for
        it to be drawn); None when there is none (an unknown id, an event older than the
        frames kept, one without an object, or a skipped one)."""
        first = self._log.frame_start(event_id)
        key = "thumbnail" if thumbnail else "snapshot"
        if first is None or key not in (self._log.get(event_id) or {}):
            return None
        drawing = self._drawing.get(first)
        if drawing is not None:
            try:
                jpeg = await asyncio.shield(drawing)
            except Exception:  # drawing failed: logged when it did
                return None
            if not thumbnail:
                return jpeg
        path = self._thumbnail_path(first, event_id) if thumbnail else self._path(first)
        try:
            return await asyncio.to_thread(path.read_bytes)
        except OSError:
            return None

    def _path(self, first: int) -> Path:
        return self._dir / f"{first}.jpg"

    def _thumbnail_path(self, first: int, event_id: int) -> Path:
        return self._dir / f"{first}-{event_id}.jpg"

    def _count(self, outcome: str) -> None:
        if self._metrics is not None:
            self._metrics.event_snapshots.labels(outcome).inc()


def _write(path: Path, data: bytes) -> None:
    """``data`` to ``path``, whole or not at all (a write that fails, a full disk say, leaves
    no ``.part`` behind: nothing would ever delete it)."""
    part = path.with_suffix(".part")
    try:
        write_private(part, data)
        os.replace(part, path)
    except BaseException:
        with contextlib.suppress(OSError):
            part.unlink()
        raise
