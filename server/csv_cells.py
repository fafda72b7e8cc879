"""CSV answers a spreadsheet opens safely.

A cell whose text begins with ``=``, ``+``, ``-``, ``@``, a tab or a carriage return is run
as a formula by Excel, LibreOffice and Google Sheets (OWASP's "CSV injection"); the names a
caller gave (a manual event's label, a zone's or a line's name) reach the job and counts
CSVs as they came, so ``=HYPERLINK(...)`` in a label became a live link. Such text is
written with a leading ``'``, which spreadsheets show as text; numbers are left alone.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def safe_cell(value: Any) -> Any:
    """``value``, text that a spreadsheet would run as a formula quoted with ``'``."""
    if isinstance(value, str) and value.startswith(FORMULA_STARTS):
        return "'" + value
    return value


def csv_text(columns: Sequence[str], rows: Iterable[Mapping[str, Any]]) -> str:
    """``rows`` as CSV under a header of ``columns`` (members of a row not in them are left
    out), every text cell :func:`safe_cell`."""
    text = io.StringIO()
    writer = csv.DictWriter(text, columns, lineterminator="\n", extrasaction="ignore")
    writer.writeheader()
    writer.writerows({key: safe_cell(value) for key, value in row.items()} for row in rows)
    return text.getvalue()
