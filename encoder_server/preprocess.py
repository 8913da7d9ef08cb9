"""Image and video preprocessing into Qwen-VL ``pixel_values`` (encoder process).

Turns encoded bytes into exactly what the Hugging Face Qwen2-VL / Qwen3-VL image
processor produces for the same parameters: decode (see :mod:`.media`), resize
with ``smart_resize`` and bicubic resampling, rescale by ``1/255`` (in float64,
then float32, as HF does), normalize with the checkpoint's mean/std, and
patchify into rows of ``C * temporal_patch * patch * patch`` values ordered in
spatial-merge blocks. An image is its own frame twice (one temporal patch),
whose rows hold the frame once (``ProcessedItem.repeat``: half the bytes; the
Hugging Face rows are :meth:`ProcessedItem.hf_pixel_values`); a video is a
list of frames, optionally subsampled to ``video_sample_fps``, padded with its
last frame to a multiple of the temporal patch.

``grid_thw = (t, h, w)`` counts patches; an item yields ``t*h*w // merge**2``
merged tokens (cache rows).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from PIL import Image

from common.config import read_json_object
from common.errors import ConfigError, InvalidMediaError
from common.media import PreprocessParams, sample_frame_indices, smart_resize
from common.placeholder import ItemMeta, PlaceholderField
from encoder_server.media import DEFAULT_FORMATS, decode_image

logger = logging.getLogger(__name__)

# Bump when the algorithm changes pixel values for the same parameters: it is
# part of the fingerprint, so cached embeddings of the old pipeline stop matching.
PREPROCESS_VERSION = 1

QWEN3_MEAN_STD = (0.5, 0.5, 0.5)
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class _PatchGeometry(Protocol):
    """What preprocessing needs from an encoder config (``VisionConfig`` has it)."""

    @property
    def patch_size(self) -> int: ...

    @property
    def spatial_merge_size(self) -> int: ...

    @property
    def temporal_patch_size(self) -> int: ...


@runtime_checkable
class _HasConfig(Protocol):
    """An encoder object carrying its ``VisionConfig`` as ``.config``."""

    @property
    def config(self) -> _PatchGeometry: ...


@dataclass(frozen=True)
class PreprocessConfig:
    """Every parameter of preprocessing; defaults are Qwen3-VL's (patch 16, mean/std 0.5)."""

    patch_size: int = 16
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 64 * 32 * 32  # Qwen3-VL's shortest_edge
    max_pixels: int = 512 * 32 * 32  # 512 merged tokens per image at patch 16 (one attention block)
    image_mean: tuple[float, ...] = QWEN3_MEAN_STD
    image_std: tuple[float, ...] = QWEN3_MEAN_STD
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    video_min_pixels: int | None = None  # None: same as images
    video_max_pixels: int | None = None
    video_sample_fps: float | None = 2.0  # used only when the caller says the frames' fps
    # Limits on untrusted input; they refuse items but never change pixel values.
    max_image_pixels: int = 16_777_216
    max_video_frames: int = 64
    formats: tuple[str, ...] = field(default=DEFAULT_FORMATS)

    def __post_init__(self) -> None:
        for name in ("patch_size", "merge_size", "temporal_patch_size", "min_pixels", "max_pixels",
                     "max_image_pixels", "max_video_frames"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"preprocess {name} must be > 0, got {getattr(self, name)!r}")
        if self.min_pixels > self.max_pixels:
            raise ConfigError(f"min_pixels {self.min_pixels} exceeds max_pixels {self.max_pixels}")
        if len(self.image_mean) != 3 or len(self.image_std) != 3:
            raise ConfigError(f"image_mean/std need 3 values, got {self.image_mean!r} / {self.image_std!r}")
        if any(s == 0 for s in self.image_std):
            raise ConfigError(f"image_std must be non-zero, got {self.image_std!r}")
        if self.video_sample_fps is not None and self.video_sample_fps <= 0:
            raise ConfigError(f"video_sample_fps must be > 0, got {self.video_sample_fps!r}")
        if not self.formats:
            raise ConfigError("formats must name at least one image format")

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size

    def params(self) -> PreprocessParams:
        """The subset a consumer needs to count an item's tokens (sent in the handshake)."""
        return PreprocessParams(
            self.patch_size, self.merge_size, self.temporal_patch_size, self.min_pixels, self.max_pixels,
            self.video_min_pixels, self.video_max_pixels, self.video_sample_fps)

    def fingerprint(self) -> str:
        """Stable hash of every parameter that changes pixel values (part of ``mm_hash``)."""
        values: dict[str, Any] = {
            "version": PREPROCESS_VERSION,
            "resample": "bicubic",
            "patch_size": self.patch_size,
            "merge_size": self.merge_size,
            "temporal_patch_size": self.temporal_patch_size,
            "min_pixels": self.min_pixels,
            "max_pixels": self.max_pixels,
            "video_min_pixels": self.video_min_pixels,
            "video_max_pixels": self.video_max_pixels,
            "video_sample_fps": self.video_sample_fps,
            "image_mean": [float(v) for v in self.image_mean],
            "image_std": [float(v) for v in self.image_std],
            "do_rescale": self.do_rescale,
            "rescale_factor": float(self.rescale_factor),
            "do_normalize": self.do_normalize,
        }
        text = json.dumps(values, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def check_matches(self, vision: _PatchGeometry) -> None:
        """Refuse a preprocessing config whose patch geometry differs from the encoder's."""
        ours = (self.patch_size, self.merge_size, self.temporal_patch_size)
        theirs = (vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size)
        if ours != theirs:
            raise ConfigError(
                f"preprocessing (patch, merge, temporal) = {ours} does not match the encoder's {theirs}"
            )

    @classmethod
    def for_encoder(
        cls, vision: _PatchGeometry | _HasConfig, *, weights_dir: str | Path | None = None, **overrides: Any
    ) -> PreprocessConfig:
        """The config for an encoder (its ``VisionConfig`` or the encoder itself).

        With a checkpoint directory holding ``preprocessor_config.json``, that file
        decides (and must agree with the encoder's patch geometry); otherwise the
        defaults are sized for the encoder: 64..512 merged tokens per image.
        """
        geometry: _PatchGeometry = vision.config if isinstance(vision, _HasConfig) else vision
        if weights_dir is not None and (Path(weights_dir) / "preprocessor_config.json").is_file():
            config = cls.from_pretrained_dir(weights_dir, **overrides)
            config.check_matches(geometry)
            return config
        factor = geometry.patch_size * geometry.spatial_merge_size
        values: dict[str, Any] = {
            "patch_size": geometry.patch_size,
            "merge_size": geometry.spatial_merge_size,
            "temporal_patch_size": geometry.temporal_patch_size,
            "min_pixels": 64 * factor * factor,
            "max_pixels": 512 * factor * factor,
        }
        values.update(overrides)
        return cls(**values)

    @classmethod
    def from_pretrained_dir(cls, path: str | Path, **overrides: Any) -> PreprocessConfig:
        """Read ``preprocessor_config.json`` (and ``video_preprocessor_config.json``) when present.

        Understands both spellings HF checkpoints use: ``min_pixels``/``max_pixels``
        (Qwen2-VL) and ``size.shortest_edge``/``size.longest_edge`` (Qwen3-VL). A
        directory without one falls back to the encoder's ``config.json``, then to
        the defaults.
        """
        root = Path(path)
        values: dict[str, Any] = {}
        image_file = root / "preprocessor_config.json"
        if image_file.is_file():
            raw = read_json_object(image_file)
            values.update(_geometry_from_json(raw))
            min_px, max_px = _pixel_bounds(raw)
            if min_px is not None:
                values["min_pixels"] = min_px
            if max_px is not None:
                values["max_pixels"] = max_px
            for key in ("image_mean", "image_std"):
                if key in raw:
                    values[key] = tuple(float(v) for v in _as_list(raw[key], key))
            for key in ("do_rescale", "do_normalize"):
                if key in raw:
                    values[key] = bool(raw[key])
            if "rescale_factor" in raw:
                values["rescale_factor"] = float(raw["rescale_factor"])
            if values.get("patch_size", 16) == 14 and "image_mean" not in raw:
                # Qwen2-VL checkpoints rely on the processor's CLIP defaults.
                values["image_mean"], values["image_std"] = CLIP_MEAN, CLIP_STD
        elif (root / "config.json").is_file():
            from encoder_server.vision.config import VisionConfig

            return cls.for_encoder(VisionConfig.from_pretrained_dir(root), **overrides)
        video_file = root / "video_preprocessor_config.json"
        if video_file.is_file():
            raw = read_json_object(video_file)
            min_px, max_px = _pixel_bounds(raw)
            values["video_min_pixels"], values["video_max_pixels"] = min_px, max_px
            if "fps" in raw and raw["fps"] is not None:
                values["video_sample_fps"] = float(raw["fps"])
        values.update(overrides)
        return cls(**values)


def _as_list(value: Any, key: str) -> list[Any]:
    if isinstance(value, (int, float)):
        return [value] * 3
    if not isinstance(value, list):
        raise ConfigError(f"{key} must be a number or a list, got {value!r}")
    return value


def _geometry_from_json(raw: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for src, dst in (("patch_size", "patch_size"), ("merge_size", "merge_size"),
                     ("temporal_patch_size", "temporal_patch_size")):
        if raw.get(src) is not None:
            out[dst] = int(raw[src])
    return out


def _pixel_bounds(raw: dict[str, Any]) -> tuple[int | None, int | None]:
    size = raw.get("size") or {}
    min_px = raw.get("min_pixels", size.get("shortest_edge") if isinstance(size, dict) else None)
    max_px = raw.get("max_pixels", size.get("longest_edge") if isinstance(size, dict) else None)
    return (int(min_px) if min_px is not None else None, int(max_px) if max_px is not None else None)


@dataclass(frozen=True, slots=True)
class ProcessedItem:
    """One preprocessed media item: Hugging Face's patch rows, or for an image one copy of them.

    ``repeat`` 1: ``pixel_values`` are the Hugging Face rows, ``[t*h*w, 3*T*P*P]``.
    ``repeat`` T (an image, one temporal patch of the same frame T times): each row holds
    the frame's patch once, ``[h*w, 3*P*P]``, a T-th of the bytes; the tower's patch
    embedding takes it as it is (:meth:`hf_pixel_values` gives the Hugging Face rows).
    """

    pixel_values: torch.Tensor  # float32, rows in spatial-merge-block order
    grid_thw: tuple[int, int, int]  # patches: temporal, height, width
    num_tokens: int  # t*h*w // merge**2 merged tokens = cache rows
    kind: str  # "image" | "video"
    repeat: int = 1  # temporal copies each row stands for

    @property
    def nbytes(self) -> int:
        return self.pixel_values.numel() * self.pixel_values.element_size()

    @property
    def meta(self) -> ItemMeta:
        """The grid, as vLLM's Qwen-VL models take it in place of the media (``image_grid_thw``)."""
        return ItemMeta(self.kind, (PlaceholderField(f"{self.kind}_grid_thw", (3,), self.grid_thw),), self.grid_thw)

    def hf_pixel_values(self) -> torch.Tensor:
        """The rows in the Hugging Face convention, ``[t*h*w, 3*T*P*P]`` (a copy when ``repeat`` > 1)."""
        if self.repeat == 1:
            return self.pixel_values
        return expand_still_rows(self.pixel_values, self.repeat)


def expand_still_rows(rows: torch.Tensor, repeat: int) -> torch.Tensor:
    """``[n, 3*P*P]`` rows of one frame -> ``[n, 3*T*P*P]``, values ordered ``(C, T, py, px)`` like Conv3d."""
    n, width = rows.shape
    per_channel = width // 3
    return rows.view(n, 3, 1, per_channel).expand(n, 3, repeat, per_channel).reshape(n, 3 * repeat * per_channel)


class Preprocessor:
    """Bytes -> :class:`ProcessedItem`; stateless apart from its config, thread-safe."""

    def __init__(self, config: PreprocessConfig) -> None:
        self.config = config
        c = config
        self._mean = np.asarray(c.image_mean, dtype=np.float32)
        self._std = np.asarray(c.image_std, dtype=np.float32)

    def image(self, data: bytes, *, item: str = "image") -> ProcessedItem:
        c = self.config
        rgb = decode_image(data, item=item, max_pixels=c.max_image_pixels, formats=c.formats)
        height, width = self._target_size(rgb, c.min_pixels, c.max_pixels, item)
        frame = self._normalize(rgb, height, width)
        # An image is one temporal patch: the same frame repeated temporal_patch_size times. Its rows
        # hold the frame once (repeat); the patch embedding sums its weights over the copies instead.
        return self._patchify([frame], "image", repeat=c.temporal_patch_size)

    def warmup_item(self) -> ProcessedItem:
        """A real preprocessed image (mid-gray, the smallest size) for warming the graph up."""
        side = max(self.config.factor, math.isqrt(self.config.min_pixels))
        encoded = io.BytesIO()
        Image.new("RGB", (side, side), (128, 128, 128)).save(encoded, format="PNG")
        return self.image(encoded.getvalue(), item="warm-up image")

    def video(self, frames: Sequence[bytes], *, fps: float | None = None, item: str = "video") -> ProcessedItem:
        c = self.config
        if isinstance(frames, (bytes, bytearray)):
            raise InvalidMediaError(item, "a video is a sequence of encoded frames, got a single bytes object")
        count = len(frames)
        if count == 0:
            raise InvalidMediaError(item, "video has no frames")
        if count > c.max_video_frames:
            raise InvalidMediaError(item, f"video has {count} frames, more than the limit of {c.max_video_frames}")
        if fps is not None and not (math.isfinite(fps) and fps > 0):
            raise InvalidMediaError(item, f"fps must be a positive number, got {fps!r}")
        indices = sample_frame_indices(count, fps, c.video_sample_fps, c.temporal_patch_size)
        min_px = c.video_min_pixels if c.video_min_pixels is not None else c.min_pixels
        max_px = c.video_max_pixels if c.video_max_pixels is not None else c.max_pixels
        decoded: list[np.ndarray] = []
        first_size: tuple[int, int] | None = None
        target: tuple[int, int] = (0, 0)
        for index in indices:
            frame_item = f"{item} frame {index}"
            rgb = decode_image(frames[index], item=frame_item, max_pixels=c.max_image_pixels, formats=c.formats)
            if first_size is None:
                first_size = rgb.size
                target = self._target_size(rgb, min_px, max_px, frame_item)
            elif rgb.size != first_size:
                raise InvalidMediaError(
                    frame_item,
                    f"frame is {rgb.size[0]}x{rgb.size[1]} but frame {indices[0]} is "
                    f"{first_size[0]}x{first_size[1]}; frames of one video must share a size",
                )
            decoded.append(self._normalize(rgb, *target))
        # Pad with the last frame to whole temporal patches, as the HF video processors do.
        while len(decoded) % c.temporal_patch_size:
            decoded.append(decoded[-1])
        return self._patchify(decoded, "video")

    def _target_size(self, rgb: Image.Image, min_px: int, max_px: int, item: str) -> tuple[int, int]:
        width, height = rgb.size
        try:
            return smart_resize(height, width, self.config.factor, min_px, max_px)
        except ValueError as exc:
            raise InvalidMediaError(item, str(exc)) from None

    def _normalize(self, rgb: Image.Image, height: int, width: int) -> np.ndarray:
        """Resize, rescale, normalize; returns float32 ``[H, W, 3]``, bit-equal to HF's."""
        c = self.config
        resized = rgb.resize((width, height), resample=Image.Resampling.BICUBIC)
        pixels: np.ndarray = np.asarray(resized)
        if c.do_rescale:
            # HF upcasts to float64 before scaling, then stores float32.
            pixels = (pixels.astype(np.float64) * c.rescale_factor).astype(np.float32)
        else:
            pixels = pixels.astype(np.float32)
        if c.do_normalize:
            pixels = (pixels - self._mean) / self._std
        return pixels

    def _patchify(self, frames: list[np.ndarray], kind: str, repeat: int = 1) -> ProcessedItem:
        c = self.config
        # repeat > 1: one frame standing for a whole temporal patch of copies of itself
        p, m, tp = c.patch_size, c.merge_size, c.temporal_patch_size // repeat
        stack = np.stack(frames)  # [F, H, W, C]
        num_frames, height, width, channels = stack.shape
        t, gh, gw = num_frames // tp, height // p, width // p
        blocks = stack.reshape(t, tp, gh // m, m, p, gw // m, m, p, channels)
        # -> (t, block_row, block_col, in_row, in_col, C, T, py, px): one row per patch,
        # patches of one merge block adjacent, values ordered (C, T, py, px) like Conv3d.
        blocks = blocks.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)
        rows = np.ascontiguousarray(blocks.reshape(t * gh * gw, channels * tp * p * p), dtype=np.float32)
        return ProcessedItem(
            pixel_values=torch.from_numpy(rows),
            grid_thw=(t, gh, gw),
            num_tokens=t * gh * gw // (m * m),
            kind=kind,
            repeat=repeat,
        )


