"""Frames drawn as JPEGs: a stream's boxes (with track ids), region of interest, zones and
counting lines on the frame they were computed on, for the viewer's JPEG frames,
``latest.jpg`` and event snapshots. Runs in worker threads (OpenCV releases the GIL)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import cv2
import numpy as np

from engines.types import Detections, Image
from streams.detect import Roi
from streams.fanout import host_array
from streams.files import encode_jpeg
from streams.lines import Line
from streams.zones import Zone

REGION_RGB = (255, 0, 255)  # the outline of a stream's region of interest: magenta
LINE_RGB = (0, 255, 255)  # counting lines: cyan, as on the viewer page
ZONE_RGB = (255, 212, 0)  # zones: yellow, as on the viewer page
JPEG_MAX_SIDE = 65_500  # libjpeg's JPEG_MAX_DIMENSION


def line_label(name: str, crossings: Mapping[str, Mapping[str, Mapping[str, int]]]) -> str:
    """``gate: 3 in, 1 out``: a line's crossings each way, summed over classes (ASCII: OpenCV's
    Hershey fonts have nothing else)."""
    ways = crossings.get(name, {})
    n_in, n_out = (sum(ways.get(way, {}).values()) for way in ("in", "out"))
    return f"{name}: {n_in} in, {n_out} out"


def zone_label(name: str, zones: Mapping[str, Mapping[str, Mapping[str, int]]]) -> str:
    """``dock: 2``: how many objects stand in a zone, summed over classes."""
    return f"{name}: {sum(zones.get(name, {}).get('now', {}).values())}"


def _color(class_id: int) -> tuple[int, int, int]:
    """A fixed, distinct RGB colour per class."""
    hue = (class_id * 47) % 180
    hsv = np.array([[[hue, 200, 255]]], np.uint8)
    r, g, b = (int(v) for v in cv2.cvtColor(hsv, cv2.COLOR_HSV2RGB)[0, 0])
    return r, g, b


def _label(
    rgb: Image,
    text: str,
    at: tuple[int, int],
    colors: tuple[tuple[int, int, int], tuple[int, int, int]],
    *,
    above: bool = False,
) -> None:
    """``text`` on a filled box (``colors``: box, text) with its top left corner at ``at``
    (its bottom left, ``above``), kept inside the image."""
    height, width = rgb.shape[:2]
    (tw, th), base = cv2.getTextSize(text, cv2.FONT_HERSHEY_SIMPLEX, 0.5, 1)
    left, top = at
    if above:
        top -= th + base + 2
    left = min(max(left, 0), max(width - tw - 4, 0))
    top = min(max(top, 0), max(height - th - base - 2, 0))
    cv2.rectangle(rgb, (left, top), (left + tw + 4, top + th + base + 2), colors[0], -1)
    cv2.putText(rgb, text, (left + 2, top + th + 1), cv2.FONT_HERSHEY_SIMPLEX, 0.5, colors[1], 1)


def draw_detections(rgb: Image, detections: Detections, scale: float) -> None:
    """Draw each box with its class name, track id (if tracked) and confidence onto ``rgb``
    (in place), boxes given in source pixels and scaled by ``scale`` to the image."""
    tracks = detections.track_ids
    for i, (box, score, cid) in enumerate(
        zip(detections.boxes, detections.scores, detections.class_ids, strict=True)
    ):
        x1, y1, x2, y2 = (round(float(v) * scale) for v in box)
        color = _color(int(cid))
        cv2.rectangle(rgb, (x1, y1), (x2, y2), color, 2)
        track = "" if tracks is None else f" #{int(tracks[i])}"
        label = f"{detections.name_of(cid)}{track} {float(score):.2f}"
        _label(rgb, label, (x1, y1), (color, (0, 0, 0)), above=True)


_Tag = tuple[str, tuple[int, int], tuple[tuple[int, int, int], tuple[int, int, int]]]
"""A label to draw: text, top left corner, colours (box, text)."""


def draw_line(rgb: Image, line: Line, label: str) -> _Tag:
    """Draw a counting line onto ``rgb`` (in place); returns its label, under its first
    point."""
    height, width = rgb.shape[:2]
    (ax, ay), (bx, by) = (
        (round(x * (width - 1)), round(y * (height - 1))) for x, y in (line.a, line.b)
    )
    cv2.line(rgb, (ax, ay), (bx, by), LINE_RGB, 2)
    return label, (ax, ay + 3), ((0, 0, 0), LINE_RGB)


def draw_zone(rgb: Image, zone: Zone, label: str) -> _Tag:
    """Draw a zone's outline onto ``rgb`` (in place); returns its label, at its first
    point."""
    height, width = rgb.shape[:2]
    corners = np.array([[x * (width - 1), y * (height - 1)] for x, y in zone.points])
    cv2.polylines(rgb, [corners.round().astype(np.int32)], True, ZONE_RGB, 2)
    return label, (int(corners[0, 0]), int(corners[0, 1])), ((0, 0, 0), ZONE_RGB)


def render_jpeg(
    image: Image | Any,
    max_width: int,
    quality: int,
    *,
    detections: Detections | None = None,
    region: Roi | None = None,
    lines: Sequence[tuple[Line, str]] = (),
    zones: Sequence[tuple[Zone, str]] = (),
) -> tuple[bytes, int, int]:
    """``image`` (RGB) drawn by :func:`render` as JPEG bytes, with the JPEG's width and
    height. Runs in a worker thread."""
    drawn = render(image, max_width, detections=detections, region=region, lines=lines, zones=zones)
    height, width = drawn.shape[:2]
    return encode_jpeg(drawn, quality), width, height


def render(
    image: Image | Any,
    max_width: int,
    *,
    detections: Detections | None = None,
    region: Roi | None = None,
    lines: Sequence[tuple[Line, str]] = (),
    zones: Sequence[tuple[Zone, str]] = (),
) -> Image:
    """``image`` (RGB) scaled down to at most ``max_width`` wide, with ``region``'s outline,
    ``zones`` and counting ``lines`` (each with its label) and ``detections`` drawn on it
    when given; never ``image`` itself when anything is drawn.

    Runs in a worker thread (OpenCV releases the GIL; a GPU frame is copied down here, not
    on the event loop).
    """
    image = source = host_array(image)
    height, width = image.shape[:2]
    # JPEG holds at most 65,500 pixels a side: a 65,501-wide panorama drawn for
    # /detect?format=jpeg failed to encode after its inference (a 500).
    scale = min(1.0, min(max_width, JPEG_MAX_SIDE) / width, JPEG_MAX_SIDE / height)
    if scale < 1.0:
        height = min(max(1, round(height * scale)), JPEG_MAX_SIDE)
        width = min(max(1, round(width * scale)), JPEG_MAX_SIDE)
        # INTER_AREA only where it matters (shrinking to under half): for 768x432 -> 640x360
        # it took 3.6 ms a frame against 0.7 ms for INTER_LINEAR, here on one CPU core.
        interpolation = cv2.INTER_AREA if width * 2 < image.shape[1] else cv2.INTER_LINEAR
        image = np.ascontiguousarray(
            cv2.resize(image, (width, height), interpolation=interpolation), dtype=np.uint8
        )
    if image is source and (region is not None or detections is not None or lines or zones):
        image = image.copy()  # drawn on: never the frame that other viewers share
    if region is not None:
        corners = np.array([[x * (width - 1), y * (height - 1)] for x, y in region.points])
        cv2.polylines(image, [corners.round().astype(np.int32)], True, REGION_RGB, 2)
    tags = [draw_zone(image, zone, label) for zone, label in zones]
    tags += [draw_line(image, line, label) for line, label in lines]
    if detections is not None:
        draw_detections(image, detections, width / detections.width if detections.width else 1.0)
    for text, at, colors in tags:  # zone and line counts over the boxes: never hidden by them
        _label(image, text, at, colors)
    return image


def crop_jpeg(
    image: Image | Any, box: Sequence[float], max_side: int, quality: int, margin: float = 0.3
) -> bytes:
    """The object in ``box`` (``x1, y1, x2, y2`` in ``image``'s pixels) cut from the frame
    with ``margin`` (of its longer side) around it, square where the frame allows (a
    notification's thumbnail, as Frigate's), scaled down to at most ``max_side`` pixels, as a
    JPEG. Runs in a worker thread."""
    image = host_array(image)
    height, width = image.shape[:2]
    x1, y1, x2, y2 = (float(v) for v in box)
    side = max(x2 - x1, y2 - y1, 1.0) * (1.0 + 2 * margin)
    crop_w, crop_h = min(width, round(side)), min(height, round(side))
    left = int(np.clip(round((x1 + x2 - crop_w) / 2), 0, width - crop_w))
    top = int(np.clip(round((y1 + y2 - crop_h) / 2), 0, height - crop_h))
    crop: Image = image[top : top + crop_h, left : left + crop_w]
    scale = max_side / max(crop_w, crop_h)
    if scale < 1.0:
        size = (max(1, round(crop_w * scale)), max(1, round(crop_h * scale)))
        crop = np.asarray(cv2.resize(crop, size, interpolation=cv2.INTER_AREA), dtype=np.uint8)
    return encode_jpeg(crop, quality)
