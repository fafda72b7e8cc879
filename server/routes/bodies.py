"""Request bodies that are no JSON Python can read, and what to tell their sender.

``json.loads`` raises more than ``JSONDecodeError``: ``UnicodeDecodeError`` for bytes that are
not UTF-8 (or UTF-16/32), ``RecursionError`` for arrays or objects nested deeper than its
parser recurses (about 1,000 here), and ``ValueError`` for an integer of more than 4,300
digits (CPython's int/str limit). Each was a 500 where a route read JSON itself, and FastAPI's
"There was an error parsing the body" (400, naming nothing) where it read a model's body.
"""

from __future__ import annotations

import json
import sys
from typing import Any

# What json.loads raises for a body it cannot read (JSONDecodeError and UnicodeDecodeError are
# ValueErrors).
UNREADABLE = (ValueError, RecursionError)

# FastAPI's answer to a model's body that json.loads raised anything but JSONDecodeError on.
FASTAPI_PARSE_ERROR = "There was an error parsing the body"


def why_unreadable(exc: BaseException) -> str:
    """What is wrong with a body ``json.loads`` raised ``exc`` on, in words for its sender."""
    if isinstance(exc, UnicodeDecodeError):
        byte = exc.object[exc.start : exc.start + 1]
        return f"not UTF-8 text: byte {exc.start} ({byte!r}): {exc.reason}"
    if isinstance(exc, RecursionError):
        return "arrays or objects nested too deeply to read"
    if isinstance(exc, json.JSONDecodeError):
        return f"not JSON: {exc}"
    if "digits" in str(exc):
        return f"an integer of more than {sys.get_int_max_str_digits()} digits"
    return f"not JSON: {exc}"


def load_json(data: bytes | str) -> Any:
    """``json.loads(data)``; ``ValueError`` saying why (``why_unreadable``) where it cannot."""
    try:
        return json.loads(data)
    except UNREADABLE as exc:
        raise ValueError(why_unreadable(exc)) from None
