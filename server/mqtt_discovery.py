"""Home Assistant MQTT discovery: the entities of each stream announced to Home Assistant,
which creates them by itself (no YAML), as Frigate's integration gives each camera its
sensors and switches.

Each stream is a device (``streamdet <name>``) with:

- a switch ``detection`` (``<prefix>/<id>/enabled/set`` and ``.../enabled/state``);
- a sensor ``state`` (``live``, ``reconnecting``, ``failed``, ``disabled``);
- a sensor ``objects``: what its last frame shows in all, the count of each class as
  attributes (``<prefix>/<id>/objects``), and ``active objects``, the same for those not
  stationary (``<prefix>/<id>/active``);
- a sensor per zone, ``<zone> objects``, the same for what stands in it;
- a camera per class it had an event of, ``<class>``: the newest thumbnail
  (``<prefix>/<id>/<class>/thumbnail``).

Configs are retained under ``<discovery prefix>/<component>/streamdet_<id>/<object>/config``
(``streamdet_<prefix>_<id>`` where the topics' prefix is not ``streamdet``: two servers with
their own prefixes keep their own entities); an entity whose stream or zone is gone gets an
empty config, which removes it. Every entity is unavailable while the server is
(``<prefix>/available``). With the server's public URL set (``--public-url``) each device
links to the viewer (its ``configuration_url``, the *Visit* link of Home Assistant's device
page).

Names become ids and topic levels uniquely: a zone's topic level is its name (UTF-8 letters
kept) with ``/``, ``+``, ``#`` and control characters replaced, and a short hash of the name
added where any was; an object id keeps letters, digits, ``_`` and ``-`` (a space becomes
``_``, as it always did) and adds the hash where anything else was replaced (``入口`` and
``出口``, ``a/b`` and ``a+b`` are two entities).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from streams.geometry import unprintable

DEFAULT_PREFIX = "streamdet"
"""The topics' default prefix: its entities' ids do not name it (as before there was any)."""
COMPONENTS = ("switch", "sensor", "camera")
"""The kinds of entity announced."""

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
_LEVEL_UNSAFE = frozenset("/+#")


@dataclass(frozen=True, slots=True)
class Discovery:
    """Where configs go (``discovery_prefix``) and where the states are (``prefix``); both
    without a leading or trailing ``/``. ``configuration_url``: each device's link to the
    viewer, where the server's public URL is known (``--public-url``); Home Assistant shows
    it on the device's page ("Visit"). None: no link."""

    prefix: str
    discovery_prefix: str = "homeassistant"
    configuration_url: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefix", self.prefix.strip("/"))
        object.__setattr__(self, "discovery_prefix", self.discovery_prefix.strip("/"))

    def stream(self, stream_id: str, name: str, zones: Iterable[str]) -> dict[str, dict[str, Any]]:
        """The configs of a stream's switch and sensors, by config topic."""
        configs = {
            self._topic("switch", stream_id, "enabled"): {
                **self._base(stream_id, name, "enabled", "detection"),
                "command_topic": self._state(stream_id, "enabled", "set"),
                "state_topic": self._state(stream_id, "enabled", "state"),
                "payload_on": "ON",
                "payload_off": "OFF",
                "icon": "mdi:cctv",
            },
            self._topic("sensor", stream_id, "state"): {
                **self._base(stream_id, name, "state", "state"),
                "state_topic": self._state(stream_id, "state"),
                "icon": "mdi:video-check",
            },
            self._topic("sensor", stream_id, "objects"): self._counts(
                stream_id, name, "objects", "objects", self._state(stream_id, "objects")
            ),
            self._topic("sensor", stream_id, "active"): self._counts(
                stream_id, name, "active", "active objects", self._state(stream_id, "active")
            ),
        }
        for zone, key in zone_keys(zones).items():
            configs[self._topic("sensor", stream_id, key)] = self._counts(
                stream_id,
                name,
                key,
                f"{zone} objects",
                self._state(stream_id, "zones", level(zone)),
            )
        return {topic: _entity_id(topic, config) for topic, config in configs.items()}

    def thumbnail(self, stream_id: str, name: str, class_name: str) -> tuple[str, dict[str, Any]]:
        """The config topic and config of the camera showing a class's newest thumbnail."""
        key = f"thumbnail_{object_id(class_name)}"
        topic = self._topic("camera", stream_id, key)
        return topic, _entity_id(
            topic,
            {
                **self._base(stream_id, name, key, class_name),
                "topic": self._state(stream_id, level(class_name), "thumbnail"),
            },
        )

    def subscriptions(self) -> list[str]:
        """Topic filters that match every config this server can have announced (and those
        of others: :meth:`owner` tells them apart)."""
        return [f"{self.discovery_prefix}/{c}/+/+/config" for c in COMPONENTS]

    def owner(self, topic: str, payload: bytes) -> tuple[str, str, dict[str, Any]] | None:
        """Of a retained config: the stream id, the component and the config, where this
        server announced it (its ids, and its availability and state topics); None for
        another's."""
        head = self.discovery_prefix + "/"
        levels = topic[len(head) :].split("/") if topic.startswith(head) else []
        if len(levels) != 4 or not levels[1].startswith("streamdet_") or levels[3] != "config":
            return None
        try:
            config = json.loads(payload)
        except ValueError:
            return None
        if not isinstance(config, dict) or config.get("availability_topic") != (
            f"{self.prefix}/available"
        ):
            return None
        source = config.get("state_topic") or config.get("topic")
        if not isinstance(source, str) or not source.startswith(self.prefix + "/"):
            return None
        return source[len(self.prefix) + 1 :].split("/", 1)[0], levels[0], config

    def _counts(
        self, stream_id: str, name: str, key: str, label: str, topic: str
    ) -> dict[str, Any]:
        return {
            **self._base(stream_id, name, key, label),
            "state_topic": topic,
            "value_template": "{{ value_json.all }}",
            "json_attributes_topic": topic,
            "unit_of_measurement": "objects",
            "state_class": "measurement",
            "icon": "mdi:shape",
        }

    def _base(self, stream_id: str, name: str, key: str, label: str) -> dict[str, Any]:
        node = self._node(stream_id)
        device = {
            "identifiers": [node],
            "name": f"streamdet {name or stream_id}",
            "manufacturer": "streamdet",
            "model": "video stream",
        }
        if self.configuration_url is not None:
            device["configuration_url"] = self.configuration_url
        return {
            "name": label,
            "unique_id": f"{node}_{key}",
            "availability_topic": f"{self.prefix}/available",
            "device": device,
        }

    def _node(self, stream_id: str) -> str:
        """The stream's device (and node) id: ``streamdet_<id>``, with the topics' prefix
        where it is not the default (another server's stream of the same id is another
        device)."""
        if self.prefix == DEFAULT_PREFIX:
            return f"streamdet_{object_id(stream_id)}"
        return f"streamdet_{object_id(self.prefix)}_{object_id(stream_id)}"

    def _topic(self, component: str, stream_id: str, key: str) -> str:
        return f"{self.discovery_prefix}/{component}/{self._node(stream_id)}/{key}/config"

    def _state(self, stream_id: str, *levels: str) -> str:
        return "/".join((self.prefix, stream_id, *levels))


def _entity_id(topic: str, config: dict[str, Any]) -> dict[str, Any]:
    """``config`` naming its entity's id: ``default_entity_id`` (Home Assistant 2025.10 on)
    and ``object_id`` (before; removed in 2026.4), both from its ``unique_id``. With
    ``unique_id`` alone Home Assistant names an entity after its device and name
    (``switch.streamdet_gate_detection``), not ``streamdet_<stream id>_<object>``."""
    component = topic.split("/")[-4]
    unique = config["unique_id"]
    return {**config, "object_id": unique, "default_entity_id": f"{component}.{unique}"}


def level(name: str) -> str:
    """A name as one MQTT topic level: itself where it can be one (UTF-8 letters are kept);
    otherwise the separator, the wildcards and what MQTT refuses (U+0000 and other control
    characters, lone surrogates: the broker drops a client that sends them) replaced by
    ``_``, and a hash of the name added, so that two names stay two levels."""
    clean = "".join("_" if c in _LEVEL_UNSAFE or unprintable(c) else c for c in name)
    return clean if clean == name and name else f"{clean}_{_digest(name)}"


def object_id(text: str, *, hashed: bool = False) -> str:
    """``text`` as Home Assistant's discovery ids allow (letters, digits, ``_`` and ``-``):
    itself where it is one, its spaces as ``_`` where it has only those besides (as ever),
    otherwise (or ``hashed``) what it has besides as ``_`` and a hash of it added."""
    safe = _UNSAFE.sub("_", text)
    if not hashed and (safe == text or set(_UNSAFE.findall(text)) == {" "}):
        return safe
    return f"{safe}_{_digest(text)}"


def zone_keys(zones: Iterable[str]) -> dict[str, str]:
    """Each zone's object id, ``zone_<id>``: unique among the stream's zones (``a b``, which
    would be ``zone_a_b`` as zone ``a_b`` is, gets a hash then)."""
    keys = {zone: f"zone_{object_id(zone)}" for zone in zones}
    taken = Counter(keys.values())
    for zone, key in keys.items():
        if taken[key] > 1 and object_id(zone) != zone:
            keys[zone] = f"zone_{object_id(zone, hashed=True)}"
    return keys


def _digest(text: str) -> str:
    """A short hash of ``text``, the same in every run."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:6]
