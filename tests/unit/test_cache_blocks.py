"""Unit tests of the encoder's block allocator, on an injected clock (no sleeps)."""

from __future__ import annotations

import random
import sys
import threading
import time

import numpy as np
import pytest
import torch

from common.errors import ConfigError
from common.fingerprint import mm_hash_fingerprint
from common.layout import CacheLayout
from encoder_server.block_pool import BlockPool
from encoder_server.cache_blocks import CacheOccupancy, EncoderCacheBlocks, Lease, SlotEntry
from encoder_server.cache_records import Allocation
from encoder_server.leases import LeaseStats, LeaseTable

BLOCK = 4
ONE_BLOCK = Allocation((0,), (1,), 1, 1)


class FakeClock:
    """Seconds, advanced by hand."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance_ms(self, ms: float) -> None:
        self.now += ms / 1000.0


def make(num_blocks: int = 9, hold_ms: int = 100, ttl_ms: int = 1000, **kw):
    clock = FakeClock()
    layout = CacheLayout(num_blocks=num_blocks, block_size=BLOCK, out_hidden_size=2,
                         num_deepstack_levels=1, dtype=torch.float32)
    return EncoderCacheBlocks(layout, hold_ms, lease_ttl_ms=ttl_ms, clock=clock, **kw), clock


def occ(cache: EncoderCacheBlocks) -> tuple[int, int, int]:
    o = cache.occupancy()
    assert o.active_blocks + o.free_blocks + o.held_blocks == cache.layout.num_blocks - 1
    return o.active_blocks, o.free_blocks, o.held_blocks


# ------------------------------------------------------------------ construction
def test_regions_shapes_dtypes_and_initial_state() -> None:
    cache, _ = make(num_blocks=5)
    assert cache.buffer.shape == (5, BLOCK, 4) and cache.buffer.dtype == torch.float32
    assert cache.mm_hash_tags.shape == (5,) and cache.mm_hash_tags.dtype == torch.int64
    assert cache.block_generations.shape == (5,) and cache.block_generations.dtype == torch.int64
    assert torch.equal(cache.mm_hash_tags, torch.zeros(5, dtype=torch.int64))
    assert cache.min_hold_time_ms == 100 and cache.lease_ttl_ms == 1000
    assert occ(cache) == (0, 4, 0)
    assert cache.num_items == 0 and cache.num_pinned_items == 0 and cache.num_active_real_tokens == 0


@pytest.mark.parametrize(("hold", "ttl"), [(-1, 10), (0, 0), (1.5, 10), (True, 10), (0, -5)])
def test_bad_config_is_rejected_naming_the_value(hold, ttl) -> None:
    layout = CacheLayout(num_blocks=3, block_size=BLOCK, out_hidden_size=2)
    with pytest.raises(ConfigError, match=repr(hold) if hold != 0 else repr(ttl)):
        EncoderCacheBlocks(layout, hold, lease_ttl_ms=ttl)


def test_custom_allocator_places_every_region_and_tags_are_zeroed() -> None:
    calls: list[tuple[tuple[int, ...], torch.dtype]] = []

    def alloc(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        calls.append((shape, dtype))
        return torch.full(shape, 7, dtype=dtype)  # not zeroed on purpose

    cache, _ = make(num_blocks=3, allocator=alloc)
    assert calls == [((3, BLOCK, 4), torch.float32), ((3, 2), torch.int64)]
    assert torch.equal(cache.stamps, torch.zeros(3, 2, dtype=torch.int64))
    # Stamps land in the allocator's memory, not in a copy: tag and generation side by side.
    ids = cache.allocate("a", [1])
    assert ids is not None and cache.stamps[ids[0]].tolist() == [mm_hash_fingerprint("a"), cache.get_generation("a")]
    assert cache.mm_hash_tags.data_ptr() == cache.stamps.data_ptr()
    assert cache.block_generations.data_ptr() == cache.stamps.data_ptr() + 8


def test_allocator_returning_wrong_shape_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"shape \(2,\)"):
        make(num_blocks=3, allocator=lambda shape, dtype: torch.zeros((2,), dtype=dtype))


# ---------------------------------------------------------------------- allocate
def test_allocate_stamps_tag_and_generation_before_returning() -> None:
    cache, _ = make()
    ids = cache.allocate("video", [4, 4, 1])
    assert ids is not None and len(ids) == 3 and len(set(ids)) == 3
    fp = mm_hash_fingerprint("video")
    gen = cache.get_generation("video")
    assert gen >= 1
    idx = torch.tensor(ids)
    assert torch.equal(cache.mm_hash_tags[idx], torch.full((3,), fp, dtype=torch.int64))
    assert torch.equal(cache.block_generations[idx], torch.full((3,), gen, dtype=torch.int64))
    assert cache.get_block_ids("video") == ids
    assert cache.get_tokens_per_block("video") == [4, 4, 1]
    assert cache.get_num_tokens("video") == 9
    assert cache.contains("video") and not cache.is_written("video")
    assert occ(cache) == (3, 5, 0)
    assert cache.num_active_real_tokens == 9 and cache.num_items == 1


def test_allocate_never_hands_out_the_scratch_block_and_returns_none_when_full() -> None:
    cache, _ = make(num_blocks=5)
    got = [cache.allocate(f"i{n}", [1]) for n in range(4)]
    assert sorted(b for ids in got for b in ids) == [0, 1, 2, 3]  # 4 = scratch
    assert cache.allocate("one-more", [1]) is None
    assert cache.allocate("two-more", [1, 1]) is None
    assert not cache.contains("one-more")
    assert occ(cache) == (4, 0, 0)


def test_allocate_refuses_a_present_item_and_leaves_it_as_it_was() -> None:
    cache, _ = make()
    ids = cache.allocate("a", [3, 2])
    gen = cache.get_generation("a")
    with pytest.raises(ValueError, match=r"'a' is already in the encoder cache \(being written, "
                                         r"tokens_per_block \[3, 2\]\); allocate asked for \[3, 2\]"):
        cache.allocate("a", [3, 2])
    cache.mark_written("a")
    with pytest.raises(ValueError, match=r"'a' is already in the encoder cache \(written, .*\[3\]"):
        cache.allocate("a", [3])
    assert cache.get_block_ids("a") == ids and cache.get_generation("a") == gen
    assert occ(cache) == (2, 6, 0)
    assert cache.allocate("b", [1]) is not None


def test_reallocating_the_same_hash_gets_a_new_generation() -> None:
    cache, _ = make(num_blocks=2, hold_ms=0)  # one usable block: same block again
    ids1 = cache.allocate("a", [1])
    gen1 = cache.get_generation("a")
    cache.mark_written("a")
    assert cache.free("a") == 1
    ids2 = cache.allocate("a", [1])
    assert ids1 == ids2 == [0]
    assert cache.get_generation("a") > gen1
    assert int(cache.block_generations[0]) == cache.get_generation("a")


@pytest.mark.parametrize(
    ("tpb", "match"),
    [
        ([], "empty"),
        ([1] * 9, "9 blocks"),
        ([-3], "-3"),
        ([0], r"\[0\] = 0"),
        ([4, 5], r"\[1\] = 5"),
        ([2.0], "2.0"),
        ([True], "True"),
        (["4"], "'4'"),
    ],
)
def test_allocate_rejects_bad_tokens_per_block_naming_the_value(tpb, match) -> None:
    cache, _ = make()
    with pytest.raises(ValueError, match=match):
        cache.allocate("a", tpb)
    assert occ(cache) == (0, 8, 0) and cache.num_items == 0


def test_allocate_accepts_numpy_counts_and_rejects_bad_hash() -> None:
    cache, _ = make()
    ids = cache.allocate("a", np.array([4, 2]))
    assert ids is not None and cache.get_tokens_per_block("a") == [4, 2]
    assert all(type(c) is int for c in cache.get_tokens_per_block("a"))
    with pytest.raises(ValueError, match="''"):
        cache.allocate("", [1])


def test_returned_lists_are_copies() -> None:
    cache, _ = make()
    ids = cache.allocate("a", [1, 1])
    assert ids is not None
    ids.append(99)
    cache.get_block_ids("a").append(98)
    cache.get_tokens_per_block("a").append(97)
    assert len(cache.get_block_ids("a")) == 2 and cache.get_tokens_per_block("a") == [1, 1]


# ------------------------------------------------------------- written / lookups
def test_mark_written_and_lookups_on_unknown_items() -> None:
    cache, _ = make()
    with pytest.raises(ValueError, match="'ghost'"):
        cache.mark_written("ghost")
    for getter in (cache.get_block_ids, cache.get_num_tokens, cache.get_tokens_per_block,
                   cache.get_generation):
        with pytest.raises(ValueError, match="'ghost'"):
            getter("ghost")
    assert not cache.contains("ghost") and not cache.is_written("ghost")
    cache.allocate("a", [1])
    cache.mark_written("a")
    assert cache.is_written("a")


# ---------------------------------------------------------------- free and hold
def test_unwritten_item_is_freed_straight_to_free() -> None:
    cache, _ = make()
    cache.allocate("a", [1, 1])
    assert cache.free("a") == 2
    assert occ(cache) == (0, 8, 0) and not cache.contains("a")
    assert cache.next_reusable_in_ms() is None


def test_written_item_is_held_until_min_hold_after_the_write() -> None:
    cache, clock = make(num_blocks=3, hold_ms=100)
    ids = cache.allocate("a", [1, 1])
    cache.mark_written("a")
    clock.advance_ms(40)
    assert cache.free("a") == 2
    assert occ(cache) == (0, 0, 2) and cache.num_active_real_tokens == 0
    assert cache.next_reusable_in_ms() == 60
    assert cache.allocate("b", [1]) is None  # never waits
    clock.advance_ms(59)
    assert cache.reclaim_held() == 0 and cache.allocate("b", [1]) is None
    clock.advance_ms(1)  # exactly write + hold
    assert cache.allocate("b", [1]) == [ids[0]]
    assert occ(cache) == (1, 1, 0)


def test_hold_counts_from_the_last_acquire_when_later_than_the_write() -> None:
    cache, clock = make(num_blocks=2, hold_ms=100)
    cache.allocate("a", [1])
    cache.mark_written("a")
    clock.advance_ms(500)
    lease = cache.acquire("a")
    assert lease is not None and cache.release(lease.lease_id)
    clock.advance_ms(30)
    cache.free("a")
    assert occ(cache) == (0, 0, 1)
    assert cache.next_reusable_in_ms() == 70
    clock.advance_ms(69)
    assert cache.allocate("b", [1]) is None
    clock.advance_ms(1)
    assert cache.reclaim_held() == 1 and occ(cache) == (0, 1, 0)


def test_hold_already_passed_goes_straight_to_free() -> None:
    cache, clock = make(hold_ms=100)
    cache.allocate("a", [1])
    cache.mark_written("a")
    clock.advance_ms(100)
    cache.free("a")
    assert occ(cache) == (0, 8, 0)


def test_free_of_unknown_item_is_a_noop_returning_zero() -> None:
    cache, _ = make()
    assert cache.free("ghost") == 0
    cache.allocate("a", [1])
    assert cache.free("a") == 1 and cache.free("a") == 0
    assert occ(cache) == (0, 8, 0)


def test_held_groups_are_released_in_release_time_order_not_free_order() -> None:
    cache, clock = make(num_blocks=3, hold_ms=100)
    cache.allocate("old", [1])
    cache.mark_written("old")
    cache.allocate("new", [1])
    clock.advance_ms(90)
    cache.mark_written("new")
    cache.free("new")  # freed first but released at t=190
    cache.free("old")  # released at t=100
    assert occ(cache) == (0, 0, 2) and cache.next_reusable_in_ms() == 10
    clock.advance_ms(10)
    assert cache.reclaim_held() == 1 and occ(cache) == (0, 1, 1)
    assert cache.next_reusable_in_ms() == 90


# ----------------------------------------------------------------------- leases
def test_acquire_requires_a_present_written_item() -> None:
    cache, clock = make()
    assert cache.acquire("ghost") is None
    cache.allocate("a", [2])
    assert cache.acquire("a") is None  # not written yet
    cache.mark_written("a")
    lease = cache.acquire("a", owner="p1")
    assert isinstance(lease, Lease)
    assert lease.mm_hash == "a" and lease.owner == "p1"
    assert lease.expires_at == pytest.approx(clock() + 1.0)
    assert cache.num_pinned_items == 1
    second = cache.acquire("a", owner="p2")
    assert second is not None and second.lease_id != lease.lease_id
    assert cache.num_pinned_items == 1  # items, not leases
    assert cache.lease_stats == LeaseStats(active=2, released=0, expired=0, rejected=0)


def test_a_lease_carries_the_allocation_it_pinned() -> None:
    cache, _ = make(num_blocks=9)
    ids = cache.allocate("a", [4, 2])
    cache.mark_written("a")
    lease = cache.acquire("a")
    assert lease is not None
    assert lease.allocation == Allocation(tuple(ids), (4, 2), 6, cache.get_generation("a"))
    # The slot map moves on (freed while pinned, re-allocated under the same hash);
    # the lease still names the blocks and generation it pinned.
    cache.free("a")
    again = cache.allocate("a", [4, 2])
    assert again is not None and set(again).isdisjoint(ids)
    assert lease.allocation.block_ids == tuple(ids)
    assert lease.allocation.generation < cache.get_generation("a")


def test_a_pending_lease_does_not_expire_until_handed_out() -> None:
    cache, clock = make(hold_ms=100, ttl_ms=1)
    cache.allocate("a", [1])
    cache.mark_written("a")
    lease = cache.acquire("a", owner="req", pending=True)
    assert lease is not None and lease.pending
    clock.advance_ms(10_000)  # ten thousand ttls while its request waits
    assert cache.reap_expired_leases() == 0 and cache.num_pinned_items == 1
    assert cache.evict_lru(8) == []  # pinned: not evictable
    started = cache.start_lease(lease.lease_id)
    assert started is not None and not started.pending
    assert started.lease_id == lease.lease_id and started.allocation == lease.allocation
    assert started.expires_at == pytest.approx(clock() + 0.001)  # the ttl runs from the hand-out
    clock.advance_ms(1)
    assert cache.reap_expired_leases() == 1 and cache.num_pinned_items == 0
    assert cache.start_lease(lease.lease_id) is None  # ended: nothing to hand out
    # The hold runs from the hand-out (1 ms ago), the last time the location went out.
    cache.free("a")
    assert occ(cache) == (0, 7, 1)
    clock.advance_ms(98)
    assert occ(cache) == (0, 7, 1)
    clock.advance_ms(1)
    assert occ(cache) == (0, 8, 0)


def test_a_pending_lease_ends_at_its_ceiling_or_when_released() -> None:
    clock = FakeClock()
    layout = CacheLayout(num_blocks=4, block_size=BLOCK, out_hidden_size=2, num_deepstack_levels=1,
                         dtype=torch.float32)
    cache = EncoderCacheBlocks(layout, 0, lease_ttl_ms=5, pending_lease_ttl_ms=50, clock=clock)
    cache.allocate("a", [1])
    cache.mark_written("a")
    first = cache.acquire("a", owner="r", pending=True)
    second = cache.acquire("a", owner="r", pending=True)
    assert first is not None and second is not None
    assert cache.release(second.lease_id, owner="r")
    clock.advance_ms(49)
    assert cache.reap_expired_leases() == 0
    clock.advance_ms(1)
    assert cache.reap_expired_leases() == 1 and cache.start_lease(first.lease_id) is None
    assert cache.lease_stats == LeaseStats(active=0, released=1, expired=1, rejected=0)


def test_release_checks_id_and_owner_and_counts_rejections() -> None:
    cache, _ = make()
    cache.allocate("a", [1])
    cache.mark_written("a")
    lease = cache.acquire("a", owner="p1")
    assert lease is not None
    assert not cache.release(lease.lease_id, owner="intruder")
    assert cache.num_pinned_items == 1
    assert not cache.release(0)  # 0 is never issued
    assert cache.release(lease.lease_id, owner="p1")
    assert not cache.release(lease.lease_id)
    assert cache.num_pinned_items == 0
    assert cache.lease_stats == LeaseStats(active=0, released=1, expired=0, rejected=3)


def test_leases_expire_and_unpin() -> None:
    cache, clock = make(ttl_ms=1000)
    cache.allocate("a", [1])
    cache.mark_written("a")
    lease = cache.acquire("a")
    assert lease is not None
    clock.advance_ms(999)
    assert cache.reap_expired_leases() == 0 and cache.num_pinned_items == 1
    clock.advance_ms(1)
    assert cache.reap_expired_leases() == 1 and cache.num_pinned_items == 0
    assert not cache.release(lease.lease_id)
    assert cache.lease_stats == LeaseStats(active=0, released=0, expired=1, rejected=1)
    assert cache.evict_lru(8) == ["a"]  # evictable again


def test_expired_leases_are_reaped_lazily_inside_other_calls() -> None:
    cache, clock = make(ttl_ms=1000)
    cache.allocate("a", [1])
    cache.mark_written("a")
    cache.acquire("a")
    clock.advance_ms(1000)
    assert cache.num_pinned_items == 0
    assert cache.lease_stats.expired == 1


def test_free_of_pinned_item_marks_it_and_frees_after_the_last_lease() -> None:
    cache, clock = make(num_blocks=3, hold_ms=100, ttl_ms=10_000)
    cache.allocate("a", [2, 1])
    cache.mark_written("a")
    first = cache.acquire("a", owner="p1")
    clock.advance_ms(20)
    second = cache.acquire("a", owner="p2")
    assert first is not None and second is not None
    assert cache.free("a") == 2  # counted now
    assert not cache.contains("a") and cache.acquire("a") is None
    assert cache.free("a") == 0
    assert occ(cache) == (2, 0, 0) and cache.num_active_real_tokens == 3
    assert cache.evict_lru(2) == []  # pinned blocks cannot be evicted
    assert cache.release(first.lease_id)
    assert occ(cache) == (2, 0, 0)
    clock.advance_ms(50)
    assert cache.release(second.lease_id)
    # Hold runs from the last acquire (t=20), not from the release (t=70).
    assert occ(cache) == (0, 0, 2) and cache.next_reusable_in_ms() == 50
    assert cache.num_pinned_items == 0 and cache.num_active_real_tokens == 0


def test_pinned_freed_item_is_released_when_its_lease_expires() -> None:
    cache, clock = make(num_blocks=2, hold_ms=100, ttl_ms=500)
    cache.allocate("a", [1])
    cache.mark_written("a")
    cache.acquire("a")
    cache.free("a")
    clock.advance_ms(499)
    assert occ(cache) == (1, 0, 0)
    clock.advance_ms(1)
    assert occ(cache) == (0, 1, 0)  # hold from the acquire has passed too
    assert cache.allocate("b", [1]) == [0]


def test_reallocate_while_old_allocation_is_still_leased() -> None:
    cache, _ = make(num_blocks=4, hold_ms=0)
    old = cache.allocate("a", [1])
    cache.mark_written("a")
    lease = cache.acquire("a")
    cache.free("a")
    new = cache.allocate("a", [1])
    assert new is not None and old is not None and set(new).isdisjoint(old)
    assert lease is not None and cache.release(lease.lease_id)
    assert cache.contains("a") and cache.get_block_ids("a") == new  # the new one survives
    assert occ(cache) == (1, 2, 0)


# --------------------------------------------------------------------- eviction
def _written(cache: EncoderCacheBlocks, name: str, tpb: list[int]) -> list[int]:
    ids = cache.allocate(name, tpb)
    assert ids is not None
    cache.mark_written(name)
    return ids


def test_evict_lru_frees_least_recently_used_first() -> None:
    cache, _ = make(num_blocks=9, hold_ms=100)
    for name in ("a", "b", "c"):
        _written(cache, name, [1, 1])
    assert cache.evict_lru(0) == [] and cache.evict_lru(2) == []  # already enough
    cache.touch("a")  # order now b, c, a
    assert cache.evict_lru_counted(3) == (["b"], 2)
    assert occ(cache) == (4, 2, 2)
    assert cache.evict_lru(8) == ["c", "a"]
    assert occ(cache) == (0, 2, 6) and cache.num_items == 0


def test_evict_lru_skips_pinned_and_unwritten_items() -> None:
    cache, _ = make(num_blocks=5, hold_ms=100)
    _written(cache, "pinned", [1])
    _written(cache, "old", [1])
    cache.allocate("writing", [1])
    _written(cache, "new", [1])
    lease = cache.acquire("pinned")
    assert lease is not None
    assert cache.evict_lru(2) == ["old", "new"]
    assert cache.contains("pinned") and cache.contains("writing")
    # Released: evictable again, at the most recent end.
    assert cache.release(lease.lease_id)
    assert cache.evict_lru(3) == ["pinned"]


def test_evict_lru_is_all_or_nothing() -> None:
    cache, _ = make(num_blocks=5, hold_ms=100)
    _written(cache, "a", [1])
    _written(cache, "b", [1])
    _written(cache, "c", [1])
    cache.acquire("c")
    assert cache.evict_lru(4) == []  # free 1 + evictable 2 < 4
    assert cache.num_items == 3
    assert cache.evict_lru(3) == ["a", "b"]


def test_evict_lru_and_can_admit_reject_bad_counts() -> None:
    cache, _ = make()
    for bad, match in ((-1, "-1"), (9, "9"), (1.0, "1.0")):
        with pytest.raises(ValueError, match=match):
            cache.evict_lru(bad)
    with pytest.raises(ValueError, match=r"block_counts\[1\] = -2"):
        cache.can_admit([1, -2])
    with pytest.raises(ValueError, match=r"block_counts\[0\] = 9"):
        cache.can_admit([9])


def test_can_admit_counts_free_held_and_evictable_blocks() -> None:
    cache, clock = make(num_blocks=7, hold_ms=100)  # 6 usable
    _written(cache, "pinned", [1, 1])
    _written(cache, "evictable", [1])
    _written(cache, "held", [1])
    cache.allocate("writing", [1])
    cache.acquire("pinned")
    cache.free("held")
    # free 1 + held 1 + evictable 1; pinned 2 and unwritten 1 are not counted
    assert cache.can_admit([1, 1, 1]) and cache.can_admit([2, 1]) and cache.can_admit([])
    assert not cache.can_admit([2, 2])
    assert not cache.can_admit([4])


def test_next_reusable_in_ms_rounds_up() -> None:
    cache, clock = make(hold_ms=100)
    _written(cache, "a", [1])
    clock.advance_ms(0.4)
    cache.free("a")
    assert cache.next_reusable_in_ms() == 100  # 99.6 rounds up
    clock.advance_ms(99.6)
    assert cache.next_reusable_in_ms() is None  # reclaimed


# ------------------------------------------------------------------- structures
def test_records_are_slotted() -> None:
    entry = SlotEntry("a", [0], [1], 1, 1)
    assert not hasattr(entry, "__dict__")
    records = (Lease(1, "a", "", 0.0, ONE_BLOCK), ONE_BLOCK, LeaseStats(0, 0, 0, 0), CacheOccupancy(0, 0, 0, 0, 0, 0))
    for record in records:
        assert not hasattr(record, "__dict__")
    with pytest.raises(AttributeError):
        entry.unknown = 1  # type: ignore[attr-defined]


def test_block_pool_orders_by_release_time() -> None:
    pool = BlockPool(4)
    assert pool.take(5) is None
    assert pool.take(2) == [0, 1]
    assert pool.give([0], release_at=5.0, now=1.0)
    assert pool.give([1], release_at=3.0, now=1.0)
    assert not pool.give([9], release_at=1.0, now=1.0)  # due now: free at once
    assert (pool.num_free, pool.num_held, pool.next_release) == (3, 2, 3.0)
    assert pool.reclaim(4.0) == 1 and pool.take(4) == [2, 3, 9, 1]


def test_lease_table_compacts_its_heap_without_losing_live_leases() -> None:
    table: LeaseTable[str] = LeaseTable(ttl_s=100.0)
    keep = table.grant("keep", "k", "", 0.0, ONE_BLOCK)
    for i in range(500):
        lease = table.grant(f"p{i}", "x", "", float(i) / 1000, ONE_BLOCK)
        assert table.release(lease.lease_id, None, now=1.0) == f"p{i}"
    assert len(table._expiry) < 100  # rebuilt from the live leases
    assert table.reap(now=99.0) == []
    assert table.reap(now=100.0) == ["keep"]
    assert table.stats() == LeaseStats(active=0, released=500, expired=1, rejected=0)
    assert keep.expires_at == 100.0


# -------------------------------------------------------------------- threading
def test_concurrent_callers_keep_the_invariant() -> None:
    cache, _ = make(num_blocks=33, hold_ms=0, ttl_ms=60_000)
    cache._clock = time.monotonic  # real clock: threads interleave for real
    names = [f"h{i}" for i in range(12)]
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(1500):
                name = rng.choice(names)
                try:
                    ids = cache.allocate(name, [1] * (1 + int(name[1:]) % 3))
                except ValueError:
                    ids = []  # present (allocated by some thread): only lease and maybe free it
                if ids is None:
                    cache.evict_lru(3)
                    continue
                if ids:
                    try:
                        cache.mark_written(name)
                    except ValueError:
                        continue  # freed by another thread in between
                lease = cache.acquire(name, owner=str(seed))
                if lease is not None:
                    assert cache.release(lease.lease_id, owner=str(seed))
                if rng.random() < 0.5:
                    cache.free(name)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, also inside the allocator's methods
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        sys.setswitchinterval(interval)
    assert not errors and not any(t.is_alive() for t in threads)
    owned = [b for h in names if cache.contains(h) for b in cache.get_block_ids(h)]
    assert len(owned) == len(set(owned)) and cache.layout.scratch_block_id not in owned
    assert occ(cache)[0] == len(owned), "blocks active but owned by no item"
    assert cache.lease_stats.active == 0 and cache.num_pinned_items == 0
    for h in names:
        cache.free(h)
    assert occ(cache) == (0, 32, 0) and cache.num_active_real_tokens == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_stamps_on_a_cuda_device() -> None:
    cache, _ = make(device="cuda")
    ids = cache.allocate("a", [1, 1])
    assert ids is not None and cache.mm_hash_tags.device.type == "cuda"
    assert cache.mm_hash_tags.cpu()[ids].tolist() == [mm_hash_fingerprint("a")] * 2
    assert cache.block_generations.cpu()[ids].tolist() == [cache.get_generation("a")] * 2
