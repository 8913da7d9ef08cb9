"""Tiny random-weight checkpoints of vision-language families for test and bench runs (that run's process).

Each writer builds a complete checkpoint that transformers and vLLM load offline: a byte-level
tokenizer with the family's special tokens and a chat template that puts the family's image
placeholder for each image part, processor configs, and float32 weights from a fixed seed
(wider than the default init, so that greedy tokens and logprobs visibly depend on the image).

- ``qwen3_vl``: Qwen3-VL, from :mod:`epd_harness.qwen3vl`.
- ``qwen2_5_vl``: Qwen2.5-VL, tokens per image grow with its size (14 px patches, 2x2 merge).
- ``llava_onevision``: LLaVA-OneVision, SigLIP tower and Qwen2 text model, anyres tiling.
- ``gemma3``: Gemma 3, SigLIP tower, a fixed :data:`GEMMA3_TOKENS_PER_IMAGE` tokens per image.
- ``llava``: LLaVA-1.5, CLIP tower and Llama text model, a fixed :data:`LLAVA_TOKENS_PER_IMAGE`.

:func:`noise_vision_copy` writes a copy of any of them whose vision tower and projector
weights (:func:`vision_prefixes`) are noise.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from epd_harness.qwen3vl import _byte_vocab, write_qwen3vl_checkpoint

VOCAB_SIZE_ALIGN = 8  # vocab_size: 256 bytes + the family's tokens, rounded up to this
INIT_STD = 0.08
MAX_LEN = 4096

QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|image_pad|>", "<|video_pad|>",
)
LLAVA_OV_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>")
GEMMA3_SPECIAL_TOKENS = (
    "<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>",
    "<image_soft_token>",
)
# Gemma 3's vocabulary has single tokens for runs of newlines, and vLLM looks them up by text.
GEMMA3_NEWLINES = ("\n", "\n\n", "\n\n\n", "\n\n\n\n")
LLAVA_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<image>")

QWEN2_5_VL_PATCH, QWEN2_5_VL_MERGE = 14, 2
LLAVA_OV_IMAGE_SIZE, LLAVA_OV_PATCH = 32, 8
GEMMA3_IMAGE_SIZE, GEMMA3_PATCH, GEMMA3_TOKENS_PER_IMAGE = 32, 8, 4
LLAVA_IMAGE_SIZE, LLAVA_PATCH = 32, 8
LLAVA_TOKENS_PER_IMAGE = (LLAVA_IMAGE_SIZE // LLAVA_PATCH) ** 2

_IMAGE_PART = "part['type'] == 'image' or part['type'] == 'image_url' or 'image' in part"
_NL = "{{ '\\n' }}"


def _chat_template(*, turn: str, turn_close: str, image: str, generation: str, video: str | None = None,
                   prefix: str = "") -> str:
    """A chat template: ``prefix``, then per message ``turn`` (a Jinja snippet of ``message``),
    its content with ``image`` (``video``) in place of each image (video) part, ``turn_close``;
    ``generation`` opens the assistant turn."""
    video_branch = f"{{%- elif part['type'] == 'video' or 'video' in part -%}}{video}" if video else ""
    return (
        prefix
        + "{%- for message in messages -%}"
        + turn
        + "{%- if message['content'] is string -%}{{ message['content'] }}"
        "{%- else -%}{%- for part in message['content'] -%}"
        f"{{%- if {_IMAGE_PART} -%}}{image}"
        f"{video_branch}"
        "{%- elif part['type'] == 'text' -%}{{ part['text'] }}"
        "{%- endif -%}{%- endfor -%}{%- endif -%}"
        + turn_close
        + "{%- endfor -%}"
        f"{{%- if add_generation_prompt -%}}{generation}{{%- endif -%}}"
    )


def _write_tokenizer(path: Path, special_tokens: Sequence[str], chat_template: str, *,
                     named: Mapping[str, str], plain_tokens: Sequence[str] = ()) -> dict[str, int]:
    """A byte-level BPE tokenizer saved at ``path``; ``named`` sets its named special tokens
    (``eos_token``, ``image_token``, ...); ``plain_tokens`` are added as non-special tokens.
    Returns the id of each special and plain token."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(vocab=_byte_vocab(), merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tokenizer_cls: Any = PreTrainedTokenizerFast
    fast = tokenizer_cls(tokenizer_object=tok, **named)
    fast.add_special_tokens({"additional_special_tokens": list(special_tokens)})
    if plain_tokens:
        fast.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain_tokens])
    fast.chat_template = chat_template
    fast.model_max_length = MAX_LEN
    fast.save_pretrained(str(path))
    return {t: int(fast.convert_tokens_to_ids(t)) for t in (*special_tokens, *plain_tokens)}


def _vocab_size(ids: Mapping[str, int]) -> int:
    """The model's vocab_size for a tokenizer whose added tokens are ``ids`` (the last ids)."""
    return -(-(max(ids.values()) + 1) // VOCAB_SIZE_ALIGN) * VOCAB_SIZE_ALIGN


def _save_model(model_cls: Any, config: Any, path: Path, seed: int, init_std: float) -> None:
    """Save ``model_cls(config)`` at ``path`` in float32: every matrix, and every vector the init
    leaves at zero (biases, Gemma's norm offsets), ``N(0, init_std)`` from ``seed``."""
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for _, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * init_std)
            elif p.numel() > 1 and float(p.abs().max()) == 0.0:
                p.copy_(torch.randn(p.shape, generator=gen) * init_std)
    model.save_pretrained(str(path), safe_serialization=True)


def _nest_vision_model(path: Path) -> None:
    """Rename the saved ``vision_tower.*`` tensors to ``vision_tower.vision_model.*``: the names of
    published SigLIP/CLIP-tower checkpoints, the ones vLLM loads (transformers drops the
    ``vision_model`` level on save and accepts both on load)."""
    for file in sorted(path.glob("*.safetensors")):
        tensors = load_file(str(file))
        renamed = {
            (f"vision_tower.vision_model.{name.removeprefix('vision_tower.')}"
             if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model.") else name): t
            for name, t in tensors.items()
        }
        save_file(renamed, str(file), metadata={"format": "pt"})


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2))


def _generation_config(path: Path, eos: int | list[int], pad: int, bos: int | None = None) -> None:
    cfg: dict[str, Any] = {"eos_token_id": eos, "pad_token_id": pad, "do_sample": False}
    if bos is not None:
        cfg["bos_token_id"] = bos
    _write_json(path / "generation_config.json", cfg)


def write_qwen2_5_vl_checkpoint(path: Path, seed: int = 0, *, init_std: float = INIT_STD) -> Path:
    """A Qwen2.5-VL checkpoint at ``path``: 2-layer window-attention tower (14 px patches, 2x2
    merge, so one token per 28x28 px), 2-layer 64-wide text model."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    path.mkdir(parents=True, exist_ok=True)
    template = _chat_template(turn="<|im_start|>{{ message['role'] }}" + _NL, turn_close="<|im_end|>" + _NL,
                              image="<|vision_start|><|image_pad|><|vision_end|>",
                              video="<|vision_start|><|video_pad|><|vision_end|>",
                              generation="<|im_start|>assistant" + _NL)
    ids = _write_tokenizer(path, QWEN_SPECIAL_TOKENS, template,
                           named={"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})
    factor = QWEN2_5_VL_PATCH * QWEN2_5_VL_MERGE
    vision_cfg = {
        "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "in_channels": 3,
        "patch_size": QWEN2_5_VL_PATCH, "spatial_merge_size": QWEN2_5_VL_MERGE, "temporal_patch_size": 2,
        "tokens_per_second": 2, "window_size": 2 * factor, "fullatt_block_indexes": [1],
        "out_hidden_size": 64, "hidden_act": "silu", "initializer_range": init_std,
    }
    text_cfg = {
        "vocab_size": _vocab_size(ids), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "hidden_act": "silu",
        "max_position_embeddings": MAX_LEN, "rms_norm_eps": 1e-6, "use_sliding_window": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 6, 6]},
        "initializer_range": init_std, "tie_word_embeddings": False,
        "bos_token_id": None, "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"],
    }
    config = Qwen2_5_VLConfig(
        text_config=text_cfg, vision_config=vision_cfg,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    _save_model(Qwen2_5_VLForConditionalGeneration, config, path, seed, init_std)
    image_proc = {
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
        "patch_size": QWEN2_5_VL_PATCH, "merge_size": QWEN2_5_VL_MERGE, "temporal_patch_size": 2,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "do_resize": True,
        "do_convert_rgb": True, "resample": 3,
        "min_pixels": 4 * factor * factor, "max_pixels": 256 * factor * factor,
        "size": {"shortest_edge": 4 * factor * factor, "longest_edge": 256 * factor * factor},
    }
    _write_json(path / "preprocessor_config.json", image_proc)
    video_proc = dict(image_proc, video_processor_type="Qwen2VLVideoProcessor", fps=2, do_sample_frames=False,
                      size={"shortest_edge": 4 * factor * factor, "longest_edge": 128 * factor * factor})
    video_proc.pop("image_processor_type")
    video_proc.pop("min_pixels")
    video_proc.pop("max_pixels")
    _write_json(path / "video_preprocessor_config.json", video_proc)
    _write_json(path / "processor_config.json", {"processor_class": "Qwen2_5_VLProcessor"})
    _generation_config(path, ids["<|im_end|>"], ids["<|endoftext|>"])
    return path


def _siglip_config(image_size: int, patch_size: int, init_std: float) -> dict[str, Any]:
    return {
        "model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_channels": 3,
        "image_size": image_size, "patch_size": patch_size, "hidden_act": "gelu_pytorch_tanh",
        "layer_norm_eps": 1e-6, "vision_use_head": False, "initializer_range": init_std,
    }


def write_llava_onevision_checkpoint(path: Path, seed: int = 0, *, init_std: float = INIT_STD) -> Path:
    """A LLaVA-OneVision checkpoint at ``path``: 2-layer SigLIP tower on 32 px tiles (8 px patches,
    16 tokens a tile), anyres grid up to 96x96 px, 2-layer 64-wide Qwen2 text model."""
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration

    path.mkdir(parents=True, exist_ok=True)
    template = _chat_template(turn="<|im_start|>{{ message['role'] }}" + _NL, turn_close="<|im_end|>" + _NL,
                              image="<image>" + _NL, video="<video>" + _NL,
                              generation="<|im_start|>assistant" + _NL)
    ids = _write_tokenizer(path, LLAVA_OV_SPECIAL_TOKENS, template,
                           named={"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                                  "image_token": "<image>", "video_token": "<video>"})
    size = LLAVA_OV_IMAGE_SIZE
    pinpoints = [[size * h, size * w] for h in range(1, 4) for w in range(1, 4)]
    text_cfg = {
        "model_type": "qwen2", "vocab_size": _vocab_size(ids), "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "hidden_act": "silu",
        "max_position_embeddings": MAX_LEN, "rms_norm_eps": 1e-6, "use_sliding_window": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "initializer_range": init_std, "tie_word_embeddings": False,
        "bos_token_id": None, "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"],
    }
    config = LlavaOnevisionConfig(
        vision_config=_siglip_config(size, LLAVA_OV_PATCH, init_std), text_config=text_cfg,
        image_token_index=ids["<image>"], video_token_index=ids["<video>"],
        vision_feature_select_strategy="full", vision_feature_layer=-1,
        image_grid_pinpoints=pinpoints, vision_aspect_ratio="anyres_max_9", tie_word_embeddings=False,
    )
    config.architectures = ["LlavaOnevisionForConditionalGeneration"]
    _save_model(LlavaOnevisionForConditionalGeneration, config, path, seed, init_std)
    _nest_vision_model(path)
    image_proc = {
        "image_processor_type": "LlavaOnevisionImageProcessor", "processor_class": "LlavaOnevisionProcessor",
        "size": {"height": size, "width": size}, "image_grid_pinpoints": pinpoints,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "do_resize": True,
        "do_convert_rgb": True, "do_pad": True, "resample": 3,
    }
    _write_json(path / "preprocessor_config.json", image_proc)
    video_proc = {k: v for k, v in image_proc.items() if k not in ("image_processor_type", "image_grid_pinpoints",
                                                                      "do_pad")}
    _write_json(path / "video_preprocessor_config.json",
                dict(video_proc, video_processor_type="LlavaOnevisionVideoProcessor", do_sample_frames=False))
    _write_json(path / "processor_config.json", {
        "processor_class": "LlavaOnevisionProcessor", "num_image_tokens": (size // LLAVA_OV_PATCH) ** 2,
        "vision_feature_select_strategy": "full", "vision_aspect_ratio": "anyres_max_9",
    })
    _generation_config(path, ids["<|im_end|>"], ids["<|endoftext|>"])
    return path


def write_gemma3_checkpoint(path: Path, seed: int = 0, *, init_std: float = INIT_STD) -> Path:
    """A Gemma 3 checkpoint at ``path``: 2-layer SigLIP tower on 32 px images (8 px patches,
    pooled to :data:`GEMMA3_TOKENS_PER_IMAGE` tokens), 2-layer 64-wide text model (one sliding,
    one global attention layer)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    path.mkdir(parents=True, exist_ok=True)
    template = _chat_template(
        turn="<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}" + _NL,
        turn_close="<end_of_turn>" + _NL, image="<start_of_image>", generation="<start_of_turn>model" + _NL,
        prefix="{{ bos_token }}")
    ids = _write_tokenizer(
        path, GEMMA3_SPECIAL_TOKENS, template, plain_tokens=GEMMA3_NEWLINES,
        named={"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "boi_token": "<start_of_image>",
               "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"})
    text_cfg = {
        "vocab_size": _vocab_size(ids), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "query_pre_attn_scalar": 32,
        "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": MAX_LEN, "rms_norm_eps": 1e-6,
        "sliding_window": 512, "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "initializer_range": init_std, "tie_word_embeddings": True,
        "bos_token_id": ids["<bos>"], "eos_token_id": [ids["<eos>"], ids["<end_of_turn>"]],
        "pad_token_id": ids["<pad>"],
    }
    config = Gemma3Config(
        text_config=text_cfg, vision_config=_siglip_config(GEMMA3_IMAGE_SIZE, GEMMA3_PATCH, init_std),
        mm_tokens_per_image=GEMMA3_TOKENS_PER_IMAGE, boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"], image_token_index=ids["<image_soft_token>"],
        initializer_range=init_std, tie_word_embeddings=True,
    )
    config.architectures = ["Gemma3ForConditionalGeneration"]
    _save_model(Gemma3ForConditionalGeneration, config, path, seed, init_std)
    _nest_vision_model(path)
    image_proc = {
        "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
        "size": {"height": GEMMA3_IMAGE_SIZE, "width": GEMMA3_IMAGE_SIZE},
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "do_resize": True,
        "do_convert_rgb": True, "resample": 2, "do_pan_and_scan": False,
        "pan_and_scan_min_crop_size": 256, "pan_and_scan_max_num_crops": 4, "pan_and_scan_min_ratio_to_activate": 1.2,
    }
    _write_json(path / "preprocessor_config.json", image_proc)
    _write_json(path / "processor_config.json",
                {"processor_class": "Gemma3Processor", "image_seq_length": GEMMA3_TOKENS_PER_IMAGE})
    _generation_config(path, [ids["<eos>"], ids["<end_of_turn>"]], ids["<pad>"], bos=ids["<bos>"])
    return path


def write_llava_checkpoint(path: Path, seed: int = 0, *, init_std: float = INIT_STD) -> Path:
    """A LLaVA-1.5 checkpoint at ``path``: 2-layer CLIP tower on 32 px images (8 px patches, so
    :data:`LLAVA_TOKENS_PER_IMAGE` tokens an image), 2-layer 64-wide Llama text model."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    path.mkdir(parents=True, exist_ok=True)
    template = _chat_template(turn="{{ message['role'] | upper + ': ' }}", turn_close="{{ ' ' }}",
                              image="<image>" + _NL, generation="ASSISTANT:", prefix="{{ bos_token }}")
    ids = _write_tokenizer(path, LLAVA_SPECIAL_TOKENS, template,
                           named={"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                                  "pad_token": "<unk>", "image_token": "<image>"})
    vision_cfg = {
        "model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64, "projection_dim": 32,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_channels": 3,
        "image_size": LLAVA_IMAGE_SIZE, "patch_size": LLAVA_PATCH, "hidden_act": "quick_gelu",
        "layer_norm_eps": 1e-5, "initializer_range": init_std,
    }
    text_cfg = {
        "model_type": "llama", "vocab_size": _vocab_size(ids), "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "hidden_act": "silu",
        "max_position_embeddings": MAX_LEN, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "initializer_range": init_std, "tie_word_embeddings": False,
        "bos_token_id": ids["<s>"], "eos_token_id": ids["</s>"], "pad_token_id": ids["<unk>"],
    }
    config = LlavaConfig(
        vision_config=vision_cfg, text_config=text_cfg, image_token_index=ids["<image>"],
        image_seq_length=LLAVA_TOKENS_PER_IMAGE, vision_feature_select_strategy="default",
        vision_feature_layer=-1, tie_word_embeddings=False,
    )
    config.architectures = ["LlavaForConditionalGeneration"]
    _save_model(LlavaForConditionalGeneration, config, path, seed, init_std)
    _nest_vision_model(path)
    image_proc = {
        "image_processor_type": "CLIPImageProcessor", "processor_class": "LlavaProcessor",
        "size": {"shortest_edge": LLAVA_IMAGE_SIZE}, "do_center_crop": True,
        "crop_size": {"height": LLAVA_IMAGE_SIZE, "width": LLAVA_IMAGE_SIZE},
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "do_resize": True,
        "do_convert_rgb": True, "resample": 3,
    }
    _write_json(path / "preprocessor_config.json", image_proc)
    _write_json(path / "processor_config.json", {
        "processor_class": "LlavaProcessor", "patch_size": LLAVA_PATCH, "vision_feature_select_strategy": "default",
        "num_additional_image_tokens": 1, "image_token": "<image>",
    })
    _generation_config(path, ids["</s>"], ids["<unk>"], bos=ids["<s>"])
    return path


FAMILIES: dict[str, Callable[[Path, int], Path]] = {
    "qwen3_vl": write_qwen3vl_checkpoint,
    "qwen2_5_vl": write_qwen2_5_vl_checkpoint,
    "llava_onevision": write_llava_onevision_checkpoint,
    "gemma3": write_gemma3_checkpoint,
    "llava": write_llava_checkpoint,
}

_QWEN_VISION = ("visual.", "model.visual.")
_LLAVA_VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
# Per model_type, the vision tower + projector prefixes under both the original checkpoint names
# (what transformers writes) and transformers' in-memory names (``model.`` in front).
VISION_PREFIXES: dict[str, tuple[str, ...]] = {
    "qwen2_5_vl": _QWEN_VISION,
    "qwen3_vl": _QWEN_VISION,
    "qwen3_vl_moe": _QWEN_VISION,
    "llava_onevision": (*_LLAVA_VISION, "image_newline", "model.image_newline"),
    "llava_next": (*_LLAVA_VISION, "image_newline", "model.image_newline"),
    "gemma3": _LLAVA_VISION,
    "llava": _LLAVA_VISION,
}


def _tensor_names(checkpoint: Path) -> list[str]:
    from safetensors import safe_open

    names: list[str] = []
    for file in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            names.extend(f.keys())
    return names


def vision_prefixes(checkpoint: Path) -> tuple[str, ...]:
    """Safetensors tensor-name prefixes of the vision tower and projector of ``checkpoint`` (by
    its ``config.json`` model_type), those that its tensors use."""
    model_type = json.loads((checkpoint / "config.json").read_text())["model_type"]
    if model_type not in VISION_PREFIXES:
        raise ValueError(f"no vision prefixes known for model_type {model_type!r}")
    names = _tensor_names(checkpoint)
    used = tuple(p for p in VISION_PREFIXES[model_type] if any(n.startswith(p) for n in names))
    if not used:
        raise ValueError(f"no tensor of {checkpoint} starts with any of {VISION_PREFIXES[model_type]}")
    return used


def noise_vision_copy(src: Path, dst: Path, seed: int = 12345) -> Path:
    """A copy of checkpoint ``src`` whose vision tower and projector weights are noise of the same
    shapes and dtypes."""
    prefixes = vision_prefixes(src)
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    gen = torch.Generator().manual_seed(seed)
    for file in sorted(dst.glob("*.safetensors")):
        tensors = load_file(str(file))
        for name, t in tensors.items():
            if name.startswith(prefixes):
                tensors[name] = torch.randn(t.shape, generator=gen).to(t.dtype)
        save_file(tensors, str(file), metadata={"format": "pt"})
    return dst
