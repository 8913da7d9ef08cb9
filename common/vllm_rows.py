"""The width of one encoder row of a model vLLM serves: what its ``encoder_cache`` entries hold.

One function for both sides, so the encoder's vLLM tower and the consumer's connector
cannot disagree: the model's input-embedding size (``get_inputs_embeds_size``: the text
model's hidden size, or its projection size), times ``1 + deepstack levels`` for models
that carry multi-level visual features after the main embedding in each row (Qwen3-VL).
"""

from __future__ import annotations

from typing import Any


def deepstack_levels(model_config: Any) -> int:
    vision = getattr(model_config.hf_config, "vision_config", None)
    return len(getattr(vision, "deepstack_visual_indexes", None) or ())


def row_width(model_config: Any) -> int:
    """Width of one row of ``encoder_cache`` for the model of a vLLM ``ModelConfig``."""
    return int(model_config.get_inputs_embeds_size()) * (1 + deepstack_levels(model_config))
