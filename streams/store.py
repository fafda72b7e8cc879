"""The stream list is data: an SQLite file under the data directory, so streams survive a
restart. A connection per call keeps it usable from any thread."""

from __future__ import annotations

import sqlite3
import time
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

_SCHEMA = """
CREATE TABLE IF NOT EXISTS streams (
    id TEXT PRIMARY KEY,
    url TEXT NOT NULL,
    name TEXT NOT NULL DEFAULT '',
    max_fps REAL,
    transport TEXT NOT NULL DEFAULT 'tcp',
    loop INTEGER NOT NULL DEFAULT 1,
    created_at REAL NOT NULL
)
"""


@dataclass(frozen=True, slots=True)
class StreamRecord:
    """A persisted stream, as the user added it."""

    id: str
    url: str
    name: str
    max_fps: float | None
    transport: str
    loop: bool
    created_at: float


class StreamStore:
    """Streams in ``<data_dir>/streams.sqlite3``.

    Args:
        data_dir: created if missing (setting ``STREAMDET_DATA_DIR``).
    """

    def __init__(self, data_dir: Path) -> None:
        data_dir.mkdir(parents=True, exist_ok=True)
        self.path = data_dir / "streams.sqlite3"
        with closing(self._connect()) as db, db:
            db.execute(_SCHEMA)

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, timeout=10.0)

    def add(self, record: StreamRecord) -> None:
        with closing(self._connect()) as db, db:
            db.execute(
                "INSERT INTO streams (id, url, name, max_fps, transport, loop, created_at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    record.id,
                    record.url,
                    record.name,
                    record.max_fps,
                    record.transport,
                    int(record.loop),
                    record.created_at,
                ),
            )

    def remove(self, stream_id: str) -> bool:
        with closing(self._connect()) as db, db:
            return db.execute("DELETE FROM streams WHERE id = ?", (stream_id,)).rowcount > 0

    def load(self) -> list[StreamRecord]:
        with closing(self._connect()) as db:
            rows = db.execute(
                "SELECT id, url, name, max_fps, transport, loop, created_at FROM streams"
                " ORDER BY created_at"
            ).fetchall()
        return [StreamRecord(r[0], r[1], r[2], r[3], r[4], bool(r[5]), r[6]) for r in rows]


def new_record(
    stream_id: str, url: str, *, name: str, max_fps: float | None, transport: str, loop: bool
) -> StreamRecord:
    return StreamRecord(stream_id, url, name, max_fps, transport, loop, time.time())
