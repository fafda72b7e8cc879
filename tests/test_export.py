"""Export: FP32 / FP16 / INT8 (ModelOpt Q/DQ) artifacts with metadata, calibration frames,
the accuracy report, and an INT8 artifact served through /detect.

Kept lean for CI on 2 cores: one INT8 export (16 calibration frames at imgsz 320, 4 fine-tuning
steps) shared by the module; the full accuracy bar (256 frames, imgsz 640, >= 0.95 vs FP32) is the
``streamdet export`` command quoted in engines/export.py's docstring, not a test.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from fastapi.testclient import TestClient

from engines.calibration import (
    CalibrationError,
    FrameReader,
    even_indices,
    input_shape,
    parse_sources,
    sample_frames,
    share,
)
from engines.evaluate import (
    ClassStats,
    EvalReport,
    calibration_indices,
    class_swaps,
    evaluate,
    held_out_sets,
    match,
)
from engines.export import (
    YOLO_HEAD,
    ExportError,
    ExportRequest,
    ExportResult,
    export_model,
    head_patterns,
)
from engines.model import read_model_info
from engines.onnxruntime import OrtEngine
from engines.registry import EngineConfig
from engines.types import Detections, DetectParams, EngineError
from server.app import create_app
from server.cli import main
from server.export_cli import EXIT_BELOW_BAR
from server.settings import Settings
from streams.files import encode_jpeg, sample_video_frames
from tests.helpers import CACHE_DIR, CAR_CLIP, MODEL_PT, VIDEOS, ultralytics_assets

IMGSZ = 320
CALIB_FRAMES = 16
FINETUNE_STEPS = 4


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("export")


@pytest.fixture(scope="module")
def int8(out_dir: Path) -> ExportResult:
    request = ExportRequest(
        model=str(MODEL_PT),
        out=out_dir / "yolov8n-int8.onnx",
        precision="int8",
        imgsz=IMGSZ,
        calib=tuple(str(v) for v in VIDEOS),
        calib_frames=CALIB_FRAMES,
        finetune_steps=FINETUNE_STEPS,
        cache_dir=CACHE_DIR,
        progress=False,
    )
    return export_model(request)


def ort_engine(path: Path) -> OrtEngine:
    config = EngineConfig(model=read_model_info(path), imgsz=IMGSZ, max_batch=1, threads=2)
    engine = OrtEngine(config)
    engine.load()
    return engine


def test_onnxruntime_is_still_the_cpu_build() -> None:
    """The export extra installs ModelOpt without its [onnx] extra, which would pull
    onnxruntime-gpu and replace the CPU onnxruntime module (see pyproject.toml)."""

    assert ort.get_device() == "CPU"
    assert importlib.metadata.version("onnxruntime") == ort.__version__
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("onnxruntime-gpu")
    assert "CUDAExecutionProvider" not in ort.get_available_providers()
    # ...and the quantizer it needs is importable alongside it.
    import modelopt.onnx.autocast
    import modelopt.onnx.quantization

    assert callable(modelopt.onnx.quantization.quantize)
    assert callable(modelopt.onnx.autocast.convert_to_f16)


def test_int8_artifact_is_explicit_qdq_with_metadata(int8: ExportResult) -> None:
    info = read_model_info(int8.path)
    assert info.precision == "int8"
    assert info.imgsz == (IMGSZ, IMGSZ) and info.stride == 32 and info.names[0] == "person"
    assert len(info.names) == 80
    assert info.dynamic_hw, "the dynamic H/W axes must survive quantization (rect letterbox)"
    model = onnx.load(str(int8.path), load_external_data=False)
    ops = Counter(n.op_type for n in model.graph.node)
    assert ops["QuantizeLinear"] > 50 and ops["DequantizeLinear"] >= ops["QuantizeLinear"]
    batch = model.graph.input[0].type.tensor_type.shape.dim[0]
    assert batch.dim_param and not batch.dim_value, "batch axis must stay dynamic"
    assert model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    calib = json.loads(info.extra["streamdet_calibration"])
    assert calib["frames"] == CALIB_FRAMES and calib["method"] == "max"
    # Both clips letterbox to 192x320 at imgsz 320 (16:9), so calibration ran at that shape.
    assert calib["shape"] == [192, 320]
    assert {s["name"] for s in calib["sources"]} == {v.name for v in VIDEOS}
    assert sum(len(s["indices"]) for s in calib["sources"]) == CALIB_FRAMES
    assert info.extra["streamdet_target"] == "tensorrt"
    assert info.extra["streamdet_quantizer"].startswith("modelopt ")


def test_int8_serves_through_detect(int8: ExportResult) -> None:
    bus = (ultralytics_assets() / "bus.jpg").read_bytes()
    settings = Settings(model=str(int8.path), cache_dir=CACHE_DIR, imgsz=IMGSZ)
    with TestClient(create_app(settings)) as client:
        assert client.get("/readyz").status_code == 200
        resp = client.post("/detect", files={"image": ("bus.jpg", bus, "image/jpeg")})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["model"] == int8.path.name
    got = Counter(d["class_name"] for d in body["detections"] if d["confidence"] >= 0.5)
    # FP32 at imgsz 320 finds the bus and 4 people with confidence >= 0.5; INT8 keeps them.
    fp32 = ort_engine(int8.reference)
    from streams.files import load_image

    (ref,) = fp32.infer([load_image(ultralytics_assets() / "bus.jpg")], [DetectParams()])
    want = Counter(
        ref.names[int(c)] for c, s in zip(ref.class_ids, ref.scores, strict=True) if s >= 0.5
    )
    assert want["bus"] == 1 and want["person"] >= 3
    assert got["bus"] == 1 and got["person"] >= want["person"] - 1, (got, want)


def test_evaluation_holds_out_calibration_frames(int8: ExportResult) -> None:
    held = calibration_indices(int8.path)
    assert sum(len(v) for v in held.values()) == CALIB_FRAMES
    sample = sample_frames(
        parse_sources([str(v) for v in VIDEOS]),
        8,
        exclude=held,
        purpose="evaluation",
        progress=False,
    )
    for record in sample.sources:
        assert record.indices and not set(record.indices) & set(held[record.name])
    report = evaluate(int8.reference, int8.path, sample.frames, imgsz=IMGSZ, threads=2)
    assert report.frames == 8 and report.total.reference > 0
    # A sanity floor for 16 calibration frames at 320; the 0.95 bar is checked by the command.
    assert report.recall >= 0.8 and report.precision >= 0.8, report.format()
    assert "recall" in report.format() and report.to_json()["overall"]["matched"] > 0


def test_fp16_autocast_keeps_float_io_and_matches_fp32(out_dir: Path) -> None:
    out = out_dir / "yolov8n-fp16.onnx"
    result = export_model(
        ExportRequest(
            model=str(MODEL_PT), out=out, precision="fp16", imgsz=IMGSZ, cache_dir=CACHE_DIR
        )
    )
    info = read_model_info(out)
    assert info.precision == "fp16" and info.names[0] == "person" and info.imgsz == (IMGSZ, IMGSZ)
    model = onnx.load(str(out))
    float16 = onnx.TensorProto.FLOAT16
    assert model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert model.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert sum(t.data_type == float16 for t in model.graph.initializer) > 50
    frame = sample_video_frames(VIDEOS[0], 1, offset=40)
    (a,) = ort_engine(result.reference).infer(frame, [DetectParams()])
    (b,) = ort_engine(out).infer(frame, [DetectParams()])
    stats: dict[int, ClassStats] = {}
    match(a, b, stats)
    assert len(a) > 0
    assert all(c.recall == 1.0 and c.precision == 1.0 for c in stats.values()), stats


def test_fp32_export_from_the_command_line(
    out_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = out_dir / "yolov8n-fp32.onnx"
    argv = ["export", "--model", str(MODEL_PT), "--precision", "fp32", "--imgsz", str(IMGSZ)]
    code = main([*argv, "--out", str(out), "--cache-dir", str(CACHE_DIR)])
    assert code == 0
    assert f"wrote {out}" in capsys.readouterr().out
    info = read_model_info(out)
    assert info.precision == "fp32" and len(info.names) == 80 and info.dynamic_hw
    assert len(info.extra["streamdet_source_sha256"]) == 64


def test_int8_without_calibration_sources_is_refused(out_dir: Path) -> None:
    with pytest.raises(ExportError, match="--calib"):
        export_model(
            ExportRequest(
                model=str(MODEL_PT), out=out_dir / "x.onnx", precision="int8", cache_dir=CACHE_DIR
            )
        )


def test_cli_names_a_missing_calibration_source(
    out_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["export", "--model", str(MODEL_PT), "--precision", "int8", "--imgsz", str(IMGSZ)]
    missing = out_dir / "no-such-clip.mp4"
    code = main(
        [
            *argv,
            "--calib",
            str(missing),
            "--out",
            str(out_dir / "y.onnx"),
            "--cache-dir",
            str(CACHE_DIR),
        ]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "--calib" in err


def test_too_few_frames_says_which_flag(tmp_path: Path) -> None:
    for i, frame in enumerate(sample_video_frames(VIDEOS[0], 3)):
        (tmp_path / f"{i}.jpg").write_bytes(encode_jpeg(frame))
    sources = parse_sources([str(tmp_path)])
    assert sources[0].kind == "images"
    assert len(sample_frames(sources, 3, progress=False).frames) == 3
    with pytest.raises(
        CalibrationError, match=r"needs 5 frames but the sources give only 3.*--calib-frames"
    ):
        sample_frames(sources, 5, progress=False)
    with pytest.raises(CalibrationError, match=r"only 1 .*setting aside 2.*--eval-frames"):
        sample_frames(
            sources, 2, exclude={tmp_path.name: [0, 2]}, purpose="evaluation", progress=False
        )


def test_even_sampling_and_shares() -> None:
    assert even_indices(list(range(10)), 3) == [0, 4, 9]
    assert even_indices([1, 2], 5) == [1, 2]
    assert share(10, [3, None]) == [3, 7]
    assert share(10, [100, 100, 100]) == [4, 3, 3]
    assert share(10, [2, 2]) == [2, 2]


def test_calibration_letterboxes_as_inference_does() -> None:
    frames = sample_video_frames(VIDEOS[0], 2)
    shape = input_shape(frames, 640, 32, dynamic_hw=True)
    assert shape == (384, 640)
    mixed = [*frames, np.zeros((640, 480, 3), np.uint8)]
    assert input_shape(mixed, 640, 32, dynamic_hw=True) == (640, 640)
    assert input_shape(frames, 640, 32, dynamic_hw=False) == (640, 640)
    reader = FrameReader(frames, 640, shape, progress=False)
    first = reader.get_next()
    assert first is not None and first["images"].shape == (1, 3, 384, 640)
    # Same tensor the serving engine builds: grey 114 border, [0, 1] scale.
    assert float(first["images"][0, 0, 0, 0]) == pytest.approx(114 / 255)
    assert reader.get_next() is not None and reader.get_next() is None
    reader.rewind()
    assert reader.get_next() is not None


def test_detections_type_is_what_match_counts() -> None:
    names = {0: "person"}
    box = np.array([[0, 0, 10, 10]], np.float32)
    one = Detections(box, np.array([0.9], np.float32), np.array([0], np.int32), names, 20, 20)
    none = Detections.empty(names, 20, 20)
    stats: dict[int, ClassStats] = {}
    match(one, none, stats)
    match(one, one, stats)
    (entry,) = stats.values()
    assert (entry.reference, entry.candidate, entry.matched) == (2, 1, 1)
    assert entry.recall == 0.5 and entry.precision == 1.0


def test_class_swaps_count_found_boxes_with_a_flipped_top_class() -> None:
    names = {0: "car", 1: "bus", 2: "bottle"}
    boxes = np.array([[0, 0, 10, 10], [50, 50, 60, 60], [100, 0, 120, 30]], np.float32)
    fp32 = Detections(
        boxes, np.array([0.4, 0.3, 0.3], np.float32), np.array([0, 0, 2], np.int32), names, 200, 200
    )
    # Box 0 kept as a car, box 1 now a bus (swap), box 2 lost entirely (a plain miss).
    cand = Detections(
        boxes[:2] + 1, np.array([0.4, 0.3], np.float32), np.array([0, 1], np.int32), names, 200, 200
    )
    assert class_swaps(fp32, cand) == 1
    assert class_swaps(fp32, Detections.empty(names, 200, 200)) == 0
    assert class_swaps(fp32, fp32) == 0


@pytest.fixture(scope="module")
def cpu_int8(int8: ExportResult, out_dir: Path) -> Path:
    """``--target cpu`` (ONNX Runtime's static quantization), exported after the ModelOpt one
    (the int8 fixture) in this process."""
    out = out_dir / "yolov8n-int8-cpu.onnx"
    export_model(
        ExportRequest(
            model=str(MODEL_PT),
            out=out,
            precision="int8",
            target="cpu",
            calib=(str(VIDEOS[0]),),
            calib_frames=8,
            calib_method="max",
            imgsz=IMGSZ,
            # Its int8 weights and int32 biases train as floats and are stored back as integers.
            finetune_steps=1,
            cache_dir=CACHE_DIR,
            progress=False,
        )
    )
    return out


def test_cpu_target_int8_after_modelopt_in_the_same_process(cpu_int8: Path) -> None:
    """ModelOpt patches onnxruntime.quantization in its process; the CPU target quantizes in a
    fresh one, so it works after a ModelOpt export in this process."""
    out = cpu_int8
    info = read_model_info(out)
    tuned = json.loads(info.extra["streamdet_finetune"])
    assert tuned["steps"] == 1 and tuned["learn_scales"]
    assert info.precision == "int8" and info.extra["streamdet_target"] == "cpu"
    assert info.extra["streamdet_quantizer"].startswith("onnxruntime ")
    nodes = onnx.load(str(out)).graph.node
    ops = Counter(n.op_type for n in nodes)
    assert ops["QuantizeLinear"] > 50
    # The convolutions are quantized, the SiLUs stay float (ORT_QUANTIZED_OPS).
    producers = {o: n.op_type for n in nodes for o in n.output}
    quantized = Counter(producers.get(n.input[0]) for n in nodes if n.op_type == "QuantizeLinear")
    assert quantized["Conv"] > 40 and quantized["Sigmoid"] == 0, quantized
    (dets,) = ort_engine(out).infer(sample_video_frames(VIDEOS[0], 1, offset=40), [DetectParams()])
    assert len(dets) > 0


def _torch_and_onnxruntime(
    path: Path, session: ort.InferenceSession, x: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The outputs for ``x`` of the graph at ``path`` run by torch (:class:`QdqGraph`, what
    fine-tuning trains) and by ONNX Runtime's ``session`` of it."""
    import torch

    from engines.finetune import QdqGraph

    with torch.no_grad():
        (got,), _ = QdqGraph(onnx.load(str(path)))(torch.from_numpy(x))
    want: np.ndarray = session.run(None, {"images": x})[0]
    return got.numpy(), want


def _conv_bias_scales(model: onnx.ModelProto) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(Conv name, its int32 bias's scale, its input scale times its weight scale)."""
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    dq = {n.output[0]: n for n in model.graph.node if n.op_type == "DequantizeLinear"}
    found = []
    for n in model.graph.node:
        if n.op_type == "Conv" and len(n.input) > 2 and n.input[2] in dq and n.input[0] in dq:
            x_scale = inits[dq[n.input[0]].input[1]]
            w_scale = inits[dq[n.input[1]].input[1]]
            found.append((n.name, inits[dq[n.input[2]].input[1]], x_scale * w_scale))
    return found


def test_cpu_target_learned_scales_keep_onnxruntime_parity(cpu_int8: Path, out_dir: Path) -> None:
    """ONNX Runtime fuses the CPU graph's DQ -> Conv -> Q into QLinearConv (its whole speed-up)
    only where the int32 bias's scale is the input scale times the weight scale, as QLinearConv
    defines it. Learned activation scales must carry the bias scales along: without that, every
    Conv stayed a float Conv (1 QLinearConv of 56, 62 ms against 35-41 ms at 640x384, still
    correct, so only the fused-kernel count catches it)."""
    import torch

    from engines.finetune import QdqGraph

    model = onnx.load(str(cpu_int8))
    graph = QdqGraph(model)
    assert graph.scales
    with torch.no_grad():
        for i, factor in enumerate(graph.scales.values()):
            factor.fill_(0.05 if i % 2 else -0.05)  # every activation scale x1.05 or /1.05
    graph.write_back(model)
    moved = out_dir / "cpu-scales-moved.onnx"
    onnx.save(model, str(moved))
    convs = _conv_bias_scales(model)
    assert len(convs) > 40
    for name, bias_scale, product in convs:
        np.testing.assert_allclose(bias_scale, product, rtol=1e-5, err_msg=name)

    frames = sample_video_frames(VIDEOS[0], 2, offset=40)
    reader = FrameReader(frames, IMGSZ, input_shape(frames, IMGSZ, 32, True), progress=False)
    x = np.concatenate([reader.tensor(0), reader.tensor(1)])
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    opts.optimized_model_filepath = str(out_dir / "cpu-scales-moved.optimized.onnx")
    session = ort.InferenceSession(str(moved), opts, providers=["CPUExecutionProvider"])
    fused = Counter(n.op_type for n in onnx.load(opts.optimized_model_filepath).graph.node)
    assert fused["QLinearConv"] >= len(convs), fused
    got, want = _torch_and_onnxruntime(moved, session, x)
    off = np.abs(got[:, 4:] - want[:, 4:])
    assert off.mean() < 1e-3 and (off > 0.02).mean() < 1e-3, (off.mean(), (off > 0.02).mean())


def test_yolo_head_stays_float(int8: ExportResult) -> None:
    """The decoded output mixes pixels and scores in one tensor; quantized per tensor, the
    scores would round to 0. The logits, DFL and decode stay float, the 3x3 convs do not."""
    patterns = head_patterns(int8.reference, (YOLO_HEAD,))
    graph = onnx.load(str(int8.reference), load_external_data=False).graph
    kept = {n.name for n in graph.node if any(re.fullmatch(p, n.name) for p in patterns)}
    assert any("/dfl/" in n for n in kept) and any(n.endswith("cv3.0.2/Conv") for n in kept)
    assert not any("cv3.0.0/" in n or "cv2.1.1/" in n for n in kept)
    nodes = onnx.load(str(int8.path)).graph.node
    producers = {o: n.op_type for n in nodes for o in n.output}
    assert producers["output0"] != "DequantizeLinear"
    # The stem (first two convolutions, YOLO_STEM) stays float by default; the third does not.
    convs = {n.name: producers.get(n.input[0]) for n in nodes if n.op_type == "Conv"}
    assert convs["/model.0/conv/Conv"] != "DequantizeLinear"
    assert convs["/model.1/conv/Conv"] != "DequantizeLinear"
    assert convs["/model.2/cv1/conv/Conv"] == "DequantizeLinear"


def test_held_out_sets_are_disjoint_from_calibration_and_each_other() -> None:
    calib = {VIDEOS[0].name: [0, 100, 200], VIDEOS[1].name: [5, 500]}
    sets = held_out_sets([str(v) for v in VIDEOS], 6, 3, calib, progress=False)
    assert [len(s.frames) for s in sets] == [6, 6, 6]
    seen: dict[str, set[int]] = {k: set(v) for k, v in calib.items()}
    for sample in sets:
        for record in sample.sources:
            taken = set(record.indices)
            assert len(taken) == 3 and not taken & seen[record.name], (record, seen)
            seen[record.name] |= taken
    # Set 1 does not depend on how many sets are asked for.
    (first,) = held_out_sets([str(v) for v in VIDEOS], 6, 1, calib, progress=False)
    assert [r.indices for r in first.sources] == [r.indices for r in sets[0].sources]


def _report(index: int, matched: int) -> EvalReport:
    report = EvalReport("fp32.onnx", "int8.onnx", "INT8", 10, 0.25, 2, held_out_set=index)
    report.classes[0] = ClassStats("car", reference=100, candidate=100, matched=matched)
    return report


def test_every_held_out_set_must_pass(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from server.export_cli import _print_report

    args = argparse.Namespace(min_score=0.95, report=tmp_path / "r.json")
    assert _print_report(args, [_report(0, 99), _report(1, 96)]) == 0
    out = capsys.readouterr().out
    assert "held-out set 2" in out and "set 2: recall 0.960" in out and "PASS" in out
    body = json.loads(args.report.read_text())
    assert body["passed"] and [s["held_out_set"] for s in body["sets"]] == [0, 1]
    assert _print_report(args, [_report(0, 99), _report(1, 94), _report(2, 97)]) == EXIT_BELOW_BAR
    assert "below 0.95 on 1 of 3 held-out sets" in capsys.readouterr().err
    assert not json.loads(args.report.read_text())["passed"]


def _calibration_reader(int8: ExportResult) -> FrameReader:
    assert int8.calibration is not None
    frames = int8.calibration.frames
    return FrameReader(frames, IMGSZ, input_shape(frames, IMGSZ, 32, True), progress=False)


def test_int8_export_records_its_fine_tuning(int8: ExportResult) -> None:
    tuned = json.loads(read_model_info(int8.path).extra["streamdet_finetune"])
    assert tuned["steps"] == FINETUNE_STEPS
    # One calibration frame in 8 is held back to judge the fine-tuned weights.
    assert tuned["train_frames"] + tuned["val_frames"] == CALIB_FRAMES and tuned["val_frames"] == 2
    assert tuned["kept"] == (tuned["flips_after"] < tuned["flips_before"])
    assert tuned["logit_err_before"] > 0


def test_qdq_graph_in_torch_computes_what_onnxruntime_does(int8: ExportResult) -> None:
    """Fine-tuning trains the exported graph run by torch; that run must be ONNX Runtime's
    arithmetic (fake quantization with the graph's scales), or training optimises something
    else than what ships."""
    reader = _calibration_reader(int8)
    x = np.concatenate([reader.tensor(0), reader.tensor(9)])
    session = ort.InferenceSession(str(int8.path), providers=["CPUExecutionProvider"])
    got, want = _torch_and_onnxruntime(int8.path, session, x)
    scores_got, scores_want = got[:, 4:], want[:, 4:]
    # Summation order (oneDNN vs MLAS) can put a value on the other side of a rounding step
    # now and then and move one anchor's score; nearly all must agree to float precision.
    off = np.abs(scores_got - scores_want)
    assert off.mean() < 1e-4 and (off > 0.02).mean() < 1e-3, (off.mean(), (off > 0.02).mean())
    found = scores_want.max(axis=1) >= 0.25
    assert found.sum() > 0
    boxes_got, boxes_want = got[:, :4], want[:, :4]
    box_off = np.abs(boxes_got - boxes_want).transpose(0, 2, 1)[found]
    assert (box_off > 1.0).mean() < 0.02, box_off.max()


def test_fine_tuning_that_does_not_help_is_discarded(int8: ExportResult, out_dir: Path) -> None:
    from engines.finetune import FinetuneConfig, finetune

    out = out_dir / "not-tuned.onnx"
    report = finetune(
        int8.path, int8.reference, _calibration_reader(int8), out,
        FinetuneConfig(steps=2, lr=0.0), progress=False,
    )  # fmt: skip
    assert not report.kept and report.flips_after == report.flips_before
    before = {
        i.name: onnx.numpy_helper.to_array(i) for i in onnx.load(str(int8.path)).graph.initializer
    }
    after = {i.name: onnx.numpy_helper.to_array(i) for i in onnx.load(str(out)).graph.initializer}
    assert before.keys() == after.keys()
    assert all(np.array_equal(before[k], after[k]) for k in before)


def test_fine_tuning_refuses_what_it_cannot_simulate(tmp_path: Path) -> None:
    from onnx import TensorProto, helper

    from engines.finetune import FinetuneError, QdqGraph

    graph = helper.make_graph(
        [helper.make_node("Tanh", ["images"], ["output0"])],
        "g",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, [1, 3, 4, 4])],
        [helper.make_tensor_value_info("output0", TensorProto.FLOAT, [1, 3, 4, 4])],
    )
    with pytest.raises(FinetuneError, match=r"\['Tanh'\].*--finetune-steps 0"):
        QdqGraph(helper.make_model(graph))


def _killed(code: int) -> int:
    os._exit(code)  # what the kernel's out-of-memory killer leaves the parent to see


def test_a_quantizer_process_that_dies_is_an_export_error() -> None:
    from engines.export import in_fresh_process

    assert in_fresh_process(abs, (-3,), "abs") == 3
    with pytest.raises(ExportError, match=r"the quantizer: the process died.*--calib-frames"):
        in_fresh_process(_killed, (137,), "the quantizer")


def test_fine_tuning_steps_default_per_target() -> None:
    with pytest.raises(ExportError, match="--finetune-steps"):
        ExportRequest(
            model="m", out=Path("x.onnx"), precision="int8", calib=("v.mp4",), finetune_steps=-1
        ).check()
    assert ExportRequest(model="m", out=Path("x.onnx"), precision="int8", target="cpu").steps == 0
    assert ExportRequest(model="m", out=Path("x.onnx"), precision="int8").steps > 0
    assert ExportRequest(model="m", out=Path("x.onnx"), precision="fp16").steps == 0


# ---- models as Ultralytics exports them by default: fixed batch 1 and a fixed size --------


def ultralytics_onnx(folder: Path, name: str, **export: object) -> Path:
    """Ultralytics' ONNX export of a copy of the shared model (its defaults: batch 1, fixed
    height and width), as ``folder / name``."""
    import shutil
    import warnings

    from ultralytics import YOLO

    folder.mkdir(parents=True, exist_ok=True)
    pt = folder / MODEL_PT.name
    shutil.copyfile(MODEL_PT, pt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        made = YOLO(str(pt)).export(format="onnx", verbose=False, **export)
    return Path(made).rename(folder / name)


@pytest.fixture(scope="module")
def fixed320(out_dir: Path) -> Path:
    """``YOLO(...).export(format="onnx", imgsz=320)``: input [1, 3, 320, 320]."""
    path = ultralytics_onnx(out_dir / "fixed", "fixed320.onnx", imgsz=IMGSZ)
    dims = onnx.load(str(path), load_external_data=False).graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_value for d in dims] == [1, 3, IMGSZ, IMGSZ]
    return path


def test_int8_of_a_fixed_batch_fixed_size_onnx(
    fixed320: Path, out_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The default recipe on Ultralytics' default export: fine-tuning runs at the batch its
    graph fixes (its Reshape constants hold batch 1: a traceback at batch 4), and without
    --imgsz calibration runs at the model's own 320 (it ran at 640: an ONNX Runtime error)."""
    out = out_dir / "fixed320-int8.onnx"
    code = main(
        [
            "export", "--model", str(fixed320), "--precision", "int8", "--finetune-steps", "2",
            "--calib", str(CAR_CLIP), "--calib-frames", "8", "--eval-frames", "2",
            "--min-score", "0", "--out", str(out), "--no-progress",
        ]
    )  # fmt: skip
    assert code == 0, capsys.readouterr().err
    info = read_model_info(out)
    assert info.precision == "int8" and info.imgsz == (IMGSZ, IMGSZ) and not info.dynamic_hw
    tuned = json.loads(info.extra["streamdet_finetune"])
    assert tuned["steps"] == 2 and tuned["batch"] == 1
    calib = json.loads(info.extra["streamdet_calibration"])
    assert calib["imgsz"] == IMGSZ and calib["shape"] == [IMGSZ, IMGSZ]
    assert "PASS" in capsys.readouterr().out


def test_a_fixed_size_model_refuses_another_imgsz(
    fixed320: Path, out_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = out_dir / "fixed320-640.onnx"
    argv = ["export", "--model", str(fixed320), "--precision", "int8", "--imgsz", "640"]
    code = main([*argv, "--calib", str(CAR_CLIP), "--calib-frames", "4", "--out", str(out)])
    assert code == 2
    err = capsys.readouterr().err
    assert "--imgsz 640" in err and "fixed 320x320 input" in err and "Traceback" not in err
    assert not out.exists()
    # The model's own size, given explicitly, is fine (and fp16 needs no calibration).
    same = out_dir / "fixed320-fp16.onnx"
    argv = ["export", "--model", str(fixed320), "--precision", "fp16", "--imgsz", str(IMGSZ)]
    assert main([*argv, "--out", str(same), "--eval-frames", "0"]) == 0
    assert read_model_info(same).imgsz == (IMGSZ, IMGSZ)


def test_int8_of_a_graph_whose_input_is_not_named_images(fixed320: Path, out_dir: Path) -> None:
    model = onnx.load(str(fixed320))
    old = model.graph.input[0].name
    model.graph.input[0].name = "pixels"
    for node in model.graph.node:
        node.input[:] = ["pixels" if name == old else name for name in node.input]
    renamed = out_dir / "pixels-in.onnx"
    onnx.save(model, str(renamed))
    out = out_dir / "pixels-in-int8.onnx"
    export_model(
        ExportRequest(
            model=str(renamed),
            out=out,
            precision="int8",
            calib=(str(CAR_CLIP),),
            calib_frames=4,
            finetune_steps=1,
            cache_dir=CACHE_DIR,
            progress=False,
        )
    )
    graph = onnx.load(str(out), load_external_data=False).graph
    assert graph.input[0].name == "pixels"
    (dets,) = ort_engine(out).infer(sample_video_frames(CAR_CLIP, 1, offset=40), [DetectParams()])
    assert dets.width > 0


def test_out_that_is_the_model_is_refused(
    fixed320: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It overwrote the FP32 source, then compared the INT8 file with itself: PASS."""
    import hashlib
    import os

    before = hashlib.sha256(fixed320.read_bytes()).hexdigest()
    relative = Path(os.path.relpath(fixed320, Path.cwd()))
    with pytest.raises(ExportError, match=r"--out: .* is the --model file"):
        ExportRequest(model=str(fixed320), out=relative, precision="fp16").check()
    argv = ["export", "--model", str(fixed320), "--precision", "int8", "--calib", str(CAR_CLIP)]
    assert main([*argv, "--calib-frames", "4", "--out", str(relative)]) == 2
    assert "is the --model file" in capsys.readouterr().err
    # A link to the model (or the cached FP32 export of a .pt) is the same file too.
    link = tmp_path / "link.onnx"
    link.symlink_to(fixed320)
    with pytest.raises(ExportError, match="--out"):
        export_model(ExportRequest(model=str(fixed320), out=link, precision="fp16"))
    assert hashlib.sha256(fixed320.read_bytes()).hexdigest() == before


def test_report_and_frame_budget_are_checked_before_the_export(
    fixed320: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    out = tmp_path / "int8.onnx"
    argv = ["export", "--model", str(fixed320), "--precision", "int8", "--out", str(out)]
    calib = ["--calib", str(CAR_CLIP), "--calib-frames", "4", "--no-progress"]
    assert main([*argv, *calib, "--report", str(blocker / "r.json")]) == 2
    err = capsys.readouterr().err
    assert f"--report: {blocker / 'r.json'}: a file, not a directory" in err
    assert not out.exists()
    # An image folder of 5 frames: 4 calibrate, 1 is left for --eval-frames 2.
    images = tmp_path / "frames"
    images.mkdir()
    for i, frame in enumerate(sample_video_frames(CAR_CLIP, 5)):
        (images / f"{i}.jpg").write_bytes(encode_jpeg(frame))
    folder = ["--calib", str(images), "--calib-frames", "4", "--eval-frames", "2"]
    assert main([*argv, *folder, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "evaluation needs 2 frames" in err and "--eval-frames" in err
    assert "only 1 besides the 4 calibration frames" in err
    assert not out.exists()


def test_fixed_batch_model_caps_the_pool_batch(
    fixed320: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every batch of 4 failed on a batch-1 graph and was retried item by item; /model said 4."""
    import asyncio
    import time

    from server.runtime import build_pool

    info = read_model_info(fixed320)
    assert info.fixed_batch == 1
    with caplog.at_level("WARNING", logger="server.runtime"):
        pool = build_pool(Settings(model=str(fixed320), cache_dir=CACHE_DIR, max_batch=4))
    try:
        assert pool.max_batch == 1 and pool.engine.max_batch == 1
        assert "max batch 4 lowered to 1" in caplog.text
        frames = sample_video_frames(CAR_CLIP, 3, offset=40)

        async def run() -> list[object]:
            deadline = time.monotonic() + 60
            return list(await pool.detect_many(frames, DetectParams(), deadline))

        results = asyncio.run(run())
        assert len(results) == 3
    finally:
        pool.stop(5)


def test_serve_refuses_another_imgsz_for_a_fixed_size_model(fixed320: Path) -> None:
    """``serve --imgsz 640`` on a fixed 320x320 ONNX started, served at 320 and said nothing
    (export refused it): refused naming the model's size, as export does."""
    from server.runtime import build_pool

    with pytest.raises(EngineError) as info:
        build_pool(Settings(model=str(fixed320), cache_dir=CACHE_DIR, imgsz=640))
    message = str(info.value)
    assert "--imgsz 640" in message and "fixed 320x320 input" in message
    assert "--imgsz 320" in message and "STREAMDET_IMGSZ" in message
    pool = build_pool(Settings(model=str(fixed320), cache_dir=CACHE_DIR, imgsz=320))
    pool.stop(5)  # its own size, given: taken


@pytest.fixture(scope="module")
def fixed320_batch8(out_dir: Path) -> Path:
    """``YOLO(...).export(format="onnx", imgsz=320, batch=8)``: input [8, 3, 320, 320]."""
    path = ultralytics_onnx(out_dir / "fixed8", "fixed320-b8.onnx", imgsz=IMGSZ, batch=8)
    assert read_model_info(path).fixed_batch == 8
    return path


def test_a_fixed_batch_of_8_serves_any_number_of_images(
    fixed320: Path, fixed320_batch8: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Ultralytics' ``batch=8`` export (its Reshapes hold the 8): the server did not start
    (ONNX Runtime: "Got: 1 Expected: 8" at warm-up). Every batch is now padded to 8, the pool
    batches 8 where --max-batch is not set, and the boxes are the batch-1 export's."""
    import asyncio
    import time

    from server.runtime import build_pool
    from streams.files import load_image

    assets = ultralytics_assets()
    frames = [load_image(assets / "bus.jpg"), load_image(assets / "zidane.jpg")]
    frames.append(sample_video_frames(CAR_CLIP, 1, offset=40)[0])

    def detect(settings: Settings) -> tuple[int, list[Detections]]:
        pool = build_pool(settings)
        try:

            async def run() -> list[Detections]:
                deadline = time.monotonic() + 60
                done = await pool.detect_many(frames, DetectParams(), deadline)
                return [r.detections for r in done if r.detections is not None]

            return pool.max_batch, asyncio.run(run())
        finally:
            pool.stop(5)

    batch, padded = detect(Settings(model=str(fixed320_batch8), cache_dir=CACHE_DIR))
    assert batch == 8 and len(padded) == len(frames)
    _, reference = detect(Settings(model=str(fixed320), cache_dir=CACHE_DIR))
    assert any(len(d.boxes) for d in reference)
    assert [d.class_ids.tolist() for d in padded] == [d.class_ids.tolist() for d in reference]
    for got, want in zip(padded, reference, strict=True):
        np.testing.assert_allclose(got.boxes, want.boxes, atol=0.01)
        np.testing.assert_allclose(got.scores, want.scores, atol=1e-4)
    with caplog.at_level("WARNING", logger="server.runtime"):
        batch, _ = detect(Settings(model=str(fixed320_batch8), cache_dir=CACHE_DIR, max_batch=2))
    assert batch == 2
    assert "every batch of at most 2 (setting STREAMDET_MAX_BATCH) is padded to 8" in caplog.text


def test_int8_of_a_batch_8_onnx(
    fixed320_batch8: Path, out_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Calibration fed a batch-8 graph one frame at a time and fine-tuning trained it at 4
    (both ONNX Runtime's "Got: 1 Expected: 8"); evaluation timed each frame as a padded 8."""
    out = out_dir / "fixed320-b8-int8.onnx"
    code = main(
        [
            "export", "--model", str(fixed320_batch8), "--precision", "int8",
            "--finetune-steps", "2", "--calib", str(CAR_CLIP), "--calib-frames", "12",
            "--eval-frames", "4", "--min-score", "0", "--out", str(out), "--no-progress",
        ]
    )  # fmt: skip
    printed = capsys.readouterr()
    assert code == 0, printed.err
    info = read_model_info(out)
    assert info.precision == "int8" and info.fixed_batch == 8
    assert json.loads(info.extra["streamdet_finetune"])["batch"] == 8
    assert "speed (batch 8, " in printed.out and "PASS" in printed.out


def test_calibration_batches_fill_up_with_real_frames() -> None:
    frames = sample_video_frames(VIDEOS[0], 3)
    shape = input_shape(frames, 640, 32, dynamic_hw=True)
    reader = FrameReader(frames, 640, shape, progress=False, batch=2)
    first, second = reader.get_next(), reader.get_next()
    assert first is not None and second is not None and reader.get_next() is None
    assert first["images"].shape == second["images"].shape == (2, 3, *shape)
    # The last batch's second slot is the first frame again, not a blank picture.
    np.testing.assert_array_equal(second["images"][1], first["images"][0])
    np.testing.assert_array_equal(second["images"][0], reader.tensor(2)[0])


def test_an_artifact_is_served_at_the_size_it_was_made_for(int8: ExportResult) -> None:
    from server.runtime import engine_config, served_imgsz

    info = read_model_info(int8.path)
    assert served_imgsz(Settings(model=str(int8.path)), info) == IMGSZ
    assert engine_config(Settings(model=str(int8.path)), info).imgsz == IMGSZ
    # An explicit --imgsz still wins; a plain dynamic model keeps the default 640.
    assert served_imgsz(Settings(model=str(int8.path), imgsz=640), info) == 640
    assert served_imgsz(Settings(), read_model_info(int8.reference)) == 640


def _one_class(source: Path, out: Path) -> Path:
    """``source`` cut down to its first class (a 'person' detector): output (B, 5, anchors)."""
    from onnx import TensorProto, helper

    model = onnx.load(str(source))
    graph = model.graph
    for node in graph.node:
        node.output[:] = ["all_classes" if o == "output0" else o for o in node.output]
    consts = [("starts", [0]), ("ends", [5]), ("axes", [1])]
    for name, value in consts:
        graph.initializer.append(helper.make_tensor(name, TensorProto.INT64, [1], value))
    graph.node.append(
        helper.make_node("Slice", ["all_classes", "starts", "ends", "axes"], ["output0"])
    )
    dims = graph.output[0].type.tensor_type.shape.dim
    dims[1].dim_value = 5
    for prop in model.metadata_props:
        if prop.key == "names":
            prop.value = "{0: 'person'}"
    onnx.save(model, str(out))
    return out


def test_evaluate_refuses_a_reference_with_other_classes(
    int8: ExportResult, out_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    person = _one_class(int8.reference, out_dir / "person-only.onnx")
    assert read_model_info(person).names == {0: "person"}
    argv = ["evaluate", "--model", str(person), "--reference", str(int8.reference)]
    code = main([*argv, "--frames", str(CAR_CLIP), "--eval-frames", "2", "--no-progress"])
    assert code == 2
    err = capsys.readouterr().err
    assert "detect different classes" in err and "--reference" in err, err


def test_evaluate_names_its_own_flags(
    int8: ExportResult, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing.pt"
    argv = ["evaluate", "--model", str(int8.path), "--eval-frames", "2", "--no-progress"]
    assert main([*argv, "--reference", str(missing), "--frames", str(CAR_CLIP)]) == 2
    err = capsys.readouterr().err
    assert "missing.pt: file not found (--reference)" in err and "STREAMDET_MODEL" not in err
    nope = tmp_path / "nope.mp4"
    assert main([*argv, "--reference", str(int8.reference), "--frames", str(nope)]) == 2
    err = capsys.readouterr().err
    assert f"evaluation source {nope}: no such file" in err and "(--frames)" in err, err
    assert "--calib" not in err


def test_a_live_source_that_cannot_open_is_named_once() -> None:
    import socket

    with socket.socket() as sock:  # a port nothing listens on: refused at once
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for url in (f"rtsp://127.0.0.1:{port}/x", f"rtsp://user:secret@127.0.0.1:{port}/x"):
        with pytest.raises(CalibrationError) as caught:
            sample_frames(parse_sources([url]), 1, progress=False)
        message = str(caught.value)
        assert f"live source rtsp://127.0.0.1:{port}/x: cannot open" in message, message
        assert "rtsp://rtsp://" not in message and "secret" not in message, message


def test_engine_export_without_tensorrt_says_what_export_can_do(tmp_path: Path) -> None:
    import importlib.util

    from engines.tensorrt import export_engine
    from engines.types import EngineError

    if importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("TensorRT is installed here")
    with pytest.raises(EngineError) as caught:
        export_engine(
            str(MODEL_PT), imgsz=640, max_batch=1, device="cuda", cache_dir=CACHE_DIR, out=None
        )
    message = str(caught.value)
    assert "--backend" not in message and "--format onnx" in message, message
