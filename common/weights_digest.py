"""Digest of a vision tower's weights, the same on both sides (encoder and prefill processes).

Two encoders with the same ``model_id`` but different vision weights (the old
and the new pods of a rolling update) hand out different embeddings under the
same ``mm_hash``. The encoder announces this digest in its handshake; a client
that knows which weights its language model was trained with (from its own
checkpoint, or configured) refuses every other encoder, and keys what it keeps
by the digest.

The digest covers each vision tensor's name (without the checkpoint's
``model.visual.`` / ``visual.`` prefix), dtype, shape and bytes, in name order,
as stored in the checkpoint: the encoder hashes the tensors it loads, a prefill
worker hashes the same files without building the tower, and both get the same
string whatever dtype the encoder then runs in. A seeded random tower (no
checkpoint) hashes its parameters the same way.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from pathlib import Path

import blake3
import torch

from common.errors import ConfigError

VISION_PREFIXES = ("model.visual.", "visual.")
# Other families' vision towers and projectors (LLaVA, Gemma 3, Idefics3, InternVL, Mistral 3, ...):
# their names keep the module, since a tower and a projector may both own a "linear_1".
TOWER_MODULES = ("vision_tower.", "multi_modal_projector.", "vision_model.", "connector.", "mlp1.",
                 "vision_embed_tokens.", "image_newline", "vision_resampler.", "embed_vision.")
PREFIX = "b3:"


def vision_name(key: str) -> str | None:
    """The tower's own name of checkpoint tensor ``key``, or None when it is not a vision tensor.

    Qwen-VL's ``visual.`` tensors are named without it (digests made before other families
    were served stay the same); another family's keep their module, less a leading ``model.``.
    """
    prefix = next((p for p in VISION_PREFIXES if key.startswith(p)), None)
    if prefix is not None:
        return key[len(prefix):]
    name = key.removeprefix("model.")
    return name if name.startswith(TOWER_MODULES) else None


def tensor_entry(tensor: torch.Tensor) -> str:
    """One tensor's part of the digest: dtype, shape and a digest of its bytes."""
    data = tensor.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().data  # a memoryview, no copy
    return f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}:{blake3.blake3(data).hexdigest(16)}"


def combine(entries: dict[str, str]) -> str:
    """The digest of a whole tower from its tensors' entries (:func:`tensor_entry`), by name."""
    if not entries:
        raise ConfigError("no vision tensors to digest")
    return PREFIX + blake3.blake3(json.dumps(entries, sort_keys=True).encode()).hexdigest(16)


def tensors_digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """The digest of ``(name, tensor)`` pairs (a module's ``named_parameters()``)."""
    return combine({name: tensor_entry(t) for name, t in named})


def checkpoint_files(root: Path) -> list[Path]:
    """The safetensors files of a checkpoint that hold vision tensors (all of them without an index)."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"cannot read {index}: {exc}") from exc
        names = sorted({f for k, f in weight_map.items() if vision_name(k) is not None})
        return [root / n for n in names]
    return sorted(root.glob("*.safetensors"))


def checkpoint_digest(path: str | Path) -> str:
    """The digest of a Hugging Face checkpoint's vision tensors, read one at a time."""
    from safetensors import safe_open

    root = Path(path)
    files = checkpoint_files(root)
    if not files:
        raise ConfigError(f"no safetensors files with vision weights in {root}")
    entries: dict[str, str] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as shard:
                for key in shard.keys():
                    name = vision_name(key)
                    if name is not None:
                        entries[name] = tensor_entry(shard.get_tensor(key))
        except OSError as exc:
            raise ConfigError(f"cannot read checkpoint shard {file}: {exc}") from exc
    return combine(entries)


def main(argv: list[str]) -> int:
    """``epd weights-digest DIR``: print a checkpoint's vision weights digest (for ``--weights-digest``)."""
    asked = argv in (["-h"], ["--help"])
    if asked or len(argv) != 1:
        print("usage: epd weights-digest CHECKPOINT_DIR", file=sys.stdout if asked else sys.stderr)
        return 0 if asked else 2
    try:
        print(checkpoint_digest(argv[0]))
    except ConfigError as exc:
        print(f"epd weights-digest: {exc}", file=sys.stderr)
        return 2
    return 0
