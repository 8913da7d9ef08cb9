"""Tiny Qwen3-VL vision checkpoints written on the spot: seeded, so two seeds are two weight versions."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from encoder_server.vision import load_encoder


def write_vision_checkpoint(path: Path, seed: int, dtype: torch.dtype = torch.float32) -> Path:
    """The default tiny tower with weights from ``seed``, saved as ``model.visual.*`` in ``dtype``."""
    path.mkdir(parents=True, exist_ok=True)
    encoder = load_encoder(seed=seed)
    vision = dataclasses.asdict(encoder.config)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3_vl", "vision_config": vision}))
    tensors = {f"model.visual.{name}": p.detach().to(dtype).contiguous() for name, p in encoder.named_parameters()}
    tensors["model.language_model.embed_tokens.weight"] = torch.zeros(8, 4)  # not a vision tensor
    save_file(tensors, str(path / "model.safetensors"))
    return path
