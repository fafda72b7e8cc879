"""``benchmarks.decode_size_bench`` on a short run: real frames converted, letterboxed and
staged whole and at the engine's size."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import decode_size_bench


def test_decode_size_bench_measures_both_sizes(tmp_path: Path) -> None:
    out = tmp_path / "decode-size.json"
    argv = ["--sizes", "1920x1080", "--frames", "4", "--batch", "4", "--repeats", "1"]
    assert decode_size_bench.main([*argv, "--out", str(out)]) == 0
    [result] = json.loads(out.read_text())["sizes"]
    assert (result["camera"], result["decoded_at"]) == ("1920x1080", "640x360")
    whole, small = result["whole"], result["decoded"]
    assert (whole["frame_mb"], small["frame_mb"]) == (6.22, 0.69)
    for figures in (whole, small):
        assert figures["convert_ms"] > 0 and figures["letterbox_ms"] > 0
        assert figures["stage_ms"] is None or figures["stage_ms"] > 0
        assert figures["upload_decode_ms"] > 0
    assert result["upload_kb"] > 0 and result["upload_decoded_at"] == "960x540"
