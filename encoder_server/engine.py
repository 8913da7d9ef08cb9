"""Encode orchestration for the encoder process: hash, cache, coalesce, batch, write.

The engine sits between the gRPC servicer and the three pieces that do the
work: the block allocator (:class:`EncoderCacheBlocks`), the preprocessor and
the aliased encoder runner. Per item it follows the layer table of the design:

* every item is a **layer-3 query**; an item that is not in the device cache
  and not already being encoded by another request is a **miss** and is
  encoded exactly once (concurrent requests for it wait on the same future);
* only items that must be encoded need pixels: they go through the
  **layer-1** input cache (pixel tensors by content hash) and are decoded on a
  miss there;
* admission counts whole blocks; when the cache cannot take the request even
  after evicting every unpinned item, the request fails at once with
  :class:`CacheFullError` and a retry hint, the encoder thread never stalls;
* misses from concurrent requests queue for one encoder thread, which takes
  as many as fit the largest bucket into one graph run.

The ``mm_hash`` is computed here from the content, the preprocessing
parameters and the model id, so a client can never name content it did not
send.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
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
from encoder_server.cache_blocks import EncoderCacheBlocks, Lease
from encoder_server.vision import default_tokens_per_block

logger = logging.getLogger(__name__)

# Longest an Encode may run when its call carries no deadline: the wait for its
# encoder runs ends here, and with it every pending lease it holds.
MAX_REQUEST_S = 120.0


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


@dataclass(slots=True)
class _Waiter:
    """A request waiting for an item's encoder run; gets its lease the moment the item is written."""

    consumer_id: str
    flight: _Flight
    lease: Lease | None = None
    cancelled: bool = False


@dataclass(slots=True)
class _Flight:
    """One scheduled encoder run of one item, and every request waiting for it."""

    future: asyncio.Future[None]
    meta: ItemMeta
    waiters: list[_Waiter] = field(default_factory=list)
    owner: _Waiter | None = None  # the request whose miss scheduled the run

    def join(self, consumer_id: str, owner: bool = False) -> _Waiter:
        waiter = _Waiter(consumer_id, self)
        self.waiters.append(waiter)
        if owner:
            self.owner = waiter
        return waiter


@dataclass(slots=True)
class _Job:
    mm_hash: str
    item: ProcessedItem
    block_ids: list[int]
    tokens_per_block: list[int]
    flight: _Flight


class _InputCache:
    """Layer 1: preprocessed pixels by content hash, LRU, bounded in bytes."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._items: collections.OrderedDict[str, ProcessedItem] = collections.OrderedDict()
        self._bytes = 0

    @staticmethod
    def _size(item: ProcessedItem) -> int:
        return item.nbytes

    def get(self, key: str) -> ProcessedItem | None:
        item = self._items.get(key)
        if item is not None:
            self._items.move_to_end(key)
        return item

    def put(self, key: str, item: ProcessedItem) -> None:
        size = self._size(item)
        if size > self.capacity_bytes or key in self._items:
            return
        self._items[key] = item
        self._bytes += size
        while self._bytes > self.capacity_bytes:
            _, old = self._items.popitem(last=False)
            self._bytes -= self._size(old)


@dataclass
class EngineStats:
    encoder_runs: int = 0
    items_encoded: int = 0
    batch_sizes: list[int] = field(default_factory=list)


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
        # Misses of concurrent requests share a run up to this many tokens (the runner's largest
        # bucket at most); the first job of a run is always taken, so a larger item runs alone.
        self.batch_tokens = min(batch_tokens or runner.max_batch_tokens, runner.max_batch_tokens)
        self.metrics = metrics
        self.model_id = model_id
        self.preprocess_fingerprint = preprocess_fingerprint
        self._inputs = _InputCache(input_cache_bytes)
        self._preprocess_pool = ThreadPoolExecutor(preprocess_workers, thread_name_prefix="epd-preprocess")
        # One thread owns the encoder graph: runs are serialized, batches form while it is busy.
        self._encoder_pool = ThreadPoolExecutor(1, thread_name_prefix="epd-encoder")
        self._inflight: dict[str, _Flight] = {}
        # The metadata of each cached item, for the response; pruned in housekeeping().
        self._metas: dict[str, ItemMeta] = {}
        self._pending: collections.deque[_Job] = collections.deque()  # misses waiting for a run
        self._queued_tokens = 0  # merged tokens of the misses waiting or running (epd_encoder_queue_tokens)
        self._wake: asyncio.Event | None = None
        self._batcher: asyncio.Task[None] | None = None
        self._admit_lock: asyncio.Lock | None = None
        self.stats = EngineStats()
        self._expired_counted = 0  # cache lease expiries already added to the metric

    # --- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        self._wake = asyncio.Event()
        self._admit_lock = asyncio.Lock()
        self._batcher = asyncio.create_task(self._batch_loop(), name="epd-batcher")
        self.update_gauges()

    async def stop(self) -> None:
        if self._batcher is not None:
            self._batcher.cancel()
            try:
                await self._batcher
            except asyncio.CancelledError:
                pass
        for flight in self._inflight.values():
            if not flight.future.done():
                flight.future.set_exception(EpdError("encoder shutting down"))
        self._preprocess_pool.shutdown(wait=False, cancel_futures=True)
        self._encoder_pool.shutdown(wait=True)

    # --- hashing -----------------------------------------------------------------------

    def mm_hash(self, content_hash: str) -> str:
        return media.mm_hash(self.model_id, self.preprocess_fingerprint, content_hash)

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
        hashes = [self.mm_hash(c) for c in content]

        leases: dict[str, Lease] = {}
        metas: dict[str, ItemMeta] = {}
        waiters: dict[str, _Waiter] = {}
        errors: dict[str, EpdError] = {}
        misses: dict[str, int] = {}  # mm_hash -> index of the first item carrying it
        try:
            for i, h in enumerate(hashes):
                self.metrics.device_queries.inc()  # every item is a layer-3 query
                if h in leases or h in waiters or h in misses:
                    continue
                flight = self._inflight.get(h)
                if flight is not None:  # coalesce with the run already scheduled for it
                    waiters[h] = flight.join(consumer_id)
                    continue
                # Pin a hit before anything below may evict to make room for misses.
                if not self._pin_hit(h, consumer_id, leases, metas):
                    misses[h] = i

            processed = await self._preprocess(items, content, misses, hashes, errors)
            self._refuse_oversized(processed, errors)
            if processed:
                async with self._admit_lock:
                    jobs = self._admit(processed, consumer_id, waiters, leases, metas)
                self.metrics.device_misses.inc(len(jobs))
                self._enqueue(jobs)
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
                    leases[h] = waiter.lease
                    metas[h] = waiter.flight.meta
        except BaseException:
            self._abandon(leases, waiters)
            raise

        fresh = {h for h, w in waiters.items() if w.flight.owner is w}
        located = {h: self._hand_out(h, lease, metas[h], hit=h not in fresh) for h, lease in leases.items()}
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

    def _refuse_oversized(self, processed: dict[str, ProcessedItem], errors: dict[str, EpdError]) -> None:
        """An item larger than the whole cache can never be admitted: a per-item error, not a stall."""
        layout = self.cache.layout
        for h in [h for h, item in processed.items() if layout.blocks_for_tokens(item.num_tokens)
                  > layout.num_usable_blocks]:
            item = processed.pop(h)
            errors[h] = LimitExceededError(
                f"item of {item.num_tokens} tokens needs {layout.blocks_for_tokens(item.num_tokens)} blocks "
                f"of {layout.block_size}; this encoder's cache has {layout.num_usable_blocks}")

    def _abandon(self, leases: dict[str, Lease], waiters: dict[str, _Waiter]) -> None:
        """Give back what a failed request holds: its leases, and its place in pending runs."""
        for waiter in waiters.values():
            waiter.cancelled = True
            if waiter.lease is not None:
                self.cache.release(waiter.lease.lease_id)
        for lease in leases.values():
            self.cache.release(lease.lease_id)

    def lookup(self, mm_hashes: Sequence[str], consumer_id: str) -> list[Located | Failed]:
        out: list[Located | Failed] = []
        for h in mm_hashes:
            lease = self.cache.acquire(h, owner=consumer_id)  # handed out at once: the ttl runs now
            if lease is None:
                out.append(Failed(h, NotFoundError(f"mm_hash {h} is not in the encoder cache")))
            else:
                out.append(_located(h, lease, self._metas.get(h, ItemMeta()), hit=True))
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
        for h in [h for h in self._metas if not self.cache.contains(h)]:
            del self._metas[h]
        self.update_gauges()

    def update_gauges(self) -> None:
        occ = self.cache.occupancy()  # one consistent snapshot
        self.metrics.set_occupancy(occ.active_blocks, occ.free_blocks, occ.held_blocks, occ.active_real_tokens)
        self.metrics.leases_active.set(self.cache.lease_stats.active)

    # --- internals -----------------------------------------------------------------------

    async def _preprocess(
        self,
        items: Sequence[MediaInput],
        content: Sequence[str],
        misses: dict[str, int],
        hashes: Sequence[str],
        errors: dict[str, EpdError],
    ) -> dict[str, ProcessedItem]:
        """Pixels for every miss, through the layer-1 cache; bad media become per-item errors."""
        loop = asyncio.get_running_loop()
        processed: dict[str, ProcessedItem] = {}
        pending: dict[str, asyncio.Future[ProcessedItem]] = {}
        for h, i in misses.items():
            self.metrics.mm_cache_queries.inc()
            cached = self._inputs.get(content[i])
            if cached is not None:
                self.metrics.mm_cache_hits.inc()
                processed[h] = cached
            else:
                pending[h] = loop.run_in_executor(self._preprocess_pool, self._decode, items[i], i)
        for h, fut in pending.items():
            i = misses[h]
            try:
                item = await fut
            except InvalidMediaError as exc:
                errors[h] = exc
                continue
            self._inputs.put(content[i], item)
            processed[h] = item
        return processed

    def _decode(self, source: MediaInput, index: int) -> ProcessedItem:
        label = f"item {index}" + (f" ({source.label})" if source.label else "")
        frames = [bytes(f) for f in source.frames]  # copied only for items that are decoded
        if source.kind == "image":
            return self.preprocessor.image(frames[0], item=label)
        return self.preprocessor.video(frames, fps=source.fps, item=label)

    def _admit(
        self, processed: dict[str, ProcessedItem], consumer_id: str, waiters: dict[str, _Waiter],
        leases: dict[str, Lease], metas: dict[str, ItemMeta],
    ) -> list[_Job]:
        """Allocate blocks for every miss, all or nothing; runs under the admission lock.

        A miss may have changed while its pixels were decoded: another request
        admitted it (join that run) or even finished it (a hit now: lease it,
        pending, into ``leases``). Only an item absent from the cache gets blocks.
        """
        layout = self.cache.layout
        todo: dict[str, ProcessedItem] = {}
        for h, item in processed.items():
            flight = self._inflight.get(h)
            if flight is not None:  # another request admitted it while we decoded
                waiters[h] = flight.join(consumer_id)
            elif not self._pin_hit(h, consumer_id, leases, metas):  # ... or even finished it
                todo[h] = item
        if not todo:
            return []
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
        jobs: list[_Job] = []
        try:
            for h, item in todo.items():
                block_ids = self.cache.allocate(h, plans[h])
                if block_ids is None:
                    raise CacheFullError(
                        f"freed blocks are still inside the {self.cache.min_hold_time_ms} ms hold",
                        retry_after_ms=self._retry_hint_ms())
                flight = _Flight(loop.create_future(), item.meta)
                waiters[h] = flight.join(consumer_id, owner=True)
                self._inflight[h] = flight
                self._metas[h] = item.meta
                jobs.append(_Job(h, item, block_ids, plans[h], flight))
        except BaseException:
            for job in jobs:  # never written, never handed out: straight back to free
                self.cache.free(job.mm_hash)
                del self._inflight[job.mm_hash]
                waiters.pop(job.mm_hash, None)
            raise
        return jobs

    def _pin_hit(self, mm_hash: str, consumer_id: str, leases: dict[str, Lease],
                 metas: dict[str, ItemMeta]) -> bool:
        """Lease a cached item, pending, into ``leases``; ``False`` if it is absent or unwritten."""
        lease = self.cache.acquire(mm_hash, owner=consumer_id, pending=True)
        if lease is None:
            return False
        leases[mm_hash] = lease
        metas[mm_hash] = self._metas.get(mm_hash, ItemMeta())
        return True

    def _fail_runs(self, batch: list[_Job], message: str) -> None:
        """Fail every run of ``batch`` not finished yet; its unwritten blocks go back to free."""
        for job in batch:
            if self._inflight.get(job.mm_hash) is job.flight:
                del self._inflight[job.mm_hash]
                if not self.cache.is_written(job.mm_hash):
                    self.cache.free(job.mm_hash)
            if not job.flight.future.done():
                job.flight.future.set_exception(EpdError(message))

    def _retry_hint_ms(self) -> int:
        hint = self.cache.next_reusable_in_ms()
        return max(1, hint if hint is not None else max(self.cache.min_hold_time_ms, 50))

    def _enqueue(self, jobs: list[_Job]) -> None:
        assert self._wake is not None
        self._pending.extend(jobs)
        if jobs:
            self._queued_tokens += sum(job.item.num_tokens for job in jobs)
            self.metrics.queue_tokens.set(self._queued_tokens)
            self._wake.set()

    async def _batch_loop(self) -> None:
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        pending = self._pending
        while True:
            if not pending:
                self._wake.clear()
                await self._wake.wait()
                continue
            # The first job always runs (an item above the budget runs alone); then take
            # jobs in order while they fit, stopping before the batch overflows the budget.
            batch = [pending.popleft()]
            tokens = batch[0].item.num_tokens
            while pending and tokens + pending[0].item.num_tokens <= self.batch_tokens:
                tokens += pending[0].item.num_tokens
                batch.append(pending.popleft())
            try:
                await self._run_batch(loop, batch)
            except Exception as exc:  # a bug past the run: fail loudly, but the encoder serves on
                logger.exception("encoder batch of %d items failed after its run", len(batch))
                self._fail_runs(batch, f"encoder batch failed: {exc}")
            finally:
                self._queued_tokens -= tokens
                self.metrics.queue_tokens.set(self._queued_tokens)

    async def _run_batch(self, loop: asyncio.AbstractEventLoop, batch: list[_Job]) -> None:
        cache = self.cache
        started = time.perf_counter()
        try:
            await loop.run_in_executor(
                self._encoder_pool,
                self.runner.write,
                [j.item for j in batch],
                [j.block_ids for j in batch],
                [j.tokens_per_block for j in batch],
                cache.buffer,
                cache.layout.scratch_block_id,
            )
        except Exception as exc:  # the graph failed: nothing of this batch is servable
            logger.exception("encoder run failed for %d items", len(batch))
            self._fail_runs(batch, f"encoder run failed: {exc}")
            return
        self.metrics.encode_latency.observe(time.perf_counter() - started)
        self.stats.encoder_runs += 1
        self.stats.items_encoded += len(batch)
        self.stats.batch_sizes.append(len(batch))
        for job in batch:
            cache.mark_written(job.mm_hash)
            self._inflight.pop(job.mm_hash, None)
            # Lease for every live waiter now, before any other request can evict the item;
            # pending: each request starts the ttl when it answers.
            for waiter in job.flight.waiters:
                if not waiter.cancelled:
                    waiter.lease = cache.acquire(job.mm_hash, owner=waiter.consumer_id, pending=True)
            if not job.flight.future.done():
                job.flight.future.set_result(None)
        self.update_gauges()
