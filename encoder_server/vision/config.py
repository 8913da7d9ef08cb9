"""Vision tower hyper-parameters, Qwen3-VL compatible (encoder process).

Field names follow the Hugging Face ``Qwen3VLVisionConfig`` so a checkpoint's
``config.json`` ``vision_config`` maps one to one. The defaults are a tiny
tower that runs in milliseconds on a CPU; a real checkpoint overrides them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from common.config import read_json_object
from common.errors import ConfigError
from common.layout import compute_fat_dim

logger = logging.getLogger(__name__)

ACTIVATIONS = ("gelu", "gelu_pytorch_tanh", "silu", "relu")


# Checkpoints whose vision tower this one is: Qwen3-VL, dense and mixture-of-experts (the
# same tower, the same tensor names; the experts are all in the language model).
QWEN3_VL_MODEL_TYPES = ("qwen3_vl", "qwen3_vl_moe")

@dataclass(frozen=True)
class VisionConfig:
    """Shape of a Qwen3-VL vision tower; the defaults are the tiny test tower."""

    depth: int = 3
    hidden_size: int = 32
    intermediate_size: int = 64
    num_heads: int = 2
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    out_hidden_size: int = 64
    num_position_embeddings: int = 64
    deepstack_visual_indexes: tuple[int, ...] = (0, 1)
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0
    layer_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels", "patch_size",
                     "spatial_merge_size", "temporal_patch_size", "out_hidden_size", "num_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"vision {name} must be > 0, got {getattr(self, name)!r}")
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.head_dim % 4:
            # 2-D rotary: a quarter of the head dim per axis, then doubled for rotate-half.
            raise ConfigError(f"head_dim {self.head_dim} must be a multiple of 4 for 2-D rotary embeddings")
        side = math.isqrt(self.num_position_embeddings)
        if side * side != self.num_position_embeddings or side < 2:
            raise ConfigError(
                f"num_position_embeddings must be a square of a side >= 2, got {self.num_position_embeddings}"
            )
        indexes = self.deepstack_visual_indexes
        if len(set(indexes)) != len(indexes) or any(not 0 <= i < self.depth for i in indexes):
            raise ConfigError(
                f"deepstack_visual_indexes must be distinct layers in [0, {self.depth}), got {list(indexes)}"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"hidden_act {self.hidden_act!r} is not one of {ACTIVATIONS}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_deepstack_levels(self) -> int:
        return len(self.deepstack_visual_indexes)

    @property
    def fat_dim(self) -> int:
        """Width of one cache row: main merged output plus each deepstack level."""
        return compute_fat_dim(self.out_hidden_size, self.num_deepstack_levels)

    @property
    def merge_unit(self) -> int:
        """Patches per merged token."""
        return self.spatial_merge_size * self.spatial_merge_size

    @property
    def patch_dim(self) -> int:
        """Values per ``pixel_values`` row: channels x temporal patch x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def num_grid_per_side(self) -> int:
        return math.isqrt(self.num_position_embeddings)

    @classmethod
    def from_hf_dict(cls, raw: Mapping[str, Any]) -> VisionConfig:
        """Build from a Hugging Face ``vision_config`` mapping; unknown keys are ignored."""
        values: dict[str, Any] = {}
        names = {f.name for f in fields(cls)}
        for key, value in raw.items():
            if key in names and value is not None:
                values[key] = value
        if "num_attention_heads" in raw and "num_heads" not in raw:
            values["num_heads"] = raw["num_attention_heads"]
        if "num_hidden_layers" in raw and "depth" not in raw:
            values["depth"] = raw["num_hidden_layers"]
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if isinstance(rope, Mapping) and rope.get("rope_theta") is not None:
            values["rope_theta"] = rope["rope_theta"]
        for key in ("patch_size", "temporal_patch_size"):
            if isinstance(values.get(key), (list, tuple)):
                sizes = set(values[key])
                if len(sizes) != 1:
                    raise ConfigError(f"non-square {key} {values[key]!r} is not supported")
                values[key] = sizes.pop()
        if "deepstack_visual_indexes" in values:
            values["deepstack_visual_indexes"] = tuple(int(i) for i in values["deepstack_visual_indexes"])
        try:
            return cls(**values)
        except TypeError as exc:
            raise ConfigError(f"invalid vision_config: {exc}") from exc

    @classmethod
    def from_pretrained_dir(cls, path: str | Path) -> VisionConfig:
        """Read ``config.json`` of a Qwen3-VL checkpoint directory (its ``vision_config``)."""
        config_file = Path(path) / "config.json"
        raw = read_json_object(config_file)
        model_type = raw.get("model_type")
        if model_type is not None and model_type not in QWEN3_VL_MODEL_TYPES:
            # Another family's vision_config may carry the same keys and build a wrong tower:
            # refuse by name rather than fail later on tensor names. (A config without a
            # model_type, which transformers itself would not load, is read as Qwen3-VL's.)
            architectures = raw.get("architectures")
            named = ", ".join(map(str, architectures)) if isinstance(architectures, list) and architectures else "?"
            raise ConfigError(
                f"{config_file}: architecture {named} (model_type {model_type!r}) is not a Qwen3-VL checkpoint; "
                f"epd encoder's vision tower serves model_type {' or '.join(QWEN3_VL_MODEL_TYPES)}")
        vision = raw.get("vision_config")
        if not isinstance(vision, dict):
            raise ConfigError(f"{config_file} has no vision_config object (model_type {model_type!r})")
        return cls.from_hf_dict(vision)
