"""The vLLM tower's pure pieces: which tower a checkpoint gets, and the runner writing rows into blocks."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from common.config import TowerChoice
from common.errors import ConfigError
from common.placeholder import ItemMeta
from encoder_server import towers
from encoder_server.towers.vllm import VllmItem, VllmRunner

WIDTH, BLOCK = 6, 4


def _checkpoint(tmp_path: Path, model_type: str | None) -> str:
    config = {"architectures": ["SomeForConditionalGeneration"]}
    if model_type is not None:
        config["model_type"] = model_type
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def _resolve(choice: str, weights: str | None) -> str:
    """The name (as the handshake sends it) of the tower the registry resolves ``choice`` to."""
    return towers.resolve(TowerChoice(choice), weights).name.value


def test_auto_picks_our_tower_for_qwen3_vl_and_vllm_for_every_other_family(tmp_path: Path) -> None:
    assert _resolve("auto", None) == "qwen3vl"
    for model_type, tower in (("qwen3_vl", "qwen3vl"), ("qwen3_vl_moe", "qwen3vl"), (None, "qwen3vl"),
                              ("qwen2_5_vl", "vllm"), ("gemma3", "vllm"), ("llava_onevision", "vllm")):
        assert _resolve("auto", _checkpoint(tmp_path, model_type)) == tower, model_type
    assert _resolve("vllm", _checkpoint(tmp_path, "qwen3_vl")) == "vllm"
    assert _resolve("qwen3vl", _checkpoint(tmp_path, "gemma3")) == "qwen3vl"  # refused later, by name
    (tmp_path / "config.json").write_text("[]")
    with pytest.raises(ConfigError, match="not a JSON object"):
        _resolve("auto", str(tmp_path))


class FakeTower:
    """Rows ``item index * 100 + row`` in every column: where each row lands is visible."""

    fat_dim = WIDTH

    def __init__(self) -> None:
        self.calls = 0

    def embed(self, items: Sequence[VllmItem]) -> list[torch.Tensor]:
        self.calls += 1
        return [(torch.arange(it.num_tokens, dtype=torch.float32) + 100 * it.inputs)[:, None].expand(-1, WIDTH)
                for it in items]


def _item(index: int, tokens: int) -> VllmItem:
    return VllmItem(index, "image", tokens, 0, ItemMeta("image"))


def test_rows_land_in_their_blocks_and_bad_arguments_write_nothing() -> None:
    tower = FakeTower()
    runner = VllmRunner(tower, block_size=BLOCK)  # type: ignore[arg-type]
    buffer = torch.full((8, BLOCK, WIDTH), -1.0)
    runner.write([_item(1, 6), _item(2, 3)], [[5, 2], [0]], [[4, 2], [3]], buffer, 7)
    assert buffer[5, :, 0].tolist() == [100, 101, 102, 103]
    assert buffer[2, :, 0].tolist() == [104, 105, -1, -1]
    assert buffer[0, :, 0].tolist() == [200, 201, 202, -1]
    before, calls = buffer.clone(), tower.calls
    for blocks, counts, words in (([[5, 2], [5]], [[4, 2], [3]], "given to item 0 and item 1"),
                                  ([[5, 9], [0]], [[4, 2], [3]], "outside"),
                                  ([[5, 2], [0]], [[4, 1], [3]], "sum to 5")):
        with pytest.raises(ValueError, match=words):
            runner.write([_item(1, 6), _item(2, 3)], blocks, counts, buffer, 7)
    with pytest.raises(ValueError, match="is not a contiguous"):
        runner.write([_item(1, 6)], [[5, 2]], [[4, 2]], torch.zeros(8, BLOCK, WIDTH + 1), 7)
    assert torch.equal(buffer, before) and tower.calls == calls  # checked before the encoder ran


class _ModelConfig:
    """The two things of vLLM's ModelConfig a row width depends on."""

    def __init__(self, embeds: int, vision: object) -> None:
        self.hf_config = type("HfConfig", (), {"vision_config": vision})()
        self._embeds = embeds

    def get_inputs_embeds_size(self) -> int:
        return self._embeds


def test_a_row_is_the_input_embedding_times_one_plus_the_deepstack_levels() -> None:
    from common.vllm_rows import row_width

    qwen3 = type("Vision", (), {"deepstack_visual_indexes": [5, 11, 17], "out_hidden_size": 2048})()
    assert row_width(_ModelConfig(2048, qwen3)) == 2048 * 4
    siglip = type("Vision", (), {"hidden_size": 1152})()  # a LLaVA / Gemma 3 tower: no deepstack
    assert row_width(_ModelConfig(2560, siglip)) == 2560
    assert row_width(_ModelConfig(64, None)) == 64
