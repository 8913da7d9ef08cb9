"""Stateful property test of the encoder's block allocator against a reference model.

Random sequences of allocate / mark_written / acquire (handed out at once or
pending) / start_lease / release / free / evict / touch / admission queries /
clock advances, checked step by step against a model. Time is kept in ticks of
1/1024 s and holds and lease TTLs are multiples of 125 ms, so clock values and
deadlines are exact in binary floating point and the model demands exact
agreement on when a block becomes reusable and when a lease expires; one rule
jumps to one tick before, or exactly onto, the next deadline.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import hypothesis.strategies as st
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from common.fingerprint import mm_hash_fingerprint
from common.layout import CacheLayout
from encoder_server.cache_blocks import DEFAULT_PENDING_LEASE_TTL_MS, EncoderCacheBlocks
from encoder_server.cache_records import Allocation

TICKS_PER_S = 1024
BLOCK_SIZE = 4
NAMES = [f"h{i}" for i in range(5)]
OWNERS = ["p", "q"]
UNKNOWN_LEASE = 0  # never issued


def ms_to_ticks(ms: int) -> int:
    assert ms % 125 == 0
    return ms * TICKS_PER_S // 1000


@dataclass
class ModelItem:
    name: str
    generation: int
    blocks: list[int]
    tpb: list[int]
    written_at: int | None = None
    last_acquire: int | None = None
    leases: set[int] = field(default_factory=set)


@dataclass
class ModelLease:
    item: ModelItem
    owner: str
    expires: int
    ended: bool = False
    pending: bool = False


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ticks = 0

    @initialize(
        num_blocks=st.integers(3, 7),
        hold_ms=st.sampled_from([0, 125, 250]),
        ttl_ms=st.sampled_from([125, 500, 1000]),
    )
    def setup(self, num_blocks: int, hold_ms: int, ttl_ms: int) -> None:
        layout = CacheLayout(num_blocks=num_blocks, block_size=BLOCK_SIZE, out_hidden_size=2,
                             dtype=torch.float32)
        self.ticks = 10 * TICKS_PER_S
        self.cache = EncoderCacheBlocks(layout, hold_ms, lease_ttl_ms=ttl_ms,
                                        clock=lambda: self.ticks / TICKS_PER_S)
        self.usable = num_blocks - 1
        self.hold = ms_to_ticks(hold_ms)
        self.ttl = ms_to_ticks(ttl_ms)
        self.present: dict[str, ModelItem] = {}
        self.doomed: list[ModelItem] = []  # freed while pinned
        self.leases: dict[int, ModelLease] = {}
        self.reusable_at: dict[int, float] = {}  # block -> earliest tick it may be handed out
        self.max_generation = 0
        self.prev_generations = self.cache.block_generations.clone()
        self.tags = self.cache.mm_hash_tags.numpy()
        self.gens = self.cache.block_generations.numpy()

    # ------------------------------------------------------------- model views
    def live(self, lease: ModelLease) -> bool:
        return not lease.ended and self.ticks < lease.expires

    def pinned(self, item: ModelItem) -> bool:
        return any(self.live(self.leases[i]) for i in item.leases)

    def busy_items(self) -> list[ModelItem]:
        return list(self.present.values()) + [it for it in self.doomed if self.pinned(it)]

    def busy_blocks(self) -> set[int]:
        return {b for it in self.busy_items() for b in it.blocks}

    def idle_blocks(self) -> list[int]:
        busy = self.busy_blocks()
        return [b for b in range(self.usable) if b not in busy]

    def ready_blocks(self) -> list[int]:
        return [b for b in self.idle_blocks() if self.reusable_at.get(b, -math.inf) <= self.ticks]

    def evictable(self) -> list[ModelItem]:
        return [it for it in self.present.values() if it.written_at is not None and not self.pinned(it)]

    def release_blocks(self, item: ModelItem) -> None:
        if item.written_at is None:
            at: float = -math.inf
        else:
            at = max(item.written_at, item.last_acquire or item.written_at) + self.hold
        for b in item.blocks:
            self.reusable_at[b] = at

    def draw_name(self, data: st.DataObject, wanted: Callable[[ModelItem], bool]) -> str:
        """Mostly a present item in the state the rule acts on, so multi-step stories
        (allocate, write, lease, free, reuse) happen; otherwise any name."""
        fitting = sorted(name for name, it in self.present.items() if wanted(it))
        if fitting and data.draw(st.integers(0, 3)) > 0:
            return data.draw(st.sampled_from(fitting))
        return data.draw(st.sampled_from(NAMES))

    # -------------------------------------------------------------------- rules
    @rule(data=st.data(), tpb=st.lists(st.integers(1, BLOCK_SIZE), min_size=1, max_size=3),
          write=st.booleans())
    def allocate(self, data: st.DataObject, tpb: list[int], write: bool) -> None:
        absent = [n for n in NAMES if n not in self.present]
        if absent and data.draw(st.integers(0, 3)) > 0:
            name = data.draw(st.sampled_from(absent))
        else:
            name = data.draw(st.sampled_from(NAMES))
        item = self.present.get(name)
        if item is not None and data.draw(st.booleans()):
            tpb = item.tpb  # the same plan again: refused all the same
        if item is not None or len(tpb) > self.usable:
            try:
                self.cache.allocate(name, tpb)
            except ValueError:
                return
            raise AssertionError(f"allocate({name!r}, {tpb}) did not raise")
        self._allocate(name, tpb)
        if write and name in self.present:
            # The service's usual story in one step (encode right after allocate).
            self.cache.mark_written(name)
            self.present[name].written_at = self.ticks

    def _allocate(self, name: str, tpb: list[int]) -> None:
        """An absent ``name`` (a present one must raise: the rule checks that)."""
        ready = set(self.ready_blocks())
        got = self.cache.allocate(name, tpb)
        if len(ready) < len(tpb):
            assert got is None, f"allocate got {got} with only {len(ready)} reusable blocks"
            return
        assert got is not None, f"allocate refused {len(tpb)} blocks with {len(ready)} reusable"
        assert len(got) == len(tpb) == len(set(got))
        assert self.usable not in got, "scratch block handed out"
        assert set(got) <= ready, f"handed out {set(got) - ready}: busy or inside its hold"
        generation = self.cache.get_generation(name)
        assert generation > self.max_generation
        self.max_generation = generation
        fp = mm_hash_fingerprint(name)
        for b in got:
            assert self.tags[b] == fp and self.gens[b] == generation, "not stamped before return"
            self.reusable_at.pop(b, None)
        self.present[name] = ModelItem(name, generation, got, list(tpb))

    @rule(data=st.data())
    def mark_written(self, data: st.DataObject) -> None:
        name = self.draw_name(data, lambda it: it.written_at is None)
        item = self.present.get(name)
        if item is None:
            try:
                self.cache.mark_written(name)
            except ValueError:
                return
            raise AssertionError("mark_written of an absent item did not raise")
        self.cache.mark_written(name)
        item.written_at = self.ticks

    @rule(data=st.data(), owner=st.sampled_from(OWNERS), later=st.sampled_from([0, 0, 100, 200]),
          pending=st.booleans())
    def acquire(self, data: st.DataObject, owner: str, later: int, pending: bool) -> None:
        """``later``: a consumer arriving some time after the write moves the hold start.
        ``pending``: taken by a request still running; expires only at the ceiling until started."""
        self.ticks += later
        name = self.draw_name(data, lambda it: it.written_at is not None)
        item = self.present.get(name)
        lease = self.cache.acquire(name, owner=owner, pending=pending)
        if item is None or item.written_at is None:
            assert lease is None
            return
        assert lease is not None and lease.mm_hash == name and lease.owner == owner
        assert lease.lease_id not in self.leases and lease.pending == pending
        assert lease.allocation == Allocation(tuple(item.blocks), tuple(item.tpb), sum(item.tpb), item.generation)
        expires = self.ticks + (ms_to_ticks(DEFAULT_PENDING_LEASE_TTL_MS) if pending else self.ttl)
        assert lease.expires_at == expires / TICKS_PER_S
        item.last_acquire = self.ticks
        item.leases.add(lease.lease_id)
        self.leases[lease.lease_id] = ModelLease(item, owner, expires, pending=pending)

    @rule(data=st.data(), later=st.sampled_from([0, 100, 200]))
    def start_lease(self, data: st.DataObject, later: int) -> None:
        """Hand a lease's location out (pending or not): its ttl and the item's hold start now."""
        self.ticks += later
        # Grant order: the draws must not depend on random ids. Mostly a live pending lease.
        pending = [i for i, le in self.leases.items() if self.live(le) and le.pending]
        known = list(self.leases)
        if pending and data.draw(st.integers(0, 3)) > 0:
            lease_id = pending[data.draw(st.integers(0, len(pending) - 1))]
        else:
            pick = data.draw(st.integers(0, len(known)))
            lease_id = known[pick] if pick < len(known) else UNKNOWN_LEASE
        lease = self.leases.get(lease_id)
        started = self.cache.start_lease(lease_id)
        if lease is None or not self.live(lease):
            assert started is None
            return
        assert started is not None and not started.pending and started.lease_id == lease_id
        item = lease.item
        assert started.allocation.block_ids == tuple(item.blocks)
        assert started.allocation.generation == item.generation
        lease.expires = self.ticks + self.ttl
        lease.pending = False
        assert started.expires_at == lease.expires / TICKS_PER_S
        item.last_acquire = self.ticks
        if any(it is item for it in self.doomed):  # freed while pinned: its blocks' hold now runs from this hand-out
            self.release_blocks(item)

    @rule(data=st.data(), owner=st.sampled_from([None, *OWNERS]))
    def release(self, data: st.DataObject, owner: str | None) -> None:
        # Grant order, not id order: ids are random, and the draws must not depend on them.
        live = [i for i, le in self.leases.items() if self.live(le)]
        if live and data.draw(st.integers(0, 3)) > 0:
            lease_id = live[data.draw(st.integers(0, len(live) - 1))]
        else:  # an ended, expired or unknown lease
            known = list(self.leases)
            pick = data.draw(st.integers(0, len(known)))
            lease_id = known[pick] if pick < len(known) else UNKNOWN_LEASE
        lease = self.leases.get(lease_id)
        expected = lease is not None and self.live(lease) and owner in (None, lease.owner)
        assert self.cache.release(lease_id, owner=owner) == expected
        if expected:
            assert lease is not None
            lease.ended = True

    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        name = self.draw_name(data, lambda it: True)
        item = self.present.pop(name, None)
        assert self.cache.free(name) == (len(item.blocks) if item else 0)
        if item is None:
            return
        self.release_blocks(item)  # applies once the item is no longer pinned
        if self.pinned(item):
            self.doomed.append(item)

    @rule(needed=st.integers(0, 6))
    def evict(self, needed: int) -> None:
        needed = min(needed, self.usable)
        have = len(self.idle_blocks())
        candidates = {it.name: it for it in self.evictable()}
        pinned = {it.name for it in self.present.values() if self.pinned(it)}
        evicted, count = self.cache.evict_lru_counted(needed)
        assert not set(evicted) & pinned, "evicted a pinned item"
        assert set(evicted) <= set(candidates), f"evicted a non-evictable item: {evicted}"
        assert count == sum(len(candidates[h].blocks) for h in evicted)
        if have >= needed or have + sum(len(it.blocks) for it in candidates.values()) < needed:
            assert evicted == []
        else:
            assert evicted and have + count >= needed
            assert have + count - len(candidates[evicted[-1]].blocks) < needed, "evicted too much"
        for h in evicted:
            self.release_blocks(self.present.pop(h))

    @rule(ticks=st.one_of(st.integers(0, 40), st.integers(100, 300)),
          to_deadline=st.sampled_from([None, -1, 0]))
    def advance(self, ticks: int, to_deadline: int | None) -> None:
        """Forward by ``ticks``, or to one tick before / exactly at the next hold end or lease expiry."""
        deadlines: list[float] = [le.expires for le in self.leases.values() if self.live(le)]
        deadlines += [at for at in self.reusable_at.values() if at > self.ticks]
        if to_deadline is None or not deadlines:
            self.ticks += ticks
        else:
            self.ticks = max(self.ticks, int(min(deadlines)) + to_deadline)

    @rule(data=st.data(), query=st.sampled_from(["can_admit", "hint", "reap", "touch"]))
    def query(self, data: st.DataObject, query: str) -> None:
        if query == "touch":
            self.cache.touch(self.draw_name(data, lambda it: True))
        elif query == "can_admit":
            counts = data.draw(st.lists(st.integers(0, min(3, self.usable)), max_size=3))
            room = len(self.idle_blocks()) + sum(len(it.blocks) for it in self.evictable())
            assert self.cache.can_admit(counts) == (sum(counts) <= room)
        elif query == "hint":
            held = [self.reusable_at[b] for b in self.idle_blocks()
                    if self.reusable_at.get(b, -math.inf) > self.ticks]
            self.cache.reclaim_held()
            hint = self.cache.next_reusable_in_ms()
            if not held:
                assert hint is None
            else:
                exact = (min(held) - self.ticks) * 1000 / TICKS_PER_S
                assert hint is not None and exact <= hint < exact + 1
        else:
            # Reaping is lazy inside every call; the invariants check the totals.
            before = self.cache.lease_stats.expired
            reaped = self.cache.reap_expired_leases()
            assert self.cache.lease_stats.expired == before + reaped

    # --------------------------------------------------------------- invariants
    @invariant()
    def occupancy_matches_the_model(self) -> None:
        if not hasattr(self, "cache"):
            return
        occ = self.cache.occupancy()
        busy_items = self.busy_items()
        busy = [b for it in busy_items for b in it.blocks]
        assert len(busy) == len(set(busy)), "a block is in two items"
        assert self.usable not in busy
        ready = self.ready_blocks()
        assert occ.active_blocks + occ.free_blocks + occ.held_blocks == self.usable
        assert occ.active_blocks == len(busy)
        assert occ.free_blocks == len(ready)
        assert occ.held_blocks == self.usable - len(busy) - len(ready)
        assert occ.active_real_tokens == sum(sum(it.tpb) for it in busy_items)
        assert occ.pinned_items == sum(1 for it in busy_items if self.pinned(it))
        assert occ.items == len(self.present)
        stats = self.cache.lease_stats
        assert stats.active == sum(1 for le in self.leases.values() if self.live(le))
        assert stats.released == sum(1 for le in self.leases.values() if le.ended)
        assert stats.expired == sum(
            1 for le in self.leases.values() if not le.ended and le.expires <= self.ticks
        )

    @invariant()
    def tags_and_generations_match_the_slot_map(self) -> None:
        if not hasattr(self, "cache"):
            return
        for name in NAMES:
            assert self.cache.contains(name) == (name in self.present)
        for it in self.busy_items():
            if it.name in self.present and self.present[it.name] is it:
                assert self.cache.get_block_ids(it.name) == it.blocks
                assert self.cache.get_generation(it.name) == it.generation
                assert self.cache.is_written(it.name) == (it.written_at is not None)
            fp = mm_hash_fingerprint(it.name)
            for b in it.blocks:
                assert self.tags[b] == fp and self.gens[b] == it.generation
        assert self.tags[self.usable] == 0 and self.gens[self.usable] == 0, "scratch stamped"
        now = self.cache.block_generations.clone()
        assert bool((now >= self.prev_generations).all()), "a generation went down"
        self.prev_generations = now


CacheMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCacheBlocksStateful = CacheMachine.TestCase
