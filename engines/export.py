"""FP32, FP16 and INT8 ONNX artifacts, each carrying its metadata, for ONNX Runtime and TensorRT.

- fp32: Ultralytics' ONNX export (dynamic batch and H/W axes, cached by content hash).
- fp16: NVIDIA ModelOpt's ONNX autocast (FP16 inside, float32 inputs and outputs).
- int8 (``target="tensorrt"``, the default): ModelOpt's post-training quantization into
  explicit Q/DQ nodes, the one INT8 form TensorRT 11 builds (strongly typed networks, no
  calibrators); calibrated on real frames letterboxed as inference does. ONNX Runtime runs the
  same file on the CPU, which is where its accuracy is checked.
- int8 ``target="cpu"``: ONNX Runtime's own static quantization (Q/DQ, per-channel weights),
  laid out for ONNX Runtime's CPU kernels rather than TensorRT's.

Default INT8 recipe (``target="tensorrt"``): ModelOpt PTQ (max calibration, fp32 for the
layers left unquantized, detection head and stem in float) and then quantization-aware
fine-tuning of that very Q/DQ graph (``engines.finetune``: torch runs the ONNX nodes with
the graph's fake quantization; the Conv weights and the activation scales learn from FP32's
class logits and boxes on the calibration frames, extra weight on the logits near the 0.25
threshold, 500 Adam steps; kept only when it flips fewer anchors across the threshold on
calibration frames held back from training).

Measured here (``make int8-report``, i.e. ``streamdet export --precision int8 --calib
../shared/videos/*.mp4 --eval-frames 150 --eval-sets 3``: 256 calibration frames, three
disjoint sets of 150 held-out frames, conf 0.25, IoU 0.5, 2 shared cores), recall/precision
vs FP32 per set:

- PTQ alone (``--finetune-steps 0``): 0.957/0.972, 0.919/0.971, 0.949/0.980. The misses are
  FP32 detections scored just over 0.25 whose INT8 score falls under it; un-quantizing the
  activations alone cuts the near-threshold logit error 0.43 -> 0.18, the weights alone do
  not lower it at all.
- Fine-tuned, weights only (lr 1e-5, 300 steps): 0.957/0.976, 0.953/0.988, 0.938/0.980.
- Fine-tuned, biases only (lr 1e-3, 200 steps): 0.961/0.969, 0.942/0.964, 0.945/0.976.
- Fine-tuned, weights and activation scales, 300 steps: 0.953/0.972, 0.957/0.976,
  0.961/0.957; 500 steps: 0.965/0.973, 0.973/0.988, 0.957/0.957 (both scratch runs on the
  same graph). Through the command, 500 steps: 0.965/0.973, 0.946/0.972, 0.953/0.980;
  800 steps: 0.965/0.976, 0.957/0.988, 0.945/0.976. A few borderline objects seen in many
  frames (a spoon, a sink, a distant car) decide these; each run moves a set by ~0.01.
- The default adds the threshold band to the loss (500 steps, 730 s on 2 cores; held-back
  threshold flips 47 -> 28): **0.957/0.961, 0.957/0.980, 0.961/0.976: all three pass**,
  thinly (benchmarks/results/2026-11-30-cpu2-int8-report.json). x0.80 FP32's speed on ONNX
  Runtime, which emulates the Q/DQ graph; the speed is TensorRT's.

Tried earlier without getting every set past 0.95: best-fit (MSE) activation and weight
scales; fine-tuning a re-creation of the quantizers on the PyTorch module and quantizing again
(0.938/0.960, 0.919/0.967, 0.938/0.968; its loss fell while the ONNX graph's error grew,
which is why the graph itself is now what is trained); 384 or 512 calibration frames
(precision fell to 0.93-0.94); entropy calibration; bias correction of the class convs alone
(recall gained what precision lost); more layers in float (the whole neck: 0.934 on the
second set).

``--target cpu`` (ONNX Runtime's static quantization, max, head and stem in float), same
command with ``--target cpu``: every op ONNX Runtime quantizes by default (each SiLU's
Sigmoid and Mul too): 0.895/0.899 at x1.53 FP32's speed; fine-tuned 500 steps (weights):
0.938/0.949, 0.934/0.949, 0.961/0.950; with learned scales: 0.950/0.961, 0.938/0.968,
0.949/0.953 (x1.44-1.50). Convolutions and the ops between them only (``ORT_QUANTIZED_OPS``,
the default): 0.957/0.961, **0.950**/0.980 (245 of 258, one short), 0.957/0.976 at x1.29-1.32;
fine-tuned 500 steps: 0.965/0.980, 0.950/0.976, 0.938/0.964 (so not fine-tuned by default);
without Add: 0.957/0.984, 0.942/0.964, 0.957/0.976; Conv alone: 0.946/0.961, 0.957/0.976,
0.945/0.964; the default plus ``/model.2/cv1`` in float (the third-ranked layer of the sweep
below): 0.973/0.992, 0.950/0.976 (245 of 258 again), 0.961/0.969 at x1.30-1.37. Entropy
calibration at 256 frames ran out of 24 GiB (ONNX Runtime keeps every activation of every
frame).

ModelOpt is imported only here and only when asked for: it comes with the ``export`` extra,
installed without ModelOpt's own ``[onnx]`` extra, which would pull ``onnxruntime-gpu`` and
replace the CPU ``onnxruntime`` module (see pyproject.toml).
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any, TypeVar

from engines.calibration import FrameReader, FrameSample, input_shape, parse_sources, sample_frames
from engines.finetune import DEFAULT_STEPS, FinetuneConfig, FinetuneReport
from engines.model import default_imgsz, file_sha256, read_model_info, resolve_onnx
from engines.types import EngineError

log = logging.getLogger(__name__)
T = TypeVar("T")

PRECISIONS = ("fp32", "fp16", "int8")
TARGETS = ("tensorrt", "cpu")
CALIB_METHODS = ("entropy", "max")
DEFAULT_CALIB_FRAMES = 256
DEFAULT_IMGSZ = 640
# Left in float by default: in the YOLO Detect module, everything but the first two (3x3)
# convolutions of each branch, i.e. the last 1x1 convolutions (box and class logits), the DFL
# and the box/score decode. The decoded output holds pixels (0..640) and scores (0..1) in one
# tensor: quantized per tensor, the scores round to 0 (seen: no detections at all from ONNX
# Runtime's quantizer). The logits sit right at the confidence threshold, and these layers
# are a few percent of the compute.
YOLO_HEAD = "yolo-head"
# Also left in float by default: the stem, the first two (3x3, stride 2) convolutions. A
# per-layer sweep (un-quantizing one Conv at a time in the max-calibrated graph; 24
# validation frames disjoint from calibration and report frames) ranked them far above the
# rest: mean |score error| on near-threshold anchors 0.099 with all quantized, 0.066 with
# model.0 in float, 0.073 with model.1, 0.086 with model.2.cv1, every other layer 0.095-0.108
# (noise). model.0 sees the raw image through 27 weights per channel, and max calibration
# gives its SiLU output a step of 0.32 (range +-40) while most values are below 1. Both in
# float: 0.059. Measured on the report's 150 frames: recall 0.926 -> 0.957, precision
# 0.930 -> 0.972. Names are Ultralytics' ONNX export's; on other models nothing matches.
YOLO_STEM = r"/model\.[01]/conv/Conv"
DEFAULT_EXCLUDE = (YOLO_HEAD, YOLO_STEM)
# Max (not entropy) calibration and fp32 for the unquantized layers: with the head and stem
# in float, entropy gave 0.946 / 0.953 on the report's frames (max 0.957 / 0.972) and fp16
# 0.953 / 0.980 (one detection from failing; also x0.59 on ONNX Runtime, which emulates fp16).
DEFAULT_CALIB_METHOD = "max"
# What ``--target cpu`` quantizes: the convolutions and the ops that pass int8 between them.
# ONNX Runtime's quantizer also takes every SiLU's Sigmoid and Mul by default, three rounding
# steps per activation instead of one: post-training 0.895/0.899 (recall/precision on the
# report's frames) at x1.41-1.53 FP32's speed, against 0.957/0.961, 0.950/0.980, 0.957/0.976
# on three held-out sets at x1.22-1.32 (two runs) with the SiLUs in float.
ORT_QUANTIZED_OPS = ("Conv", "MaxPool", "Concat", "Resize", "Split", "Add")
DEFAULT_FINETUNE_STEPS = DEFAULT_STEPS
DEFAULT_HIGH_PRECISION = "fp32"


class ExportError(EngineError):
    """An export could not be made; the message says which option to change."""


@dataclass(frozen=True, slots=True)
class ExportRequest:
    """What to export.

    Attributes:
        model: an Ultralytics ``.pt`` checkpoint, a ``.torchscript`` (not for INT8) or an FP32
            ``.onnx`` file.
        out: the ONNX file to write.
        precision: ``fp32``, ``fp16`` or ``int8``.
        imgsz: inference size the artifact is made (and calibrated) for; ``None``: the
            model's (a fixed-shape ONNX's own, see ``engines.model.default_imgsz``), else 640.
            A fixed-shape model refuses any other.
        calib: INT8 calibration sources: videos, image folders, images or RTSP URLs.
        calib_frames: frames sampled evenly over ``calib``.
        calib_method: ``entropy`` or ``max`` activation ranges.
        target: ``tensorrt`` (ModelOpt Q/DQ, for TensorRT; also runs on ONNX Runtime) or
            ``cpu`` (ONNX Runtime's static quantization, for its CPU kernels).
        high_precision: dtype of the layers an INT8 ModelOpt graph keeps unquantized:
            ``fp32`` (the default, see ``DEFAULT_HIGH_PRECISION``) or ``fp16`` (ModelOpt's
            default, what TensorRT runs fastest).
        exclude_nodes: regular expressions of node names left unquantized; ``yolo-head``
            stands for the Detect module's logits, DFL and decode (found in the graph); the
            default adds the stem convolutions (``YOLO_STEM``).
        finetune_steps: quantization-aware fine-tuning steps after ModelOpt's calibration
            (``engines.finetune``); ``None`` means ``DEFAULT_FINETUNE_STEPS`` for the
            ``tensorrt`` target and none for ``cpu``; 0 keeps the post-training graph.
        cache_dir: where the FP32 export of a ``.pt`` is cached.
        progress: progress bars on stderr while sampling, calibrating and fine-tuning.
    """

    model: str
    out: Path
    precision: str = "fp32"
    imgsz: int | None = None
    calib: tuple[str, ...] = ()
    calib_frames: int = DEFAULT_CALIB_FRAMES
    calib_method: str = DEFAULT_CALIB_METHOD
    target: str = "tensorrt"
    high_precision: str = DEFAULT_HIGH_PRECISION
    exclude_nodes: tuple[str, ...] = DEFAULT_EXCLUDE
    finetune_steps: int | None = None
    cache_dir: Path = Path(".cache/streamdet")
    progress: bool = True

    @property
    def steps(self) -> int:
        """Fine-tuning steps this export runs."""
        if self.precision != "int8":
            return 0
        if self.finetune_steps is None:
            return DEFAULT_FINETUNE_STEPS if self.target == "tensorrt" else 0
        return self.finetune_steps

    def check(self) -> None:
        """Raises:
        ExportError: an option out of range, naming the flag to change.
        """
        if self.precision not in PRECISIONS:
            raise ExportError(f"--precision: expected one of {PRECISIONS}, got {self.precision!r}")
        if self.target not in TARGETS:
            raise ExportError(f"--target: expected one of {TARGETS}, got {self.target!r}")
        if self.calib_method not in CALIB_METHODS:
            raise ExportError(
                f"--calib-method: expected one of {CALIB_METHODS}, got {self.calib_method!r}"
            )
        if self.high_precision not in ("fp16", "fp32"):
            raise ExportError(
                f"--high-precision: expected fp16 or fp32, got {self.high_precision!r}"
            )
        if self.imgsz is not None and (self.imgsz < 32 or self.imgsz % 32):
            raise ExportError(
                f"--imgsz: expected a multiple of 32 (the model stride), got {self.imgsz}"
            )
        if self.out.suffix.lower() != ".onnx":
            raise ExportError(f"--out: expected a .onnx file name, got {self.out}")
        if _same_file(self.out, Path(self.model).expanduser()):
            raise ExportError(
                f"--out: {self.out} is the --model file; writing it would overwrite the FP32"
                " source the artifact is checked against: pass another --out"
            )
        if self.precision == "int8" and not self.calib:
            raise ExportError(
                "--precision int8 needs calibration frames: pass videos, image folders or RTSP"
                " URLs with --calib"
            )
        if self.precision == "int8" and self.calib_frames < 1:
            raise ExportError(f"--calib-frames: expected at least 1, got {self.calib_frames}")
        if self.precision != "int8" and self.target != "tensorrt":
            raise ExportError("--target cpu applies to --precision int8 only")
        if self.finetune_steps is not None and self.finetune_steps < 0:
            raise ExportError(f"--finetune-steps: expected 0 or more, got {self.finetune_steps}")


@dataclass(slots=True)
class ExportResult:
    """The written artifact, the FP32 model it came from and the calibration it used."""

    path: Path
    precision: str
    reference: Path
    calibration: FrameSample | None = None
    metadata: dict[str, str] = field(default_factory=dict)


def export_model(request: ExportRequest) -> ExportResult:
    """Write the artifact ``request`` asks for.

    Raises:
        ExportError: bad options, too few calibration frames, or a missing quantizer.
        ModelError: the model cannot be read or exported.
    """
    request.check()
    reference = resolve_onnx(request.model, request.cache_dir, request.imgsz or DEFAULT_IMGSZ)
    if _same_file(request.out, reference):
        raise ExportError(
            f"--out: {request.out} is the FP32 reference {reference} the artifact is made from"
            " and checked against: pass another --out"
        )
    info = read_model_info(reference)
    own = default_imgsz(info)
    if not info.dynamic_hw and request.imgsz is not None and request.imgsz != own:
        raise ExportError(
            f"--imgsz {request.imgsz}: model {request.model} has a fixed"
            f" {info.imgsz[0]}x{info.imgsz[1]} input, so it runs at {own} only: drop --imgsz"
            f" (or pass --imgsz {own}), or export the model again with dynamic=True"
        )
    imgsz = request.imgsz or own or DEFAULT_IMGSZ
    fixed = None if info.dynamic_hw else info.imgsz
    if info.precision != "fp32":
        raise ExportError(
            f"model {request.model}: is already {info.precision};"
            " export from the .pt or the FP32 .onnx"
        )
    if request.precision == "int8" and info.extra.get("streamdet_source") == "torchscript":
        # Its graph has no module names (/model.22/dfl/...) to find the Detect head by.
        raise ExportError(
            f"model {request.model}: INT8 needs the module names a TorchScript trace lost;"
            " export INT8 from the .pt checkpoint or its ONNX export"
        )
    request.out.parent.mkdir(parents=True, exist_ok=True)
    extra: dict[str, str] = {
        "streamdet_precision": request.precision,
        "streamdet_source_sha256": file_sha256(reference),
    }
    calibration: FrameSample | None = None
    with tempfile.TemporaryDirectory(dir=request.out.parent, prefix=".export-") as tmp:
        work = Path(tmp)
        if request.precision == "fp32":
            produced = reference
        elif request.precision == "fp16":
            produced = _autocast_fp16(reference, work)
            extra["streamdet_converter"] = _version("nvidia-modelopt", "modelopt")
        else:
            sources = parse_sources(request.calib)
            calibration = sample_frames(sources, request.calib_frames, progress=request.progress)
            shape = input_shape(calibration.frames, imgsz, info.stride, info.dynamic_hw, fixed)
            reader = FrameReader(
                calibration.frames,
                imgsz,
                shape,
                input_name=_input_name(reference),
                progress=request.progress,
                batch=info.fixed_batch or 1,
            )
            if request.target == "cpu":
                produced = _quantize_ort(reference, work, reader, request)
                quantizer = _version("onnxruntime")
            else:
                produced = _quantize_modelopt(reference, work, reader, request)
                quantizer = _version("nvidia-modelopt", "modelopt")
            if request.steps:
                tuned = work / "int8-finetuned.onnx"
                report = _finetune(produced, reference, tuned, reader, request)
                produced = tuned
                extra["streamdet_finetune"] = json.dumps(report.to_json(), separators=(",", ":"))
            extra["streamdet_target"] = request.target
            extra["streamdet_quantizer"] = quantizer
            extra["streamdet_calibration"] = json.dumps(
                {
                    "method": request.calib_method,
                    "frames": len(calibration.frames),
                    "imgsz": imgsz,
                    "shape": list(shape),
                    "high_precision": request.high_precision
                    if request.target == "tensorrt"
                    else "fp32",
                    "sources": [s.to_json() for s in calibration.sources],
                },
                separators=(",", ":"),
            )
        metadata = _write_with_metadata(produced, reference, request.out, extra)
    log.info("export %s: wrote %s (%s)", request.model, request.out, request.precision)
    return ExportResult(request.out, request.precision, reference, calibration, metadata)


def _same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file (resolved: ``./m.onnx`` and ``m.onnx``, links)."""
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and a.samefile(b))
    except OSError:
        return False


def _input_name(path: Path) -> str:
    """The name of the graph's image input (``images`` in Ultralytics' exports; any name in a
    graph from elsewhere)."""
    import onnx

    name: str = onnx.load(str(path), load_external_data=False).graph.input[0].name
    return name


def _version(dist: str, label: str | None = None) -> str:
    try:
        return f"{label or dist} {importlib_metadata.version(dist)}"
    except importlib_metadata.PackageNotFoundError:
        return label or dist


@contextmanager
def _third_party() -> Iterator[None]:
    """Quantizers log and warn freely (deprecations, ONNX checker notes); an export must not
    fail on their chatter where warnings are errors, and their INFO flood is kept out."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _import_modelopt(what: str) -> Any:
    try:
        with _third_party():
            if what == "autocast":
                import modelopt.onnx.autocast as module
            else:
                import modelopt.onnx.quantization as module
    except ImportError as exc:
        raise ExportError(
            f"NVIDIA ModelOpt is needed for this export but cannot be imported ({exc}):"
            " install the export extra, `pip install -e .[export]` (not nvidia-modelopt[onnx],"
            " which replaces the CPU onnxruntime with onnxruntime-gpu);"
            " or use --target cpu for INT8"
        ) from exc
    return module


def _autocast_fp16(reference: Path, work: Path) -> Path:
    import onnx

    autocast = _import_modelopt("autocast")
    model = onnx.load(str(reference))
    with _third_party():
        converted = autocast.convert_to_f16(model, keep_io_types=True)
    out = work / "fp16.onnx"
    onnx.save(converted, str(out))
    return out


def _quantize_modelopt(
    reference: Path, work: Path, reader: FrameReader, request: ExportRequest
) -> Path:
    quantization = _import_modelopt("quantization")
    # ModelOpt writes intermediate files beside its input: work on a copy in our temp dir.
    src = work / "fp32.onnx"
    shutil.copyfile(reference, src)
    out = work / "int8.onnx"
    with _third_party():
        quantization.quantize(
            str(src),
            quantize_mode="int8",
            calibration_data_reader=reader,
            calibration_method=request.calib_method,
            # Calibration runs on ONNX Runtime's CPU provider: the CPU install has no other.
            calibration_eps=["cpu"],
            high_precision_dtype=request.high_precision,
            nodes_to_exclude=head_patterns(src, request.exclude_nodes),
            output_path=str(out),
            log_level="WARNING",
        )
    if not out.exists():
        raise ExportError(f"ModelOpt quantization of {reference} wrote no model; see the log above")
    return out


def _finetune(
    produced: Path, reference: Path, out: Path, reader: FrameReader, request: ExportRequest
) -> FinetuneReport:
    from engines.finetune import finetune

    with _third_party():
        return finetune(
            produced,
            reference,
            reader,
            out,
            FinetuneConfig(steps=request.steps),
            progress=request.progress,
        )


def _quantize_ort(reference: Path, work: Path, reader: FrameReader, request: ExportRequest) -> Path:
    """ONNX Runtime's static quantization, in a fresh process: ModelOpt patches
    ``onnxruntime.quantization`` in the process that imported it (``patch_ort_modules``), and
    the patched calibrator fails on a plain ORT quantization afterwards."""
    return in_fresh_process(
        _quantize_ort_here,
        (reference, work, reader, request),
        f"ONNX Runtime's quantizer ({request.calib_method} calibration of"
        f" {request.calib_frames} frames)",
    )


def in_fresh_process(fn: Callable[..., T], args: tuple[Any, ...], what: str) -> T:
    """``fn(*args)`` in a fresh (spawned) process.

    Raises:
        ExportError: the process died (the kernel's out-of-memory killer, most often),
            naming the options that use less memory.
    """
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as child:
        try:
            return child.submit(fn, *args).result()
        except BrokenProcessPool:
            raise ExportError(
                f"{what}: the process died before it finished, most likely out of memory"
                " (ONNX Runtime's entropy calibrator keeps every activation of every frame);"
                " try fewer --calib-frames or --calib-method max"
            ) from None


def _quantize_ort_here(
    reference: Path, work: Path, reader: FrameReader, request: ExportRequest
) -> Path:
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    pre = work / "pre.onnx"
    out = work / "int8.onnx"
    with _third_party():
        # Symbolic shape inference cannot resolve the dynamic H/W axes; ONNX's is enough.
        quant_pre_process(str(reference), str(pre), skip_symbolic_shape=True)
        exclude = _matching_nodes(pre, head_patterns(pre, request.exclude_nodes))
        quantize_static(
            str(pre),
            str(out),
            reader,
            quant_format=QuantFormat.QDQ,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            per_channel=True,
            calibrate_method=CalibrationMethod.Entropy
            if request.calib_method == "entropy"
            else CalibrationMethod.MinMax,
            nodes_to_exclude=exclude,
            op_types_to_quantize=list(ORT_QUANTIZED_OPS),
        )
    return out


def head_patterns(path: Path, patterns: Sequence[str]) -> list[str]:
    """``patterns`` with ``yolo-head`` replaced by the Detect module's float region of ``path``
    (the module holding the DFL: all of it but ``cv2.*.0/1`` and ``cv3.*.0/1``)."""
    import onnx

    out = [p for p in patterns if p != YOLO_HEAD]
    if YOLO_HEAD in patterns:
        graph = onnx.load(str(path), load_external_data=False).graph
        found = {m.group(1) for n in graph.node if (m := re.match(r"(/model\.\d+)/dfl/", n.name))}
        if len(found) != 1:
            raise ExportError(
                f"model {path}: no single YOLO Detect module with a DFL found ({sorted(found)});"
                " name the nodes to keep in float with --exclude-nodes"
            )
        scope = re.escape(found.pop())
        out.append(rf"{scope}/(?!cv[23]\.\d+/cv[23]\.\d+\.[01]/).*")
    return out


def _matching_nodes(path: Path, patterns: Sequence[str]) -> list[str]:
    """Names of the nodes of ``path`` that fully match one of ``patterns`` (regular
    expressions, as ModelOpt takes them; ONNX Runtime's quantizer takes exact names)."""
    import onnx

    if not patterns:
        return []
    compiled = [re.compile(p) for p in patterns]
    graph = onnx.load(str(path), load_external_data=False).graph
    return [n.name for n in graph.node if any(c.fullmatch(n.name) for c in compiled)]


def _write_with_metadata(
    produced: Path, reference: Path, out: Path, extra: dict[str, str]
) -> dict[str, str]:
    """Save ``produced`` to ``out`` with the reference's metadata (names, imgsz, stride, ...)
    plus ``extra``; quantizers drop ``metadata_props``. Written atomically."""
    import onnx

    ref_meta = {
        p.key: p.value for p in onnx.load(str(reference), load_external_data=False).metadata_props
    }
    model = onnx.load(str(produced))
    meta = {**ref_meta, **{p.key: p.value for p in model.metadata_props}, **extra}
    del model.metadata_props[:]
    for key, value in meta.items():
        model.metadata_props.add(key=key, value=value)
    tmp = out.with_name(f".{out.name}.tmp")
    onnx.save(model, str(tmp))
    os.replace(tmp, out)
    return meta
