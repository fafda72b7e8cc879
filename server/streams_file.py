"""The streams file (``--streams-file``): cameras declared as configuration, as Frigate's and
DeepStream's configuration files declare theirs, kept in version control and deployed with
the server.

YAML (JSON is YAML too): a list of streams, or ``{"streams": [...]}``; each entry has the
fields of ``POST /streams`` and an ``id``::

    streams:
      - id: front_door
        url: rtsp://admin:${FRONT_DOOR_PASSWORD}@10.0.0.5/stream1
        classes: [person, car]
        track: true
        zones: [{name: porch, points: [[0, 0.6], [1, 0.6], [1, 1], [0, 1]], loiter_s: 30}]

``${NAME}`` in a text is replaced by the environment variable ``NAME``, so passwords stay out
of the file (as Frigate's ``{FRIGATE_RTSP_PASSWORD}``). A value that is nothing but an
unquoted ``${NAME}`` (``enabled: ${DOOR_ON}``, ``max_fps: ${FPS}``) takes the type its text
has in YAML, as if written there (``false``, ``5``); quoted (``"${NAME}"``) it stays text.
At start the server makes the streams the file declares match it
(``server.routes.streams.apply_streams_file``); ``GET /streams?format=yaml`` writes
every stream in this form (passwords masked).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

_VARIABLE = re.compile(r"(\$?)\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
"""``${NAME}``, or ``$${NAME}``: the text ``${NAME}`` itself (Docker Compose's escape)."""
# What an export leaves out: the stream's state and counts, not its settings.
_SETTINGS = ("id", "name", "url", "max_fps", "transport", "loop", "enabled")


class StreamsFileError(ValueError):
    """The streams file cannot be used; the message names the file, the entry and why."""


def read_entries(path: Path, environ: Mapping[str, str]) -> list[dict[str, Any]]:
    """The entries of the streams file at ``path``, ``${NAME}`` replaced from ``environ``.

    Raises:
        StreamsFileError: unreadable, not YAML, not a list of mappings, an entry without an
            ``id`` or with one used twice, or an environment variable that is not set.
    """
    where = f"streams file {path} (setting STREAMDET_STREAMS_FILE)"
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader
    except OSError as exc:
        raise StreamsFileError(f"{where}: cannot read it: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:  # UTF-16 from an editor, a binary file
        raise StreamsFileError(
            f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start})"
        ) from None
    except yaml.YAMLError as exc:
        raise StreamsFileError(f"{where}: not YAML: {exc}") from None
    if isinstance(data, dict) and set(data) == {"streams"}:
        data = data["streams"]
    if data is None:
        data = []
    if not isinstance(data, list) or not all(isinstance(e, dict) for e in data):
        raise StreamsFileError(f"{where}: expected a list of streams, or {{streams: [...]}}")
    seen: set[str] = set()
    entries = []
    for number, raw in enumerate(data, 1):
        named = raw.get("id")
        plain = isinstance(named, str) and named and not _VARIABLE.search(named)
        label = f"stream {named!r}" if plain else f"stream {number}"
        entry = _substitute(raw, environ, f"{where}: {label}")
        sid = entry.get("id")
        if isinstance(sid, (int, float)) and not isinstance(sid, bool):
            # Quoted as written: a variable's "007" read as 7 is quoted as "${CAMID}" (the
            # advice id: "7" lost its zeros).
            written = named if isinstance(named, str) else sid
            raise StreamsFileError(
                f'{where}: stream {number}: its id {sid} is a number; quote it (id: "{written}")'
            )
        if not isinstance(sid, str) or not sid:
            raise StreamsFileError(f"{where}: stream {number}: give it an id (e.g. front_door)")
        if sid in seen:
            raise StreamsFileError(f"{where}: stream {number}: the id {sid!r} is used twice")
        seen.add(sid)
        entries.append(entry)
    return entries


class _Variable(str):
    """A value that was nothing but an unquoted ``${NAME}``: typed by its text once filled."""


_VARIABLE_TAG = "!streamdet/variable"


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping: the last one won, so
    a second ``streams:`` block dropped the first's cameras without a word."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == MERGE_TAG:  # "<<: *base": its keys may be given again here
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                twice = key in seen
                seen.add(key)
            except TypeError:  # a list or mapping as a key: the loader says so below
                continue
            if twice:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} is given twice", key_node.start_mark
                )
        return super().construct_mapping(node, deep=deep)

    def construct_variable(self, node: yaml.ScalarNode) -> _Variable:
        return _Variable(self.construct_scalar(node))


# Implicit resolvers apply to plain (unquoted) scalars only: "${NAME}" quoted stays text.
_UniqueKeyLoader.add_implicit_resolver(
    _VARIABLE_TAG, re.compile(r"^\$\{[A-Za-z_][A-Za-z0-9_]*\}$"), ["$"]
)
_UniqueKeyLoader.add_constructor(_VARIABLE_TAG, _UniqueKeyLoader.construct_variable)


MERGE_TAG = "tag:yaml.org,2002:merge"


# In a URL's user or password part these end it early: a password with "@" or "#" gave
# another host, and showed what came after the character in every error and listing.
_USERINFO_ENDS = {c: f"%{ord(c):02X}" for c in "@/?#[] "}


def _in_userinfo(text: str, start: int, end: int) -> bool:
    """Whether ``text[start:end]`` lies in a URL's ``user:password@`` part."""
    scheme = text.find("://")
    if scheme < 0 or start < scheme + 3:
        return False
    authority = re.match(r"[^/?#]*", text[scheme + 3 :])
    at = text.rfind("@", scheme + 3, scheme + 3 + (authority.end() if authority else 0))
    return end <= at


def _substitute(value: Any, environ: Mapping[str, str], where: str) -> Any:
    """``value`` with ``${NAME}`` in its texts replaced from ``environ``; in a URL's user or
    password part, with the characters that would end that part percent-encoded (``%`` is
    kept: a value already encoded stays as it was)."""
    if isinstance(value, str):

        def variable(match: re.Match[str]) -> str:
            escaped, name = match.group(1), match.group(2)
            if escaped:
                return f"${{{name}}}"
            if name not in environ:
                raise StreamsFileError(f"{where}: the environment variable {name} is not set")
            if _in_userinfo(value, match.start(), match.end()):
                return "".join(_USERINFO_ENDS.get(c, c) for c in environ[name])
            return environ[name]

        text = _VARIABLE.sub(variable, value)
        return _typed(text) if isinstance(value, _Variable) else text
    if isinstance(value, list):
        return [_substitute(v, environ, where) for v in value]
    if isinstance(value, dict):
        return {k: _substitute(v, environ, where) for k, v in value.items()}
    return value


def _typed(text: str) -> Any:
    """``text`` as YAML reads it written unquoted, where that is a true/false, a number or
    nothing (``enabled: ${ON}`` with ``ON=false`` is false, as in Docker Compose's files);
    any other text stays as it is (``#`` in a password is not a comment)."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if value is None or isinstance(value, (bool, int, float)):
        return value
    return text


def to_text(streams: Sequence[Mapping[str, Any]]) -> str:
    """Streams as ``GET /streams`` describes them, as a streams file: their settings only
    (``url`` as described, its password masked)."""
    entries = [
        _escaped({**{key: stream[key] for key in _SETTINGS}, **stream["detect"]})
        for stream in streams
    ]
    return str(yaml.safe_dump({"streams": entries}, sort_keys=False, allow_unicode=True))


def _escaped(value: Any) -> Any:
    """``value`` with each ``${NAME}`` in its texts written ``$${NAME}``, which a streams
    file reads back as that text (a stream named "Gate ${A}" was read with A's value, or
    not at all where A was not set)."""
    if isinstance(value, str):
        return _VARIABLE.sub(lambda m: "$" + m.group(0) if not m.group(1) else m.group(0), value)
    if isinstance(value, list):
        return [_escaped(v) for v in value]
    if isinstance(value, dict):
        return {k: _escaped(v) for k, v in value.items()}
    return value
