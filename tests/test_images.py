"""Uploads decoded for the engine (:func:`server.images.decode_upload`): large JPEGs decoded
smaller by libjpeg itself, their size as sent kept for the boxes, EXIF turns included."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image as PILImage
from PIL import ImageOps

from server.images import (
    EXIF_ORIENTATION,
    MAX_JPEG_SCANS,
    ImageError,
    decode_image,
    decode_upload,
    decoded_pixels,
)


def _jpeg(width: int, height: int, orientation: int | None = None, fmt: str = "JPEG") -> bytes:
    pixels = np.zeros((height, width, 3), np.uint8)
    pixels[: height // 2, : width // 2] = (220, 30, 30)  # red top-left quarter
    image = PILImage.fromarray(pixels)
    out = io.BytesIO()
    if orientation is None:
        image.save(out, format=fmt)
    else:
        exif = PILImage.Exif()
        exif[EXIF_ORIENTATION] = orientation
        image.save(out, format=fmt, exif=exif)
    return out.getvalue()


def test_a_large_jpeg_is_decoded_at_a_power_of_two_no_smaller_than_the_engine() -> None:
    cases = {
        (4000, 3000): (1000, 750),  # a 12 MP photo: an eighth would be under 640 wide, a quarter
        (1920, 1080): (960, 540),
        (1280, 720): (640, 360),
        (1279, 720): (1279, 720),  # under twice 640: whole
    }
    for (width, height), (w, h) in cases.items():
        image, size = decode_upload(_jpeg(width, height), 50_000_000, 640)
        assert size == (width, height)
        assert image.shape == (h, w, 3), (width, height)
        # The same picture, smaller: the red quarter where it was.
        assert tuple(image[h // 4, w // 4]) > (180, 0, 0) and image[h // 4, w // 4, 1] < 60
        assert image[3 * h // 4, 3 * w // 4].max() < 30
    # Without max_side, or not a JPEG: whole.
    assert decode_upload(_jpeg(4000, 3000), 50_000_000)[0].shape == (3000, 4000, 3)
    assert decode_image(_jpeg(1920, 1080), 50_000_000).shape == (1080, 1920, 3)
    png, size = decode_upload(_jpeg(1920, 1080, fmt="PNG"), 50_000_000, 640)
    assert png.shape == (1080, 1920, 3) and size == (1920, 1080)


def test_a_turned_jpeg_is_decoded_smaller_and_gives_its_turned_size() -> None:
    # Orientation 6: the camera was held upright; shown turned, 3000 wide and 4000 high.
    image, size = decode_upload(_jpeg(4000, 3000, orientation=6), 50_000_000, 640)
    assert size == (3000, 4000) and image.shape == (1000, 750, 3)
    assert decode_upload(_jpeg(4000, 3000, orientation=3), 50_000_000, 640)[1] == (4000, 3000)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_each_exif_orientation_is_turned_as_pillow_turns_it(fmt: str) -> None:
    for orientation in range(1, 9):
        data = _jpeg(64, 48, orientation=orientation, fmt=fmt)
        image, size = decode_upload(data, 50_000_000)
        with PILImage.open(io.BytesIO(data)) as opened:
            want = np.asarray(ImageOps.exif_transpose(opened).convert("RGB"))
        assert np.array_equal(image, want), orientation
        assert size == (want.shape[1], want.shape[0]), orientation


def _exif_with(entries: list[tuple[int, int, bytes]]) -> bytes:
    """Raw EXIF (one little-endian IFD) of ``(tag, type, 4-byte value)`` entries."""
    body = b"".join(struct.pack("<HHI", tag, kind, 1) + value for tag, kind, value in entries)
    return b"Exif\0\0II*\0" + struct.pack("<IH", 8, len(entries)) + body + b"\0\0\0\0"


def test_a_turned_photo_whose_exif_pillow_cannot_write_back_is_turned() -> None:
    """An ImageWidth tag stored as a negative SSHORT beside orientation 6: Pillow reads it,
    and ``exif_transpose``'s writing it back raised ``struct.error`` (a bare 500)."""
    pixels = np.zeros((48, 64, 3), np.uint8)
    pixels[:24, :32] = (220, 30, 30)
    exif = _exif_with([(0x0100, 8, struct.pack("<h", -5) + b"\0\0"), (0x0112, 3, b"\x06\0\0\0")])
    for fmt in ("JPEG", "PNG"):
        out = io.BytesIO()
        PILImage.fromarray(pixels).save(out, format=fmt, exif=exif)
        image, size = decode_upload(out.getvalue(), 50_000_000)
        assert size == (48, 64) and image.shape == (64, 48, 3), fmt
        assert image[10, 40, 0] > 180 and image[50, 10, 0] < 30  # red now top-right
    # EXIF that cannot be read at all: the pixels as stored.
    out = io.BytesIO()
    PILImage.fromarray(pixels).save(out, format="JPEG", exif=b"Exif\0\0II*\0\xff\xff\xff\x7f")
    with pytest.warns(UserWarning, match="Corrupt EXIF"):  # Pillow's, on reading it
        assert decode_upload(out.getvalue(), 50_000_000)[1] == (64, 48)


def test_a_16_bit_grey_png_is_decoded_as_opencv_reads_it() -> None:
    """Its samples scaled to 8 bits (the high byte, as ``cv2.imread`` and so Ultralytics read
    it): ``convert("RGB")`` clipped them at 255, an almost white picture and no detection."""
    import cv2

    ramp = (np.arange(64 * 48, dtype=np.uint32).reshape(48, 64) * 21).astype(np.uint16)
    out = io.BytesIO()
    PILImage.fromarray(ramp).save(out, format="PNG")
    image = decode_image(out.getvalue(), 50_000_000)
    theirs = cv2.imdecode(np.frombuffer(out.getvalue(), np.uint8), cv2.IMREAD_COLOR)
    assert theirs is not None
    assert image.shape == (48, 64, 3) and image.dtype == np.uint8
    np.testing.assert_array_equal(image, theirs[..., ::-1])
    assert 100 < image.mean() < 150  # not all white


def _scans_repeated(jpeg: bytes, times: int) -> bytes:
    """``jpeg`` (progressive) with its last scan repeated ``times`` times: each repeat a few
    bytes, each decoded over the whole picture."""
    start = jpeg.rindex(b"\xff\xda")
    end = jpeg.rindex(b"\xff\xd9")
    return jpeg[:start] + jpeg[start:end] * times + jpeg[end:]


def test_a_jpeg_of_thousands_of_scans_is_refused_before_decoding() -> None:
    """A progressive JPEG decodes every scan over the whole picture: one of 1,000 repeated
    scans, 97 kB, took 7.3 s of a decode thread at 4000x3000 (pixels under the limit)."""
    out = io.BytesIO()
    PILImage.new("RGB", (640, 480), "grey").save(out, format="JPEG", progressive=True)
    progressive = out.getvalue()
    assert progressive.count(b"\xff\xda") == 10  # libjpeg's progression for a colour picture
    assert decode_image(progressive, 50_000_000).shape == (480, 640, 3)
    crafted = _scans_repeated(progressive, 2000)
    assert len(crafted) < 100_000
    with pytest.raises(ImageError) as refused:
        decode_upload(crafted, 50_000_000, 320)
    assert refused.value.status_code == 400
    assert f"2009 scans, over the limit of {MAX_JPEG_SCANS}" in refused.value.message
    with pytest.raises(ImageError):
        decoded_pixels(crafted, 50_000_000, 320)  # KServe v2's check before decoding
    # As many as the limit still decode.
    allowed = _scans_repeated(progressive, MAX_JPEG_SCANS - 9)
    assert decode_image(allowed, 50_000_000).shape == (480, 640, 3)


def test_a_png_of_megabytes_of_text_chunks_is_refused_as_its_header_is_read() -> None:
    """Pillow inflates a PNG's text chunks as it reads the header, up to its own 64 MB: a
    66 kB picture of 63 zTXt chunks took 0.4 s of a decode thread, 64 in a call 25 s. More
    than 4 MB of text is refused; a photo's few kB of metadata are read as before."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    pixels = zlib.compress(b"".join(b"\x00" + b"\x7f" * 48 for _ in range(16)))
    text = zlib.compress(b"A" * 1_000_000, 9)  # 1 MB inflated, 1 kB sent

    def png(chunks: int) -> bytes:
        texts = b"".join(chunk(b"zTXt", b"k%d\x00\x00" % i + text) for i in range(chunks))
        head = chunk(b"IHDR", struct.pack(">IIBBBBB", 16, 16, 8, 2, 0, 0, 0))
        body = chunk(b"IDAT", pixels) + chunk(b"IEND", b"")
        return b"\x89PNG\r\n\x1a\n" + head + texts + body

    assert decoded_pixels(png(2), 50_000_000, 640) == 256  # 2 MB of text: a picture still
    assert decode_image(png(2), 50_000_000).shape == (16, 16, 3)
    crafted = png(63)
    assert len(crafted) < 100_000
    with pytest.raises(ImageError) as refused:
        decoded_pixels(crafted, 50_000_000, 640)
    assert refused.value.status_code == 400
    assert "unreadable PNG header: Too much memory used in text chunks" in refused.value.message


@pytest.mark.parametrize(
    ("fmt", "name"),
    [("ICO", "ICO"), ("PPM", "PPM/PGM/PBM"), ("JPEG2000", "JPEG 2000"), ("TIFF", "TIFF")],
)
def test_an_image_format_it_does_not_take_is_a_415_naming_it(fmt: str, name: str) -> None:
    """ICO, PPM, JPEG 2000 (and JPEG XL, HEIF's other brands) were 400 "not a decodable
    image", though each is an image the server does not take: 415 naming the format."""
    out = io.BytesIO()
    PILImage.new("RGB", (16, 16), (10, 200, 10)).save(out, format=fmt)
    with pytest.raises(ImageError) as refused:
        decode_image(out.getvalue(), 1_000_000)
    assert refused.value.status_code == 415 and f"format {name};" in refused.value.message


@pytest.mark.parametrize(
    "head",
    [
        b"\x00\x00\x00\x1cftypavis\x00\x00\x00\x00avifmif1msf1",  # an animated AVIF
        b"\x00\x00\x00\x18ftypheis\x00\x00\x00\x00mif1heic",
        b"\x00\x00\x00\x18ftyphevc\x00\x00\x00\x00msf1hevc",
        b"\xff\x0a\xfa\x7f",  # a JPEG XL codestream
        b"\x00\x00\x00\x0cJXL \r\n\x87\n\x00\x00\x00\x14ftypjxl ",
    ],
)
def test_heif_brands_and_jpeg_xl_are_415(head: bytes) -> None:
    with pytest.raises(ImageError) as refused:
        decode_image(head + bytes(64), 1_000_000)
    assert refused.value.status_code == 415, refused.value.message
