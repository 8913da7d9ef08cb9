"""A corpus of bad media: each item raises InvalidMediaError naming the item and the reason."""

from __future__ import annotations

import io
import struct
import zlib
from collections.abc import Callable

import numpy as np
import pytest
from PIL import Image

from common.errors import InvalidMediaError
from encoder_server.preprocess import PreprocessConfig, Preprocessor


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_claiming(width: int, height: int) -> bytes:
    """A valid PNG header for any size, with almost no pixel data behind it."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr)
            + _chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + _chunk(b"IEND", b""))


def gif_claiming(width: int, height: int) -> bytes:
    return (b"GIF89a" + struct.pack("<HHBBB", width, height, 0, 0, 0) + b"\x2c"
            + struct.pack("<HHHHB", 0, 0, width, height, 0) + b"\x02\x02\x44\x01\x00\x3b")


def encoded(fmt: str, size: tuple[int, int] = (64, 48), mode: str = "RGB") -> bytes:
    out = io.BytesIO()
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).convert(mode).save(out, format=fmt)
    return out.getvalue()


def float_tiff() -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).random((16, 16)).astype(np.float32)).save(out, format="TIFF")
    return out.getvalue()


CONFIG = PreprocessConfig(max_video_frames=4)
TIFF_ALLOWED = PreprocessConfig(formats=("PNG", "TIFF"))

# name -> (preprocess call, expected reason pattern)
CORPUS: dict[str, tuple[Callable[[Preprocessor, str], object], str]] = {
    "empty": (lambda p, n: p.image(b"", item=n), "empty payload"),
    "text": (lambda p, n: p.image(b"hello, this is not an image", item=n), "not a decodable image"),
    "random-bytes": (lambda p, n: p.image(np.random.default_rng(1).bytes(4096), item=n), "not a decodable image"),
    "png-signature-only": (lambda p, n: p.image(b"\x89PNG\r\n\x1a\n", item=n), "not a decodable image|header"),
    "truncated-png": (lambda p, n: p.image(encoded("PNG")[:200], item=n), "cannot decode|truncated"),
    "truncated-jpeg": (lambda p, n: p.image(encoded("JPEG")[:400], item=n), "cannot decode|truncated"),
    "truncated-webp": (lambda p, n: p.image(encoded("WEBP")[:60], item=n), "cannot|not a decodable"),
    "png-bomb-30000": (lambda p, n: p.image(png_claiming(30000, 30000), item=n), "decompression bomb|exceeds"),
    "gif-bomb-60000": (lambda p, n: p.image(gif_claiming(60000, 60000), item=n), "decompression bomb|exceeds"),
    "over-limit-pixels": (lambda p, n: p.image(png_claiming(5000, 4000), item=n), "20000000 pixels exceeds"),
    "zero-width-png": (lambda p, n: p.image(png_claiming(0, 10), item=n), "zero-size|not a decodable"),
    "zero-size-gif": (lambda p, n: p.image(gif_claiming(0, 5), item=n), "zero-size|not a decodable"),
    "absurd-aspect": (lambda p, n: p.image(png_claiming(1, 300), item=n), "aspect ratio"),
    "unsupported-format-bmp": (lambda p, n: p.image(encoded("BMP"), item=n), "accepted format"),
    "not-bytes": (lambda p, n: p.image("a string", item=n), "expected encoded bytes"),  # type: ignore[arg-type]
    "too-many-frames": (lambda p, n: p.video([encoded("PNG")] * 5, item=n), "5 frames, more than the limit of 4"),
    "no-frames": (lambda p, n: p.video([], item=n), "no frames"),
    "bad-fps": (lambda p, n: p.video([encoded("PNG")], fps=0.0, item=n), "fps"),
    "single-bytes-as-video": (lambda p, n: p.video(encoded("PNG"), item=n), "sequence of encoded frames"),
}


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_bad_media_raises_invalid_media_error(name: str) -> None:
    call, reason = CORPUS[name]
    with pytest.raises(InvalidMediaError, match=reason) as info:
        call(Preprocessor(CONFIG), name)
    assert info.value.item == name
    assert str(info.value).startswith(f"invalid media item {name}: ")


def test_bad_frame_is_named_within_its_video() -> None:
    frames = [encoded("PNG"), b"garbage", encoded("PNG")]
    with pytest.raises(InvalidMediaError) as info:
        Preprocessor(CONFIG).video(frames, item="clip")
    assert info.value.item == "clip frame 1"


def test_frames_of_different_sizes_are_refused() -> None:
    frames = [encoded("PNG", (64, 48)), encoded("PNG", (48, 64))]
    with pytest.raises(InvalidMediaError, match="must share a size") as info:
        Preprocessor(CONFIG).video(frames, item="clip")
    assert info.value.item == "clip frame 1"


def test_unsupported_mode_is_refused() -> None:
    # Float samples have no defined 8-bit RGB mapping; TIFF is allowed here only to carry them.
    with pytest.raises(InvalidMediaError, match="unsupported image mode 'F'"):
        Preprocessor(TIFF_ALLOWED).image(float_tiff(), item="float")


def test_limit_is_configurable() -> None:
    small = Preprocessor(PreprocessConfig(max_image_pixels=64 * 47))
    with pytest.raises(InvalidMediaError, match="3072 pixels exceeds the limit of 3008"):
        small.image(encoded("PNG", (64, 48)), item="x")
    assert Preprocessor(PreprocessConfig(max_image_pixels=64 * 48)).image(encoded("PNG", (64, 48))).num_tokens > 0
