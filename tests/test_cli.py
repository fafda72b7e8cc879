"""``streamdet`` command line: settings refused with the flag to change, and ``serve``'s checks
that come before the model loads (streams file entries, the data dir), early signals, and
misspelt environment variables. None of these loads the model."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from engines.types import EngineError
from loadtest.server import free_port
from server import cli
from server.data_dir import DataDirLock, data_dir_problems
from server.settings import Settings
from tests.helpers import CACHE_DIR, CAR_CLIP, MODEL_PT, REPO


@pytest.fixture(autouse=True)
def switch_interval_kept() -> Iterator[None]:
    """``serve`` sets the interpreter's switch interval (``--gil-switch-ms``) first thing: the
    tests that call it in this process put it back (a later test measured at 1 ms where it
    meant Python's default)."""
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


@pytest.fixture
def no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """``serve`` called in-process stops where the model would load (these checks come
    before it)."""

    def build_pool(settings: Settings) -> Any:
        raise EngineError("the model would load here")

    monkeypatch.setattr("server.runtime.build_pool", build_pool)


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "server.cli", *args],
        cwd=REPO,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--shutdown-timeout-s", "inf"),
        ("--max-upload-mb", "inf"),
        ("--max-job-upload-mb", "Infinity"),
        ("--max-wait-ms", "nan"),
        ("--request-timeout-ms", "1e400"),
        ("--event-retain-days", "-inf"),
    ],
)
def test_infinite_or_nan_settings_are_refused_naming_the_flag(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["serve", f"{flag}={value}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"streamdet: {flag}: ") and "finite" in err, err
    assert "Traceback" not in err


def test_every_number_setting_is_bounded_above() -> None:
    """A huge finite value failed later, as inf did (gRPC's message limit is a C int); and
    ``--max-queue 999999999999`` or ``--max-image-pixels 1e23`` started, as README says no
    setting does."""
    for name, field in Settings.model_fields.items():
        if field.annotation in (float, int, float | None, int | None):
            assert any(hasattr(m, "le") or hasattr(m, "lt") for m in field.metadata), name
    with pytest.raises(ValueError, match="max_upload_mb"):
        Settings(max_upload_mb=1e12)
    with pytest.raises(ValueError, match="max_queue"):
        Settings(max_queue=999_999_999_999)


def test_the_grpc_message_limit_stays_under_2_gib_and_a_port_in_use_is_refused() -> None:
    """--max-upload-mb 2048 failed gRPC's start; and gRPC's SO_REUSEPORT let a second server
    bind a port another one serves, without a word."""
    grpc = pytest.importorskip("grpc")
    pytest.importorskip("tritonclient.grpc")
    from server import grpc_v2
    from server.auth import ApiKeys

    app: Any = SimpleNamespace(state=SimpleNamespace(api_keys=ApiKeys(), streamdet=None))
    seen: dict[str, Any] = {}
    real_server = grpc.aio.server

    def server(*args: Any, **kwargs: Any) -> Any:
        seen.update(dict(kwargs.get("options", ())))
        return real_server(*args, **kwargs)

    async def main() -> None:
        holder = grpc.aio.server()  # gRPC's defaults: SO_REUSEPORT on
        port = holder.add_insecure_port("127.0.0.1:0")
        await holder.start()
        try:
            settings = Settings(grpc_port=port, max_upload_mb=4096)
            with pytest.raises(RuntimeError, match="STREAMDET_GRPC_PORT"):
                await grpc_v2.start(app, settings)
        finally:
            await holder.stop(0)

    grpc.aio.server = server
    try:
        asyncio.run(main())
    finally:
        grpc.aio.server = real_server
    assert seen["grpc.max_receive_message_length"] == 2**31 - 1
    assert seen["grpc.so_reuseport"] == 0


@pytest.mark.parametrize("variable", ["STREAMDET_ALLOWED_FILE_DIR", "STREAMDET_STREAMS_FILE"])
def test_an_empty_optional_path_variable_is_unset_not_the_working_directory(
    variable: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(variable, "")
    settings = Settings()
    assert settings.allowed_file_dir is None and settings.streams_file is None


@pytest.mark.parametrize(
    ("value", "message"), [(",", "no key in it"), (" , ", "no key in it"), ('[""]', "empty key")]
)
@pytest.mark.parametrize("variable", ["STREAMDET_API_KEYS", "STREAMDET_API_KEYS_READONLY"])
def test_api_keys_set_to_no_key_are_refused_not_an_open_server(
    variable: str, value: str, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Set to ``,`` (or a list of blanks), they gave no key: the server ran with every call
    allowed, and said nothing to the operator who asked for keys. Empty is unset."""
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValidationError, match=message):
        Settings()
    monkeypatch.setenv(variable, " ")
    assert Settings().api_keys == [] and Settings().api_keys_readonly == []
    monkeypatch.setenv(variable, "a, b,,")
    assert getattr(Settings(), variable.removeprefix("STREAMDET_").lower()) == ["a", "b"]


@pytest.mark.parametrize(
    ("flag", "variable"), [("--data-dir", "DATA_DIR"), ("--cache-dir", "CACHE_DIR")]
)
def test_an_empty_required_path_is_refused_naming_its_setting(
    flag: str, variable: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["serve", flag, ""]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"streamdet: {flag}: empty") and f"STREAMDET_{variable}" in err, err


def test_sighup_while_the_server_starts_is_logged_not_fatal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """SIGHUP's default action killed a server still loading its model (exit 129)."""
    seen: list[Any] = []

    def build_pool(settings: Settings) -> Any:  # stands in for the model load
        os.kill(os.getpid(), signal.SIGHUP)
        seen.append(signal.getsignal(signal.SIGHUP))
        raise EngineError("stop here")

    monkeypatch.setattr("server.runtime.build_pool", build_pool)
    before = sys.getswitchinterval()
    previous = signal.getsignal(signal.SIGHUP)
    try:
        with caplog.at_level(logging.WARNING, logger="streamdet"):
            assert cli.serve(Settings(data_dir=tmp_path / "data")) == 2
    finally:
        sys.setswitchinterval(before)
    assert seen and seen[0] is not signal.SIG_DFL
    assert "SIGHUP: the server is still starting" in caplog.text
    assert signal.getsignal(signal.SIGHUP) == previous  # restored when serve returns


def test_a_sighup_while_the_model_loads_does_not_kill_the_process(tmp_path: Path) -> None:
    """The real ``streamdet`` command: SIGHUP as soon as it handles one (the command's first
    step, before its imports: they took 0.6 s, and a SIGHUP in them ended the process), then
    again once it logs (before the model loads); it was the app's handler alone, once the
    model had loaded."""
    log_path = tmp_path / "serve.log"
    serve = ["serve", "--model", str(MODEL_PT), "--cache-dir", str(CACHE_DIR), "--port", "0"]
    command = Path(sys.executable).parent / "streamdet"
    with log_path.open("w") as log_file:
        launched = time.monotonic()
        proc = subprocess.Popen(
            [command, *serve, "--data-dir", str(tmp_path / "data")],
            cwd=REPO,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None and not _handles_hup(proc.pid):
            time.sleep(0.005)
        caught_after_s = time.monotonic() - launched
        proc.send_signal(signal.SIGHUP)
        while time.monotonic() < deadline and proc.poll() is None and not log_path.read_text():
            time.sleep(0.01)
        proc.send_signal(signal.SIGHUP)
        while time.monotonic() < deadline and proc.poll() is None:
            if "SIGHUP: the server is still starting" in log_path.read_text():
                break
            time.sleep(0.05)
        alive = proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
    text = log_path.read_text()
    assert alive and "SIGHUP: the server is still starting" in text, text[-3000:]
    assert "Uvicorn running" not in text  # it came while the server was starting
    # The command sets its handler before any heavy import (they took 0.6 s here).
    probe = "import sys, server.entry; print(sorted({'numpy', 'pydantic'} & set(sys.modules)))"
    imported = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, check=True
    )
    assert imported.stdout.decode().strip() == "[]", (imported, caught_after_s)


def _handles_hup(pid: int) -> bool:
    """Whether process ``pid`` catches SIGHUP (its SigCgt mask in /proc)."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt"))
    return bool(int(caught, 16) & (1 << (signal.SIGHUP - 1)))


@pytest.mark.usefixtures("no_model")
def test_unknown_streamdet_variables_are_named_with_the_closest_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from server.settings import unknown_env_settings

    environ = {
        "STREAMDET_MAXQUEUE": "5",
        "STREAMDET_WORKER": "1",
        "STREAMDET_NOTHING_LIKE_IT": "1",
        "STREAMDET_MAX_QUEUE": "5",  # a setting
        "STREAMDET_SHARED_DIR": "x",  # the tests' own
        "STREAMDET_GPU_TEST_DEVICE": "x",
        "STREAMDET_LOADTEST_API_KEY": "x",
        "OTHER": "x",
    }
    assert unknown_env_settings(environ) == [
        ("STREAMDET_MAXQUEUE", "STREAMDET_MAX_QUEUE"),
        ("STREAMDET_NOTHING_LIKE_IT", None),
        ("STREAMDET_WORKER", "STREAMDET_WORKERS"),
    ]
    monkeypatch.setenv("STREAMDET_MAXQUEUE", "5")
    before = sys.getswitchinterval()
    try:
        with caplog.at_level(logging.WARNING, logger="streamdet"):
            assert cli.serve(Settings(data_dir=tmp_path / "data")) == 2
    finally:
        sys.setswitchinterval(before)
    assert "STREAMDET_MAXQUEUE is not a setting" in caplog.text
    assert "did you mean STREAMDET_MAX_QUEUE?" in caplog.text


def test_a_data_dir_that_cannot_be_made_stops_serve_naming_the_setting(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    done = run_cli("serve", "--data-dir", str(blocker / "data"))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        f"streamdet: --data-dir: {blocker / 'data'}: Not a directory (setting STREAMDET_DATA_DIR)"
    )
    done = run_cli("serve", "--data-dir", str(blocker))
    assert done.returncode == 2, done.stderr
    assert "a file, not a directory (setting STREAMDET_DATA_DIR)" in done.stderr


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
@pytest.mark.usefixtures("no_model")
def test_a_data_dir_that_cannot_be_written_stops_serve(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data"
    data.mkdir(mode=0o500)
    before = sys.getswitchinterval()
    try:
        assert cli.serve(Settings(data_dir=data)) == 2
    finally:
        sys.setswitchinterval(before)
        data.chmod(0o700)
    assert "Permission denied (setting STREAMDET_DATA_DIR)" in capsys.readouterr().err


@pytest.mark.usefixtures("no_model")
def test_a_host_a_shared_port_or_a_cache_dir_that_cannot_work_stops_serve_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each named what is wrong before the model loads: a host this machine lacks was blamed
    on --port; --grpc-port equal to --port, and a cache directory that is a file, failed with
    a traceback once the model had loaded."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    port = free_port()
    data = tmp_path / "data"
    cases = [
        (Settings(data_dir=data, host="10.255.255.1", port=port), "--host: 10.255.255.1"),
        (Settings(data_dir=data, host="not_a_host!", port=port), "cannot resolve the host"),
        (Settings(data_dir=data, port=port, grpc_port=port), f"--grpc-port: {port} is --port's"),
        (Settings(data_dir=data, cache_dir=blocker / "sub", port=port), "is a file, not a"),
    ]
    before = sys.getswitchinterval()
    try:
        for settings, words in cases:
            assert cli.serve(settings) == 2, words
            err = capsys.readouterr().err
            assert words in err, err
            assert "(setting STREAMDET_" in err and "--port:" not in err, err
    finally:
        sys.setswitchinterval(before)


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A real filesystem with no space left: a 1 MiB tmpfs, filled (needs mount rights)."""
    where = tmp_path / "small"
    where.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)],
        check=False,
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        with contextlib.suppress(OSError), (where / "filler").open("wb") as filler:
            while True:
                filler.write(bytes(64 * 1024))
                filler.flush()
        (where / "data").mkdir()  # a directory still fits (tmpfs counts pages, not inodes)
        yield where / "data"
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.mark.usefixtures("no_model")
def test_a_data_dir_on_a_full_disk_stops_serve_naming_the_setting(
    full_disk: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An empty file fits on a full disk: the check passed, the model loaded, and the event
    store's first write failed the start with a traceback naming no setting."""
    before = sys.getswitchinterval()
    try:
        assert cli.serve(Settings(data_dir=full_disk)) == 2
    finally:
        sys.setswitchinterval(before)
    assert "No space left on device (setting STREAMDET_DATA_DIR)" in capsys.readouterr().err


def test_analyze_and_export_name_an_out_that_cannot_be_made(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from server.analyze_cli import run_analyze

    blocker = tmp_path / "file"
    blocker.write_text("")
    out = blocker / "results"
    args = argparse.Namespace(video=CAR_CLIP, settings="{}", out=out)
    assert run_analyze(Settings(), args) == 2  # before the model loads
    assert capsys.readouterr().err == f"streamdet analyze: --out: {out}: Not a directory\n"
    done = run_cli("export", "--model", "missing.pt", "--out", str(blocker / "m.onnx"))
    assert done.returncode == 2, done.stderr
    said = f"streamdet export: --out: {blocker / 'm.onnx'}: a file, not a directory\n"
    assert done.stderr == said


def test_streams_file_entries_are_checked_before_the_model_loads(tmp_path: Path) -> None:
    path = tmp_path / "streams.yaml"
    entries = [
        {"id": "door", "url": "rtsp://camera/1", "max_fsp": 5},
        {"id": "yard", "url": "rtsp://camera/2", "max_fps": -1, "transport": "carrier pigeon"},
    ]
    path.write_text(yaml.safe_dump({"streams": entries}))
    done = run_cli("serve", "--streams-file", str(path), "--data-dir", str(tmp_path / "data"))
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert "Traceback" not in done.stderr and len(lines) == 3, done.stderr
    where = f"streamdet: --streams-file: {path}: stream"
    assert lines[0] == (
        f"{where} 'door': max_fsp: not a stream setting; did you mean max_fps?"
        " (setting STREAMDET_STREAMS_FILE)"
    )
    assert lines[1].startswith(f"{where} 'yard': max_fps: Input should be greater than 0")
    assert lines[2].startswith(f"{where} 'yard': transport: ")


def test_ctrl_c_after_a_clean_shutdown_exits_130_without_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """uvicorn raises the SIGINT it caught again once it has shut down."""

    def serve(settings: Settings) -> int:
        signal.raise_signal(signal.SIGINT)
        return 0

    monkeypatch.setattr(cli, "serve", serve)
    # Python's own Ctrl-C handler, as a shell's streamdet has (a CI run once returned 0 here,
    # the handler another test's code had left in place taking the signal).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert cli.main(["serve", "--data-dir", str(tmp_path / "data")]) == 130
    finally:
        signal.signal(signal.SIGINT, previous)


def test_decode_processes_help_says_what_the_code_checks() -> None:
    from streams.decode_child import SLOTS, STREAMS_NEEDED, ring_bytes, rings_that_fit

    text = Settings.model_fields["decode_processes"].description or ""
    assert "256 MB" not in text
    assert f"{STREAMS_NEEDED} streams' rings of {SLOTS} frames" in text
    assert f"{ring_bytes(SLOTS, 640) / 2**20:.1f} MiB each at 640" in text
    docker = 64 * 2**20
    assert f"64 MB holds {rings_that_fit(docker, SLOTS, 640)} at 640" in text
    assert rings_that_fit(docker, SLOTS, 0) == 1 and "only one whole" in text


@pytest.mark.parametrize("flag", ["port", "grpc-port"])
def test_a_port_another_server_holds_is_refused_before_the_model_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_model: None, flag: str
) -> None:
    """A port already served (by another streamdet, say) stops the start at once, naming the
    flag and its setting: it failed only after the model loaded and the cameras opened (HTTP,
    uvicorn's error) or with a traceback from the app's startup (gRPC)."""
    import socket

    from loadtest.server import free_port

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        taken = holder.getsockname()[1]
        http, grpc = (taken, free_port()) if flag == "port" else (free_port(), taken)
        settings = Settings(data_dir=tmp_path / "data", host="127.0.0.1", port=http, grpc_port=grpc)
        assert cli.serve(settings) == 2
    err = capsys.readouterr().err
    setting = flag.replace("-", "_").upper()
    assert f"--{flag}: 127.0.0.1:{taken}: cannot listen there" in err, err
    assert f"(setting STREAMDET_{setting})" in err and "would load" not in err


def test_analyze_keeps_a_url_whole(tmp_path: Path) -> None:
    """A Path folded "http://host/x.mp4" into "http:/host/x.mp4" (job.json, stdout)."""
    from server.analyze_cli import add_analyze_args

    parser = argparse.ArgumentParser()
    add_analyze_args(parser)
    assert parser.parse_args(["http://host/x.mp4"]).video == "http://host/x.mp4"
    assert parser.parse_args([str(CAR_CLIP)]).video == str(CAR_CLIP)


def test_analyze_that_fails_leaves_no_folder_it_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from server.analyze_cli import run_analyze

    missing = str(tmp_path / "gone.onnx")
    monkeypatch.chdir(tmp_path)
    args = argparse.Namespace(video=str(CAR_CLIP), settings="{}", out=None)
    assert run_analyze(Settings(model=missing, cache_dir=CACHE_DIR), args) == 2
    assert "gone.onnx: file not found" in capsys.readouterr().err
    assert not (tmp_path / f"{CAR_CLIP.name}.streamdet").exists()
    nested = tmp_path / "new" / "results"
    args = argparse.Namespace(video=str(CAR_CLIP), settings="{}", out=nested)
    assert run_analyze(Settings(model=missing, cache_dir=CACHE_DIR), args) == 2
    assert not (tmp_path / "new").exists()
    # A folder that was there before stays, even empty.
    kept = tmp_path / "kept"
    kept.mkdir()
    args = argparse.Namespace(video=str(CAR_CLIP), settings="{}", out=kept)
    assert run_analyze(Settings(model=missing, cache_dir=CACHE_DIR), args) == 2
    assert kept.is_dir()


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("cams.example.com/streamdet", "is not an http:// or https:// URL with a host"),
        ("ftp://cams.example.com", "is not an http:// or https:// URL with a host"),
        ("https:///streamdet", "is not an http:// or https:// URL with a host"),
        ("https://cams.example.com/streamdet?x=1", "has a query or a fragment"),
        ("https://cams.example.com/streamdet#top", "has a query or a fragment"),
        ("https://me:secret@cams.example.com", "credentials in it"),
        ("https://cams.example.com:99999", "Port out of range"),
    ],
)
def test_a_public_url_that_is_no_base_url_is_refused_naming_the_setting(
    value: str, why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["serve", "--public-url", value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("streamdet: --public-url: ") and why in err, err
    assert "(setting STREAMDET_PUBLIC_URL)" in err and "Traceback" not in err
    assert "secret" not in err  # a password given in it is not printed back


@pytest.mark.parametrize(
    ("flags", "why"),
    [
        # Each was taken without a word: the CPU engine ran, no proxy was trusted, no CORS
        # header was sent, a key meant to be read-only kept full access.
        (["--device", "cuda:0"], "device 'cuda:0' is for the GPU backends"),
        (["--forwarded-allow-ips", "127.0.0.1/8"], "has host bits set"),
        (["--forwarded-allow-ips", "127.0.0.1;10.0.0.1"], "does not appear to be an IPv4"),
        (["--cors-origins", "https://app.example.com/"], "is not an origin"),
        (["--api-keys", "k1,k2", "--api-keys-readonly", "k2"], "1 key(s) in both"),
        (["--forwarded-allow-ips", "10.0.0.1, *"], "* trusts every proxy only on its own"),
    ],
)
def test_settings_that_would_silently_do_nothing_are_refused_naming_them(
    flags: list[str], why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["serve", *flags]) == 2
    err = capsys.readouterr().err
    assert why in err and "(setting STREAMDET_" in err and "Traceback" not in err, err
    assert "k2" not in err  # keys are not printed back
    taken = Settings(forwarded_allow_ips="127.0.0.0/8, ::1,", cors_origins="https://a.example:8443")
    assert taken.cors_origins == ["https://a.example:8443"]


def test_a_public_url_loses_its_final_slash_and_empty_is_unset() -> None:
    assert Settings(public_url="https://cams.example.com/streamdet/").public_url == (
        "https://cams.example.com/streamdet"
    )
    assert Settings(public_url="http://10.0.0.5:8000").public_url == "http://10.0.0.5:8000"
    assert Settings(public_url=" ").public_url is None  # a compose file's KEY=
    assert Settings().public_url is None


@pytest.mark.usefixtures("no_model")
@pytest.mark.parametrize(
    ("public_url", "warned"),
    [
        ("https://cams.example.com/streamdet", False),
        ("https://cams.example.com/site/streamdet", False),  # an outer proxy's prefix too
        ("https://cams.example.com/other", True),
        ("https://cams.example.com", True),
    ],
)
def test_a_public_url_that_disagrees_with_the_root_path_is_warned_of(
    public_url: str, warned: bool, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = Settings(
        data_dir=tmp_path / "data", port=0, root_path="/streamdet", public_url=public_url
    )
    with caplog.at_level(logging.WARNING, logger="streamdet"):
        assert cli.serve(settings) == 2  # stopped where the model would load
    said = "does not end with root_path '/streamdet'" in caplog.text
    assert said == warned, caplog.text
    if warned:
        assert "STREAMDET_PUBLIC_URL" in caplog.text and "STREAMDET_ROOT_PATH" in caplog.text


def test_a_streams_files_unknown_class_stops_the_start_without_a_traceback(
    tmp_path: Path,
) -> None:
    """Class names need the model: an unknown one failed the app's start in its lifespan,
    uvicorn printing a traceback (exit 3). Checked once the model has loaded, before the
    port is bound: a line naming the stream and the class, exit 2."""
    path = tmp_path / "streams.yaml"
    entry = {"id": "door", "url": "rtsp://camera/1", "classes": ["person", "unicorn"]}
    path.write_text(yaml.safe_dump({"streams": [entry]}))
    done = run_cli(
        "serve",
        "--model",
        str(MODEL_PT),
        "--cache-dir",
        str(CACHE_DIR),
        "--streams-file",
        str(path),
        "--data-dir",
        str(tmp_path / "data"),
        "--port",
        str(free_port()),
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    said = [line for line in done.stderr.splitlines() if line.startswith("streamdet:")]
    assert len(said) == 1 and f"--streams-file: {path}: stream 'door': " in said[0], said
    assert "unicorn" in said[0] and "STREAMDET_STREAMS_FILE" in said[0], said


@pytest.mark.parametrize(
    "args",
    [
        ["bench", "--frames", "0"],  # it ran one frame a clip
        ["bench", "--clients", "-3"],
        ["bench", "--seconds", "nan"],
        # out of range: a report skipped unsaid, a bar no run could pass, no load at all
        ["export", "--model", "m.pt", "--eval-frames", "-5"],
        ["export", "--model", "m.pt", "--min-score", "2"],
        ["evaluate", "--model", "m.onnx", "--reference", "m.pt", "--eval-sets", "0"],
        ["export", "--model", "m.pt", "--threads", "-2"],
        ["loadtest", "--users", "-1"],
        ["analyze", "clip.mp4", "--port", "99999"],  # a server's setting: no such flag here
        ["analyze", "clip.mp4", "--streams-file", "/nonexistent.yaml"],  # was ignored: exit 0
    ],
)
def test_a_commands_flags_are_its_own_and_checked(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as done:
        cli.main(args)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "give a number" in err or "unrecognized arguments" in err, err


def test_analyze_and_bench_ignore_the_variables_of_settings_they_do_not_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A server's environment (STREAMDET_PORT=99999, STREAMDET_DECODE=cuda) refused
    ``analyze`` with "--port: ..." and "--decode", flags it has not; the variables of the
    settings it uses still count, and the environment is left as it was."""
    monkeypatch.setenv("STREAMDET_PORT", "99999")
    monkeypatch.setenv("STREAMDET_DECODE", "cuda")
    monkeypatch.setenv("STREAMDET_IMGSZ", "320")
    unused = frozenset(Settings.model_fields) - cli.ANALYZED
    settings = cli.settings_from_args(argparse.Namespace(), unused)
    assert settings.imgsz == 320 and settings.port == 8000 and settings.decode == "cpu"
    assert os.environ["STREAMDET_PORT"] == "99999" and os.environ["STREAMDET_DECODE"] == "cuda"
    missing = str(tmp_path / "gone.onnx")
    assert cli.main(["analyze", str(CAR_CLIP), "--model", missing]) == 2
    err = capsys.readouterr().err
    assert "gone.onnx: file not found" in err and "--port" not in err, err
    with pytest.raises(ValidationError, match="port"):  # serve uses it: refused there
        cli.settings_from_args(argparse.Namespace())


def test_the_port_answers_the_probes_while_the_model_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The port was bound only once the model had loaded: /healthz and /readyz refused
    connections for as long (a liveness probe killed the pod mid-load, Prometheus' up was 0
    and StreamdetNotReady could never fire). It is bound first and answers the probes as the
    app will: alive, not ready, streamdet_ready 0, anything else 503 saying why."""
    import socket

    import httpx
    import tritonclient.grpc as triton_grpc
    from tritonclient.utils import InferenceServerException

    port, grpc_port = free_port(), free_port()
    seen: dict[str, httpx.Response] = {}
    over_grpc: dict[str, Any] = {}

    def grpc_calls() -> None:
        """gRPC's port while the model loads: it refused connections (a probe killed the
        server mid-load); live, not ready, the rest UNAVAILABLE saying why, keys asked."""
        client = triton_grpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        keyed = {"authorization": "Bearer k1"}
        try:
            over_grpc["live"] = client.is_server_live(headers=keyed)
            over_grpc["ready"] = client.is_server_ready(headers=keyed)
            over_grpc["model ready"] = client.is_model_ready("yolov8n", headers=keyed)
            for name, call in (
                ("metadata", lambda: client.get_model_metadata("yolov8n", headers=keyed)),
                ("no key", client.is_server_live),
            ):
                try:
                    call()
                except InferenceServerException as exc:
                    over_grpc[name] = (exc.status(), exc.message())
        finally:
            client.close()

    def build_pool(settings: Settings) -> Any:
        grpc_calls()
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:
            for path in ("/healthz", "/readyz", "/metrics", "/model", "/v2/models/yolov8n"):
                seen[path] = c.get(path)
            seen["POST /detect"] = c.post("/detect", content=b"x" * 4_000_000)  # a body, read
            seen["/v2/health/live"] = c.get("/v2/health/live")
            seen["token /metrics"] = c.get("/metrics", params={"access_token": "k1"})
            seen["keyed /metrics"] = c.get("/metrics", headers={"Authorization": "Bearer k1"})
        raise EngineError("the test's: no model")

    monkeypatch.setattr("server.runtime.build_pool", build_pool)
    settings = Settings(
        model=str(MODEL_PT),
        cache_dir=CACHE_DIR,
        data_dir=tmp_path / "data",
        port=port,
        grpc_port=grpc_port,
        root_path="/base",
        api_keys=["k1"],
    )
    before = sys.getswitchinterval()
    try:
        assert cli.serve(settings) == 2  # the model failed: exit 2, the port let go
    finally:
        sys.setswitchinterval(before)
    assert seen["/healthz"].status_code == 200
    assert seen["/healthz"].json() == {"status": "ok", "model": "loading"}
    assert seen["/v2/health/live"].status_code == 200  # KServe's liveness, as the app's
    v2 = seen["/v2/models/yolov8n"]  # KServe's errors are {"error"}: tritonclient reads it
    assert v2.status_code == 503 and "the model is loading" in v2.json()["error"], v2.text
    assert over_grpc["live"] is True
    assert over_grpc["ready"] is False and over_grpc["model ready"] is False
    status, message = over_grpc["metadata"]
    assert status == "StatusCode.UNAVAILABLE" and "the model is loading" in message
    assert over_grpc["no key"][0] == "StatusCode.UNAUTHENTICATED", over_grpc
    for path in ("/readyz", "/model", "POST /detect"):
        answer = seen[path]
        assert answer.status_code == 503 and answer.headers["Retry-After"] == "5", path
        assert "the model is loading" in answer.json()["detail"], path
    assert seen["/metrics"].status_code == 401  # keys set: a key to read it
    # the challenge as the app's (RFC 6750: no error code where no key came)
    assert seen["/metrics"].headers["WWW-Authenticate"] == 'Bearer realm="streamdet"'
    assert seen["token /metrics"].status_code == 401  # as a bearer token, as the app takes it
    assert seen["keyed /metrics"].status_code == 200
    assert "streamdet_ready 0.0" in seen["keyed /metrics"].text
    for freed in (port, grpc_port):  # let go: free for the next server (as uvicorn binds)
        with socket.socket() as again:
            again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            again.bind(("127.0.0.1", freed))


def test_a_start_that_fails_after_the_streams_started_stops_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A start that failed after the streams and webhooks had started (a jobs folder root
    made, the server run as another user) left their threads running: the process never
    exited, its port open and unanswered, its camera still decoded and recorded. What had
    started is stopped, and the error goes on to uvicorn (exit 3)."""
    import threading

    from fastapi.testclient import TestClient

    from server.jobs import JobManager
    from tests.helpers import file_stream_app

    async def refused(self: JobManager) -> None:
        raise PermissionError(13, "Permission denied", str(self.directory))

    monkeypatch.setattr(JobManager, "start", refused)
    before = set(threading.enumerate())
    path = tmp_path / "streams.yaml"
    entry = {"id": "road", "url": f"file://{CAR_CLIP}", "loop": True}
    path.write_text(yaml.safe_dump({"streams": [entry]}))
    app = file_stream_app(
        tmp_path, streams_file=path, webhooks=[f"http://127.0.0.1:{free_port()}/hook"]
    )
    with pytest.raises(PermissionError), TestClient(app):
        pass
    deadline = time.monotonic() + 10
    while (left := set(threading.enumerate()) - before) and time.monotonic() < deadline:
        time.sleep(0.1)
    # The stream's decode thread, the engine's workers and the event store's writer went on.
    assert not left, left


def test_bench_names_a_video_or_model_it_cannot_read_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A missing or unreadable video, or a missing model (found only after the frames were
    sampled), ended in a traceback and exit 1."""
    text = tmp_path / "notes.mp4"
    text.write_text("not a video")
    for args, said in (
        (["--videos", str(tmp_path / "gone.mp4")], "--videos"),
        (["--videos", str(text)], f"--videos: {text}: not a video FFmpeg can read"),
        (["--model", str(tmp_path / "gone.pt"), "--videos", str(text)], "file not found"),
    ):
        code = cli.main(["bench", "--cache-dir", str(CACHE_DIR), "--model", str(MODEL_PT), *args])
        err = capsys.readouterr().err
        assert code == 2 and said in err and "Traceback" not in err, (args, err)


@pytest.mark.parametrize(
    "args",
    [
        ["export", "--precision", "fp16", "--eval", "{text}", "--eval-frames", "2"],
        ["export", "--precision", "int8", "--target", "cpu", "--calib", "{text}"],
        ["evaluate", "--reference", str(MODEL_PT), "--frames", "{text}", "--eval-frames", "2"],
    ],
)
def test_export_and_evaluate_name_a_frame_source_ffmpeg_cannot_read(
    args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before the export (whose ONNX was written first), not a traceback after it."""
    text = tmp_path / "notes.mp4"
    text.write_text("not a video")
    out = tmp_path / "out.onnx"
    model = ["--model", str(MODEL_PT), "--out", str(out), "--cache-dir", str(CACHE_DIR)]
    if args[0] == "evaluate":
        model = ["--model", str(tmp_path / "m.onnx")]
    code = cli.main([*(a.replace("{text}", str(text)) for a in args), *model])
    err = capsys.readouterr().err
    assert code == 2 and f"{text}: not a video FFmpeg can read" in err, err
    assert "Traceback" not in err and not out.exists(), err


def test_a_second_server_on_a_data_dir_in_use_is_refused_naming_it(tmp_path: Path) -> None:
    """Two servers on one data dir opened the same cameras, sent each event to the webhooks
    twice under two ids, and interleaved their event logs. The second is refused at once."""
    data = tmp_path / "data"
    first = DataDirLock(data)
    assert first.acquire() is None
    try:
        done = run_cli("serve", "--data-dir", str(data), "--port", str(free_port()))
        assert done.returncode == 2, done.stderr
        said = done.stderr.strip().splitlines()[-1]
        assert f"--data-dir: {data}: in use by another streamdet server (pid {os.getpid()})" in said
        assert "STREAMDET_DATA_DIR" in said
    finally:
        first.release()
    again = DataDirLock(data)  # let go: the next server takes it
    assert again.acquire() is None
    again.release()


def test_a_damaged_store_in_the_data_dir_is_named_before_the_model_loads(
    tmp_path: Path,
) -> None:
    """A database that was not one, or a file where a folder goes, failed the start with a
    traceback naming neither the file nor the setting (exit 3, after the model loaded)."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "streams.sqlite3").write_bytes(os.urandom(4096))
    (data / "webhooks.sqlite3").mkdir()
    (data / "snapshots").write_text("in the way")
    (data / "jobs").write_text("in the way")  # (the start failed after the streams started)
    done = run_cli("serve", "--data-dir", str(data), "--port", str(free_port()))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    said = [line for line in done.stderr.splitlines() if line.startswith("streamdet:")]
    assert len(said) == 4, said
    assert f"--data-dir: {data / 'jobs'}: not a folder; move it aside" in said[0]
    assert f"--data-dir: {data / 'snapshots'}: not a folder; move it aside" in said[1]
    assert f"{data / 'streams.sqlite3'}: not a database SQLite can read" in said[2]
    assert f"{data / 'webhooks.sqlite3'}: not a file" in said[3]
    assert all("STREAMDET_DATA_DIR" in line for line in said), said


def test_another_programs_database_in_the_data_dir_is_named_before_the_model_loads(
    tmp_path: Path,
) -> None:
    """A database SQLite reads but not streamdet's (a file of the same name from another
    program, a table damaged by hand) failed the start after the model loaded, with a
    traceback ("no such column: id", exit 3). An older release's file (a column later
    releases add missing) still starts."""
    data = tmp_path / "data"
    data.mkdir()
    with closing(sqlite3.connect(data / "events.sqlite3")) as db, db:
        db.execute("CREATE TABLE events (ts REAL, what TEXT)")
    done = run_cli("serve", "--data-dir", str(data), "--port", str(free_port()))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    said = [line for line in done.stderr.splitlines() if line.startswith("streamdet:")]
    assert len(said) == 1, said
    assert f"{data / 'events.sqlite3'}: not streamdet's (table events has no body, id)" in said[0]
    assert "STREAMDET_DATA_DIR" in said[0]
    (data / "events.sqlite3").unlink()
    with closing(sqlite3.connect(data / "streams.sqlite3")) as db, db:  # the first release's
        db.execute(
            "CREATE TABLE streams (id TEXT PRIMARY KEY, url TEXT NOT NULL, name TEXT NOT NULL"
            " DEFAULT '', max_fps REAL, transport TEXT NOT NULL DEFAULT 'tcp', loop INTEGER NOT"
            " NULL DEFAULT 1, created_at REAL NOT NULL)"
        )
    assert data_dir_problems(data) == []


def test_a_bad_setting_from_the_environment_is_named_as_the_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """STREAMDET_PORT=abc was told as "--port: ...", a flag its user never typed."""
    monkeypatch.setenv("STREAMDET_PORT", "abc")
    assert cli.main(["serve", "--model", str(MODEL_PT)]) == 2
    assert "streamdet: STREAMDET_PORT='abc' (--port): " in capsys.readouterr().err
    assert cli.main(["serve", "--model", str(MODEL_PT), "--port", "x"]) == 2  # the flag's own
    assert "streamdet: --port: " in capsys.readouterr().err


def test_export_and_evaluate_take_the_cache_dir_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``serve``, ``bench`` and ``analyze`` took STREAMDET_CACHE_DIR; ``export`` and
    ``evaluate`` exported the .pt again under ~/.cache/streamdet."""
    from server.export_cli import _default_cache_dir

    monkeypatch.setenv("STREAMDET_CACHE_DIR", str(CACHE_DIR))
    assert _default_cache_dir() == CACHE_DIR
    monkeypatch.delenv("STREAMDET_CACHE_DIR")
    assert _default_cache_dir() == Settings.model_fields["cache_dir"].default_factory()  # type: ignore[call-arg,misc]


def test_an_allowed_file_dir_that_is_no_folder_is_warned_of(tmp_path: Path) -> None:
    """It started without a word, every file:// stream refused later."""
    done = run_cli(
        "serve",
        "--allowed-file-dir",
        str(tmp_path / "videos"),
        "--data-dir",
        str(tmp_path / "data"),
        "--model",
        str(tmp_path / "gone.pt"),  # ends the start once the settings are checked
    )
    assert done.returncode == 2, done.stderr
    assert f"--allowed-file-dir: {tmp_path / 'videos'} is not a folder (yet)" in done.stderr


def test_a_device_that_is_no_torch_device_is_refused_before_the_model_loads(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--device gpu was refused after the model's export and the workers' start, without the
    flag's name."""
    assert cli.main(["serve", "--backend", "torch", "--device", "gpu", "--model", "x.pt"]) == 2
    assert "streamdet: --device: 'gpu': give cpu, cuda or cuda:N" in capsys.readouterr().err
    assert Settings(backend="torch", device="cuda:1").device == "cuda:1"


def test_the_data_dirs_lock_holds_when_its_pid_file_is_deleted(tmp_path: Path) -> None:
    """The lock was on server.lock: deleted (it stays on disk after every exit), the next
    server made another, took it, and opened the running server's cameras."""
    data = tmp_path / "data"
    first = DataDirLock(data)
    assert first.acquire() is None
    try:
        (data / DataDirLock.NAME).unlink()
        assert DataDirLock(data).acquire() == "its lock is held"
    finally:
        first.release()
