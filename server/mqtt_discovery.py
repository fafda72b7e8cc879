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

Configs are retained under ``<discovery prefix>/<component>/streamdet_<id>/<object>/config``;
an entity whose stream or zone is gone gets an empty config, which removes it. Every entity
is unavailable while the server is (``<prefix>/available``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


@dataclass(frozen=True, slots=True)
class Discovery:
    """Where configs go (``discovery_prefix``) and where the states are (``prefix``)."""

    prefix: str
    discovery_prefix: str = "homeassistant"

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
        for zone in zones:
            key = f"zone_{_safe(zone)}"
            configs[self._topic("sensor", stream_id, key)] = self._counts(
                stream_id,
                name,
                key,
                f"{zone} objects",
                self._state(stream_id, "zones", level(zone)),
            )
        return configs

    def thumbnail(self, stream_id: str, name: str, class_name: str) -> tuple[str, dict[str, Any]]:
        """The config topic and config of the camera showing a class's newest thumbnail."""
        key = f"thumbnail_{_safe(class_name)}"
        return self._topic("camera", stream_id, key), {
            **self._base(stream_id, name, key, class_name),
            "topic": self._state(stream_id, level(class_name), "thumbnail"),
        }

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
        return {
            "name": label,
            "unique_id": f"streamdet_{_safe(stream_id)}_{key}",
            "availability_topic": f"{self.prefix}/available",
            "device": {
                "identifiers": [f"streamdet_{_safe(stream_id)}"],
                "name": f"streamdet {name or stream_id}",
                "manufacturer": "streamdet",
                "model": "video stream",
            },
        }

    def _topic(self, component: str, stream_id: str, key: str) -> str:
        return f"{self.discovery_prefix}/{component}/streamdet_{_safe(stream_id)}/{key}/config"

    def _state(self, stream_id: str, *levels: str) -> str:
        return "/".join((self.prefix, stream_id, *levels))


def level(name: str) -> str:
    """A name as one MQTT topic level: the separator and the wildcards replaced."""
    return name.replace("/", "_").replace("+", "_").replace("#", "_")


def _safe(text: str) -> str:
    """``text`` as Home Assistant's discovery ids allow (letters, digits, _ and -)."""
    return _UNSAFE.sub("_", text)
