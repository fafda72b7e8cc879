"""Model files: an Ultralytics ``.pt`` or ``.torchscript`` export is converted once to ONNX
(cached by content hash), an ``.onnx`` is used as is; either way the metadata (names, imgsz,
stride) comes from the ONNX.

A ``.torchscript`` (Ultralytics' TorchScript export) needs only PyTorch to load, so it serves
machines without Ultralytics. Its trace holds the anchor grid of one input size (640x640 for
the shared model): its ONNX has a dynamic batch axis but a fixed height and width, and every
backend letterboxes to that square instead of the rectangle a 16:9 frame would take.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from engines.types import ModelError, ModelInfo

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

EXPORT_VERSION = "1"  # bump when the export recipe changes, to invalidate the cache
MODEL_SUFFIXES = (".pt", ".torchscript", ".onnx")
# Ultralytics' TorchScript metadata entries copied into the ONNX, as its ONNX export writes them.
TORCHSCRIPT_META_KEYS = ("description", "author", "version", "license", "docs", "stride", "task")
EXPORT_TMP_PREFIX = ".export-"
STALE_EXPORT_S = 3600.0
"""An export's temporary directory in the cache untouched for this long was left by an export
killed before it could delete it (another process exporting now writes into its own)."""


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _quiet_ultralytics() -> None:
    # Never pip-install at run time (Ultralytics tries for onnxslim & co.), never phone home.
    os.environ.setdefault("YOLO_AUTOINSTALL", "false")
    os.environ.setdefault("YOLO_OFFLINE", "true")
    os.environ.setdefault("YOLO_VERBOSE", "false")


def remove_stale_exports(cache_dir: Path, older_than_s: float = STALE_EXPORT_S) -> int:
    """Delete the temporary directories (``.export-*``) that exports killed mid-way (SIGKILL,
    a crash) left in ``cache_dir``, each a copy of a checkpoint or more, once nothing in them
    has changed for ``older_than_s``: a fresher one may be another process's export under
    way. Returns how many were deleted."""
    gone = 0
    now = time.time()
    for tmp in cache_dir.glob(EXPORT_TMP_PREFIX + "*"):
        try:
            if tmp.is_symlink() or not tmp.is_dir():
                continue
            newest, size = tmp.stat().st_mtime, 0
            for root, dirs, files in os.walk(tmp):
                for name in (*dirs, *files):
                    info = os.lstat(os.path.join(root, name))
                    newest = max(newest, info.st_mtime)
                    size += info.st_size if name in files else 0
        except OSError:
            continue  # deleted meanwhile (its export ended), or unreadable: left alone
        if now - newest < older_than_s:
            continue
        shutil.rmtree(tmp, ignore_errors=True)
        if not tmp.exists():
            gone += 1
            log.warning(
                "model cache %s: deleted %s (%d bytes), left by an export that was stopped",
                cache_dir,
                tmp.name,
                size,
            )
    return gone


class _Terminated(BaseException):
    """SIGTERM arrived during an export (see :func:`_cleanup_before_sigterm`)."""


@contextlib.contextmanager
def _cleanup_before_sigterm() -> Iterator[None]:
    """While an export runs in the main thread of a process that leaves SIGTERM to its
    default action (a server still loading its model), SIGTERM raises instead, so the
    export's temporary directory is deleted on the way out; then the signal is raised again
    with its default action, and the process ends as it would have. (Its default action
    killed the process at once, leaving a copy of the checkpoint in the cache for ever.)"""
    try:
        if (
            threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        ):
            yield  # signals cannot be set here, or someone else handles SIGTERM
            return
    except (AttributeError, ValueError):  # no SIGTERM on this platform
        yield
        return

    received: list[int] = []

    def terminated(signum: int, frame: FrameType | None) -> None:
        if not received:  # once: a second SIGTERM must not cut the cleanup short
            received.append(signum)
            raise _Terminated

    signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:  # the temporary directory is gone by now
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if received:  # ends the process, even where the export swallowed the exception
            signal.raise_signal(signal.SIGTERM)


def export_onnx(pt_path: Path, out_path: Path, imgsz: int, dynamic: bool = True) -> Path:
    """Export an Ultralytics checkpoint to ONNX with a dynamic batch axis.

    Raises:
        ModelError: the checkpoint cannot be loaded or is not a detection model.
    """
    _quiet_ultralytics()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_exports(out_path.parent)
    # The temporary directory goes whatever ends the export (an error, Ctrl-C, SIGTERM).
    with (
        _cleanup_before_sigterm(),
        tempfile.TemporaryDirectory(dir=out_path.parent, prefix=EXPORT_TMP_PREFIX) as tmp,
    ):
        # Ultralytics writes next to the checkpoint; the source may be read-only.
        local_pt = Path(tmp) / pt_path.name
        shutil.copyfile(pt_path, local_pt)
        # Third-party deprecation chatter (torch's legacy ONNX exporter) must not turn an
        # export into a failure where warnings are errors.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            exported = _export(pt_path, local_pt, imgsz, dynamic)
        os.replace(exported, out_path)
    return out_path


def _export(pt_path: Path, local_pt: Path, imgsz: int, dynamic: bool) -> str:
    from ultralytics import YOLO

    try:
        model = YOLO(str(local_pt))
    except Exception as exc:
        raise ModelError(
            f"model {pt_path}: cannot load: not a loadable Ultralytics checkpoint (empty,"
            f" truncated or corrupted?): {_load_failure(exc, local_pt, pt_path)}"
        ) from exc
    if model.task != "detect":
        raise ModelError(
            f"model {pt_path}: is a {model.task!r} model; streamdet serves detection models"
            " (task 'detect')"
        )
    try:
        exported: str = model.export(
            format="onnx", dynamic=dynamic, simplify=True, imgsz=imgsz, verbose=False
        )
    except Exception as exc:
        raise ModelError(f"model {pt_path}: ONNX export failed: {exc}") from exc
    return exported


def _load_failure(exc: BaseException, local_pt: Path, pt_path: Path) -> str:
    """Why Ultralytics could not load a checkpoint, in one line, naming the user's file rather
    than the temporary copy Ultralytics read, without its advice to run its own models."""
    root = exc.__cause__ or exc
    text = str(root).replace(str(local_pt), str(pt_path)).strip()
    first = text.splitlines()[0] if text else type(root).__name__
    if "Recommended fixes" in first:
        first = first.split("Recommended fixes", 1)[0].strip()
    return first[:300]


def resolve_onnx(
    model: str, cache_dir: Path, imgsz: int, flag: str = "setting STREAMDET_MODEL / --model"
) -> Path:
    """Return an ONNX file for ``model`` (a ``.pt`` or ``.onnx`` path), exporting if needed.

    Args:
        model: the path (or a bare Ultralytics name such as ``yolov8n.pt``).
        cache_dir: where exports of ``.pt`` and ``.torchscript`` files are cached.
        imgsz: the export size of a ``.pt``.
        flag: the setting or flag that named ``model``, for messages (``--reference``).

    Raises:
        ModelError: missing, unreadable or unsupported file; the message names it.
    """
    path = Path(model).expanduser()
    suffix = path.suffix.lower()
    if suffix not in MODEL_SUFFIXES:
        raise ModelError(
            f"model {model}: expected an Ultralytics .pt checkpoint, a .torchscript export or an"
            f" .onnx file ({flag})"
        )
    if not path.exists():
        if suffix == ".pt" and path.parent == Path("."):
            return _fetch_and_export(path.name, cache_dir, imgsz)
        raise ModelError(f"model {model}: file not found ({flag})")
    if not path.is_file() or not os.access(path, os.R_OK):
        raise ModelError(f"model {model}: not a readable file ({flag})")
    if suffix == ".onnx":
        return path
    digest = file_sha256(path)[:16]
    cached = cache_dir / f"{path.stem}-{digest}-{imgsz}-v{EXPORT_VERSION}.onnx"
    if cached.exists():
        log.info("model %s: using cached export %s", model, cached)
        return cached
    _writable_cache(cache_dir)
    if suffix == ".torchscript":
        log.info("model %s: converting the TorchScript trace to ONNX into %s", model, cached)
        return torchscript_to_onnx(path, cached, imgsz)
    log.info("model %s: exporting to ONNX (imgsz %d) into %s", model, imgsz, cached)
    return export_onnx(path, cached, imgsz)


def _writable_cache(cache_dir: Path) -> None:
    """Raise :class:`ModelError` naming the setting where exports cannot be written into
    ``cache_dir`` (a read-only root's ``~/.cache``: it was a FileNotFoundError's traceback
    from the export, exit 1)."""
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelError(
            f"cache directory {cache_dir}: cannot create it ({exc.strerror or exc}); set"
            " STREAMDET_CACHE_DIR / --cache-dir to a writable directory"
        ) from None
    if not os.access(cache_dir, os.W_OK | os.X_OK):
        raise ModelError(
            f"cache directory {cache_dir}: not writable; set STREAMDET_CACHE_DIR / --cache-dir"
            " to a writable directory"
        )


def load_torchscript(
    path: Path, device: torch.device | str = "cpu"
) -> tuple[torch.jit.ScriptModule, dict[str, Any]]:
    """An Ultralytics TorchScript export on ``device`` in eval mode, and its metadata
    (``config.txt``: names, imgsz, stride, task; empty for a trace made elsewhere).

    Raises:
        ModelError: not a loadable TorchScript file.
    """
    import json

    import torch

    files = {"config.txt": ""}
    try:
        with warnings.catch_warnings():  # torch.jit.load is deprecated, and says so
            warnings.simplefilter("ignore")
            module = torch.jit.load(  # type: ignore[no-untyped-call]
                str(path), _extra_files=files, map_location=device
            )
    except Exception as exc:
        raise ModelError(f"model {path}: not a loadable TorchScript file: {exc}") from exc
    try:
        meta = json.loads(files["config.txt"]) if files["config.txt"] else {}
    except ValueError as exc:
        raise ModelError(f"model {path}: unreadable Ultralytics metadata (config.txt)") from exc
    if not isinstance(meta, dict):
        raise ModelError(f"model {path}: unreadable Ultralytics metadata (config.txt)")
    task = meta.get("task", "detect")
    if task != "detect":
        raise ModelError(f"model {path}: is a {task!r} model; streamdet serves 'detect' models")
    module.eval()
    return module, meta


def torchscript_input_size(meta: dict[str, Any], imgsz: int) -> tuple[int, int]:
    """The (height, width) a TorchScript export was traced at: its metadata's, else ``imgsz``."""
    size = meta.get("imgsz", imgsz)
    height, width = (size, size) if isinstance(size, int) else (size[0], size[1])
    return int(height), int(width)


def torchscript_to_onnx(ts_path: Path, out_path: Path, imgsz: int) -> Path:
    """Convert an Ultralytics TorchScript export to ONNX: dynamic batch, the traced height and
    width, and the export's names, stride and size as ONNX metadata.

    Raises:
        ModelError: not a TorchScript detection model, or it does not run at its input size.
    """
    import onnx
    import torch

    module, meta = load_torchscript(ts_path)
    height, width = torchscript_input_size(meta, imgsz)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_exports(out_path.parent)
    with (
        _cleanup_before_sigterm(),
        tempfile.TemporaryDirectory(dir=out_path.parent, prefix=EXPORT_TMP_PREFIX) as tmp,
    ):
        staged = Path(tmp) / "model.onnx"
        try:
            with warnings.catch_warnings(), torch.inference_mode():
                warnings.simplefilter("ignore")  # the TorchScript exporter is deprecated
                torch.onnx.export(
                    module,
                    (torch.zeros(1, 3, height, width),),
                    str(staged),
                    dynamo=False,  # a ScriptModule: only the TorchScript exporter takes it
                    input_names=["images"],
                    output_names=["output0"],
                    dynamic_axes={"images": {0: "batch"}, "output0": {0: "batch"}},
                    opset_version=17,
                )
        except Exception as exc:
            hint = "" if "imgsz" in meta else f" (no metadata: tried --imgsz {imgsz})"
            raise ModelError(
                f"model {ts_path}: the TorchScript trace does not run at its input size"
                f" {height}x{width}{hint}: {exc}"
            ) from exc
        proto = onnx.load(str(staged))
        with torch.inference_mode():
            out_shape = tuple(module(torch.zeros(1, 3, height, width)).shape)
        # The exporter may leave the output's dims symbolic; the class count is read from them.
        dims = proto.graph.output[0].type.tensor_type.shape.dim
        if len(dims) == len(out_shape) == 3:
            for dim, size in zip(dims[1:], out_shape[1:], strict=True):
                dim.dim_value = size
        props = {k: str(meta[k]) for k in TORCHSCRIPT_META_KEYS if k in meta}
        if isinstance(meta.get("names"), dict):
            props["names"] = str({int(k): str(v) for k, v in meta["names"].items()})
        props["imgsz"] = str([height, width])
        props["streamdet_source"] = "torchscript"
        del proto.metadata_props[:]
        for key, value in props.items():
            proto.metadata_props.add(key=key, value=value)
        onnx.save(proto, str(staged))
        os.replace(staged, out_path)
    return out_path


def _fetch_and_export(name: str, cache_dir: Path, imgsz: int) -> Path:
    """A bare name such as ``yolov8n.pt``: let Ultralytics download it (needs network)."""
    _quiet_ultralytics()
    from ultralytics.utils.downloads import attempt_download_asset

    _writable_cache(cache_dir)
    target = cache_dir / "weights" / name
    target.parent.mkdir(parents=True, exist_ok=True)
    if not target.exists():
        try:
            fetched = Path(attempt_download_asset(str(target)))
        except Exception as exc:
            raise ModelError(
                f"model {name}: not a local file and the download failed ({exc});"
                " pass a path to a local .pt or .onnx file with --model"
            ) from exc
        if not fetched.exists():
            raise ModelError(f"model {name}: file not found and could not be downloaded")
    return resolve_onnx(str(target), cache_dir, imgsz)


def default_imgsz(info: ModelInfo) -> int | None:
    """The inference size a model asks for when no ``--imgsz`` is given: a fixed-shape
    model's (the longer side of its input), or the size a ``streamdet export`` artifact was
    made, calibrated and checked at (its ``imgsz`` metadata); ``None`` for any other
    dynamic-shape model (the caller's default, 640)."""
    if not info.dynamic_hw:
        return max(info.imgsz)
    if "streamdet_precision" in info.extra:
        return info.imgsz[0]
    return None


def _parse_imgsz(onnx_path: Path, raw: str) -> tuple[int, int]:
    """The ``imgsz`` metadata entry (``[640, 640]`` or ``640``) as ``(height, width)``.

    Raises:
        ModelError: not one or two positive integers.
    """
    try:
        value = ast.literal_eval(raw)
        size = [value, value] if isinstance(value, int) else list(value)
        height, width = int(size[0]), int(size[1])
    except (ValueError, SyntaxError, TypeError, IndexError) as exc:
        raise ModelError(
            f"model {onnx_path}: unreadable 'imgsz' metadata {raw!r}: expected [height, width];"
            " re-export the model or remove the entry"
        ) from exc
    if height < 1 or width < 1:
        raise ModelError(f"model {onnx_path}: 'imgsz' metadata {raw!r} is not a positive size")
    return height, width


def read_model_info(onnx_path: Path) -> ModelInfo:
    """Read names, input size and stride from an ONNX file and check it is a YOLO detector.

    Raises:
        ModelError: unreadable ONNX or not a ``(B, 4 + nc, anchors)`` detection head.
    """
    import onnx

    try:
        proto = onnx.load(str(onnx_path), load_external_data=False)
    except Exception as exc:
        raise ModelError(f"model {onnx_path}: not a readable ONNX file ({exc})") from exc
    meta = {p.key: p.value for p in proto.metadata_props}
    task = meta.get("task", "detect")
    if task != "detect":
        raise ModelError(
            f"model {onnx_path}: is a {task!r} model; streamdet serves 'detect' models"
        )
    graph = proto.graph
    if len(graph.input) != 1 or not graph.output:
        raise ModelError(f"model {onnx_path}: expected one image input and a detection output")
    in_dims = graph.input[0].type.tensor_type.shape.dim
    out_dims = graph.output[0].type.tensor_type.shape.dim
    if len(in_dims) != 4 or len(out_dims) != 3:
        raise ModelError(
            f"model {onnx_path}: expected input (B, 3, H, W) and output (B, 4+nc, anchors),"
            f" got ranks {len(in_dims)} and {len(out_dims)}"
        )
    channels = out_dims[1].dim_value
    names_raw = meta.get("names")
    if names_raw:
        try:
            parsed = ast.literal_eval(names_raw)
            names = {int(k): str(v) for k, v in parsed.items()}
        except (ValueError, SyntaxError, AttributeError) as exc:
            raise ModelError(f"model {onnx_path}: unreadable 'names' metadata") from exc
    elif channels > 4:
        names = {i: f"class{i}" for i in range(channels - 4)}
    else:
        raise ModelError(f"model {onnx_path}: no class names and no fixed class dimension")
    if channels and channels != 4 + len(names):
        raise ModelError(
            f"model {onnx_path}: output has {channels} channels, expected 4 + {len(names)}"
            " classes: not a YOLOv8-style detection head (end-to-end/NMS exports unsupported)"
        )
    h, w = in_dims[2].dim_value, in_dims[3].dim_value
    imgsz_raw = meta.get("imgsz")
    imgsz = _parse_imgsz(onnx_path, imgsz_raw) if imgsz_raw else (h or 640, w or 640)
    dynamic_hw = not (h and w)
    if not dynamic_hw:
        imgsz = (h, w)  # the graph's fixed input is what runs, whatever the metadata says
    extra = {k: v for k, v in meta.items() if k.startswith("streamdet_")}
    return ModelInfo(
        path=str(onnx_path),
        names=names,
        imgsz=imgsz,
        stride=int(meta.get("stride", 32)),
        dynamic_hw=dynamic_hw,
        precision=meta.get("streamdet_precision", "fp32"),
        extra=extra,
        # A fixed batch dimension (Ultralytics' default, non-dynamic export: 1): the pool
        # cannot batch more than this.
        fixed_batch=in_dims[0].dim_value or None,
    )
