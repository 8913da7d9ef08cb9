"""Vision tower: parity with transformers' Qwen3VLVisionModel, weight loading, seeded init."""

from __future__ import annotations

import json
from typing import Any
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from common.errors import ConfigError
from encoder_server.preprocess import expand_still_rows
from encoder_server.vision import VisionConfig, load_encoder
from encoder_server.vision.model import TanhGELU, frame_attention, frame_runs, sdpa_frame_attention
from encoder_server.vision.positions import frame_interpolation, frame_positions
from encoder_server.vision.rotary import rotary_cos_sin

qwen3_vl = pytest.importorskip("transformers.models.qwen3_vl.modeling_qwen3_vl")
qwen3_vl_config = pytest.importorskip("transformers.models.qwen3_vl.configuration_qwen3_vl")

TINY = dict(depth=3, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
            deepstack_visual_indexes=[0, 1], num_position_embeddings=64, patch_size=16,
            spatial_merge_size=2, temporal_patch_size=2)
# images of several shapes plus a 2-temporal-patch video, in one HF call
GRIDS = torch.tensor([[1, 4, 6], [2, 8, 4], [1, 2, 2], [1, 10, 2]])


def hf_model(config_cls: Any = None, model_cls: Any = None, **overrides: object) -> tuple[object, object]:
    """A transformers tower (Qwen3-VL's unless classes are given) with every parameter randomized."""
    config = (config_cls or qwen3_vl_config.Qwen3VLVisionConfig)(**{**TINY, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(1234)
    model = (model_cls or qwen3_vl.Qwen3VLVisionModel)(config).eval()
    with torch.no_grad():
        # HF initializes norms to 1 and biases to 0; randomize everything so every tensor matters.
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    return config, model


def save_checkpoint(path: Path, config: object, model: object, prefix: str = "model.visual.",
                    model_type: str = "qwen3_vl") -> None:
    (path / "config.json").write_text(json.dumps({"model_type": model_type, "vision_config": config.to_dict()}))
    tensors = {prefix + k: v.contiguous() for k, v in model.state_dict().items()}  # type: ignore[attr-defined]
    tensors["model.language_model.embed_tokens.weight"] = torch.zeros(8, 4)  # must be ignored
    save_file(tensors, str(path / "model.safetensors"))


def hf_rows(model: object, pixel_values: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(pixel_values, grid_thw=grid)  # type: ignore[operator]
    assert len(out.deepstack_features) == 2
    return torch.cat([out.pooler_output, *out.deepstack_features], dim=-1)


# Heads of 16 (TINY), and of 72 as in Qwen3-VL's larger towers (hidden 1152, 16 heads): not a whole
# number of 16-lane vectors, so the native kernel's last vector is masked (SDPA where it is absent).
@pytest.mark.parametrize(("prefix", "overrides", "head_size"),
                         [("model.visual.", {}, 16), ("visual.", {}, 16),
                          ("model.visual.", {"hidden_size": 144, "num_heads": 2}, 72)],
                         ids=["heads-16", "prefix-visual", "heads-72"])
def test_embed_matches_transformers(tmp_path: Path, prefix: str, overrides: dict[str, int], head_size: int) -> None:
    config, model = hf_model(**overrides)
    save_checkpoint(tmp_path, config, model, prefix)
    encoder = load_encoder(str(tmp_path))
    assert encoder.config.hidden_size // encoder.config.num_heads == head_size
    assert encoder.config.fat_dim == 64 * 3 == encoder.fat_dim
    total = int(GRIDS.prod(-1).sum())
    pixel_values = torch.randn(total, encoder.config.patch_dim, generator=torch.Generator().manual_seed(5))
    ours = encoder.embed(pixel_values, GRIDS)
    ref = hf_rows(model, pixel_values, GRIDS)
    assert ours.shape == (total // 4, 192)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)



def test_a_bfloat16_tower_is_as_near_the_float32_one_as_transformers_bfloat16_is(tmp_path: Path) -> None:
    """``--tower-dtype bfloat16``: the eager path's own bfloat16 steps (the MLP's linear with its
    GELU fused by oneDNN, the rotation written once in float32) against transformers' tower in
    bfloat16, both held to the float32 tower on the same rounded weights."""
    config, model = hf_model(hidden_act="gelu_pytorch_tanh")
    with torch.no_grad():
        for param in model.parameters():  # type: ignore[attr-defined]
            param.copy_(param.to(torch.bfloat16))
    save_checkpoint(tmp_path, config, model)
    encoder = load_encoder(str(tmp_path), dtype=torch.bfloat16)
    total = int(GRIDS.prod(-1).sum())
    pixel_values = torch.randn(total, encoder.config.patch_dim,
                               generator=torch.Generator().manual_seed(5)).bfloat16()
    exact = hf_rows(model, pixel_values.float(), GRIDS)
    theirs = hf_rows(model.to(torch.bfloat16), pixel_values, GRIDS).float()  # type: ignore[attr-defined]
    with torch.inference_mode():
        ours = encoder.embed(pixel_values, GRIDS)
    assert ours.dtype == torch.bfloat16
    scale = exact.abs().max()
    our_error = float((ours.float() - exact).abs().max() / scale)
    their_error = float((theirs - exact).abs().max() / scale)
    assert 0 < our_error <= 2 * their_error, (our_error, their_error)


def test_a_qwen3_vl_moe_checkpoints_tower_matches_transformers(tmp_path: Path) -> None:
    """The mixture-of-experts Qwen3-VL checkpoints (30B-A3B, 235B-A22B) share the dense ones' tower."""
    moe_config = pytest.importorskip("transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe")
    moe = pytest.importorskip("transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe")
    config, model = hf_model(moe_config.Qwen3VLMoeVisionConfig, moe.Qwen3VLMoeVisionModel)
    save_checkpoint(tmp_path, config, model, model_type="qwen3_vl_moe")
    encoder = load_encoder(str(tmp_path))
    pixel_values = torch.randn(int(GRIDS.prod(-1).sum()), encoder.config.patch_dim,
                               generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(encoder.embed(pixel_values, GRIDS), hf_rows(model, pixel_values, GRIDS),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("raw", "named"), [
    ({"model_type": "qwen2_5_vl", "architectures": ["Qwen2_5_VLForConditionalGeneration"]},
     "Qwen2_5_VLForConditionalGeneration (model_type 'qwen2_5_vl')"),
    ({"model_type": "llava_onevision", "architectures": ["LlavaOnevisionForConditionalGeneration"]},
     "LlavaOnevisionForConditionalGeneration (model_type 'llava_onevision')"),
    ({"model_type": "gemma3"}, "? (model_type 'gemma3')"),
], ids=["qwen2.5-vl", "llava-onevision", "no-architectures"])
def test_a_checkpoint_of_another_family_is_refused_by_name(tmp_path: Path, raw: dict[str, Any], named: str) -> None:
    # A vision_config with Qwen3-VL's own keys: only the architecture tells the families apart.
    (tmp_path / "config.json").write_text(json.dumps({**raw, "vision_config": dict(TINY)}))
    with pytest.raises(ConfigError, match="is not a Qwen3-VL checkpoint") as info:
        load_encoder(str(tmp_path))
    assert named in str(info.value)


def test_stills_rows_of_one_frame_match_transformers_on_the_repeated_frame(tmp_path: Path) -> None:
    # Images as the preprocessing hands them over (ProcessedItem.repeat 2: each patch once, half the
    # width) give transformers' rows for the Hugging Face input, which repeats the frame.
    config, model = hf_model()
    save_checkpoint(tmp_path, config, model)
    encoder = load_encoder(str(tmp_path))
    grids = torch.tensor([[1, 4, 6], [1, 2, 2], [1, 10, 2]])
    total = int(grids.prod(-1).sum())
    frames = torch.randn(total, encoder.config.patch_dim // 2, generator=torch.Generator().manual_seed(6))
    full = expand_still_rows(frames, 2)
    assert full.shape == (total, encoder.config.patch_dim)
    torch.testing.assert_close(encoder.embed(frames, grids), hf_rows(model, full, grids), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(encoder.embed(frames, grids), encoder.embed(full, grids), atol=1e-5, rtol=1e-5)
    # the summed kernel follows the weights: new weights loaded in place are summed again
    first = encoder.embed(frames, grids)
    with torch.no_grad():
        encoder.patch_embed.proj.weight.mul_(-0.5)
    torch.testing.assert_close(encoder.embed(frames, grids), encoder.embed(full, grids), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(encoder.embed(frames, grids), first)
    with pytest.raises(ValueError, match="does not match grid_thw"):  # a video's grid wants full rows
        encoder.embed(frames[:32], [(2, 4, 4)])
    with pytest.raises(ValueError, match="repeat 3"):
        encoder.embed_patches(frames, repeat=3)
    with pytest.raises(ValueError, match=r"expected \(\.\.\., 1536\) for repeat 1"):
        encoder.embed_patches(frames)


def test_deepstack_order_follows_layers(tmp_path: Path) -> None:
    # Mergers listed in reverse layer order: features still come out in layer order.
    config, model = hf_model(deepstack_visual_indexes=[2, 0])
    save_checkpoint(tmp_path, config, model)
    encoder = load_encoder(str(tmp_path))
    grid = torch.tensor([[1, 6, 4]])
    pixel_values = torch.randn(24, encoder.config.patch_dim)
    torch.testing.assert_close(encoder.embed(pixel_values, grid), hf_rows(model, pixel_values, grid),
                               atol=1e-5, rtol=1e-5)


def test_config_round_trips_from_hf() -> None:
    config = qwen3_vl_config.Qwen3VLVisionConfig(**TINY)
    ours = VisionConfig.from_hf_dict(config.to_dict())
    assert ours == VisionConfig()  # the tiny default is exactly this config
    assert ours.num_deepstack_levels == 2 and ours.patch_dim == 3 * 2 * 16 * 16


def test_loader_refuses_missing_and_misshapen_tensors(tmp_path: Path) -> None:
    config, model = hf_model()
    state = {"model.visual." + k: v.contiguous() for k, v in model.state_dict().items()}  # type: ignore[attr-defined]
    (tmp_path / "config.json").write_text(json.dumps({"vision_config": config.to_dict()}))
    missing = dict(state)
    del missing["model.visual.blocks.1.attn.qkv.weight"]
    save_file(missing, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"missing \['blocks.1.attn.qkv.weight'\]"):
        load_encoder(str(tmp_path))
    wrong = dict(state)
    wrong["model.visual.merger.linear_fc2.weight"] = torch.zeros(3, 3)
    save_file(wrong, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match="merger.linear_fc2.weight has shape"):
        load_encoder(str(tmp_path))
    extra = dict(state)
    extra["model.visual.blocks.9.norm1.weight"] = torch.zeros(32)
    save_file(extra, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match="unexpected"):
        load_encoder(str(tmp_path))


def test_loader_follows_sharded_index(tmp_path: Path) -> None:
    config, model = hf_model()
    state = {"model.visual." + k: v.contiguous() for k, v in model.state_dict().items()}  # type: ignore[attr-defined]
    names = sorted(state)
    shards = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(tmp_path / file))
        weight_map.update({k: file for k in keys})
    save_file({"lm_head.weight": torch.zeros(2, 2)}, str(tmp_path / "c.safetensors"))
    weight_map["lm_head.weight"] = "c.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps({"vision_config": config.to_dict()}))
    encoder = load_encoder(str(tmp_path))
    torch.testing.assert_close(encoder.blocks[2].mlp.linear_fc1.weight, model.blocks[2].mlp.linear_fc1.weight)  # type: ignore[attr-defined]


def test_seeded_init_is_deterministic() -> None:
    a, b, c = load_encoder(seed=3), load_encoder(seed=3), load_encoder(seed=4)
    for (name, x), (_, y), (_, z) in zip(a.state_dict().items(), b.state_dict().items(), c.state_dict().items()):
        assert torch.equal(x, y), name
        if not name.endswith("norm.weight") and not name.endswith(("norm1.weight", "norm2.weight")):
            assert not torch.equal(x, z), name
    pixel_values = torch.randn(16, a.config.patch_dim)
    rows = a.embed(pixel_values, [(1, 4, 4)])
    assert rows.shape == (4, a.fat_dim) and torch.isfinite(rows).all()
    assert torch.equal(rows, b.embed(pixel_values, [(1, 4, 4)]))


def test_embed_rejects_mismatched_inputs() -> None:
    encoder = load_encoder()
    with pytest.raises(ValueError, match="does not match grid_thw"):
        encoder.embed(torch.zeros(15, encoder.config.patch_dim), [(1, 4, 4)])
    with pytest.raises(ValueError, match="merge size"):
        encoder.embed(torch.zeros(15, encoder.config.patch_dim), [(1, 3, 5)])


def test_position_tables_follow_merge_block_order() -> None:
    pos = frame_positions(4, 6, 2)
    # first merge block: (0,0) (0,1) (1,0) (1,1); then the block to its right
    assert pos[:6].tolist() == [[0, 0], [0, 1], [1, 0], [1, 1], [0, 2], [0, 3]]
    index, weight = frame_interpolation(4, 6, 2, 8)
    torch.testing.assert_close(weight.sum(-1), torch.ones(24))
    # corners map exactly onto the table's corners (align_corners)
    assert index[0, 0] == 0 and weight[0, 0] == 1
    last = pos.tolist().index([3, 5])
    assert index[last, 0] == 63 and weight[last, 0] == 1


def test_frame_runs_group_equal_neighbours_and_stop_at_padding() -> None:
    assert frame_runs([16, 16, 8, 16, 0, 0]) == [(0, 2, 16), (32, 1, 8), (40, 1, 16)]
    assert frame_runs([0, 4]) == [] and frame_runs([]) == []


@pytest.mark.parametrize("attention", [frame_attention, sdpa_frame_attention], ids=["dispatch", "sdpa"])
def test_frame_attention_equals_a_dense_masked_reference(attention: Any) -> None:
    generator = torch.Generator().manual_seed(3)
    lengths = [12, 12, 4, 12, 8]  # a run of two, then singles; 8 padding rows after them
    rows, heads, dim = sum(lengths) + 8, 2, 16
    q, k, v = (torch.randn(rows, heads, dim, generator=generator) for _ in range(3))
    frames = torch.tensor(lengths + [0, 0, 0], dtype=torch.int64)
    out = attention(q, k, v, frames)
    segment = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)] + [torch.full((8,), -1)])
    mask = segment[:, None] == segment[None, :]
    dense = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask).transpose(0, 1)
    real = sum(lengths)
    torch.testing.assert_close(out[:real], dense[:real], atol=1e-5, rtol=1e-5)
    assert torch.equal(out[real:], torch.zeros(8, heads, dim))
    # one run covering every row: the same numbers, no padding
    single = attention(q[:24], k[:24], v[:24], torch.tensor([12, 12]))
    torch.testing.assert_close(single, dense[:24], atol=1e-5, rtol=1e-5)


def test_compiled_gelu_and_rotary_ops_equal_their_eager_forms() -> None:
    # The graph computes tanh-GELU as x * sigmoid(2u) and the rotary angles as one opaque op.
    x = torch.linspace(-12, 12, 4097)
    compiled = torch.compile(TanhGELU(), dynamic=False, fullgraph=True)
    torch.testing.assert_close(compiled(x), torch.nn.functional.gelu(x, approximate="tanh"), atol=1e-6, rtol=1e-6)
    encoder = load_encoder()
    positions = frame_positions(6, 4, 2)
    cos, sin = rotary_cos_sin(positions, encoder.rotary_pos_emb.inv_freq)
    want_cos, want_sin = encoder.rotary_pos_emb(positions)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    assert cos.shape == (24, encoder.config.head_dim // 2)
