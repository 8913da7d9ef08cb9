"""A tiny but complete Qwen3-VL checkpoint written on the spot for test and bench runs (that run's process).

Text model, vision tower, tokenizer (byte-level, with Qwen3-VL's special tokens and a chat
template that places one ``<|vision_start|><|image_pad|><|vision_end|>`` per image) and
processor configs, all from a fixed seed, loadable by transformers and vLLM.
:func:`epd_harness.families.noise_vision_copy` writes a copy whose vision weights are noise:
a consumer given it can only answer like the original if its embeddings come from somewhere else.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from encoder_server.vision.config import VisionConfig

SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|image_pad|>", "<|video_pad|>",
)
VOCAB_SIZE = 384  # 256 bytes + the special tokens, padded

# Qwen-style: each message framed by <|im_start|>role ... <|im_end|>; media parts become their
# placeholders in place; the generation prompt opens the assistant turn.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "<|im_start|>{{ message['role'] }}\n"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' or part['type'] == 'image_url' or 'image' in part -%}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif part['type'] == 'video' or 'video' in part -%}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "<|im_end|>\n"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)


def _byte_vocab() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {ch: i for i, ch in enumerate(bytes_to_unicode().values())}  # type: ignore[no-untyped-call]


def _write_tokenizer(path: Path) -> dict[str, int]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = _byte_vocab()
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tokenizer_cls: Any = PreTrainedTokenizerFast  # its constructor is untyped
    fast = tokenizer_cls(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS)})
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 4096
    fast.save_pretrained(str(path))
    ids = {t: int(fast.convert_tokens_to_ids(t)) for t in SPECIAL_TOKENS}
    assert max(ids.values()) < VOCAB_SIZE, ids
    return ids


def write_qwen3vl_checkpoint(path: Path, seed: int = 0, *, init_std: float = 0.08,
                             vision: VisionConfig | None = None) -> Path:
    """The whole checkpoint at ``path``: float32 weights from ``seed`` (a wider init than the
    default so that greedy decoding has clear winners).

    ``vision``: the vision tower's shape, by default the tiny test tower (``VisionConfig()``); a
    real tower's width (``bench/encoder.py``'s presets) gives a checkpoint whose encode costs what
    that model's does, beside the same tiny two-layer language model (its hidden size is the
    tower's ``out_hidden_size``).
    """
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    path.mkdir(parents=True, exist_ok=True)
    ids = _write_tokenizer(path)
    vision = vision if vision is not None else VisionConfig()
    vision_cfg = dataclasses.asdict(vision)
    vision_cfg["deepstack_visual_indexes"] = list(vision.deepstack_visual_indexes)
    text_cfg = {
        "vocab_size": VOCAB_SIZE, "hidden_size": vision.out_hidden_size, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
        "hidden_act": "silu", "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0, "mrope_section": [4, 6, 6],
                            "mrope_interleaved": True},
        "initializer_range": init_std, "tie_word_embeddings": False,
        "bos_token_id": None, "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"],
    }
    config = Qwen3VLConfig(
        text_config=text_cfg, vision_config=vision_cfg,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    config.architectures = ["Qwen3VLForConditionalGeneration"]
    torch.manual_seed(seed)
    model_cls: Any = Qwen3VLForConditionalGeneration  # its constructor is untyped
    model = model_cls(config).to(torch.float32).eval()
    with torch.no_grad():  # a readable model: every weight from the seed, wider than the default init
        gen = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * init_std)
    model.save_pretrained(str(path), safe_serialization=True)
    factor = vision.patch_size * vision.spatial_merge_size
    image_proc = {
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen3VLProcessor",
        "patch_size": vision.patch_size, "merge_size": vision.spatial_merge_size,
        "temporal_patch_size": vision.temporal_patch_size,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "do_resize": True,
        "do_convert_rgb": True, "resample": 3,
        "size": {"shortest_edge": 64 * factor * factor, "longest_edge": 512 * factor * factor},
    }
    (path / "preprocessor_config.json").write_text(json.dumps(image_proc, indent=2))
    video_proc = dict(image_proc, video_processor_type="Qwen3VLVideoProcessor", fps=2, do_sample_frames=False,
                      size={"shortest_edge": 16 * factor * factor, "longest_edge": 256 * factor * factor})
    video_proc.pop("image_processor_type")
    (path / "video_preprocessor_config.json").write_text(json.dumps(video_proc, indent=2))
    (path / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen3VLProcessor"}))
    (path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"], "do_sample": False}))
    return path

