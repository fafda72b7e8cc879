"""Streams declared with ids: ``POST /streams`` with an ``id``, ``PUT /streams/{id}`` (create,
or replace, reopening the source only where it changed, viewers kept), the streams file
(``--streams-file``: declared at start, ``${ENV}`` in it, the API refused on its streams, a
stream no longer declared removed) and ``GET /streams?format=yaml``, against the real model
and the shared clips."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from fastapi.testclient import TestClient

from loadtest.server import ServerProcess
from server.streams_file import StreamsFileError, read_entries, to_text
from streams.sources import redact
from streams.store import StreamStore, new_record
from tests.helpers import (
    BOTTLE_CLIP,
    CACHE_DIR,
    CAR_CLIP,
    MODEL_PT,
    SHELF,
    file_stream_app,
    wait_until,
)


def write(path: Path, data: Any) -> Path:
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


def test_the_streams_file_is_read_with_its_variables_and_checked(tmp_path: Path) -> None:
    env = {"PASSWORD": "s3cret", "HOST": "10.0.0.5"}
    listed = [{"id": "door", "url": "rtsp://admin:${PASSWORD}@${HOST}/1", "zones": [SHELF]}]
    assert read_entries(write(tmp_path / "a.yaml", listed), env) == [
        {"id": "door", "url": "rtsp://admin:s3cret@10.0.0.5/1", "zones": [SHELF]}
    ]
    wrapped = write(tmp_path / "b.yaml", {"streams": listed})
    assert read_entries(wrapped, env) == read_entries(tmp_path / "a.yaml", env)
    assert read_entries(write(tmp_path / "empty.yaml", ""), env) == []
    for name, text, words in (
        ("novar.yaml", listed, "the environment variable HOST is not set"),
        ("noid.yaml", [{"url": "rtsp://x/1"}], "stream 1: give it an id"),
        ("twice.yaml", [{"id": "a", "url": "x"}, {"id": "a", "url": "y"}], "'a' is used twice"),
        ("scalar.yaml", "just text", "expected a list of streams"),
        ("broken.yaml", "streams: [unclosed", "not YAML"),
        # The last of a key given twice won: a second streams: block dropped the first's.
        ("dup.yaml", "streams:\n- {id: a, url: x}\nstreams:\n- {id: b, url: y}\n", "'streams'"),
        ("dupkey.yaml", "- {id: a, url: x, max_fps: 1, max_fps: 2}\n", "'max_fps' is given twice"),
        ("number.yaml", "- {id: 7, url: x}\n", 'its id 7 is a number; quote it (id: "7")'),
    ):
        with pytest.raises(StreamsFileError, match="STREAMDET_STREAMS_FILE") as error:
            read_entries(write(tmp_path / name, text), {"PASSWORD": "x"})
        assert words in str(error.value) and name in str(error.value), str(error.value)
    with pytest.raises(StreamsFileError, match="cannot read it"):
        read_entries(tmp_path / "missing.yaml", env)
    # YAML's merge keys still work, an entry giving again what it merged included.
    merged = "- &base {id: front, url: rtsp://a/1, max_fps: 5}\n- <<: *base\n  id: back\n"
    assert [e["id"] for e in read_entries(write(tmp_path / "merge.yaml", merged), env)] == [
        "front",
        "back",
    ]
    with pytest.raises(StreamsFileError, match=r"(?s)not YAML: .*unhashable"):  # no TypeError
        read_entries(write(tmp_path / "odd.yaml", "- id: a\n  ? [a, b]\n  : x\n"), env)
    # UTF-16, as an editor may save it: said so (it was a UnicodeDecodeError's traceback).
    (tmp_path / "utf16.yaml").write_text("- {id: a, url: x}\n", encoding="utf-16")
    with pytest.raises(StreamsFileError, match="not UTF-8 text"):
        read_entries(tmp_path / "utf16.yaml", env)


def test_a_variable_in_a_urls_password_is_encoded_where_it_would_end_it(tmp_path: Path) -> None:
    """``${PW}`` holding "@" or "#" gave another host, and showed the password's tail in
    every listing and error; in the user or password part those characters are encoded
    (FFmpeg decodes them), elsewhere the value goes in as it is."""
    env = {"PW": "Secr@t#tail/99%41", "URL": "rtsp://a:b@c/d", "HOST": "10.0.0.5"}
    listed = [
        {"id": "a", "url": "rtsp://${PW}:${PW}@${HOST}/s?k=${PW}"},
        {"id": "b", "url": "${URL}"},
    ]
    first, second = read_entries(write(tmp_path / "a.yaml", listed), env)
    encoded = "Secr%40t%23tail%2F99%41"  # "%" kept: a value already encoded stays so
    assert first["url"] == f"rtsp://{encoded}:{encoded}@10.0.0.5/s?k=Secr@t#tail/99%41"
    assert second["url"] == "rtsp://a:b@c/d"
    assert redact(first["url"]).startswith(f"rtsp://{encoded}:***@10.0.0.5/s")  # the host kept


def test_a_value_that_is_only_a_variable_takes_its_type_from_its_text(tmp_path: Path) -> None:
    """``enabled: ${ON}`` was the text "false" after substitution, and the strict switch
    refused it; an unquoted ``${NAME}`` alone is read as YAML reads its text written there,
    a quoted one stays text, and text YAML would cut (``#``) is kept whole."""
    text = (
        "- id: ${CAM}\n  url: ${URL}\n  enabled: ${ON}\n  max_fps: ${FPS}\n"
        '  name: "${FPS}"\n  classes: ${NONE}\n  track: ${TRACK}\n'
    )
    env = {"CAM": "door", "URL": "rtsp://a:b#c@h/1", "ON": "false", "FPS": "2.5", "NONE": ""}
    env["TRACK"] = "true"
    assert read_entries(write(tmp_path / "v.yaml", text), env) == [
        {
            "id": "door",
            "url": "rtsp://a:b#c@h/1",
            "enabled": False,
            "max_fps": 2.5,
            "name": "2.5",
            "classes": None,
            "track": True,
        }
    ]
    # A variable's error names the stream by its id even when the id is a variable.
    with pytest.raises(StreamsFileError, match=r"stream 1: the environment variable CAM is not"):
        read_entries(tmp_path / "v.yaml", {})
    with pytest.raises(StreamsFileError, match="its id 7 is a number; quote it"):
        read_entries(tmp_path / "v.yaml", {**env, "CAM": "7"})
    # Quoted as written: the advice id: "7" lost a variable's 007 zeros.
    with pytest.raises(StreamsFileError, match=r'quote it \(id: "\$\{CAM\}"\)'):
        read_entries(tmp_path / "v.yaml", {**env, "CAM": "007"})


def test_streams_with_ids_are_put_replaced_and_reopened_keeping_their_viewers(
    tmp_path: Path,
) -> None:
    bottles = {"url": f"file://{BOTTLE_CLIP}", "max_fps": 8, "classes": "bottle"}
    with TestClient(file_stream_app(tmp_path)) as c:
        created = c.post("/streams", json={**bottles, "id": "shelf_cam"})
        assert created.status_code == 201 and created.json()["id"] == "shelf_cam"
        again = c.post("/streams", json={**bottles, "id": "shelf_cam"})
        assert again.status_code == 409 and "'shelf_cam' exists" in again.text
        for bad in ("has space", "-leading", "x" * 65):
            refused = c.post("/streams", json={**bottles, "id": bad})
            assert refused.status_code == 422 and "id" in refused.text
        # PUT creates (201), then replaces (200): the same body twice changes nothing.
        put = c.put("/streams/cam1", json=bottles)
        assert put.status_code == 201 and put.json()["id"] == "cam1"

        def stream() -> dict[str, Any]:
            info: dict[str, Any] = c.get("/streams/cam1").json()
            return info

        wait_until(lambda: stream()["frames_in"] >= 5, "cam1's first frames")
        before = stream()
        same = c.put("/streams/cam1", json=bottles)
        assert same.status_code == 200 and same.json()["created_at"] == before["created_at"]
        assert stream()["frames_in"] >= before["frames_in"]  # the same source, not reopened
        # What a PUT leaves out takes its default: every class again.
        assert c.put("/streams/cam1", json={**bottles, "classes": None}).status_code == 200
        assert stream()["detect"]["classes"] is None
        with c.websocket_connect("/ws/streams/cam1") as viewer:
            first = viewer.receive_json()
            assert first["width"] == before["width"]
            # A new source is opened in place of the old one; the viewer stays connected.
            reopened = c.put("/streams/cam1", json={"url": f"file://{CAR_CLIP}", "max_fps": 8})
            assert reopened.status_code == 200, reopened.text
            deadline = time.monotonic() + 60
            while (frame := viewer.receive_json())["width"] == before["width"]:
                assert time.monotonic() < deadline, "no frame of the new source in 60 s"
            assert frame["stream_id"] == "cam1" and frame["width"] != before["width"]
            assert frame["frame"] > first["frame"]  # numbers go on from the old source's
        info = stream()
        assert info["frames_in"] > before["frames_in"]  # so do its counts
        assert info["url"] == f"file://{CAR_CLIP}" and info["created_at"] == before["created_at"]
        mismatch = c.put("/streams/cam1", json={**bottles, "id": "other"})
        assert mismatch.status_code == 422 and "'other' in the body" in mismatch.text
        bad_path = c.put("/streams/bad%20id", json=bottles)
        assert bad_path.status_code == 422 and "letters, digits" in bad_path.text
        bad_url = c.put("/streams/cam1", json={"url": "ftp://nope"})
        assert bad_url.status_code == 422 and "url" in bad_url.text
        assert stream()["url"] == f"file://{CAR_CLIP}"  # a refused PUT changes nothing


def test_the_streams_file_declares_streams_the_api_cannot_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CLIPS", str(BOTTLE_CLIP.parent))
    shelf = {
        "id": "shelf",
        "url": f"file://${{CLIPS}}/{BOTTLE_CLIP.name}",
        "max_fps": 8,
        "classes": ["bottle"],
        "track": True,
        "zones": [SHELF],
    }
    road = {"id": "road", "url": f"file://${{CLIPS}}/{CAR_CLIP.name}", "max_fps": 4}
    path = write(tmp_path / "streams.yaml", {"streams": [shelf, road]})
    with TestClient(file_stream_app(tmp_path, streams_file=path)) as c:
        streams = {s["id"]: s for s in c.get("/streams").json()["streams"]}
        assert set(streams) == {"shelf", "road"} and all(s["from_file"] for s in streams.values())
        assert streams["shelf"]["url"] == f"file://{BOTTLE_CLIP}"  # ${CLIPS} filled in
        assert streams["shelf"]["detect"]["zones"][0]["name"] == "shelf"
        extra = c.post("/streams", json={"id": "extra", "url": f"file://{CAR_CLIP}"})
        assert extra.status_code == 201 and extra.json()["from_file"] is False
        for refused in (
            c.patch("/streams/shelf", json={"conf": 0.5}),
            c.put("/streams/shelf", json={"url": f"file://{CAR_CLIP}"}),
            c.delete("/streams/road"),
        ):
            assert refused.status_code == 409, refused.text
            assert "declared in the streams file" in refused.text and str(path) in refused.text
        # Every stream as a streams file: the settings, not the state.
        exported = c.get("/streams", params={"format": "yaml"})
        assert exported.headers["content-type"].startswith("application/yaml")
        entries = {e["id"]: e for e in yaml.safe_load(exported.text)["streams"]}
        assert set(entries) == {"shelf", "road", "extra"}
        assert entries["shelf"]["zones"][0]["points"] == SHELF["points"]
        assert entries["shelf"]["classes"] == ["bottle"] and "frames_in" not in entries["shelf"]
        wait_until(lambda: c.get("/streams/shelf").json()["frames_in"] > 0, "shelf's frames")

    # Restarted with a changed file: shelf changes (no zones, 5 fps), road is no longer
    # declared and goes, lot is new; the stream added through the API stays as it was.
    lot = {"id": "lot", "url": f"file://{CAR_CLIP}", "classes": "car,truck", "track": True}
    changed = {**shelf, "max_fps": 5, "zones": None}
    write(path, [changed, lot])
    with TestClient(file_stream_app(tmp_path, streams_file=path)) as c:
        streams = {s["id"]: s for s in c.get("/streams").json()["streams"]}
        assert set(streams) == {"shelf", "lot", "extra"}
        assert streams["shelf"]["max_fps"] == 5 and streams["shelf"]["detect"]["zones"] == []
        assert streams["lot"]["detect"]["classes"] == ["car", "truck"]
        assert streams["lot"]["from_file"] and not streams["extra"]["from_file"]
        assert c.patch("/streams/extra", json={"conf": 0.4}).status_code == 200
        # The exported file, given to a fresh server, declares the same streams.
        exported_text = c.get("/streams", params={"format": "yaml"}).text
    fresh = write(tmp_path / "exported.yaml", exported_text)
    with TestClient(file_stream_app(tmp_path / "fresh", streams_file=fresh)) as c:
        again = {s["id"]: s for s in c.get("/streams").json()["streams"]}
        assert set(again) == {"shelf", "lot", "extra"}
        for sid, stream in again.items():
            assert stream["detect"] == streams[sid]["detect"] | (
                {"conf": 0.4} if sid == "extra" else {}
            )


def test_a_streams_file_that_does_not_fit_stops_the_start_naming_the_stream(
    tmp_path: Path,
) -> None:
    path = write(
        tmp_path / "streams.yaml",
        [{"id": "door", "url": f"file://{CAR_CLIP}", "classes": "person,unicorn"}],
    )
    with (
        pytest.raises(StreamsFileError, match=r"stream 'door': classes: unknown class name"),
        TestClient(file_stream_app(tmp_path, streams_file=path)),
    ):
        pass
    write(path, [{"id": "door", "url": f"file://{CAR_CLIP}", "max_fpss": 2}])
    with (
        pytest.raises(StreamsFileError, match=r"stream 'door': max_fpss: Extra inputs"),
        TestClient(file_stream_app(tmp_path, streams_file=path)),
    ):
        pass
    # The event store was closed, not left as a crash's (events.ids: the highest id given,
    # then the reservation, 0 once closed): a crash's reservation is passed over.
    _, reserved = struct.unpack("<qq", (tmp_path / "data" / "events.ids").read_bytes()[:16])
    assert reserved == 0


def test_an_export_masks_passwords() -> None:
    stream = {
        "id": "door",
        "name": "front door",
        "url": "rtsp://admin:***@10.0.0.5/1",
        "max_fps": None,
        "transport": "tcp",
        "loop": True,
        "enabled": False,
        "frames_in": 12,
        "detect": {"conf": 0.25, "classes": None},
    }
    [entry] = yaml.safe_load(to_text([stream]))["streams"]
    settings = {k: v for k, v in stream.items() if k not in {"frames_in", "detect"}}
    assert entry == {**settings, "conf": 0.25, "classes": None}  # the state left out
    assert entry["url"] == "rtsp://admin:***@10.0.0.5/1"


def test_text_that_looks_like_a_variable_is_exported_escaped_and_read_back_as_it_was(
    tmp_path: Path,
) -> None:
    """A stream named "Gate ${A} $HOME" with a zone "z${Y}" was exported as it is: the file
    read it with A's and Y's values, or failed where A was not set. ``$${NAME}`` is the text
    ``${NAME}`` itself (Docker Compose's escape), and the export writes it so."""
    stream = {
        "id": "gate",
        "name": "Gate ${A} $HOME",
        "url": "file:///videos/gate.mp4",
        "max_fps": None,
        "transport": "tcp",
        "loop": True,
        "enabled": True,
        "detect": {"zones": [{"name": "z${Y}", "points": [[0, 0], [1, 0], [1, 1]]}]},
    }
    path = tmp_path / "exported.yaml"
    path.write_text(to_text([stream]))
    assert "Gate $${A} $HOME" in path.read_text()
    [entry] = read_entries(path, {"Y": ""})  # A not set: not asked for
    assert entry["name"] == "Gate ${A} $HOME" and entry["zones"][0]["name"] == "z${Y}"
    written = tmp_path / "written.yaml"
    written.write_text("- {id: door, url: 'rtsp://h/${CAM}', name: 'cost $${PRICE}'}\n")
    [door] = read_entries(written, {"CAM": "1"})
    assert (door["url"], door["name"]) == ("rtsp://h/1", "cost ${PRICE}")


def test_streamdet_serve_refuses_a_broken_streams_file_before_loading_the_model(
    tmp_path: Path,
) -> None:
    path = write(tmp_path / "streams.yaml", [{"url": "rtsp://camera/1"}])
    serve = [sys.executable, "-m", "server.cli", "serve", "--model", str(MODEL_PT)]
    done = subprocess.run(
        [*serve, "--streams-file", str(path), "--data-dir", str(tmp_path / "data")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "cannot start" in done.stderr and "stream 1: give it an id" in done.stderr
    # Sources that could never open, and more streams than allowed: each said in a line
    # (the model loaded, then the start failed with a traceback and exit 3).
    entries = [
        {"id": "port", "url": "rtsp://127.0.0.1:99999/s"},
        {"id": "scheme", "url": "rtspx://camera/s"},
        {"id": "outside", "url": "file:///etc/passwd"},
    ]
    path = write(tmp_path / "streams.yaml", entries)
    done = subprocess.run(
        [
            *serve,
            "--streams-file",
            str(path),
            "--data-dir",
            str(tmp_path / "data"),
            "--allowed-file-dir",
            str(tmp_path),
            "--max-streams",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 4 and "Traceback" not in done.stderr, done.stderr
    assert "3 streams, over the limit 2 (setting STREAMDET_MAX_STREAMS)" in lines[0]
    assert "stream 'port': url: malformed url: Port out of range" in lines[1]
    assert "stream 'scheme': url: scheme 'rtspx' is not allowed" in lines[2]
    assert "stream 'outside': url: file /etc/passwd is outside the allowed directory" in lines[3]
    # Within the limit alone, over it with a stream the API added (kept in the data dir):
    # it failed once the model had loaded, with a traceback and exit 3.
    api = new_record("api", f"file://{CAR_CLIP}", name="", max_fps=None, transport="tcp", loop=True)
    StreamStore(tmp_path / "data").add(api)
    path = write(tmp_path / "one.yaml", [{"id": "a", "url": f"file://{CAR_CLIP}"}])
    given = ["--streams-file", str(path), "--data-dir", str(tmp_path / "data")]
    done = subprocess.run(
        [*serve, *given, "--allowed-file-dir", str(CAR_CLIP.parent), "--max-streams", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "1 streams and 1 added through the API are more than 1" in done.stderr


def test_sighup_applies_a_changed_streams_file_and_keeps_the_streams_on_a_broken_one(
    tmp_path: Path,
) -> None:
    path = write(tmp_path / "streams.yaml", [{"id": "road", "url": f"file://{CAR_CLIP}"}])
    settings: dict[str, object] = {
        "model": str(MODEL_PT),
        "cache_dir": str(CACHE_DIR),
        "data_dir": str(tmp_path / "data"),
        "allowed_file_dir": str(CAR_CLIP.parent),
        "streams_file": str(path),
        "workers": 1,
    }
    server = ServerProcess(settings, log_path=tmp_path / "server.log")
    with server, httpx.Client(base_url=server.base_url, timeout=30) as c:

        def ids() -> set[str]:
            return {s["id"] for s in c.get("/streams").json()["streams"]}

        assert ids() == {"road"}
        shelf = {"id": "shelf", "url": f"file://{BOTTLE_CLIP}", "classes": "bottle"}
        write(path, [shelf])
        os.kill(server.pid, signal.SIGHUP)
        wait_until(lambda: ids() == {"shelf"}, "the reloaded file's streams", 30)
        assert c.get("/streams/shelf").json()["detect"]["classes"] == ["bottle"]
        # A file that does not fit changes nothing: the error is logged, streams go on.
        write(path, [shelf, {"id": "bad", "url": "ftp://camera/1"}])
        os.kill(server.pid, signal.SIGHUP)
        wait_until(lambda: "streams file not reloaded" in server.log_text(), "the error", 30)
        assert ids() == {"shelf"} and "'bad': url" in server.log_text()
        assert c.get("/healthz").status_code == 200


def test_a_disabled_stream_closes_its_camera_keeps_its_settings_and_opens_again(
    tmp_path: Path,
) -> None:
    shelf = {"id": "shelf", "url": f"file://{BOTTLE_CLIP}", "max_fps": 8, "zones": [SHELF]}
    path = write(tmp_path / "streams.yaml", [shelf])
    with TestClient(file_stream_app(tmp_path, streams_file=path)) as c:
        road = c.post("/streams", json={"id": "road", "url": f"file://{CAR_CLIP}"}).json()
        assert road["enabled"] is True

        def stream(sid: str) -> dict[str, Any]:
            info: dict[str, Any] = c.get(f"/streams/{sid}").json()
            return info

        wait_until(lambda: stream("road")["frames_processed"] > 2, "road's frames")
        wait_until(lambda: bool(stream("road")["objects"]), "road's cars in a frame")
        off = c.patch("/streams/road", json={"enabled": False})
        assert off.status_code == 200 and off.json()["enabled"] is False
        assert off.json()["state"] == "disabled"
        hidden = c.get("/streams/road/latest.jpg")  # a privacy switch: its last picture too
        assert hidden.status_code == 503, hidden.text
        assert hidden.json()["detail"] == "stream 'road' is disabled: it shows nothing now"
        assert "retry-after" not in hidden.headers  # back only when switched on, not in 1 s
        frames = stream("road")["frames_in"]
        time.sleep(0.5)
        assert stream("road")["frames_in"] == frames  # its camera is closed
        events = c.get("/events", params={"stream_id": "road", "type": "stream_state"})
        off_event = events.json()["events"][-1]
        assert off_event["state"] == "disabled"
        assert off_event["previous"] == "live"  # as it was (it said "stopped": read after)
        counted = stream("road")
        # It shows nothing now: no dashboard goes on counting what its last frame showed.
        assert counted["objects"] == {} and counted["stationary"] == {}
        assert counted["detections"]  # the totals stay
        metrics = c.get("/metrics").text
        assert 'streamdet_stream_objects{class="car",stream="road"} 0.0' in metrics
        assert c.patch("/streams/road", json={"enabled": True}).json()["state"] != "disabled"
        wait_until(
            lambda: stream("road")["frames_processed"] > counted["frames_processed"],
            "road's frames after it was enabled",
        )
        again = stream("road")  # its counts go on from where they were
        assert again["frames_in"] > counted["frames_in"]
        assert all(again["detections"].get(k, 0) >= n for k, n in counted["detections"].items())
        assert c.patch("/streams/road", json={"enabled": False}).status_code == 200
        # A stream of the streams file may be switched off too, but nothing else changed.
        wait_until(lambda: bool(stream("shelf")["zones"]), "shelf's zone counts")
        assert c.patch("/streams/shelf", json={"enabled": False}).json()["state"] == "disabled"
        assert all(not z["now"] for z in stream("shelf")["zones"].values())
        both = c.patch("/streams/shelf", json={"enabled": True, "conf": 0.4})
        assert both.status_code == 409
        assert stream("shelf")["detect"]["zones"][0]["name"] == "shelf"  # settings kept
    # Kept across a restart: road stays off; shelf is as its file says (on).
    with TestClient(file_stream_app(tmp_path, streams_file=path)) as c:
        assert stream("road")["state"] == "disabled" and stream("road")["frames_in"] == 0
        assert stream("road")["enabled"] is False
        wait_until(lambda: stream("shelf")["frames_in"] > 0, "shelf's frames")
        on = c.patch("/streams/road", json={"enabled": True})
        assert on.json()["enabled"] is True
        wait_until(lambda: stream("road")["state"] == "live", "road live again")
        wait_until(lambda: stream("road")["frames_processed"] > 0, "road's frames again")


def test_serve_hands_the_gil_over_every_gil_switch_ms(tmp_path: Path) -> None:
    """``--gil-switch-ms`` (default 1) is set before anything starts: the broken streams file
    stops this start right after it."""
    from server.cli import serve
    from server.settings import Settings

    assert Settings().gil_switch_ms == 1.0
    path = write(tmp_path / "streams.yaml", [{"url": "rtsp://camera/1"}])
    before = sys.getswitchinterval()
    try:
        settings = Settings(streams_file=path, gil_switch_ms=0.7, data_dir=tmp_path / "data")
        assert serve(settings) == 2
        assert sys.getswitchinterval() == pytest.approx(0.0007)
    finally:
        sys.setswitchinterval(before)


def test_a_file_stream_is_the_apis_once_the_server_runs_without_the_file(
    tmp_path: Path,
) -> None:
    """A stream a streams file declared, the server restarted without ``--streams-file``:
    the API may change and remove it (it was refused 409 for good: no file to change it in)."""
    shelf = {"id": "shelf", "url": f"file://{BOTTLE_CLIP}", "max_fps": 8}
    path = write(tmp_path / "streams.yaml", [shelf])
    with TestClient(file_stream_app(tmp_path, streams_file=path)) as c:
        refused = c.delete("/streams/shelf")
        assert refused.status_code == 409 and "SIGHUP" in refused.text
    with TestClient(file_stream_app(tmp_path)) as c:
        # Said so: the viewer page locked it (from_file true) while the API let it change.
        assert c.get("/streams/shelf").json()["from_file"] is False
        assert c.patch("/streams/shelf", json={"max_fps": 4}).json()["max_fps"] == 4
        assert c.delete("/streams/shelf").status_code == 204


async def test_a_streams_files_room_is_held_while_it_is_applied(tmp_path: Path) -> None:
    """An API call coming between the steps of a reload cannot take the room its streams
    were checked to have (the reload was half applied, its log saying nothing changed)."""
    import asyncio
    import dataclasses

    from engines.registry import prepare_model
    from server.routes.streams import apply_streams_file
    from streams.manager import StreamLimitError
    from tests.helpers import file_manager, start_ort_pool

    pool = start_ort_pool(prepare_model(str(MODEL_PT), CACHE_DIR, 640), max_wait_ms=2)
    try:
        async with file_manager(pool, tmp_path / "data") as m:
            m._opt = dataclasses.replace(m._opt, max_streams=2)
            with m.reserving(["a", "b"]):
                with pytest.raises(StreamLimitError):
                    await m.add(f"file://{CAR_CLIP}", stream_id="api")
                await m.add(f"file://{CAR_CLIP}", stream_id="a")  # its own room
                await m.add(f"file://{CAR_CLIP}", stream_id="b")
            await m.remove("b")
            path = write(tmp_path / "streams.yaml", [{"id": "b", "url": f"file://{CAR_CLIP}"}])
            apply = asyncio.create_task(apply_streams_file(m, path, pool.engine.names, {}))
            await asyncio.sleep(0)  # the file checked, its room held
            with pytest.raises(StreamLimitError):
                await m.add(f"file://{CAR_CLIP}", stream_id="api")
            await apply
            assert {s["id"] for s in m.list()} == {"a", "b"}
    finally:
        pool.stop(5)


def test_sighup_during_the_shutdown_is_ignored() -> None:
    """Once the reload handler is taken away (the server stopping), ``SIGHUP`` is ignored:
    removing it put back the default action, which ended the process in its shutdown."""
    import asyncio

    from server.routes.streams import StreamsFileReloads

    before = signal.getsignal(signal.SIGHUP)

    async def main() -> None:
        reloads = StreamsFileReloads(None, None, {})  # type: ignore[arg-type]
        reloads.install()
        reloads.uninstall()

    try:
        asyncio.run(main())
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGHUP)  # and this process goes on
    finally:
        signal.signal(signal.SIGHUP, before)
