"""What one cache allocation is, and what a valid request for one looks like (encoder process).

:class:`SlotEntry` is the allocator's per-item record (slotted: there is one per
cached item). The checks turn caller input into plain ints and raise
``ValueError`` naming the offending value.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

from encoder_server.block_pool import BlockId


@dataclass(frozen=True, slots=True)
class Allocation:
    """Where one allocation's rows live, as a lease pins it: never re-read from the slot map.

    The slot map can name a newer allocation of the same ``mm_hash`` (evicted,
    then re-allocated and stamped but not yet written): a location built from
    it would point at unwritten blocks whose tags already verify.
    """

    block_ids: tuple[BlockId, ...]
    tokens_per_block: tuple[int, ...]
    num_tokens: int
    generation: int


@dataclass(slots=True, eq=False)
class SlotEntry:
    """One allocation: in the slot map while present, alive until its last lease ends."""

    mm_hash: str
    block_ids: list[BlockId]
    tokens_per_block: list[int]
    num_tokens: int
    generation: int
    write_time: float | None = None
    last_acquire: float | None = None
    pins: int = 0
    doomed: bool = False  # freed while pinned: blocks go when the last lease ends
    # Built once: the location never changes while the entry lives, and every lease on it carries it.
    allocation: Allocation = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.allocation = Allocation(
            tuple(self.block_ids), tuple(self.tokens_per_block), self.num_tokens, self.generation)


@dataclass(frozen=True, slots=True)
class CacheOccupancy:
    """One consistent snapshot of the occupancy gauges."""

    active_blocks: int
    free_blocks: int
    held_blocks: int
    active_real_tokens: int
    pinned_items: int
    items: int


def check_tokens_per_block(tokens_per_block: Sequence[int], usable: int, block_size: int) -> list[int]:
    """Validated per-block real-token counts of one item, as a new list of ints."""
    counts = list(tokens_per_block)
    # Fast path, one pass: plain ints in range (allocate is on the request path).
    if 0 < len(counts) <= usable:
        for c in counts:
            if type(c) is not int or not 0 < c <= block_size:
                break
        else:
            return counts
    counts = [_as_int(c, f"tokens_per_block[{i}]") for i, c in enumerate(counts)]
    if not counts:
        raise ValueError("tokens_per_block is empty: an item needs at least one block")
    if len(counts) > usable:
        raise ValueError(
            f"tokens_per_block names {len(counts)} blocks, more than the cache's "
            f"{usable} usable blocks"
        )
    for i, c in enumerate(counts):
        if not 0 < c <= block_size:
            raise ValueError(f"tokens_per_block[{i}] = {c} is outside 1..{block_size}")
    return counts


def check_block_count(value: int, name: str, usable: int) -> int:
    """A block count in ``0..usable``."""
    count = _as_int(value, name)
    if count < 0 or count > usable:
        raise ValueError(f"{name} = {count} is outside 0..{usable} (usable blocks)")
    return count


def _as_int(value: object, name: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
