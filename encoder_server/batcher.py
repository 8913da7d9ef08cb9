"""The encoder thread's queue: misses of concurrent requests batched into runs that write the cache (encoder process).

The engine admits a request's misses (their blocks allocated) and schedules them here as
jobs. One thread owns the encoder graph, so runs are serialized and a batch forms while it
is busy: the first job waiting always runs (an item above the budget runs alone), then the
jobs behind it while they fit ``batch_tokens`` and batching pays (:func:`next_batch`).
Once a run has written its items, every request waiting for one of them gets its lease at
once, before any other request can evict the item.

When batching pays. A run of ``n`` merged tokens takes about ``fixed + per_token * n``
seconds (:class:`RunCosts` fits the line to the last runs). An item of ``m`` tokens added to
a run delays the run's other items by ``per_token * m`` and saves the ``fixed`` cost of a run
of its own; for equal items, one run of ``k`` finishes them all later on average than ``k``
runs in turn unless ``per_token * m <= fixed``. A GPU's runs should cost mostly their launch (they batch);
a CPU running a tower of real size spends in proportion to the tokens (one at a time: on the
Qwen3-VL-2B-width tower, three 224 px images in one run took 1.4-1.6 s each against 1.4-1.9 s
alone, and held three of the first four first tokens for the whole run). Two exceptions keep
batching: while more tokens wait than one run holds (a queue that grows needs the throughput),
and while the delay is under :data:`BATCH_DELAY_FLOOR_S` (nothing worth weighing).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common.errors import EpdError
from common.metrics import EncoderMetrics
from common.placeholder import ItemMeta
from encoder_server.cache_blocks import EncoderCacheBlocks, Lease

if TYPE_CHECKING:
    from encoder_server.engine import ProcessedItem, Runner

logger = logging.getLogger(__name__)

# An item's delay to its run's other items under this is not weighed: it joins (small towers, GPUs).
BATCH_DELAY_FLOOR_S = 0.005
RUN_HISTORY = 64  # the runs RunCosts fits its line to (older ones forgotten: the load changes)


@dataclass(slots=True)
class Waiter:
    """A request waiting for an item's encoder run; gets its lease the moment the item is written."""

    consumer_id: str
    flight: Flight
    lease: Lease | None = None
    cancelled: bool = False


@dataclass(slots=True)
class Flight:
    """One scheduled encoder run of one item, and every request waiting for it."""

    future: asyncio.Future[None]
    meta: ItemMeta
    waiters: list[Waiter] = field(default_factory=list)
    owner: Waiter | None = None  # the request whose miss scheduled the run

    def join(self, consumer_id: str, owner: bool = False) -> Waiter:
        waiter = Waiter(consumer_id, self)
        self.waiters.append(waiter)
        if owner:
            self.owner = waiter
        return waiter


@dataclass(frozen=True, slots=True)
class EncodeJob:
    """One admitted miss: the item, the blocks its rows go to, and the run its requests wait for."""

    mm_hash: str
    item: ProcessedItem
    block_ids: list[int]
    tokens_per_block: list[int]
    flight: Flight


@dataclass(slots=True)
class RunStats:
    """The encoder runs since start; a histogram, so it stays small however long the encoder lives."""

    encoder_runs: int = 0
    items_encoded: int = 0
    batch_sizes: collections.Counter[int] = field(default_factory=collections.Counter)  # items per run -> runs


class RunCosts:
    """What the encoder's runs cost: ``fixed + per_token * tokens`` seconds, fitted (least squares)
    to the last :data:`RUN_HISTORY` runs. Unknown until those runs had two sizes at least."""

    def __init__(self, history: int = RUN_HISTORY) -> None:
        self._runs: collections.deque[tuple[int, float]] = collections.deque(maxlen=history)
        self._fit: tuple[float, float] | None = None  # of the runs now

    def add(self, tokens: int, seconds: float) -> None:
        """One more run; the line is fitted again (once a run, not once a candidate item)."""
        self._runs.append((tokens, seconds))
        self._fit = self._least_squares()

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), or None while the runs do not tell them apart."""
        return self._fit

    def _least_squares(self) -> tuple[float, float] | None:
        runs = self._runs
        if len({tokens for tokens, _ in runs}) < 2:
            return None
        mean_x = sum(tokens for tokens, _ in runs) / len(runs)
        mean_y = sum(seconds for _, seconds in runs) / len(runs)
        sxx = sum((tokens - mean_x) ** 2 for tokens, _ in runs)
        sxy = sum((tokens - mean_x) * (seconds - mean_y) for tokens, seconds in runs)
        per_token = sxy / sxx
        return mean_y - per_token * mean_x, per_token

    def publish(self, metrics: EncoderMetrics) -> None:
        """The fitted line on ``/metrics`` (``epd_encoder_run_fixed_seconds``,
        ``epd_encoder_run_seconds_per_token``); left as they were while it is unknown."""
        fit = self.fit()
        if fit is not None:
            metrics.run_fixed_seconds.set(fit[0])
            metrics.run_seconds_per_token.set(fit[1])

    def worth_joining(self, tokens: int) -> bool:
        """Whether an item of ``tokens`` should join a run rather than wait for one of its own:
        its cost to the run's other items (``per_token * tokens``) is at most what it saves (a
        run's ``fixed`` cost), or under :data:`BATCH_DELAY_FLOOR_S`; True while the cost is unknown."""
        fit = self.fit()
        if fit is None:
            return True
        fixed, per_token = fit
        return per_token * tokens <= max(fixed, BATCH_DELAY_FLOOR_S)


def next_batch(pending: collections.deque[EncodeJob], waiting_tokens: int, batch_tokens: int,
               costs: RunCosts) -> tuple[list[EncodeJob], int]:
    """Take the next run's jobs off ``pending`` (not empty; ``waiting_tokens`` in all), and their
    tokens: the first always; then, in order, each that fits ``batch_tokens``, while more tokens
    wait than one run holds or it is worth joining (:meth:`RunCosts.worth_joining`)."""
    batch = [pending.popleft()]
    tokens = batch[0].item.num_tokens
    overloaded = waiting_tokens > batch_tokens
    while pending and tokens + pending[0].item.num_tokens <= batch_tokens:
        if not overloaded and not costs.worth_joining(pending[0].item.num_tokens):
            break
        tokens += pending[0].item.num_tokens
        batch.append(pending.popleft())
    return batch, tokens


class EncodeBatcher:
    """Runs scheduled misses on the encoder thread in batches and leases each written item to its waiters."""

    def __init__(self, *, cache: EncoderCacheBlocks, runner: Runner, metrics: EncoderMetrics, batch_tokens: int,
                 after_run: Callable[[], None]) -> None:
        self.cache = cache
        self.runner = runner
        self.metrics = metrics
        self.batch_tokens = batch_tokens
        self._after_run = after_run  # the engine's gauges, refreshed after each run
        # One thread owns the encoder graph: runs are serialized, batches form while it is busy.
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="epd-encoder")
        self._inflight: dict[str, Flight] = {}
        self._pending: collections.deque[EncodeJob] = collections.deque()  # misses waiting for a run
        self._queued_tokens = 0  # merged tokens of the misses waiting or running (epd_encoder_queue_tokens)
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self.stats = RunStats()
        self.costs = RunCosts()

    def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._loop(), name="epd-batcher")

    async def cancel(self) -> None:
        """Take no more jobs; every scheduled run not finished fails its requests."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for flight in self._inflight.values():
            if not flight.future.done():
                flight.future.set_exception(EpdError("encoder shutting down"))

    def shutdown(self) -> None:
        """End the encoder thread once the run on it, if any, is over."""
        self._pool.shutdown(wait=True)

    def flight(self, mm_hash: str) -> Flight | None:
        """The scheduled run of ``mm_hash`` that has not finished, if any."""
        return self._inflight.get(mm_hash)

    def schedule(self, jobs: list[EncodeJob]) -> None:
        """Queue admitted misses; from here on a request missing the same item joins the job's run."""
        assert self._wake is not None, "batcher not started"
        for job in jobs:
            self._inflight[job.mm_hash] = job.flight
        self._pending.extend(jobs)
        if jobs:
            self._queued_tokens += sum(job.item.num_tokens for job in jobs)
            self.metrics.queue_tokens.set(self._queued_tokens)
            self._wake.set()

    async def _loop(self) -> None:
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        pending = self._pending
        while True:
            if not pending:
                self._wake.clear()
                await self._wake.wait()
                continue
            # Between runs the queued tokens are the waiting ones: the last run's left in its finally.
            batch, tokens = next_batch(pending, self._queued_tokens, self.batch_tokens, self.costs)
            try:
                await self._run(loop, batch, tokens)
            except Exception as exc:  # a bug past the run: fail loudly, but the encoder serves on
                logger.exception("encoder batch of %d items failed after its run", len(batch))
                self._fail(batch, f"encoder batch failed: {exc}")
            finally:
                self._queued_tokens -= tokens
                self.metrics.queue_tokens.set(self._queued_tokens)

    async def _run(self, loop: asyncio.AbstractEventLoop, batch: list[EncodeJob], tokens: int) -> None:
        cache = self.cache
        started = time.perf_counter()
        try:
            await loop.run_in_executor(
                self._pool,
                self.runner.write,
                [j.item for j in batch],
                [j.block_ids for j in batch],
                [j.tokens_per_block for j in batch],
                cache.buffer,
                cache.layout.scratch_block_id,
            )
        except Exception as exc:  # the graph failed: nothing of this batch is servable
            logger.exception("encoder run failed for %d items", len(batch))
            self._fail(batch, f"encoder run failed: {exc}")
            return
        elapsed = time.perf_counter() - started
        self.metrics.encode_latency.observe(elapsed)
        self.costs.add(tokens, elapsed)
        self.costs.publish(self.metrics)
        self.stats.encoder_runs += 1
        self.stats.items_encoded += len(batch)
        self.stats.batch_sizes[len(batch)] += 1
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
        self._after_run()

    def _fail(self, batch: list[EncodeJob], message: str) -> None:
        """Fail every run of ``batch`` not finished yet; its unwritten blocks go back to free."""
        for job in batch:
            if self._inflight.get(job.mm_hash) is job.flight:
                del self._inflight[job.mm_hash]
                if not self.cache.is_written(job.mm_hash):
                    self.cache.free(job.mm_hash)
            if not job.flight.future.done():
                job.flight.future.set_exception(EpdError(message))
