"""The device layer the GPU engines share: one instance per worker thread.

Everything on the device comes from PyTorch (already installed with Ultralytics), not pycuda,
which ships no Linux wheels and needs the CUDA toolkit to build. Per worker:

* one ``torch.cuda.Stream``: all of the worker's copies and kernels run on it, so two workers
  overlap (one uploads and post-processes while the other's model runs);
* pinned host staging buffers, grown when needed and reused across batches, and
  ``non_blocking`` host-to-device copies from them;
* letterbox and normalise on the device from the uint8 frames (the host only memcpys);
* class-aware batched NMS on the device, then one device-to-host copy of the kept boxes;
* CUDA events instead of device-wide synchronisation: the host waits only for its own
  stream's work (``Event.synchronize``), never ``torch.cuda.synchronize()``;
* CUDA graphs for fixed batch-size buckets: a batch is padded up to its bucket (1, 2, 4, 8, …)
  so a handful of captured graphs cover every batch size.

The same code runs on ``device="cpu"`` (no stream, no pinning, no graphs), which is how its
letterbox and NMS are checked against :mod:`engines.yolo` on a machine without a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from engines.registry import ConfiguredEngine, EngineConfig, fixed_shape
from engines.types import Detections, DetectParams, EngineError, Image
from engines.yolo import MAX_NMS, MAX_WH, PAD_VALUE, LetterboxMeta, group_by_shape

log = logging.getLogger(__name__)

RESIZE_ONE = 1 << 11  # OpenCV's INTER_RESIZE_COEF_SCALE

Frame = Image | torch.Tensor
"""A host RGB ``(H, W, 3)`` uint8 array, or the same as a tensor already on the device."""


# ---- device ---------------------------------------------------------------------------------
def resolve_device(name: str) -> torch.device:
    """The torch device for ``name`` (``cpu``, ``cuda``, ``cuda:N``).

    Raises:
        EngineError: a CUDA device was asked for and none is usable; the message says why.
    """
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise EngineError(
            f"device {name!r} is not a torch device (setting STREAMDET_DEVICE)"
        ) from exc
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise EngineError(f"device {name!r}: GPU backends run on cuda or cuda:N (STREAMDET_DEVICE)")
    if torch.version.cuda is None:
        raise EngineError(
            f"no CUDA device: this torch {torch.__version__} is a CPU-only build;"
            " install a CUDA build of torch or pick --backend onnxruntime"
        )
    if not torch.cuda.is_available():
        raise EngineError(
            f"no CUDA device: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU"
            " (driver missing or CUDA_VISIBLE_DEVICES empty); pick --backend onnxruntime"
        )
    index = device.index or 0
    count = torch.cuda.device_count()
    if index >= count:
        raise EngineError(
            f"device {name!r}: only {count} CUDA device(s) visible (STREAMDET_DEVICE)"
        )
    if (reason := unsupported_capability(index)) is not None:
        raise EngineError(reason)
    return torch.device("cuda", index)


def unsupported_capability(index: int) -> str | None:
    """Why this torch build has no kernels for CUDA device ``index``, or ``None`` if it has.

    A cubin runs on GPUs of its major compute capability and the same or a higher minor one
    (``sm_80`` on 8.0 and 8.6, not on 7.5 or 9.0); PTX (``compute_XY``) is compiled at load
    for any capability from ``X.Y`` up. Without either, the device is visible but its first
    kernel fails ("no kernel image is available for execution on the device"), mid-warmup.
    """
    archs = torch.cuda.get_arch_list()
    if not archs:  # a build that does not say: let its first kernel tell
        return None
    major, minor = torch.cuda.get_device_capability(index)
    for arch in archs:
        kind, _, digits = arch.partition("_")
        number = "".join(c for c in digits if c.isdigit())
        if not number:
            continue
        arch_major, arch_minor = divmod(int(number), 10)
        if kind == "sm" and arch_major == major and arch_minor <= minor:
            return None
        if kind == "compute" and (arch_major, arch_minor) <= (major, minor):
            return None
    return (
        f"CUDA device {index} ({torch.cuda.get_device_name(index)}) has compute capability"
        f" {major}.{minor}, which this torch {torch.__version__} (CUDA {torch.version.cuda})"
        f" has no kernels for (built for {' '.join(archs)}): install a torch build for"
        f" sm_{major}{minor}, or pick --backend onnxruntime"
    )


# ---- batch buckets --------------------------------------------------------------------------
def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """Batch sizes that get a captured graph: powers of two below ``max_batch``, and it.

    Padding a batch of 5 to 8 wastes at most half a batch of compute on the smallest buckets and
    under a quarter from 8 up, while capturing every size would cost one graph (and its memory
    pool) per size.
    """
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = [1 << i for i in range(max_batch.bit_length()) if (1 << i) < max_batch]
    return (*sizes, max_batch)


def bucket_for(size: int, buckets: Sequence[int]) -> int:
    """Smallest bucket holding ``size`` items.

    Raises:
        ValueError: ``size`` is below 1 or above the largest bucket.
    """
    for bucket in buckets:
        if bucket >= size >= 1:
            return bucket
    raise ValueError(
        f"batch of {size} does not fit buckets {tuple(buckets)} (setting STREAMDET_MAX_BATCH)"
    )


# ---- letterbox ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Placement:
    """Where a source image lands in the network input (same rounding as ``yolo.letterbox``)."""

    new_h: int
    new_w: int
    top: int
    left: int
    meta: LetterboxMeta


def placement(height: int, width: int, shape: tuple[int, int], imgsz: int) -> Placement:
    """Scale and offset of an ``height x width`` image letterboxed into ``shape``."""
    gain = min(imgsz / height, imgsz / width, shape[0] / height, shape[1] / width)
    new_w, new_h = max(1, round(width * gain)), max(1, round(height * gain))  # never 0: 1x5000
    dw, dh = (shape[1] - new_w) / 2, (shape[0] - new_h) / 2
    top, left = round(dh - 0.1), round(dw - 0.1)
    meta = LetterboxMeta(gain=gain, pad_x=left, pad_y=top, width=width, height=height)
    return Placement(new_h=new_h, new_w=new_w, top=top, left=left, meta=meta)


@functools.lru_cache(maxsize=64)
def _linear_taps(src: int, dst: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """OpenCV's INTER_LINEAR taps: source indices and 11-bit fixed-point weights.

    Cached per size pair and device: a camera's frames all need the same taps, and building
    them is a dozen small kernels.
    """
    pos = (torch.arange(dst, dtype=torch.float64, device=device) + 0.5) * (src / dst) - 0.5
    frac = pos.to(torch.float32)  # OpenCV computes the position in float
    first = torch.floor(frac)
    frac = frac - first
    idx = first.to(torch.int64)
    edge = (idx < 0) | (idx >= src - 1)
    frac = torch.where(edge, torch.zeros_like(frac), frac)
    idx = idx.clamp(0, src - 1)
    w0 = torch.round((1.0 - frac) * RESIZE_ONE).to(torch.int32)
    w1 = torch.round(frac * RESIZE_ONE).to(torch.int32)
    return idx, (idx + 1).clamp(max=src - 1), w0[:, None], w1[:, None]


def resize_linear(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """``cv2.resize(image, (width, height), interpolation=cv2.INTER_LINEAR)`` on any device.

    A float bilinear resize differs from OpenCV by one grey level on ~5% of pixels, and that
    alone moved a borderline detection's confidence by 0.03 on the car clip; this integer
    version reproduces OpenCV's fixed-point arithmetic (11-bit weights, the vector path's
    shifts) and is bit-exact for downscaling (checked against cv2 in the tests).

    Args:
        image: ``(h, w, C)`` uint8, or ``(N, h, w, C)``: a batch of same-size frames resized
            in one pass (the same kernels whatever N).
        height: output rows.
        width: output columns.

    Returns:
        ``(height, width, C)`` (or ``(N, height, width, C)``) uint8.
    """
    h, w = int(image.shape[-3]), int(image.shape[-2])
    x0, x1, ax0, ax1 = _linear_taps(w, width, image.device)
    y0, y1, by0, by1 = _linear_taps(h, height, image.device)
    # Columns first, gathered as uint8 so the int32 intermediate is output-wide, not input-wide.
    left = image.index_select(-2, x0).to(torch.int32)
    right = image.index_select(-2, x1).to(torch.int32)
    rows = left.mul_(ax0).add_(right.mul_(ax1)).bitwise_right_shift_(4)  # scaled by 2^7
    top = rows.index_select(-3, y0).mul_(by0[:, None]).bitwise_right_shift_(16)
    bottom = rows.index_select(-3, y1).mul_(by1[:, None]).bitwise_right_shift_(16)
    return top.add_(bottom).add_(2).bitwise_right_shift_(2).clamp_(0, 255).to(torch.uint8)


def letterbox_into(
    frames: Sequence[torch.Tensor], out: torch.Tensor, imgsz: int
) -> list[LetterboxMeta]:
    """Letterbox uint8 ``(h, w, 3)`` RGB frames into ``out[:len(frames)]``, scaled to ``[0, 1]``.

    ``out`` is a ``(bucket, 3, H, W)`` float tensor on the frames' device; rows past the frames
    (bucket padding) are filled with the pad grey so they never produce NaNs. The resize is
    :func:`resize_linear`, so the network sees the pixels the CPU engine's letterbox gives it.
    Frames of one size (a camera's, or cameras of one resolution) are resized and written
    together: the kernels launched per batch grow with the number of distinct sizes, not frames.
    """
    if len(frames) > out.shape[0]:
        raise ValueError(f"{len(frames)} frames do not fit a batch buffer of {out.shape[0]}")
    shape = (int(out.shape[2]), int(out.shape[3]))
    out.fill_(PAD_VALUE / 255.0)
    metas: list[LetterboxMeta] = []
    sizes: dict[tuple[int, int], list[int]] = {}
    for i, frame in enumerate(frames):
        h, w = int(frame.shape[0]), int(frame.shape[1])
        metas.append(placement(h, w, shape, imgsz).meta)
        sizes.setdefault((h, w), []).append(i)
    for (h, w), idxs in sizes.items():
        p = placement(h, w, shape, imgsz)
        group = frames[idxs[0]][None] if len(idxs) == 1 else torch.stack([frames[i] for i in idxs])
        if (p.new_h, p.new_w) != (h, w):
            group = resize_linear(group, p.new_h, p.new_w)
        pixels = group.permute(0, 3, 1, 2).to(out.dtype).mul_(1.0 / 255.0)
        region = (slice(p.top, p.top + p.new_h), slice(p.left, p.left + p.new_w))
        if idxs == list(range(idxs[0], idxs[0] + len(idxs))):  # a run: a plain slice
            out[idxs[0] : idxs[0] + len(idxs), :, region[0], region[1]] = pixels
        else:
            rows = torch.tensor(idxs, dtype=torch.long).to(out.device, non_blocking=True)
            out[rows, :, region[0], region[1]] = pixels
    return metas


# ---- per-worker workspace ---------------------------------------------------------------------
STAGE_SHARE_BYTES = 4 << 20
"""A batch is copied into staging by several threads only where each gets at least this."""


def default_copy_threads() -> int:
    """Threads that copy one batch into staging: a quarter of the cores, 1 to 4.

    The memcpy is most of ``infer``'s host time for camera frames (32 frames of 768x432 are
    32 MB); numpy copies without the interpreter lock, so threads split it (into a plain
    array, 2 threads took 3.6 -> 2.0 ms for those 32 frames on a 2-core machine, where this
    still says 1: the cores there are the decoders' and the engines')."""
    return max(1, min(4, (os.cpu_count() or 1) // 4))


def _copy_into(staging: np.ndarray, jobs: Sequence[tuple[int, Image]]) -> None:
    for offset, im in jobs:
        staging[offset : offset + im.nbytes] = np.ascontiguousarray(im).reshape(-1)


def _shares(jobs: list[tuple[int, Image]], total: int, parts: int) -> list[list[tuple[int, Image]]]:
    """``jobs`` cut into ``parts`` runs of about equal bytes (frames whole, in order)."""
    shares: list[list[tuple[int, Image]]] = [[]]
    done = 0
    for job in jobs:
        if done >= total * len(shares) / parts and len(shares) < parts:
            shares.append([])
        shares[-1].append(job)
        done += int(job[1].nbytes)
    return shares


class DeviceWorkspace:
    """One worker's stream, pinned staging buffers and events.

    Args:
        device: where the model runs; on ``cpu`` there is no stream, pinning or event.
        copy_threads: threads that copy a batch into staging, the worker's own among them
            (``None``: :func:`default_copy_threads`).
    """

    def __init__(self, device: torch.device, copy_threads: int | None = None) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.copy_threads = default_copy_threads() if copy_threads is None else copy_threads
        self._copiers: ThreadPoolExecutor | None = None
        self.stream: torch.cuda.Stream | None = None
        self._staging = torch.empty(0, dtype=torch.uint8)
        self._device_frames = torch.empty(0, dtype=torch.uint8, device=device)
        self._result_host = torch.empty(0, dtype=torch.float32)
        self._uploaded: torch.cuda.Event | None = None
        self._downloaded: torch.cuda.Event | None = None
        if self.cuda:
            self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            self._uploaded = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._downloaded = torch.cuda.Event()  # type: ignore[no-untyped-call]

    def _host_buffer(self, current: torch.Tensor, size: int, dtype: torch.dtype) -> torch.Tensor:
        if current.numel() >= size:
            return current
        # Grow to the next power of two so a slowly growing batch does not re-pin every time.
        capacity = 1 << max(20, math.ceil(math.log2(max(size, 1))))
        return torch.empty(capacity, dtype=dtype, pin_memory=self.cuda)

    def stage(self, host: Sequence[Image]) -> tuple[list[int], int]:
        """Copy ``host`` into the staging buffer (pinned on CUDA), one after the other; numpy
        copies outside the interpreter lock. Returns each image's byte offset and the total."""
        total = sum(int(im.nbytes) for im in host)
        if self._uploaded is not None:
            self._uploaded.synchronize()  # the previous batch's copy has left the staging buffer
        self._staging = self._host_buffer(self._staging, total, torch.uint8)
        staging_np = self._staging.numpy()
        offsets: list[int] = []
        offset = 0
        for im in host:
            offsets.append(offset)
            offset += int(im.nbytes)
        jobs = list(zip(offsets, host, strict=True))
        parts = min(self.copy_threads, len(jobs), total // STAGE_SHARE_BYTES)
        if parts < 2:
            _copy_into(staging_np, jobs)
            return offsets, total
        if self._copiers is None:
            self._copiers = ThreadPoolExecutor(
                self.copy_threads - 1, thread_name_prefix="stage-copy"
            )
        mine, *theirs = _shares(jobs, total, parts)
        futures = [self._copiers.submit(_copy_into, staging_np, share) for share in theirs]
        _copy_into(staging_np, mine)
        for future in futures:
            future.result()
        return offsets, total

    def close(self) -> None:
        """Let the copy threads go."""
        if self._copiers is not None:
            self._copiers.shutdown(wait=False)
            self._copiers = None

    def upload(self, images: Sequence[Frame]) -> list[torch.Tensor]:
        """Device views ``(h, w, 3)`` uint8 of ``images``: one pinned memcpy, one async copy."""
        host: list[Image] = [im for im in images if not isinstance(im, torch.Tensor)]
        if not self.cuda or not host:
            return [
                im.to(self.device)
                if isinstance(im, torch.Tensor)
                else torch.from_numpy(im if im.flags.writeable else im.copy())
                for im in images
            ]
        offsets, total = self.stage(host)
        if self._device_frames.numel() < total:
            self._device_frames = torch.empty(
                self._staging.numel(), dtype=torch.uint8, device=self.device
            )
        self._device_frames[:total].copy_(self._staging[:total], non_blocking=True)
        if self._uploaded is not None:
            self._uploaded.record()
        views: list[torch.Tensor] = []
        it = iter(zip(host, offsets, strict=True))
        for frame in images:
            if isinstance(frame, torch.Tensor):
                views.append(frame.to(self.device, non_blocking=True))
                continue
            arr, off = next(it)
            views.append(self._device_frames[off : off + arr.nbytes].view(arr.shape))
        return views

    def postprocess(
        self,
        output: torch.Tensor,
        metas: Sequence[LetterboxMeta],
        params: Sequence[DetectParams],
        names: Mapping[int, str],
    ) -> list[Detections]:
        """Decode a ``(B, 4 + nc, anchors)`` head output with batched NMS on the device.

        Same semantics as :func:`engines.yolo.postprocess_one`: candidates by best class score
        above ``conf``, class filter, class-aware greedy NMS, ``max_det`` per image, boxes mapped
        back to source pixels. Images are kept apart by offsetting boxes by image along y while
        classes are offset along x (both by ``MAX_WH``), so one NMS call serves the batch.
        """
        batch = len(metas)
        out = output[:batch].float()
        nc = out.shape[1] - 4
        dev = out.device
        conf = torch.tensor([p.conf for p in params], dtype=torch.float32).to(
            dev, non_blocking=True
        )
        best, cls = out[:, 4:].max(dim=1)  # (B, A)
        # A box of NaN or infinity (an FP16 overflow) is no detection (yolo.postprocess_one)
        mask = (best > conf[:, None]) & torch.isfinite(out[:, :4]).all(dim=1)
        if any(p.classes is not None for p in params):
            allowed = torch.ones((batch, nc), dtype=torch.bool)
            for i, p in enumerate(params):
                if p.classes is not None:
                    allowed[i] = False
                    allowed[i, [c for c in p.classes if 0 <= c < nc]] = True
            mask &= torch.gather(allowed.to(dev, non_blocking=True), 1, cls)
        img, anchor = mask.nonzero(as_tuple=True)  # the one unavoidable sync: a dynamic size
        if img.numel() == 0:
            return [Detections.empty(names, m.width, m.height) for m in metas]
        scores = best[img, anchor]
        classes = cls[img, anchor]
        xywh = out[img, :4, anchor]
        boxes = torch.cat((xywh[:, :2] - xywh[:, 2:] / 2, xywh[:, :2] + xywh[:, 2:] / 2), dim=1)
        if out.shape[2] > MAX_NMS:  # only above imgsz ~1200 can an image have more candidates
            scores, boxes, classes, img = _cap_candidates(scores, boxes, classes, img, batch)
        keep = _batched_nms(boxes, scores, classes, img, [p.iou for p in params])
        max_det = torch.tensor([p.max_det for p in params], dtype=torch.long).to(
            dev, non_blocking=True
        )
        keep = _first_per_image(keep, img, max_det, batch)
        kept = (boxes[keep], scores[keep], classes[keep], img[keep])
        return self._to_host(kept, metas, names)

    def _to_host(
        self,
        kept: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        metas: Sequence[LetterboxMeta],
        names: Mapping[int, str],
    ) -> list[Detections]:
        boxes, scores, classes, img = kept
        dev = boxes.device
        gain = torch.tensor([m.gain for m in metas], dtype=torch.float32).to(dev, non_blocking=True)
        pad = torch.tensor([[m.pad_x, m.pad_y] for m in metas], dtype=torch.float32).to(
            dev, non_blocking=True
        )
        size = torch.tensor([[m.width, m.height] for m in metas], dtype=torch.float32).to(
            dev, non_blocking=True
        )
        xy = (boxes.view(-1, 2, 2) - pad[img, None, :]) / gain[img, None, None]
        xy = torch.minimum(xy.clamp(min=0), size[img, None, :])
        packed = torch.cat(
            (xy.reshape(-1, 4), scores[:, None], classes[:, None].float(), img[:, None].float()),
            dim=1,
        )
        if self.cuda and self._downloaded is not None:
            self._result_host = self._host_buffer(self._result_host, packed.numel(), torch.float32)
            host = self._result_host[: packed.numel()].view(packed.shape)
            host.copy_(packed, non_blocking=True)
            self._downloaded.record()
            self._downloaded.synchronize()  # waits for this stream only, not the device
            rows = host.numpy().copy()
        else:
            rows = packed.numpy()
        # Rows come grouped by image (score order within one): each image's detections are
        # one slice of shared arrays, not a mask over all rows per image (the per-image loop
        # holds the interpreter lock: 0.29 -> 0.11 ms for 32 images here).
        owner = rows[:, 6].astype(np.int64)
        order = np.argsort(owner, kind="stable")  # already sorted: a no-op kept for safety
        rows, owner = rows[order], owner[order]
        bounds = np.searchsorted(owner, np.arange(len(metas) + 1)).tolist()
        xyxy = np.ascontiguousarray(rows[:, :4], dtype=np.float32)
        confidences = np.ascontiguousarray(rows[:, 4], dtype=np.float32)
        class_ids = rows[:, 5].astype(np.int32)
        return [
            Detections(
                boxes=xyxy[start:end],
                scores=confidences[start:end],
                class_ids=class_ids[start:end],
                names=names,
                width=m.width,
                height=m.height,
            )
            for start, end, m in zip(bounds[:-1], bounds[1:], metas, strict=True)
        ]


def _batched_nms(
    boxes: torch.Tensor,
    scores: torch.Tensor,
    classes: torch.Tensor,
    img: torch.Tensor,
    ious: Sequence[float],
) -> torch.Tensor:
    """Indices kept by class- and image-aware NMS, in descending score order."""
    from torchvision.ops import nms

    offset = torch.stack((classes.float(), img.float()), dim=1).repeat(1, 2) * MAX_WH
    shifted = boxes + offset
    distinct = sorted(set(ious))
    if len(distinct) == 1:
        kept_one: torch.Tensor = nms(shifted, scores, distinct[0])
        return kept_one
    # Requests with different IoU thresholds share a batch only rarely: one call per value.
    iou_of = torch.tensor(ious, dtype=torch.float32, device=boxes.device)[img]
    kept = []
    for value in distinct:
        idx = (iou_of == value).nonzero(as_tuple=True)[0]
        kept.append(idx[nms(shifted[idx], scores[idx], value)])
    keep = torch.cat(kept)
    return keep[torch.argsort(scores[keep], descending=True, stable=True)]


def _first_per_image(
    keep: torch.Tensor, img: torch.Tensor, max_det: torch.Tensor, batch: int
) -> torch.Tensor:
    """The first ``max_det[i]`` of ``keep`` (score order) for each image ``i``, in a few tensor
    operations instead of a loop over the images (the mask at the end waits for the device
    once, as NMS's own result does)."""
    owner = img[keep]
    order = torch.sort(owner, stable=True).indices  # by image, score order kept within one
    keep, owner = keep[order], owner[order]
    counts = torch.bincount(owner, minlength=batch)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(keep.numel(), device=keep.device) - starts[owner]
    return keep[rank < max_det[owner]]


def _cap_candidates(
    scores: torch.Tensor, boxes: torch.Tensor, classes: torch.Tensor, img: torch.Tensor, batch: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keep each image's ``MAX_NMS`` best candidates, as the CPU path does."""
    order = torch.argsort(scores, descending=True, stable=True)
    order = order[torch.sort(img[order], stable=True).indices]
    owner = img[order]
    counts = torch.bincount(owner, minlength=batch)
    rank = (
        torch.arange(order.numel(), device=order.device) - (torch.cumsum(counts, 0) - counts)[owner]
    )
    sel = order[rank < MAX_NMS]
    return scores[sel], boxes[sel], classes[sel], img[sel]


# ---- captured forward passes ---------------------------------------------------------------------
Forward = Callable[[torch.Tensor], torch.Tensor]
_CAPTURE_LOCK = threading.Lock()
CAPTURE_RETRY_S = 60.0
"""A bucket whose graph capture ran out of GPU memory is captured again after this long,
twice as long after each such failure, up to ``CAPTURE_RETRY_MAX_S``."""
CAPTURE_RETRY_MAX_S = 1800.0


class BucketRunner:
    """Runs ``forward`` on static ``(bucket, 3, H, W)`` input buffers, replaying CUDA graphs.

    Each ``(bucket, H, W)`` gets its own input buffer and, on CUDA with ``use_graphs``, its own
    graph captured on first use (after two eager warm-up passes on the worker's stream). At most
    ``max_graphs`` are kept; the least recently used is dropped with its memory pool.
    (Entering a capture synchronizes the device once, in ``torch.cuda.graph``; replays do not.)

    Args:
        forward: the model on a ``(B, 3, H, W)`` tensor; must keep shapes static.
        workspace: the worker's device, stream and events.
        dtype: the model's input dtype.
        use_graphs: capture CUDA graphs (ignored on CPU).
        max_graphs: most captured graphs kept.
    """

    def __init__(
        self,
        forward: Forward,
        workspace: DeviceWorkspace,
        dtype: torch.dtype,
        use_graphs: bool = True,
        max_graphs: int = 12,
    ) -> None:
        self._forward = forward
        self._ws = workspace
        self._dtype = dtype
        self._use_graphs = use_graphs and workspace.cuda
        self._max_graphs = max_graphs
        self._slots: OrderedDict[tuple[int, int, int], _Slot] = OrderedDict()

    @property
    def captured(self) -> int:
        """How many graphs are held now."""
        return sum(1 for s in self._slots.values() if s.graph is not None)

    @property
    def use_graphs(self) -> bool:
        """Whether this worker still captures graphs (a failed capture turns them off)."""
        return self._use_graphs

    def input_for(self, bucket: int, shape: tuple[int, int]) -> torch.Tensor:
        """The static input buffer of this bucket and shape (fill it, then :meth:`run`)."""
        return self._slot(bucket, shape).inputs

    def run(self, bucket: int, shape: tuple[int, int]) -> torch.Tensor:
        """Run the model on the bucket's input buffer; the output is valid until the next run."""
        slot = self._slot(bucket, shape)
        if slot.graph is not None and slot.output is not None:
            slot.graph.replay()
            return slot.output
        if not self._use_graphs or time.monotonic() < slot.retry_at:
            return self._forward(slot.inputs)
        return self._capture(slot, bucket, shape)

    def _slot(self, bucket: int, shape: tuple[int, int]) -> _Slot:
        key = (bucket, shape[0], shape[1])
        slot = self._slots.get(key)
        if slot is None:
            inputs = torch.zeros((bucket, 3, *shape), dtype=self._dtype, device=self._ws.device)
            slot = self._slots[key] = _Slot(inputs)
            while len(self._slots) > self._max_graphs:
                old_key, _ = self._slots.popitem(last=False)
                log.info("dropping captured graph for batch %d at %dx%d", *old_key)
        self._slots.move_to_end(key)
        return slot

    def _capture(self, slot: _Slot, bucket: int, shape: tuple[int, int]) -> torch.Tensor:
        stream = self._ws.stream
        if stream is None:
            raise EngineError("CUDA graphs need a CUDA stream")
        for _ in range(2):  # cuDNN/cuBLAS pick their kernels before capture, not inside it
            out = self._forward(slot.inputs)
        graph = torch.cuda.CUDAGraph()
        try:
            # One capture at a time, and "thread_local" so the other workers' syncs and
            # copies, legal outside this stream, keep running while this one captures.
            with (
                _CAPTURE_LOCK,
                torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"),
            ):
                slot.output = self._forward(slot.inputs)
        except RuntimeError as exc:
            if not _out_of_memory(exc):
                # An op of the model's that cannot be captured, or a capture that could not be
                # ended (invalidated: an allocation under memory pressure can do it too): on
                # some torch versions the latter leaves the allocator's pool or capture state
                # behind, so no capture is tried again on this worker.
                log.warning(
                    "CUDA graph capture failed (%s); this worker runs every batch eagerly", exc
                )
                self._use_graphs = False
                return out
            # The GPU was full at that moment (other workers' buckets, another process): this
            # bucket runs eagerly and is captured again later, waiting twice as long after
            # each such failure; the others keep their graphs. (Any failure turned graphs off
            # for every bucket of the worker for good.)
            slot.failures += 1
            wait = min(CAPTURE_RETRY_S * 2 ** (slot.failures - 1), CAPTURE_RETRY_MAX_S)
            slot.retry_at, slot.output = time.monotonic() + wait, None
            log.warning(
                "CUDA graph capture for batch %d at %dx%d ran out of GPU memory (%s); running"
                " it eagerly, captured again in %.0f s",
                bucket,
                *shape,
                str(exc).splitlines()[0],
                wait,
            )
            return out
        slot.graph = graph
        log.info("captured CUDA graph for batch %d at %dx%d", bucket, *shape)
        graph.replay()
        return slot.output


def _out_of_memory(exc: BaseException) -> bool:
    """Whether a capture failed because the GPU was out of memory, and nothing worse: the
    capture's own allocation (``OutOfMemoryError``) or instantiation (``CUDA error: out of
    memory``), raised as it is. Where ending the capture raised over it (invalidated), the
    allocator may hold the capture's pool or think a capture is still going on (PyTorch
    issues 159594, 180395, 190348): that is not retried."""
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc)


class _Slot:
    __slots__ = ("failures", "graph", "inputs", "output", "retry_at")

    def __init__(self, inputs: torch.Tensor) -> None:
        self.inputs = inputs
        self.graph: torch.cuda.CUDAGraph | None = None
        self.output: torch.Tensor | None = None
        self.retry_at = 0.0
        """Monotonic time before which it runs eagerly (its capture ran out of memory)."""
        self.failures = 0
        """Its captures that ran out of memory (each doubles the wait before the next)."""


# ---- the Engine protocol on top of the layer ----------------------------------------------------
class GpuDetector(ConfiguredEngine):
    """:class:`engines.types.Engine` for runtimes on the device layer; one per worker thread.

    Subclasses implement :meth:`_open` (load the runtime, return its forward pass and input
    dtype). Images are grouped by letterbox shape exactly as the CPU engine does, so a frame's
    result never depends on what it was batched with, then run in bucket-padded chunks.
    """

    def __init__(self, config: EngineConfig, use_graphs: bool = True) -> None:
        super().__init__(config)
        self._use_graphs = use_graphs
        self._dynamic_hw = config.model.dynamic_hw
        # A graph whose batch is fixed (Ultralytics' batch=8 export: its Reshapes hold the 8)
        # takes that batch alone: every chunk is padded up to it, as to any bucket.
        fixed = config.model.fixed_batch
        self._buckets = (fixed,) if fixed is not None else batch_buckets(self.max_batch)
        self._ws: DeviceWorkspace | None = None
        self._runner: BucketRunner | None = None

    @property
    def device(self) -> torch.device:
        """Where the model runs (after :meth:`load`)."""
        if self._ws is None:
            raise EngineError("engine used before load()")
        return self._ws.device

    def _open(self, device: torch.device) -> tuple[Forward, torch.dtype]:
        raise NotImplementedError

    def _clamp_shape(self, shape: tuple[int, int]) -> tuple[int, int]:
        """The input shape a letterbox shape runs at (a runtime may have a minimum)."""
        return shape

    def load(self) -> None:
        """Resolve the device, load the runtime and set up this worker's stream and buffers.

        Raises:
            EngineError: no usable device or runtime; the message says which and what to change.
        """
        device = resolve_device(self._config.device)
        workspace = DeviceWorkspace(device)
        with self._on_stream(workspace):
            forward, dtype = self._open(device)
        self._ws = workspace
        self._runner = BucketRunner(forward, workspace, dtype, use_graphs=self._use_graphs)

    def warmup(self) -> None:
        """Run (and on CUDA capture) every batch bucket once at the square input shape and,
        for a model that takes rectangular inputs, at a 16:9 camera frame's letterbox shape:
        a capture costs tens of milliseconds, which must not land on a live camera's first
        frames of each batch size."""
        frames = [np.full((self._imgsz, self._imgsz, 3), PAD_VALUE, np.uint8)]
        if self._dynamic_hw:
            frames.append(np.full((self._imgsz * 9 // 16, self._imgsz, 3), PAD_VALUE, np.uint8))
        for frame in frames:
            for bucket in self._buckets:
                self.infer([frame] * bucket, [DetectParams()] * bucket)
        started = time.monotonic()  # one square frame again, warm: warm_item_s
        self.infer(frames[:1], [DetectParams()])
        self.warm_item_s = time.monotonic() - started

    def infer(self, images: Sequence[Frame], params: Sequence[DetectParams]) -> list[Detections]:
        """Detections for each image (host arrays or device tensors), one params each."""
        if self._ws is None or self._runner is None:
            raise EngineError("engine used before load()")
        if len(images) != len(params):
            raise ValueError(f"{len(images)} images but {len(params)} parameter sets")
        ws, runner, info = self._ws, self._runner, self._config.model
        results: list[Detections | None] = [None] * len(images)
        groups = group_by_shape(
            images,  # type: ignore[arg-type]
            self._imgsz,
            info.stride,
            self._dynamic_hw,
            fixed_shape(info),
        )
        with torch.inference_mode(), self._on_stream(ws):
            frames = ws.upload(images)
            for group_shape, idxs in groups.items():
                shape = self._clamp_shape(group_shape)
                for start in range(0, len(idxs), self.max_batch):
                    chunk = idxs[start : start + self.max_batch]
                    bucket = bucket_for(len(chunk), self._buckets)
                    inputs = runner.input_for(bucket, shape)
                    metas = letterbox_into([frames[i] for i in chunk], inputs, self._imgsz)
                    output = runner.run(bucket, shape)
                    dets = ws.postprocess(output, metas, [params[i] for i in chunk], info.names)
                    for i, det in zip(chunk, dets, strict=True):
                        results[i] = det
        return [d for d in results if d is not None]

    def close(self) -> None:
        if self._ws is not None:
            self._ws.close()
        self._runner = None
        self._ws = None

    @staticmethod
    @contextlib.contextmanager
    def _on_stream(workspace: DeviceWorkspace) -> Iterator[None]:
        if workspace.stream is None:
            yield
            return
        with torch.cuda.device(workspace.device), torch.cuda.stream(workspace.stream):
            yield
