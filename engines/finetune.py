"""Quantization-aware fine-tuning of an INT8 Q/DQ ONNX graph by self-distillation.

Post-training quantization leaves each class logit with noise (mean |error| 0.43 near the
confidence threshold on YOLOv8n, mostly from activation quantization: with the activations
left float it is 0.18, with the weights left float it is no lower), so FP32 detections scored
just over 0.25 fall under it. Here the graph learns to carry that noise: the FP32 model's
class logits and boxes teach the quantized graph on the calibration frames (no labels).

What is trained is the exported graph itself, not a re-creation of it: :class:`QdqGraph` runs
every node of the ONNX file in torch, each QuantizeLinear/DequantizeLinear pair as fake
quantization (round half to even, saturation) with a straight-through gradient, so the
forward pass is what ONNX Runtime and TensorRT compute; it is checked against ONNX Runtime
before training. (An earlier attempt re-created the quantizers on the PyTorch module: its own
loss fell while the ONNX graph's error grew.) The Conv weights and biases train, and so do the
activation scales (LSQ: a learned factor on each calibrated scale, tied where ModelOpt tied
them); everything is written back into the same graph, which keeps every Q/DQ node, so
TensorRT builds it as before. On ONNX Runtime's static-quantization graph (``--target cpu``)
the int8 weights and int32 biases train as floats and are stored back as integers, and each
int32 bias's scale follows its Conv's learned input scale (QLinearConv defines it as input
scale x weight scale; ONNX Runtime fuses DQ -> Conv -> Q into QLinearConv only when it is).

A slice of the calibration frames is kept out of training; the fine-tuned graph is kept only
when it flips fewer anchors across the confidence threshold there than the post-training
graph does.

Runs on the CPU (~1.6 s a step at 640x384, batch 4, on 2 cores). Torch is imported only when
an INT8 export asks for fine-tuning (it comes with Ultralytics).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

from engines.types import EngineError

if TYPE_CHECKING:
    import onnx
    import torch

log = logging.getLogger(__name__)

DEFAULT_STEPS = 500
DEFAULT_LR = 1e-5
# Learning rate of the activation scales' log factors (their gradients are LSQ's).
DEFAULT_SCALE_LR = 1e-3
DEFAULT_BATCH = 4
# Weight of every class logit in the loss, on top of its probability (see _distill_loss).
LOGIT_FLOOR = 1e-3
# Extra weight on the logits near the default confidence threshold (see _distill_loss).
DEFAULT_BAND_GAIN = 1.0
BAND_WIDTH = 1.0
# Calibration frames kept out of training to decide whether the fine-tuned weights are kept.
VALIDATION_SHARE = 0.125
CONF = 0.25
# Checked before training: the torch run of the graph against ONNX Runtime on a few frames.
# Summation order differs (oneDNN vs MLAS), so now and then a value lands on the other side
# of a rounding step and one anchor's score moves (0.15 seen on 1 frame of 5); the share of
# scores off by more than SCORE_STEP must stay tiny (7e-5 seen at worst).
SCORE_STEP = 0.02
MAX_OFF_SHARE = 1e-3
# Anchors scored above this by either model count in the logit-error summary.
NEAR = 0.15


class FinetuneError(EngineError):
    """The graph cannot be fine-tuned; the message names the option that turns it off."""


@dataclass(frozen=True, slots=True)
class FinetuneConfig:
    """Adam steps, peak learning rates (one-cycle schedule) and frames per step."""

    steps: int = DEFAULT_STEPS
    lr: float = DEFAULT_LR
    scale_lr: float = DEFAULT_SCALE_LR
    batch: int = DEFAULT_BATCH
    band_gain: float = DEFAULT_BAND_GAIN
    learn_scales: bool = True
    """Learn the activation scales too (off: weights and biases only)."""
    seed: int = 0


@dataclass(slots=True)
class FinetuneReport:
    """What fine-tuning did. ``flips``: validation anchor-class scores on the other side of
    the confidence threshold from FP32; ``logit_err``: mean |logit error| where either model
    scores above ``NEAR``."""

    config: FinetuneConfig
    train_frames: int
    val_frames: int
    seconds: float
    flips_before: int
    flips_after: int
    logit_err_before: float
    logit_err_after: float
    kept: bool

    def to_json(self) -> dict[str, Any]:
        """The config's fields and the outcome's, flat."""
        out = asdict(self)
        config: dict[str, Any] = out.pop("config")
        return {**config, **out}


def _fake_quant(
    x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, dtype: Any = None
) -> torch.Tensor:
    """QuantizeLinear's integer values (as floats) in ``dtype`` (the zero point's, else int8):
    round half to even, saturate, and a straight-through gradient inside the range (none
    outside it)."""
    import torch

    if dtype is None:
        dtype = torch.int8 if zero is None else zero.dtype
    if dtype not in (torch.int8, torch.uint8, torch.int32):
        raise FinetuneError(f"QuantizeLinear to {dtype} is not simulated")
    limits = torch.iinfo(dtype)
    z = 0.0 if zero is None else zero.to(x.dtype)
    y = torch.clamp(x / scale + z, float(limits.min), float(limits.max))
    return y + (torch.round(y) - y).detach()


def _per_axis(t: torch.Tensor, like: torch.Tensor, axis: int) -> torch.Tensor:
    if t.ndim == 0 or t.numel() == 1:
        return t.reshape(())
    shape = [1] * like.ndim
    shape[axis] = -1
    return t.reshape(shape)


Op = Callable[[list[Any], dict[str, Any], int], Any]


def _ops() -> dict[str, Op]:
    import torch
    import torch.nn.functional as F  # noqa: N812
    from onnx import numpy_helper

    def quantize(i: list[Any], a: dict[str, Any], n: int) -> Any:
        axis = a.get("axis", 1)
        zero = i[2] if len(i) > 2 else None
        scale = _per_axis(i[1], i[0], axis)
        return _fake_quant(i[0], scale, None if zero is None else _per_axis(zero, i[0], axis))

    def dequantize(i: list[Any], a: dict[str, Any], n: int) -> Any:
        axis = a.get("axis", 1)
        x = i[0].to(torch.float32)
        if len(i) > 2 and i[2] is not None:
            x = x - _per_axis(i[2], i[0], axis).to(torch.float32)
        return x * _per_axis(i[1], i[0], axis)

    def conv(i: list[Any], a: dict[str, Any], n: int) -> Any:
        pads = a.get("pads", [0, 0, 0, 0])
        if pads[0] != pads[2] or pads[1] != pads[3]:
            raise FinetuneError(f"Conv with asymmetric pads {pads} is not simulated")
        bias = i[2] if len(i) > 2 else None
        return F.conv2d(
            i[0], i[1], bias, a.get("strides", [1, 1]), (pads[0], pads[1]),
            a.get("dilations", [1, 1]), a.get("group", 1),
        )  # fmt: skip

    def div(i: list[Any], a: dict[str, Any], n: int) -> Any:
        if i[0].is_floating_point():
            return i[0] / i[1]
        return torch.div(i[0], i[1], rounding_mode="trunc")

    def split(i: list[Any], a: dict[str, Any], n: int) -> Any:
        axis = a.get("axis", 0)
        if len(i) > 1 and i[1] is not None:
            sizes = i[1].tolist()
        elif "split" in a:
            sizes = list(a["split"])
        else:
            sizes = [math.ceil(i[0].shape[axis] / n)] * n
        return list(torch.split(i[0], sizes, axis))

    def reshape(i: list[Any], a: dict[str, Any], n: int) -> Any:
        shape = i[1].tolist()
        if not a.get("allowzero", 0):
            shape = [i[0].shape[k] if s == 0 else s for k, s in enumerate(shape)]
        return i[0].reshape(shape)

    def unsqueeze(i: list[Any], a: dict[str, Any], n: int) -> Any:
        out = i[0]
        axes = i[1].tolist() if len(i) > 1 else list(a["axes"])
        rank = out.ndim + len(axes)
        for axis in sorted(ax % rank for ax in axes):
            out = out.unsqueeze(axis)
        return out

    def gather(i: list[Any], a: dict[str, Any], n: int) -> Any:
        axis = a.get("axis", 0)
        idx = i[1].long()
        out = torch.index_select(i[0], axis, idx.reshape(-1) % i[0].shape[axis])
        return out.squeeze(axis) if idx.ndim == 0 else out

    def constant_of_shape(i: list[Any], a: dict[str, Any], n: int) -> Any:
        value = a.get("value")
        arr = numpy_helper.to_array(value) if value is not None else np.zeros(1, np.float32)
        fill = torch.from_numpy(arr.reshape(-1).copy())
        return torch.full(i[0].tolist(), fill[0].item(), dtype=fill.dtype)

    def resize(i: list[Any], a: dict[str, Any], n: int) -> Any:
        mode = a.get("mode", b"nearest")
        ctm = a.get("coordinate_transformation_mode", b"half_pixel")
        nearest = a.get("nearest_mode", b"round_prefer_floor")
        if mode != b"nearest" or ctm != b"asymmetric" or nearest != b"floor":
            raise FinetuneError(f"Resize {mode!r}/{ctm!r} is not simulated")
        scales = i[2] if len(i) > 2 and i[2] is not None and i[2].numel() else None
        if scales is not None:
            return F.interpolate(i[0], scale_factor=scales.tolist()[2:], mode="nearest")
        return F.interpolate(i[0], size=i[3].tolist()[2:], mode="nearest")

    def slice_(i: list[Any], a: dict[str, Any], n: int) -> Any:
        x = i[0]
        starts, ends = i[1].tolist(), i[2].tolist()
        axes = i[3].tolist() if len(i) > 3 and i[3] is not None else list(range(len(starts)))
        steps = i[4].tolist() if len(i) > 4 and i[4] is not None else [1] * len(starts)
        index = [slice(None)] * x.ndim
        for first, last, axis, step in zip(starts, ends, axes, steps, strict=True):
            dim = x.shape[axis]
            if step != 1:
                raise FinetuneError("Slice with a step is not simulated")
            lo = min(max(first + dim if first < 0 else first, 0), dim)
            hi = min(max(last + dim if last < 0 else last, 0), dim)
            index[axis] = slice(lo, hi)
        return x[tuple(index)]

    def maxpool(i: list[Any], a: dict[str, Any], n: int) -> Any:
        pads = a.get("pads", [0, 0, 0, 0])
        kernel = a["kernel_shape"]
        return F.max_pool2d(i[0], kernel, a.get("strides", kernel), (pads[0], pads[1]))

    dtypes = {1: torch.float32, 6: torch.int32, 7: torch.int64, 9: torch.bool, 11: torch.float64}
    return {
        "QuantizeLinear": quantize,
        "DequantizeLinear": dequantize,
        "Conv": conv,
        "Sigmoid": lambda i, a, n: torch.sigmoid(i[0]),
        "Mul": lambda i, a, n: i[0] * i[1],
        "Add": lambda i, a, n: i[0] + i[1],
        "Sub": lambda i, a, n: i[0] - i[1],
        "Div": div,
        "Concat": lambda i, a, n: torch.cat(i, a["axis"]),
        "Split": split,
        "Reshape": reshape,
        "Unsqueeze": unsqueeze,
        "Shape": lambda i, a, n: torch.tensor(list(i[0].shape), dtype=torch.int64),
        "Gather": gather,
        "Range": lambda i, a, n: torch.arange(
            i[0].item(), i[1].item(), i[2].item(), dtype=i[0].dtype
        ),
        "Cast": lambda i, a, n: i[0].to(dtypes[a["to"]]),
        "Expand": lambda i, a, n: i[0] * torch.ones(i[1].tolist(), dtype=i[0].dtype),
        "MaxPool": maxpool,
        "ConstantOfShape": constant_of_shape,
        "Transpose": lambda i, a, n: i[0].permute(a["perm"]),
        "Resize": resize,
        "Slice": slice_,
        "Softmax": lambda i, a, n: torch.softmax(i[0], a.get("axis", -1)),
        "Constant": lambda i, a, n: torch.from_numpy(numpy_helper.to_array(a["value"]).copy()),
    }


@dataclass(frozen=True, slots=True)
class _Stored:
    """An integer initializer under a DequantizeLinear: its scale and zero-point initializers,
    the quantization axis and the integer type."""

    scale: str
    zero: str | None
    axis: int
    dtype: Any


class QdqGraph:
    """An ONNX graph run by torch, node by node, with its Conv weights and biases
    (``params``; the DFL's fixed projection excepted) and its activation quantization scales
    (``scales``) as trainable parameters."""

    def __init__(self, model: onnx.ModelProto, *, learn_scales: bool = True) -> None:
        import onnx
        import torch
        from onnx import numpy_helper

        graph = model.graph
        ops = _ops()
        unknown = sorted({n.op_type for n in graph.node} - ops.keys())
        if unknown:
            raise FinetuneError(
                f"ops {unknown} are not simulated for fine-tuning; export with --finetune-steps 0"
            )
        self._ops = ops
        self._nodes = [
            (n.op_type, list(n.input), list(n.output),
             {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute})
            for n in graph.node
        ]  # fmt: skip
        self.input = graph.input[0].name
        self.outputs = [o.name for o in graph.output]
        weights = {
            i for n in graph.node if n.op_type in ("Conv", "QuantizeLinear") for i in n.input
        }
        self.params: dict[str, torch.nn.Parameter] = {}
        self._consts: dict[str, torch.Tensor] = {}
        for init in graph.initializer:
            tensor = torch.from_numpy(numpy_helper.to_array(init).copy())
            trainable = (
                init.name in weights
                and tensor.dtype == torch.float32
                and tensor.ndim in (1, 4)
                and init.name.endswith((".weight", ".bias"))
                and ".dfl." not in init.name
            )
            if trainable:
                self.params[init.name] = torch.nn.Parameter(tensor)
            else:
                self._consts[init.name] = tensor
        # Weights and biases stored as integers under a DequantizeLinear (ONNX Runtime's static
        # quantization) train as floats, quantized again in every forward pass and on write-back.
        self._stored: dict[str, _Stored] = {}
        self.scales: dict[float, torch.nn.Parameter] = {}
        self._scale_of: dict[str, float] = {}
        conv_inputs = {i for n in graph.node if n.op_type == "Conv" for i in n.input[1:]}
        for n in graph.node:
            if n.op_type != "DequantizeLinear" or n.output[0] not in conv_inputs:
                continue
            q = self._consts.get(n.input[0])
            if q is None or q.dtype not in (torch.int8, torch.int32):
                continue
            zero = n.input[2] if len(n.input) > 2 and n.input[2] else None
            axis = next((a.i for a in n.attribute if a.name == "axis"), 1)
            stored = _Stored(n.input[1], zero, axis, q.dtype)
            self._stored[n.input[0]] = stored
            levels = q.to(torch.float32)
            zero_levels = self._stored_zero(stored, q)
            if zero_levels is not None:
                levels = levels - zero_levels
            self.params[n.input[0]] = torch.nn.Parameter(levels * self._stored_scale(stored, q))
            del self._consts[n.input[0]]
        # Activation scales are learned too, as a factor exp(d) on the calibrated scale (d = 0
        # at the start, so an untrained graph is written back bit for bit). Scales ModelOpt
        # made equal (a Concat's inputs and output, a Split, the SPPF pools: TensorRT fuses
        # them only when equal) share one factor, and so stay equal.
        activations = {
            n.input[1]
            for n in graph.node
            if n.op_type == "QuantizeLinear" and n.input[0] not in self.params
            and n.input[0] not in self._consts
        }  # fmt: skip
        for name in activations if learn_scales else ():
            scale = self._consts[name]
            if scale.numel() == 1 and scale.dtype == torch.float32:
                key = float(scale)
                self.scales.setdefault(key, torch.nn.Parameter(torch.zeros(())))
        stored_scales = {s.scale for s in self._stored.values()}
        for n in graph.node:
            if n.op_type in ("QuantizeLinear", "DequantizeLinear"):
                found = self._consts.get(n.input[1])
                if (
                    found is not None
                    and found.numel() == 1
                    and float(found) in self.scales
                    and n.input[1] not in stored_scales
                ):
                    self._scale_of[n.input[1]] = float(found)
        # An int32 bias (ONNX Runtime's graph) is stored in units of its Conv's input scale
        # times the weight scale, and ONNX Runtime's fused QLinearConv takes that product for
        # granted: the bias scale follows the input scale's learned factor.
        producer = {n.output[0]: n for n in graph.node if n.op_type == "DequantizeLinear"}
        for n in graph.node:
            if n.op_type != "Conv" or len(n.input) < 3:
                continue
            source, bias = producer.get(n.input[0]), producer.get(n.input[2])
            if source is None or bias is None or bias.input[0] not in self._stored:
                continue
            if source.input[1] in self._scale_of:
                self._scale_of[self._stored[bias.input[0]].scale] = self._scale_of[source.input[1]]

    def __call__(
        self, x: torch.Tensor, keep: Sequence[str] = ()
    ) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        """The graph's outputs for input ``x``, and the tensors named in ``keep``."""
        env: dict[str, Any] = {self.input: x}
        for op, inputs, outputs, attrs in self._nodes:
            args = [self._value(env, name) for name in inputs]
            out = self._ops[op](args, attrs, len(outputs))
            if isinstance(out, list):
                env.update(zip(outputs, out, strict=True))
            else:
                env[outputs[0]] = out
        return [env[o] for o in self.outputs], {k: env[k] for k in keep}

    def _value(self, env: dict[str, Any], name: str) -> Any:
        if not name:
            return None
        if name in env:
            return env[name]
        if name in self._stored:
            return self._quantize_stored(name)
        if name in self.params:
            return self.params[name]
        if name in self._scale_of:
            return self._consts[name] * self.scales[self._scale_of[name]].exp()
        return self._consts[name]

    def _stored_scale(self, stored: _Stored, like: torch.Tensor) -> torch.Tensor:
        return _per_axis(self._value({}, stored.scale), like, stored.axis)

    def _stored_zero(self, stored: _Stored, like: torch.Tensor) -> torch.Tensor | None:
        return _per_axis(self._consts[stored.zero], like, stored.axis) if stored.zero else None

    def _quantize_stored(self, name: str) -> torch.Tensor:
        """The integer values (as floats) of trained parameter ``name``."""
        param, stored = self.params[name], self._stored[name]
        zero = self._stored_zero(stored, param)
        return _fake_quant(param, self._stored_scale(stored, param), zero, stored.dtype)

    def write_back(self, model: onnx.ModelProto) -> None:
        """Put the trained parameters into ``model``'s initializers (same names, same graph)."""
        from onnx import numpy_helper

        for init in model.graph.initializer:
            if init.name in self._stored:
                dtype = numpy_helper.to_array(init).dtype
                arr = self._quantize_stored(init.name).detach().numpy().astype(dtype)
            elif init.name in self.params:
                arr = self.params[init.name].detach().numpy().astype(np.float32)
            elif init.name in self._scale_of:
                scaled = self._value({}, init.name).detach().numpy().astype(np.float32)
                arr = scaled.reshape(tuple(init.dims))
            else:
                continue
            init.CopyFrom(numpy_helper.from_array(arr, init.name))


class FrameSource(Protocol):
    """Letterboxed model inputs by index (``engines.calibration.FrameReader``)."""

    def tensor(self, i: int) -> npt.NDArray[np.float32]: ...

    def __len__(self) -> int: ...


def _logit_tensor(model: onnx.ModelProto) -> str:
    """The class logits: the input of the Sigmoid that feeds the graph's output."""
    graph = model.graph
    final = {o.name for o in graph.output}
    producers = [n for n in graph.node if set(n.output) & final]
    feeding = {i for n in producers for i in n.input}
    found = [n.input[0] for n in graph.node if n.op_type == "Sigmoid" and n.output[0] in feeding]
    if len(found) != 1:
        raise FinetuneError(
            "no single Sigmoid feeds the model's output (not a YOLO detection head);"
            " export with --finetune-steps 0"
        )
    name: str = found[0]
    return name


def finetune(
    candidate: Path,
    reference: Path,
    frames: FrameSource,
    out: Path,
    config: FinetuneConfig = FinetuneConfig(),
    *,
    progress: bool = True,
) -> FinetuneReport:
    """Fine-tune the INT8 graph ``candidate`` to match the FP32 ``reference`` on ``frames``
    and write the result to ``out`` (``candidate`` unchanged when it does not help).

    Raises:
        FinetuneError: the graph holds ops that are not simulated, or its torch run does not
            match ONNX Runtime's.
    """
    import onnx
    import onnxruntime as ort
    import torch

    from engines.calibration import progress_bar
    from engines.registry import usable_cores

    torch.set_num_threads(usable_cores())
    model = onnx.load(str(candidate))
    # A graph exported with a fixed batch (Ultralytics' default: 1; batch=8) has it baked
    # into its Reshape constants too: it runs, and so trains, at that batch only (a batch
    # of 4 on a batch-8 graph failed as a batch of 4 on a batch-1 graph did).
    fixed = model.graph.input[0].type.tensor_type.shape.dim[0].dim_value
    if fixed and fixed != config.batch:
        log.info(
            "fine-tuning %s at batch %d, the batch its graph fixes (not %d)",
            candidate, fixed, config.batch,
        )  # fmt: skip
        config = replace(config, batch=fixed)
    chunk = fixed or 8  # frames per validation run
    graph = QdqGraph(model, learn_scales=config.learn_scales)
    logits_name = _logit_tensor(model)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = usable_cores()
    teacher = ort.InferenceSession(str(reference), opts, providers=["CPUExecutionProvider"])
    quantized = ort.InferenceSession(str(candidate), opts, providers=["CPUExecutionProvider"])

    count = len(frames)
    val = list(range(0, count, max(1, round(1 / VALIDATION_SHARE))))
    train = [i for i in range(count) if i not in set(val)] or val

    def batch(idx: Sequence[int]) -> torch.Tensor:
        if fixed and len(idx) < fixed:  # a fixed-batch graph: filled up with its own frames
            idx = [idx[k % len(idx)] for k in range(fixed)]
        return torch.from_numpy(np.concatenate([frames.tensor(i) for i in idx]))

    def teach(x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(teacher.run(None, {graph.input: x.numpy()})[0])

    first = batch(val[: min(4, chunk)])
    with torch.no_grad():
        (sim,), _ = graph(first)
    ref = quantized.run(None, {graph.input: first.numpy()})[0]
    off = float((np.abs(sim.numpy()[:, 4:] - ref[:, 4:]) > SCORE_STEP).mean())
    if off > MAX_OFF_SHARE:
        raise FinetuneError(
            f"the torch run of {candidate} differs from ONNX Runtime's in {off:.2%} of scores"
            f" (by more than {SCORE_STEP}); export with --finetune-steps 0"
        )

    val_inputs = [batch(val[k : k + chunk]) for k in range(0, len(val), chunk)]
    val_targets = [teach(x) for x in val_inputs]

    def validate() -> tuple[int, float]:
        flips, errs = 0, []
        with torch.no_grad():
            for x, target in zip(val_inputs, val_targets, strict=True):
                _, kept = graph(x, keep=[logits_name])
                s_logit = kept[logits_name]
                s_prob, t_prob = torch.sigmoid(s_logit), target[:, 4:]
                flips += int(((s_prob >= CONF) != (t_prob >= CONF)).sum())
                near = (s_prob > NEAR) | (t_prob > NEAR)
                errs.append((s_logit - _logit(t_prob))[near].abs())
        err = torch.cat(errs)
        return flips, float(err.mean()) if err.numel() else 0.0

    flips_before, err_before = validate()
    weights, scales = list(graph.params.values()), list(graph.scales.values())
    params = weights + scales
    start = [p.detach().clone() for p in params]
    opt = torch.optim.Adam(
        [{"params": weights, "lr": config.lr}, {"params": scales, "lr": config.scale_lr}]
    )
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt,
        max_lr=[config.lr, config.scale_lr],
        total_steps=max(config.steps, 1),
        pct_start=0.1,
    )
    rng = np.random.default_rng(config.seed)
    bar = progress_bar(config.steps, "fine-tuning", progress, unit="step")
    t0 = time.perf_counter()
    for _ in range(config.steps):
        idx = rng.choice(train, min(config.batch, len(train)), replace=False)
        x = batch(idx.tolist())
        flip = torch.from_numpy(rng.random(len(x)) < 0.5)[:, None, None, None]
        x = torch.where(flip, x.flip(-1), x).contiguous()
        loss = _distill_loss(graph, x, teach(x), logits_name, config.band_gain)
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        sched.step()
        bar.update(1)
    bar.close()
    seconds = time.perf_counter() - t0
    flips_after, err_after = validate()
    kept = flips_after < flips_before
    if not kept:
        with torch.no_grad():
            for p, s in zip(params, start, strict=True):
                p.copy_(s)
    graph.write_back(model)
    onnx.save(model, str(out))
    report = FinetuneReport(
        config=config,
        train_frames=len(train),
        val_frames=len(val),
        seconds=round(seconds, 1),
        flips_before=flips_before,
        flips_after=flips_after,
        logit_err_before=round(err_before, 4),
        logit_err_after=round(err_after, 4),
        kept=kept,
    )
    log.info(
        "fine-tuning %s: %d steps in %.0f s; threshold flips on %d held-back frames %d -> %d,"
        " near-threshold logit error %.3f -> %.3f; %s",
        candidate, config.steps, seconds, len(val), flips_before, flips_after,
        err_before, err_after, "kept" if kept else "discarded (no better than PTQ)",
    )  # fmt: skip
    return report


def _logit(p: torch.Tensor) -> torch.Tensor:
    import torch

    p = p.clamp(1e-9, 1 - 1e-7)
    return torch.log(p) - torch.log1p(-p)


def _distill_loss(
    graph: QdqGraph, x: torch.Tensor, target: torch.Tensor, logits_name: str, band_gain: float
) -> torch.Tensor:
    """Class logits: squared error weighted by the larger of the two probabilities plus
    ``LOGIT_FLOOR`` (the anchors that are, or become, detections count most; the floor keeps
    the background near FP32's too: with 1e-5 instead, the held-back frames' threshold flips
    rose), plus ``band_gain`` on those within about ``BAND_WIDTH`` of the default threshold's
    logit in either model (with it, the report's worst set went 0.946 -> 0.957 at 500 steps);
    boxes: L1 in pixels / 8, weighted by the FP32 top score."""
    import torch

    (out,), kept = graph(x, keep=[logits_name])
    s_logit = kept[logits_name]
    t_prob = target[:, 4:]
    t_logit = _logit(t_prob)
    weight = torch.maximum(t_prob, torch.sigmoid(s_logit).detach()) + LOGIT_FLOOR
    if band_gain:
        # The logits that decide a detection at the default threshold: a Gaussian band
        # (BAND_WIDTH logits wide) around logit(CONF), on either model's side.
        edge = math.log(CONF / (1 - CONF))
        nearest = torch.minimum((t_logit - edge).abs(), (s_logit.detach() - edge).abs())
        weight = weight + band_gain * torch.exp(-0.5 * (nearest / BAND_WIDTH) ** 2)
    cls = (weight * (s_logit - t_logit) ** 2).sum() / weight.sum()
    box_w = t_prob.amax(1, keepdim=True)
    box = (box_w * (out[:, :4] - target[:, :4]).abs()).sum() / (box_w.sum() * 4) / 8
    return cls + box
