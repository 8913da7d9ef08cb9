"""The static-shape prefill step of the reference worker: merge + LM (prefill process).

One step embeds the new tokens, merges the encoder rows (main rows into the
embeddings, deepstack levels kept aside for the LM to add after its first
layers), runs the layers over the new tokens attending to the cached prefix KV,
and returns the first token's logits plus this step's KV.

Shapes the graph sees are bucketed so it sees few of them: the new-token
count is padded to a power of two from ``min_bucket``, the prefix KV likewise
(never below ``min_bucket``, so a cold step has the same shape family as a
warm one), and the merge gathers a fixed ``max_blocks`` per token bucket. The
rows buffer is one tensor for the worker's lifetime. Variable placement is data
(``encoder_positions``, ``past_len``, ``last_index``), so with ``compile=True``
each bucket pair compiles once and never again.

Before the graph runs, the host proves every placeholder row of the window
gets exactly one encoder row (:func:`prefill_client.reference.positions.check_filled`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from common.config import CacheMode
from common.errors import LimitExceededError
from prefill_client.reference.lm import TinyLM
from prefill_client.reference.merge import merge_deepstack_embeddings, merge_multimodal_embeddings
from prefill_client.reference.positions import ItemPlacement, build_encoder_positions, check_filled, placeholder_rows
from prefill_client.reference.tokenizer import Special

logger = logging.getLogger(__name__)

StepFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def bucket(n: int, minimum: int) -> int:
    """Smallest power of two >= max(n, minimum)."""
    return 1 << max(0, math.ceil(math.log2(max(n, minimum, 1))))


class _Step(nn.Module):
    """embed -> merge -> layers, as one function of fixed-shape tensors."""

    def __init__(self, lm: TinyLM, num_levels: int) -> None:
        super().__init__()
        self.lm = lm
        self.num_levels = num_levels

    def forward(
        self, token_ids: torch.Tensor, rows: torch.Tensor, block_ids: torch.Tensor,
        encoder_positions: torch.Tensor, past_kv: torch.Tensor, past_len: torch.Tensor,
        last_index: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.lm.embed(token_ids)
        if self.num_levels:
            hidden, deepstack = merge_deepstack_embeddings(
                hidden, rows, encoder_positions, num_levels=self.num_levels, block_ids=block_ids)
        else:
            hidden = merge_multimodal_embeddings(hidden, rows, encoder_positions, block_ids)
            deepstack = []
        return self.lm(hidden, deepstack, past_kv, past_len, last_index)  # type: ignore[no-any-return]


@dataclass(frozen=True, slots=True)
class StepResult:
    logits: torch.Tensor  # [vocab] of the last prompt token
    kv: torch.Tensor  # [layers, 2, new_tokens, kv_heads, head_dim], real rows only
    shape: tuple[int, int, int]  # (token bucket, prefix bucket, max_blocks) the graph ran with


class PrefillGraph:
    """Pads a step to bucketed shapes, checks the merge map, runs the (optionally compiled) step."""

    def __init__(
        self,
        lm: TinyLM,
        *,
        max_model_len: int,
        max_items: int,
        min_bucket: int = 64,
        compile: bool = False,
        backend: str | Callable[..., Any] = "inductor",
        device: str | torch.device = "cpu",
    ) -> None:
        if max_model_len <= 0 or max_items <= 0 or min_bucket <= 0:
            raise ValueError(
                f"max_model_len, max_items and min_bucket must be > 0, got {max_model_len}, {max_items}, {min_bucket}")
        self.lm = lm.to(device)
        self.config = lm.config
        self.max_model_len = max_model_len
        self.max_items = max_items
        self.min_bucket = min_bucket
        self.device = torch.device(device)
        self.dtype = next(lm.parameters()).dtype
        step = _Step(self.lm, lm.config.num_deepstack_levels).eval()
        # dynamic=False: one graph per bucket pair; positions are data, so they never recompile it.
        self._fn: StepFn = (
            torch.compile(step, dynamic=False, fullgraph=True, backend=backend) if compile else step)
        self.compiled = compile
        self.shapes_seen: set[tuple[int, int, int]] = set()

    def max_blocks(self, token_bucket: int, block_size: int) -> int:
        """Gather slots for a token bucket: whole blocks of rows, plus two partial blocks per item."""
        return math.ceil(token_bucket / block_size) + 2 * self.max_items

    @torch.inference_mode()
    def run(
        self,
        token_ids: Sequence[int],
        *,
        start: int,
        prefix_kv: Sequence[torch.Tensor],
        rows: torch.Tensor,
        placements: Sequence[ItemPlacement],
        spans: Sequence[tuple[str, int, int]],
        mode: CacheMode,
    ) -> StepResult:
        """Compute ``token_ids`` (sequence positions ``start ..``) on top of ``prefix_kv``.

        ``prefix_kv`` are the cached blocks (``[layers, 2, B, kv_heads, head_dim]``
        each) covering positions ``0 .. start - 1``; ``rows`` / ``placements``
        say where the encoder rows are; ``spans`` are the request's placeholder
        runs ``(mm_hash, offset, length)`` the check proves are filled.
        """
        n = len(token_ids)
        if n <= 0:
            raise ValueError("a prefill step needs at least one new token")
        if start + n > self.max_model_len:
            raise LimitExceededError(f"prompt of {start + n} tokens exceeds max_model_len {self.max_model_len}")
        c = self.config
        t_pad = bucket(n, self.min_bucket)
        p_pad = bucket(start, self.min_bucket)
        block_size = int(rows.shape[1])
        max_blocks = self.max_blocks(t_pad, block_size)
        window = (start, start + n)

        pmap = build_encoder_positions(
            placements, num_tokens=t_pad, max_blocks=max_blocks, block_size=block_size, window=window)
        expected = [(h, placeholder_rows(off, length, window=window)) for h, off, length in spans]
        check_filled(pmap.encoder_positions, expected, num_tokens=t_pad, mode=mode, owners=pmap.owners)

        ids = torch.full((t_pad,), int(Special.PAD), dtype=torch.int64)
        ids[:n] = torch.as_tensor(list(token_ids), dtype=torch.int64)
        past = torch.zeros(c.num_layers, 2, p_pad, c.num_kv_heads, c.head_dim, dtype=self.dtype, device=self.device)
        if prefix_kv:
            cat = torch.cat(list(prefix_kv), dim=2)
            if cat.shape[2] != start:
                raise ValueError(f"prefix KV covers {cat.shape[2]} positions, the step starts at {start}")
            past[:, :, :start] = cat
        elif start:
            raise ValueError(f"the step starts at {start} but no prefix KV was given")
        dev = self.device
        logits, kv = self._fn(
            ids.to(dev), rows, pmap.block_ids.to(dev), pmap.encoder_positions.to(dev), past,
            torch.tensor(start, dtype=torch.int64, device=dev), torch.tensor(n - 1, dtype=torch.int64, device=dev))
        shape = (t_pad, p_pad, max_blocks)
        if shape not in self.shapes_seen:
            self.shapes_seen.add(shape)
            logger.debug("prefill graph shape %s (%s)", shape, "compiled" if self.compiled else "eager")
        return StepResult(logits.float(), kv[:, :, :n], shape)
