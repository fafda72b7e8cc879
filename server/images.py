"""Decoding uploaded images safely: format, size and pixel-count checks before any pixel is
decoded, so a decompression bomb is refused from its header."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image as PILImage
from PIL import ImageOps, UnidentifiedImageError

from engines.types import Image

# We check the pixel count ourselves, with our own setting and a clear error.
PILImage.MAX_IMAGE_PIXELS = None

ALLOWED_FORMATS = {"JPEG": "image/jpeg", "PNG": "image/png", "WEBP": "image/webp"}
IMAGE_CONTENT_TYPES = set(ALLOWED_FORMATS.values()) | {"image/jpg", "application/octet-stream"}


class ImageError(ValueError):
    """An upload that is not an acceptable image; carries the HTTP status to answer."""

    def __init__(self, status_code: int, message: str) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message


def decode_image(data: bytes, max_pixels: int) -> Image:
    """Decode JPEG/PNG/WebP bytes to an RGB ``(H, W, 3)`` uint8 array (EXIF-rotated).

    Raises:
        ImageError: 400 empty/corrupt/truncated, 415 another format, 413 too many pixels.
    """
    if not data:
        raise ImageError(400, "empty image: the upload has no bytes")
    try:
        img = PILImage.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise ImageError(
            400, f"not a decodable image ({len(data)} bytes); send a JPEG, PNG or WebP image"
        ) from None
    except (OSError, ValueError) as exc:
        raise ImageError(400, f"unreadable image header: {exc}") from None
    fmt = img.format or "unknown"
    if fmt not in ALLOWED_FORMATS:
        raise ImageError(415, f"unsupported image format {fmt}; send a JPEG, PNG or WebP image")
    width, height = img.size
    if width < 1 or height < 1:
        raise ImageError(400, f"image has no pixels ({width}x{height})")
    if width * height > max_pixels:
        raise ImageError(
            413,
            f"image is {width}x{height} = {width * height / 1e6:.1f} MP, over the limit of"
            f" {max_pixels / 1e6:.1f} MP (setting STREAMDET_MAX_IMAGE_PIXELS)",
        )
    try:
        img.load()
        img = ImageOps.exif_transpose(img) or img
        rgb = img.convert("RGB")
    except (OSError, ValueError, SyntaxError) as exc:
        raise ImageError(400, f"truncated or corrupt {fmt} image: {exc}") from None
    return np.ascontiguousarray(np.asarray(rgb, dtype=np.uint8))
