"""TensorRT backend: a serialized engine built from the ONNX, bound to the device layer's tensors.

Works on TensorRT 10.x and 11.x. TensorRT 11 removed the precision builder flags and the INT8
calibrators: a network is always strongly typed and runs in the precision its ONNX carries
(FP16 from ModelOpt AutoCast, INT8 from explicit Q/DQ). So the build sets no precision flag on
either version; 10.x gets ``NetworkDefinitionCreationFlag.STRONGLY_TYPED`` for the same result.
The batch axis (and, for a dynamic-shape ONNX, height and width) is dynamic, with one
optimization profile; a fixed-shape ONNX (square or not) runs at its own height and width, and
one whose batch is fixed at that batch, every batch padded up to it. Built engines are cached
on disk under a key of everything that makes a plan invalid: ONNX hash, TensorRT version,
GPU, precision, batch range and input sizes.

The workers of a process running one plan on one device share its deserialized engine (one
copy of the weights on the GPU) and each own one execution context made from it. Inputs and
outputs are torch tensors whose addresses are bound with ``set_tensor_address``;
``execute_async_v3`` runs on the worker's CUDA stream (it releases the GIL), and the device
layer captures it in a CUDA graph per batch bucket. NMS stays outside the engine so its
outputs have fixed shapes.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import logging
import os
import shutil
import tempfile
import threading
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from engines.gpu import Forward, GpuDetector, resolve_device
from engines.model import file_sha256
from engines.registry import EngineConfig
from engines.types import EngineError, ModelInfo
from engines.yolo import rect_shape

log = logging.getLogger(__name__)

Shape = tuple[int, int, int, int]
WORKSPACE_BYTES = 4 << 30  # builder scratch; tactics needing more are skipped, not failed


SERVE_INSTEAD = "pick --backend torch / onnxruntime"


def import_tensorrt(instead: str = SERVE_INSTEAD) -> ModuleType:
    """The ``tensorrt`` module.

    Args:
        instead: what the message suggests doing without TensorRT.

    Raises:
        EngineError: TensorRT is not installed, saying how to install it or what to pick instead.
    """
    try:
        return importlib.import_module("tensorrt")
    except ImportError as exc:
        raise EngineError(
            f"TensorRT not installed ({exc}): install the gpu extra (pip install 'streamdet[gpu]',"
            f" TensorRT 10 or 11 from NVIDIA's index) or {instead}"
        ) from exc


def trt_major(version: str) -> int:
    """Major version of a TensorRT version string (``"10.13.0.35"`` -> 10)."""
    try:
        return int(version.split(".", 1)[0])
    except ValueError:
        raise EngineError(f"unrecognised TensorRT version {version!r}") from None


@dataclass(frozen=True, slots=True)
class ProfileShapes:
    """The optimization profile of the image input: ``(B, 3, H, W)`` min, opt and max."""

    min: Shape
    opt: Shape
    max: Shape

    def contains(self, shape: Shape) -> bool:
        return all(lo <= v <= hi for lo, v, hi in zip(self.min, shape, self.max, strict=True))


def profile_shapes(
    max_batch: int,
    imgsz: int,
    stride: int,
    dynamic_hw: bool,
    opt_batch: int | None = None,
    *,
    fixed_hw: tuple[int, int] | None = None,
    fixed_batch: int | None = None,
) -> ProfileShapes:
    """Profile for batches of 1..``max_batch`` letterboxed to at most ``imgsz``.

    A dynamic-shape ONNX gets a height/width range from ``imgsz / 4`` (an image wider than
    4:1 is padded up to it) to ``imgsz``, tuned for 16:9 camera frames (640x384 at 640), the
    common case of a multi-camera server. A fixed-shape ONNX gets only the batch range, at its
    own ``fixed_hw`` (a non-square ``(320, 480)`` export too; else ``imgsz`` square). A graph
    whose batch is fixed (``fixed_batch``: Ultralytics' ``batch=8`` export) gets that batch
    alone: TensorRT refuses a range over a static dimension, and the device layer pads every
    batch up to it.
    """
    if max_batch < 1 or imgsz < stride or imgsz % stride:
        raise ValueError(
            f"need max_batch >= 1 and imgsz a multiple of {stride}, got {max_batch}, {imgsz}"
        )
    if fixed_batch is not None:
        lo_b = opt_b = max_batch = fixed_batch
    else:
        lo_b, opt_b = 1, min(max(opt_batch or max_batch, 1), max_batch)
    if not dynamic_hw:
        h, w = fixed_hw or (imgsz, imgsz)
        return ProfileShapes((lo_b, 3, h, w), (opt_b, 3, h, w), (max_batch, 3, h, w))
    low = max(stride, (imgsz // 4) // stride * stride)
    opt_h, opt_w = rect_shape(1080, 1920, imgsz, stride)
    return ProfileShapes(
        (lo_b, 3, low, low), (opt_b, 3, opt_h, opt_w), (max_batch, 3, imgsz, imgsz)
    )


def model_profile(info: ModelInfo, max_batch: int, imgsz: int) -> ProfileShapes:
    """The profile an engine of ``info`` is built with, the same for ``streamdet export
    --format engine`` and ``serve`` (so one finds the other's cached plan): a fixed-shape
    model at its own ``(H, W)`` and batch, a dynamic one at ``imgsz`` and ``max_batch``."""
    if info.dynamic_hw:
        return profile_shapes(max_batch, imgsz, info.stride, True, fixed_batch=info.fixed_batch)
    return profile_shapes(
        max_batch,
        max(info.imgsz),
        info.stride,
        False,
        fixed_hw=info.imgsz,
        fixed_batch=info.fixed_batch,
    )


@dataclass(frozen=True, slots=True)
class EngineKey:
    """Everything a serialized engine depends on; any change means a rebuild."""

    onnx_sha256: str
    trt_version: str
    gpu: str
    precision: str
    profile: ProfileShapes

    def digest(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:20]

    def path(self, cache_dir: Path, stem: str) -> Path:
        """Where this engine is cached."""
        return cache_dir / "engines" / f"{stem}-{self.digest()}.engine"


def gpu_identity(device: torch.device) -> str:
    """GPU name and compute capability: a plan is only valid on the same model of GPU."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} sm_{major}{minor}"


def build_engine(trt: Any, onnx_path: Path, shapes: ProfileShapes, out: Path) -> Path:
    """Build a strongly typed engine with one dynamic-batch profile and write it to ``out``.

    Raises:
        EngineError: the ONNX does not parse or the build fails; TensorRT's errors are included.
    """
    logger = trt_logger(trt)
    builder = trt.Builder(logger)
    if trt_major(trt.__version__) >= 11:
        network = builder.create_network()  # always strongly typed in 11.x
    else:
        network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise EngineError(f"TensorRT cannot parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, WORKSPACE_BYTES)
    profile = builder.create_optimization_profile()
    profile.set_shape(network.get_input(0).name, shapes.min, shapes.opt, shapes.max)
    config.add_optimization_profile(profile)
    log.info(
        "building TensorRT %s engine from %s, profile %s (minutes)",
        trt.__version__,
        onnx_path,
        shapes,
    )
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise EngineError(
            f"TensorRT failed to build an engine from {onnx_path} (see its log above)"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=out.parent, prefix=".build-", delete=False) as tmp:
        try:
            tmp.write(memoryview(plan))
        except BaseException:  # a full disk: no half-written plan left beside the cache
            Path(tmp.name).unlink(missing_ok=True)
            raise
    os.replace(tmp.name, out)  # concurrent builders: the last complete plan wins, none is torn
    return out


def ensure_engine(config: EngineConfig, device: torch.device, trt: Any) -> Path:
    """The cached engine for ``config`` on ``device``, building it first if needed."""
    info = config.model
    shapes = model_profile(info, config.max_batch, config.imgsz)
    onnx_path = Path(info.path)
    key = EngineKey(
        file_sha256(onnx_path), trt.__version__, gpu_identity(device), info.precision, shapes
    )
    path = key.path(config.cache_dir, onnx_path.stem)
    # Every worker of a pool loads at once: one builds, the others wait for its plan (they
    # each built the same plan at the same time, minutes of GPU and N times the memory).
    with _build_lock(path):
        if path.exists():
            log.info("using cached TensorRT engine %s", path)
            return path
        build_engine(trt, onnx_path, shapes, path)
        path.with_suffix(".json").write_text(json.dumps(asdict(key), indent=2))
    return path


_BUILD_LOCKS: dict[Path, threading.Lock] = {}
_BUILD_LOCKS_GUARD = threading.Lock()


def _build_lock(path: Path) -> threading.Lock:
    with _BUILD_LOCKS_GUARD:
        return _BUILD_LOCKS.setdefault(path.resolve(), threading.Lock())


class LoadedPlan:
    """A deserialized engine and its runtime, shared by the workers of this process that run
    the same plan on the same device: each makes its own execution context from it. One copy
    of the weights on the GPU, and one deserialization, rather than one a worker (a pool of 4
    workers held 4); it is freed with the last forward that keeps it.

    TensorRT 10 and 11 let contexts share the engine's optimization profile (8.6 needed the
    ``PROFILE_SHARING_0806`` preview flag, on by default since 10.0); each context still runs
    on its own worker's thread and stream alone.
    """

    def __init__(self, runtime: Any, engine: Any) -> None:
        self.runtime = runtime
        self.engine = engine
        self._lock = threading.Lock()

    def new_context(self) -> Any:
        """A new execution context (None where its memory could not be allocated), made one
        at a time."""
        with self._lock:
            return self.engine.create_execution_context()


_LOADED: weakref.WeakValueDictionary[tuple[str, int, tuple[int, int, int]], LoadedPlan] = (
    weakref.WeakValueDictionary()
)


@functools.cache
def trt_logger(trt: Any) -> Any:
    """TensorRT's logger, one for the process: the library keeps a single pointer to it, and
    every builder and runtime is to use the same one."""
    return trt.Logger(trt.Logger.WARNING)


def load_plan(trt: Any, plan: Path, device: torch.device) -> LoadedPlan:
    """The engine in ``plan`` on ``device``: deserialized by the first worker to ask, shared
    with the others while any keeps it (a plan written anew since is loaded anew).

    Raises:
        EngineError: TensorRT cannot deserialize it (another version, another GPU, damaged).
    """
    found = plan.stat()  # a plan written anew (os.replace: a new inode) is another plan
    index = device.index
    if index is None:  # "cuda" is the current device: the same GPU as "cuda:N"
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
    key = (str(plan.resolve()), index, (found.st_ino, found.st_size, found.st_mtime_ns))
    with _build_lock(plan):
        loaded = _LOADED.get(key)
        if loaded is not None:
            log.info("tensorrt engine %s: shared with a worker that loaded it", plan)
            return loaded
        runtime = trt.Runtime(trt_logger(trt))
        engine = runtime.deserialize_cuda_engine(plan.read_bytes())
        if engine is None:
            raise EngineError(
                f"TensorRT {trt.__version__} cannot load {plan} (see its log above: built by"
                f" another TensorRT version or for another GPU than {gpu_identity(device)},"
                " or damaged); delete it and it is rebuilt at the next start"
                " (or by streamdet export --format engine)"
            )
        loaded = LoadedPlan(runtime, engine)
        _LOADED[key] = loaded
        return loaded


# TensorRT's I/O types and torch's of the same size; FP8/INT4/FP4 never are an engine's I/O here.
_TORCH_DTYPES = {
    "FLOAT": torch.float32,
    "HALF": torch.float16,
    "BF16": torch.bfloat16,
    "INT8": torch.int8,
    "UINT8": torch.uint8,
    "INT32": torch.int32,
    "INT64": torch.int64,
    "BOOL": torch.bool,
}


def torch_dtype(trt: Any, dtype: Any, name: str, plan: Path) -> torch.dtype:
    """The torch dtype of an I/O tensor of TensorRT type ``dtype`` (its buffer is allocated
    in it, so a wrong one is a wrong size: an INT64 output in float32 would overflow it).

    Raises:
        EngineError: a type with no torch equivalent.
    """
    for member, torch_type in _TORCH_DTYPES.items():
        if getattr(trt.DataType, member, None) == dtype:
            return torch_type
    raise EngineError(
        f"engine {plan}: tensor {name!r} is of TensorRT type {dtype}, which streamdet does not"
        " bind; export the ONNX with float32 or float16 inputs and outputs"
    )


class TensorBindings:
    """The engine's forward pass on torch tensors: the input bound by address, the outputs in
    tensors of their own per input tensor, run on the caller's stream.

    Each input tensor (a bucket's static input: :class:`~engines.gpu.BucketRunner`) gets its
    outputs once, in its eager warm-up before any graph capture, and they live as long as
    it does: a graph captured on them keeps reading them, and when the runner drops the
    bucket (its graph with it) they are freed too. (Kept per input shape for ever, they
    grew by about 178 MB per letterbox shape at max batch 32.)

    Args:
        context: the execution context (one per worker).
        in_name: the image input's name.
        outputs: each output's name and dtype; the first is the detection head.
        device: where the outputs are allocated.
        stream: the CUDA stream to run on (its handle), asked at each call.
        keep: what must outlive the context (the engine, its runtime, aux streams).
        profile: the engine's optimization profile, named when a shape falls outside it.
    """

    def __init__(
        self,
        context: Any,
        in_name: str,
        outputs: dict[str, torch.dtype],
        device: torch.device,
        *,
        stream: Callable[[], int],
        keep: object = None,
        profile: ProfileShapes | None = None,
    ) -> None:
        self._context = context
        self._profile = "(unknown)" if profile is None else f"{profile.min}..{profile.max}"
        self._in_name = in_name
        self._outputs = outputs
        self._out_name = next(iter(outputs))
        self._device = device
        self._stream = stream
        self._keep = keep
        self._bound: dict[tuple[int, tuple[int, ...]], dict[str, torch.Tensor]] = {}

    def __len__(self) -> int:
        """Input tensors with outputs bound now."""
        return len(self._bound)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = tuple(x.shape)
        context = self._context
        if not context.set_input_shape(self._in_name, shape):
            # Outside the engine's profile: its output shapes would be -1s (TensorRT's log
            # above says which bound).
            raise EngineError(
                f"TensorRT refused input shape {shape} for {self._in_name!r}: outside the"
                f" engine's optimization profile {self._profile}; rebuild the engine with a"
                " --max-batch / --imgsz that covers it"
            )
        key = (x.data_ptr(), shape)
        bound = self._bound.get(key)
        if bound is None:  # allocated in the eager warm-up, before any graph capture
            bound = {
                n: torch.empty(tuple(context.get_tensor_shape(n)), device=self._device, dtype=dt)
                for n, dt in self._outputs.items()
            }
            self._bound[key] = bound
            # Freed with the input (the runner's bucket); popped before its memory can be
            # handed out again, so a new tensor at the same address gets outputs anew.
            weakref.finalize(x, self._bound.pop, key, None)
        context.set_tensor_address(self._in_name, x.data_ptr())
        for n, t in bound.items():
            context.set_tensor_address(n, t.data_ptr())
        if not context.execute_async_v3(self._stream()):
            raise EngineError(f"TensorRT execution failed for input {shape}")
        return bound[self._out_name]


class TrtEngine(GpuDetector):
    """A TensorRT engine on the worker's stream, one execution context per worker.

    Args:
        config: model metadata (the ONNX it is built from), sizes, device and cache folder.
        use_graphs: capture ``execute_async_v3`` in CUDA graphs per batch bucket.
    """

    _shapes: ProfileShapes | None = None

    def load(self) -> None:
        """Check TensorRT and the GPU (naming every missing one), then build or load the engine.

        Raises:
            EngineError: TensorRT not installed, no CUDA device, or the build failed.
        """
        problems: list[str] = []
        for check in (import_tensorrt, lambda: resolve_device(self._config.device)):
            try:
                check()
            except EngineError as exc:
                problems.append(str(exc))
        if problems:
            raise EngineError("backend tensorrt cannot load: " + "; ".join(problems))
        super().load()

    def _open(self, device: torch.device) -> tuple[Forward, torch.dtype]:
        trt = import_tensorrt()
        if device.type != "cuda":
            raise EngineError("backend tensorrt runs on a CUDA device (setting STREAMDET_DEVICE)")
        info = self._config.model
        self._shapes = model_profile(info, self.max_batch, self.input_size)
        plan = ensure_engine(self._config, device, trt)
        loaded = load_plan(trt, plan, device)
        engine = loaded.engine
        context = loaded.new_context()
        if context is None:  # its activation memory could not be allocated (TensorRT logs it)
            free, total = torch.cuda.mem_get_info(device)
            raise EngineError(
                f"TensorRT could not create an execution context for {plan} on {device}"
                f" (out of GPU memory? {free >> 20} MiB free of {total >> 20} MiB): lower"
                " --workers or --max-batch, or free the GPU"
            )
        # TensorRT may run parts of the engine on auxiliary streams; made by it, they might
        # be blocking streams, which NVDEC's work on the legacy default stream would then
        # wait on (and which fail a graph capture going on meanwhile): so they are torch's
        # own, non-blocking, kept alive with the forward.
        aux = [
            torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            for _ in range(int(getattr(engine, "num_aux_streams", 0)))
        ]
        if aux:
            context.set_aux_streams([s.cuda_stream for s in aux])
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        outputs = [n for n in names if n not in inputs]
        if len(inputs) != 1 or not outputs:
            raise EngineError(f"engine {plan}: expected one image input, got {inputs} -> {outputs}")
        in_name = inputs[0]
        in_dtype = torch_dtype(trt, engine.get_tensor_dtype(in_name), in_name, plan)
        out_dtype = {n: torch_dtype(trt, engine.get_tensor_dtype(n), n, plan) for n in outputs}
        forward = TensorBindings(
            context,
            in_name,
            out_dtype,
            device,
            stream=lambda: torch.cuda.current_stream(device).cuda_stream,
            keep=(loaded, aux),
            profile=self._shapes,
        )
        log.info("tensorrt engine: %s on %s (%s in, %s out)", plan, device, in_dtype, out_dtype)
        return forward, in_dtype

    def _clamp_shape(self, shape: tuple[int, int]) -> tuple[int, int]:
        if self._shapes is None:
            return shape
        return max(shape[0], self._shapes.min[2]), max(shape[1], self._shapes.min[3])


def export_engine(
    model: str, *, imgsz: int, max_batch: int, device: str, cache_dir: Path, out: Path | None
) -> Path:
    """Build (or find cached) the TensorRT engine for ``model`` ahead of serving.

    The precision is the ONNX's own: pass the file ``streamdet export --precision fp16|int8``
    wrote for an FP16 or INT8 engine; a ``.pt`` is exported to FP32 ONNX first.

    Returns:
        The cached engine, or ``out`` when given (a copy of it).

    Raises:
        EngineError: TensorRT missing, no CUDA device, or the build failed; says which.
    """
    from engines.registry import prepare_model

    problems: list[str] = []
    trt: Any = None
    try:
        trt = import_tensorrt(
            "export ONNX instead (--format onnx, the default), which the onnxruntime and"
            " torch backends serve"
        )
    except EngineError as exc:
        problems.append(str(exc))
    try:
        torch_device = resolve_device(device)
    except EngineError as exc:
        # Its words are serve's (--backend, STREAMDET_DEVICE); export has --device only.
        problems.append(
            str(exc)
            .replace("; pick --backend onnxruntime", "")
            .replace(" or pick --backend onnxruntime", "")
            .replace("STREAMDET_DEVICE", "--device")
        )
    if problems:
        raise EngineError("cannot build a TensorRT engine: " + "; ".join(problems))
    if torch_device.type != "cuda":
        raise EngineError("a TensorRT engine is built on the GPU it runs on: pass --device cuda")
    info = prepare_model(model, cache_dir, imgsz)
    config = EngineConfig(
        model=info, imgsz=imgsz, max_batch=max_batch, threads=1, device=device, cache_dir=cache_dir
    )
    path = ensure_engine(config, torch_device, trt)
    if out is None:
        return path
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(path, out)
    return out
