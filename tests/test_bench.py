"""``streamdet bench``'s engine-only rates, on every form of the shared model (its load test
against the server is what ``make bench`` runs; the figures are in the README)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.server import _env_value
from server.bench import engine_ceiling, serve_settings
from server.settings import Settings
from streams.files import sample_video_frames
from tests.helpers import CACHE_DIR, MODEL_PT, MODEL_TS, VIDEOS


@pytest.mark.parametrize("model", [MODEL_PT, MODEL_TS], ids=["pt", "torchscript"])
def test_engine_rates_at_square_and_rect_shapes(model: Path) -> None:
    settings = Settings(model=str(model), cache_dir=CACHE_DIR)
    (frame,) = sample_video_frames(VIDEOS[0], 1)  # 640x360: rect 640x384 where the model allows
    square = engine_ceiling(settings, frame, 0.3)
    rect = engine_ceiling(settings, frame, 0.3, rect=True)  # a TorchScript runs square anyway
    assert square > 0 and rect > 0


def test_the_bench_server_gets_only_the_settings_given_and_never_the_data_dir(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Everything dumped made None "None" (STREAMDET_MQTT_URL=None) and handed the bench's
    server the user's data dir (their cameras, their jobs)."""
    monkeypatch.setenv("STREAMDET_MAX_QUEUE", "7")  # from the environment: given too
    settings = Settings(
        model=str(MODEL_PT), data_dir=Path("/nowhere/data"), api_keys=["a", "b"], max_wait_ms=2
    )
    given = serve_settings(settings)
    assert "data_dir" not in given and given["streams_file"] == ""
    env = {f"STREAMDET_{k.upper()}": _env_value(v) for k, v in given.items()}
    assert "None" not in env.values()
    assert env["STREAMDET_MODEL"] == str(MODEL_PT) and env["STREAMDET_MAX_QUEUE"] == "7"
    for name in list(os.environ):
        if name.startswith("STREAMDET_"):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    again = Settings()  # as the bench's server reads them
    assert again.api_keys == ["a", "b"] and again.max_wait_ms == 2 and again.max_queue == 7
    assert again.mqtt_url is None and again.streams_file is None and not again.access_log
    assert again.data_dir != settings.data_dir


def test_a_short_bench_keeps_away_from_the_users_data_dir_and_leaves_no_log(
    tmp_path: Path,
) -> None:
    user_data = tmp_path / "user-data"  # as a developer's STREAMDET_DATA_DIR
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "STREAMDET_DATA_DIR": str(user_data), "TMPDIR": str(scratch)}
    bench = [sys.executable, "-m", "server.cli", "bench", "--model", str(MODEL_PT)]
    options = ["--skip-seed", "--seconds", "1", "--warmup-seconds", "0.2", "--frames", "2"]
    done = subprocess.run(
        [*bench, *options, "--clients", "1", "--videos", str(VIDEOS[0])],
        env={**env, "STREAMDET_CACHE_DIR": str(CACHE_DIR), "STREAMDET_WORKERS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "streamdet: " in done.stdout
    assert not user_data.exists()  # the server's stores were made elsewhere
    assert not list(scratch.glob("streamdet-bench-*"))


def test_bench_finds_the_shared_clips_from_any_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """They were looked up under ``../shared`` from the current directory: run from
    elsewhere, ``streamdet bench`` found no clip (``streamdet loadtest`` found them)."""
    from server.bench import default_videos

    monkeypatch.delenv("STREAMDET_SHARED_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    found = default_videos()
    assert found and all(Path(p).is_file() for p in found), found


def test_bench_offers_no_flag_it_would_ignore(capsys: pytest.CaptureFixture[str]) -> None:
    """``streamdet bench --help`` listed ``--data-dir`` and ``--streams-file``, which the bench
    dropped (its server runs on data of its own): they are not offered, and refused."""
    from server.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    shown = capsys.readouterr().out
    assert "--max-batch" in shown and "--log-level" in shown
    for flag in ("--data-dir", "--streams-file", "--port "):
        assert flag not in shown, flag
    with pytest.raises(SystemExit) as refused:
        main(["bench", "--data-dir", "/tmp/x"])
    assert refused.value.code == 2 and "--data-dir" in capsys.readouterr().err
