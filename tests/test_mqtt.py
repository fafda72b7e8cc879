"""MQTT events (``server/mqtt.py``) against a real Mosquitto broker on loopback and a real
``streamdet serve``: events logged while the broker is down are published once it is up, on
the shared and the per-stream topic, with the server's availability retained."""

from __future__ import annotations

import asyncio
import dataclasses
import getpass
import json
import logging
import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from engines.types import Detections
from loadtest.server import free_port
from server.mqtt import (
    MqttPublisher,
    active_counts,
    check_mqtt_url,
    object_counts,
    safe_url,
    zone_counts,
)
from server.mqtt_discovery import Discovery, level, object_id, zone_keys
from server.settings import Settings
from streams.detect import StreamDetect
from streams.events import EventLog, ManualEvent, StateEvent
from streams.fanout import ProcessedFrame
from streams.zones import parse_zones
from tests.helpers import BOTTLE_CLIP, CAR_CLIP, GATE, clip_server, decode_jpeg, eventually

MOSQUITTO = shutil.which("mosquitto") or "/usr/sbin/mosquitto"


def listening(port: int) -> bool:
    """Whether something accepts connections on loopback ``port``."""
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


class Broker:
    """``mosquitto -p PORT`` (loopback only), started and stopped on demand."""

    def __init__(self, log_path: Path) -> None:
        self.port = free_port()
        self._log_path = log_path
        self._proc: subprocess.Popen[bytes] | None = None
        self._config: Path | None = None

    def keep_sessions(self, directory: Path) -> None:
        """From the next start on, keep its clients' sessions in ``directory`` across its
        restarts, and queue for a client away what its subscriptions match (QoS 0 too)."""
        directory.mkdir(exist_ok=True)
        self._config = directory / "mosquitto.conf"
        self._config.write_text(
            f"listener {self.port} 127.0.0.1\nallow_anonymous true\npersistence true\n"
            f"persistence_location {directory}/\nqueue_qos0_messages true\nmax_queued_messages 0\n"
            # Run as root, it would switch to the user "mosquitto", who may not write there.
            f"user {getpass.getuser()}\n"
        )

    def start(self) -> None:
        command = [MOSQUITTO, "-p", str(self.port), "-v"]
        if self._config is not None:
            command = [MOSQUITTO, "-c", str(self._config), "-v"]
        with self._log_path.open("ab") as log:  # the broker writes to its own copy
            self._proc = subprocess.Popen(command, stdout=log, stderr=log)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if listening(self.port):
                return
            time.sleep(0.05)
        raise RuntimeError(f"mosquitto did not listen on {self.port}")

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(10)


class Listener:
    """A subscriber of ``streamdet/#`` and ``homeassistant/#`` (discovery): every message with
    its topic and retain flag; subscribed once it is made. With ``session``, that client id's
    session is kept by the broker (:meth:`Broker.keep_sessions`): what was published while it
    was away comes when it is back."""

    def __init__(self, port: int, session: str | None = None) -> None:
        self.messages: list[tuple[str, str, bool]] = []
        self.payloads: dict[str, list[bytes]] = {}  # as sent (JPEGs are not text)
        self._lock = threading.Lock()
        subscribed = threading.Event()
        self._client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=session or f"test-{id(self)}",
            clean_session=session is None,
        )
        self._client.on_message = self._on_message
        self._client.on_subscribe = lambda *_: subscribed.set()

        def on_connect(client: mqtt.Client, userdata: object, flags: Any, *_: object) -> None:
            if flags.session_present:  # subscribed already; its messages come as they are
                subscribed.set()
            else:
                client.subscribe([("streamdet/#", 1), ("homeassistant/#", 1)])

        self._client.on_connect = on_connect
        self._client.connect("127.0.0.1", port)
        self._client.loop_start()
        assert subscribed.wait(10), f"not subscribed to the broker on {port} in 10 s"

    def _on_message(self, client: mqtt.Client, userdata: object, msg: mqtt.MQTTMessage) -> None:
        with self._lock:
            text = msg.payload.decode(errors="replace")
            self.messages.append((msg.topic, text, bool(msg.retain)))
            self.payloads.setdefault(msg.topic, []).append(bytes(msg.payload))

    def on(self, topic: str) -> list[str]:
        with self._lock:
            return [payload for t, payload, _ in self.messages if t == topic]

    def wait_for(self, topic: str, n: int, timeout_s: float) -> list[str]:
        deadline = time.monotonic() + timeout_s
        while len(self.on(topic)) < n and time.monotonic() < deadline:
            time.sleep(0.1)
        return self.on(topic)

    def wait_last(self, topic: str, payload: str, timeout_s: float) -> bool:
        """Whether ``topic``'s newest message is ``payload`` within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while (self.on(topic) or [""])[-1] != payload:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def publish(self, topic: str, payload: str, *, retain: bool = False) -> None:
        self._client.publish(topic, payload, qos=1, retain=retain).wait_for_publish(10)

    def last(self, topic: str) -> str | None:
        """``topic``'s newest message; None before any."""
        got = self.on(topic)
        return got[-1] if got else None

    def close(self) -> None:
        self._client.loop_stop()
        self._client.disconnect()


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    b = Broker(tmp_path / "mosquitto.log")
    yield b
    b.stop()


@pytest.mark.mqtt
def test_events_logged_while_the_broker_was_down_are_published_once_it_is_up(
    tmp_path: Path, broker: Broker
) -> None:
    car = CAR_CLIP
    # A listener's session, kept while the broker is down and the listener away: all the
    # server publishes once the broker is up waits for it (subscribed after the broker's
    # start, it missed what the server sent if the server reconnected first).
    broker.keep_sessions(tmp_path / "broker")
    broker.start()
    Listener(broker.port, session="test-events").close()
    broker.stop()
    server = clip_server(tmp_path, mqtt_url=f"mqtt://127.0.0.1:{broker.port}")
    with server, httpx.Client(base_url=server.base_url, timeout=60) as c:
        gate = GATE
        lower = {"name": "lower", "points": [[0, 0.5], [1, 0.5], [1, 1], [0, 1]], "inertia": 1}
        stream = {
            "url": f"file://{car}",
            "max_fps": 8,
            "track": True,
            "lines": [gate],
            "zones": [lower],
        }
        sid = c.post("/streams", json=stream).json()["id"]
        # The broker is down: the server serves on, its events wait in the log.
        deadline = time.monotonic() + 90
        while not (early := c.get("/events").json()["events"]) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert early, "no event in 90 s"
        assert "streamdet_mqtt_connected 0.0" in c.get("/metrics").text
        broker.start()
        listener = Listener(broker.port, session="test-events")
        try:
            # It reconnects by itself and publishes from the first event on, on both topics.
            shared = listener.wait_for("streamdet/events", len(early), 30)
            own = listener.wait_for(f"streamdet/{sid}/events", len(early), 10)
            assert listener.wait_for("streamdet/available", 1, 10)[-1] == "online"
            # Retained state for dashboards: the stream's state, and what stands in its zone.
            assert listener.wait_for(f"streamdet/{sid}/state", 1, 10)[-1] == "live"
            zone = listener.wait_for(f"streamdet/{sid}/zones/lower", 1, 30)
            shown = listener.wait_for(f"streamdet/{sid}/objects", 1, 30)
            active = listener.wait_for(f"streamdet/{sid}/active", 1, 30)
            zone = zone + shown + active  # the frame's counts have the same form
            counts = [json.loads(m) for m in zone if m]
            assert all(c["all"] == sum(v for k, v in c.items() if k != "all") for c in counts)
            got = [json.loads(m) for m in shared]
            assert got[: len(early)] == early
            assert [json.loads(m) for m in own][: len(early)] == early
            # The newest thumbnail of each class the stream's events saw, retained: the one
            # GET /events/{id}/thumbnail.jpg serves for its newest event of that class.
            deadline = time.monotonic() + 60
            while not (
                newest := {
                    e["class_name"]: e
                    for e in c.get("/events", params={"limit": 1000}).json()["events"]
                    if "thumbnail" in e
                }
            ):
                assert time.monotonic() < deadline, "no event with an object in 60 s"
                time.sleep(0.5)
            for class_name, event in newest.items():
                topic = f"streamdet/{sid}/{class_name}/thumbnail"
                deadline = time.monotonic() + 10
                want = c.get(event["thumbnail"]).content
                while listener.payloads.get(topic, [b""])[-1] != want:
                    assert time.monotonic() < deadline, (topic, listener.payloads.get(topic))
                    time.sleep(0.1)
                    newest_now = c.get(
                        "/events", params={"latest": True, "classes": class_name, "limit": 1}
                    ).json()["events"][0]
                    want = c.get(newest_now["thumbnail"]).content  # a newer one came meanwhile
                assert decode_jpeg(want).shape[2] == 3
            # Home Assistant is told of the stream's entities (MQTT discovery): a switch, its
            # state, what it shows, what stands in its zone, a camera per thumbnail class.
            device = f"streamdet_{sid}"
            switch = json.loads(
                listener.wait_for(f"homeassistant/switch/{device}/enabled/config", 1, 10)[-1]
            )
            assert switch["command_topic"] == f"streamdet/{sid}/enabled/set"
            assert switch["state_topic"] == f"streamdet/{sid}/enabled/state"
            assert switch["availability_topic"] == "streamdet/available"
            assert switch["device"]["identifiers"] == [device]
            sensors = (("objects", "objects"), ("active", "active"), ("zone_lower", "zones/lower"))
            for key, topic in sensors:
                config_topic = f"homeassistant/sensor/{device}/{key}/config"
                sensor = json.loads(listener.wait_for(config_topic, 1, 10)[-1])
                assert sensor["state_topic"] == f"streamdet/{sid}/{topic}"
                assert sensor["value_template"] == "{{ value_json.all }}"
                assert sensor["unique_id"] == f"{device}_{key}"
            # Renamed in the API: Home Assistant's device is announced again under the name.
            assert c.patch(f"/streams/{sid}", json={"name": "Loading bay"}).status_code == 200
            renamed = f"homeassistant/sensor/{device}/objects/config"
            deadline = time.monotonic() + 10
            while json.loads(listener.on(renamed)[-1])["device"]["name"] != "streamdet Loading bay":
                assert time.monotonic() < deadline, listener.on(renamed)[-1]
                time.sleep(0.1)
            for class_name in newest:
                # An entity's id has no space ("cell phone": thumbnail_cell_phone).
                config_topic = (
                    f"homeassistant/camera/{device}/thumbnail_{object_id(class_name)}/config"
                )
                camera = json.loads(listener.wait_for(config_topic, 1, 10)[-1])
                assert camera["topic"] == f"streamdet/{sid}/{level(class_name)}/thumbnail"
            # A switch for Home Assistant: OFF disables the stream, ON opens it again, and
            # the retained state follows.
            enabled = f"streamdet/{sid}/enabled/state"
            assert listener.wait_for(enabled, 1, 10)[0] == "ON"  # announced on connect
            listener.publish(f"streamdet/{sid}/enabled/set", "OFF")
            deadline = time.monotonic() + 10
            while c.get(f"/streams/{sid}").json()["state"] != "disabled":
                assert time.monotonic() < deadline, "not disabled by MQTT in 10 s"
                time.sleep(0.1)
            assert listener.wait_last(enabled, "OFF", 10)
            assert listener.wait_last(f"streamdet/{sid}/objects", '{"all":0}', 10)
            assert listener.wait_last(f"streamdet/{sid}/active", '{"all":0}', 10)
            listener.publish(f"streamdet/{sid}/enabled/set", "ON")
            assert listener.wait_last(enabled, "ON", 10)
            assert c.get(f"/streams/{sid}").json()["enabled"] is True
            listener.publish(f"streamdet/{sid}/enabled/set", "maybe")  # refused, logged
            listener.publish("streamdet/nope/enabled/set", "OFF")  # no such stream: logged
            assert "streamdet_mqtt_connected 1.0" in c.get("/metrics").text
            sent = [ln for ln in c.get("/metrics").text.splitlines() if "mqtt_events_total" in ln]
            assert any('outcome="sent"' in ln and not ln.endswith(" 0.0") for ln in sent), sent
            # A dashboard that subscribes now gets the retained state at once.
            newcomer = Listener(broker.port)
            try:
                assert newcomer.wait_for(f"streamdet/{sid}/state", 1, 10) == ["live"]
                assert newcomer.wait_for(f"streamdet/{sid}/zones/lower", 1, 10)
                first: dict[str, bool] = {}
                for topic, _, retain in list(newcomer.messages):
                    first.setdefault(topic, retain)  # later ones may be live updates
                assert first[f"streamdet/{sid}/state"] and first[f"streamdet/{sid}/zones/lower"]
            finally:
                newcomer.close()
            # A removed stream's retained topics are cleared (an empty retained message).
            assert c.delete(f"/streams/{sid}").status_code == 204
            assert listener.wait_last(f"streamdet/{sid}/state", "", 10)
            deadline = time.monotonic() + 10
            while listener.on(f"streamdet/{sid}/zones/lower")[-1] and time.monotonic() < deadline:
                time.sleep(0.1)
            assert listener.on(f"streamdet/{sid}/zones/lower")[-1] == ""
            assert listener.wait_last(f"homeassistant/switch/{device}/enabled/config", "", 10)
            for class_name in newest:
                thumbnail = f"streamdet/{sid}/{class_name}/thumbnail"
                deadline = time.monotonic() + 10
                while listener.on(thumbnail)[-1] and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert listener.on(thumbnail)[-1] == ""
            # A clean stop says so: offline, retained for whoever subscribes later.
            server.stop()
            assert listener.wait_for("streamdet/available", 2, 10)[-1] == "offline"
        finally:
            listener.close()
    late = Listener(broker.port)
    try:
        assert late.wait_for("streamdet/available", 1, 10) == ["offline"]
        time.sleep(0.5)
        assert [t for t, _, _ in late.messages] == ["streamdet/available"]  # nothing stale
    finally:
        late.close()
    assert "mqtt mqtt://127.0.0.1" in server.log_text() and "connected" in server.log_text()
    assert "expected ON or OFF, got 'maybe'" in server.log_text()
    assert "no stream 'nope'" in server.log_text()


def test_mqtt_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="STREAMDET_MQTT_URL"):
        Settings(mqtt_url="http://broker:1883")
    with pytest.raises(ValueError, match="STREAMDET_MQTT_TOPIC"):
        Settings(mqtt_topic="cams/#")
    assert check_mqtt_url("mqtts://u:p@broker") == "mqtts://u:p@broker"
    assert safe_url("mqtts://user:secret@broker") == "mqtts://broker:8883"  # no password in logs
    # A port out of range or not a number was a traceback once the model had loaded; a path
    # or query was ignored.
    for url in (
        "mqtt://127.0.0.1:99999",
        "mqtt://u:secret@broker:abc",
        "mqtt://broker:0",
        "mqtt://broker/cams",
        "mqtt://broker?topic=cams",
        "mqtt://u:p@broker/?token=secret",  # the query was shown, its token in clear
        "mqtt://u:pass/secret@broker",  # the password's start was shown as the port
        "mqtt://u:secret#x@broker",
        # A mistyped scheme: the whole URL was echoed, password and all.
        "mqtt//user:secret@host",
        "ha_user:secret@192.168.1.5",
    ):
        with pytest.raises(ValueError, match="STREAMDET_MQTT_URL"):
            Settings(mqtt_url=url)
        with pytest.raises(ValueError, match="STREAMDET_MQTT_URL") as refused:
            check_mqtt_url(url)
        assert "secret" not in str(refused.value) and "'pass'" not in str(refused.value), url
    assert Settings(mqtt_url="mqtt://broker:1884/").mqtt_url == "mqtt://broker:1884/"
    # One form of the prefixes everywhere: the publisher stripped slashes, Home Assistant's
    # availability, state and command topics had them.
    given = Settings(mqtt_topic="/home/streamdet/", mqtt_discovery_prefix="ha/")
    assert (given.mqtt_topic, given.mqtt_discovery_prefix) == ("home/streamdet", "ha")
    switch = Discovery(given.mqtt_topic).stream("door", "", [])
    assert all(
        config["availability_topic"] == "home/streamdet/available" for config in switch.values()
    )
    for topic in ("a//b", "/", "cams/+", "a\u0000b"):
        with pytest.raises(ValueError, match="STREAMDET_MQTT_TOPIC"):
            Settings(mqtt_topic=topic)
    with pytest.raises(ValueError, match="STREAMDET_MQTT_DISCOVERY_PREFIX"):
        Settings(mqtt_discovery_prefix="ha//x")


def test_zone_counts_count_each_tracked_object_once() -> None:
    names = {0: "person", 2: "car", 7: "truck"}
    detections = Detections(
        boxes=np.zeros((4, 4), np.float32),
        scores=np.array([0.9, 0.8, 0.7, 0.6], np.float32),
        class_ids=np.array([2, 7, 0, 2], np.int32),
        names=names,
        width=100,
        height=100,
        track_ids=np.array([1, 1, 2, 3], np.int64),  # a car also boxed as a truck
    )
    image = np.zeros((100, 100, 3), np.uint8)
    frame = ProcessedFrame("s", 1, None, 0.0, 0.0, image, detections, 1)
    frame.zones = [["dock"], ["dock"], ["dock", "door"], []]
    assert zone_counts(frame, ["dock", "door", "gone"]) == {
        "dock": {"all": 2, "car": 1, "person": 1},
        "door": {"all": 1, "person": 1},
        "gone": {"all": 0},
    }
    # What the frame shows: each tracked object once; untracked, each box.
    assert object_counts(frame) == {"all": 3, "car": 2, "person": 1}
    untracked = ProcessedFrame(
        "s", 1, None, 0.0, 0.0, image, dataclasses.replace(detections, track_ids=None), 1
    )
    assert object_counts(untracked) == {"all": 4, "car": 2, "truck": 1, "person": 1}
    assert active_counts(untracked) == object_counts(untracked)  # untracked: all active
    # Tracked: the parked car (still 30 s, over the stream's 10) is not active, the rest are.
    frame.still = [30.0, 30.0, 0.5, 2.0]
    assert active_counts(frame) == {"all": 2, "car": 1, "person": 1}
    frame.stationary_s = 60.0  # a car park's stream: nobody is stationary yet
    assert active_counts(frame) == object_counts(frame)


def test_discovery_names_entities_as_home_assistant_allows() -> None:
    discovery = Discovery("cams", "ha")
    configs = discovery.stream("door", "Front door", ["loading/dock #2", "front yard"])
    # The prefix is not the default "streamdet": it is in the ids (another server's stream
    # "door" is another device).
    node = "streamdet_cams_door"
    key = zone_keys(["loading/dock #2"])["loading/dock #2"]
    assert key.startswith("zone_loading_dock__2_")  # replaced characters: a hash of the name
    zone = configs[f"ha/sensor/{node}/{key}/config"]
    assert zone["state_topic"].startswith("cams/door/zones/loading_dock _2_")  # one level
    assert zone["unique_id"] == f"{node}_{key}"
    # Its entity id as the README says (with unique_id alone, Home Assistant named it after
    # the device and the sensor's name): default_entity_id, and object_id for older ones.
    assert zone["default_entity_id"] == f"sensor.{node}_{key}"
    assert zone["object_id"] == f"{node}_{key}"
    assert zone["device"]["name"] == "streamdet Front door"
    assert zone["device"]["identifiers"] == [node]
    assert set(configs) == {
        f"ha/switch/{node}/enabled/config",
        f"ha/sensor/{node}/state/config",
        f"ha/sensor/{node}/objects/config",
        f"ha/sensor/{node}/active/config",
        f"ha/sensor/{node}/{key}/config",
        f"ha/sensor/{node}/zone_front_yard/config",  # spaces only: as it always was
    }
    topic, camera = discovery.thumbnail("door", "", "traffic light")
    assert topic == f"ha/camera/{node}/thumbnail_traffic_light/config"
    assert camera["topic"] == "cams/door/traffic light/thumbnail"
    assert camera["device"]["name"] == "streamdet door"  # no name: its id
    # The default prefix: the ids existing users' entities have.
    plain = Discovery("streamdet").stream("door", "", ["lower"])
    assert "homeassistant/sensor/streamdet_door/zone_lower/config" in plain
    assert plain["homeassistant/sensor/streamdet_door/zone_lower/config"]["unique_id"] == (
        "streamdet_door_zone_lower"
    )


def test_different_names_are_different_entities_and_valid_topic_levels() -> None:
    """入口 and 出口 were both ``zone___``, ``a/b`` and ``a+b`` both ``a_b``; a NUL in a zone's
    name went into its topic (the broker dropped the server's client, at every reconnect)."""
    names = ["入口", "出口", "a/b", "a+b", "a b", "a_b", "bad\u0000zone", "sur\ud800", "lower"]
    keys = zone_keys(names)
    assert len(set(keys.values())) == len(names)
    assert all(re.fullmatch(r"zone_[A-Za-z0-9_-]+", key) for key in keys.values())
    assert (keys["lower"], keys["a_b"]) == ("zone_lower", "zone_a_b")  # unchanged
    assert keys["a b"] != "zone_a_b" and zone_keys(["a b"])["a b"] == "zone_a_b"
    levels = [level(name) for name in names]
    assert len(set(levels)) == len(names)
    assert level("入口") == "入口" and level("lower") == "lower"  # MQTT topics are UTF-8
    for topic_level in levels:
        assert not set(topic_level) & set("/+#\0") and topic_level.encode("utf-8")
    assert level("a/b") == level("a/b")  # stable


@pytest.mark.mqtt
def test_a_broker_that_restarts_or_stalls_loses_no_state_event_or_entity(
    tmp_path: Path, broker: Broker
) -> None:
    """A broker that restarts without keeping retained topics gets each stream's state again
    (Home Assistant showed "unknown" until the next change); a stream removed after that
    takes every topic and entity it had, those from before the reconnect too (they stayed);
    events a stalled broker never acknowledged are published after the server's restart (the
    server counted them delivered once queued, and lost them)."""
    import signal

    broker.start()
    settings = {"mqtt_url": f"mqtt://127.0.0.1:{broker.port}", "shutdown_timeout_s": 2}
    server = clip_server(tmp_path, **settings)
    with server, httpx.Client(base_url=server.base_url, timeout=60) as c:
        lower = {"name": "lower", "points": [[0, 0.5], [1, 0.5], [1, 1], [0, 1]]}
        stream = {"id": "bay", "url": f"file://{CAR_CLIP}", "max_fps": 4, "zones": [lower]}
        assert c.post("/streams", json=stream).status_code == 201
        first = Listener(broker.port)
        try:
            assert first.wait_last("streamdet/bay/state", "live", 30)
            assert first.wait_for("streamdet/bay/zones/lower", 1, 30)
        finally:
            first.close()
        broker.stop()  # a broker that keeps nothing: its retained topics are gone
        broker.start()
        again = Listener(broker.port)
        try:
            assert again.wait_last("streamdet/bay/state", "live", 30)  # published again
            assert again.wait_for("homeassistant/sensor/streamdet_bay/zone_lower/config", 1, 10)
            assert again.wait_for("streamdet/bay/objects", 1, 30)
            assert c.delete("/streams/bay").status_code == 204
            assert again.wait_last("streamdet/bay/state", "", 10)  # its topics being cleared
        finally:
            again.close()
        deadline = time.monotonic() + 15
        while True:  # nothing of the stream retained (its topics are cleared in one go)
            late = Listener(broker.port)
            try:
                assert late.wait_for("streamdet/available", 1, 10) == ["online"]
                time.sleep(0.5)  # the retained topics come right after the subscription
                left = sorted({t for t, p, _ in late.messages if p})
            finally:
                late.close()
            if left == ["streamdet/available"]:
                break
            assert time.monotonic() < deadline, left
        # A stalled broker (stopped, its connection open): events queued, never acknowledged.
        assert c.post("/streams", json={**stream, "zones": []}).status_code == 201
        assert c.post("/streams/bay/events", json={"label": "warm-up"}).status_code == 201
        proc = broker._proc
        assert proc is not None
        proc.send_signal(signal.SIGSTOP)
        try:
            ids = [
                c.post("/streams/bay/events", json={"label": f"stalled {i}"}).json()["id"]
                for i in range(20)
            ]
            server.stop()  # the broker still stalled: they cannot go out
        finally:
            proc.send_signal(signal.SIGCONT)
    listener = Listener(broker.port)
    try:
        with server:  # started again on the same data: what was not acknowledged goes out
            got: set[int] = set()
            deadline = time.monotonic() + 30
            while not set(ids) <= got and time.monotonic() < deadline:
                got = {json.loads(m)["id"] for m in listener.on("streamdet/bay/events") if m}
                time.sleep(0.2)
            assert set(ids) <= got, sorted(set(ids) - got)
    finally:
        listener.close()


@pytest.mark.mqtt
def test_a_stream_that_ends_shows_nothing_now(tmp_path: Path, broker: Broker) -> None:
    """A file that ends (or a camera that fails) shows nothing now: its retained counts go
    to 0 (they kept its last frame's objects for ever), as ``GET /streams/{id}`` says too."""
    from benchmarks.make_clip import make_clip

    short = tmp_path / "clips" / "short.mp4"
    short.parent.mkdir()
    make_clip(BOTTLE_CLIP, short, width=640, height=360, fps=25, gop=25, frames=40)
    broker.start()
    server = clip_server(
        tmp_path, mqtt_url=f"mqtt://127.0.0.1:{broker.port}", allowed_file_dir=str(short.parent)
    )
    listener = Listener(broker.port)
    try:
        with server, httpx.Client(base_url=server.base_url, timeout=60) as c:
            whole = {"name": "whole", "points": [[0, 0], [1, 0], [1, 1], [0, 1]]}
            stream = {"id": "end", "url": f"file://{short}", "loop": False, "zones": [whole]}
            assert c.post("/streams", json=stream).status_code == 201
            assert listener.wait_last("streamdet/end/state", "stopped", 60)
            seen = [json.loads(m)["all"] for m in listener.on("streamdet/end/objects")]
            assert max(seen) > 0  # its bottles were counted while it played
            assert listener.wait_last("streamdet/end/objects", '{"all":0}', 10)
            assert listener.wait_last("streamdet/end/zones/whole", '{"all":0}', 10)
            info = c.get("/streams/end").json()
            assert info["state"] == "stopped" and info["objects"] == {}
            assert info["zones"]["whole"]["now"] == {} and info["detections"]["bottle"] > 0
    finally:
        listener.close()


# ---- the publisher on its own against the real broker (no model, no server) -----------------
class Streams:
    """The stream manager as the publisher sees it: names, zones, whether enabled."""

    def __init__(self, **names: str) -> None:
        self.names = dict(names)
        self.zones: dict[str, list[str]] = {}

    def roster(self) -> dict[str, tuple[str, bool]]:
        return {sid: (name, True) for sid, name in self.names.items()}

    def name_of(self, stream_id: str) -> str | None:
        return self.names.get(stream_id)

    def detect(self, stream_id: str) -> StreamDetect | None:
        if stream_id not in self.names:
            return None
        square = [[0, 0], [1, 0], [1, 1], [0, 1]]
        zones = [{"name": z, "points": square} for z in self.zones.get(stream_id, [])]
        return StreamDetect(zones=parse_zones(zones))

    def publisher(self, port: int, log: EventLog, prefix: str = "streamdet") -> MqttPublisher:
        async def thumbnail(event_id: int) -> bytes:
            return b"jpeg"

        return MqttPublisher(
            f"mqtt://127.0.0.1:{port}",
            prefix,
            log,
            None,
            self.detect,
            thumbnail_of=thumbnail,
            roster=self.roster,
            name_of=self.name_of,
            discovery=Discovery(prefix),
        )


def _state(log: EventLog, stream_id: str, state: str) -> None:
    log.add(stream_id, "", time.time(), [StateEvent("live", state, None, 0)], str)


def _config(source: str, available: str = "streamdet/available", name: str = "x") -> str:
    return json.dumps(
        {
            "name": name,
            "state_topic" if "thumbnail" not in source else "topic": source,
            "availability_topic": available,
            "device": {"name": "streamdet Old name"},
        }
    )


class Disabled(Streams):
    """Streams all disabled: kept so across a restart, with no state change logged."""

    def roster(self) -> dict[str, tuple[str, bool]]:
        return {sid: (name, False) for sid, name in self.names.items()}


@pytest.mark.mqtt
async def test_a_stream_kept_disabled_across_a_restart_has_its_state_on_the_broker(
    broker: Broker,
) -> None:
    """A stream disabled before the server restarted logs no change at the start: a broker
    that kept nothing (restarted, or a new one) got its switch OFF but no state and no
    counts (Home Assistant showed "unknown"). Its state is "disabled", its counts 0."""
    broker.start()
    listener = Listener(broker.port)
    try:
        streams = Disabled(door="Front door")
        log = EventLog(100)
        publisher = streams.publisher(broker.port, log)
        publisher.start()
        await eventually(lambda: listener.last("streamdet/door/state") == "disabled")
        assert listener.last("streamdet/door/enabled/state") == "OFF"
        await eventually(lambda: listener.last("streamdet/door/objects") == '{"all":0}')
        log.finish()
        await publisher.stop(2)
    finally:
        listener.close()


@pytest.mark.mqtt
async def test_what_streams_and_zones_gone_left_retained_is_cleared_on_connect(
    tmp_path: Path, broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    """What the server retained lived in its memory only: a stream or zone removed while it
    was down (or deleted after a restart) left its topics and Home Assistant entities on the
    broker for ever. On connect it reads what the broker retains of its own, and clears what
    no stream, zone or class of it has now; another server's (its own prefix) stay."""
    broker.start()
    earlier = {  # what an earlier run of the server left retained
        "streamdet/gone/state": "live",  # a stream removed while the server was down
        "streamdet/gone/zones/z": '{"all":0}',
        "streamdet/gone/person/thumbnail": "jpeg",
        "homeassistant/sensor/streamdet_gone/objects/config": _config("streamdet/gone/objects"),
        "streamdet/door/zones/old": '{"all":1}',  # a zone removed between runs
        "homeassistant/sensor/streamdet_door/zone_old/config": _config("streamdet/door/zones/old"),
        "streamdet/door/zones/kept": '{"all":1}',
        "streamdet/door/person/thumbnail": "jpeg",
        "homeassistant/camera/streamdet_door/thumbnail_person/config": _config(
            "streamdet/door/person/thumbnail", name="person"
        ),
    }
    others = {  # another server's (prefix "cams"), and another integration's
        "homeassistant/sensor/streamdet_cams_gone/objects/config": _config(
            "cams/gone/objects", "cams/available"
        ),
        "homeassistant/sensor/lamp/power/config": json.dumps({"name": "power"}),
    }
    listener = Listener(broker.port)
    try:
        for topic, payload in {**earlier, **others}.items():
            listener.publish(topic, payload, retain=True)
        streams = Streams(door="Front door")
        streams.zones["door"] = ["kept"]
        log = EventLog(100)
        publisher = streams.publisher(broker.port, log)
        caplog.set_level(logging.INFO, "server.mqtt")
        publisher.start()
        gone = [t for t in earlier if "/gone/" in t or "streamdet_gone" in t or "old" in t]
        await eventually(lambda: all(listener.last(t) == "" for t in gone))
        # The camera of the class it had a thumbnail of, under the stream's name now.
        camera = "homeassistant/camera/streamdet_door/thumbnail_person/config"
        await eventually(lambda: "Front door" in (listener.last(camera) or ""))
        # Deleted after the restart: what the earlier run retained goes with it.
        del streams.names["door"]
        _state(log, "door", "removed")
        kept = ("streamdet/door/person/thumbnail", "streamdet/door/zones/kept", camera)
        await eventually(lambda: all(listener.last(t) == "" for t in kept))
        log.finish()
        await publisher.stop(2)
    finally:
        listener.close()
    late = Listener(broker.port)
    try:
        await eventually(lambda: late.on("streamdet/available") == ["offline"])
        await asyncio.sleep(0.5)
        left = {t for t, p, _ in late.messages if p}
        assert left == {"streamdet/available", *others}, left
    finally:
        late.close()
    assert "cleared 6 retained topic(s)" in caplog.text
    assert "reconnecting" not in caplog.text  # a clean stop is not a broker going away


@pytest.mark.mqtt
async def test_the_sweep_on_connect_leaves_a_nested_servers_topics_alone(
    tmp_path: Path, broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    """Another server publishing under ``streamdet/site2`` has topics that look like this
    one's: its stream ``zones``' ``streamdet/site2/zones/objects`` reads as zone ``objects`` of
    a stream ``site2``, its stream ``enabled``'s state as the switch of ``site2``, and the sweep
    cleared them (``site2`` is no stream here). Only what this server publishes there, as it
    publishes it, and not under a server's retained availability topic, is taken as its own."""
    broker.start()
    earlier = {  # what an earlier run of this server left: a stream removed while it was down
        "streamdet/gone/state": "live",
        "streamdet/gone/zones/z": '{"all":0}',
        "streamdet/gone/enabled/state": "OFF",
    }
    nested = {
        "streamdet/site2/available": "online",  # a server with the prefix streamdet/site2
        "streamdet/site2/zones/state": "live",  # its stream "zones"
        "streamdet/site2/zones/objects": '{"all":2,"car":2}',
        "streamdet/site2/zones/active": '{"all":1,"car":1}',
        "streamdet/site2/enabled/state": "reconnecting",  # its stream "enabled"
        "streamdet/site2/enabled/objects": '{"all":0}',
        "streamdet/lab/zones/available": "offline",  # a server with the prefix streamdet/lab/zones
        "streamdet/site3/zones/state": "failed",  # one whose availability is not retained
        "streamdet/site3/enabled/state": "disabled",
    }
    listener = Listener(broker.port)
    try:
        for topic, payload in {**earlier, **nested}.items():
            listener.publish(topic, payload, retain=True)
        streams = Streams(door="Front door")
        log = EventLog(100)
        publisher = streams.publisher(broker.port, log)
        caplog.set_level(logging.INFO, "server.mqtt")
        publisher.start()
        await eventually(lambda: all(listener.last(t) == "" for t in earlier))
        log.finish()
        await publisher.stop(2)
    finally:
        listener.close()
    late = Listener(broker.port)
    try:
        await eventually(lambda: late.on("streamdet/available") == ["offline"])
        await asyncio.sleep(0.5)
        left = {t for t, p, _ in late.messages if p and not t.startswith("homeassistant/")}
        assert left - {"streamdet/available", "streamdet/door/enabled/state"} == set(nested), left
    finally:
        late.close()
    assert "cleared 3 retained topic(s)" in caplog.text


@pytest.mark.mqtt
async def test_a_stream_without_frames_is_announced_again_when_renamed_or_its_zones_change(
    broker: Broker,
) -> None:
    """A disabled (reconnecting, failed) stream has no frames: its new name and zones were
    announced at its next frame only, its cameras kept the old name for ever, and were not
    announced again on reconnect."""
    broker.start()
    listener = Listener(broker.port)
    try:
        streams = Streams(door="Door")
        streams.zones["door"] = ["a", "b"]
        log = EventLog(100)
        publisher = streams.publisher(broker.port, log)
        publisher.start()
        _state(log, "door", "disabled")
        node = "homeassistant/sensor/streamdet_door"
        await eventually(lambda: listener.last(f"{node}/zone_b/config"))
        person = {"class_name": "person", "thumbnail": "/events/1/thumbnail.jpg"}
        log.add("door", "Door", time.time(), [ManualEvent("bell", 0)], str, extra=lambda e: person)
        camera = "homeassistant/camera/streamdet_door/thumbnail_person/config"
        await eventually(lambda: listener.last(camera))
        assert json.loads(listener.last(camera) or "")["device"]["name"] == "streamdet Door"
        streams.names["door"] = "Loading bay"
        streams.zones["door"] = ["a", "c"]

        def renamed(topic: str) -> bool:
            config: dict[str, Any] = json.loads(listener.last(topic) or "{}")
            return bool(config.get("device", {}).get("name") == "streamdet Loading bay")

        await eventually(lambda: renamed(f"{node}/objects/config") and renamed(camera), 3)
        await eventually(lambda: listener.last(f"{node}/zone_b/config") == "", 3)
        # Published after zone_b's clearing (stale topics go first): waited for, not read at
        # once (under load the assertion came between the two).
        await eventually(lambda: renamed(f"{node}/zone_c/config"), 3)
        # disabled: nothing in it
        await eventually(lambda: listener.last("streamdet/door/zones/c") == '{"all":0}', 3)
        # A broker that comes back without what it retained gets the cameras again.
        broker.stop()
        broker.start()
        again = Listener(broker.port)
        try:
            await eventually(lambda: again.last(camera))
            assert json.loads(again.last(camera) or "")["device"]["name"] == (
                "streamdet Loading bay"
            )
        finally:
            again.close()
        log.finish()
        await publisher.stop(2)
    finally:
        listener.close()


async def test_why_the_broker_cannot_be_reached_is_logged_naming_the_setting(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Nothing listening (a TLS failure alike): only "connecting" was logged, for ever."""
    port = free_port()
    log = EventLog(10)
    publisher = MqttPublisher(f"mqtt://127.0.0.1:{port}", "streamdet", log)
    caplog.set_level(logging.INFO, "server.mqtt")
    publisher.start()
    try:
        await eventually(lambda: "cannot connect" in caplog.text, 5)
        await asyncio.sleep(2.5)  # retried meanwhile: logged once a minute at most
    finally:
        log.finish()
        await publisher.stop(1)
    failures = [
        r.getMessage()
        for r in caplog.records
        if "cannot connect" in r.getMessage() and publisher.name in r.getMessage()
    ]
    assert len(failures) == 1, failures
    assert "STREAMDET_MQTT_URL" in failures[0] and "refused" in failures[0].lower()


@pytest.mark.mqtt
async def test_two_servers_from_one_data_directory_do_not_kick_each_other_off(
    broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    """Client ids were ``streamdet-<next event id>``: two servers started from a copy of one
    data directory had the same, and the broker dropped one for the other every second."""
    broker.start()
    log = EventLog(10, start_id=1)
    publishers = [MqttPublisher(f"mqtt://127.0.0.1:{broker.port}", p, log) for p in "ab"]
    caplog.set_level(logging.INFO, "server.mqtt")
    for publisher in publishers:
        publisher.start()
    await eventually(lambda: caplog.text.count("connected") >= 2, 5)
    await asyncio.sleep(2.0)
    log.finish()
    for publisher in publishers:
        await publisher.stop(1)
    assert "reconnecting" not in caplog.text


@pytest.mark.mqtt
async def test_a_broker_that_refuses_the_server_is_logged_naming_the_setting(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A broker that wants a user and password: "refused: Not authorized", naming the
    setting, once (it retries every few seconds)."""
    port = free_port()
    config = tmp_path / "mosquitto.conf"
    config.write_text(f"listener {port} 127.0.0.1\nallow_anonymous false\n")
    proc = await asyncio.create_subprocess_exec(
        MOSQUITTO, "-c", str(config), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    log = EventLog(10)
    publisher = MqttPublisher(f"mqtt://127.0.0.1:{port}", "streamdet", log)
    caplog.set_level(logging.INFO, "server.mqtt")
    try:
        await eventually(lambda: listening(port), 10)
        publisher.start()
        await eventually(lambda: "refused" in caplog.text, 5)
        await asyncio.sleep(2.5)
    finally:
        log.finish()
        await publisher.stop(1)
        proc.terminate()
        await proc.wait()
    refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refused) == 1 and "Not authorized" in refused[0], refused
    assert "STREAMDET_MQTT_URL" in refused[0]
