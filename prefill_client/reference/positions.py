"""Position maps for the in-graph merge, built and checked on the host (prefill process).

The merge graph takes fixed-shape inputs: ``block_ids [max_blocks]`` (which
blocks of the landing / cache buffer to gather) and ``encoder_positions
[max_blocks, block_size]`` (the hidden row each gathered row lands in). Every
row that must not land anywhere holds the sentinel ``num_tokens``: the merge
writes it to a dummy row and drops it. Variable placement is therefore data,
never control flow, and one compiled graph serves every step.

This module builds those maps from item placements, remaps them for
sequence-parallel ranks, and proves after the gather that every placeholder
row the scheduler expects is filled exactly once (fail loud: a request never
runs as if an image were absent).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NoReturn

import torch

from common.config import CacheMode
from common.errors import ECLoadFailure, EncoderCacheReadError, LoadFailureReason

logger = logging.getLogger(__name__)

# Padding entries of ``block_ids`` must still name a valid block (the gather
# runs on them); their rows are all sentinel, so any block will do.
PAD_BLOCK_ID = 0


@dataclass(frozen=True, slots=True)
class ItemPlacement:
    """Where one scheduled item's rows are and where they go.

    ``block_ids`` are blocks of the buffer the merge gathers from (the local
    landing blocks or the cache itself); block ``j`` carries real rows
    ``0 .. tokens_per_block[j] - 1`` (the rest is pad, e.g. a video block that
    packs whole frames). The item's tokens, in order, occupy sequence
    positions ``offset .. offset + num_tokens - 1``.
    """

    mm_hash: str
    block_ids: tuple[int, ...]
    tokens_per_block: tuple[int, ...]
    num_tokens: int
    offset: int

    def __post_init__(self) -> None:
        # Accept any int sequence from callers but store immutable tuples.
        object.__setattr__(self, "block_ids", tuple(int(b) for b in self.block_ids))
        object.__setattr__(self, "tokens_per_block", tuple(int(n) for n in self.tokens_per_block))
        if not self.block_ids:
            raise ValueError(f"item {self.mm_hash}: block_ids is empty")
        if len(self.block_ids) != len(self.tokens_per_block):
            raise ValueError(
                f"item {self.mm_hash}: {len(self.block_ids)} block_ids but "
                f"{len(self.tokens_per_block)} tokens_per_block entries"
            )
        if min(self.block_ids) < 0:
            raise ValueError(f"item {self.mm_hash}: negative block id in {self.block_ids}")
        if min(self.tokens_per_block) <= 0:
            raise ValueError(
                f"item {self.mm_hash}: tokens_per_block must be > 0, got {self.tokens_per_block}"
            )
        if sum(self.tokens_per_block) != self.num_tokens:
            raise ValueError(
                f"item {self.mm_hash}: tokens_per_block {self.tokens_per_block} sums to "
                f"{sum(self.tokens_per_block)}, not num_tokens {self.num_tokens}"
            )
        if self.offset < 0:
            raise ValueError(f"item {self.mm_hash}: offset must be >= 0, got {self.offset}")

    @classmethod
    def dense(
        cls, mm_hash: str, block_ids: Sequence[int], num_tokens: int, offset: int, block_size: int
    ) -> ItemPlacement:
        """An item packed densely: token ``i`` in block ``i // block_size``, row ``i % block_size``."""
        if num_tokens <= 0 or block_size <= 0:
            raise ValueError(
                f"item {mm_hash}: num_tokens and block_size must be > 0, got {num_tokens} and {block_size}"
            )
        full, rest = divmod(num_tokens, block_size)
        tokens = [block_size] * full + ([rest] if rest else [])
        return cls(mm_hash, tuple(block_ids), tuple(tokens), num_tokens, offset)


@dataclass(frozen=True, slots=True, eq=False)
class PositionMap:
    """Fixed-shape merge inputs for one step (CPU tensors; the caller moves them)."""

    block_ids: torch.Tensor  # [max_blocks] int64
    encoder_positions: torch.Tensor  # [max_blocks, block_size] int64; sentinel = num_tokens
    owners: tuple[str, ...]  # mm_hash of each used slot, in slot order; the rest is padding
    num_tokens: int  # hidden rows of the step; also the sentinel value

    @property
    def sentinel(self) -> int:
        return self.num_tokens


def build_encoder_positions(
    items: Iterable[ItemPlacement],
    *,
    num_tokens: int,
    max_blocks: int,
    block_size: int,
    window: tuple[int, int] | None = None,
    pad_block_id: int = PAD_BLOCK_ID,
) -> PositionMap:
    """Build ``block_ids`` and ``encoder_positions`` for the items of one step.

    ``window = (start, end)`` is the range of sequence positions scheduled in
    this step (chunked prefill); hidden row ``r`` holds sequence position
    ``start + r``, so a kept row lands at ``position - start`` and every row
    outside the window is sentinel. Default: ``(0, num_tokens)``. Blocks with
    no row in the window are not gathered at all, so a long video cut by a
    chunk costs only the blocks the chunk needs. Raises ``ValueError`` when the
    window does not fit ``num_tokens`` rows, when two items claim the same
    position, or when the items need more than ``max_blocks`` blocks.
    """
    if num_tokens <= 0 or max_blocks <= 0 or block_size <= 0:
        raise ValueError(
            f"num_tokens, max_blocks and block_size must be > 0, "
            f"got {num_tokens}, {max_blocks} and {block_size}"
        )
    start, end = window if window is not None else (0, num_tokens)
    if not 0 <= start <= end or end - start > num_tokens:
        raise ValueError(f"window {(start, end)} does not fit {num_tokens} hidden rows")
    placed = sorted(items, key=lambda item: item.offset)
    for before, after in zip(placed, placed[1:]):
        if before.offset + before.num_tokens > after.offset:
            raise ValueError(
                f"items {before.mm_hash} (positions {before.offset}.."
                f"{before.offset + before.num_tokens - 1}) and {after.mm_hash} "
                f"(from {after.offset}) overlap"
            )

    # (mm_hash, block id, sequence position of row 0, real rows) per block to gather.
    needed: list[tuple[str, int, int, int]] = []
    for item in placed:
        first = item.offset
        for block_id, rows in zip(item.block_ids, item.tokens_per_block):
            if rows > block_size:
                raise ValueError(
                    f"item {item.mm_hash}: block {block_id} carries {rows} rows, "
                    f"more than block_size {block_size}"
                )
            if first < end and first + rows > start:
                needed.append((item.mm_hash, block_id, first, rows))
            first += rows
    if len(needed) > max_blocks:
        raise ValueError(
            f"the scheduled items need {len(needed)} blocks but max_blocks is {max_blocks}"
        )

    block_ids = torch.full((max_blocks,), pad_block_id, dtype=torch.int64)
    positions = torch.full((max_blocks, block_size), num_tokens, dtype=torch.int64)
    row_index = torch.arange(block_size, dtype=torch.int64)
    for slot, (_, block_id, first, rows) in enumerate(needed):
        block_ids[slot] = block_id
        seq = first + row_index[:rows]
        inside = (seq >= start) & (seq < end)
        positions[slot, :rows] = torch.where(inside, seq - start, num_tokens)
    return PositionMap(block_ids, positions, tuple(owner for owner, *_ in needed), num_tokens)


def placeholder_rows(offset: int, length: int, *, window: tuple[int, int]) -> range:
    """Hidden rows of this step that a placeholder run ``[offset, offset + length)`` covers.

    This is the scheduler's side of the post-gather check: it comes from the
    request's placeholders, not from the producer's item metadata.
    """
    start, end = window
    lo, hi = max(offset, start), min(offset + length, end)
    return range(lo - start, max(lo, hi) - start)


def shard_range(rank: int, world_size: int, num_tokens_global: int) -> tuple[int, int]:
    """Global rows ``[start, end)`` that a sequence-parallel rank holds.

    Contiguous shards in rank order. An uneven split follows
    ``torch.tensor_split``: the first ``num_tokens_global % world_size`` ranks
    hold one row more than the others.
    """
    if world_size <= 0 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of size {world_size}")
    if num_tokens_global < 0:
        raise ValueError(f"num_tokens_global must be >= 0, got {num_tokens_global}")
    base, extra = divmod(num_tokens_global, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def remap_to_range(positions: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Shift positions into the local shard ``[start, end)``; everything else -> local sentinel.

    Pure tensor ops with no data-dependent control flow, so it also runs
    inside a compiled graph. The global sentinel lies outside every shard and
    becomes the local one.
    """
    if not 0 <= start <= end:
        raise ValueError(f"local range {(start, end)} is not a range")
    inside = (positions >= start) & (positions < end)
    return torch.where(inside, positions - start, end - start)


def global_to_local_positions(
    positions: torch.Tensor, rank: int, world_size: int, num_tokens_global: int
) -> torch.Tensor:
    """Remap a global position map to ``rank``'s shard (see :func:`shard_range`)."""
    start, end = shard_range(rank, world_size, num_tokens_global)
    return remap_to_range(positions, start, end)


def _fail(mode: CacheMode, mm_hash: str, *, expected: object, got: object, detail: str) -> NoReturn:
    logger.warning("encoder rows for %s not filled: %s", mm_hash, detail)
    if mode is CacheMode.EPD:
        raise ECLoadFailure(
            LoadFailureReason.TOKEN_COUNT, mm_hash, expected=expected, got=got, detail=detail
        )
    raise EncoderCacheReadError(
        f"encoder cache read for mm_hash {mm_hash}: expected {expected}, got {got}: {detail}"
    )


def check_num_tokens(mm_hash: str, stored: int, placeholder_count: int, mode: CacheMode) -> None:
    """Raise when an item's stored token count differs from its placeholder count."""
    if stored != placeholder_count:
        _fail(
            mode, mm_hash, expected=placeholder_count, got=stored,
            detail="stored token count differs from the request's placeholder count",
        )


def check_filled(
    encoder_positions: torch.Tensor,
    expected: Mapping[str, Iterable[int]] | Iterable[tuple[str, Iterable[int]]],
    *,
    num_tokens: int,
    mode: CacheMode,
    owners: Sequence[str] = (),
) -> None:
    """Prove that the map fills every expected row exactly once and nothing else.

    ``expected`` gives, per mm_hash, the hidden rows the scheduler expects to
    be filled by encoder rows (see :func:`placeholder_rows`). A row missing or
    filled twice, or a row filled that no item expects (it would overwrite a
    text token), raises ``ECLoadFailure(TOKEN_COUNT)`` in EPD mode or
    ``EncoderCacheReadError`` in monolithic mode, naming the item. ``owners``
    (``PositionMap.owners``) lets a stray row be named by the item it came
    from. Values outside ``[0, num_tokens]`` are a malformed map: ValueError.
    """
    flat = encoder_positions.reshape(-1).to("cpu", torch.int64)
    if flat.numel():
        low, high = int(flat.min()), int(flat.max())
        if low < 0 or high > num_tokens:
            raise ValueError(
                f"encoder position {low if low < 0 else high} is outside [0, {num_tokens}]"
            )
    counts = torch.bincount(flat, minlength=num_tokens + 1)[:num_tokens]
    claimed = torch.zeros(num_tokens, dtype=torch.bool)
    pairs = expected.items() if isinstance(expected, Mapping) else expected
    for mm_hash, given in pairs:
        # Materialize once: a generator would be spent before the message names it.
        rows = given if isinstance(given, Sequence) else list(given)
        idx = torch.as_tensor(list(rows), dtype=torch.int64)
        if idx.numel() == 0:
            continue
        if int(idx.min()) < 0 or int(idx.max()) >= num_tokens:
            raise ValueError(f"item {mm_hash}: expected rows {rows} fall outside [0, {num_tokens})")
        if bool(claimed[idx].any()) or int(torch.bincount(idx).max()) > 1:
            raise ValueError(f"item {mm_hash}: expected rows {rows} are claimed twice")
        claimed[idx] = True
        got = counts[idx]
        bad = got != 1
        if bool(bad.any()):
            _fail(
                mode, mm_hash, expected=idx.numel(), got=int((~bad).sum()),
                detail=(
                    f"{int((got == 0).sum())} placeholder rows unfilled, "
                    f"{int((got > 1).sum())} filled more than once "
                    f"(first bad row {int(idx[bad][0])})"
                ),
            )
    stray = (counts > 0) & ~claimed
    if bool(stray.any()):
        row = int(stray.nonzero()[0, 0])
        slot = int((encoder_positions.reshape(encoder_positions.shape[0], -1).cpu() == row)
                   .any(dim=1).nonzero()[0, 0])
        owner = owners[slot] if slot < len(owners) else f"<block slot {slot}>"
        _fail(
            mode, owner, expected="placeholder rows only", got=f"row {row}",
            detail=f"{int(stray.sum())} rows written outside every placeholder of this step",
        )
