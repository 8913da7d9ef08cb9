"""Build the vision tower: from a Qwen3-VL checkpoint, or seeded random (encoder process).

A checkpoint directory holds ``config.json`` (with a ``vision_config``) and
safetensors shards. Only tensors under ``model.visual.`` (Qwen3-VL in
transformers >= 4.57) or ``visual.`` (older exports) are read, one at a time
through ``safe_open``, so the language model's weights never reach memory,
and hashed as they are read (:mod:`common.weights_digest`: the digest the
handshake announces, the one a prefill worker computes from the same files).
Every tower parameter must be present with its exact shape, and no unknown
vision tensor may be left over: a silent partial load would serve wrong
embeddings under the right model id.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch
from safetensors import safe_open

from common.config import read_json_object
from common.errors import ConfigError
from common.weights_digest import checkpoint_files, combine, tensor_entry, tensors_digest, vision_name
from encoder_server.vision.config import VisionConfig
from encoder_server.vision.model import VisionEncoder

logger = logging.getLogger(__name__)

# A checkpoint's dtype names (config.json's "dtype" / "torch_dtype", safetensors' dtype codes) -> the
# tower dtypes --tower-dtype names.
_CONFIG_DTYPES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16",
                  "half": "float16"}
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def declared_dtype(path: str | Path) -> tuple[str, str]:
    """The dtype a checkpoint declares for its model, and where it says so: ``("bfloat16", "config.json dtype")``.

    vLLM's rule for ``--dtype auto``: the config's ``dtype`` (or ``torch_dtype``), else its
    ``text_config``'s, else its ``vision_config``'s; without any, the dtype the vision tensors are
    stored in (one dtype for all, else float32); float32 when there are none. Unlike vLLM, which
    runs a float32 checkpoint in bfloat16 too, a float32 checkpoint stays float32.
    """
    root = Path(path)
    config_file = root / "config.json"
    raw = read_json_object(config_file)
    for where, section in (("", raw), ("text_config.", raw.get("text_config")),
                           ("vision_config.", raw.get("vision_config"))):
        if not isinstance(section, dict):
            continue
        for key in ("dtype", "torch_dtype"):
            value = section.get(key)
            if value is None:
                continue
            name = _CONFIG_DTYPES.get(str(value).removeprefix("torch."))
            if name is None:
                raise ConfigError(
                    f"{config_file}: {where}{key} is {value!r}, not a dtype the tower runs in "
                    f"({', '.join(sorted(set(_CONFIG_DTYPES.values())))}); set --tower-dtype")
            return name, f"config.json {where}{key}"
    stored: set[str] = set()
    for file in checkpoint_files(root):
        if not file.is_file():
            continue
        with safe_open(str(file), framework="pt", device="cpu") as shard:
            stored.update(shard.get_slice(key).get_dtype() for key in shard.keys() if vision_name(key) is not None)
    if len(stored) == 1 and (name := _SAFETENSORS_DTYPES.get(next(iter(stored)))) is not None:
        return name, "the vision tensors' stored dtype"
    return "float32", "no dtype declared" if not stored else f"vision tensors stored in {sorted(stored)}"


def load_encoder(
    path: str | None = None,
    *,
    config: VisionConfig | None = None,
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> VisionEncoder:
    """The vision tower, in eval mode, on ``device``.

    With ``path``: the config and weights of that Hugging Face Qwen3-VL checkpoint
    (``config`` must then be None or equal to the checkpoint's). Without: ``config``
    (default: the tiny :class:`VisionConfig`) initialized deterministically from ``seed``.
    """
    if path is not None:
        found = VisionConfig.from_pretrained_dir(path)
        if config is not None and config != found:
            raise ConfigError(f"config {config} differs from the checkpoint's vision_config {found}")
        encoder = VisionEncoder(found)
        encoder.weights_digest = _load_checkpoint(encoder, Path(path))
        logger.info("loaded vision tower from %s (%d layers, fat_dim %d)", path, found.depth, found.fat_dim)
    else:
        encoder = VisionEncoder(config or VisionConfig())
        init_seeded(encoder, seed)
        encoder.weights_digest = tensors_digest(encoder.named_parameters())
    encoder.to(device=torch.device(device), dtype=dtype)
    encoder.eval()
    encoder.requires_grad_(False)
    return encoder


@torch.no_grad()
def init_seeded(encoder: VisionEncoder, seed: int) -> None:
    """Deterministic weights from ``seed`` (same seed, same config -> same tensors on any host)."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    for name, param in encoder.named_parameters():
        values = torch.empty(param.shape, dtype=torch.float32)
        leaf = name.rsplit(".", 1)[-1]
        is_norm = ".norm" in name or name.startswith("norm")
        if is_norm and leaf == "weight":
            values.fill_(1.0)
        elif is_norm or leaf == "bias":
            values.normal_(0.0, 0.02, generator=generator)
        elif name == "pos_embed.weight":
            values.normal_(0.0, 0.5, generator=generator)
        else:
            # Unit-variance activations whatever the width: std 1/sqrt(fan_in).
            fan_in = math.prod(param.shape[1:])
            values.normal_(0.0, fan_in ** -0.5, generator=generator)
        param.copy_(values)


@torch.no_grad()
def _load_checkpoint(encoder: VisionEncoder, root: Path) -> str:
    """Copy the checkpoint's vision tensors into ``encoder``; returns their weights digest."""
    files = checkpoint_files(root)
    if not files:
        raise ConfigError(f"no safetensors files with vision weights in {root}")
    params = dict(encoder.named_parameters())
    loaded: dict[str, str] = {}  # name -> its weights-digest entry
    unexpected: list[str] = []
    for file in files:
        if not file.is_file():
            raise ConfigError(f"checkpoint shard {file} named by the index is missing")
        with safe_open(str(file), framework="pt", device="cpu") as shard:
            for key in shard.keys():
                name = vision_name(key)
                if name is None:
                    continue
                if name not in params:
                    unexpected.append(key)
                    continue
                if name in loaded:
                    raise ConfigError(f"vision tensor {name} appears twice in {root} (last in {file.name})")
                tensor = shard.get_tensor(key)
                if tuple(tensor.shape) != tuple(params[name].shape):
                    raise ConfigError(
                        f"checkpoint tensor {key} has shape {tuple(tensor.shape)}, "
                        f"the config expects {tuple(params[name].shape)}"
                    )
                params[name].copy_(tensor)
                loaded[name] = tensor_entry(tensor)  # as stored: a prefill worker hashes the same files
    missing = sorted(set(params) - set(loaded))
    if missing or unexpected:
        raise ConfigError(
            f"checkpoint {root} does not match the vision config: "
            f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''} ({len(missing)}), "
            f"unexpected {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''} ({len(unexpected)})"
        )
    return combine(loaded)
