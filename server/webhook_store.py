"""Webhooks added at run time (``POST /webhooks``) are data: ``<data_dir>/webhooks.sqlite3``,
so they survive a restart (their cursors are kept with the event log). A connection per
call, from a worker thread."""

from __future__ import annotations

import json
import sqlite3
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from streams.store import keep_private

SCHEMA = """
CREATE TABLE IF NOT EXISTS webhooks (
    id TEXT PRIMARY KEY,
    url TEXT NOT NULL,
    secret TEXT,
    filter TEXT NOT NULL DEFAULT '{}',
    created_at REAL NOT NULL
)
"""


@dataclass(frozen=True, slots=True)
class WebhookRecord:
    """A webhook as it was added: where, its secret, its filters (``GET /events``' names,
    lists of strings) and when."""

    id: str
    url: str
    secret: str | None
    filter: dict[str, Any]
    created_at: float


class WebhookStore:
    """Webhooks in ``<data_dir>/webhooks.sqlite3``."""

    def __init__(self, data_dir: Path) -> None:
        data_dir.mkdir(parents=True, exist_ok=True)
        self.path = data_dir / "webhooks.sqlite3"
        keep_private(self.path)  # webhook URLs (tokens) and secrets
        with closing(self._connect()) as db, db:
            db.execute(SCHEMA)

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, timeout=10.0)

    def add(self, record: WebhookRecord) -> None:
        with closing(self._connect()) as db, db:
            db.execute(
                "INSERT INTO webhooks (id, url, secret, filter, created_at) VALUES (?, ?, ?, ?, ?)",
                (
                    record.id,
                    record.url,
                    record.secret,
                    json.dumps(record.filter),
                    record.created_at,
                ),
            )

    def remove(self, webhook_id: str) -> bool:
        with closing(self._connect()) as db, db:
            return db.execute("DELETE FROM webhooks WHERE id = ?", (webhook_id,)).rowcount > 0

    def load(self) -> list[WebhookRecord]:
        with closing(self._connect()) as db:
            rows = db.execute(
                "SELECT id, url, secret, filter, created_at FROM webhooks ORDER BY created_at"
            ).fetchall()
        return [WebhookRecord(r[0], r[1], r[2], json.loads(r[3]), r[4]) for r in rows]
