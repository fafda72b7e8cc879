"""GPU decode falls back to the CPU here, and its NV12 -> RGB conversion matches FFmpeg's."""

from __future__ import annotations

import itertools
from typing import Any

import av
import numpy as np
import numpy.typing as npt
import pytest
import torch

from engines.nvdec import VideoDecoder, nv12_to_rgb, nvdec_unavailable
from streams.files import iter_video_frames
from tests.helpers import VIDEOS


def _planes(frame: av.VideoFrame, dtype: type) -> tuple[torch.Tensor, torch.Tensor]:
    """A semi-planar frame's Y and interleaved CbCr planes, as NVDEC's DLPack export gives
    them: ``(H, W)`` and ``(H/2, W/2, 2)``, padding cut off."""
    h, w = frame.height, frame.width
    luma_rows: npt.NDArray[Any] = np.frombuffer(bytes(frame.planes[0]), dtype).reshape(h, -1)[:, :w]
    chroma_rows: npt.NDArray[Any] = np.frombuffer(bytes(frame.planes[1]), dtype).reshape(
        h // 2, -1
    )[:, :w]
    return (
        torch.from_numpy(luma_rows.copy()),
        torch.from_numpy(chroma_rows.reshape(h // 2, -1, 2).copy()),
    )


def _first_frames(video: object) -> list[av.VideoFrame]:
    with av.open(str(video)) as container:
        return list(itertools.islice(container.decode(video=0), 0, 30, 10))


@pytest.mark.parametrize("video", VIDEOS, ids=[v.name for v in VIDEOS])
@pytest.mark.parametrize("color_range", [1, 2], ids=["limited-range", "full-range"])
def test_nv12_to_rgb_matches_ffmpeg_rgb24(video: object, color_range: int) -> None:
    """NVDEC's NV12 surfaces as RGB, against FFmpeg's conversion of the same decoded pictures
    (the CPU path): limited-range video, and full-range video, which many IP cameras send
    (taken as limited, its darks and lights were clipped)."""
    for frame in _first_frames(video):
        picture = frame.reformat(format="yuv420p", src_color_range=1, dst_color_range=color_range)
        assert (picture.color_range == 2) == (color_range == 2)  # 0: unspecified, limited
        ref = picture.to_ndarray(format="rgb24").astype(int)  # the CPU path
        surface = picture.reformat(
            format="nv12", src_color_range=color_range, dst_color_range=color_range
        )
        luma, chroma = _planes(surface, np.uint8)
        ours = nv12_to_rgb(luma, chroma, int(picture.colorspace), int(picture.color_range))
        diff = np.abs(ours.numpy().astype(int) - ref)
        # swscale's chroma filter and rounding differ slightly; no visible difference.
        assert diff.max() <= 4 and diff.mean() < 1.5, (diff.max(), diff.mean())


@pytest.mark.parametrize("video", VIDEOS, ids=[v.name for v in VIDEOS])
def test_p010_surfaces_of_10_bit_video_convert_as_their_8_bit_pictures(video: object) -> None:
    """NVDEC gives 10-bit video (HEVC Main10 and the like) as P010: 16-bit samples, the 10 bits
    in the high ones. Converted, they are the 8-bit picture's RGB to rounding (read as 8-bit
    samples, they were garbage)."""
    for frame in _first_frames(video):
        ten = frame.reformat(format="p010le", src_color_range=1, dst_color_range=1)
        eight = frame.reformat(format="nv12", src_color_range=1, dst_color_range=1)
        ours10 = nv12_to_rgb(*_planes(ten, np.uint16), int(frame.colorspace), 1)
        ours8 = nv12_to_rgb(*_planes(eight, np.uint8), int(frame.colorspace), 1)
        diff = np.abs(ours10.numpy().astype(int) - ours8.numpy().astype(int))
        assert diff.max() <= 3 and diff.mean() < 0.5, (diff.max(), diff.mean())


def test_gpu_decode_falls_back_to_cpu_with_a_reason() -> None:
    if not torch.cuda.is_available():
        assert nvdec_unavailable("cuda") is not None
    decoder = VideoDecoder(VIDEOS[0], device="cuda")
    if decoder.on_gpu:
        pytest.skip("NVDEC is available here; tests/test_gpu_cuda.py covers it")
    assert decoder.reason
    got = list(itertools.islice(iter(decoder), 5))
    want = list(iter_video_frames(VIDEOS[0], limit=5))
    assert len(got) == 5
    for a, b in zip(got, want, strict=True):
        assert isinstance(a, np.ndarray) and np.array_equal(a, b)


def test_cpu_decode_when_asked() -> None:
    decoder = VideoDecoder(VIDEOS[0], device="cpu")
    assert not decoder.on_gpu and decoder.reason == "CPU decode requested"
    first = next(iter(decoder))
    assert isinstance(first, np.ndarray) and first.dtype == np.uint8 and first.shape[2] == 3


def test_nvdec_probe_names_a_cuda_device_it_cannot_use() -> None:
    """A GPU VM whose driver exposes no NVDEC fails FFmpeg's device open (seen on the H200
    machine: errno 95); the probe reports that once instead of each stream failing to open."""
    from engines.nvdec import _nvdec_probe

    reason = _nvdec_probe(0)
    if reason is None:
        pytest.skip("FFmpeg opens CUDA device 0 here")
    assert "CUDA device 0" in reason, reason
    assert _nvdec_probe(0) is reason  # probed once per device


def test_a_software_fallback_frame_turns_the_stream_to_cpu_decode() -> None:
    """NVDEC asked for, FFmpeg decoding in software anyway (allow_software_fallback): the frame
    still comes out as RGB, and the stream says it decodes on the CPU and why."""
    from engines.nvdec import GpuDecode

    decode = GpuDecode("cpu")
    decode.on_gpu = True  # as if NVDEC had been granted at open
    with av.open(str(VIDEOS[0])) as container:
        frame = next(container.decode(video=0))
    rgb = decode.convert(frame)
    assert isinstance(rgb, np.ndarray) and rgb.shape == (frame.height, frame.width, 3)
    assert not decode.on_gpu and decode.hwaccel() is None
    assert decode.reason is not None and "in software" in decode.reason
