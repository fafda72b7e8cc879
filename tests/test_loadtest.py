"""``streamdet loadtest``: profiles, target checks, and real short Locust runs against a real
server (a passing profile exits 0, an impossible target exits 1)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtest.profiles import ProfileError, Target, available, load_profile
from loadtest.report import Row, evaluate, passed
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


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "server.cli", "loadtest", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
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
