"""The vision weights digest: the same from the loaded tower and from the checkpoint files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.errors import ConfigError
from common.weights_digest import PREFIX, checkpoint_digest, main, tensors_digest
from encoder_server.vision import load_encoder
from tests.support.checkpoints import write_vision_checkpoint


def test_loader_and_checkpoint_agree_and_ignore_the_run_dtype(tmp_path: Path) -> None:
    path = write_vision_checkpoint(tmp_path / "a", seed=1, dtype=torch.bfloat16)
    digest = checkpoint_digest(path)
    assert digest.startswith(PREFIX)
    assert load_encoder(str(path)).weights_digest == digest
    # The encoder may run in another dtype than the checkpoint stores: the digest is of the files.
    assert load_encoder(str(path), dtype=torch.float32).weights_digest == digest


def test_every_tensor_byte_counts(tmp_path: Path) -> None:
    a = checkpoint_digest(write_vision_checkpoint(tmp_path / "a", seed=1))
    assert checkpoint_digest(write_vision_checkpoint(tmp_path / "b", seed=2)) != a
    # One value of one tensor changed: another digest.
    shard = tmp_path / "a" / "model.safetensors"
    tensors = load_file(str(shard))
    tensors["model.visual.blocks.2.mlp.linear_fc2.bias"][3] += 1e-3
    save_file(tensors, str(shard))
    assert checkpoint_digest(tmp_path / "a") != a
    # Only vision tensors count: the language model's are not read.
    tensors = load_file(str(tmp_path / "b" / "model.safetensors"))
    before = checkpoint_digest(tmp_path / "b")
    tensors["model.language_model.embed_tokens.weight"] += 1
    save_file(tensors, str(tmp_path / "b" / "model.safetensors"))
    assert checkpoint_digest(tmp_path / "b") == before


def test_the_same_bytes_in_another_dtype_or_shape_differ() -> None:
    base = torch.arange(8, dtype=torch.int16)
    assert tensors_digest([("w", base)]) != tensors_digest([("w", base.view(torch.bfloat16))])
    assert tensors_digest([("w", base)]) != tensors_digest([("w", base.view(2, 4))])
    assert tensors_digest([("w", base)]) != tensors_digest([("v", base)])


def test_seeded_towers_have_stable_distinct_digests() -> None:
    assert load_encoder(seed=0).weights_digest == load_encoder(seed=0).weights_digest
    assert load_encoder(seed=0).weights_digest != load_encoder(seed=1).weights_digest


def test_a_checkpoint_without_vision_tensors_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"vision_config": {}}))
    with pytest.raises(ConfigError, match="no safetensors files"):
        checkpoint_digest(tmp_path)
    save_file({"lm_head.weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match="no vision tensors"):
        checkpoint_digest(tmp_path)


def test_cli_prints_the_digest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_vision_checkpoint(tmp_path / "a", seed=5)
    assert main([str(path)]) == 0
    assert capsys.readouterr().out.strip() == checkpoint_digest(path)
    assert main([str(tmp_path / "missing")]) == 2
