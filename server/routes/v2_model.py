"""What the served model is to the KServe v2 / Open Inference Protocol, over HTTP
(:mod:`server.routes.kserve`) and gRPC (:mod:`server.grpc_v2`) alike: its name and version,
inputs and outputs, metadata and Triton's model configuration, the repository index, the
inference statistics both add to, and why the Triton extensions it lacks are refused."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import PurePath
from typing import Any

import numpy as np
import numpy.typing as npt
from fastapi import HTTPException

from engines.batching import WorkResult
from server.state import AppState

VERSION = "1"

NP_TYPES: dict[str, npt.DTypeLike] = {
    "UINT8": np.uint8,
    "INT32": np.int32,
    "FP32": np.float32,
}
INPUTS: list[dict[str, Any]] = [
    {"name": "image_bytes", "datatype": "BYTES", "shape": [-1]},
    {"name": "images", "datatype": "UINT8", "shape": [-1, -1, -1, 3]},
]
OUTPUTS: list[dict[str, Any]] = [
    {"name": "num_detections", "datatype": "INT32", "shape": [-1, 1]},
    {"name": "detection_boxes", "datatype": "FP32", "shape": [-1, -1, 4]},
    {"name": "detection_scores", "datatype": "FP32", "shape": [-1, -1]},
    {"name": "detection_classes", "datatype": "INT32", "shape": [-1, -1]},
]


def served_name(state: AppState) -> str:
    """The served model's name without its file's suffix (``yolov8n``)."""
    return PurePath(state.pool.engine.model_name).stem


def check_model(state: AppState, name: str, version: str | None) -> None:
    """A 404 for a model or version this server does not have (Triton's ``NOT_FOUND``), a
    400 for a version that is no number (Triton's "failed to get model version")."""
    served = served_name(state)
    if version and not version.lstrip("-").isdigit():
        raise HTTPException(
            400, f"version {version[:40]!r} of model {name!r} is not a number; it has {VERSION!r}"
        )
    if name not in {served, state.pool.engine.model_name}:
        raise HTTPException(404, f"unknown model {name!r}; this server serves {served!r}")
    if version not in (None, "", VERSION):
        raise HTTPException(404, f"model {name!r} has no version {version!r}; it has {VERSION!r}")


EXTENSIONS = [
    "binary_tensor_data",
    "parameters",
    "model_configuration",
    "statistics",
]
"""The protocol extensions served (Triton's names). The repository's index is answered too,
but not its loads (so not ``model_repository``)."""


class InferStats:
    """Triton's statistics of the model (``get_inference_statistics``), as the v2 calls over
    HTTP and gRPC add to them: ``success`` and ``fail`` count calls and their whole time,
    ``queue`` and ``compute_infer`` each image's wait and its batch's inference,
    ``inference_count`` the images, ``execution_count`` the batches they ran in."""

    KINDS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")

    def __init__(self) -> None:
        self.last_ms = 0
        self.images = 0
        self.times: dict[str, list[int]] = {kind: [0, 0] for kind in (*self.KINDS, "cache_hit")}
        self.times["cache_miss"] = [0, 0]
        self.batches: dict[int, list[float]] = {}  # size: [executions, inference ns]

    def _add(self, kind: str, ns: float, count: int = 1) -> None:
        self.times[kind][0] += count
        self.times[kind][1] += int(ns)

    def failed(self, started_ns: int) -> None:
        self._add("fail", time.monotonic_ns() - started_ns)

    def succeeded(self, started_ns: int, results: Sequence[WorkResult]) -> None:
        self._add("success", time.monotonic_ns() - started_ns)
        self.last_ms = time.time_ns() // 1_000_000
        self.images += len(results)
        for result in results:
            self._add("queue", result.queue_ms * 1e6)
            self._add("compute_infer", result.inference_ms * 1e6)
            # Each image of a batch of n is one n-th of its execution.
            size = max(result.batch_size, 1)
            batch = self.batches.setdefault(size, [0.0, 0.0])
            batch[0] += 1 / size
            batch[1] += result.inference_ms * 1e6 / size

    def json(self, name: str) -> dict[str, Any]:
        """The model's entry of ``model_stats``, as Triton writes it."""

        def duration(count: float, ns: float) -> dict[str, int]:
            return {"count": round(count), "ns": int(ns)}

        return {
            "name": name,
            "version": VERSION,
            "last_inference": self.last_ms,
            "inference_count": self.images,
            "execution_count": round(sum(b[0] for b in self.batches.values())),
            "inference_stats": {kind: duration(*t) for kind, t in self.times.items()},
            "batch_stats": [
                {
                    "batch_size": size,
                    "compute_input": duration(count, 0),
                    "compute_infer": duration(count, ns),
                    "compute_output": duration(count, 0),
                }
                for size, (count, ns) in sorted(self.batches.items())
            ],
        }


def infer_stats(app: Any) -> InferStats:
    """The app's :class:`InferStats` (HTTP and gRPC add to the same)."""
    stats: InferStats | None = getattr(app.state, "kserve_stats", None)
    if stats is None:
        stats = app.state.kserve_stats = InferStats()
    return stats


def statistics_json(app: Any, state: AppState, name: str, version: str | None) -> dict[str, Any]:
    """``get_inference_statistics``'s answer: the served model's (``name`` empty: every
    model's, which is the one), or 404."""
    if name:
        check_model(state, name, version)
    return {"model_stats": [infer_stats(app).json(name or served_name(state))]}


def repository_index_json(state: AppState, ready_only: bool = False) -> list[dict[str, str]]:
    """The model repository's index: the one model, its version and its state (``ready_only``:
    nothing while it is not ready, as Triton's ``ready`` flag asks)."""
    if ready_only and not state.ready:
        return []
    ready = "READY" if state.ready else "LOADING"
    return [{"name": served_name(state), "version": VERSION, "state": ready, "reason": ""}]


UNSUPPORTED = {
    "shared memory": "shared memory is not supported by streamdet (it may run on another"
    " machine than its clients): send the tensors in the request (set_data_from_numpy),"
    " as binary data",
    "load": "loading and unloading models is not supported: streamdet serves the one model it"
    " started with; restart it with another (setting STREAMDET_MODEL, --model)",
    "trace": "trace settings are not supported by streamdet; see GET /metrics and its logs",
    "log": "log settings are not supported by streamdet over the protocol; restart it with"
    " --log-level (setting STREAMDET_LOG_LEVEL)",
}
"""Why each Triton extension streamdet lacks is refused (501 here, UNIMPLEMENTED over gRPC)."""


def refuse(what: str) -> HTTPException:
    return HTTPException(501, UNSUPPORTED[what])


def model_metadata_json(state: AppState, name: str) -> dict[str, Any]:
    """The model's metadata as the protocol's JSON (the gRPC service parses the same)."""
    return {
        "name": name,
        "versions": [VERSION],
        "platform": f"streamdet_{state.settings.backend}",
        "inputs": INPUTS,
        "outputs": OUTPUTS,
    }


CONFIG_TYPES = {"BYTES": "TYPE_STRING", "UINT8": "TYPE_UINT8", "INT32": "TYPE_INT32"}
CONFIG_TYPES["FP32"] = "TYPE_FP32"
"""Tensor datatypes as Triton's model configuration names them (BYTES is TYPE_STRING)."""


def model_config_json(state: AppState, name: str) -> dict[str, Any]:
    """Triton's model configuration as JSON (the gRPC service parses the same)."""
    return {
        "name": name,
        "platform": f"streamdet_{state.settings.backend}",
        "max_batch_size": state.pool.max_batch,
        "input": [{"name": i["name"], "data_type": CONFIG_TYPES[i["datatype"]]} for i in INPUTS],
        "output": [{"name": o["name"], "data_type": CONFIG_TYPES[o["datatype"]]} for o in OUTPUTS],
        "dynamic_batching": {
            "max_queue_delay_microseconds": int(state.settings.max_wait_ms * 1000)
        },
        "instance_group": [{"count": state.pool.workers}],
        "parameters": {"names": {"string_value": json.dumps(state.pool.engine.names)}},
    }
