"""Encode orchestration: hash, cache, coalesce, admit, then hand misses to the batcher (encoder process).

The engine sits between the gRPC servicer and the three pieces that do the
work: the block allocator (:class:`EncoderCacheBlocks`), the preprocessor and
the aliased encoder runner. Per item it follows the layer table of the design:

* every item is a **layer-3 query**; an item that is not in the device cache
  and not already being encoded by another request is a **miss** and is
  encoded exactly once (concurrent requests for it wait on the same future);
* only items that must be encoded need pixels: they go through the
  **layer-1** input cache (pixel tensors by mm_hash) and are decoded on a
  miss there;
* admission counts whole blocks; when the cache cannot take the request even
  after evicting every unpinned item, the request fails at once with
  :class:`CacheFullError` and a retry hint, the encoder thread never stalls;
* misses from concurrent requests queue for one encoder thread, which takes
  as many as fit the largest bucket into one graph run (:mod:`.batcher`).

The ``mm_hash`` is computed here from the content, the preprocessing
parameters, the model id and the item's cache salt, so a client can never name
content it did not send. Everything here is keyed by it (the device cache,
leases, coalescing, the input cache), so an item under one tenant's salt never
meets another tenant's entry for the same bytes, nor a timing that depends on it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from common import media
from common.errors import (
    CacheFullError,
    EpdError,
    InvalidMediaError,
    ItemLostError,
    LimitExceededError,
    NotFoundError,
)
from common.fingerprint import cached_fingerprint
from common.metrics import EncoderMetrics
from common.placeholder import ItemMeta
from encoder_server.batcher import EncodeBatcher, EncodeJob, Flight, Waiter
from encoder_server.cache_blocks import EncoderCacheBlocks, Lease
from encoder_server.input_cache import InputCache
from encoder_server.vision import default_tokens_per_block

logger = logging.getLogger(__name__)

# Longest an Encode may run when its call carries no deadline: the wait for its
# encoder runs ends here, and with it every pending lease it holds.
MAX_REQUEST_S = 120.0
# The metadata of an item the engine did not admit itself; one instance, not one per answer.
_NO_META = ItemMeta()


class ProcessedItem(Protocol):
    """An item ready for the tower: what the engine reads of it (the tower reads the rest)."""

    @property
    def num_tokens(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def meta(self) -> ItemMeta: ...


class Preprocessor(Protocol):
    """Bytes -> the tower's processed item; thread-safe (it runs on the preprocessing threads)."""

    def image(self, data: bytes, *, item: str = "image") -> ProcessedItem: ...

    def video(self, frames: Sequence[bytes], *, fps: float | None = None, item: str = "video") -> ProcessedItem: ...


class Runner(Protocol):
    """What the engine needs from the aliased encoder graph."""

    max_batch_tokens: int

    def write(
        self,
        items: Sequence[Any],
        block_ids: Sequence[Sequence[int]],
        tokens_per_block: Sequence[Sequence[int]],
        buffer: torch.Tensor,
        scratch_block_id: int,
    ) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class MediaInput:
    """One item of an Encode request, as bytes (never decoded yet)."""

    kind: str  # "image" | "video"
    frames: tuple[bytes | memoryview, ...]  # one entry for an image; views into the request bytes
    fps: float | None = None
    label: str = ""
    cache_salt: str = ""  # the tenant's: part of the item's identity ("" none)

    def content_hash(self) -> str:
        return media.content_hash(self.kind, self.frames, self.fps)


@dataclass(frozen=True, slots=True)
class Located:
    """An item's location in the cache plus the lease that pins it."""

    mm_hash: str
    block_ids: tuple[int, ...]
    tokens_per_block: tuple[int, ...]
    num_tokens: int
    fingerprint: int
    generation: int
    lease: Lease
    hit: bool
    meta: ItemMeta = ItemMeta()


@dataclass(frozen=True, slots=True)
class Failed:
    """One item's typed failure; the rest of its request is answered as usual."""

    mm_hash: str
    error: EpdError


def _located(mm_hash: str, lease: Lease, meta: ItemMeta, *, hit: bool) -> Located:
    """The answer for an item: exactly the allocation ``lease`` pinned."""
    alloc = lease.allocation
    return Located(
        mm_hash=mm_hash,
        block_ids=alloc.block_ids,
        tokens_per_block=alloc.tokens_per_block,
        num_tokens=alloc.num_tokens,
        fingerprint=cached_fingerprint(mm_hash),
        generation=alloc.generation,
        lease=lease,
        hit=hit,
        meta=meta,
    )


@dataclass(frozen=True, slots=True)
class _Pinned:
    """An item a request holds: its pending lease, and the metadata of the answer."""

    lease: Lease
    meta: ItemMeta


@dataclass(frozen=True, slots=True)
class _Preprocessed:
    """The misses' items ready for the tower, and the misses whose media were refused."""

    items: dict[str, ProcessedItem]
    errors: dict[str, EpdError]


@dataclass(frozen=True, slots=True)
class _Admitted:
    """What admission gave a request: runs to schedule, and the misses it now waits for or holds."""

    jobs: list[EncodeJob]
    waiters: dict[str, Waiter]
    pinned: dict[str, _Pinned]


class EncoderEngine:
    """Turns Encode/Lookup/Release into cache and encoder operations."""

    def __init__(
        self,
        *,
        cache: EncoderCacheBlocks,
        preprocessor: Preprocessor,
        runner: Runner,
        metrics: EncoderMetrics,
        model_id: str,
        preprocess_fingerprint: str,
        input_cache_bytes: int = 256 << 20,
        preprocess_workers: int = 2,
        batch_tokens: int | None = None,
    ) -> None:
        self.cache = cache
        self.preprocessor = preprocessor
        self.runner = runner
        self.metrics = metrics
        self.model_id = model_id
        self.preprocess_fingerprint = preprocess_fingerprint
        self._inputs = InputCache(input_cache_bytes)
        self._preprocess_pool = ThreadPoolExecutor(preprocess_workers, thread_name_prefix="epd-preprocess")
        # Misses of concurrent requests share a run up to this many tokens (the runner's largest
        # bucket at most); the first job of a run is always taken, so a larger item runs alone.
        self._batcher = EncodeBatcher(
            cache=cache, runner=runner, metrics=metrics,
            batch_tokens=min(batch_tokens or runner.max_batch_tokens, runner.max_batch_tokens),
            after_run=self.update_gauges)
        self.stats = self._batcher.stats
        # The metadata of each cached item, for the response; pruned in housekeeping().
        self._metas: dict[str, ItemMeta] = {}
        self._admit_lock: asyncio.Lock | None = None
        self._expired_counted = 0  # cache lease expiries already added to the metric

    # --- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        self._admit_lock = asyncio.Lock()
        self._batcher.start()
        self.update_gauges()

    async def stop(self) -> None:
        await self._batcher.cancel()
        self._preprocess_pool.shutdown(wait=False, cancel_futures=True)
        self._batcher.shutdown()

    # --- hashing -----------------------------------------------------------------------

    def mm_hash(self, content_hash: str, cache_salt: str = "") -> str:
        return media.mm_hash(self.model_id, self.preprocess_fingerprint, content_hash, cache_salt)

    # --- public operations ---------------------------------------------------------------

    async def encode(
        self, items: Sequence[MediaInput], consumer_id: str, timeout: float | None = None
    ) -> list[Located | Failed]:
        """Encode or find every item; per-item errors are returned (:class:`Failed`), not raised.

        Each distinct item of the request gets one lease (an item named twice
        shares it). Leases are taken *pending* while the request runs (hits
        first, misses the moment their rows are written) and handed out
        together at the end: their ttl starts then, so a request that waits
        longer than the ttl never loses an item it pinned. Every location is
        built from the allocation its lease pinned, never from the slot map.
        Raises :class:`CacheFullError` when the misses cannot be admitted even
        after eviction, and ``asyncio.TimeoutError`` when the encoder runs do
        not finish within ``timeout`` (default :data:`MAX_REQUEST_S`); leases
        taken so far are given back, the runs still complete and their items
        stay cached.
        """
        assert self._admit_lock is not None, "engine not started"
        deadline = time.monotonic() + (MAX_REQUEST_S if timeout is None else timeout)
        loop = asyncio.get_running_loop()
        content = await loop.run_in_executor(
            self._preprocess_pool, lambda: [item.content_hash() for item in items])
        hashes = [self.mm_hash(c, item.cache_salt) for c, item in zip(content, items)]

        pinned: dict[str, _Pinned] = {}
        waiters: dict[str, Waiter] = {}
        errors: dict[str, EpdError] = {}
        misses: dict[str, int] = {}  # mm_hash -> index of the first item carrying it
        try:
            for i, h in enumerate(hashes):
                self.metrics.device_queries.inc()  # every item is a layer-3 query
                if h in pinned or h in waiters or h in misses:
                    continue
                flight = self._batcher.flight(h)
                if flight is not None:  # coalesce with the run already scheduled for it
                    waiters[h] = flight.join(consumer_id)
                    continue
                # Pin a hit before anything below may evict to make room for misses.
                hit = self._pin_hit(h, consumer_id)
                if hit is not None:
                    pinned[h] = hit
                else:
                    misses[h] = i

            preprocessed = await self._preprocess(items, misses)
            errors.update(preprocessed.errors)
            admissible, oversized = self._split_oversized(preprocessed.items)
            errors.update(oversized)
            if admissible:
                async with self._admit_lock:
                    admitted = self._admit(admissible, consumer_id)
                    pinned.update(admitted.pinned)
                    waiters.update(admitted.waiters)
                    self._batcher.schedule(admitted.jobs)
                self.metrics.device_misses.inc(len(admitted.jobs))
            for h, waiter in waiters.items():
                try:
                    await asyncio.wait_for(
                        asyncio.shield(waiter.flight.future), max(0.0, deadline - time.monotonic()))
                except EpdError as exc:
                    errors[h] = exc
                    continue
                if waiter.lease is None:
                    errors[h] = ItemLostError(f"mm_hash {h} was evicted before it could be leased; retry")
                else:
                    pinned[h] = _Pinned(waiter.lease, waiter.flight.meta)
        except BaseException:
            self._abandon([p.lease for p in pinned.values()], waiters.values())
            raise

        fresh = {h for h, w in waiters.items() if w.flight.owner is w}
        located = {h: self._hand_out(h, p.lease, p.meta, hit=h not in fresh) for h, p in pinned.items()}
        located.update((h, Failed(h, err)) for h, err in errors.items())
        out = [located[h] for h in hashes]
        self.update_gauges()
        return out

    def _hand_out(self, mm_hash: str, lease: Lease, meta: ItemMeta, *, hit: bool) -> Located | Failed:
        """Start a pending lease's ttl and build the location it pinned; a typed error if it ended."""
        started = self.cache.start_lease(lease.lease_id)
        if started is None:
            return Failed(mm_hash, ItemLostError(f"mm_hash {mm_hash}: its lease ended while the request ran; retry"))
        return _located(mm_hash, started, meta, hit=hit)

    def _split_oversized(
        self, processed: dict[str, ProcessedItem]
    ) -> tuple[dict[str, ProcessedItem], dict[str, EpdError]]:
        """``(admissible, refused)``: an item larger than the whole cache can never be admitted, so it
        is a per-item error, not a stall."""
        layout = self.cache.layout
        admissible: dict[str, ProcessedItem] = {}
        refused: dict[str, EpdError] = {}
        for h, item in processed.items():
            needed = layout.blocks_for_tokens(item.num_tokens)
            if needed > layout.num_usable_blocks:
                refused[h] = LimitExceededError(
                    f"item of {item.num_tokens} tokens needs {needed} blocks "
                    f"of {layout.block_size}; this encoder's cache has {layout.num_usable_blocks}")
            else:
                admissible[h] = item
        return admissible, refused

    def _abandon(self, leases: Iterable[Lease], waiters: Iterable[Waiter]) -> None:
        """Give back what a failed request holds: its leases, and its place in pending runs."""
        for waiter in waiters:
            waiter.cancelled = True
            if waiter.lease is not None:
                self.cache.release(waiter.lease.lease_id)
        for lease in leases:
            self.cache.release(lease.lease_id)

    def lookup(self, mm_hashes: Sequence[str], consumer_id: str) -> list[Located | Failed]:
        out: list[Located | Failed] = []
        for h in mm_hashes:
            lease = self.cache.acquire(h, owner=consumer_id)  # handed out at once: the ttl runs now
            if lease is None:
                out.append(Failed(h, NotFoundError(f"mm_hash {h} is not in the encoder cache")))
            else:
                out.append(_located(h, lease, self._metas.get(h, _NO_META), hit=True))
        return out

    def release(self, lease_ids: Sequence[int], consumer_id: str | None) -> int:
        released = sum(1 for lease_id in lease_ids if self.cache.release(lease_id, owner=consumer_id))
        self.update_gauges()
        return released

    def housekeeping(self) -> None:
        """Reap expired leases, move held blocks past their hold to free, refresh gauges."""
        self.cache.reap_expired_leases()
        # Count from the cache's own tally: every cache call also expires due leases
        # on the way, and those never pass through reap_expired_leases().
        expired = self.cache.lease_stats.expired
        if expired > self._expired_counted:
            self.metrics.leases_expired.inc(expired - self._expired_counted)
            self._expired_counted = expired
        self.cache.reclaim_held()
        # Every present item was admitted here with its metadata, so only a count above the
        # cache's means some left. Asking the cache about each item on every tick held the event
        # loop (and every Lookup) for milliseconds once it held thousands.
        if len(self._metas) > self.cache.num_items:
            for h in self.cache.absent(self._metas):
                del self._metas[h]
        self.update_gauges()

    def update_gauges(self) -> None:
        occ = self.cache.occupancy()  # one consistent snapshot
        self.metrics.set_occupancy(occ.active_blocks, occ.free_blocks, occ.held_blocks, occ.active_real_tokens)
        self.metrics.leases_active.set(self.cache.lease_stats.active)

    # --- internals -----------------------------------------------------------------------

    async def _preprocess(self, items: Sequence[MediaInput], misses: dict[str, int]) -> _Preprocessed:
        """Pixels for every miss, through the layer-1 cache; bad media become per-item errors.

        The layer-1 cache is keyed by mm_hash, not by content: the same bytes under another
        tenant's salt are decoded again, so how fast a miss is never says whether another
        tenant sent those bytes.
        """
        loop = asyncio.get_running_loop()
        processed: dict[str, ProcessedItem] = {}
        errors: dict[str, EpdError] = {}
        pending: dict[str, asyncio.Future[ProcessedItem]] = {}
        for h, i in misses.items():
            self.metrics.mm_cache_queries.inc()
            cached = self._inputs.get(h)
            if cached is not None:
                self.metrics.mm_cache_hits.inc()
                processed[h] = cached
            else:
                pending[h] = loop.run_in_executor(self._preprocess_pool, self._decode, items[i], i)
        for h, fut in pending.items():
            try:
                item = await fut
            except InvalidMediaError as exc:
                errors[h] = exc
                continue
            self._inputs.put(h, item)
            processed[h] = item
        return _Preprocessed(processed, errors)

    def _decode(self, source: MediaInput, index: int) -> ProcessedItem:
        label = f"item {index}" + (f" ({source.label})" if source.label else "")
        frames = [bytes(f) for f in source.frames]  # copied only for items that are decoded
        if source.kind == "image":
            return self.preprocessor.image(frames[0], item=label)
        return self.preprocessor.video(frames, fps=source.fps, item=label)

    def _admit(self, processed: dict[str, ProcessedItem], consumer_id: str) -> _Admitted:
        """Allocate blocks for every miss, all or nothing; runs under the admission lock.

        A miss may have changed while its pixels were decoded: another request
        admitted it (join that run) or even finished it (a hit now: lease it,
        pending). Only an item absent from the cache gets blocks. On a failure
        nothing is left taken: what was joined or leased here is given back.
        """
        waiters: dict[str, Waiter] = {}
        pinned: dict[str, _Pinned] = {}
        todo: dict[str, ProcessedItem] = {}
        for h, item in processed.items():
            flight = self._batcher.flight(h)
            if flight is not None:  # another request admitted it while we decoded
                waiters[h] = flight.join(consumer_id)
                continue
            hit = self._pin_hit(h, consumer_id)  # ... or even finished it
            if hit is not None:
                pinned[h] = hit
            else:
                todo[h] = item
        try:
            jobs = self._allocate(todo) if todo else []
        except BaseException:
            self._abandon([p.lease for p in pinned.values()], waiters.values())
            raise
        for job in jobs:
            waiters[job.mm_hash] = job.flight.join(consumer_id, owner=True)
        return _Admitted(jobs, waiters, pinned)

    def _allocate(self, todo: dict[str, ProcessedItem]) -> list[EncodeJob]:
        """Blocks for every item of ``todo``, evicting unpinned items for room; all or none."""
        layout = self.cache.layout
        plans = {h: default_tokens_per_block(item.num_tokens, layout.block_size) for h, item in todo.items()}
        counts = [len(p) for p in plans.values()]
        if not self.cache.can_admit(counts):
            raise CacheFullError(
                f"cache cannot take {sum(counts)} blocks: {self.cache.num_pinned_items} items are "
                f"pinned by leases and {layout.num_usable_blocks} blocks exist",
                retry_after_ms=self._retry_hint_ms())
        _, evicted_blocks = self.cache.evict_lru_counted(sum(counts))
        if evicted_blocks:
            self.metrics.device_evictions.inc(evicted_blocks)
        loop = asyncio.get_running_loop()
        jobs: list[EncodeJob] = []
        try:
            for h, item in todo.items():
                block_ids = self.cache.allocate(h, plans[h])
                if block_ids is None:
                    raise CacheFullError(
                        f"freed blocks are still inside the {self.cache.min_hold_time_ms} ms hold",
                        retry_after_ms=self._retry_hint_ms())
                jobs.append(EncodeJob(h, item, block_ids, plans[h], Flight(loop.create_future(), item.meta)))
        except BaseException:
            for job in jobs:  # never written, never handed out: straight back to free
                self.cache.free(job.mm_hash)
            raise
        for job in jobs:
            self._metas[job.mm_hash] = job.item.meta
        return jobs

    def _pin_hit(self, mm_hash: str, consumer_id: str) -> _Pinned | None:
        """A pending lease on a cached item; ``None`` if it is absent or unwritten."""
        lease = self.cache.acquire(mm_hash, owner=consumer_id, pending=True)
        if lease is None:
            return None
        return _Pinned(lease, self._metas.get(mm_hash, _NO_META))

    def _retry_hint_ms(self) -> int:
        hint = self.cache.next_reusable_in_ms()
        return max(1, hint if hint is not None else max(self.cache.min_hold_time_ms, 50))
