"""Qwen3-VL-compatible vision tower and its cached static-shape runner (encoder process)."""

from __future__ import annotations

from encoder_server.vision.config import VisionConfig
from encoder_server.vision.model import VisionEncoder
from encoder_server.vision.runner import EncoderRunner, default_tokens_per_block
from encoder_server.vision.weights import load_encoder

__all__ = ["EncoderRunner", "VisionConfig", "VisionEncoder", "default_tokens_per_block", "load_encoder"]
