"""The tiny Qwen3-VL checkpoint of test and bench runs: its vision tower's shape is the caller's to choose."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from encoder_server.vision.config import VisionConfig
from encoder_server.vision.weights import load_encoder
from epd_harness.qwen3vl import write_qwen3vl_checkpoint

WIDER = VisionConfig(depth=2, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=96,
                     num_position_embeddings=256, deepstack_visual_indexes=(1,))


def test_the_default_checkpoint_has_the_tiny_test_tower(tmp_path: Path) -> None:
    path = write_qwen3vl_checkpoint(tmp_path / "ckpt", seed=1)
    assert VisionConfig.from_pretrained_dir(path) == VisionConfig()


def test_a_chosen_vision_config_is_the_towers_and_sizes_the_language_model(tmp_path: Path) -> None:
    path = write_qwen3vl_checkpoint(tmp_path / "ckpt", seed=1, vision=WIDER)
    assert VisionConfig.from_pretrained_dir(path) == WIDER
    text = json.loads((path / "config.json").read_text())["text_config"]
    assert text["hidden_size"] == WIDER.out_hidden_size and text["num_hidden_layers"] == 2
    encoder = load_encoder(str(path))  # every tensor of that shape is there
    assert encoder.config == WIDER
    assert any(p.shape == (WIDER.intermediate_size, WIDER.hidden_size) for p in encoder.parameters())
    assert all(torch.isfinite(p).all() for p in encoder.parameters())
