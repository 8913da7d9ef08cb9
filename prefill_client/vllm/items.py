"""What both pull paths of the vLLM connector need to know about a request's items."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vllm.v1.request import Request


@dataclass(frozen=True)
class Wanted:
    """One item a request needs: its identifier and the number of rows the prompt has for it."""

    identifier: str
    num_embeds: int


def wanted_items(request: Request, num_computed_tokens: int) -> list[Wanted]:
    """The request's items (each once) whose placeholders are not all covered by its prefix-cache hit."""
    out: list[Wanted] = []
    seen: set[str] = set()
    for index, feature in enumerate(request.mm_features):
        pos = feature.mm_position
        if pos.offset + pos.length <= num_computed_tokens or feature.identifier in seen:
            continue
        seen.add(feature.identifier)
        out.append(Wanted(feature.identifier, int(request.get_num_encoder_embeds(index))))
    return out


def shape_problem(identifier: str, rows: torch.Tensor, num_embeds: int, width: int | None) -> str | None:
    """Why ``rows`` cannot be the item's encoder output in this model, or None."""
    if rows.dim() != 2 or rows.shape[0] != num_embeds:
        return (f"item {identifier}: the encoder has {tuple(rows.shape)} rows, the prompt expects "
                f"{num_embeds} (the request's placeholder metadata does not match the item)")
    if width is not None and rows.shape[1] != width:
        return (f"item {identifier}: rows of width {rows.shape[1]}, the model expects {width} "
                f"(its input-embedding size x (1 + deepstack levels)); encoder and model disagree")
    return None


def worker_device() -> torch.device:
    """The device of this vLLM worker (its GPU on CUDA, the host elsewhere)."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike():
        return torch.device(current_platform.device_type, current_platform.current_device())
    return torch.device(current_platform.device_type)
