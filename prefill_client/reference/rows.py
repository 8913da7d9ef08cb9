"""Where the prefill graph gathers encoder rows from (prefill process).

The merge takes one buffer of blocks plus a block-id index, so where the rows
live is a choice of buffer:

- EPD (:class:`StagingRows`): rows pulled from an encoder are copied into a
  worker-owned staging buffer ``[num_blocks, block_size, fat_dim]``, only the
  part of each item inside the step's window.
- monolithic (:class:`prefill_client.reference.monolithic.MonolithicReader`): the
  encoder's own cache buffer, with the item's own block ids; nothing moves.

Both check the item's stored token count against the request's placeholder
count first: ``ECLoadFailure(TOKEN_COUNT)`` in EPD mode,
``EncoderCacheReadError`` in monolithic mode.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from common.config import CacheMode
from common.errors import HandshakeError, LimitExceededError
from prefill_client.consumer.client import PulledItem
from prefill_client.reference.positions import ItemPlacement, check_num_tokens

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ScheduledItem:
    """An item with placeholders in the step's window, and its rows when they were pulled."""

    mm_hash: str
    offset: int  # sequence position of its first placeholder
    num_tokens: int  # the request's placeholder count
    pulled: PulledItem | None = None  # None in monolithic mode: the rows stay in the cache

    def window_part(self, window: tuple[int, int]) -> tuple[int, int]:
        """Item-local row range ``[lo, hi)`` inside the sequence window (``lo == hi`` if none)."""
        lo = max(window[0], self.offset) - self.offset
        hi = min(window[1], self.offset + self.num_tokens) - self.offset
        return lo, max(lo, hi)


class RowStore(Protocol):
    """A buffer the merge gathers from, and where each scheduled item's rows are in it."""

    @property
    def mode(self) -> CacheMode: ...

    @property
    def block_size(self) -> int: ...

    def place(
        self, items: Sequence[ScheduledItem], window: tuple[int, int]
    ) -> tuple[torch.Tensor, list[ItemPlacement]]: ...


class StagingRows:
    """EPD: copy pulled rows into a fixed staging buffer; placements point into it."""

    def __init__(
        self,
        fat_dim: int,
        *,
        num_blocks: int,
        block_size: int = 32,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        if fat_dim <= 0 or num_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"fat_dim, num_blocks and block_size must be > 0, got {fat_dim}, {num_blocks}, {block_size}")
        self.fat_dim = fat_dim
        self._block_size = block_size
        # Allocated once: every step gathers from the same tensor, so the graph's
        # input shapes never change with what was pulled.
        self.buffer = torch.zeros(num_blocks, block_size, fat_dim, dtype=dtype, device=device)

    @property
    def mode(self) -> CacheMode:
        return CacheMode.EPD

    @property
    def block_size(self) -> int:
        return self._block_size

    def place(
        self, items: Sequence[ScheduledItem], window: tuple[int, int]
    ) -> tuple[torch.Tensor, list[ItemPlacement]]:
        bs = self._block_size
        flat = self.buffer.view(-1, self.fat_dim)
        placements: list[ItemPlacement] = []
        next_block = 0
        for item in items:
            pulled = item.pulled
            if pulled is None:
                raise ValueError(f"item {item.mm_hash} was scheduled without pulled rows")
            check_num_tokens(item.mm_hash, pulled.num_tokens, item.num_tokens, CacheMode.EPD)
            if pulled.embeddings.dim() != 2 or pulled.embeddings.shape[1] != self.fat_dim:
                raise HandshakeError(
                    f"item {item.mm_hash}: encoder rows are {tuple(pulled.embeddings.shape)}, "
                    f"this worker's model expects rows {self.fat_dim} wide")
            lo, hi = item.window_part(window)
            if hi == lo:
                continue
            n = hi - lo
            blocks = math.ceil(n / bs)
            if next_block + blocks > self.buffer.shape[0]:
                raise LimitExceededError(
                    f"items of one step need more than the {self.buffer.shape[0]} staging blocks")
            start = next_block * bs
            flat[start:start + n].copy_(pulled.embeddings[lo:hi])
            placements.append(ItemPlacement.dense(
                item.mm_hash, range(next_block, next_block + blocks), n, item.offset + lo, bs))
            next_block += blocks
        return self.buffer, placements
