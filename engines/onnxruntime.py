"""ONNX Runtime backend: the embedded default, CPU execution provider."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from engines.registry import ConfiguredEngine, EngineConfig, fixed_shape
from engines.types import Detections, DetectParams, EngineError, Image
from engines.yolo import group_by_shape, postprocess, preprocess

log = logging.getLogger(__name__)


INPUT_TYPES: dict[str, type[np.floating[Any]]] = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
}
"""The input types a model may take, and the NumPy type its blob is handed over as."""


class OrtEngine(ConfiguredEngine):
    """One ONNX Runtime session; the pool gives each worker its own instance."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._fixed = fixed_shape(config.model)
        self._session: object | None = None
        self._input_name = "images"
        self._output_name = "output0"
        self._input_type: type[np.floating[Any]] = np.float32

    def load(self) -> None:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.intra_op_num_threads = self._config.threads
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        # Spinning intra-op threads (ORT's default) kept: on 2 cores, 3 RTSP cameras at
        # --imgsz 416 went from 85.6% to 96.0% of frames processed and p99 164 -> 140 ms,
        # and /detect goodput at 8 clients from 17.4 to 18.0 img/s, versus no spinning.
        opts.add_session_config_entry("session.intra_op.allow_spinning", "1")
        try:
            session = ort.InferenceSession(
                self._config.model.path, sess_options=opts, providers=["CPUExecutionProvider"]
            )
        except Exception as exc:
            raise EngineError(
                f"model {self._config.model.path}: ONNX Runtime cannot load it: {exc}"
            ) from exc
        inputs, outputs = session.get_inputs(), session.get_outputs()
        self._input_name, self._output_name = inputs[0].name, outputs[0].name
        # Ultralytics' half=True export (and FP16 conversions that keep no float32 inputs)
        # takes float16: it was refused by ONNX Runtime's "Unexpected input data type".
        kind = inputs[0].type
        if kind not in INPUT_TYPES:
            raise EngineError(
                f"model {self._config.model.path}: its input {inputs[0].name!r} is {kind};"
                " export it with a float32 or float16 input"
            )
        self._input_type = INPUT_TYPES[kind]
        self._session = session

    def warmup(self) -> None:
        """Run a square frame twice (the first run sets ONNX Runtime up); the second's time
        is :attr:`warm_item_s`."""
        frame = np.full((self._imgsz, self._imgsz, 3), 114, np.uint8)
        self.infer([frame], [DetectParams()])
        started = time.monotonic()
        self.infer([frame], [DetectParams()])
        self.warm_item_s = time.monotonic() - started

    def infer(self, images: Sequence[Image], params: Sequence[DetectParams]) -> list[Detections]:
        if self._session is None:
            raise EngineError("engine used before load()")
        info = self._config.model
        results: list[Detections | None] = [None] * len(images)
        for shape, idxs in group_by_shape(
            images, self._imgsz, info.stride, info.dynamic_hw, self._fixed
        ).items():
            blob, metas = preprocess([images[i] for i in idxs], self._imgsz, shape)
            output = self.run_raw(blob)
            dets = postprocess(output, metas, [params[i] for i in idxs], info.names)
            for i, det in zip(idxs, dets, strict=True):
                results[i] = det
        return [d for d in results if d is not None]

    def close(self) -> None:
        self._session = None

    def run_raw(self, blob: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """Run an already preprocessed ``(B, 3, H, W)`` float32 tensor.

        A graph whose batch is fixed (Ultralytics' ``batch=8`` export, whose Reshapes hold the
        8) runs any ``B``: in runs of its batch, the last padded with zeros whose outputs are
        dropped (ONNX Runtime refuses every other batch size).
        """
        if self._session is None:
            raise EngineError("engine used before load()")
        fixed = self._config.model.fixed_batch
        if fixed is None or len(blob) == fixed:
            return self._run(blob)
        outputs = []
        for start in range(0, len(blob), fixed):
            part = blob[start : start + fixed]
            real = len(part)
            if real < fixed:
                pad = np.zeros((fixed - real, *part.shape[1:]), part.dtype)
                part = np.concatenate([part, pad])
            outputs.append(self._run(part)[:real])
        return np.concatenate(outputs)

    def _run(self, blob: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        session: Any = self._session
        feed = blob.astype(self._input_type, copy=False)
        (output,) = session.run([self._output_name], {self._input_name: feed})
        return np.asarray(output, np.float32)
