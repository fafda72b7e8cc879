"""``streamdet export`` and ``streamdet evaluate``: make FP32/FP16/INT8 ONNX artifacts and
check them against FP32 on held-out frames (recall/precision per class, speed on this CPU)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from engines.calibration import CalibrationError, check_sources
from engines.evaluate import EvalReport
from engines.export import (
    CALIB_METHODS,
    DEFAULT_CALIB_FRAMES,
    DEFAULT_CALIB_METHOD,
    DEFAULT_EXCLUDE,
    DEFAULT_FINETUNE_STEPS,
    DEFAULT_HIGH_PRECISION,
    PRECISIONS,
    TARGETS,
)
from engines.types import EngineError
from server.argtypes import number

log = logging.getLogger(__name__)

DEFAULT_EVAL_FRAMES = 100
DEFAULT_EVAL_SETS = 1
ACCURACY_BAR = 0.95
EXIT_BELOW_BAR = 3


def _default_cache_dir() -> Path:
    """``STREAMDET_CACHE_DIR``, as ``serve``, ``bench`` and ``analyze`` take it (it was
    ignored here), else the settings' default."""
    from server.settings import Settings

    if given := os.environ.get("STREAMDET_CACHE_DIR", "").strip():
        return Path(given).expanduser()
    return Settings.model_fields["cache_dir"].default_factory()  # type: ignore[call-arg,misc,no-any-return]


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--imgsz", type=int, default=None, help="inference size (default: the model's, else 640)"
    )
    p.add_argument(
        "--eval-frames",
        type=number(int, 0),
        default=DEFAULT_EVAL_FRAMES,
        help=f"held-out frames compared with FP32 (default {DEFAULT_EVAL_FRAMES}; 0 skips)",
    )
    p.add_argument(
        "--eval-sets",
        type=number(int, 1),
        default=DEFAULT_EVAL_SETS,
        help="disjoint held-out sets of --eval-frames frames each, every one reported and held to"
        f" --min-score (default {DEFAULT_EVAL_SETS}; set k skips calibration and sets 1..k-1)",
    )
    p.add_argument(
        "--min-score",
        type=number(float, 0, 1),
        default=ACCURACY_BAR,
        help=f"recall and precision vs FP32 below this exit with {EXIT_BELOW_BAR}",
    )
    p.add_argument(
        "--threads",
        type=number(int, 0),
        default=0,
        help="ONNX Runtime threads when timing; 0 = all cores",
    )
    p.add_argument(
        "--report", type=Path, default=None, help="also write the accuracy report as JSON"
    )
    p.add_argument(
        "--cache-dir", type=Path, default=None, help="where FP32 exports of .pt files are cached"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def add_export_parsers(sub: Any) -> None:
    """Register ``export`` and ``evaluate`` on the ``streamdet`` subcommand parser."""
    exp = sub.add_parser("export", help="write an FP32 / FP16 / INT8 ONNX artifact (and check it)")
    exp.add_argument(
        "--model", required=True, help="Ultralytics .pt checkpoint, .torchscript or FP32 .onnx"
    )
    exp.add_argument("--precision", choices=PRECISIONS, default="fp32")
    exp.add_argument("--out", type=Path, required=True, help="ONNX file to write")
    exp.add_argument(
        "--calib",
        nargs="+",
        default=[],
        metavar="SRC",
        help="INT8 calibration frames: videos, image folders/files, rtsp:// URLs",
    )
    exp.add_argument(
        "--calib-frames",
        type=int,
        default=DEFAULT_CALIB_FRAMES,
        help=f"calibration frames sampled evenly over --calib (default {DEFAULT_CALIB_FRAMES})",
    )
    exp.add_argument("--calib-method", choices=CALIB_METHODS, default=DEFAULT_CALIB_METHOD)
    exp.add_argument(
        "--target",
        choices=TARGETS,
        default="tensorrt",
        help="int8 for TensorRT (ModelOpt Q/DQ) or for ONNX Runtime on the CPU (measured x1.3"
        " FP32's speed here at recall 0.950-0.957, precision 0.961-0.980 vs FP32 on three"
        " held-out sets)",
    )
    exp.add_argument(
        "--high-precision",
        choices=("fp16", "fp32"),
        default=DEFAULT_HIGH_PRECISION,
        help="dtype of the layers a ModelOpt INT8 graph leaves unquantized",
    )
    exp.add_argument(
        "--exclude-nodes",
        nargs="*",
        default=None,
        metavar="REGEX",
        help="INT8: node names (regular expressions) left unquantized; 'yolo-head' is the"
        " Detect module's logits, DFL and decode; the default is 'yolo-head' plus the two stem"
        " convolutions; an empty list quantizes all",
    )
    exp.add_argument(
        "--finetune-steps",
        type=int,
        default=None,
        metavar="N",
        help="INT8: quantization-aware fine-tuning steps after calibration, FP32 teaching the"
        " Q/DQ graph on the calibration frames (default: tensorrt target"
        f" {DEFAULT_FINETUNE_STEPS}, ~1.6 s a step on 2 cores at imgsz 640; cpu target 0;"
        " 0 keeps the post-training graph)",
    )
    exp.add_argument(
        "--eval",
        nargs="+",
        default=None,
        metavar="SRC",
        help="frames for the accuracy report (default: the --calib sources)",
    )
    _common(exp)
    ev = sub.add_parser("evaluate", help="compare an ONNX artifact with FP32 on held-out frames")
    ev.add_argument("--model", required=True, help="the artifact (.onnx) to check")
    ev.add_argument("--reference", required=True, help="the FP32 model: .pt, .torchscript or .onnx")
    ev.add_argument(
        "--frames",
        nargs="+",
        required=True,
        metavar="SRC",
        help="videos, image folders/files or rtsp:// URLs",
    )
    _common(ev)


def run_export_command(args: argparse.Namespace) -> int:
    """Run ``export`` or ``evaluate``; returns the process exit status."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        if args.command == "export":
            return _export(args)
        return _evaluate(args)
    except EngineError as exc:
        print(f"streamdet {args.command}: {exc}", file=sys.stderr)
        return 2


def _threads(args: argparse.Namespace) -> int:
    from engines.registry import default_threads

    return default_threads(1, int(args.threads))


def _export(args: argparse.Namespace) -> int:
    from engines.export import ExportRequest, export_model

    request = ExportRequest(
        model=args.model,
        out=args.out,
        precision=args.precision,
        imgsz=args.imgsz,
        calib=tuple(args.calib),
        calib_frames=args.calib_frames,
        calib_method=args.calib_method,
        target=args.target,
        high_precision=args.high_precision,
        exclude_nodes=DEFAULT_EXCLUDE if args.exclude_nodes is None else tuple(args.exclude_nodes),
        finetune_steps=args.finetune_steps,
        cache_dir=args.cache_dir or _default_cache_dir(),
        progress=not args.no_progress,
    )
    from server.cli import unusable_dir

    unusable = unusable_dir(args.out.parent)
    if unusable is not None:  # before the export (minutes, for INT8), not a traceback after
        print(f"streamdet export: --out: {args.out}: {unusable}", file=sys.stderr)
        return 2
    if not _report_writable(args):
        return 2
    sources = args.eval or args.calib
    if not _sources_readable(args, (args.calib, "--calib"), (args.eval, "--eval")):
        return 2
    if args.precision != "fp32" and args.eval_frames > 0 and sources and args.calib:
        from engines.calibration import check_frame_budget

        # Before a fine-tune of many minutes, not after it: the held-out sets must fit in
        # what calibration leaves of the sources.
        try:
            check_frame_budget(
                args.calib, args.calib_frames, sources, args.eval_frames, max(1, args.eval_sets)
            )
        except CalibrationError as exc:
            print(f"streamdet export: accuracy report: {exc}", file=sys.stderr)
            return 2
    result = export_model(request)
    print(f"wrote {result.path} ({result.precision}; FP32 reference {result.reference})")
    if args.eval_frames <= 0 or result.precision == "fp32":
        return 0
    if not sources:
        print("no --eval sources: accuracy report skipped", file=sys.stderr)
        return 0
    return _report(args, result.path, result.reference, sources)


def _sources_readable(args: argparse.Namespace, *given: tuple[list[str] | None, str]) -> bool:
    """Whether each flag's frame sources exist and their videos can be read, checked before
    the export or evaluation (an unreadable one failed after them, with a traceback); prints
    why not."""
    try:
        for specs, flag in given:
            if specs:
                check_sources(specs, flag)
    except CalibrationError as exc:
        print(f"streamdet {args.command}: {exc}", file=sys.stderr)
        return False
    return True


def _report_writable(args: argparse.Namespace) -> bool:
    """Whether ``--report`` can be written, checked before the export and evaluation (it
    failed with a traceback after them); prints why not."""
    if args.report is None:
        return True
    from server.cli import unusable_dir

    report: Path = args.report
    problem = "a directory, not a file" if report.is_dir() else unusable_dir(report.parent)
    if problem is None and report.exists() and not os.access(report, os.W_OK):
        problem = "not writable"
    if problem is None:
        return True
    print(f"streamdet {args.command}: --report: {report}: {problem}", file=sys.stderr)
    return False


def _evaluate(args: argparse.Namespace) -> int:
    from engines.model import resolve_onnx

    if not _report_writable(args):
        return 2
    if not _sources_readable(args, (args.frames, "--frames")):
        return 2
    imgsz = args.imgsz or 640
    reference = resolve_onnx(
        args.reference, args.cache_dir or _default_cache_dir(), imgsz, flag="--reference"
    )
    return _report(args, Path(args.model), reference, args.frames)


def _report(args: argparse.Namespace, candidate: Path, reference: Path, sources: list[str]) -> int:
    from engines.evaluate import evaluate_artifact

    try:
        reports = evaluate_artifact(
            candidate,
            reference,
            sources,
            frames=args.eval_frames,
            sets=max(1, int(args.eval_sets)),
            threads=_threads(args),
            imgsz=args.imgsz,
            progress=not args.no_progress,
            flag=_sources_flag(args),
        )
    except CalibrationError as exc:
        print(f"streamdet {args.command}: accuracy report: {exc}", file=sys.stderr)
        return 2
    return _print_report(args, reports)


def _sources_flag(args: argparse.Namespace) -> str:
    """The flag that named the accuracy report's frames."""
    if args.command == "evaluate":
        return "--frames"
    return "--eval" if args.eval else "--calib"


def _print_report(args: argparse.Namespace, reports: list[EvalReport]) -> int:
    """Print each held-out set's table and a verdict; write the JSON report. Passing means
    every set's recall and precision are at least ``--min-score``."""
    for report in reports:
        print(report.format())
    figures = ", ".join(
        f"set {r.held_out_set + 1}: recall {r.recall:.3f} / precision {r.precision:.3f}"
        for r in reports
    )
    passed = all(r.passed(args.min_score) for r in reports)
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        body: dict[str, Any] = {
            **reports[0].to_json(),
            "min_score": args.min_score,
            "passed": passed,
            "sets": [r.to_json() for r in reports],
        }
        args.report.write_text(json.dumps(body, indent=2) + "\n")
    if passed:
        print(f"PASS ({figures}) >= {args.min_score}")
        return 0
    print(
        f"FAIL ({figures}): below {args.min_score} on"
        f" {sum(not r.passed(args.min_score) for r in reports)} of {len(reports)} held-out sets:"
        " try more --finetune-steps or --calib-frames, calibration frames closer to the"
        " cameras served, or more sensitive layers kept in float"
        " (--exclude-nodes yolo-head REGEX...)",
        file=sys.stderr,
    )
    return EXIT_BELOW_BAR
