"""Decode untrusted image bytes into RGB Pillow images, with limits (encoder process).

Everything here runs on bytes a client sent, so every check that can run on the
header runs before any pixel is decoded: an image whose header claims more than
``max_pixels`` pixels is refused without allocating its raster (decompression
bombs), and only the formats in ``formats`` reach a decoder at all.

Any failure is an :class:`~common.errors.InvalidMediaError` naming the item and
the reason; nothing here raises anything else on bad input.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Sequence

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from common.errors import InvalidMediaError

logger = logging.getLogger(__name__)

DEFAULT_FORMATS: tuple[str, ...] = ("PNG", "JPEG", "WEBP", "GIF")

# Modes Pillow converts to 8-bit RGB with a defined meaning. 16-bit grayscale is
# handled separately (scaled to 8 bits: Pillow's own conversion clips instead).
# 32-bit integer ("I") and float ("F") samples have no agreed 8-bit mapping, so
# they are refused rather than guessed.
_RGB_CONVERTIBLE = frozenset(
    {"1", "L", "LA", "La", "P", "PA", "RGB", "RGBA", "RGBa", "RGBX", "CMYK", "YCbCr", "LAB", "HSV"}
)
_SIXTEEN_BIT = frozenset({"I;16", "I;16L", "I;16B", "I;16N"})

# Qwen-VL's smart_resize refuses aspect ratios beyond this; refusing here keeps
# the error an InvalidMediaError instead of a ValueError deep in resizing.
MAX_ASPECT_RATIO = 200.0


def decode_image(
    data: bytes,
    *,
    item: str,
    max_pixels: int,
    formats: Sequence[str] = DEFAULT_FORMATS,
) -> Image.Image:
    """Decode one encoded image to an RGB image, EXIF orientation applied.

    Checks, in order: non-empty bytes, a known allowed format, a non-zero size
    within ``max_pixels`` and a sane aspect ratio (all from the header), then
    decodes the first frame and converts its mode to RGB (transparency is
    composited onto white, as the Hugging Face processors do).
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InvalidMediaError(item, f"expected encoded bytes, got {type(data).__name__}")
    if len(data) == 0:
        raise InvalidMediaError(item, "empty payload (0 bytes)")
    try:
        image = Image.open(io.BytesIO(bytes(data)), formats=list(formats))
    except UnidentifiedImageError:
        raise InvalidMediaError(
            item, f"not a decodable image in an accepted format ({', '.join(formats)})"
        ) from None
    except Image.DecompressionBombError as exc:
        raise InvalidMediaError(item, f"decompression bomb refused: {exc}") from None
    except Exception as exc:
        # Pillow's header parsers raise many unrelated types (SyntaxError,
        # struct.error, ValueError, ...) on malformed input; all are the input's fault.
        raise InvalidMediaError(item, f"cannot read image header: {type(exc).__name__}: {exc}") from None

    with image:
        check_dimensions(image.size, item=item, max_pixels=max_pixels, fmt=image.format)
        try:
            # Only the first frame of an animated GIF/WebP/APNG is decoded.
            image.load()
            oriented = ImageOps.exif_transpose(image)
        except Exception as exc:
            # Truncated streams raise OSError, corrupt ones a zoo of types; as above.
            raise InvalidMediaError(item, f"cannot decode {image.format} data: {type(exc).__name__}: {exc}") from None
        rgb = to_rgb(oriented, item=item)
    if rgb.size[0] * rgb.size[1] > max_pixels:  # EXIF transposition keeps the count; defensive
        raise InvalidMediaError(item, f"decoded size {rgb.size} exceeds {max_pixels} pixels")
    return rgb


def check_dimensions(size: tuple[int, int], *, item: str, max_pixels: int, fmt: str | None) -> None:
    """Refuse empty, oversized and absurdly elongated images from their header size."""
    width, height = size
    if width <= 0 or height <= 0:
        raise InvalidMediaError(item, f"zero-size image {width}x{height}")
    if width * height > max_pixels:
        raise InvalidMediaError(
            item,
            f"{fmt or 'image'} of {width}x{height} = {width * height} pixels exceeds the limit of {max_pixels} pixels",
        )
    ratio = max(width, height) / min(width, height)
    if ratio > MAX_ASPECT_RATIO:
        raise InvalidMediaError(
            item, f"aspect ratio {ratio:.1f} of {width}x{height} exceeds {MAX_ASPECT_RATIO:.0f}"
        )


def to_rgb(image: Image.Image, *, item: str) -> Image.Image:
    """Any supported mode to 8-bit RGB; transparency composited onto white."""
    mode = image.mode
    if mode in _SIXTEEN_BIT:
        # Keep the 8 most significant bits: Pillow's convert() would clip at 255.
        samples = np.asarray(image, dtype=np.uint16) >> 8
        image = Image.fromarray(samples.astype(np.uint8), mode="L")
    elif mode not in _RGB_CONVERTIBLE:
        raise InvalidMediaError(item, f"unsupported image mode {mode!r}")
    has_alpha = "A" in image.getbands() or image.info.get("transparency") is not None
    try:
        if has_alpha:
            rgba = image.convert("RGBA")
            background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return Image.alpha_composite(background, rgba).convert("RGB")
        return image.convert("RGB")
    except Exception as exc:
        raise InvalidMediaError(item, f"cannot convert mode {mode!r} to RGB: {exc}") from None
