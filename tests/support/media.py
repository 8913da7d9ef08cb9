"""Generated test media: deterministic images and videos of chosen sizes."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def image_bytes(width: int, height: int, seed: int = 0, fmt: str = "PNG") -> bytes:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format=fmt)
    return buf.getvalue()


def video_frames(width: int, height: int, count: int, seed: int = 0) -> list[bytes]:
    return [image_bytes(width, height, seed=seed * 1000 + i) for i in range(count)]
