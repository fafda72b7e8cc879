"""A CPU install never reaches CUDA or TensorRT code by accident.

Run in a fresh interpreter so nothing this test session imported counts: build the server app,
load and run the default onnxruntime engine, then look at what got imported and whether torch
(pulled in by Ultralytics) initialised CUDA.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import CACHE_DIR, MODEL_PT, REPO

PROBE = """
import json, sys
import numpy as np
from engines.registry import EngineConfig, load_backend, prepare_model
from engines.types import DetectParams
import server.app, server.cli, server.runtime  # noqa: F401

info = prepare_model({model!r}, __import__("pathlib").Path({cache!r}), 640)
engine = load_backend("onnxruntime")(EngineConfig(model=info, imgsz=640, max_batch=2, threads=1))
engine.load()
engine.infer([np.full((64, 96, 3), 114, np.uint8)], [DetectParams()])
torch = sys.modules.get("torch")
print(json.dumps({{
    "modules": sorted(m for m in sys.modules
                      if m.split(".")[0] in ("tensorrt", "pycuda", "cupy", "modelopt")
                      or m in ("engines.gpu", "engines.torch_cuda", "engines.tensorrt",
                               "engines.nvdec")),
    "cuda_initialised": bool(torch is not None and torch.cuda.is_initialized()),
}}))
"""


def _probe(code: str) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_cpu_server_path_imports_no_gpu_code() -> None:
    result = _probe(PROBE.format(model=str(MODEL_PT), cache=str(CACHE_DIR)))
    assert result == {"modules": [], "cuda_initialised": False}


def test_gpu_modules_import_without_touching_cuda_or_tensorrt() -> None:
    """The GPU backends import on a CPU machine (so they can refuse at load() with a reason)
    without importing TensorRT or creating a CUDA context."""
    code = (
        "import json, sys, torch\n"
        "import engines.gpu, engines.torch_cuda, engines.tensorrt, engines.nvdec\n"
        "print(json.dumps({'tensorrt': 'tensorrt' in sys.modules,"
        " 'cuda_initialised': torch.cuda.is_initialized()}))\n"
    )
    assert _probe(code) == {"tensorrt": False, "cuda_initialised": False}


def test_a_decode_process_imports_neither_torch_nor_the_server() -> None:
    """A decode process (``python -m streams.decode_child``) holds only the reader loop: no
    torch (hundreds of MB per process), no FastAPI."""
    code = (
        "import json, sys, streams.decode_child\n"
        "print(json.dumps({'modules': sorted(m for m in sys.modules if m.split('.')[0] in"
        " ('torch', 'ultralytics', 'fastapi', 'server', 'onnxruntime'))}))"
    )
    assert _probe(code) == {"modules": []}
