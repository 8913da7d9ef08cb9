"""Block allocator for the encoder's cache buffer (encoder process).

``EncoderCacheBlocks`` owns ``buffer [num_blocks, block_size, fat_dim]`` and
``stamps int64[num_blocks, 2]`` (per block its tag, then its generation; the
views ``mm_hash_tags`` and ``block_generations``), allocated once; the last
block is scratch and never allocated. A usable block is *active* (owned by an
item), *held* or *free*::

    free --allocate--> active --free/evict--> held --min_hold passed--> free

- ``allocate`` stamps the tag (``mm_hash_fingerprint``) and a fresh generation
  (one global counter, bumped per allocation) on every block before it
  returns, so the encoder's write always follows the stamp and a consumer
  that reads data, then tags, proves what it read. Tags and generations are
  left in place when blocks are freed: the data stays valid until the block
  is re-allocated, which restamps it, so zeroing would cost work for nothing.
- A freed block is held until ``min_hold`` has passed since the later of the
  item's write and the last time its location was handed out (``acquire``).
  An item freed before it was written was never handed out: its blocks go
  straight back to the free queue.
- A lease pins one allocation and carries its location, taken under the
  lock: callers build answers from the lease, never from the slot map, which
  may name a newer allocation of the same ``mm_hash`` by then. A *pending*
  lease (taken by a request still running) does not expire until
  :meth:`start_lease` hands its location out; only then does the ttl run.
- Items under a live lease are pinned and never evicted; ``free`` only marks
  them (``contains`` turns false, no new lease) and their blocks leave when
  the last lease ends or expires. Only written, unpinned items are evictable:
  an unwritten item belongs to the encoder run writing it.
- Leases expire and held blocks become free lazily, inside every call.

Invariant after every call: ``active + free + held == num_blocks - 1``. One
lock guards all state (the gRPC service calls from several threads). Work is
O(1) per block touched plus O(log n) per item entering a heap.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

import torch

from common.errors import ConfigError
from common.fingerprint import cached_fingerprint
from common.layout import CacheLayout
from encoder_server.block_pool import BlockId, BlockPool
from encoder_server.cache_records import (
    CacheOccupancy,
    SlotEntry,
    check_block_count,
    check_tokens_per_block,
)
from encoder_server.cache_regions import DeviceStamper, TensorAllocator, allocate_regions
from encoder_server.leases import Lease, LeaseStats, LeaseTable

logger = logging.getLogger(__name__)

__all__ = [
    "BlockId", "CacheOccupancy", "EncoderCacheBlocks", "Lease", "LeaseStats", "SlotEntry",
    "TensorAllocator",
]

# Float seconds cannot hold "write + 100 ms" exactly; see __init__.
_HOLD_SLACK_S = 1e-9
# A pending lease ends at this ceiling even if its request never hands it out: a
# backstop only, the engine bounds every request far below it.
DEFAULT_PENDING_LEASE_TTL_MS = 600_000



class EncoderCacheBlocks:
    """Slot map, LRU, leases and block states over one cache buffer."""

    def __init__(
        self,
        layout: CacheLayout,
        min_hold_time_ms: int,
        *,
        lease_ttl_ms: int = 30_000,
        pending_lease_ttl_ms: int = DEFAULT_PENDING_LEASE_TTL_MS,
        clock: Callable[[], float] = time.monotonic,
        device: str | torch.device = "cpu",
        allocator: TensorAllocator | None = None,
    ) -> None:
        for name, value, low in (
            ("min_hold_time_ms", min_hold_time_ms, 0),
            ("lease_ttl_ms", lease_ttl_ms, 1),
            ("pending_lease_ttl_ms", pending_lease_ttl_ms, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{name} must be an int >= {low}, got {value!r}")
        self.layout = layout
        self.buffer, self.stamps = allocate_regions(layout, device, allocator)
        # Views of the stamp region: per block, its tag and its generation.
        self.mm_hash_tags, self.block_generations = self.stamps[:, 0], self.stamps[:, 1]
        self._stamper = DeviceStamper(self.stamps)
        self._min_hold_time_ms = min_hold_time_ms
        self._lease_ttl_ms = lease_ttl_ms
        # One nanosecond short of the hold: clock readings are float seconds,
        # and without the slack "write + 0.1 s" can round just past the reading
        # taken exactly 100 ms later. A block is never reusable earlier than that.
        self._hold_s = max(0.0, min_hold_time_ms / 1000.0 - _HOLD_SLACK_S)
        self._clock = clock
        self._lock = threading.Lock()
        self._usable = layout.num_usable_blocks
        self._block_size = layout.block_size
        self._pool = BlockPool(self._usable)
        self._slots: dict[str, SlotEntry] = {}
        # Evictable items only (present, written, unpinned), least recently used first.
        self._lru: OrderedDict[str, SlotEntry] = OrderedDict()
        self._evictable_blocks = 0
        self._num_active = 0
        self._active_tokens = 0
        self._num_pinned = 0
        self._generation = 0
        self._leases: LeaseTable[SlotEntry] = LeaseTable(
            lease_ttl_ms / 1000.0, max(lease_ttl_ms, pending_lease_ttl_ms) / 1000.0)
        # Earliest clock time a lease may expire or a held block become free:
        # every call compares the clock against this one number.
        self._next_due = math.inf

    @property
    def min_hold_time_ms(self) -> int:
        return self._min_hold_time_ms

    @property
    def lease_ttl_ms(self) -> int:
        return self._lease_ttl_ms

    # ------------------------------------------------------------ allocation
    def allocate(self, mm_hash: str, tokens_per_block: Sequence[int]) -> list[BlockId] | None:
        """Fresh stamped blocks for an absent ``mm_hash``; ``None`` if no room now.

        Never waits and never evicts: on ``None`` the caller evicts
        (:meth:`evict_lru`) or answers with :meth:`next_reusable_in_ms`.
        A present ``mm_hash`` is a ``ValueError``, never its live blocks: the
        caller writes what it is given, and nothing may write an item's blocks
        again until they are re-allocated (readers may hold their location,
        and an eviction mid-write would hand them to another item).
        """
        counts = check_tokens_per_block(tokens_per_block, self._usable, self._block_size)
        # Memoized: an evicted item that comes back is re-allocated under the same
        # mm_hash, and BLAKE2b is the largest single cost of an allocate on the CPU.
        fingerprint = cached_fingerprint(mm_hash)
        with self._lock:
            now = self._clock()
            if now >= self._next_due:
                self._catch_up(now)
            entry = self._slots.get(mm_hash)
            if entry is not None:
                state = "written" if entry.write_time is not None else "being written"
                raise ValueError(
                    f"mm_hash {mm_hash!r} is already in the encoder cache ({state}, tokens_per_block "
                    f"{entry.tokens_per_block}); allocate asked for {counts}"
                )
            block_ids = self._pool.take(len(counts))
            if block_ids is None:
                return None
            self._generation += 1
            self._stamper.stamp(block_ids, fingerprint, self._generation)
            num_tokens = sum(counts)
            self._slots[mm_hash] = SlotEntry(mm_hash, block_ids, counts, num_tokens, self._generation)
            self._num_active += len(block_ids)
            self._active_tokens += num_tokens
            return block_ids.copy()

    def mark_written(self, mm_hash: str) -> None:
        """The encoder finished writing ``mm_hash``: starts its hold clock, makes it evictable."""
        with self._lock:
            now = self._now()
            entry = self._present(mm_hash)
            entry.write_time = now
            if mm_hash in self._lru:
                self._lru.move_to_end(mm_hash)
            elif entry.pins == 0:
                self._lru[mm_hash] = entry
                self._evictable_blocks += len(entry.block_ids)

    # ---------------------------------------------------------------- lookups
    def contains(self, mm_hash: str) -> bool:
        """Present: allocated and not freed (possibly not written yet)."""
        with self._lock:
            self._now()
            return mm_hash in self._slots

    def absent(self, mm_hashes: Iterable[str]) -> list[str]:
        """Those of ``mm_hashes`` that are not present, under one lock for all of them."""
        with self._lock:
            self._now()
            slots = self._slots
            return [h for h in mm_hashes if h not in slots]

    def is_written(self, mm_hash: str) -> bool:
        with self._lock:
            self._now()
            entry = self._slots.get(mm_hash)
            return entry is not None and entry.write_time is not None

    def get_block_ids(self, mm_hash: str) -> list[BlockId]:
        with self._lock:
            return self._present(mm_hash).block_ids.copy()

    def get_num_tokens(self, mm_hash: str) -> int:
        with self._lock:
            return self._present(mm_hash).num_tokens

    def get_tokens_per_block(self, mm_hash: str) -> list[int]:
        with self._lock:
            return self._present(mm_hash).tokens_per_block.copy()

    def get_generation(self, mm_hash: str) -> int:
        with self._lock:
            return self._present(mm_hash).generation

    def touch(self, mm_hash: str) -> None:
        """LRU bump on a hit; absent, unwritten or pinned items are left as they are."""
        with self._lock:
            if mm_hash in self._lru:
                self._lru.move_to_end(mm_hash)

    # ----------------------------------------------------------------- leases
    def acquire(self, mm_hash: str, owner: str = "", *, pending: bool = False) -> Lease | None:
        """Pin a present, written item and restart its hold clock; ``None`` otherwise.

        The lease carries the allocation's location. ``pending``: the caller
        hands the location out later; the ttl starts then (:meth:`start_lease`).
        """
        with self._lock:
            now = self._now()
            entry = self._slots.get(mm_hash)
            if entry is None or entry.write_time is None:
                return None
            lease = self._leases.grant(entry, mm_hash, owner, now, entry.allocation, pending=pending)
            self._next_due = min(self._next_due, lease.expires_at)
            entry.last_acquire = now
            if entry.pins == 0:
                self._num_pinned += 1
                del self._lru[mm_hash]
                self._evictable_blocks -= len(entry.block_ids)
            entry.pins += 1
            return lease

    def start_lease(self, lease_id: int) -> Lease | None:
        """The location of a lease is being handed out: its ttl runs from now; ``None`` if it ended.

        Also restarts the hold clock of the pinned allocation (a block is reused
        only ``min_hold`` after the last time its location went out).
        """
        with self._lock:
            now = self._now()
            lease = self._leases.start(lease_id, now)
            if lease is None:
                return None
            self._next_due = min(self._next_due, lease.expires_at)
            entry = self._leases.payload(lease_id)
            entry.last_acquire = now
            return lease

    def release(self, lease_id: int, owner: str | None = None) -> bool:
        """End a lease; ``False`` (counted as rejected) if unknown, expired or not ``owner``'s."""
        with self._lock:
            now = self._now()
            entry = self._leases.release(lease_id, owner, now)
            if entry is None:
                return False
            self._unpin(entry, now)
            return True

    def reap_expired_leases(self) -> int:
        """Expire every lease past its time; returns how many (also done inside every call)."""
        with self._lock:
            before = self._leases.stats().expired
            self._catch_up(self._clock())
            return self._leases.stats().expired - before

    # ------------------------------------------------------ freeing, eviction
    def free(self, mm_hash: str) -> int:
        """Drop ``mm_hash``; returns its block count (0 if absent) for the evictions counter.

        A pinned item is only marked and counted now; its blocks follow when
        its last lease ends.
        """
        with self._lock:
            now = self._clock()
            if now >= self._next_due:
                self._catch_up(now)
            entry = self._slots.pop(mm_hash, None)
            if entry is None:
                return 0
            n = len(entry.block_ids)
            if self._lru.pop(mm_hash, None) is not None:
                self._evictable_blocks -= n
            if entry.pins:
                entry.doomed = True
            else:
                self._release_blocks(entry, now)
            return n

    def reclaim_held(self) -> int:
        """Move every held block whose hold has passed to the free queue; returns how many."""
        with self._lock:
            return self._catch_up(self._clock())

    def evict_lru(self, num_blocks_needed: int) -> list[str]:
        """Free LRU evictable items until ``num_blocks_needed`` blocks are free or held.

        All or nothing: if evicting everything evictable would still fall
        short, nothing is evicted (the cache is not emptied for a request that
        fails anyway). Returns the freed mm_hashes, least recent first.
        """
        return self.evict_lru_counted(num_blocks_needed)[0]

    def evict_lru_counted(self, num_blocks_needed: int) -> tuple[list[str], int]:
        """:meth:`evict_lru` plus the number of blocks evicted."""
        needed = check_block_count(num_blocks_needed, "num_blocks_needed", self._usable)
        with self._lock:
            now = self._now()
            have = self._pool.num_free + self._pool.num_held
            if have >= needed or have + self._evictable_blocks < needed:
                return [], 0
            evicted: list[str] = []
            start = have
            while have < needed:
                mm_hash, entry = self._lru.popitem(last=False)
                del self._slots[mm_hash]
                self._evictable_blocks -= len(entry.block_ids)
                self._release_blocks(entry, now)
                have += len(entry.block_ids)
                evicted.append(mm_hash)
            logger.debug("evicted %d items (%d blocks) for %d needed", len(evicted), have - start, needed)
            return evicted, have - start

    def can_admit(self, block_counts: Sequence[int]) -> bool:
        """Would items of these block counts fit, in whole blocks, after evicting what is evictable?

        Counts free, held (free again within ``min_hold``) and evictable
        blocks. Acquire the request's hits first so they are not counted as
        evictable.
        """
        total = sum(
            check_block_count(c, f"block_counts[{i}]", self._usable) for i, c in enumerate(block_counts)
        )
        with self._lock:
            self._now()
            return total <= self._pool.num_free + self._pool.num_held + self._evictable_blocks

    def next_reusable_in_ms(self) -> int | None:
        """Milliseconds until the earliest held block becomes free; ``None`` if none is held."""
        with self._lock:
            now = self._now()
            release_at = self._pool.next_release
            if release_at == math.inf:
                return None
            return max(0, math.ceil((release_at - now) * 1000.0))

    # -------------------------------------------------------------- occupancy
    def occupancy(self) -> CacheOccupancy:
        with self._lock:
            self._now()
            return CacheOccupancy(
                self._num_active, self._pool.num_free, self._pool.num_held,
                self._active_tokens, self._num_pinned, len(self._slots),
            )

    @property
    def num_active_blocks(self) -> int:
        return self.occupancy().active_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.occupancy().free_blocks

    @property
    def num_held_blocks(self) -> int:
        return self.occupancy().held_blocks

    @property
    def num_active_real_tokens(self) -> int:
        return self.occupancy().active_real_tokens

    @property
    def num_pinned_items(self) -> int:
        return self.occupancy().pinned_items

    @property
    def num_items(self) -> int:
        return self.occupancy().items

    @property
    def lease_stats(self) -> LeaseStats:
        with self._lock:
            self._now()
            return self._leases.stats()

    # --------------------------------------------------------------- internal
    # Everything below runs with self._lock held.
    def _now(self) -> float:
        now = self._clock()
        if now >= self._next_due:
            self._catch_up(now)
        return now

    def _present(self, mm_hash: str) -> SlotEntry:
        entry = self._slots.get(mm_hash)
        if entry is None:
            raise ValueError(f"mm_hash {mm_hash!r} is not in the encoder cache")
        return entry

    def _catch_up(self, now: float) -> int:
        """Expire due leases, then free due held blocks; returns blocks moved to free."""
        for entry in self._leases.reap(now):
            self._unpin(entry, now)
        moved = self._pool.reclaim(now)
        self._next_due = min(self._leases.next_expiry, self._pool.next_release)
        return moved

    def _unpin(self, entry: SlotEntry, now: float) -> None:
        entry.pins -= 1
        if entry.pins:
            return
        self._num_pinned -= 1
        if entry.doomed:
            self._release_blocks(entry, now)
        elif self._slots.get(entry.mm_hash) is entry:
            # Its last use was a lease: back in at the most recent end.
            self._lru[entry.mm_hash] = entry
            self._evictable_blocks += len(entry.block_ids)

    def _release_blocks(self, entry: SlotEntry, now: float) -> None:
        self._num_active -= len(entry.block_ids)
        self._active_tokens -= entry.num_tokens
        if entry.write_time is None:
            release_at = -math.inf  # never written, never handed out: nothing to protect
        elif entry.last_acquire is not None and entry.last_acquire > entry.write_time:
            release_at = entry.last_acquire + self._hold_s
        else:
            release_at = entry.write_time + self._hold_s
        if self._pool.give(entry.block_ids, release_at, now) and release_at < self._next_due:
            self._next_due = release_at
