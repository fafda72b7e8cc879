"""What a caller sends the server, as an attacker holding a valid key would send it: names
that reach the log, images crafted to cost far more than their bytes, URLs reaching past
what is allowed. Against the real app on the real model; no timing is asserted."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.helpers import CAR_CLIP, file_stream_app

FORGED = "door\n2026-12-02 10:00:00,000 CRITICAL server.auth: admin in"


def test_a_name_or_label_with_a_newline_is_refused_and_forges_no_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An outside event's label went into the log as it came: a newline in it wrote a line
    of the caller's own, as the server's."""
    caplog.set_level(logging.INFO)
    with TestClient(file_stream_app(tmp_path)) as c:
        sid = c.post("/streams", json={"url": f"file://{CAR_CLIP}", "max_fps": 1}).json()["id"]
        for label in (FORGED, "door\rbell", "bell\x1b[2J", "a\x00b", "x\u0085y"):
            refused = c.post(f"/streams/{sid}/events", json={"label": label})
            assert refused.status_code == 422, refused.text
            assert "label" in refused.text and "control characters" in refused.text
        job = c.post("/jobs", json={"url": f"file://{CAR_CLIP}", "name": FORGED})
        assert job.status_code == 422 and "control characters" in job.text, job.text
        assert "CRITICAL" not in caplog.text
        # A label of any other text goes through as it was.
        made = c.post(f"/streams/{sid}/events", json={"label": "Türklingel 🔔 pressed"})
        assert made.status_code == 201 and made.json()["label"] == "Türklingel 🔔 pressed"


def test_a_video_of_frames_over_the_pixel_limit_is_refused_when_sent(tmp_path: Path) -> None:
    """It was queued (202) and failed at its first frame; its size is known from the probe."""
    with TestClient(file_stream_app(tmp_path, max_image_pixels=200_000)) as c:
        by_url = c.post("/jobs", json={"url": f"file://{CAR_CLIP}"})  # 768x432
        uploaded = c.post(
            "/jobs", content=CAR_CLIP.read_bytes(), headers={"content-type": "video/mp4"}
        )
        for refused in (by_url, uploaded):
            assert refused.status_code == 413, refused.text
            assert "768x432 = 0.3 MP, over the limit of 0.2 MP" in refused.text
            assert "STREAMDET_MAX_IMAGE_PIXELS" in refused.text
        assert c.get("/jobs").json()["jobs"] == []
        assert not any((tmp_path / "data" / "jobs").glob("*/source*"))  # nothing kept


def test_a_jobs_json_body_is_capped_as_a_settings_body_is(tmp_path: Path) -> None:
    """``POST /jobs`` as JSON was read whole, however large (300 MB: 1.2 GB of memory)."""

    def body(megabytes: int) -> Iterator[bytes]:
        yield b'{"url": "file:///x.mp4", "name": "'
        for _ in range(megabytes):
            yield b"a" * (1 << 20)
        yield b'"}'

    with TestClient(file_stream_app(tmp_path)) as c:
        json_type = {"content-type": "application/json"}
        for sent in (body(8), b"".join(body(8))):  # chunked, and with its length declared
            refused = c.post("/jobs", content=sent, headers=json_type)
            assert refused.status_code == 413, refused.text[:300]
            assert "larger than 1024 kB" in refused.text and "multipart" in refused.text
        fits = c.post("/jobs", json={"url": f"file://{CAR_CLIP}", "name": "a" * 200})
        assert fits.status_code == 202, fits.text
