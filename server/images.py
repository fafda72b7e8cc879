"""Decoding uploaded images safely: format, size and pixel-count checks before any pixel is
decoded, so a decompression bomb is refused from its header."""

from __future__ import annotations

import io
import re

import numpy as np
from PIL import Image as PILImage
from PIL import ImageFile, JpegImagePlugin, PngImagePlugin, WebPImagePlugin

from engines.types import Image
from streams.frames import decoded_size

# We check the pixel count ourselves, with our own setting and a clear error.
PILImage.MAX_IMAGE_PIXELS = None
# A PNG's text chunks are inflated as its header is read: up to Pillow's own 64 MB of them,
# 0.4 s of a decode thread for a 66 kB picture (64 in one call held it 25 s). A photo's
# metadata is kilobytes; more is refused as an unreadable header.
PngImagePlugin.MAX_TEXT_MEMORY = 4 * 1024 * 1024

ALLOWED_FORMATS = {"JPEG": "image/jpeg", "PNG": "image/png", "WEBP": "image/webp"}
IMAGE_CONTENT_TYPES = set(ALLOWED_FORMATS.values()) | {"image/jpg", "application/octet-stream"}

# Formats are told by their magic bytes and opened by their own plugin, not PIL.Image.open:
# nothing but these three decoders ever sees untrusted bytes, and Ultralytics' global
# monkey-patch of Image.open (it retries unknown bytes through a HEIF plugin) stays out.
_DECODERS: list[tuple[bytes, int, str, type[ImageFile.ImageFile]]] = [
    (b"\xff\xd8\xff", 0, "JPEG", JpegImagePlugin.JpegImageFile),
    (b"\x89PNG\r\n\x1a\n", 0, "PNG", PngImagePlugin.PngImageFile),
    (b"WEBP", 8, "WEBP", WebPImagePlugin.WebPImageFile),
]
_OTHER_FORMATS = {
    b"GIF8": "GIF",
    b"BM": "BMP",
    b"II*\x00": "TIFF",
    b"MM\x00*": "TIFF",
    b"\x00\x00\x01\x00": "ICO",
    b"\x00\x00\x00\x0cjP  \r\n\x87\n": "JPEG 2000",
    b"\xffO\xffQ": "JPEG 2000",
    b"\xff\x0a": "JPEG XL",
    b"\x00\x00\x00\x0cJXL \r\n\x87\n": "JPEG XL",
    b"8BPS": "PSD",
    b"qoif": "QOI",
    b"v/1\x01": "OpenEXR",
    b"DDS ": "DDS",
}
# The major brands of HEIF (HEIC, its sequences and AVIF) in an ISO-BMFF "ftyp" box.
_HEIF_BRANDS = {
    b"heic", b"heix", b"hevc", b"hevx", b"heim", b"heis", b"hevm", b"hevs",
    b"mif1", b"msf1", b"avif", b"avis",
}  # fmt: skip
_NETPBM = re.compile(rb"P[1-7][ \t\r\n#]")


def _sniff(data: bytes) -> tuple[str, type[ImageFile.ImageFile]]:
    for magic, offset, name, cls in _DECODERS:
        if data[offset : offset + len(magic)] == magic and (name != "WEBP" or data[:4] == b"RIFF"):
            return name, cls
    for magic, name in _OTHER_FORMATS.items():
        if data.startswith(magic):
            raise ImageError(
                415, f"unsupported image format {name}; send a JPEG, PNG or WebP image"
            )
    if data[4:8] == b"ftyp" and data[8:12] in _HEIF_BRANDS:
        raise ImageError(415, "unsupported image format HEIF/AVIF; send a JPEG, PNG or WebP image")
    if _NETPBM.match(data[:3]):
        raise ImageError(
            415, "unsupported image format PPM/PGM/PBM; send a JPEG, PNG or WebP image"
        )
    raise ImageError(
        400, f"not a decodable image ({len(data)} bytes); send a JPEG, PNG or WebP image"
    )


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
    return decode_upload(data, max_pixels)[0]


MAX_JPEG_SCANS = 100
"""The most scans a JPEG may hold. Each scan of a progressive JPEG is decoded over the whole
picture, and a crafted one repeats a scan of a few bytes: a 97 kB 4000x3000 JPEG of 1,000
scans took 7.3 s of a decode thread here (10,000 in 330 kB over a minute), where its pixels
alone pass the pixel limit. Encoders write 10 or so (libjpeg's progression: 10 for a colour
picture, 6 for a grey one), mozjpeg's and jpegtran's optimized ones a few more; NVIDIA's
nvImageCodec refuses over 256 for the same reason (the Cure53 report on libjpeg-turbo)."""

EXIF_ORIENTATION = 0x0112
"""The EXIF tag saying how a picture is turned; values 5 to 8 swap its width and height."""

_UPRIGHT = {
    2: PILImage.Transpose.FLIP_LEFT_RIGHT,
    3: PILImage.Transpose.ROTATE_180,
    4: PILImage.Transpose.FLIP_TOP_BOTTOM,
    5: PILImage.Transpose.TRANSPOSE,
    6: PILImage.Transpose.ROTATE_270,
    7: PILImage.Transpose.TRANSVERSE,
    8: PILImage.Transpose.ROTATE_90,
}
"""What turns a picture of each EXIF orientation upright (as ``ImageOps.exif_transpose``)."""


def _orientation(img: PILImage.Image) -> int:
    """The picture's EXIF orientation; 1 (as stored) where its EXIF cannot be read.

    Not ``ImageOps.exif_transpose``: it also writes the EXIF back without the tag, and a tag
    of an unexpected type (a signed width) made that raise ``struct.error``: a 500 for a phone
    photo whose pixels are fine and whose EXIF the engine never reads."""
    try:
        value = img.getexif().get(EXIF_ORIENTATION, 1)
    except Exception:  # any EXIF Pillow cannot parse: the pixels as they are
        return 1
    return value if isinstance(value, int) else 1


def _opened(
    data: bytes, max_pixels: int, max_side: int
) -> tuple[ImageFile.ImageFile, str, tuple[int, int]]:
    """The image opened (its header read, no pixel decoded; a large JPEG set to decode
    smaller: see :func:`decode_upload`), its format and its width and height as sent.

    Raises:
        ImageError: 400 empty or unreadable header, 415 another format, 413 too many pixels.
    """
    if not data:
        raise ImageError(400, "empty image: the upload has no bytes")
    fmt, decoder = _sniff(data)
    try:
        img = decoder(io.BytesIO(data))
    except (OSError, ValueError, SyntaxError, IndexError) as exc:
        raise ImageError(400, f"unreadable {fmt} header: {exc}") from None
    width, height = img.size
    if width < 1 or height < 1:
        raise ImageError(400, f"image has no pixels ({width}x{height})")
    if width * height > max_pixels:
        raise ImageError(
            413,
            f"image is {width}x{height} = {width * height / 1e6:.1f} MP, over the limit of"
            f" {max_pixels / 1e6:.1f} MP (setting STREAMDET_MAX_IMAGE_PIXELS)",
        )
    # A scan starts with the marker SOS (FF DA), which the entropy-coded data never holds
    # (its FF bytes are stuffed with 00): counted in the whole file, what the decoder would
    # read is at most this (a thumbnail in the EXIF adds its own few).
    if fmt == "JPEG" and (scans := data.count(b"\xff\xda")) > MAX_JPEG_SCANS:
        raise ImageError(
            400,
            f"JPEG holds {scans} scans, over the limit of {MAX_JPEG_SCANS}: each is decoded over"
            " the whole picture (encoders write about 10); re-encode the image",
        )
    if max_side and fmt == "JPEG" and max(width, height) >= 2 * max_side:
        try:
            img.draft("RGB", decoded_size(width, height, max_side))  # libjpeg keeps at least it
        except (OSError, ValueError, SyntaxError) as exc:
            raise ImageError(400, f"truncated or corrupt {fmt} image: {exc}") from None
    return img, fmt, (width, height)


def decoded_pixels(data: bytes, max_pixels: int, max_side: int = 0) -> int:
    """How many pixels :func:`decode_upload` will decode ``data`` to, from its header alone
    (a large JPEG decoded smaller counts as such), after the same checks.

    Raises:
        ImageError: as :func:`decode_upload` does for its header.
    """
    img, _, _ = _opened(data, max_pixels, max_side)
    width, height = img.size
    return width * height


def decode_upload(data: bytes, max_pixels: int, max_side: int = 0) -> tuple[Image, tuple[int, int]]:
    """:func:`decode_image`, and the image's width and height; with ``max_side``, a JPEG at
    least twice that size is decoded at a half, a quarter or an eighth of it by libjpeg itself
    (``draft``: the scaled inverse DCT, several times faster than decoding it whole), as
    long as it stays at least ``max_side`` on its longer side: what an engine of that input
    size sees is the same picture, the engine resizes it anyway. The size returned is the
    image's own (EXIF-rotated), to give boxes in.

    Raises:
        ImageError: 400 empty/corrupt/truncated, 415 another format, 413 too many pixels.
    """
    opened, fmt, (width, height) = _opened(data, max_pixels, max_side)
    img: PILImage.Image = opened
    try:
        orientation = _orientation(img)
        img.load()
        if (upright := _UPRIGHT.get(orientation)) is not None:
            img = img.transpose(upright)
        if img.mode.startswith("I"):  # 16-bit grey PNG ("I;16", or "I" from older Pillow)
            grey = (np.asarray(img).astype(np.uint32) >> 8).clip(0, 255).astype(np.uint8)
            rgb_array = np.ascontiguousarray(np.repeat(grey[..., None], 3, axis=2))
        else:
            rgb_array = np.asarray(img.convert("RGB"), dtype=np.uint8)
    except (OSError, ValueError, SyntaxError) as exc:
        raise ImageError(400, f"truncated or corrupt {fmt} image: {exc}") from None
    size = (height, width) if orientation in (5, 6, 7, 8) else (width, height)
    return np.ascontiguousarray(rgb_array), size
