"""Calibration and evaluation frames: sampled evenly from videos, image folders or RTSP URLs,
and letterboxed exactly as inference does (``engines.yolo``).

Frames are chosen by index so an evaluation can take frames that calibration did not see:
calibration takes evenly spaced indices of each file source and records them (in the ONNX
metadata, see ``engines.export``); evaluation takes evenly spaced indices among the rest. A
live RTSP source has no indices; its evaluation frames are simply later frames.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from engines.types import EngineError, Image
from engines.yolo import preprocess, rect_shape
from streams.files import (
    IMAGE_SUFFIXES,
    VIDEO_SUFFIXES,
    iter_video_frames,
    load_image,
    video_frame_count,
)

log = logging.getLogger(__name__)

LIVE_SCHEMES = ("rtsp://", "rtsps://", "rtmp://", "http://", "https://", "udp://", "srt://")
LIVE_STEP = 5  # a live source gives every 5th decoded frame, so samples are not near-duplicates
LIVE_TIMEOUT_S = 10.0


class CalibrationError(EngineError):
    """The calibration sources are missing, unreadable or give too few frames."""


@dataclass(frozen=True, slots=True)
class FrameSource:
    """One place frames come from.

    Attributes:
        kind: ``video``, ``images`` (a folder or one image) or ``live`` (a URL).
        location: the path or URL as given.
        name: the key recorded in metadata (file or folder name; the URL without credentials).
    """

    kind: str
    location: str
    name: str


@dataclass(slots=True)
class SourceSample:
    """Which frames of one source were taken (indices for files, ``None`` for live ones)."""

    name: str
    kind: str
    total: int | None
    indices: list[int] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "total": self.total, "indices": self.indices}


@dataclass(slots=True)
class FrameSample:
    """Frames taken from a set of sources, in source order, and where each came from."""

    frames: list[Image]
    sources: list[SourceSample]


def parse_sources(specs: Sequence[str], flag: str = "--calib") -> list[FrameSource]:
    """Turn ``--calib`` (or ``flag``'s) arguments into sources.

    Raises:
        CalibrationError: a path that does not exist or is neither a video, an image nor a
            folder of images.
    """
    sources: list[FrameSource] = []
    for spec in specs:
        if spec.lower().startswith(LIVE_SCHEMES):
            name = spec.split("@", 1)[-1] if "@" in spec else spec.split("://", 1)[-1]
            sources.append(FrameSource("live", spec, name))
            continue
        path = Path(spec).expanduser()
        if path.is_dir():
            if not _folder_images(path):
                raise CalibrationError(
                    f"{_purpose(flag)} source {spec}: folder holds no images"
                    f" ({', '.join(sorted(IMAGE_SUFFIXES))});"
                    f" pass videos, images or RTSP URLs to {flag}"
                )
            sources.append(FrameSource("images", str(path), path.name))
        elif path.is_file() and path.suffix.lower() in VIDEO_SUFFIXES:
            sources.append(FrameSource("video", str(path), path.name))
        elif path.is_file() and path.suffix.lower() in IMAGE_SUFFIXES:
            sources.append(FrameSource("images", str(path), path.name))
        elif not path.exists():
            raise CalibrationError(
                f"{_purpose(flag)} source {spec}: no such file, folder or URL ({flag})"
            )
        else:
            raise CalibrationError(
                f"{_purpose(flag)} source {spec}: expected a video"
                f" ({', '.join(sorted(VIDEO_SUFFIXES))}), an image, a folder of images"
                f" or an rtsp:// URL ({flag})"
            )
    if not sources:
        raise CalibrationError(
            f"no {_purpose(flag)} sources; pass videos, image folders or RTSP URLs with {flag}"
        )
    return sources


def check_sources(specs: Sequence[str], flag: str) -> None:
    """That ``flag``'s sources exist and their videos can be read, before an export or an
    evaluation of minutes (an unreadable one failed after them, with a traceback).

    Raises:
        CalibrationError: naming the source and ``flag``.
    """
    for source in parse_sources(specs, flag):
        try:
            source_length(source)
        except CalibrationError as exc:
            raise CalibrationError(f"{_purpose(flag)} source {exc} ({flag})") from None


def _purpose(flag: str) -> str:
    return "calibration" if flag == "--calib" else "evaluation"


def check_frame_budget(
    calib: Sequence[str], calib_frames: int, evals: Sequence[str], eval_frames: int, sets: int
) -> None:
    """Refuse, before anything is exported, evaluation sources too short for ``sets`` held-out
    sets of ``eval_frames`` frames besides the ``calib_frames`` calibration frames (taken from
    the sources of the same name). Live sources are unbounded and pass.

    Raises:
        CalibrationError: too few frames, naming ``--eval-frames``; or a bad source.
    """
    calib_sources = parse_sources(calib)
    calib_caps = [source_length(s) for s in calib_sources]
    taken: dict[str, int] = {}
    for src, n in zip(calib_sources, share(calib_frames, calib_caps), strict=True):
        taken[src.name] = taken.get(src.name, 0) + n
    same = list(evals) == list(calib)
    eval_sources = calib_sources if same else parse_sources(evals, "--eval")
    caps: list[int | None] = []
    for src in eval_sources:
        total = source_length(src)
        caps.append(None if total is None else max(0, total - taken.pop(src.name, 0)))
    wanted = eval_frames * sets
    available = sum(share(wanted, caps))
    if available < wanted:
        raise CalibrationError(
            f"evaluation needs {wanted} frames ({sets} set(s) of {eval_frames}) but the sources"
            f" give only {available} besides the {calib_frames} calibration frames: add"
            " sources (--eval), lower --eval-frames or --eval-sets, or pass --eval-frames 0 to"
            " skip the accuracy report"
        )


def _folder_images(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)


def source_length(source: FrameSource) -> int | None:
    """Frames a file source holds; ``None`` for a live source.

    Raises:
        CalibrationError: a video FFmpeg cannot read (a traceback, after an export).
    """
    if source.kind == "video":
        try:
            return video_frame_count(source.location)
        except Exception as exc:  # PyAV raises its own error family
            raise CalibrationError(
                f"video {source.location}: not a video FFmpeg can read ({exc})"
            ) from exc
    if source.kind == "images":
        return len(_folder_images(Path(source.location)))
    return None


def even_indices(candidates: Sequence[int], count: int) -> list[int]:
    """``count`` indices spread evenly over ``candidates`` (all of them if fewer)."""
    if count >= len(candidates):
        return list(candidates)
    if count <= 0:
        return []
    picks = np.linspace(0, len(candidates) - 1, count).round().astype(int)
    return [candidates[int(i)] for i in picks]


def share(count: int, capacities: Sequence[int | None]) -> list[int]:
    """Split ``count`` over sources as evenly as their capacities allow (``None``: unbounded).

    A short source's remainder goes to the others; each round fills or closes a source, so
    the loop ends.
    """
    shares = [0] * len(capacities)
    left = count
    while left > 0:
        open_ = [i for i, cap in enumerate(capacities) if cap is None or shares[i] < cap]
        if not open_:
            break
        each, extra = divmod(left, len(open_))
        for rank, i in enumerate(open_):
            want = each + (1 if rank < extra else 0)
            cap = capacities[i]
            room = want if cap is None else min(want, cap - shares[i])
            shares[i] += room
            left -= room
    return shares


def sample_frames(
    sources: Sequence[FrameSource],
    count: int,
    exclude: Mapping[str, Sequence[int]] | None = None,
    purpose: str = "calibration",
    progress: bool = True,
) -> FrameSample:
    """Take ``count`` frames spread evenly over ``sources``, skipping ``exclude``'s indices.

    Args:
        sources: from :func:`parse_sources`.
        count: frames wanted in total; each source gets an even share, a short source's
            remainder goes to the others.
        exclude: per source name, indices that must not be taken (e.g. calibration frames
            when sampling evaluation frames).
        purpose: ``calibration`` or ``evaluation``, for messages and the progress bar.
        progress: show a progress bar on stderr.

    Raises:
        CalibrationError: the sources hold fewer than ``count`` usable frames, or one cannot
            be read.
    """
    if count < 1:
        raise CalibrationError(f"{purpose} needs at least 1 frame, got {count}")
    exclude = exclude or {}
    candidates: list[list[int] | None] = []
    for src in sources:
        total = source_length(src)
        if total is None:
            candidates.append(None)
            continue
        skip = set(exclude.get(src.name, ()))
        candidates.append([i for i in range(total) if i not in skip])
    capacities = [None if c is None else len(c) for c in candidates]
    shares = share(count, capacities)
    available = sum(shares)
    if available < count:
        flag = "--calib-frames" if purpose == "calibration" else "--eval-frames"
        held = sum(len(v) for v in exclude.values())
        raise CalibrationError(
            f"{purpose} needs {count} frames but the sources give only {available}"
            + (f" (after setting aside {held} frames used elsewhere)" if held else "")
            + f": add sources or lower the frame count ({flag})"
        )
    bar = progress_bar(count, f"sampling {purpose} frames", progress)
    frames: list[Image] = []
    records: list[SourceSample] = []
    try:
        for src, cands, n in zip(sources, candidates, shares, strict=True):
            if n == 0:
                continue
            record = SourceSample(
                src.name,
                src.kind,
                None if cands is None else len(cands) + len(exclude.get(src.name, ())),
            )
            got = _read_source(
                src, None if cands is None else even_indices(cands, n), n, record, bar
            )
            if len(got) < n:
                raise CalibrationError(
                    f"{purpose} source {src.name}: expected {n} frames, read only {len(got)}"
                    " (the file may be truncated or the stream ended)"
                )
            frames.extend(got)
            records.append(record)
    finally:
        bar.close()
    log.info(
        "%s: %d frames from %s",
        purpose,
        len(frames),
        ", ".join(f"{r.name} ({len(r.indices) or 'live'})" for r in records),
    )
    return FrameSample(frames, records)


def _read_source(
    src: FrameSource, indices: list[int] | None, n: int, record: SourceSample, bar: Any
) -> list[Image]:
    frames: list[Image] = []
    if src.kind == "images":
        files = _folder_images(Path(src.location))
        for i in indices or []:
            try:
                frames.append(load_image(files[i]))
            except OSError as exc:
                raise CalibrationError(f"calibration image {files[i]}: unreadable ({exc})") from exc
            record.indices.append(i)
            bar.update(1)
        return frames
    if src.kind == "video":
        wanted = set(indices or [])
        last = max(wanted) if wanted else -1
        try:
            for i, frame in enumerate(iter_video_frames(src.location)):
                if i in wanted:
                    frames.append(frame)
                    record.indices.append(i)
                    bar.update(1)
                if i >= last:
                    break
        except Exception as exc:  # PyAV raises its own error family
            raise CalibrationError(f"video {src.location}: cannot decode ({exc})") from exc
        return frames
    for frame in _iter_live(src.location, n):
        frames.append(frame)
        bar.update(1)
    return frames


def _iter_live(url: str, n: int) -> Iterator[Image]:
    """Every ``LIVE_STEP``-th frame of a live stream, ``n`` of them, over TCP for RTSP."""
    import av

    options = {"rtsp_transport": "tcp"} if url.lower().startswith(("rtsp://", "rtsps://")) else {}
    try:
        container = av.open(url, options=options, timeout=LIVE_TIMEOUT_S)
    except Exception as exc:
        scheme, _, rest = url.partition("://")
        where = f"{scheme}://{rest.rsplit('@', maxsplit=1)[-1]}"  # no credentials in messages
        reason = str(exc).replace(url, where)
        raise CalibrationError(f"live source {where}: cannot open ({reason})") from None
    produced = 0
    with container:
        stream = container.streams.video[0]
        for index, frame in enumerate(container.decode(stream)):
            if index % LIVE_STEP:
                continue
            yield np.asarray(frame.to_ndarray(format="rgb24"), np.uint8)
            produced += 1
            if produced >= n:
                return


class _NoBar:
    def update(self, n: int) -> None:
        del n

    def close(self) -> None:
        return None


def progress_bar(total: int, desc: str, enabled: bool, unit: str = "frame") -> Any:
    """A tqdm bar on stderr, or a silent stand-in when ``enabled`` is false."""
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, leave=False)


def input_shape(
    frames: Sequence[Image],
    imgsz: int,
    stride: int,
    dynamic_hw: bool,
    fixed: tuple[int, int] | None = None,
) -> tuple[int, int]:
    """The one ``(H, W)`` calibration runs at.

    A dynamic-shape model serves each frame at its own rect shape; when every calibration
    frame shares one (frames of one camera, or clips of one aspect ratio) calibration uses
    it, so the activations seen are the ones served. Mixed aspect ratios use the square
    ``imgsz`` input, which holds any letterboxed frame (the grey border is what inference
    pads with too). A fixed-shape model always runs at its own ``(H, W)``: ``fixed``, else
    ``(imgsz, imgsz)``.
    """
    if not dynamic_hw:
        return fixed or (imgsz, imgsz)
    shapes = {rect_shape(f.shape[0], f.shape[1], imgsz, stride) for f in frames}
    return shapes.pop() if len(shapes) == 1 else (imgsz, imgsz)


class FrameReader:
    """Feeds letterboxed frames, one batch at a time, to an ONNX Runtime / ModelOpt calibrator.

    Implements ``onnxruntime.quantization.CalibrationDataReader``'s ``get_next`` and
    ``rewind`` (and ModelOpt's ``get_first``). Frames are letterboxed lazily so 256 frames
    cost their uint8 size, not a float32 copy; the bar advances as the calibrator consumes
    them. ``batch`` is the graph's fixed batch (an ``export(batch=8)`` runs batches of 8 only):
    the last batch is filled up with the first frames again, never with blank ones, which
    would shift the activation ranges calibrated.
    """

    def __init__(
        self,
        frames: Sequence[Image],
        imgsz: int,
        shape: tuple[int, int],
        *,
        input_name: str = "images",
        progress: bool = True,
        batch: int = 1,
    ) -> None:
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        self._frames = frames
        self._imgsz = imgsz
        self._shape = shape
        self._input_name = input_name
        self._progress = progress
        self._batch = batch
        self._pos = 0
        self._bar: Any = None

    def tensor(self, i: int) -> npt.NDArray[np.float32]:
        """Frame ``i`` as a ``(1, 3, H, W)`` float32 input."""
        blob, _ = preprocess([self._frames[i]], self._imgsz, self._shape)
        return blob

    def _batch_at(self, start: int) -> npt.NDArray[np.float32]:
        idx = [(start + k) % len(self._frames) for k in range(self._batch)]
        blob, _ = preprocess([self._frames[i] for i in idx], self._imgsz, self._shape)
        return blob

    def get_first(self) -> dict[str, npt.NDArray[np.float32]]:
        return {self._input_name: self._batch_at(0)}

    def get_next(self) -> dict[str, npt.NDArray[np.float32]] | None:
        if self._pos == 0 and self._bar is None:
            self._bar = progress_bar(len(self._frames), "calibrating", self._progress)
        if self._pos >= len(self._frames):
            if self._bar is not None:
                self._bar.close()
                self._bar = None
            return None
        item = {self._input_name: self._batch_at(self._pos)}
        step = min(self._batch, len(self._frames) - self._pos)
        self._pos += step
        self._bar.update(step)
        return item

    def rewind(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._pos = 0

    def __len__(self) -> int:
        return len(self._frames)
