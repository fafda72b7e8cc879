"""PyTorch backend: the Ultralytics ``.pt`` model run by PyTorch, FP16 on CUDA; or its
``.torchscript`` export, where Ultralytics is not installed.

Why the ``.pt`` first and not the ONNX or the TorchScript trace: PyTorch cannot run an ONNX
graph, and Ultralytics' TorchScript export traces the anchor grid of one input size (640x640),
so a 16:9 camera frame has to run square (1.67x the pixels of its 640x384 letterbox). Loaded
through Ultralytics' own modules the model takes any stride-multiple input, so this engine
letterboxes to the same rectangular shapes as the CPU engine and its boxes match it. A
``.torchscript`` loads with plain ``torch.jit.load``: it runs at its traced square size, and the
CPU engine, given the same file, does too (see :mod:`engines.model`). The ONNX export of the
same file still provides the names and stride (``EngineConfig.model``), like for every backend.

``device="cpu"`` also works (FP32, no stream, no graphs): it is how the parity suite checks this
engine's device-side letterbox and NMS on a machine without a GPU.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from engines.gpu import Forward, GpuDetector
from engines.model import load_torchscript, torchscript_input_size
from engines.registry import EngineConfig
from engines.types import EngineError, ModelError, ModelInfo

log = logging.getLogger(__name__)
TORCH_SUFFIXES = (".pt", ".torchscript")


def find_checkpoint(config: EngineConfig) -> Path:
    """The ``.pt`` file this engine runs: the model as given, or its downloaded copy.

    Raises:
        ModelError: the model was given as ONNX or the checkpoint cannot be found.
    """
    source = config.source
    if source is None or source.suffix.lower() not in TORCH_SUFFIXES:
        raise ModelError(
            "backend torch runs an Ultralytics .pt checkpoint or .torchscript export, got"
            f" {source or config.model.path}; pass --model file.pt, or pick --backend"
            " tensorrt / onnxruntime for an .onnx model"
        )
    for candidate in (source.expanduser(), config.cache_dir / "weights" / source.name):
        if candidate.is_file():
            return candidate
    raise ModelError(f"model {source}: file not found (setting STREAMDET_MODEL / --model)")


def load_detection_model(path: Path, device: torch.device) -> torch.nn.Module:
    """Load a fused Ultralytics detection model in eval mode on ``device``.

    Raises:
        ModelError: not a loadable Ultralytics detection checkpoint.
    """
    os.environ.setdefault("YOLO_OFFLINE", "true")
    os.environ.setdefault("YOLO_AUTOINSTALL", "false")
    os.environ.setdefault("YOLO_VERBOSE", "false")
    try:
        from ultralytics.nn.tasks import DetectionModel, load_checkpoint
    except ImportError as exc:
        raise EngineError(
            f"backend torch needs the ultralytics package to load {path}: {exc}"
        ) from exc
    try:
        with warnings.catch_warnings():  # torch.load chatter must not fail a load
            warnings.simplefilter("ignore")
            model, _ = load_checkpoint(str(path), device="cpu", fuse=True)
    except Exception as exc:
        raise ModelError(f"model {path}: cannot load as an Ultralytics checkpoint: {exc}") from exc
    if not isinstance(model, DetectionModel) or type(model).__name__ != "DetectionModel":
        raise ModelError(
            f"model {path}: is a {type(model).__name__}; streamdet serves detection models"
        )
    model = model.to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    module: torch.nn.Module = model
    return module


def checkpoint_info(path: Path, imgsz: int = 640) -> ModelInfo:
    """Names and stride straight from a ``.pt`` or ``.torchscript`` (no ONNX export): for
    machines with PyTorch but no exporter, such as the GPU check."""
    if path.suffix.lower() == ".torchscript":
        _, meta = load_torchscript(path)
        return ModelInfo(
            path=str(path),
            names={int(k): str(v) for k, v in meta.get("names", {}).items()},
            imgsz=torchscript_input_size(meta, imgsz),
            stride=int(meta.get("stride", 32)),
            dynamic_hw=False,
            precision="fp16",
        )
    model = load_detection_model(path, torch.device("cpu"))
    names = {int(k): str(v) for k, v in getattr(model, "names", {}).items()}
    stride = int(getattr(model, "stride", torch.tensor([32])).max())
    return ModelInfo(
        path=str(path),
        names=names,
        imgsz=(imgsz, imgsz),
        stride=stride,
        dynamic_hw=True,
        precision="fp16",
    )


class AnchorsPerShape:
    """The detection head's anchor grid kept per input shape, so CUDA graphs can capture it.

    Ultralytics' head rebuilds its grid when the input shape changes, with ``torch.arange`` on
    the host copied to the device: inside a graph capture that copy is illegal ("Cannot copy
    between CPU and CUDA tensors during CUDA graph capture"), and a graph captured at one shape
    would read a grid the next shape's rebuild freed. So the grid each shape got in its eager
    pass (the runner runs two before capturing) is stored and put back before every later
    call at that shape: no rebuild happens inside a capture, and every captured graph's grid
    stays alive.

    The grid depends on the picture's height and width, not on the batch, so it is kept per
    ``(H, W)`` and serves every batch bucket: one grid a letterbox shape (at most twice
    ``imgsz / stride`` of them, about 100 kB each at 640), all kept. (Kept per batch shape and
    capped at 64, a 65th shape's grid was rebuilt and then freed by the next shape while a
    graph captured at it still read it.)
    """

    def __init__(self, model: Any) -> None:
        self._model = model  # Ultralytics' DetectionModel (untyped)
        self._head: Any = model.model[-1]
        self._head.dynamic = False
        self._grids: dict[tuple[int, int], tuple[object, object, tuple[int, ...]]] = {}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        key = (int(x.shape[-2]), int(x.shape[-1]))
        grid = self._grids.get(key)
        if grid is not None:
            anchors, strides, feature = grid
            # The head rebuilds its grid whenever its first feature map's shape changes,
            # batch included: told this batch's shape, it keeps the grid put back.
            self._head.anchors, self._head.strides = anchors, strides
            self._head.shape = torch.Size((int(x.shape[0]), *feature))
        out = self._model(x)
        if grid is None:
            head = self._head
            self._grids[key] = (head.anchors, head.strides, tuple(head.shape[1:]))
        pred: torch.Tensor = out[0] if isinstance(out, tuple | list) else out
        return pred


def _load(path: Path, device: torch.device, dtype: torch.dtype) -> Forward:
    """The model's forward pass on ``device`` in ``dtype``, from a ``.pt`` or ``.torchscript``."""
    if path.suffix.lower() != ".torchscript":
        return AnchorsPerShape(load_detection_model(path, device).to(dtype))
    traced = load_torchscript(path, device)[0].to(dtype)

    def run_traced(x: torch.Tensor) -> torch.Tensor:
        # The plain interpreter (a thread-local switch): the profiling executor would
        # re-optimize, and compile fused kernels, during the first calls, and one of those
        # may be a CUDA graph capture.
        with torch.jit.optimized_execution(False):  # type: ignore[attr-defined]
            out: torch.Tensor = traced(x)
        return out

    return run_traced


class TorchEngine(GpuDetector):
    """The Ultralytics model on PyTorch: FP16 with CUDA graphs on a GPU, FP32 eager on CPU.

    Args:
        config: model metadata, sizes, device (``cuda``, ``cuda:N`` or ``cpu``) and source file.
        use_graphs: capture CUDA graphs per batch bucket (CUDA only).
    """

    def _open(self, device: torch.device) -> tuple[Forward, torch.dtype]:
        path = find_checkpoint(self._config)
        dtype = torch.float16 if device.type == "cuda" else torch.float32
        model = _load(path, device, dtype)
        log.info(
            "torch engine: %s on %s (%s, graphs %s)",
            path,
            device,
            dtype,
            self._use_graphs and device.type == "cuda",
        )

        def forward(x: torch.Tensor) -> torch.Tensor:
            out = model(x)
            pred: torch.Tensor = out[0] if isinstance(out, tuple | list) else out
            return pred

        return forward, dtype
