"""Accuracy and speed of an exported artifact against the FP32 model, on the CPU.

The FP32 model's detections are the reference: a candidate detection is a true positive
when it has the same class and IoU >= 0.5 with a reference detection not matched yet
(greedy, highest confidence first, as in COCO matching). Recall = matched / reference
detections, precision = matched / candidate detections, per class and overall. Both models
run through the serving engine (``OrtEngine``: same letterbox, same NMS), one frame at a
time, alternating, so a busy machine slows both alike.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engines.calibration import FrameSample, parse_sources, sample_frames
from engines.model import read_model_info
from engines.registry import EngineConfig
from engines.types import Detections, DetectParams, Engine, Image, ModelError, ModelInfo
from engines.yolo import box_iou

log = logging.getLogger(__name__)

MATCH_IOU = 0.5


@dataclass(slots=True)
class ClassStats:
    """Counts of one class. ``reference``: FP32 detections; ``candidate``: the artifact's."""

    name: str
    reference: int = 0
    candidate: int = 0
    matched: int = 0

    @property
    def recall(self) -> float:
        return self.matched / self.reference if self.reference else 1.0

    @property
    def precision(self) -> float:
        return self.matched / self.candidate if self.candidate else 1.0


@dataclass(slots=True)
class EvalReport:
    """What :func:`evaluate` found. Times are medians per frame, pre/post included, at batch 1
    (a graph whose batch is fixed: at that ``batch``, per frame of it)."""

    reference: str
    candidate: str
    precision_label: str
    frames: int
    conf: float
    threads: int
    classes: dict[int, ClassStats] = field(default_factory=dict)
    reference_ms: float = float("nan")
    candidate_ms: float = float("nan")
    held_out_set: int = 0
    batch: int = 1
    class_swaps: int = 0
    """Missed FP32 detections the candidate has as the same box under another class (an
    ambiguous object whose top class flipped): each costs recall and precision at once."""

    @property
    def total(self) -> ClassStats:
        out = ClassStats("all")
        for c in self.classes.values():
            out.reference += c.reference
            out.candidate += c.candidate
            out.matched += c.matched
        return out

    @property
    def recall(self) -> float:
        return self.total.recall

    @property
    def precision(self) -> float:
        return self.total.precision

    @property
    def speedup(self) -> float:
        return self.reference_ms / self.candidate_ms if self.candidate_ms else float("nan")

    def passed(self, bar: float) -> bool:
        """Overall recall and precision both at least ``bar``."""
        return self.recall >= bar and self.precision >= bar

    def to_json(self) -> dict[str, Any]:
        return {
            "reference": self.reference,
            "candidate": self.candidate,
            "precision": self.precision_label,
            "frames": self.frames,
            "held_out_set": self.held_out_set,
            "conf": self.conf,
            "match_iou": MATCH_IOU,
            "threads": self.threads,
            "batch": self.batch,
            "overall": {"recall": self.recall, "precision": self.precision, **asdict(self.total)},
            "classes": {
                c.name: {"recall": c.recall, "precision": c.precision, **asdict(c)}
                for c in self.classes.values()
            },
            "class_swaps": self.class_swaps,
            "reference_ms": self.reference_ms,
            "candidate_ms": self.candidate_ms,
            "speedup": self.speedup,
        }

    def format(self) -> str:
        """A plain-text table for the terminal."""
        lines = [
            f"{self.precision_label} {Path(self.candidate).name}"
            f" vs FP32 {Path(self.reference).name}:"
            f" held-out set {self.held_out_set + 1}, {self.frames} frames,"
            f" conf {self.conf}, IoU {MATCH_IOU}",
            f"{'class':<16}{'fp32':>7}{'cand':>7}{'match':>7}{'recall':>9}{'precision':>11}",
        ]
        rows = sorted(self.classes.values(), key=lambda c: -c.reference)
        for c in [*rows, self.total]:
            lines.append(
                f"{c.name:<16}{c.reference:>7}{c.candidate:>7}{c.matched:>7}"
                f"{c.recall:>9.3f}{c.precision:>11.3f}"
            )
        missed = self.total.reference - self.total.matched
        lines.append(
            f"of {missed} missed FP32 detections, {self.class_swaps} are the same box under"
            " another class (top-class swaps on ambiguous objects)"
        )
        lines.append(
            f"speed (batch {self.batch}, {self.threads} threads, median per frame):"
            f" FP32 {self.reference_ms:.1f} ms,"
            f" {self.precision_label} {self.candidate_ms:.1f} ms, speed-up x{self.speedup:.2f}"
        )
        return "\n".join(lines)


def match(reference: Detections, candidate: Detections, stats: dict[int, ClassStats]) -> None:
    """Add one frame's counts to ``stats`` (greedy matching, candidates by confidence)."""
    for cid in set(reference.class_ids.tolist()) | set(candidate.class_ids.tolist()):
        entry = stats.setdefault(cid, ClassStats(reference.names.get(cid, str(cid))))
        ref = reference.boxes[reference.class_ids == cid]
        cand_mask = candidate.class_ids == cid
        cand = candidate.boxes[cand_mask]
        order = np.argsort(-candidate.scores[cand_mask], kind="stable")
        entry.reference += len(ref)
        entry.candidate += len(cand)
        if not len(ref) or not len(cand):
            continue
        ious = box_iou(cand[order], ref)
        taken = np.zeros(len(ref), bool)
        for row in ious:
            free = np.where(taken, -1.0, row)
            j = int(free.argmax())
            if free[j] >= MATCH_IOU:
                taken[j] = True
                entry.matched += 1


def class_swaps(reference: Detections, candidate: Detections) -> int:
    """Reference detections with no candidate of their class at IoU >= ``MATCH_IOU`` but one
    of another class there: the box was found, its top class flipped."""
    if not len(reference) or not len(candidate):
        return 0
    ious = box_iou(reference.boxes, candidate.boxes) >= MATCH_IOU
    same = reference.class_ids[:, None] == candidate.class_ids[None, :]
    found_same = (ious & same).any(axis=1)
    found_other = (ious & ~same).any(axis=1)
    return int((found_other & ~found_same).sum())


def _engine(path: Path, imgsz: int, threads: int) -> Engine:
    from engines.onnxruntime import OrtEngine

    config = EngineConfig(model=read_model_info(path), imgsz=imgsz, max_batch=1, threads=threads)
    engine = OrtEngine(config)
    engine.load()
    engine.warmup()
    return engine


def evaluate(
    reference: Path,
    candidate: Path,
    frames: Sequence[Image],
    *,
    imgsz: int,
    threads: int,
    conf: float = 0.25,
) -> EvalReport:
    """Run both ONNX files on ``frames`` and compare the candidate with the reference.

    Args:
        reference: the FP32 ONNX file (its detections count as ground truth).
        candidate: the exported artifact.
        frames: RGB frames not used for calibration.
        imgsz: inference size, as served.
        threads: ONNX Runtime intra-op threads for each model.
        conf: confidence threshold of both (the ``/detect`` default).
    """
    (report,) = evaluate_sets(
        reference, candidate, [frames], imgsz=imgsz, threads=threads, conf=conf
    )
    return report


def check_same_classes(reference: Path, candidate: Path) -> ModelInfo:
    """The candidate's info, once its class names are the reference's: detections are matched
    by class id, so another class set would compare unrelated classes (or none at all).

    Raises:
        ModelError: the names differ, saying how.
    """
    ref, cand = read_model_info(reference).names, read_model_info(candidate)
    if dict(ref) != dict(cand.names):
        differ = sorted(i for i in set(ref) | set(cand.names) if ref.get(i) != cand.names.get(i))
        shown = ", ".join(
            f"{i}: {ref.get(i, '-')!s} vs {cand.names.get(i, '-')!s}" for i in differ[:5]
        )
        raise ModelError(
            f"model {candidate} ({len(cand.names)} classes) and reference {reference}"
            f" ({len(ref)} classes) detect different classes ({shown}"
            f"{', ...' if len(differ) > 5 else ''}): pass the FP32 model this artifact was"
            " exported from as --reference"
        )
    return cand


def evaluate_sets(
    reference: Path,
    candidate: Path,
    frame_sets: Sequence[Sequence[Image]],
    *,
    imgsz: int,
    threads: int,
    conf: float = 0.25,
) -> list[EvalReport]:
    """:func:`evaluate` on each of ``frame_sets`` (one report per set), loading each model once.

    Raises:
        ModelError: the two models detect different classes.
    """
    info = check_same_classes(reference, candidate)
    params = [DetectParams(conf=conf)]
    ref_engine, cand_engine = _engine(reference, imgsz, threads), _engine(candidate, imgsz, threads)
    # A graph whose batch is fixed runs every batch padded up to it: timed one frame at a
    # time, it would be charged its whole batch for each frame.
    batch = max(read_model_info(reference).fixed_batch or 1, info.fixed_batch or 1)
    reports: list[EvalReport] = []
    try:
        for index, frames in enumerate(frame_sets):
            report = EvalReport(
                reference=str(reference),
                candidate=str(candidate),
                precision_label=info.precision.upper(),
                frames=len(frames),
                conf=conf,
                threads=threads,
                held_out_set=index,
                batch=batch,
            )
            ref_times: list[float] = []
            cand_times: list[float] = []
            for start in range(0, len(frames), batch):
                chunk = frames[start : start + batch]
                t0 = time.perf_counter()
                ref_all = ref_engine.infer(chunk, params * len(chunk))
                t1 = time.perf_counter()
                cand_all = cand_engine.infer(chunk, params * len(chunk))
                t2 = time.perf_counter()
                ref_times.append((t1 - t0) / len(chunk))
                cand_times.append((t2 - t1) / len(chunk))
                for ref_dets, cand_dets in zip(ref_all, cand_all, strict=True):
                    match(ref_dets, cand_dets, report.classes)
                    report.class_swaps += class_swaps(ref_dets, cand_dets)
            if frames:
                report.reference_ms = statistics.median(ref_times) * 1000
                report.candidate_ms = statistics.median(cand_times) * 1000
            log.info(
                "evaluate %s, held-out set %d: recall %.3f precision %.3f over %d frames",
                candidate,
                index + 1,
                report.recall,
                report.precision,
                len(frames),
            )
            reports.append(report)
    finally:
        ref_engine.close()
        cand_engine.close()
    return reports


def calibration_record(path: Path) -> dict[str, Any] | None:
    """The calibration summary an INT8 artifact carries (``streamdet_calibration``), or ``None``."""
    raw = read_model_info(path).extra.get("streamdet_calibration")
    if not raw:
        return None
    record: dict[str, Any] = json.loads(raw)
    return record


def calibration_indices(path: Path) -> Mapping[str, Sequence[int]]:
    """Per source name, the frame indices ``path`` was calibrated on, to hold them out."""
    record = calibration_record(path) or {}
    return {s["name"]: list(s.get("indices") or []) for s in record.get("sources", [])}


def held_out_sets(
    sources: Sequence[str],
    frames: int,
    sets: int,
    exclude: Mapping[str, Sequence[int]],
    *,
    progress: bool = True,
    flag: str = "--eval",
) -> list[FrameSample]:
    """``sets`` disjoint samples of ``frames`` frames each, none of them in ``exclude``.

    Set ``k`` is sampled evenly over what ``exclude`` and sets ``0..k-1`` left, so set 0 is
    the same whatever ``sets`` is, and each further set is a fresh, disjoint look.

    Raises:
        CalibrationError: the sources hold too few frames besides the excluded ones.
    """
    held: dict[str, list[int]] = {name: list(idx) for name, idx in exclude.items()}
    parsed = parse_sources(sources, flag)
    out: list[FrameSample] = []
    for _ in range(sets):
        sample = sample_frames(
            parsed, frames, exclude=held, purpose="evaluation", progress=progress
        )
        for record in sample.sources:
            held.setdefault(record.name, []).extend(record.indices)
        out.append(sample)
    return out


def evaluate_artifact(
    candidate: Path,
    reference: Path,
    sources: Sequence[str],
    *,
    frames: int,
    threads: int,
    sets: int = 1,
    imgsz: int | None = None,
    conf: float = 0.25,
    progress: bool = True,
    flag: str = "--eval",
) -> list[EvalReport]:
    """Evaluate ``candidate`` against ``reference`` on ``sets`` disjoint sets of ``frames``
    frames of ``sources`` that the candidate was not calibrated on (its
    ``streamdet_calibration`` metadata says which); one report per set.

    Raises:
        CalibrationError: the sources (``flag``'s) hold too few frames besides the
            calibration ones.
        ModelError: the two models detect different classes.
    """
    size = imgsz or read_model_info(candidate).imgsz[0]
    check_same_classes(reference, candidate)
    samples = held_out_sets(
        sources, frames, sets, calibration_indices(candidate), progress=progress, flag=flag
    )
    return evaluate_sets(
        reference,
        candidate,
        [s.frames for s in samples],
        imgsz=size,
        threads=threads,
        conf=conf,
    )
