"""Telling a data directory that cannot be written (a full disk, a quota, a read-only mount)
from other errors, for every store to say so and name the setting."""

from __future__ import annotations

import errno
import sqlite3

STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})
SQLITE_STORAGE_WORDS = ("full", "readonly", "disk i/o", "no such table", "unable to open")
"""SQLite's words for a store it cannot write: the last two, its file or the whole data dir
deleted (or replaced) while the server ran (a 500 naming no setting)."""
DATA_DIR_HINT = (
    "free space in, or fix the permissions of, the data directory: setting STREAMDET_DATA_DIR"
)


def storage_failure(exc: BaseException) -> bool:
    """Whether ``exc`` says the data directory cannot be written: a full disk, a quota, a
    read-only mount (an ``OSError``, or SQLite's words for them)."""
    if isinstance(exc, sqlite3.OperationalError):
        return any(word in str(exc).lower() for word in SQLITE_STORAGE_WORDS)
    return isinstance(exc, OSError) and exc.errno in STORAGE_ERRNOS
