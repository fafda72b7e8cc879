"""The data dir as a server starts on it: held by one server at a time
(:class:`DataDirLock`), and its stores checked before the model loads
(:func:`data_dir_problems`): a damaged database, or a file where a folder goes, failed the
start with a traceback that named neither the file nor the setting."""

from __future__ import annotations

import contextlib
import os
import sqlite3
from pathlib import Path

DATABASES = ("streams.sqlite3", "events.sqlite3", "webhooks.sqlite3")
FOLDERS = ("jobs", "snapshots", "clips")
MOVE_ASIDE = (
    "move it aside to start without what it held, or put back a copy that works (setting"
    " STREAMDET_DATA_DIR)"
)


def data_dir_problems(data_dir: Path) -> list[str]:
    """What in ``data_dir`` would stop the server's start: each a line naming the file."""
    problems: list[str] = []
    for name in FOLDERS:
        path = data_dir / name
        if path.exists() and not path.is_dir():
            problems.append(f"{path}: not a folder; {MOVE_ASIDE}")
    for name in DATABASES:
        path = data_dir / name
        if not path.exists():
            continue
        if not path.is_file():
            problems.append(f"{path}: not a file; {MOVE_ASIDE}")
            continue
        if not os.access(path, os.R_OK | os.W_OK):
            problems.append(
                f"{path}: this user ({os.getuid()}) cannot read and write it; give it to the"
                " server's user (chown), or run the server as its owner"
            )
            continue
        try:  # read only, and as little as tells a database from something else
            with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
                db.execute("SELECT name FROM sqlite_master").fetchall()
                lacking = _lacking_columns(db, name)
        except sqlite3.Error as exc:
            problems.append(f"{path}: not a database SQLite can read ({exc}); {MOVE_ASIDE}")
            continue
        if lacking:
            problems.append(
                f"{path}: not streamdet's ({lacking}): another program's database, or one"
                f" damaged by hand; {MOVE_ASIDE}"
            )
    return problems


def _lacking_columns(db: sqlite3.Connection, name: str) -> str:
    """What ``db``'s tables lack of the columns streamdet's store ``name`` reads (those its
    later releases add to an older file aside): a file of the same name from another program
    failed the start after the model loaded, with a traceback ("no such column: id")."""
    from server.webhook_store import SCHEMA as WEBHOOKS
    from streams.event_store import SCHEMA as EVENTS
    from streams.store import ADDED_COLUMNS
    from streams.store import SCHEMA as STREAMS

    statements, added = {
        "streams.sqlite3": ((STREAMS,), {"streams": ADDED_COLUMNS}),
        "events.sqlite3": (EVENTS, {}),
        "webhooks.sqlite3": ((WEBHOOKS,), {}),
    }[name]
    with contextlib.closing(sqlite3.connect(":memory:")) as wanted:
        for statement in statements:
            wanted.execute(statement)
        tables = [row[0] for row in wanted.execute("SELECT name FROM sqlite_master")]
        tables = [t for t in tables if not t.startswith("sqlite_")]  # its indexes
        lacking = []
        for table in tables:
            have = table_columns(db, table)
            need = table_columns(wanted, table) - set(added.get(table, ()))
            if have and need - have:  # a table that is not there yet is made
                lacking.append(f"table {table} has no {', '.join(sorted(need - have))}")
    return "; ".join(lacking)


def table_columns(db: sqlite3.Connection, table: str) -> set[str]:
    """The names of ``table``'s columns in ``db`` (none where it has no such table)."""
    return {row[1] for row in db.execute("SELECT * FROM pragma_table_info(?)", (table,))}


class DataDirLock:
    """The data dir, held (``flock`` on the folder itself) while a server runs: two servers
    on one data dir opened the same cameras, sent each event to the webhooks twice under two
    ids, and interleaved their logs. The kernel lets go of it however the process ends.
    ``<data-dir>/server.lock`` says which process holds it (a lock on that file was lost
    when it was deleted: the next server made another and took that).

    A data dir deleted whole and made again while its server runs is another folder: a
    second server can take it.
    """

    NAME = "server.lock"

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / self.NAME
        self._fd: int | None = None

    def acquire(self) -> str | None:
        """Hold it; who holds it instead (``pid N``), or None. A data dir it cannot be made
        in is left to the server's own check of the dir, which says why."""
        import fcntl

        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            try:
                holder = self.path.read_text(errors="replace").strip()
            except OSError:
                holder = ""
            return f"pid {holder}" if holder.isdigit() else "its lock is held"
        except OSError:  # a file system without locks: as before, unlocked
            os.close(fd)
            return None
        with contextlib.suppress(OSError):
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(f"{os.getpid()}\n")
            tmp.replace(self.path)
        self._fd = fd
        return None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
