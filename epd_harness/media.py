"""Generated media for test and bench runs: seeded images and videos, as bytes or data URLs (that run's process)."""

from __future__ import annotations

import base64
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


def image_url(seed: int, height: int, width: int) -> str:
    """A PNG of seeded noise (:func:`image_bytes`) as a data URL."""
    return "data:image/png;base64," + base64.b64encode(image_bytes(width, height, seed=seed)).decode()


def video_url(seed: int, frames: int, height: int, width: int) -> str:
    """A video as vLLM's frame-sequence data URL: ``data:video/jpeg;base64,FRAME,FRAME,...``."""
    rng = np.random.default_rng(seed)
    parts = []
    for _ in range(frames):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, "JPEG", quality=90)
        parts.append(base64.b64encode(buf.getvalue()).decode())
    return "data:video/jpeg;base64," + ",".join(parts)
