"""The reference worker's LM and its static-shape graph."""

from __future__ import annotations

import json

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from common.config import CacheMode
from common.errors import ConfigError, LimitExceededError
from prefill_client.reference.graph import PrefillGraph, bucket
from prefill_client.reference.lm import LMConfig, TinyLM, build_lm, load_lm, save_lm
from prefill_client.reference.positions import ItemPlacement
from prefill_client.reference.tokenizer import MIN_VOCAB_SIZE, MediaPart, Special, TextPart, render_chat, token_name

CFG = LMConfig(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
               num_deepstack_levels=2)


def test_random_init_is_a_pure_function_of_the_seed():
    a, b, c = build_lm(CFG, seed=3), build_lm(CFG, seed=3), build_lm(CFG, seed=4)
    for (name, pa), (_, pb), (_, pc) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert torch.equal(pa, pb), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc), name


def test_weights_round_trip_through_safetensors(tmp_path):
    lm = build_lm(CFG, seed=1)
    save_lm(lm, tmp_path)
    loaded = build_lm(CFG, weights_dir=tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["num_key_value_heads"] == 2
    for (name, pa), (_, pb) in zip(lm.named_parameters(), loaded.named_parameters()):
        assert torch.equal(pa, pb), name


def test_loading_a_checkpoint_missing_a_tensor_names_it(tmp_path):
    from safetensors.torch import load_file, save_file

    save_lm(build_lm(CFG, seed=1), tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["model.layers.1.mlp.up_proj.weight"]
    state["visual.blocks.0.weight"] = torch.zeros(1)  # other towers' tensors are ignored
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match="missing \\['model.layers.1.mlp.up_proj.weight'\\]"):
        load_lm(tmp_path, num_deepstack_levels=2)


def test_config_rejects_bad_shapes():
    with pytest.raises(ConfigError, match="vocab_size 100"):
        LMConfig(vocab_size=100)
    with pytest.raises(ConfigError, match="not a multiple of num_kv_heads"):
        LMConfig(num_heads=4, num_kv_heads=3)
    with pytest.raises(ConfigError, match="num_deepstack_levels"):
        LMConfig(num_layers=2, num_deepstack_levels=2)
    assert MIN_VOCAB_SIZE == max(Special) + 1


def test_bucket_is_the_next_power_of_two_above_the_minimum():
    assert [bucket(n, 64) for n in (0, 1, 64, 65, 129)] == [64, 64, 64, 128, 256]


def _run(graph: PrefillGraph, rows: torch.Tensor, n: int = 10, offset: int = 2, length: int = 4):
    tokens = [Special.BOS, Special.USER] + [Special.IMAGE] * length + [65] * (n - 2 - length)
    return graph.run(tokens, start=0, prefix_kv=[], rows=rows,
                     placements=[ItemPlacement.dense("a", [0], length, offset, 8)],
                     spans=[("a", offset, length)], mode=CacheMode.EPD)


def test_deepstack_levels_are_added_after_the_first_layers():
    lm = TinyLM(CFG).init_weights(0).eval()
    graph = PrefillGraph(lm, max_model_len=64, max_items=2)
    rows = torch.randn(2, 8, 32 * 3, generator=torch.Generator().manual_seed(0))
    base = _run(graph, rows)
    for level in (0, 1):  # each level reaches the first token through the layers after it
        without = rows.clone()
        without[..., 32 * (1 + level):32 * (2 + level)] = 0
        assert not torch.allclose(base.logits, _run(graph, without).logits)
    # Rows outside the item's placements are never read.
    other = rows.clone()
    other[1] += 5.0
    assert torch.equal(_run(graph, other).logits, base.logits)
    assert base.kv.shape == (3, 2, 10, 2, 8) and base.shape == (64, 64, 64 // 8 + 2 * 2)


def test_graph_refuses_a_prompt_longer_than_max_model_len():
    graph = PrefillGraph(TinyLM(CFG).init_weights(0), max_model_len=8, max_items=1)
    with pytest.raises(LimitExceededError, match="exceeds max_model_len 8"):
        _run(graph, torch.zeros(2, 8, 96), n=10)


def test_chat_template_places_each_item_between_vision_markers():
    prompt = render_chat([("user", [TextPart("hi"), MediaPart("image", 3)]), ("assistant", [TextPart("ok")])])
    ids = prompt.token_ids
    assert ids[:4] == (Special.BOS, Special.USER, ord("h"), ord("i"))
    assert ids[4] == Special.VISION_START and ids[5:8] == (Special.IMAGE,) * 3 and ids[8] == Special.VISION_END
    assert ids[-1] == Special.ASSISTANT and ids[-2] == Special.END
    assert (prompt.spans[0].offset, prompt.spans[0].length) == (5, 3)
    assert token_name(ord("a")) == "'a'" and token_name(int(Special.END)) == "<|end|>"
    with pytest.raises(ValueError, match="role must be"):
        render_chat([("robot", [])])


def test_compiled_step_compiles_once_per_bucket_and_matches_eager():
    lm = TinyLM(CFG).init_weights(0).eval()
    counter = CompileCounter()
    compiled = PrefillGraph(lm, max_model_len=256, max_items=2, compile=True, backend=counter)
    eager = PrefillGraph(lm, max_model_len=256, max_items=2)
    rows = torch.randn(4, 8, 32 * 3, generator=torch.Generator().manual_seed(0))
    for n, offset, length in ((10, 2, 4), (30, 5, 8), (64, 40, 3)):  # same bucket, data moves
        a, b = _run(compiled, rows, n, offset, length), _run(eager, rows, n, offset, length)
        torch.testing.assert_close(a.logits, b.logits)
    assert counter.frame_count == 1
    _run(compiled, rows, 70, 2, 4)  # next token bucket: one more graph
    assert counter.frame_count == 2
