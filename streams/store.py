"""The stream list is data: an SQLite file under the data directory, so streams survive a
restart. A connection per call keeps it usable from any thread."""

from __future__ import annotations

import os
import sqlite3
import time
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS streams (
    id TEXT PRIMARY KEY,
    url TEXT NOT NULL,
    name TEXT NOT NULL DEFAULT '',
    max_fps REAL,
    transport TEXT NOT NULL DEFAULT 'tcp',
    loop INTEGER NOT NULL DEFAULT 1,
    created_at REAL NOT NULL,
    detect TEXT NOT NULL DEFAULT '{}'
)
"""
# Columns added after the first release, with their definitions: an older file gains them.
ADDED_COLUMNS = {
    "detect": "TEXT NOT NULL DEFAULT '{}'",
    "from_file": "INTEGER NOT NULL DEFAULT 0",
    "enabled": "INTEGER NOT NULL DEFAULT 1",
}
_COLUMNS = "id, url, name, max_fps, transport, loop, created_at, detect, from_file, enabled"
_INSERT = f"INSERT INTO streams ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"  # noqa: S608
_SELECT = f"SELECT {_COLUMNS} FROM streams ORDER BY created_at"  # noqa: S608 (constants)


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
    detect: str = "{}"
    """Detection parameters as JSON (:meth:`engines.types.DetectParams.describe`)."""
    from_file: bool = False
    """Declared in the streams file (``--streams-file``), which alone changes it."""
    enabled: bool = True
    """Decoded and detected; a disabled stream keeps its settings and counts, camera closed."""


def keep_private(path: Path) -> None:
    """Make the file at ``path`` (created empty if missing) readable by this user only: it
    holds secrets at rest (cameras' passwords in their URLs, webhooks' tokens), and was made
    0644 under the usual umask, for every user of the machine to read. SQLite gives the
    database's journal the database's mode."""
    os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
    os.chmod(path, 0o600)  # one an earlier version made readable by everyone


def private_dir(path: Path) -> None:
    """Make the directory at ``path`` (and its missing parents) enterable by this user only:
    what it holds (a job's source URL and callback, people's snapshots and clips) was made
    under the usual umask for every user of the machine to read; an earlier version's is
    closed too."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)


def write_private(path: Path, data: bytes) -> None:
    """``data`` to a new file at ``path`` (replaced if there), readable by this user only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        os.fchmod(out.fileno(), 0o600)  # one left by an earlier version
        out.write(data)


class StreamStore:
    """Streams in ``<data_dir>/streams.sqlite3``.

    Args:
        data_dir: created if missing (setting ``STREAMDET_DATA_DIR``).
    """

    def __init__(self, data_dir: Path) -> None:
        data_dir.mkdir(parents=True, exist_ok=True)
        self.path = data_dir / "streams.sqlite3"
        keep_private(self.path)  # camera URLs, passwords and all
        with closing(self._connect()) as db, db:
            db.execute(SCHEMA)
            have = {row[1] for row in db.execute("PRAGMA table_info(streams)")}
            for column, definition in ADDED_COLUMNS.items():
                if column not in have:
                    db.execute(f"ALTER TABLE streams ADD COLUMN {column} {definition}")

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, timeout=10.0)

    def add(self, record: StreamRecord) -> None:
        with closing(self._connect()) as db, db:
            db.execute(_INSERT, _row(record))

    def replace(self, record: StreamRecord) -> bool:
        """Save every field of a stream that was replaced (``PUT``, the streams file); False
        if the stream is unknown."""
        with closing(self._connect()) as db, db:
            cursor = db.execute(
                "UPDATE streams SET url = ?, name = ?, max_fps = ?, transport = ?, loop = ?,"
                " detect = ?, from_file = ?, enabled = ? WHERE id = ?",
                (*_row(record)[1:6], *_row(record)[7:], record.id),
            )
            return cursor.rowcount > 0

    def update(self, record: StreamRecord) -> bool:
        """Save what may change while a stream runs (name, max_fps, detect, enabled); False
        if the stream is unknown."""
        with closing(self._connect()) as db, db:
            cursor = db.execute(
                "UPDATE streams SET name = ?, max_fps = ?, detect = ?, enabled = ? WHERE id = ?",
                (record.name, record.max_fps, record.detect, int(record.enabled), record.id),
            )
            return cursor.rowcount > 0

    def remove(self, stream_id: str) -> bool:
        with closing(self._connect()) as db, db:
            return db.execute("DELETE FROM streams WHERE id = ?", (stream_id,)).rowcount > 0

    def load(self) -> list[StreamRecord]:
        with closing(self._connect()) as db:
            rows = db.execute(_SELECT).fetchall()
        return [
            StreamRecord(
                r[0], r[1], r[2], r[3], r[4], bool(r[5]), r[6], r[7], bool(r[8]), bool(r[9])
            )
            for r in rows
        ]


def _row(record: StreamRecord) -> tuple[Any, ...]:
    """A record as the table's columns, in :data:`_COLUMNS`' order."""
    return (
        record.id,
        record.url,
        record.name,
        record.max_fps,
        record.transport,
        int(record.loop),
        record.created_at,
        record.detect,
        int(record.from_file),
        int(record.enabled),
    )


def new_record(
    stream_id: str,
    url: str,
    *,
    name: str,
    max_fps: float | None,
    transport: str,
    loop: bool,
    detect: str = "{}",
    from_file: bool = False,
    enabled: bool = True,
) -> StreamRecord:
    return StreamRecord(
        stream_id, url, name, max_fps, transport, loop, time.time(), detect, from_file, enabled
    )
