"""Item identity and token counting that encoder and prefill must agree on (both processes).

* ``content_hash`` digests an item's bytes (an image, or a video's frames and
  fps). It is the only variable input of the item's ``mm_hash`` and the key a
  prefill worker routes the item by.
* ``mm_hash`` binds the content to the model and to every preprocessing
  parameter that changes pixel values: the same bytes under another model or
  another resize policy are another item. The encoder computes it from the
  bytes it received, so a client can never store content under a key of its
  choosing; a prefill worker computes the same value to name the item in its
  prefix-cache keys before asking the encoder anything. A tenant's cache salt
  (vLLM's ``cache_salt``) makes the same bytes another item again: its mm_hash
  is derived from the salt and the unsalted mm_hash; no salt, the unsalted one.
* ``image_grid`` / ``video_grid`` give the Qwen-VL patch grid and the number of
  merged tokens (placeholders) an item takes.
"""

from __future__ import annotations

import hashlib
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass

import blake3

from common.errors import InvalidMediaError

# BLAKE3 in key-derivation mode: its context string separates our content digests from
# any other use of the hash. BLAKE3 hashes at memory speed (about 7x BLAKE2b here).
_CONTENT_CONTEXT = "epd-cache 2026 item content v2"
_MM_PERSON = b"epd-mmhash-v1"
_SALTED_PERSON = b"epd-mmsalt-v1"  # its own personalization: a salted mm_hash is never an unsalted one

# EXIF orientations 5..8 rotate by 90 degrees: width and height swap.
_EXIF_ORIENTATION = 0x0112
_SWAPPING_ORIENTATIONS = {5, 6, 7, 8}


@dataclass(frozen=True, slots=True)
class PreprocessParams:
    """What decides an item's grid: patching, merging, resize bounds and video sampling.

    The encoder announces its values in the handshake; defaults are Qwen3-VL's
    (patch 16, merge 2, 64..512 merged tokens per image).
    """

    patch_size: int = 16
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 64 * 32 * 32
    max_pixels: int = 512 * 32 * 32
    video_min_pixels: int | None = None  # None: the image bounds
    video_max_pixels: int | None = None
    video_sample_fps: float | None = 2.0  # None: keep every frame

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @property
    def video_bounds(self) -> tuple[int, int]:
        return (self.video_min_pixels if self.video_min_pixels is not None else self.min_pixels,
                self.video_max_pixels if self.video_max_pixels is not None else self.max_pixels)


def content_hash(kind: str, frames: Sequence[bytes | memoryview], fps: float | None = None) -> str:
    """Digest (BLAKE3, 128 bits) of an item's bytes; frames are length-prefixed so boundaries count."""
    if kind not in ("image", "video"):
        raise ValueError(f"kind must be 'image' or 'video', got {kind!r}")
    h = blake3.blake3(derive_key_context=_CONTENT_CONTEXT)
    h.update(kind.encode())
    h.update(repr(float(fps) if fps else 0.0).encode())
    for frame in frames:
        h.update(len(frame).to_bytes(8, "little"))
        h.update(frame)
    return h.hexdigest(16)


def mm_hash(model_id: str, preprocess_fingerprint: str, content: str, cache_salt: str = "") -> str:
    """32 lowercase hex digits naming (model, preprocessing, content), under ``cache_salt`` if one is given.

    Unsalted: BLAKE2b (16 bytes, personalization ``epd-mmhash-v1``) over the three parts, each
    length-prefixed. Salted: BLAKE2b (16 bytes, ``epd-mmsalt-v1``) over the length-prefixed salt
    and unsalted mm_hash, so the same bytes under two salts are two items, and neither is the
    unsalted one; the format stays what every consumer checks.
    """
    unsalted = _digest(_MM_PERSON, (model_id, preprocess_fingerprint, content))
    return _digest(_SALTED_PERSON, (cache_salt, unsalted)) if cache_salt else unsalted


def _digest(person: bytes, parts: Sequence[str]) -> str:
    h = hashlib.blake2b(digest_size=16, person=person)
    for part in parts:
        data = part.encode()
        h.update(len(data).to_bytes(4, "little"))
        h.update(data)
    return h.hexdigest()


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen-VL resize target: both sides multiples of ``factor``, area within the bounds,
    aspect ratio kept as closely as rounding allows."""
    if height <= 0 or width <= 0:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio of {width}x{height} is above 200")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def sample_frame_indices(count: int, fps: float | None, target_fps: float | None, temporal_patch: int) -> list[int]:
    """Frames of a video to keep: all of them unless both rates are known and the
    source is faster than the target, else uniformly spaced to ``target_fps``
    (at least one temporal patch)."""
    if fps is None or target_fps is None or target_fps >= fps:
        return list(range(count))
    wanted = min(count, max(temporal_patch, round(count * target_fps / fps)))
    if wanted >= count:
        return list(range(count))
    if wanted == 1:
        return [0]
    step = (count - 1) / (wanted - 1)
    return [round(i * step) for i in range(wanted)]


def image_grid(height: int, width: int, params: PreprocessParams) -> tuple[int, int, int]:
    """(t, h, w) in patches for one image (t is 1: the frame is repeated to fill the temporal patch)."""
    h, w = smart_resize(height, width, params.factor, params.min_pixels, params.max_pixels)
    return (1, h // params.patch_size, w // params.patch_size)


def video_grid(
    num_frames: int, height: int, width: int, params: PreprocessParams, fps: float | None = None
) -> tuple[int, int, int]:
    """(t, h, w) for a video of ``num_frames`` frames at ``fps``: frames are sampled to
    ``video_sample_fps``, then the last one pads to a whole temporal patch."""
    if num_frames <= 0:
        raise ValueError(f"a video needs at least one frame, got {num_frames}")
    kept = len(sample_frame_indices(num_frames, fps or None, params.video_sample_fps, params.temporal_patch_size))
    low, high = params.video_bounds
    h, w = smart_resize(height, width, params.factor, low, high)
    return (math.ceil(kept / params.temporal_patch_size), h // params.patch_size, w // params.patch_size)


def num_tokens(grid_thw: Sequence[int], merge_size: int) -> int:
    """Merged tokens (placeholders) of an item: t * h * w / merge^2."""
    t, h, w = grid_thw
    return t * h * w // (merge_size * merge_size)


def probe_image_size(data: bytes, item: str = "image") -> tuple[int, int]:
    """(height, width) after EXIF orientation, read from the header without decoding pixels."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
            try:
                orientation = img.getexif().get(_EXIF_ORIENTATION, 1)
            except Exception:  # a broken EXIF block does not change the size
                orientation = 1
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise InvalidMediaError(item, f"cannot read the image header: {exc}") from exc
    if orientation in _SWAPPING_ORIENTATIONS:
        width, height = height, width
    return height, width
