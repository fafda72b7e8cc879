"""The GPU check's harness, run on the CPU: ``gpu_bench prepare`` then ``gpu_bench run --device
cpu`` on the shared model and clips, so the one script a device session runs cannot rot
unnoticed between the sessions that have a GPU (few: one so far, 2026-12-01).

The figures themselves mean nothing here (FP32 on two cores); what is checked is that every
key the GPU report promises is there, that JSON holds no NaN, that the torch engine's boxes
match the CPU engine's stored ones, and that the pool answered every frame it took.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import gpu_bench, make_clip
from tests.helpers import CACHE_DIR, MODEL_PT, VIDEOS

REPORT_KEYS = {
    "gpu",
    "engine",
    "precision",
    "engine_img_s",
    "e2e_img_s",
    "e2e_over_engine",
    "gpu_busy_pct",
    "boxes_match_cpu",
    "streams",
    "frame_latency_p99_ms",
}


def test_gpu_check_harness_runs_end_to_end_on_the_cpu(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "models").mkdir(parents=True)
    (data / "videos").mkdir()
    (data / "models" / MODEL_PT.name).symlink_to(MODEL_PT)
    for clip in VIDEOS:
        (data / "videos" / clip.name).symlink_to(clip)
    camera = data / gpu_bench.CAMERA_CLIP  # as gpu_check.sh prepare makes it, shorter
    camera.parent.mkdir()
    assert make_clip.main(["--out", str(camera), "--frames", "12"]) == 0
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    (data / "cache").symlink_to(CACHE_DIR)  # reuse the suite's ONNX export
    assert gpu_bench.main(["prepare", "--data", str(data)]) == 0
    reference = json.loads((data / "cpu_reference.json").read_text())
    assert len(reference) == 1 + gpu_bench.FRAMES_PER_CLIP * len(VIDEOS)
    assert any(r["boxes"] for r in reference)

    out = tmp_path / "out"
    argv = ["run", "--data", str(data), "--out-dir", str(out), "--device", "cpu"]
    argv += ["--streams", "2", "--fps", "4", "--seconds", "2", "--engine-seconds", "0.2"]
    argv += ["--max-batch", "2", "--workers", "1", "--decode-seconds", "0.5"]
    argv += ["--decode-processes", "1", "2"]
    assert gpu_bench.main(argv) == 0

    (written,) = out.glob("*-cpu-gpu.json")
    report = json.loads(written.read_text(), parse_constant=lambda c: c)  # NaN would stay a str
    assert not REPORT_KEYS - report.keys(), REPORT_KEYS - report.keys()
    assert report["boxes_match_cpu"] is True, report["parity_problems"]
    assert report["parity_same_decoded_pixels"] is True
    assert set(report["engine_infer_img_s"]) == {"1", "2"}
    stages = report["engine_stage_ms"]  # where a batch's time goes, for the next GPU run
    assert set(stages) == {
        "upload",
        "upload_host_copy",
        "upload_host_copy_1_thread",
        "letterbox",
        "model",
        "rest",
        "infer",
    }
    assert stages["upload_host_copy"] > 0 and stages["upload_host_copy_1_thread"] > 0
    assert report["copy_threads"] >= 1
    assert stages["infer"] > 0 and stages["model"] > 0 and report["stage_batch"] == 2
    assert report["engine_img_s"] > 0 and report["e2e_img_s"] > 0
    assert report["errors"] == 0 and report["pool_batches"] > 0
    assert report["gpu_busy_pct"] is None and "NVML unavailable" in report["gpu_busy_note"]
    assert isinstance(report["frame_latency_p99_ms"], float)
    assert report["targets_met"]["boxes_match_cpu"] is True
    sweep = report["decode_only_by_setting"]
    assert {"auto", "slice", "one"} <= sweep.keys() and all(v > 0 for v in sweep.values())
    assert report["decode_threads"] in sweep and report["switch_interval_ms"] in (1.0, 5.0)
    assert set(report["e2e_img_s_by_switch_ms"]) == {"5", "1"}
    # The server's way too: the streams' readers in decode processes, frames through shared
    # memory; the faster way is the reported e2e (and its paced run the latency).
    by_count = report["decode_only_fps_by_processes"]
    assert set(by_count) == {"1", "2"} and all(v > 0 for v in by_count.values())
    assert report["decode_processes"] in (1, 2)
    by_decode = report["e2e_img_s_by_decode"]
    assert set(by_decode) == {"threads", "processes"} and by_decode["processes"] > 0
    assert report["e2e_img_s"] == by_decode[report["e2e_decode_in"]]
    # How the workers spent the unpaced runs: the CPU engine keeps its one worker busy.
    for tally in report["pool_by_decode"].values():
        assert 0 < tally["worker_busy_pct"] <= 100 and 1 <= tally["mean_batch"] <= 2
        assert tally["batch_ms"] > 0
    assert (
        report["worker_busy_pct"]
        == report["pool_by_decode"][report["e2e_decode_in"]]["worker_busy_pct"]
    )
    # Last, 1080p cameras through decode processes, decoded at the engine's size and whole.
    assert report["camera_clip"] == "1920x1080"
    by_size = report["camera_e2e_img_s_by_decode_size"]
    assert set(by_size) == {"engine_size", "whole"} and all(v > 0 for v in by_size.values())
    assert set(report["camera_pool_by_decode_size"]) == {"engine_size", "whole"}
    # The ratio at the same batch size: engine-only at the batch nearest e2e's mean.
    assert (
        report["e2e_mean_batch"] == report["pool_by_decode"][report["e2e_decode_in"]]["mean_batch"]
    )
    ((batch, rate),) = report["engine_img_s_at_e2e_batch"].items()
    assert rate == report["engine_infer_img_s"][batch]
    assert report["e2e_over_engine_at_e2e_batch"] == pytest.approx(
        report["e2e_img_s"] / rate, abs=0.002
    )
    # Whether each worker ran on CUDA graphs (none on the CPU): a failed capture shows here.
    assert report["graphs_captured_by_worker"] == [{"captured": 0, "use_graphs": False}]


def test_gpu_busy_is_the_mean_of_the_samples_inside_the_measured_window() -> None:
    """Processes starting, streams going live and the shutdown see an idle GPU around the
    measured window: its samples alone make the busy share."""
    busy = gpu_bench.BusySampler()
    busy.samples = [(0.5, 0), (1.0, 80), (1.5, 100), (2.0, 90), (2.5, 0)]
    assert busy.mean == 54.0
    busy.window = (1.0, 2.0)
    assert busy.measured == [80, 100, 90] and busy.mean == 90.0
    busy.window = (3.0, 4.0)
    assert busy.mean is None
