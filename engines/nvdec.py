"""Optional GPU video decode: NVDEC through PyAV's ``hwaccel`` and DLPack, CPU decode otherwise.

PyAV's wheel ships FFmpeg with the ``cuda`` hardware device. With ``HWAccel("cuda",
is_hw_owned=True)`` the decoded NV12 surfaces stay on the GPU and each plane exports by DLPack,
so a frame reaches torch without a host copy; :func:`nv12_to_rgb` turns it into the same
``(H, W, 3)`` uint8 RGB the CPU path produces, on the device. Where there is no GPU, no CUDA
build of torch or no NVDEC for the codec, the decoder says why and decodes on the CPU
(``VideoFrame.to_ndarray(format="rgb24")``), which stays the default.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from engines.types import Image

log = logging.getLogger(__name__)

# Y'CbCr -> R'G'B' for limited-range video (rows R, G, B; columns Y, Cb, Cr), as swscale uses.
_BT601 = ((1.164383, 0.0, 1.596027), (1.164383, -0.391762, -0.812968), (1.164383, 2.017232, 0.0))
_BT709 = ((1.164383, 0.0, 1.792741), (1.164383, -0.213249, -0.532909), (1.164383, 2.112402, 0.0))
BT709_COLORSPACE = 1  # AVCOL_SPC_BT709; everything else is treated as BT.601 like swscale does
# The same for full-range ("JPEG") video, which many IP cameras send: Y from 0, no gain.
_BT601_FULL = ((1.0, 0.0, 1.402), (1.0, -0.344136, -0.714136), (1.0, 1.772, 0.0))
_BT709_FULL = ((1.0, 0.0, 1.5748), (1.0, -0.187324, -0.468124), (1.0, 1.8556, 0.0))
FULL_RANGE = 2  # AVCOL_RANGE_JPEG


def nvdec_unavailable(device: str = "cuda") -> str | None:
    """Why NVDEC decode cannot be used here, or ``None`` when it can."""
    try:
        from av.codec.hwaccel import hwdevices_available
    except ImportError as exc:
        return f"this PyAV has no hardware decode support ({exc})"
    if "cuda" not in hwdevices_available():
        return "this PyAV/FFmpeg build has no cuda hardware device"
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if torch.version.cuda is None or not torch.cuda.is_available():
        return f"no CUDA device visible to torch {torch.__version__}"
    if device != "cuda" and not device.startswith("cuda:"):
        return f"device {device!r} is not a CUDA device"
    return _nvdec_probe(int(device.split(":", 1)[1]) if ":" in device else 0)


CU_CTX_SCHED_BLOCKING_SYNC = 0x04


def share_primary_context(index: int) -> str | None:
    """Give device ``index``'s primary CUDA context the flags FFmpeg's NVDEC requires.

    Decoded frames must live in torch's context (the device's primary one) for DLPack to hand
    them over, so FFmpeg is asked to use it (``primary_ctx``, PyAV's default for hardware-owned
    frames). FFmpeg insists on ``CU_CTX_SCHED_BLOCKING_SYNC`` there and refuses a primary
    context already active with other flags ("Primary context already active with
    incompatible flags", ``[Errno 95] Operation not supported``), which is what torch leaves
    once it has run anything. Since CUDA 11 the flags of an active primary context can be
    changed (``cuDevicePrimaryCtxSetFlags_v2``): done here, through the driver library that
    any CUDA process has loaded. Waits then block instead of spinning, which frees CPU for
    the decode threads.

    Returns:
        None when set, else why not.
    """
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return f"the CUDA driver library cannot be loaded ({exc})"
    set_flags = getattr(cuda, "cuDevicePrimaryCtxSetFlags_v2", None) or getattr(
        cuda, "cuDevicePrimaryCtxSetFlags", None
    )
    if set_flags is None:
        return "the CUDA driver has no cuDevicePrimaryCtxSetFlags"
    device = ctypes.c_int()
    steps: tuple[tuple[str, Callable[[], int]], ...] = (
        ("cuInit", lambda: int(cuda.cuInit(0))),
        ("cuDeviceGet", lambda: int(cuda.cuDeviceGet(ctypes.byref(device), index))),
        ("cuDevicePrimaryCtxSetFlags", lambda: int(set_flags(device, CU_CTX_SCHED_BLOCKING_SYNC))),
    )
    for step, call in steps:
        if (code := call()) != 0:
            return f"{step} failed with CUDA error {code} on device {index}"
    return None


@functools.lru_cache(maxsize=8)
def _nvdec_probe(index: int) -> str | None:
    """Open FFmpeg's CUDA device once, in torch's context, as every stream will: a GPU whose
    driver exposes no decoder, or a context FFmpeg cannot share, fails here (naming why)
    rather than on each stream's open."""
    if (reason := share_primary_context(index)) is not None:
        return f"NVDEC cannot share CUDA device {index}'s context with torch: {reason}"
    import av
    from av.codec.hwaccel import HWAccel

    try:
        HWAccel("cuda", device=index, allow_software_fallback=True, is_hw_owned=True).create(
            av.Codec("h264", "r")
        )
    except Exception as exc:  # FFmpeg's error, whatever its errno: report it, decode on the CPU
        return f"FFmpeg cannot open CUDA device {index} for decoding: {exc}"
    return None


def nv12_to_rgb(luma: Any, chroma: Any, colorspace: int = 0, color_range: int = 0) -> Any:
    """Convert an NV12 (or P010) frame (torch tensors, any device) to ``(H, W, 3)`` uint8 RGB.

    Args:
        luma: ``(H, W)`` Y plane: uint8 (NV12), or uint16 with 10 bits in the high ones
            (P010: what NVDEC gives for 10-bit video, HEVC Main10 and the like).
        chroma: ``(H/2, W/2, 2)`` interleaved Cb/Cr plane, of the same type.
        colorspace: FFmpeg's ``AVColorSpace`` of the frame (1 = BT.709, else BT.601).
        color_range: FFmpeg's ``AVColorRange`` (2 = full range, else limited, as swscale
            takes an unspecified one).

    Returns:
        ``(H, W, 3)`` uint8 tensor on the planes' device.
    """
    import torch

    full = color_range == FULL_RANGE
    if colorspace == BT709_COLORSPACE:
        coefficients = _BT709_FULL if full else _BT709
    else:
        coefficients = _BT601_FULL if full else _BT601
    matrix = torch.tensor(coefficients, dtype=torch.float32, device=luma.device)
    # 16-bit samples (P010) are scaled to 8 bits' range, their fraction kept.
    scale = 1.0 / 256.0 if luma.dtype == torch.uint16 else 1.0
    h, w = int(luma.shape[0]), int(luma.shape[1])
    y = luma.float() * scale
    if not full:
        y -= 16.0
    # Chroma is sited between luma rows; nearest-neighbour upsampling is what swscale's
    # default fast path does for 4:2:0 -> RGB at the same size.
    cbcr = chroma.float() * scale - 128.0
    cbcr = cbcr.repeat_interleave(2, dim=0).repeat_interleave(2, dim=1)[:h, :w]
    ycc = torch.cat((y[..., None], cbcr), dim=2)
    rgb = ycc @ matrix.T
    return rgb.round_().clamp_(0, 255).to(torch.uint8)


class GpuDecode:
    """How one source decodes: the ``hwaccel`` to open it with, and decoded frames to images.

    Args:
        device: ``cuda``/``cuda:N`` to try NVDEC, ``cpu`` to decode on the CPU.

    Attributes:
        on_gpu: NVDEC is used; frames become ``(H, W, 3)`` uint8 torch tensors on the GPU.
        reason: why not, when ``on_gpu`` is false.
    """

    def __init__(self, device: str = "cpu") -> None:
        self.reason = "CPU decode requested" if device == "cpu" else nvdec_unavailable(device)
        self.on_gpu = self.reason is None
        self._device_index = int(device.split(":", 1)[1]) if device.startswith("cuda:") else 0

    def hwaccel(self) -> Any | None:
        """The ``hwaccel`` argument of ``av.open``: None on the CPU."""
        if not self.on_gpu:
            return None
        from av.codec.hwaccel import HWAccel

        return HWAccel(
            "cuda", device=self._device_index, allow_software_fallback=True, is_hw_owned=True
        )

    def convert(self, frame: Any) -> Image | Any:
        """A decoded ``av.VideoFrame`` as RGB: a numpy array, or a GPU tensor from NVDEC."""
        if self.on_gpu and frame.format.name == "cuda":
            import torch
            from torch.utils.dlpack import from_dlpack

            # PyAV exports CUDA planes only without a stream argument (it cannot order them on
            # ours), so hand torch the capsules, and wait on the legacy default stream, which
            # FFmpeg's NVDEC copies use: a stream wait, not a device-wide synchronize.
            luma = from_dlpack(frame.planes[0].__dlpack__())
            chroma = from_dlpack(frame.planes[1].__dlpack__())
            with torch.cuda.device(luma.device):
                torch.cuda.default_stream().synchronize()
                on_device = nv12_to_rgb(luma, chroma, int(frame.colorspace), int(frame.color_range))
                # An engine reads it from its own stream: finish the conversion first.
                torch.cuda.current_stream().synchronize()
            return on_device
        if self.on_gpu:  # FFmpeg's software fallback: NVDEC did not take this stream
            self.on_gpu = False
            self.reason = (
                f"FFmpeg decoded {frame.format.name} frames in software: NVDEC did not take"
                " this stream (codec, profile or size)"
            )
            log.warning("decoding on the CPU: %s", self.reason)
        rgb: Image = np.ascontiguousarray(frame.to_ndarray(format="rgb24"))
        return rgb


class VideoDecoder:
    """Decode a video file or URL into RGB frames, on the GPU when asked and possible.

    Iterating yields numpy ``(H, W, 3)`` uint8 arrays (CPU decode) or torch ``(H, W, 3)``
    uint8 tensors on the GPU (NVDEC). Engines accept both.

    Args:
        source: path or URL PyAV can open.
        device: ``cuda``/``cuda:N`` to try NVDEC, ``cpu`` to decode on the CPU.
        options: FFmpeg options for ``av.open`` (e.g. ``rtsp_transport``).
        threads: CPU decode threading: ``auto`` (FFmpeg's frame and slice threads, as many as
            cores: fastest for one video), ``slice`` (no frame delay) or ``one`` (a thread per
            video: least overhead when many videos decode at once).
    """

    THREADS = ("auto", "slice", "one")

    def __init__(
        self,
        source: str | Path,
        device: str = "cpu",
        options: dict[str, str] | None = None,
        threads: str = "auto",
    ) -> None:
        if threads not in self.THREADS:
            raise ValueError(f"threads must be one of {self.THREADS}, got {threads!r}")
        self.source = str(source)
        self._options = options or {}
        self._threads = threads
        self._decode = GpuDecode(device)
        self.reason = self._decode.reason
        self.on_gpu = self._decode.on_gpu
        if not self.on_gpu:  # a note only where GPU decode was asked for and is not possible
            level = logging.DEBUG if device == "cpu" else logging.INFO
            log.log(level, "video %s: decoding on the CPU (%s)", self.source, self.reason)

    def __iter__(self) -> Iterator[Image | Any]:
        import av

        hwaccel = self._decode.hwaccel()
        with av.open(self.source, options=self._options, hwaccel=hwaccel) as container:
            stream = container.streams.video[0]
            if self._threads == "one":
                stream.codec_context.thread_count = 1
            else:
                stream.thread_type = "AUTO" if self._threads == "auto" else "SLICE"
            for frame in container.decode(stream):
                yield self._decode.convert(frame)
