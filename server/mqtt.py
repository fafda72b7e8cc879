"""MQTT: every event of the event log (``streams/events.py``) published to a broker, as
Frigate publishes its events for Home Assistant and Node-RED.

With ``mqtt_url`` set (``mqtt://[user:password@]host[:port]``, ``mqtts://`` for TLS), each
event goes, as the JSON ``GET /events`` returns, to ``<prefix>/events`` and to
``<prefix>/<stream id>/events`` (QoS 1: at least once), and ``<prefix>/available`` holds
``online`` while the server is connected, ``offline`` otherwise (retained; the broker
publishes ``offline`` itself if the server vanishes, as its last will).

Retained state for dashboards (Home Assistant sensors): ``<prefix>/<stream id>/state`` holds
the stream's state (``live``, ``reconnecting``, ``failed``) from its ``stream_state`` events,
``<prefix>/<stream id>/objects`` what its last frame shows and ``<prefix>/<stream
id>/zones/<zone>`` what stands in each zone now, ``{"all": n, "<class>": n, ...}`` (objects
counted once where the stream tracks), published when they change, as Frigate publishes its
camera and zone counts; ``<prefix>/<stream id>/active`` the same for the objects that are not
stationary (tracked streams: still under the stream's ``stationary_s``; untracked, every
object), as Frigate's ``<camera>/<object>/active``: a parked car is in ``objects``, not in
``active``; ``<prefix>/<stream id>/<class>/thumbnail`` the
JPEG thumbnail of the newest event of an object of that class (``GET
/events/{id}/thumbnail.jpg``), as Frigate publishes ``frigate/<camera>/<object>/snapshot``
for Home Assistant's MQTT camera ("the last person at the door"). A zone that is removed has
its topic cleared, and so has a stream that is removed, all of its topics. What a stream or
zone removed while the server was down (or another run of it) left retained is cleared on
connect: the publisher reads what the broker retains under its topics (and its discovery
configs, told apart from another server's by their availability topic) for a moment, and
clears what no current stream, zone or class has; a server nested under the prefix, whose
topics look like this one's, is left alone (see :meth:`MqttPublisher._owned`).

Control, as Frigate's ``frigate/<camera>/enabled/set``: ``ON`` or ``OFF`` published to
``<prefix>/<stream id>/enabled/set`` enables or disables the stream (``PATCH /streams/{id}
{"enabled": ...}``: a privacy switch for Home Assistant), and
``<prefix>/<stream id>/enabled/state`` holds ``ON`` or ``OFF`` (retained).

The publisher reads the log with its own cursor, as a webhook does, and only while the broker
is connected: a broker that is down or restarting gets, once it is back, what happened
meanwhile, as far back as the log reaches; what left the log before is counted
(``streamdet_mqtt_events_total{outcome="missed"}``) and logged. The client reconnects by
itself, backing off from 1 s to 10 s; why it cannot connect is logged (the first time, then
at most once a minute). A broker that cannot be reached never delays a stream, a request or
the server's start.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import ssl
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.reasoncodes import ReasonCode

from server.metrics import Metrics
from server.mqtt_discovery import Discovery, level
from server.routes.paths import link_base, served_event
from streams.detect import StreamDetect
from streams.events import EventLog, LogReader
from streams.fanout import ProcessedFrame
from streams.geometry import unprintable
from streams.reader import NOT_SHOWING

log = logging.getLogger(__name__)

ACK_POLL_S = 0.02
"""How often the broker's acknowledgements of a page of events are looked at."""
BATCH = 100
QOS = 1
COUNT_TOPICS = ("objects", "active")
SHOWS_NOTHING = frozenset(state.value for state in NOT_SHOWING)
"""Stream states in which it shows nothing now: its counts are published as 0."""
"""A stream's retained counts of what its last frame shows: all, and those not stationary."""
MAX_INFLIGHT = 1000
"""Publications the client keeps unacknowledged before the publisher waits for the broker."""
SETTLE_S = 0.5
"""On connect, how long no retained message of the server's topics comes before what came is
taken as all the broker retains."""
SWEEP_MAX_S = 5.0
"""On connect, the longest the retained topics are read (a broker that retains a lot)."""
FAILURE_LOG_S = 60.0
"""Failures to connect are logged at most this often (the first at once)."""
REFRESH_S = 0.5
"""How often the streams' names and zones are looked at (announced again where they changed,
frames or none)."""
FIXED_KINDS = (("state",), ("objects",), ("active",), ("enabled", "state"))
"""A stream's retained topics besides its zones and thumbnails."""
SWITCH_STATES = frozenset({b"ON", b"OFF"})
"""What a stream's ``enabled/state`` holds."""
AVAILABILITY = frozenset({b"online", b"offline"})
"""What a server's ``available`` topic holds."""


def _json_object(payload: bytes) -> bool:
    """Whether ``payload`` is a JSON object (as a zone's counts are)."""
    try:
        return isinstance(json.loads(payload), dict)
    except ValueError:  # not JSON, or not UTF-8
        return False


def check_mqtt_url(url: str) -> str:
    """``url`` if it is ``mqtt://`` or ``mqtts://`` with a host, a port from 1 to 65535 if
    any, and no path, query or fragment (MQTT has no use for them: they were ignored).

    Raises:
        ValueError: naming the setting.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("mqtt", "mqtts") or not parts.hostname:
        from streams.sources import redact  # its password: the error is shown

        raise ValueError(
            f"mqtt_url: {redact(url)!r} is not mqtt://host[:port] or mqtts://host[:port]"
            " (setting STREAMDET_MQTT_URL)"
        )
    where = f"{parts.scheme}://{parts.hostname}"  # no password in the message
    if "@" in url[url.index(parts.netloc) + len(parts.netloc) :]:
        # A "/", "?" or "#" in the password ended the host part early: its start was shown
        # as the port, or its end as a path.
        raise ValueError(
            "mqtt_url: its user or password holds '/', '?' or '#', which end that part of a"
            " URL: percent-encode them (%2F, %3F, %23) (setting STREAMDET_MQTT_URL)"
        )
    try:
        port = parts.port
    except ValueError:
        port = 0
    if port == 0:
        given = parts.netloc.rpartition("@")[2].rpartition(":")[2]
        raise ValueError(
            f"mqtt_url: port {given!r} of {where} is not a number from 1 to 65535 (setting"
            " STREAMDET_MQTT_URL)"
        )
    extras = [
        name
        for name, there in (
            ("a path", parts.path not in ("", "/")),
            ("a query", parts.query),
            ("a fragment", parts.fragment),
        )
        if there
    ]
    if extras:  # named, not shown: a query may hold a token
        raise ValueError(
            f"mqtt_url: {where} has {' and '.join(extras)}, which MQTT has no use for:"
            " mqtt://[user:password@]host[:port]; the topics are set by STREAMDET_MQTT_TOPIC"
            " (setting STREAMDET_MQTT_URL)"
        )
    return url


def check_topic_prefix(value: str, field: str) -> str:
    """``value`` (``mqtt_topic``, ``mqtt_discovery_prefix``) without a leading or trailing
    ``/``: the form every topic is built from.

    Raises:
        ValueError: an empty level, a wildcard or a control character, naming the setting.
    """
    prefix = value.strip("/")
    problem = ""
    if not prefix:
        problem = "has no topic level"
    elif "//" in prefix:
        problem = "has an empty topic level (//)"
    elif "+" in prefix or "#" in prefix:
        problem = "may not hold the wildcards + or #"
    elif any(unprintable(c) for c in prefix):
        problem = "may not hold control characters (U+0000...)"
    if problem:
        raise ValueError(f"{field}: {value!r} {problem} (setting STREAMDET_{field.upper()})")
    return prefix


def safe_url(url: str) -> str:
    """``url`` without its credentials, for logs."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}:{parts.port or _default_port(parts.scheme)}"


def _default_port(scheme: str) -> int:
    return 8883 if scheme == "mqtts" else 1883


class MqttPublisher:
    """Publishes the log's events from those after ``start`` on.

    Args:
        url: the broker.
        prefix: the topics' first level.
        events: the event log.
        metrics: counts events sent and missed, and whether the broker is connected.
        detect_of: a stream's settings (its zones' counts are published).
        thumbnail_of: an event's thumbnail JPEG (published, retained, per stream and class).
        enable: enables or disables a stream (``.../enabled/set``); False for an unknown one.
        roster: every stream's name and whether it is enabled (``.../enabled/state`` and the
            discovery configs on connect).
        name_of: a stream's name now: a renamed stream's entities are announced again under
            the new name (within a second, whether it has frames or not).
        discovery: announce each stream's entities to Home Assistant
            (``server/mqtt_discovery.py``); None: do not.
        root_path: the events' paths (snapshot, thumbnail, clip) start with it, as
            ``GET /events`` gives them behind the proxy (``--root-path``).
        public_url: where receivers reach the app (``--public-url``): the events' paths
            are absolute URLs under it instead, which Home Assistant or Node-RED can fetch.
    """

    def __init__(
        self,
        url: str,
        prefix: str,
        events: EventLog,
        metrics: Metrics | None = None,
        detect_of: Callable[[str], StreamDetect | None] | None = None,
        *,
        thumbnail_of: Callable[[int], Awaitable[bytes | None]] | None = None,
        enable: Callable[[str, bool], Awaitable[bool]] | None = None,
        roster: Callable[[], Mapping[str, tuple[str, bool]]] | None = None,
        name_of: Callable[[str], str | None] | None = None,
        discovery: Discovery | None = None,
        root_path: str = "",
        public_url: str | None = None,
    ) -> None:
        parts = urlsplit(check_mqtt_url(url))
        self._base = link_base(root_path, public_url)
        self.name = safe_url(url)
        self.prefix = check_topic_prefix(prefix, "mqtt_topic")
        self._host = parts.hostname or ""
        self._port = parts.port or _default_port(parts.scheme)
        self._reader = LogReader(f"mqtt {self.name}/{self.prefix}", events, self._count)
        self._metrics = metrics
        if metrics is not None:
            metrics.show_mqtt()
        self._connected = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._detect_of = detect_of
        self._zones: dict[str, dict[str, dict[str, int]]] = {}  # stream -> zone -> counts
        # (stream, "objects" | "active") -> what its last frame showed
        self._objects: dict[tuple[str, str], dict[str, int]] = {}
        self._thumbnail_of = thumbnail_of
        self._enable = enable
        self._roster = roster
        self._name_of = name_of
        self._discovery = discovery
        self._announced: dict[str, dict[str, tuple[str, ...]]] = {}  # stream -> kind -> topics
        # Kept across reconnects (what the broker may still retain, and what a new broker
        # must be given again): every retained topic published per stream, and its state.
        self._retained: dict[str, set[str]] = {}
        self._states: dict[str, str] = {}
        self._commands: set[asyncio.Task[None]] = set()
        self._thumbnails: dict[str, set[str]] = {}  # stream -> thumbnail topics it has
        self._cameras: dict[str, set[str]] = {}  # stream -> classes with a camera entity
        self._stopping = False
        self._failed_at: float | None = None  # when a failure to connect was last logged
        self._refreshed_at = 0.0
        # What the broker retains under this server's topics, read on connect (the network
        # thread collects, the event loop reads): None while not reading.
        self._lock = threading.Lock()
        self._found: dict[str, bytes] | None = None
        self._found_at = 0.0  # when the last of them came
        self._sweep_mid: int | None = None  # the subscription's packet id, until acknowledged
        self._subscribed_at: float | None = None
        self._generation = 0  # connections so far: a sweep of an earlier one stops
        self._sweeps: set[asyncio.Task[None]] = set()
        # A random id: two servers started from a copy of one data directory (the same
        # event ids) kicked each other off the broker every second.
        client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=f"streamdet-{secrets.token_hex(6)}",
            reconnect_on_failure=True,
        )
        if parts.username:
            client.username_pw_set(unquote(parts.username), unquote(parts.password or ""))
        if parts.scheme == "mqtts":
            client.tls_set_context(ssl.create_default_context())
        client.reconnect_delay_set(min_delay=1, max_delay=10)
        client.max_inflight_messages_set(MAX_INFLIGHT)
        client.will_set(self.topic("available"), "offline", qos=QOS, retain=True)
        client.on_connect = self._on_connect
        client.on_connect_fail = self._on_connect_fail
        client.on_disconnect = self._on_disconnect
        client.on_message = self._on_message
        client.on_subscribe = self._on_subscribe
        self._client = client

    def topic(self, *levels: str) -> str:
        return "/".join((self.prefix, *levels))

    def _keep(self, stream_id: str, topic: str, payload: str | bytes) -> None:
        """Publish ``payload`` retained on ``topic``, a topic of ``stream_id`` (cleared with
        it, whatever reconnects came between)."""
        self._client.publish(topic, payload, QOS, retain=True)
        self._retained.setdefault(stream_id, set()).add(topic)

    def _clear(self, stream_id: str, topic: str) -> None:
        """Clear the retained ``topic`` of ``stream_id``."""
        self._client.publish(topic, b"", QOS, retain=True)
        self._retained.get(stream_id, set()).discard(topic)

    @property
    def pending(self) -> int:
        """Events logged and not published yet."""
        return self._reader.pending

    def start(self) -> None:
        """Connect in the background and start publishing."""
        self._loop = asyncio.get_running_loop()
        log.info("mqtt %s: connecting, topics %s/...", self.name, self.prefix)
        self._client.connect_async(self._host, self._port, keepalive=30)
        self._client.loop_start()
        self._task = asyncio.create_task(self._run(), name=f"mqtt {self.name}")

    async def stop(self, timeout_s: float) -> None:
        """After the log finished: publish what is left (within ``timeout_s``), say
        ``offline`` and disconnect."""
        if self._task is not None:
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(self._task, timeout_s)
        for sweep in list(self._sweeps):
            sweep.cancel()
        if self.pending:
            log.warning(
                "mqtt %s: %d event(s) not published at shutdown (broker unreachable?)",
                self.name,
                self.pending,
            )
        self._stopping = True
        if self._connected.is_set():
            info = self._client.publish(self.topic("available"), "offline", qos=QOS, retain=True)
            with contextlib.suppress(RuntimeError, ValueError):
                await asyncio.to_thread(info.wait_for_publish, min(timeout_s, 2.0))
        self._client.disconnect()
        await asyncio.to_thread(self._client.loop_stop)

    async def _run(self) -> None:
        while True:
            if not self._connected.is_set():
                if self._reader.log.finished:
                    return  # no broker to give the rest to
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._connected.wait(), 1.0)
                continue
            if time.monotonic() - self._refreshed_at >= REFRESH_S:
                self._refreshed_at = time.monotonic()
                self._refresh()
            page = await self._reader.take(BATCH, 1.0)
            if page is None:
                return
            if not page.events:
                continue
            published = await self._publish(page.events)
            if published:
                whole = published == len(page.events)
                through = page.next if whole else page.events[published - 1]["id"]
                self._reader.delivered(through, published)

    async def _publish(self, events: list[dict[str, Any]]) -> int:
        """Hand ``events`` to the client, in order; how many it took (it stops at the first
        it refuses: disconnected, or its queue is full)."""
        # Of the thumbnails a page has (many, after a broker outage), the newest of each
        # stream and class is the one the retained topic keeps: only those are sent.
        newest = {_thumbnail_key(e): e["id"] for e in events if "thumbnail" in e}
        sent: list[list[mqtt.MQTTMessageInfo]] = []
        for event in events:
            body = json.dumps(served_event(event, self._base), separators=(",", ":"))
            infos = []
            for topic in (self.topic("events"), self.topic(event["stream_id"], "events")):
                info = self._client.publish(topic, body, qos=QOS)
                if info.rc != mqtt.MQTT_ERR_SUCCESS:
                    await asyncio.sleep(0.5)  # the broker is going away: wait for it
                    return await self._acknowledged(sent)
                infos.append(info)
            sent.append(infos)
            if event["type"] == "stream_state":
                self._retain_state(event["stream_id"], event["state"])
            elif "thumbnail" in event and newest[_thumbnail_key(event)] == event["id"]:
                await self._retain_thumbnail(event)
        return await self._acknowledged(sent)

    async def _acknowledged(self, sent: list[list[mqtt.MQTTMessageInfo]]) -> int:
        """How many of the events ``sent`` (each its messages) the broker acknowledged, in
        order, waiting while connected: an event counts as delivered (the cursor kept across
        restarts moves past it) once the broker has it, not once the client has queued it
        (a broker stalled at shutdown lost them all: the client's queue went with it)."""
        while True:
            done = 0
            for infos in sent:
                if not all(info.is_published() for info in infos):
                    break
                done += 1
            if done == len(sent) or not self._connected.is_set():
                return done
            await asyncio.sleep(ACK_POLL_S)

    async def _retain_thumbnail(self, event: dict[str, Any]) -> None:
        """Keep the thumbnail of ``event`` as its stream's newest of its class."""
        if self._thumbnail_of is None:
            return
        jpeg = await self._thumbnail_of(int(event["id"]))
        if jpeg is None:  # skipped under load, or deleted already
            return
        stream_id, class_name = _thumbnail_key(event)
        if not self._exists(stream_id):  # a removed stream's, read again after a restart
            return
        topic = self.topic(stream_id, level(class_name), "thumbnail")
        self._keep(stream_id, topic, jpeg)
        self._thumbnails.setdefault(stream_id, set()).add(topic)
        cameras = self._cameras.setdefault(stream_id, set())
        if class_name not in cameras:  # a camera entity per class, from its first thumbnail
            cameras.add(class_name)
            self._announce_cameras(stream_id, self._current_name(stream_id))

    def _announce_cameras(self, stream_id: str, name: str) -> None:
        """Publish the configs of a stream's cameras (one per class it has a thumbnail of),
        under its name now."""
        if self._discovery is None:
            return
        topics = []
        for class_name in sorted(self._cameras.get(stream_id, ())):
            topic, config = self._discovery.thumbnail(stream_id, name, class_name)
            self._keep(stream_id, topic, json.dumps(config))
            topics.append(topic)
        self._announced.setdefault(stream_id, {})["cameras"] = tuple(topics)

    def _current_name(self, stream_id: str) -> str:
        """A stream's name now ("" where unknown)."""
        if self._name_of is not None:
            return self._name_of(stream_id) or ""
        roster = self._roster() if self._roster is not None else {}
        return roster.get(stream_id, ("", True))[0]

    def _exists(self, stream_id: str) -> bool:
        """Whether the server has the stream now (True where it cannot tell)."""
        if self._name_of is not None:
            return self._name_of(stream_id) is not None
        return self._roster is None or stream_id in self._roster()

    def observe_frame(self, frame: ProcessedFrame) -> None:
        """Event loop, every frame: publish what the stream's frame shows, and what stands in
        its zones, where they changed."""
        if not self._connected.is_set():
            return  # sent once connected (the state is cleared on connect)
        names = self._zone_names(frame.stream_id)
        if self._discovery is not None:
            announced = self._announced.get(frame.stream_id, {})
            name = None if self._name_of is None else self._name_of(frame.stream_id)
            if announced.get("zones") != tuple(names) or (
                name is not None and announced.get("name") != (name,)
            ):  # new, renamed, or its zones changed
                self._announce_stream(frame.stream_id, name, zones=names)
        sid = frame.stream_id
        if self._states.get(sid) in SHOWS_NOTHING:
            # A frame the engines finish after its stream stopped (a file's last frames, in
            # flight at its end) would put back the counts its state zeroed.
            return
        for kind, counts in (("objects", object_counts(frame)), ("active", active_counts(frame))):
            key = (sid, kind)
            if counts != self._objects.get(key):
                self._keep(sid, self.topic(sid, kind), json.dumps(counts, separators=(",", ":")))
                self._objects[key] = counts
        before = self._zones.get(sid)
        if before is None:  # first frame since a (re)connect: zones gone meanwhile go now
            self._clear_gone_zones(sid, names)
            before = {}
        if not names and not before:
            self._zones[sid] = {}
            return
        now = zone_counts(frame, names)
        if now == before:
            return
        for zone, counts in now.items():
            if counts != before.get(zone):
                body = json.dumps(counts, separators=(",", ":"))
                self._keep(sid, self._zone_topic(sid, zone), body)
        for zone in before.keys() - now.keys():  # removed: its retained count goes too
            self._clear(sid, self._zone_topic(sid, zone))
        self._zones[sid] = now

    def _retain_state(self, stream_id: str, state: str) -> None:
        """Keep a stream's state (and whether it is enabled); a removed stream's retained
        topics are cleared."""
        if state != "removed" and not self._exists(stream_id):
            return  # an event of a stream removed since (read again after a restart)
        if state != "removed":
            self._states[stream_id] = state
            self._keep(stream_id, self.topic(stream_id, "state"), state)
            self._retain_enabled(stream_id, state != "disabled")
            if self._discovery is not None and "stream" not in self._announced.get(stream_id, {}):
                self._announce_stream(stream_id)  # a camera that never sent a frame too
            if state in SHOWS_NOTHING:  # disabled, failed, ended: the counts say so
                nothing = json.dumps({"all": 0}, separators=(",", ":"))
                for kind in COUNT_TOPICS:
                    self._keep(stream_id, self.topic(stream_id, kind), nothing)
                    self._objects[(stream_id, kind)] = {"all": 0}
                for zone in self._zones.get(stream_id, {}):
                    self._keep(stream_id, self._zone_topic(stream_id, zone), nothing)
                    self._zones[stream_id][zone] = {"all": 0}
            return
        # Removed: every retained topic it ever had goes, its entities with them, whatever
        # reconnects came between (those after a reconnect were left behind).
        self._states.pop(stream_id, None)
        self._client.publish(self.topic(stream_id, "state"), b"", qos=QOS, retain=True)
        self._client.publish(self.topic(stream_id, "enabled", "state"), b"", QOS, retain=True)
        for kind in COUNT_TOPICS:
            self._objects.pop((stream_id, kind), None)
        self._forget_stream(stream_id)
        self._zones.pop(stream_id, None)
        self._thumbnails.pop(stream_id, None)
        self._cameras.pop(stream_id, None)
        for topic in self._retained.pop(stream_id, set()):
            self._client.publish(topic, b"", qos=QOS, retain=True)

    def _retain_enabled(self, stream_id: str, on: bool) -> None:
        self._keep(stream_id, self.topic(stream_id, "enabled", "state"), "ON" if on else "OFF")

    def _announce(self) -> None:
        """Event loop, once connected: whether each stream is enabled, its state (a broker
        that restarted without keeping retained topics had none: Home Assistant showed
        "unknown" until the next change), and its entities."""
        self._announced.clear()
        roster = self._roster() if self._roster is not None else {}
        for stream_id, (name, on) in roster.items():
            self._retain_enabled(stream_id, on)
            self._announce_stream(stream_id, name)
            # One kept disabled across a restart logged no change to learn it from.
            state = self._states.get(stream_id, None if on else "disabled")
            if state is not None:
                self._retain_state(stream_id, state)

    def _start_sweep(self, generation: int) -> None:
        """Event loop, once connected: read what the broker retains of this server's (see
        :meth:`_sweep`)."""
        task = asyncio.create_task(self._sweep(generation), name=f"mqtt {self.name} sweep")
        self._sweeps.add(task)
        task.add_done_callback(self._sweeps.discard)

    async def _sweep(self, generation: int) -> None:
        """Wait until the retained messages of the subscriptions made on connect stop coming
        (:data:`SETTLE_S` after the broker acknowledged them), stop them, and tidy."""
        started = time.monotonic()
        while True:
            await asyncio.sleep(0.05)
            with self._lock:
                if generation != self._generation or self._found is None:
                    return  # disconnected meanwhile: the next connection reads again
                quiet_since = max(self._subscribed_at or started, self._found_at)
                acked = self._subscribed_at is not None
            now = time.monotonic()
            if (acked and now - quiet_since >= SETTLE_S) or now - started >= SWEEP_MAX_S:
                break
        with self._lock:
            found, self._found = self._found or {}, None
        self._client.unsubscribe(self._sweep_topics())
        self._tidy(found)

    def _sweep_topics(self) -> list[str]:
        """Topic filters of every retained topic this server publishes."""
        # And another server's availability one level below: a server nested under this
        # prefix (``<prefix>/site2``) has topics of the same shape (see :meth:`_owned`).
        kinds = [*FIXED_KINDS, ("zones", "+"), ("+", "thumbnail"), ("available",)]
        topics = [self.topic("+", *kind) for kind in kinds]
        return topics + ([] if self._discovery is None else self._discovery.subscriptions())

    def _tidy(self, found: dict[str, bytes]) -> None:
        """Of what the broker retains under this server's topics (``found``), clear what no
        stream, zone or class of it has now (removed while the server was down, by another
        run of it, or while the broker was away; a config under an id of before), and keep
        the rest among the streams' topics (cleared with them)."""
        if self._roster is None:
            return  # which streams there are is not known
        roster = self._roster()
        cleared = 0
        cameras: set[str] = set()  # streams with cameras announced before: under the name now
        servers = {  # the levels below the prefix where another server publishes
            topic.split("/")[-2]
            for topic, payload in found.items()
            if mqtt.topic_matches_sub(self.topic("+", "available"), topic)
            and payload in AVAILABILITY
        }
        for topic, payload in found.items():
            owned = self._owned(topic, payload, servers)
            if owned is None:
                continue
            stream_id, class_name = owned
            if stream_id in roster and class_name is not None:
                self._cameras.setdefault(stream_id, set()).add(class_name)
                cameras.add(stream_id)
            if stream_id in roster and self._wanted(stream_id, topic, class_name):
                self._retained.setdefault(stream_id, set()).add(topic)
                if class_name is None and topic.endswith("/thumbnail"):
                    self._thumbnails.setdefault(stream_id, set()).add(topic)
            else:
                self._clear(stream_id, topic)
                cleared += 1
        for stream_id in cameras:
            self._announce_cameras(stream_id, roster[stream_id][0])
        if cleared:
            log.info(
                "mqtt %s: cleared %d retained topic(s) of streams, zones or entities gone",
                self.name,
                cleared,
            )

    def _owned(
        self, topic: str, payload: bytes, servers: set[str]
    ) -> tuple[str, str | None] | None:
        """Of a retained ``topic`` of :meth:`_sweep_topics`: its stream and, for a camera's
        config, its class; None for another server's.

        A topic is this server's only where it publishes that topic, as it publishes it, and
        no other server does: a server nested under the prefix (``<prefix>/site2``, known by
        its retained ``<prefix>/site2/available``) has ``<prefix>/site2/zones/objects`` for its
        stream ``zones`` and ``<prefix>/site2/enabled/state`` for its stream ``enabled``,
        which read as a zone and the switch of a stream ``site2`` here (and were cleared); a
        switch's state is ``ON`` or ``OFF`` and a zone's count a JSON object, never a state
        (``live``) or an availability (``online``, of a server ``<prefix>/<id>/zones``)."""
        head = self.prefix + "/"
        if topic.startswith(head):
            stream_id, _, rest = topic[len(head) :].partition("/")
            kind = tuple(rest.split("/"))
            if len(kind) == 2 and stream_id in servers:
                return None  # under another server's prefix
            if kind == ("enabled", "state") and payload not in SWITCH_STATES:
                return None
            if len(kind) == 2 and kind[0] == "zones" and not _json_object(payload):
                return None
            zone_or_thumbnail = len(kind) == 2 and (kind[0] == "zones" or kind[1] == "thumbnail")
            if kind in FIXED_KINDS or zone_or_thumbnail:
                return stream_id, None
        if self._discovery is None:
            return None
        owner = self._discovery.owner(topic, payload)
        if owner is None:
            return None
        stream_id, component, config = owner
        class_name = config.get("name")
        if component == "camera" and isinstance(class_name, str):
            return stream_id, class_name
        return stream_id, None

    def _wanted(self, stream_id: str, topic: str, class_name: str | None) -> bool:
        """Whether a retained ``topic`` of a current stream (see :meth:`_owned`) is one it
        has now."""
        if topic.startswith(self.prefix + "/"):
            kind = topic[len(self.prefix) + 1 :].split("/")[1:]
            if len(kind) == 2 and kind[0] == "zones" and kind[1] != "thumbnail":
                zones = self._zone_names(stream_id)
                return topic in {self._zone_topic(stream_id, zone) for zone in zones}
            return True
        if self._discovery is None:
            return False
        name = self._current_name(stream_id)
        if class_name is not None:
            return topic == self._discovery.thumbnail(stream_id, name, class_name)[0]
        return topic in self._discovery.stream(stream_id, name, self._zone_names(stream_id))

    def _zone_names(self, stream_id: str) -> list[str]:
        """The names of a stream's zones now."""
        detect = None if self._detect_of is None else self._detect_of(stream_id)
        return [] if detect is None else [zone.name for zone in detect.zones]

    def _announce_stream(
        self, stream_id: str, name: str | None = None, zones: list[str] | None = None
    ) -> None:
        """Publish the discovery configs of a stream's switch and sensors (one per zone it has
        now, ``zones`` where the caller has them); a zone's sensor whose zone is gone is
        removed."""
        if self._discovery is None:
            return
        if name is None:
            roster = self._roster() if self._roster is not None else {}
            name = roster.get(stream_id, ("", True))[0]
        if zones is None:
            zones = self._zone_names(stream_id)
        configs = self._discovery.stream(stream_id, name, zones)
        self._announce_cameras(stream_id, name)  # under the name now, after a rename too
        announced = self._announced.setdefault(stream_id, {})
        cameras = set(announced.get("cameras", ()))
        config_topics = self._discovery.discovery_prefix + "/"
        for topic in list(self._retained.get(stream_id, ())):
            # A sensor of a zone gone (while connected, or while the broker was away).
            stale = topic.startswith(config_topics) and topic not in configs
            if stale and topic not in cameras:
                self._clear(stream_id, topic)
        for topic, config in configs.items():
            self._keep(stream_id, topic, json.dumps(config))
        announced["stream"] = tuple(configs)
        announced["zones"] = tuple(zones)
        announced["name"] = (name,)

    def _refresh(self) -> None:
        """Event loop, while connected: a stream renamed, or whose zones changed, is announced
        again and a zone gone has its count cleared, whether the stream has frames or not
        (disabled, reconnecting: the old name and zones stayed until its next frame)."""
        if self._roster is None:
            return
        for stream_id, (name, _) in self._roster().items():
            zones = self._zone_names(stream_id)
            announced = self._announced.get(stream_id)
            if (
                self._discovery is not None
                and announced is not None
                and (announced.get("zones") != tuple(zones) or announced.get("name") != (name,))
            ):
                self._announce_stream(stream_id, name, zones)
            self._clear_gone_zones(stream_id, zones)

    def _clear_gone_zones(self, stream_id: str, names: list[str]) -> None:
        """Clear the counts of a stream's zones not among ``names``; a stream that shows
        nothing now gets 0 in a new one."""
        wanted = {self._zone_topic(stream_id, zone) for zone in names}
        zone_topics = self.topic(stream_id, "zones", "")
        for topic in list(self._retained.get(stream_id, ())):
            if topic.startswith(zone_topics) and topic not in wanted:
                self._clear(stream_id, topic)
        shows_nothing = self._states.get(stream_id) in SHOWS_NOTHING
        counts = (
            self._zones.setdefault(stream_id, {}) if shows_nothing else self._zones.get(stream_id)
        )
        if counts is None:
            return
        for zone in counts.keys() - set(names):
            del counts[zone]
        if shows_nothing:
            nothing = json.dumps({"all": 0}, separators=(",", ":"))
            for zone in names:
                if zone not in counts:
                    self._keep(stream_id, self._zone_topic(stream_id, zone), nothing)
                    counts[zone] = {"all": 0}

    def _forget_stream(self, stream_id: str) -> None:
        """A removed stream's entities go from Home Assistant (what it announced before a
        reconnect is among its retained topics, cleared with them)."""
        announced = self._announced.pop(stream_id, {})
        for topic in (*announced.get("stream", ()), *announced.get("cameras", ())):
            self._clear(stream_id, topic)

    def _command(self, topic: str, payload: bytes) -> None:
        """Event loop: ``<prefix>/<stream id>/enabled/set`` with ``ON`` or ``OFF``."""
        stream_id = topic[len(self.prefix) + 1 :].split("/", 1)[0]
        value = payload.decode(errors="replace").strip().lower()
        enable = self._enable
        if value not in {"on", "off", "true", "false"} or enable is None:
            log.warning("mqtt %s: %s: expected ON or OFF, got %r", self.name, topic, value[:20])
            return

        async def apply(on: bool) -> None:
            try:
                known = await enable(stream_id, on)
            except Exception as exc:  # shutting down, say: logged, not a task's traceback
                log.warning("mqtt %s: %s: not applied: %s", self.name, topic, exc)
                return
            if not known:
                log.warning("mqtt %s: %s: no stream %r", self.name, topic, stream_id)
                return
            log.info("mqtt %s: stream %s %s", self.name, stream_id, "on" if on else "off")

        task = asyncio.create_task(apply(value in {"on", "true"}))
        self._commands.add(task)
        task.add_done_callback(self._commands.discard)

    def _zone_topic(self, stream_id: str, zone: str) -> str:
        return self.topic(stream_id, "zones", level(zone))

    def _count(self, outcome: str, n: int) -> None:
        if self._metrics is not None:
            self._metrics.mqtt_events.labels(outcome).inc(n)

    # ---- paho's network thread ---------------------------------------------------------------
    def _on_connect(
        self,
        client: mqtt.Client,
        userdata: Any,
        flags: mqtt.ConnectFlags,
        reason: ReasonCode,
        properties: Any,
    ) -> None:
        if reason.is_failure:
            self._failed(f"refused: {reason} (its user and password?)")
            return
        log.info("mqtt %s: connected", self.name)
        self._failed_at = None  # the next failure is logged at once
        client.publish(self.topic("available"), "online", qos=QOS, retain=True)
        client.subscribe(self.topic("+", "enabled", "set"), qos=QOS)
        generation = None
        if self._roster is not None:  # what the broker retains of this server's, to tidy
            with self._lock:
                self._generation += 1
                generation = self._generation
                self._found, self._found_at, self._subscribed_at = {}, 0.0, None
                _, self._sweep_mid = client.subscribe([(t, QOS) for t in self._sweep_topics()])
        self._set_connected(True)
        if self._loop is not None:  # zone counts are sent again, in full
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._zones.clear)
                self._loop.call_soon_threadsafe(self._objects.clear)
                self._loop.call_soon_threadsafe(self._announce)
                if generation is not None:
                    self._loop.call_soon_threadsafe(self._start_sweep, generation)

    def _on_subscribe(
        self, client: mqtt.Client, userdata: Any, mid: int, reasons: Any, properties: Any
    ) -> None:
        with self._lock:
            if mid == self._sweep_mid:
                self._subscribed_at = time.monotonic()

    def _on_connect_fail(self, client: mqtt.Client, userdata: Any) -> None:
        # Called while paho handles the OSError (nothing listening, TLS refused...).
        error = sys.exc_info()[1]
        self._failed(f"cannot connect: {error or 'connection failed'}")

    def _failed(self, why: str) -> None:
        """Log why the broker cannot be had: the first time, then at most once a minute."""
        now = time.monotonic()
        if self._stopping or (
            self._failed_at is not None and now - self._failed_at < FAILURE_LOG_S
        ):
            return
        self._failed_at = now
        log.warning(
            "mqtt %s: %s; retrying (setting STREAMDET_MQTT_URL)", self.name, why.rstrip(".")
        )

    def _on_message(self, client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage) -> None:
        command = mqtt.topic_matches_sub(self.topic("+", "enabled", "set"), message.topic)
        if message.retain and not command:  # read on connect (see _sweep)
            with self._lock:
                if self._found is not None and message.payload:
                    self._found[message.topic] = bytes(message.payload)
                    self._found_at = time.monotonic()
            return
        loop = self._loop
        if loop is None or loop.is_closed() or message.retain or not command:
            return  # a stale command is not run; the server's own messages are not commands
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self._command, message.topic, bytes(message.payload))

    def _on_disconnect(
        self,
        client: mqtt.Client,
        userdata: Any,
        flags: mqtt.DisconnectFlags,
        reason: ReasonCode,
        properties: Any,
    ) -> None:
        with self._lock:
            self._found = None  # a sweep under way stops: the next connection reads again
        if self._stopping:
            log.info("mqtt %s: disconnected", self.name)
        elif self._connected.is_set():
            log.warning("mqtt %s: disconnected (%s); reconnecting", self.name, reason)
        elif reason.is_failure:  # dropped before it was accepted
            self._failed(f"disconnected before connected ({reason})")
        self._set_connected(False)

    def _set_connected(self, up: bool) -> None:
        if self._metrics is not None:
            self._metrics.mqtt_connected.set(1 if up else 0)
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self._connected.set if up else self._connected.clear)


def _thumbnail_key(event: dict[str, Any]) -> tuple[str, str]:
    return str(event["stream_id"]), str(event.get("class_name"))


def zone_counts(frame: ProcessedFrame, zones: list[str]) -> dict[str, dict[str, int]]:
    """What stands in each of ``zones`` in ``frame``: ``{"all": n, class name: n, ...}``; a
    tracked object with two boxes (two classes) counts once, under its first."""
    return _tally(frame, frame.zones or [], zones)


def object_counts(frame: ProcessedFrame) -> dict[str, int]:
    """What ``frame`` shows: ``{"all": n, class name: n, ...}``, each tracked object once."""
    return _tally(frame, [("",)] * len(frame.detections), [""])[""]


def active_counts(frame: ProcessedFrame) -> dict[str, int]:
    """:func:`object_counts` of the objects that are not stationary."""
    still = frame.still or [0.0] * len(frame.detections)
    groups = [() if s >= frame.stationary_s else ("",) for s in still]
    return _tally(frame, groups, [""])[""]


def _tally(
    frame: ProcessedFrame, groups: Sequence[Iterable[str]], wanted: list[str]
) -> dict[str, dict[str, int]]:
    """Per group in ``wanted``, the detections of ``frame`` in it by class (``groups``: each
    detection's), each tracked object once, under its first class."""
    counts: dict[str, dict[str, int]] = {group: {"all": 0} for group in wanted}
    ids = frame.detections.track_ids
    seen: set[tuple[str, int]] = set()
    for i, inside in enumerate(groups):
        name = frame.detections.name_of(int(frame.detections.class_ids[i]))
        for group in inside:
            if group not in counts:
                continue
            if ids is not None:
                key = (group, int(ids[i]))
                if key in seen:
                    continue
                seen.add(key)
            counts[group]["all"] += 1
            counts[group][name] = counts[group].get(name, 0) + 1
    return counts
