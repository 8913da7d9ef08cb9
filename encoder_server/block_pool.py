"""Free queue and hold heap of the cache blocks no item owns (encoder process).

A block that leaves an item is either reusable at once (its hold has passed,
or it was never handed out) and joins the back of the free queue, or it waits
in a min-heap keyed by the clock time its hold ends. :meth:`BlockPool.reclaim`
moves every due group to the free queue: O(log n) per freed item, O(1) per
block. The queue is FIFO so reuse spreads over the whole cache instead of
recycling the most recently freed block at once.

Not thread-safe on its own: :class:`~encoder_server.cache_blocks.EncoderCacheBlocks`
calls it under its lock.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Sequence

BlockId = int


class BlockPool:
    """Blocks in the *free* and *held* states; all others are active (owned by an item)."""

    __slots__ = ("_free", "_held", "_seq", "_num_held")

    def __init__(self, num_usable_blocks: int) -> None:
        if num_usable_blocks < 1:
            raise ValueError(f"num_usable_blocks must be >= 1, got {num_usable_blocks}")
        self._free: deque[BlockId] = deque(range(num_usable_blocks))
        # (release_at, tie-break sequence, blocks): the sequence keeps equal
        # release times in freeing order and never compares the lists.
        self._held: list[tuple[float, int, Sequence[BlockId]]] = []
        self._seq = itertools.count()
        self._num_held = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_held(self) -> int:
        return self._num_held

    @property
    def next_release(self) -> float:
        """Clock time the earliest held group becomes free; ``inf`` when nothing is held."""
        return self._held[0][0] if self._held else math.inf

    def take(self, n: int) -> list[BlockId] | None:
        """``n`` blocks from the front of the free queue, or ``None`` if fewer are free."""
        free = self._free
        if len(free) < n:
            return None
        if n == 1:
            return [free.popleft()]
        return [free.popleft() for _ in range(n)]

    def give(self, block_ids: Sequence[BlockId], release_at: float, now: float) -> bool:
        """Return blocks; free at once if ``release_at <= now``, else held. True if held."""
        if release_at <= now:
            self._free.extend(block_ids)
            return False
        heapq.heappush(self._held, (release_at, next(self._seq), block_ids))
        self._num_held += len(block_ids)
        return True

    def reclaim(self, now: float) -> int:
        """Move every held group with ``release_at <= now`` to the free queue; returns blocks moved."""
        held, free = self._held, self._free
        moved = 0
        while held and held[0][0] <= now:
            block_ids = heapq.heappop(held)[2]
            free.extend(block_ids)
            moved += len(block_ids)
        self._num_held -= moved
        return moved
