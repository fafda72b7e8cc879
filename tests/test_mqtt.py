"""MQTT events (``server/mqtt.py``) against a real Mosquitto broker on loopback and a real
``streamdet serve``: events logged while the broker is down are published once it is up, on
the shared and the per-stream topic, with the server's availability retained."""

from __future__ import annotations

import dataclasses
import json
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from engines.types import Detections
from loadtest.server import free_port
from server.mqtt import active_counts, check_mqtt_url, object_counts, safe_url, zone_counts
from server.mqtt_discovery import Discovery
from server.settings import Settings
from streams.fanout import ProcessedFrame
from tests.helpers import BOTTLE_CLIP, CAR_CLIP, GATE, clip_server, decode_jpeg

MOSQUITTO = shutil.which("mosquitto") or "/usr/sbin/mosquitto"


class Broker:
    """``mosquitto -p PORT`` (loopback only), started and stopped on demand."""

    def __init__(self, log_path: Path) -> None:
        self.port = free_port()
        self._log_path = log_path
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        command = [MOSQUITTO, "-p", str(self.port), "-v"]
        with self._log_path.open("ab") as log:  # the broker writes to its own copy
            self._proc = subprocess.Popen(command, stdout=log, stderr=log)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.05)
        raise RuntimeError(f"mosquitto did not listen on {self.port}")

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(10)


class Listener:
    """A subscriber of ``streamdet/#`` and ``homeassistant/#`` (discovery): every message with
    its topic and retain flag."""

    def __init__(self, port: int) -> None:
        self.messages: list[tuple[str, str, bool]] = []
        self.payloads: dict[str, list[bytes]] = {}  # as sent (JPEGs are not text)
        self._lock = threading.Lock()
        self._client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"test-{id(self)}")
        self._client.on_message = self._on_message
        self._client.connect("127.0.0.1", port)
        self._client.subscribe([("streamdet/#", 1), ("homeassistant/#", 1)])
        self._client.loop_start()

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

    def publish(self, topic: str, payload: str) -> None:
        self._client.publish(topic, payload, qos=1).wait_for_publish(10)

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
        listener = Listener(broker.port)
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
                config_topic = f"homeassistant/camera/{device}/thumbnail_{class_name}/config"
                camera = json.loads(listener.wait_for(config_topic, 1, 10)[-1])
                assert camera["topic"] == f"streamdet/{sid}/{class_name}/thumbnail"
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
    configs = discovery.stream("door", "Front door", ["loading/dock #2"])
    zone = configs["ha/sensor/streamdet_door/zone_loading_dock__2/config"]
    assert zone["state_topic"] == "cams/door/zones/loading_dock _2"  # one topic level
    assert zone["unique_id"] == "streamdet_door_zone_loading_dock__2"
    assert zone["device"]["name"] == "streamdet Front door"
    assert set(configs) == {
        "ha/switch/streamdet_door/enabled/config",
        "ha/sensor/streamdet_door/state/config",
        "ha/sensor/streamdet_door/objects/config",
        "ha/sensor/streamdet_door/active/config",
        "ha/sensor/streamdet_door/zone_loading_dock__2/config",
    }
    topic, camera = discovery.thumbnail("door", "", "traffic light")
    assert topic == "ha/camera/streamdet_door/thumbnail_traffic_light/config"
    assert camera["topic"] == "cams/door/traffic light/thumbnail"
    assert camera["device"]["name"] == "streamdet door"  # no name: its id


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
            time.sleep(1.0)
        finally:
            again.close()
        late = Listener(broker.port)
        try:
            assert late.wait_for("streamdet/available", 1, 10) == ["online"]
            time.sleep(1.0)
            left = sorted({t for t, p, _ in late.messages if p})
            assert left == ["streamdet/available"], left  # nothing of the stream retained
        finally:
            late.close()
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
