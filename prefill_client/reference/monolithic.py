"""Monolithic mode: encoder and prefill in one process, reading the local cache (one process: encoder and reference prefill worker).

When the encoder runs in the same process, the prefill graph gathers rows
straight out of the encoder's ``EncoderCacheBlocks.buffer`` with the item's
own block ids: no transport, no landing blocks, no copy, and the tag and
generation regions are not read (nothing can rewrite a block between the
scheduler's check and the step when both run in one thread, as in the
reference). The cache object is taken duck-typed (:class:`LocalEncoderCache`),
so this package does not import the encoder's.

A scheduled item whose slot is missing or unwritten, or whose stored token
count differs from the request's placeholder count, raises
:class:`EncoderCacheReadError`: never a silent skip.

:class:`MonolithicSource` lets the reference worker run in this mode: layer
2a asks the local cache, misses go to an in-process encoder
(:class:`LocalEncoder`) that writes into the same cache.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from common.config import CacheMode
from common.errors import EncoderCacheReadError
from common.media import PreprocessParams
from prefill_client.consumer.client import PulledItem
from prefill_client.consumer.connection import MediaSpec
from prefill_client.reference.positions import ItemPlacement, check_num_tokens
from prefill_client.reference.rows import ScheduledItem

logger = logging.getLogger(__name__)


class LocalEncoderCache(Protocol):
    """What monolithic mode reads of ``EncoderCacheBlocks``."""

    @property
    def buffer(self) -> torch.Tensor: ...  # [num_blocks, block_size, fat_dim]

    def contains(self, mm_hash: str) -> bool: ...

    def is_written(self, mm_hash: str) -> bool: ...

    def get_block_ids(self, mm_hash: str) -> list[int]: ...

    def get_num_tokens(self, mm_hash: str) -> int: ...

    def get_tokens_per_block(self, mm_hash: str) -> list[int]: ...


class MonolithicReader:
    """Placements into the local cache buffer; a :class:`prefill_client.reference.rows.RowStore`."""

    def __init__(self, cache: LocalEncoderCache) -> None:
        self.cache = cache

    @property
    def mode(self) -> CacheMode:
        return CacheMode.MONOLITHIC

    @property
    def block_size(self) -> int:
        return int(self.cache.buffer.shape[1])

    def _slot(self, mm_hash: str) -> tuple[int, list[int], list[int]]:
        """(stored tokens, block ids, tokens per block) of a present, written item."""
        if not self.cache.contains(mm_hash):
            raise EncoderCacheReadError(f"encoder cache read for mm_hash {mm_hash}: no slot (evicted or never encoded)")
        if not self.cache.is_written(mm_hash):
            raise EncoderCacheReadError(f"encoder cache read for mm_hash {mm_hash}: slot allocated but not written")
        try:
            return (self.cache.get_num_tokens(mm_hash), self.cache.get_block_ids(mm_hash),
                    self.cache.get_tokens_per_block(mm_hash))
        except ValueError as exc:  # freed between the checks above and now
            raise EncoderCacheReadError(f"encoder cache read for mm_hash {mm_hash}: {exc}") from exc

    def placement(self, mm_hash: str, num_placeholders: int, offset: int) -> ItemPlacement:
        """Where ``mm_hash``'s rows are in the cache buffer, checked against the request."""
        stored, block_ids, tokens_per_block = self._slot(mm_hash)
        check_num_tokens(mm_hash, stored, num_placeholders, CacheMode.MONOLITHIC)
        try:
            return ItemPlacement(mm_hash, tuple(block_ids), tuple(tokens_per_block), stored, offset)
        except ValueError as exc:
            raise EncoderCacheReadError(f"encoder cache read for mm_hash {mm_hash}: bad slot: {exc}") from exc

    def place(
        self, items: Sequence[ScheduledItem], window: tuple[int, int]
    ) -> tuple[torch.Tensor, list[ItemPlacement]]:
        """The whole cache buffer and every in-window item's own blocks (the merge gathers in-graph)."""
        placements = []
        for item in items:
            placement = self.placement(item.mm_hash, item.num_tokens, item.offset)
            lo, hi = item.window_part(window)
            if hi > lo:
                placements.append(placement)
        return self.cache.buffer, placements

    def rows(self, mm_hash: str) -> torch.Tensor:
        """The item's rows ``[num_tokens, fat_dim]``: a view of the buffer when its blocks allow one."""
        placement = self.placement(mm_hash, self._slot(mm_hash)[0], 0)
        buffer, bs = self.cache.buffer, self.block_size
        ids, tpb = placement.block_ids, placement.tokens_per_block
        dense = all(n == bs for n in tpb[:-1])
        consecutive = all(b == ids[0] + i for i, b in enumerate(ids))
        if dense and consecutive:
            return buffer[ids[0]:ids[0] + len(ids)].reshape(-1, buffer.shape[-1])[:placement.num_tokens]
        return torch.cat([buffer[b, :n] for b, n in zip(ids, tpb)])


@dataclass(frozen=True, slots=True)
class EncodedItem:
    """What an in-process encoder reports for one item it encoded or found."""

    mm_hash: str
    grid_thw: tuple[int, ...]
    hit: bool  # already in the cache: the encoder did not run for it


class LocalEncoder(Protocol):
    """An encoder in this process that writes into the same cache (and marks items written)."""

    def encode(self, items: Sequence[MediaSpec]) -> list[EncodedItem]: ...


class MonolithicSource:
    """The worker's embedding source in monolithic mode (same methods as the EPD client)."""

    def __init__(
        self,
        cache: LocalEncoderCache,
        encoder: LocalEncoder,
        params: PreprocessParams,
        preprocess_fingerprint: str,
    ) -> None:
        self.reader = MonolithicReader(cache)
        self.encoder = encoder
        self._media = (params, preprocess_fingerprint)
        self._grids: dict[str, tuple[int, ...]] = {}

    def media_params(self) -> tuple[PreprocessParams, str]:
        return self._media

    def _item(self, mm_hash: str, source: str) -> PulledItem | None:
        if not self.reader.cache.is_written(mm_hash):
            return None
        return PulledItem(mm_hash, self.reader.rows(mm_hash), self._grids.get(mm_hash, ()), "local", source)

    def cached(self, mm_hash: str) -> PulledItem | None:
        """Layer 2a: the item is in the local cache, so the encoder need not run."""
        return self._item(mm_hash, "local")

    def lookup(self, mm_hashes: Sequence[str]) -> list[PulledItem | None]:
        return [self._item(h, "hit") for h in mm_hashes]

    def encode(self, items: Sequence[MediaSpec]) -> list[PulledItem]:
        out: list[PulledItem] = []
        for spec, done in zip(items, self.encoder.encode(items), strict=True):
            self._grids[done.mm_hash] = tuple(done.grid_thw)
            item = self._item(done.mm_hash, "hit" if done.hit else "miss")
            if item is None:
                raise EncoderCacheReadError(
                    f"encoder cache read for mm_hash {done.mm_hash} ({spec.uuid or spec.kind}): "
                    "the local encoder reported it but its slot is not written")
            out.append(item)
        return out
