"""The event log on disk: ``<data_dir>/events.sqlite3`` keeps the last ``event_log_size``
events and each webhook's and MQTT broker's cursor, so a restart loses neither: ``GET
/events`` still has them, ids carry on where they stopped (a client's cursor stays valid),
and events logged but not yet delivered when the server stopped are delivered when it is
back.

Writes go through one writer thread in batches (a frame's events, a delivered batch's cursor),
so the event loop never waits for the disk; :meth:`EventStore.close` writes what is queued.
"""

from __future__ import annotations

import json
import logging
import queue
import sqlite3
import threading
from collections.abc import Sequence
from contextlib import closing
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS events (id INTEGER PRIMARY KEY, body TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS cursors (name TEXT PRIMARY KEY, cursor INTEGER NOT NULL)",
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL)",
)
PRUNE_EVERY = 500
"""Events written between two prunings of those beyond the log's size."""

_Op = tuple[str, Any]


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
        with closing(self._connect()) as db, db:
            db.execute("PRAGMA journal_mode=WAL")
            for statement in _SCHEMA:
                db.execute(statement)
            _close_emptied_run(db)
        self._ops: queue.SimpleQueue[_Op | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="event-store", daemon=True)
        self._writer.start()

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, timeout=10.0)

    # ---- reads, at start -----------------------------------------------------------------
    def load(self) -> tuple[list[dict[str, Any]], int | None]:
        """The last ``size`` events, oldest first, and the id of the first event of the run of
        ids they belong to (None for a new store, or one found empty at start)."""
        with closing(self._connect()) as db:
            rows = db.execute(
                "SELECT body FROM events ORDER BY id DESC LIMIT ?", (self.size,)
            ).fetchall()
            first = db.execute("SELECT value FROM meta WHERE key = 'first_id'").fetchone()
        events = []
        for (body,) in reversed(rows):
            try:
                events.append(json.loads(body))
            except ValueError:
                log.warning("event store %s: an unreadable event was skipped", self.path)
        return events, None if first is None else int(first[0])

    def gone_runs(self) -> list[tuple[int, int]]:
        """``(first, last)`` ids of earlier runs of ids every event of which left the log
        (retention emptied it, then ids started afresh from the clock), oldest first."""
        with closing(self._connect()) as db:
            rows = db.execute("SELECT key, value FROM meta WHERE key LIKE 'gone:%'").fetchall()
        return sorted((int(key.split(":", 1)[1]), int(last)) for key, last in rows)

    def cursor(self, name: str) -> int | None:
        """Where the sink ``name`` (a webhook, an MQTT broker) had delivered up to."""
        with closing(self._connect()) as db:
            row = db.execute("SELECT cursor FROM cursors WHERE name = ?", (name,)).fetchone()
        return None if row is None else int(row[0])

    # ---- writes, queued --------------------------------------------------------------------
    def append(self, events: Sequence[dict[str, Any]]) -> None:
        """Keep ``events`` (logged, with their ids)."""
        if events:
            self._ops.put(("events", list(events)))

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
        with closing(self._connect()) as db:
            db.execute("PRAGMA synchronous=NORMAL")
            while True:
                ops = [self._ops.get()]
                while True:  # everything queued meanwhile, in one transaction
                    try:
                        ops.append(self._ops.get_nowait())
                    except queue.Empty:
                        break
                done = None in ops
                try:
                    with db:
                        written += self._apply(db, [op for op in ops if op is not None])
                        if written >= PRUNE_EVERY:
                            written = 0
                            db.execute(
                                "DELETE FROM events WHERE id <= (SELECT id FROM events"
                                " ORDER BY id DESC LIMIT 1 OFFSET ?)",
                                (self.size,),
                            )
                except sqlite3.Error as exc:  # a full disk must not stop the server
                    log.error("event store %s: write failed: %s", self.path, exc)
                if done:
                    return

    @staticmethod
    def _apply(db: sqlite3.Connection, ops: list[_Op]) -> int:
        written = 0
        for kind, payload in ops:
            if kind == "events":
                rows = [(e["id"], json.dumps(e, separators=(",", ":"))) for e in payload]
                db.executemany("INSERT OR REPLACE INTO events (id, body) VALUES (?, ?)", rows)
                db.execute(
                    "INSERT OR IGNORE INTO meta (key, value) VALUES ('first_id', ?)", (rows[0][0],)
                )
                db.execute(
                    "INSERT OR REPLACE INTO meta (key, value) VALUES ('last_id', ?)",
                    (rows[-1][0],),
                )
                written += len(rows)
            elif kind == "forget":
                db.execute("DELETE FROM events WHERE id < ?", (payload,))
            elif kind == "drop-cursor":
                db.execute("DELETE FROM cursors WHERE name = ?", (payload,))
            else:
                db.execute(
                    "INSERT INTO cursors (name, cursor) VALUES (?, ?)"
                    " ON CONFLICT(name) DO UPDATE SET cursor = excluded.cursor",
                    payload,
                )
        return written
