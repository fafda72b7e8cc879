"""What a decoded video frame becomes, shared by streams, video jobs and uploads: the size
it is decoded at (:func:`decoded_size`), its RGB pixels at that size (:func:`frame_rgb`),
and whether a stream's keyframes alone give the frames it samples
(:func:`keyframes_suffice`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from engines.types import Image
from engines.yolo import resize


def decoded_size(width: int, height: int, max_side: int) -> tuple[int, int]:
    """The size a ``width`` x ``height`` frame is decoded at: scaled down, aspect kept, so
    its longer side is at most ``max_side`` (0: unscaled), rounded as the engines' letterbox
    rounds (:func:`engines.yolo.letterbox`), so a frame scaled to the engine's input size is
    not resized again there. A frame that would not shrink to half its pixels or less stays
    as it is: a resize in the decoder (where a GPU host's CPU is short) for little saved."""
    if max_side <= 0 or max(width, height) <= max_side:
        return width, height
    gain = min(max_side / width, max_side / height)
    size = max(1, round(width * gain)), max(1, round(height * gain))
    return size if 2 * size[0] * size[1] <= width * height else (width, height)


def upright(frame: Any) -> Any:
    """``frame`` as the video is shown: turned by the rotation its container states (a phone
    held upright records landscape frames and a 90 degree display matrix; players turn them,
    as FFmpeg's ``autorotate`` does), as a new RGB ``av.VideoFrame`` with its timing. A frame
    without one is itself (the common case costs a side-data lookup). Detections, regions,
    zones and lines are then in the picture the user sees (they were in the sideways one)."""
    turn = getattr(frame, "rotation", 0) or 0  # degrees counterclockwise, -180..180
    quarter = round(turn / 90) % 4
    if not quarter:
        return frame
    import av

    image = np.ascontiguousarray(np.rot90(frame.to_ndarray(format="rgb24"), quarter))
    turned = av.VideoFrame.from_ndarray(image, format="rgb24")
    turned.pts, turned.time_base = frame.pts, frame.time_base
    return turned


def frame_rgb(frame: Any, size: tuple[int, int], out: Image | None = None) -> Image:
    """An ``av.VideoFrame`` as an RGB array of ``size`` (width, height), into ``out`` where
    given: converted by FFmpeg, then resized as the engines' letterbox resizes
    (:func:`engines.yolo.resize`), so the engine gets the very pixels it would have made."""
    image: Image = frame.to_ndarray(format="rgb24")
    if size != (frame.width, frame.height):
        return resize(image, size, out)
    if out is None:
        return image
    out[...] = image
    return out


KEYFRAME_SLACK = 1.05
"""A group of pictures may be this much longer than ``1 / max_fps`` for keyframes to do."""


def keyframes_suffice(gop_s: float | None, max_fps: float | None, reorders: bool) -> bool:
    """Whether decoding only a stream's keyframes gives the frames its sampling takes: it
    samples at most ``max_fps`` frames a second and a keyframe comes every ``gop_s`` seconds
    (the longest of the last groups of pictures), at least as often; never for a stream that
    reorders frames (B-frames: its decoder holds each picture back until the next one, a
    keyframe would wait a whole group)."""
    if not max_fps or gop_s is None or gop_s <= 0 or reorders:
        return False
    return gop_s <= KEYFRAME_SLACK / max_fps


def bound_decoder(stream: Any, max_pixels: int) -> None:
    """Have FFmpeg's decoder of ``stream`` (before its first packet) refuse a frame of more
    than ``max_pixels`` pixels before allocating it (its ``max_pixels`` option): a video
    that changes to a huge size part way (an 8192x8192 frame after small ones: an H.264
    stream may change its size at any keyframe, an MPEG-TS concatenation does) was decoded,
    hundreds of MB a frame, and only then compared. The refused packet raises
    ``InvalidDataError``; :func:`refused_size` says whether that was why."""
    stream.codec_context.options = {
        **dict(stream.codec_context.options or {}),
        "max_pixels": str(max_pixels),
    }


def refused_size(stream: Any, max_pixels: int) -> tuple[int, int] | None:
    """The frame size ``stream``'s decoder stands at where it is over ``max_pixels`` (its
    last packet refused by :func:`bound_decoder`), else None."""
    context = stream.codec_context
    width, height = int(context.width or 0), int(context.height or 0)
    return (width, height) if width * height > max_pixels else None


def too_large_message(width: int, height: int, max_pixels: int) -> str:
    """What a stream or job whose frames are over the limit says."""
    return (
        f"frames of {width}x{height} exceed {max_pixels} pixels (setting"
        " STREAMDET_MAX_IMAGE_PIXELS)"
    )
