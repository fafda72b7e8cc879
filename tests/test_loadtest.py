"""``streamdet loadtest``: profiles, target checks, and real short Locust runs against a real
server (a passing profile exits 0, an impossible target exits 1); and the load generators
against small fake servers that hang, drop connections or close WebSockets (the thing under
test is the client: a call the server never answers must count as a failure, never vanish)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import httpx
import pytest
from websockets.asyncio.server import ServerConnection, serve

from loadtest.client import Connection, closed_loop, open_loop
from loadtest.profiles import ProfileError, Target, available, load_profile
from loadtest.report import Row, evaluate, passed, read_stats
from loadtest.server import REPO, ServerProcess
from streams.store import StreamStore, new_record
from tests.helpers import CACHE_DIR, MODEL_PT


def test_shipped_profiles_load_and_target_known_requests() -> None:
    names = available()
    assert {"cpu-ci", "gpu"} <= set(names)
    for name in names:
        profile = load_profile(name)
        assert profile.run_time_s > 0
        assert set(profile.targets) <= {"POST /detect", "WS frame", "SSE event"}
        for target in profile.targets.values():
            assert target.p99_ms is not None and target.max_error_rate is not None


def test_ci_profile_fits_the_ci_budget() -> None:
    profile = load_profile("cpu-ci")
    assert profile.run_time_s <= 60
    assert profile.scenario == "mixed"


def test_bad_profiles_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="cpu-ci"):
        load_profile("no-such-profile")
    bad = tmp_path / "bad.toml"
    bad.write_text('users = 2\nspeed = "fast"\n')
    with pytest.raises(ProfileError, match="speed"):
        load_profile(str(bad))
    bad.write_text('[targets."POST /detect"]\np95_ms = 3\n')
    with pytest.raises(ProfileError, match="p95_ms"):
        load_profile(str(bad))


def test_evaluate_checks_each_bound_and_skips() -> None:
    rows = {"POST /detect": Row("POST /detect", 100, 2, 300.0, 900.0, 5.0, 0.1)}
    targets = {
        "POST /detect": Target(p50_ms=400, p99_ms=800, max_error_rate=0.05, min_goodput_rps=4),
        "WS frame": Target(p99_ms=1000),
    }
    verdicts = evaluate(rows, targets, {"WS frame": "no streams API"}, duration_s=20)
    by_metric = {(v.name, v.metric): v.ok for v in verdicts}
    assert by_metric[("POST /detect", "p50_ms")] is True
    assert by_metric[("POST /detect", "p99_ms")] is False  # 900 > 800
    assert by_metric[("POST /detect", "error_rate")] is True  # 2 %
    assert by_metric[("POST /detect", "goodput_rps")] is True  # 98 / 20 s = 4.9
    assert by_metric[("WS frame", "all")] is None
    assert not passed(verdicts)
    missing = evaluate({}, {"POST /detect": Target(p99_ms=1)})
    assert not passed(missing) and missing[0].note == "no requests recorded"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    logs = tmp_path_factory.mktemp("loadtest")
    settings: dict[str, object] = {
        "model": str(MODEL_PT),
        "cache_dir": str(CACHE_DIR),
        "max_batch": 2,
        "admission_deadline_ms": 0,
    }
    with ServerProcess(settings, log_path=logs / "server.log") as proc:
        yield proc


def write_profile(path: Path, p99_ms: float) -> Path:
    path.write_text(f"""
description = "test"
scenario = "detect"
users = 1
spawn_rate = 1
run_time_s = 6
wait_s = [0.2, 0.4]

[targets."POST /detect"]
p99_ms = {p99_ms}
""")
    return path


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "server.cli", "loadtest", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        env={**os.environ, "STREAMDET_LOADTEST_PER_CLIP": "1", **(env or {})},
    )


def test_cli_passes_then_fails_an_impossible_target(server: ServerProcess, tmp_path: Path) -> None:
    lax = write_profile(tmp_path / "lax.toml", p99_ms=60_000)
    out = tmp_path / "lax-out"
    done = run_cli("--profile", str(lax), "--host", server.base_url, "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "POST /detect" in done.stdout and "PASS" in done.stdout
    assert (out / "locust_stats.csv").stat().st_size > 0
    assert (out / "report.html").stat().st_size > 0
    assert '"passed": true' in (out / "verdict.json").read_text()

    strict = write_profile(tmp_path / "strict.toml", p99_ms=1)
    out = tmp_path / "strict-out"
    done = run_cli("--profile", str(strict), "--host", server.base_url, "--out", str(out))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "MISSED" in done.stdout and "FAIL" in done.stdout


def test_cli_unknown_profile_exits_2() -> None:
    done = run_cli("--profile", "no-such-profile")
    assert done.returncode == 2
    assert "no profile 'no-such-profile'" in done.stderr


def test_a_server_process_keeps_its_streams_apart_from_the_users(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A benchmark's or a test's server without a ``data_dir`` opens none of the user's
    cameras and leaves nothing in their data; its own streams last across its restarts."""
    users = StreamStore(tmp_path / "share" / "streamdet")  # the default data dir, made here
    camera = new_record(
        "porch", "rtsp://10.0.0.9/1", name="", max_fps=None, transport="tcp", loop=False
    )
    users.add(camera)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "share"))
    settings: dict[str, object] = {"model": str(MODEL_PT), "cache_dir": str(CACHE_DIR)}
    with ServerProcess(settings, log_path=tmp_path / "server.log") as proc:
        assert httpx.get(f"{proc.base_url}/streams").json()["streams"] == []
        body = {"url": "rtsp://127.0.0.1:9/none", "enabled": False}
        assert httpx.put(f"{proc.base_url}/streams/mine", json=body).status_code == 201
        proc.stop()
        proc.start()
        kept = httpx.get(f"{proc.base_url}/streams").json()["streams"]
        assert [s["id"] for s in kept] == ["mine"]
    assert [r.id for r in users.load()] == ["porch"]


def test_the_tests_keep_their_data_apart_from_the_users() -> None:
    """In-process apps made with default settings (``tests/conftest.py``) use the run's own
    data folder."""
    from server.settings import Settings
    from tests.conftest import TEST_DATA_HOME

    data_dir = Settings().data_dir
    assert data_dir == Path(TEST_DATA_HOME) / "streamdet"
    assert not data_dir.is_relative_to(Path.home() / ".local" / "share")


# --- fake servers: what the load generators do when a server hangs, drops or closes ---

Behaviour = Callable[[int], str]  # the n-th /detect call (from 1) -> "ok", "hang" or "drop"


class FakeHttp:
    """An HTTP/1.1 keep-alive server on a thread: ``POST /detect`` answers per ``behaviour``
    (after ``delay_s``), ``GET /healthz`` 200, anything else 404 (no streams API). It counts
    the /detect requests it read, so a test can tell a re-sent POST from a counted one."""

    def __init__(self, behaviour: Behaviour, delay_s: float = 0.0, idle_close_s: float = 0) -> None:
        self.behaviour, self.delay_s, self.idle_close_s = behaviour, delay_s, idle_close_s
        self.received = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(10)
        self.base_url = f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()
        server.close()
        tasks = asyncio.all_tasks(self._loop)
        for task in tasks:  # the hanging calls
            task.cancel()
        self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        self._loop.run_until_complete(asyncio.sleep(0.05))  # transports close
        self._loop.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                read = reader.readuntil(b"\r\n\r\n")
                head = await (
                    asyncio.wait_for(read, self.idle_close_s) if self.idle_close_s else read
                )
                lines = head.decode("latin-1").split("\r\n")
                length = next(
                    (
                        int(v)
                        for k, _, v in (ln.partition(":") for ln in lines[1:])
                        if k.lower() == "content-length"
                    ),
                    0,
                )
                await reader.readexactly(length)
                status, body = "404 Not Found", b"{}"
                if lines[0].startswith("GET /healthz"):
                    status = "200 OK"
                elif lines[0].startswith("POST /detect"):
                    self.received += 1
                    what = self.behaviour(self.received)
                    if what == "hang":
                        await asyncio.sleep(3600)
                    if what == "drop":
                        return  # read, never answered: the connection closes
                    await asyncio.sleep(self.delay_s)
                    status, body = "200 OK", b'{"detections": []}'
                writer.write(
                    f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n"
                    f"content-length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            pass
        finally:
            writer.close()

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@contextlib.contextmanager
def fake_http(behaviour: Behaviour, **kwargs: float) -> Iterator[FakeHttp]:
    server = FakeHttp(behaviour, **kwargs)
    try:
        yield server
    finally:
        server.close()


def every(n: int, what: str) -> Behaviour:
    return lambda i: what if i % n == 0 else "ok"


JPEGS = [b"\xff\xd8" + b"x" * 2000]


def test_closed_loop_counts_a_hung_call_as_a_timeout_and_waits_for_the_last_calls() -> None:
    """Calls ending after the window were dropped (the slowest, p99 biased low) and the 30 s
    timeout outlasted a 20 s window, so "no timeouts" held by construction."""
    with fake_http(every(4, "hang"), delay_s=0.3) as server:
        phase = asyncio.run(
            closed_loop(server.base_url, JPEGS, clients=2, seconds=1.0, warmup=0, timeout_s=1.0)
        )
        received = server.received
    assert phase.statuses.get("ReadTimeout", 0) >= 1, phase.statuses
    assert sum(phase.statuses.values()) == received  # every call sent is counted, none lost
    assert max(phase.latencies_ms) >= 250  # and the slow ones ending past the window too
    assert phase.unexpected == {"ReadTimeout": phase.statuses["ReadTimeout"]}


def test_a_dropped_post_is_an_error_and_never_sent_twice() -> None:
    """A connection dropped after the request was written was re-sent as if the keep-alive
    connection had been stale, and the overload check passed it as no 5xx, no timeout."""
    with fake_http(every(3, "drop")) as server:
        phase = asyncio.run(closed_loop(server.base_url, JPEGS, clients=2, seconds=0.6, warmup=0))
        received = server.received
    assert phase.statuses.get("IncompleteReadError", 0) >= 1, phase.statuses
    assert sum(phase.statuses.values()) == received  # no call was posted twice
    assert "IncompleteReadError" in phase.unexpected and "200" not in phase.unexpected


def test_a_keep_alive_connection_the_server_closed_is_reopened_before_the_call() -> None:
    async def two_calls(base: str) -> list[str]:
        conn = Connection(base)
        request = Connection.request(JPEGS[0])
        first = await conn.post(request)
        await asyncio.sleep(0.5)  # the server closes the idle connection meanwhile
        second = await conn.post(request)
        await conn.close()
        return [first[0], second[0]]

    with fake_http(lambda i: "ok", idle_close_s=0.2) as server:
        assert asyncio.run(two_calls(server.base_url)) == ["200", "200"]
        assert server.received == 2


def test_open_loop_keeps_the_rate_and_times_from_the_planned_arrival() -> None:
    with fake_http(lambda i: "ok", delay_s=0.05) as server:
        phase = asyncio.run(open_loop(server.base_url, JPEGS, rate=100.0, seconds=1.5))
    sent = sum(phase.statuses.values())
    assert 110 <= sent <= 190, sent  # Poisson, 150 expected (seeded)
    assert phase.statuses == {"200": sent}
    assert min(phase.latencies_ms) >= 50


def write_detect_profile(path: Path, run_time_s: int, users: int = 2) -> Path:
    path.write_text(f"""
description = "test"
scenario = "detect"
users = {users}
spawn_rate = {users}
run_time_s = {run_time_s}
wait_s = [0.05, 0.1]

[targets."POST /detect"]
p99_ms = 60000
max_error_rate = 0
""")
    return path


def test_cli_counts_hung_detect_calls_as_failures(tmp_path: Path) -> None:
    """Locust's 60 s network timeout outlasted the run, so calls a server never answered
    were neither failures nor latencies and the gate passed."""
    profile = write_detect_profile(tmp_path / "hang.toml", run_time_s=4)  # call timeout 1 s
    with fake_http(every(6, "hang")) as server:
        done = run_cli("--profile", str(profile), "--host", server.base_url, "--out", str(tmp_path))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAIL" in done.stdout
    row = read_stats(tmp_path / "final_stats.csv")["POST /detect"]
    assert row.failures >= 2 and row.requests > row.failures
    assert '"passed": false' in (tmp_path / "verdict.json").read_text()


def test_a_detect_call_unanswered_when_the_run_stops_is_a_failure(tmp_path: Path) -> None:
    """Locust drops a call still in flight when it stops its users; the user records it."""
    final = tmp_path / "final.csv"
    env = {
        **os.environ,
        "STREAMDET_LOADTEST_PER_CLIP": "1",
        "STREAMDET_LOADTEST_TIMEOUT_S": "60",  # longer than the run: only the stop ends them
        "STREAMDET_LOADTEST_DETECT_USERS": "2",
        "STREAMDET_LOADTEST_WAIT_S": "0.05,0.1",
        "STREAMDET_LOADTEST_FINAL_CSV": str(final),
    }
    locust = [sys.executable, "-m", "locust", "-f", str(REPO / "loadtest" / "locustfile.py")]
    options = ["--headless", "-u", "2", "-r", "2", "-t", "3s", "--stop-timeout", "1"]
    with fake_http(lambda i: "ok" if i <= 4 else "hang") as server:
        subprocess.run(
            [*locust, *options, "--host", server.base_url, "--only-summary", "DetectUser"],
            env=env,
            capture_output=True,
            timeout=60,
            check=False,
        )
    row = read_stats(final)["POST /detect"]
    assert (row.requests, row.failures) == (6, 2), row  # 4 answered, 2 left hanging at stop
    assert "no answer when the run stopped" in final.with_name("final_failures.csv").read_text()


def test_cli_exits_2_when_the_run_cannot_happen(tmp_path: Path) -> None:
    """An unreachable --host was a traceback (exit 1), a Locust crash "a target was missed",
    a run that measured nothing PASS; and an earlier verdict.json stayed behind."""
    profile = write_detect_profile(tmp_path / "p.toml", run_time_s=2)
    out = tmp_path / "out"
    out.mkdir()
    (out / "verdict.json").write_text('{"passed": true}')
    done = run_cli("--profile", str(profile), "--host", "http://127.0.0.1:9", "--out", str(out))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "cannot talk to the server at http://127.0.0.1:9" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (out / "verdict.json").exists()

    with fake_http(lambda i: "ok") as server:
        base = ["--profile", str(profile), "--host", server.base_url, "--out", str(out)]
        done = run_cli(*base, env={"STREAMDET_LOADTEST_PER_CLIP": "abc"})
        assert done.returncode == 2, done.stdout + done.stderr
        assert "Locust exited with" in done.stderr and "FAIL" not in done.stdout

        done = run_cli(*base, "--scenario", "live", "--live-users", "1")  # no /streams here
        assert done.returncode == 2, done.stdout + done.stderr
        assert "nothing to run" in done.stderr and "PASS" not in done.stdout
        assert not (out / "verdict.json").exists()

    done = run_cli("--profile", str(profile), "--run-time", "2.5")
    assert done.returncode == 2 and "--run-time" in done.stderr
    (tmp_path / "frac.toml").write_text("run_time_s = 2.5\n")
    with pytest.raises(ProfileError, match="whole seconds"):
        load_profile(str(tmp_path / "frac.toml"))


@contextlib.contextmanager
def closing_ws(frames: int, seen: list[float] | None = None) -> Iterator[str]:
    """A WebSocket server that sends ``frames`` frames and closes; its ws:// base URL.
    ``seen`` gets the time of each connection."""
    ready = threading.Event()
    loop = asyncio.new_event_loop()
    port: list[int] = []

    async def handler(ws: ServerConnection) -> None:
        if seen is not None:
            seen.append(time.monotonic())
        for i in range(frames):
            await ws.send(json.dumps({"frame": i, "captured_at": time.time()}))
        await ws.close()

    async def main(stop: Callable[[], Awaitable[object]]) -> None:
        async with serve(handler, "127.0.0.1", 0) as server:
            port.append(next(iter(server.sockets)).getsockname()[1])
            ready.set()
            await stop()

    stopped = asyncio.Event()

    def run() -> None:
        loop.run_until_complete(main(stopped.wait))
        loop.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    ready.wait(10)
    try:
        yield f"http://127.0.0.1:{port[0]}"
    finally:
        loop.call_soon_threadsafe(stopped.set)
        thread.join(10)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_closed_websocket_makes_the_viewer_reconnect_not_spin(tmp_path: Path) -> None:
    """A closed WebSocket left LiveUser returning at once from its task with no wait: a
    whole core spun for the rest of the run."""
    final = tmp_path / "final.csv"
    env = {
        **os.environ,
        "STREAMDET_LOADTEST_PER_CLIP": "1",
        "STREAMDET_LOADTEST_STREAMS": "s",
        "STREAMDET_LOADTEST_LIVE_USERS": "1",
        "STREAMDET_LOADTEST_DETECT_USERS": "0",
        "STREAMDET_LOADTEST_EVENT_USERS": "0",
        "STREAMDET_LOADTEST_FINAL_CSV": str(final),
    }
    locust = [sys.executable, "-m", "locust", "-f", str(REPO / "loadtest" / "locustfile.py")]
    options = ["--headless", "-u", "1", "-r", "1", "-t", "12s", "--only-summary"]
    seen: list[float] = []
    with closing_ws(frames=1, seen=seen) as host:
        proc = subprocess.Popen(
            [*locust, *options, "--host", host, "LiveUser"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            # Measured once it has come back after a close: Locust's own start (imports,
            # clips) is over however loaded the machine (a fixed sleep could land in it).
            deadline = time.monotonic() + 60
            while len(seen) < 2 and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.05)
            assert len(seen) >= 2, "the viewer never came back after its first close"
            before = cpu_seconds(proc.pid)
            time.sleep(2.0)
            spent = cpu_seconds(proc.pid) - before
        finally:
            proc.wait(60)
    assert spent < 0.5, f"the load generator spent {spent:.2f} s of CPU in 2 s"
    row = read_stats(final)["WS frame"]
    assert row.failures >= 2  # each close recorded...
    assert row.requests - row.failures >= 2  # ...and the viewer came back for more frames
