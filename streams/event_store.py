"""The event log on disk: ``<data_dir>/events.sqlite3`` keeps the last ``event_log_size``
events and each webhook's and MQTT broker's cursor, so a restart loses neither: ``GET
/events`` still has them, ids carry on where they stopped (a client's cursor stays valid),
and events logged but not yet delivered when the server stopped are delivered when it is
back.

Writes go through one writer thread in batches (a frame's events, a delivered batch's cursor),
so the event loop never waits for the disk; :meth:`EventStore.close` writes what is queued.

A write that fails (a full disk) loses nothing while the server runs: what it held is kept
in memory (the newest ``size`` events at most: older ones would be pruned from the file
anyway, and the log holds them) and written once writing works again, logged once per such
episode. An id is never given twice, even where its event never reached the disk (``kill
-9`` while the disk was full): ``<data_dir>/events.ids``, 16 bytes overwritten in place (so
written on a full disk too), keeps the highest id given and the ids reserved ahead by a
running server (0 once it closed cleanly), and ``meta`` rows in the database keep the same.
A start after a run that did not close carries on above the reservation; the ids passed
over are kept as ``skip:<first>`` rows, so ``missed`` never counts them as events, while the
ids given whose events never reached the disk are counted as missed. A write of ``events.ids``
that fails is tried again with each write (the database's retries), so ids given while it
failed count as missed once it works again before a kill; where nothing at all can be written
until the kill, nothing on disk says which ids were given, and they are passed over.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import sqlite3
import struct
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from contextlib import closing, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from streams.store import keep_private

log = logging.getLogger(__name__)

SCHEMA = (
    "CREATE TABLE IF NOT EXISTS events (id INTEGER PRIMARY KEY, body TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS cursors (name TEXT PRIMARY KEY, cursor INTEGER NOT NULL)",
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL)",
)
PRUNE_EVERY = 500
"""Events written between two prunings of those beyond the log's size."""
RESERVE_IDS = 10_000
"""Ids a running server may give ahead of the last ``reserved`` written (renewed at half)."""
MAX_AHEAD_IDS = 1_000 * RESERVE_IDS
"""How far past the database's ids (or the clock's) ``events.ids`` may be: a thousand runs
killed before their first event reached the disk; past it the file is damaged."""
RETRY_FIRST_S = 0.25
RETRY_MAX_S = 5.0
"""A failed write is tried again after these (doubling), with what came meanwhile."""

_Op = tuple[str, Any]
_MARKS = struct.Struct("<qq")
_UPSERT_MAX = (
    "INSERT INTO meta (key, value) VALUES (?, ?)"
    " ON CONFLICT(key) DO UPDATE SET value = max(value, excluded.value)"
)


def _close_emptied_run(db: sqlite3.Connection) -> None:
    """A store that holds no event but has held some (retention deleted them all) starts a
    new run of ids from the clock: the old run's ids are kept as gone, so ``missed`` counts
    its events and not the microseconds between the two runs."""
    if db.execute("SELECT 1 FROM events LIMIT 1").fetchone() is not None:
        return
    first = db.execute("SELECT value FROM meta WHERE key = 'first_id'").fetchone()
    last = db.execute("SELECT value FROM meta WHERE key = 'last_id'").fetchone()
    if first is not None and last is not None and last[0] >= first[0]:
        db.execute(
            "INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
            (f"gone:{first[0]}", last[0]),
        )
    db.execute("DELETE FROM meta WHERE key IN ('first_id', 'last_id')")


@dataclass(frozen=True, slots=True)
class Resumed:
    """What a log carries on from (:meth:`EventStore.resume`).

    Attributes:
        events: the last ``size`` events kept, oldest first (ids need not be contiguous:
            events of a failed write can be missing).
        first: the id of the first event of the run of ids the log carries on (or starts).
        next_id: the id the next event gets: above every id ever given.
        gone: ``(first, last)`` of earlier runs every event of which left the log.
        skips: ``(first, last)`` ranges of the run's ids never given (passed over at a start
            after a run that did not close), oldest first.
    """

    events: list[dict[str, Any]]
    first: int
    next_id: int
    gone: list[tuple[int, int]]
    skips: list[tuple[int, int]]


@dataclass
class _Pending:
    """Writes not done yet, merged: the newest ``size`` events, the last word on each
    cursor, the latest forget, and the marks (ids given, reserved, passed over)."""

    size: int
    events: deque[dict[str, Any]] = field(init=False)
    first: int | None = None  # first event id merged (for a new run's first_id)
    top: int | None = None  # highest id given
    reserved: int | None = None
    skips: dict[int, int] = field(default_factory=dict)
    cursors: dict[str, int | None] = field(default_factory=dict)
    forget: int | None = None
    release: bool = False  # a clean close: the reservation goes
    close_run: bool = False  # the run found emptied at start is closed first

    def __post_init__(self) -> None:
        self.events = deque(maxlen=self.size)

    def merge(self, kind: str, payload: Any) -> None:
        if kind == "events":
            self.events.extend(payload)
            ids = (int(payload[0]["id"]), int(payload[-1]["id"]))
            self.first = ids[0] if self.first is None else min(self.first, ids[0])
            self.top = ids[1] if self.top is None else max(self.top, ids[1])
        elif kind == "forget":
            self.forget = payload if self.forget is None else max(self.forget, payload)
        elif kind == "drop-cursor":
            self.cursors[payload] = None
        elif kind == "cursor":
            self.cursors[payload[0]] = payload[1]
        elif kind == "reserve":
            self.reserved = payload if self.reserved is None else max(self.reserved, payload)
        elif kind == "skip":
            first, last = payload
            self.skips[first] = max(last, self.skips.get(first, last))
            self.top = last if self.top is None else max(self.top, last)

    @property
    def empty(self) -> bool:
        return not (
            self.events
            or self.close_run
            or self.cursors
            or self.skips
            or self.release
            or self.forget is not None
            or self.top is not None
            or self.reserved is not None
        )

    def write(self, db: sqlite3.Connection) -> int:
        """Everything, in the caller's transaction; returns the events written."""
        self.write_marks(db)  # first: a run emptied at start is closed before new events
        rows = [(e["id"], json.dumps(e, separators=(",", ":"))) for e in self.events]
        db.executemany("INSERT OR REPLACE INTO events (id, body) VALUES (?, ?)", rows)
        if self.forget is not None:
            db.execute("DELETE FROM events WHERE id < ?", (self.forget,))
        for name, cursor in self.cursors.items():
            if cursor is None:
                db.execute("DELETE FROM cursors WHERE name = ?", (name,))
            else:
                db.execute(
                    "INSERT INTO cursors (name, cursor) VALUES (?, ?)"
                    " ON CONFLICT(name) DO UPDATE SET cursor = excluded.cursor",
                    (name, cursor),
                )
        if self.release:
            db.execute("DELETE FROM meta WHERE key = 'reserved'")
        return len(rows)

    def write_marks(self, db: sqlite3.Connection) -> None:
        """The ids given, reserved and passed over: all that keeps ids from being given
        twice, written alone where the events cannot be (a few bytes)."""
        if self.close_run:
            _close_emptied_run(db)
        if self.first is not None:
            db.execute(
                "INSERT OR IGNORE INTO meta (key, value) VALUES ('first_id', ?)", (self.first,)
            )
        for first, last in self.skips.items():
            db.execute(_UPSERT_MAX, (f"skip:{first}", last))
        if self.top is not None:
            db.execute(_UPSERT_MAX, ("last_id", self.top))
        if self.reserved is not None and not self.release:
            db.execute(_UPSERT_MAX, ("reserved", self.reserved))


class _IdMarks:
    """``<data_dir>/events.ids``: the highest id given and the highest reserved (0 once the
    server closed cleanly), two 64-bit integers overwritten in place, so they are written
    where the disk is full too (the file's blocks are its own)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            log.warning("event store %s: cannot open it (%s)", path, exc)
            return
        try:
            os.fchmod(fd, 0o600)  # one an earlier version made readable by everyone
            if os.fstat(fd).st_size < _MARKS.size:
                os.pwrite(fd, bytes(_MARKS.size), 0)
                os.fsync(fd)
        except OSError as exc:
            os.close(fd)
            log.warning("event store %s: cannot make it (%s)", path, exc)
            return
        self._fd = fd

    def read(self) -> tuple[int, int]:
        """``(given, reserved)``; zeros where unknown."""
        if self._fd is None:
            return 0, 0
        try:
            data = os.pread(self._fd, _MARKS.size, 0)
        except OSError:
            return 0, 0
        return _MARKS.unpack(data) if len(data) == _MARKS.size else (0, 0)

    def write(self, given: int, reserved: int, *, sync: bool) -> bool:
        """Whether it was written (to the page cache, which outlives a killed process; to
        the disk with ``sync``)."""
        if self._fd is None:
            return False
        try:
            os.pwrite(self._fd, _MARKS.pack(given, reserved), 0)
            if sync:
                os.fsync(self._fd)
        except OSError:
            return False
        return True

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class EventStore:
    """Events and delivery cursors in ``<data_dir>/events.sqlite3``.

    Args:
        data_dir: created if missing (setting ``STREAMDET_DATA_DIR``).
        size: events kept (setting ``STREAMDET_EVENT_LOG_SIZE``).
    """

    def __init__(self, data_dir: Path, size: int) -> None:
        data_dir.mkdir(parents=True, exist_ok=True)
        self.path = data_dir / "events.sqlite3"
        self.size = size
        # What happened where, manual events' data and sources' errors: this user's only
        # (it was 0644 under the usual umask, beside the 0600 stream and webhook stores).
        keep_private(self.path)
        for journal in ("-wal", "-shm"):  # an earlier version's (SQLite gives new ones the
            with suppress(FileNotFoundError):  # database's mode)
                os.chmod(f"{self.path}{journal}", 0o600)
        with closing(self._connect()) as db:
            with db:
                db.execute("PRAGMA journal_mode=WAL")
                for statement in SCHEMA:
                    db.execute(statement)
            try:
                with db:
                    _close_emptied_run(db)
            except sqlite3.Error as exc:  # tried again by resume() and the writer
                log.warning("event store %s: cannot close the emptied run (%s)", self.path, exc)
            try:
                with db:
                    self._prune(db)
            except sqlite3.Error as exc:  # pruned by the writer, after PRUNE_EVERY events
                log.warning("event store %s: cannot delete old events (%s)", self.path, exc)
        self._marks = _IdMarks(data_dir / "events.ids")
        self._renew_at: int | None = None  # the id past which a reservation is renewed
        self.failing = False
        """Whether writes fail now (what they held is kept and tried again)."""
        self._ops: queue.SimpleQueue[_Op | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="event-store", daemon=True)
        self._writer.start()

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, timeout=10.0)

    def _prune(self, db: sqlite3.Connection) -> None:
        """Delete the events past the last ``size``: by the writer every ``PRUNE_EVERY``
        events, and at each start (a server restarted more often than that never pruned: the
        file grew by every event, with ``--event-log-size 5``)."""
        db.execute(
            "DELETE FROM events WHERE id <= (SELECT id FROM events ORDER BY id DESC LIMIT 1"
            " OFFSET ?)",
            (self.size,),
        )

    # ---- reads, at start -----------------------------------------------------------------
    def load(self) -> tuple[list[dict[str, Any]], int | None]:
        """The last ``size`` events, oldest first, and the id of the first event of the run of
        ids they belong to (None for a new store, or one found empty at start); reads only
        (:meth:`resume` is what a log carries on from)."""
        with closing(self._connect()) as db:
            rows = db.execute(
                "SELECT body FROM events ORDER BY id DESC LIMIT ?", (self.size,)
            ).fetchall()
            first = db.execute("SELECT value FROM meta WHERE key = 'first_id'").fetchone()
        return self._parse(body for (body,) in reversed(rows)), (
            None if first is None else int(first[0])
        )

    def _parse(self, bodies: Iterable[str]) -> list[dict[str, Any]]:
        events = []
        for body in bodies:
            try:
                events.append(json.loads(body))
            except ValueError:
                log.warning("event store %s: an unreadable event was skipped", self.path)
        return events

    def resume(self, start: int) -> Resumed:
        """What the log carries on from, and the id it gives next: above every id given or
        reserved before (ids given by a run that did not close may never have reached the
        database). ``start`` (the clock, in microseconds) is where a new run of ids starts,
        and where ids carry on from if this start cannot be recorded at all. Records the
        start: this run's reservation, and the ids passed over."""
        with closing(self._connect()) as db:
            rows = db.execute(
                "SELECT id, body FROM events ORDER BY id DESC LIMIT ?", (self.size,)
            ).fetchall()
            meta = {str(k): int(v) for k, v in db.execute("SELECT key, value FROM meta")}
        events = self._parse(body for _, body in reversed(rows))
        gone = sorted((int(k[5:]), v) for k, v in meta.items() if k.startswith("gone:"))
        skips = dict(sorted((int(k[5:]), v) for k, v in meta.items() if k.startswith("skip:")))
        marks = _Pending(self.size)
        if not rows and "first_id" in meta and meta.get("last_id", -1) >= meta["first_id"]:
            gone.append((meta["first_id"], meta["last_id"]))  # not closed at init: now
            marks.close_run = True
        given, reserved = self._marks.read()
        known = [meta.get("last_id", 0), meta.get("reserved", 0)]
        known += [int(rows[0][0])] if rows else []
        known += [last for _, last in gone] + list(skips.values())
        # A run that did not close gave ids at most its reservations past what the database
        # or the clock says: marks beyond that (a damaged file) made ids jump by 7e18, every
        # webhook "missing" as many, or overflowed 64 bits and stopped the start.
        bound = max([start, *known]) + MAX_AHEAD_IDS
        if not 0 <= given <= bound or not 0 <= reserved <= bound:
            log.warning(
                "event store %s: its marks (%d, %d) are past any id given or reserved; ignored"
                " (a damaged file)",
                self._marks.path,
                given,
                reserved,
            )
            given = reserved = 0
        known += [given, reserved]
        next_id = max(known) + 1  # a clean close leaves no reservation
        if rows:  # carry on the run
            first = meta.get("first_id", int(rows[-1][0]))
            top = max(given, meta.get("last_id", 0), int(rows[0][0]))
        else:  # a new store, or one retention emptied: a new run from the clock
            first = next_id = max(start, next_id)
            top = next_id - 1
        skip = None if not rows or next_id <= top + 1 else (top + 1, next_id - 1)
        if skip is not None:
            marks.merge("skip", skip)
        reserve = next_id - 1 + RESERVE_IDS
        marks.merge("reserve", reserve)
        recorded = self._marks.write(next_id - 1, reserve, sync=True)
        try:
            with closing(self._connect()) as db, db:
                db.execute("DELETE FROM meta WHERE key = 'reserved'")
                marks.write_marks(db)
        except sqlite3.Error as exc:
            log.error(
                "event store %s: cannot record the start (%s): free space under the data"
                " directory (setting STREAMDET_DATA_DIR)",
                self.path,
                exc,
            )
            if not recorded and rows and start > next_id:
                # Nothing of this run may reach the disk: its ids start from the clock, above
                # those it could give before the next start carries on from the same place.
                next_id = start
                skip = (top + 1, next_id - 1)
                reserve = next_id - 1 + RESERVE_IDS
                marks.merge("skip", skip)
                marks.merge("reserve", reserve)
            self._ops.put(("marks", marks))  # written with the first write that works
        self._ops.put(("file", (next_id - 1, reserve, recorded)))
        self._renew_at = next_id + RESERVE_IDS // 2
        if skip is not None:
            skips[skip[0]] = max(skip[1], skips.get(skip[0], skip[1]))
            log.warning(
                "event store %s: ids carry on from %d, above those a run that did not close"
                " may have given (%d passed over)",
                self.path,
                next_id,
                skip[1] - skip[0] + 1,
            )
        gone = sorted(g for g in gone if g[1] < first)
        return Resumed(events, first, next_id, gone, sorted(skips.items()))

    def cursor(self, name: str) -> int | None:
        """Where the sink ``name`` (a webhook, an MQTT broker) had delivered up to."""
        with closing(self._connect()) as db:
            row = db.execute("SELECT cursor FROM cursors WHERE name = ?", (name,)).fetchone()
        return None if row is None else int(row[0])

    # ---- writes, queued --------------------------------------------------------------------
    def append(self, events: Sequence[dict[str, Any]]) -> None:
        """Keep ``events`` (logged, with their ids, growing)."""
        if events:
            self._ops.put(("events", list(events)))
            last = int(events[-1]["id"])
            if self._renew_at is not None and last >= self._renew_at:
                self._renew_at = last + RESERVE_IDS // 2
                self._ops.put(("reserve", last + RESERVE_IDS))

    def save_cursor(self, name: str, cursor: int) -> None:
        self._ops.put(("cursor", (name, cursor)))

    def drop_cursor(self, name: str) -> None:
        """Forget the cursor of the sink ``name`` (gone for good)."""
        self._ops.put(("drop-cursor", name))

    def forget_before(self, event_id: int) -> None:
        """Delete the events with ids below ``event_id`` (retention by age)."""
        self._ops.put(("forget", event_id))

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is queued, then stop the writer."""
        self._ops.put(None)
        self._writer.join(timeout_s)
        if self._writer.is_alive():
            log.warning("event store %s: writes still queued after %.0f s", self.path, timeout_s)

    def _write_loop(self) -> None:
        written = 0
        pending = _Pending(self.size)
        failed_at: float | None = None  # when this episode of failed writes began
        retry_s = RETRY_FIRST_S
        retry_at = 0.0
        done = False
        given = reserved = 0  # the ids given and reserved
        written_marks = (0, 0)  # as events.ids has them
        marks_failed = False  # whether writing events.ids failed last
        with closing(self._connect()) as db:
            db.execute("PRAGMA synchronous=NORMAL")
            while True:
                wait = None if failed_at is None else max(0.0, retry_at - time.monotonic())
                try:
                    ops = [self._ops.get(timeout=wait)]
                except queue.Empty:
                    ops = []
                while True:  # everything queued meanwhile, in one transaction
                    try:
                        ops.append(self._ops.get_nowait())
                    except queue.Empty:
                        break
                for op in ops:
                    if op is None:
                        done = pending.release = True
                    elif op[0] == "file":  # resume() wrote them (or could not)
                        given, reserved, recorded = op[1]
                        written_marks = (given, reserved) if recorded else written_marks
                    elif op[0] == "marks":
                        self._merge_marks(pending, op[1])
                    else:
                        pending.merge(*op)
                # The ids given and reserved first, in place: never given again, whatever
                # becomes of the events. A write that failed is tried again with each turn
                # (the retries of the database's writes): the ids were taken as written, and
                # those given while it failed were passed over after a kill, not missed.
                now = (max(given, pending.top or 0), max(reserved, pending.reserved or 0))
                if now != written_marks:
                    if self._marks.write(*now, sync=now[1] != written_marks[1]):
                        if marks_failed:
                            log.warning("event store %s: writes work again", self._marks.path)
                        written_marks, marks_failed = now, False
                    elif not marks_failed:
                        marks_failed = True
                        log.error(
                            "event store %s: cannot be written (tried again with each"
                            " write); if the database cannot be either, a kill meanwhile"
                            " leaves the ids given since uncounted (passed over, not missed):"
                            " make the data directory writable (setting STREAMDET_DATA_DIR)",
                            self._marks.path,
                        )
                    given, reserved = now
                if pending.empty or (
                    failed_at is not None and not done and time.monotonic() < retry_at
                ):
                    if done:
                        break
                    continue
                try:
                    with db:
                        written += pending.write(db)
                        if written >= PRUNE_EVERY:
                            written = 0
                            self._prune(db)
                except sqlite3.Error as exc:  # a full disk must not stop the server
                    self._failed(db, pending, exc, first=failed_at is None, at_close=done)
                    if failed_at is None:
                        failed_at = time.monotonic()
                    else:
                        retry_s = min(retry_s * 2.0, RETRY_MAX_S)
                    retry_at = time.monotonic() + retry_s
                    if done:
                        break
                else:
                    if failed_at is not None:
                        log.warning(
                            "event store %s: writing works again, after %.0f s; what was"
                            " held meanwhile is written",
                            self.path,
                            time.monotonic() - failed_at,
                        )
                        failed_at, retry_s, self.failing = None, RETRY_FIRST_S, False
                    pending = _Pending(self.size)
                    if done:  # everything written: a clean close, nothing reserved
                        self._marks.write(given, 0, sync=True)
                        break
        self._marks.close()

    @staticmethod
    def _merge_marks(pending: _Pending, marks: _Pending) -> None:
        pending.close_run = pending.close_run or marks.close_run
        for first, last in marks.skips.items():
            pending.merge("skip", (first, last))
        if marks.reserved is not None:
            pending.merge("reserve", marks.reserved)

    def _failed(
        self,
        db: sqlite3.Connection,
        pending: _Pending,
        exc: sqlite3.Error,
        *,
        first: bool,
        at_close: bool,
    ) -> None:
        """A write failed: the marks are written alone if they can be (so that the ids of
        the events held are never given again, even if the events never reach the disk);
        logged once an episode, and at a close that leaves events unwritten."""
        try:
            with db:
                pending.write_marks(db)
        except sqlite3.Error:
            pass
        if first and not at_close:
            log.error(
                "event store %s: writing failed (%s); %d event(s) and the cursors are kept"
                " in memory (the newest %d events at most) and written once it works again:"
                " free space under the data directory (setting STREAMDET_DATA_DIR)",
                self.path,
                exc,
                len(pending.events),
                self.size,
            )
        if at_close:
            log.error(
                "event store %s: writing failed (%s) at shutdown; %d event(s) and %d cursor(s)"
                " are lost (their ids are never given again): free space under the data"
                " directory (setting STREAMDET_DATA_DIR)",
                self.path,
                exc,
                len(pending.events),
                len(pending.cursors),
            )
        self.failing = True
