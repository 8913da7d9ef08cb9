"""The worker halves of the two pull strategies (vLLM worker process, one per tensor-parallel rank).

Each puts this step's items into ``encoder_cache`` from the step's orders
(:class:`~.items.StepOrders`, the connector metadata :mod:`.scheduler` built):

- :class:`ShippedRows` (``pull_on=scheduler``): the rows travel in the metadata; copied to
  this worker's device.
- :class:`WorkerLoader` (``pull_on=worker``): pulls what the scheduler orders over the side
  channel (:mod:`.channel`) with the client library (one block READ, one tag READ, the checks)
  into a landing pool registered with NIXL on its own device, checks each item's shape against
  the model, reports, and keeps the rows until the step that gathers them places them (or a
  later step drops them). An order whose items a prefetch hint pulled already takes those
  (:mod:`.prefetch`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from common.malloc import prefault
from common.metrics import PrefillMetrics
from prefill_client.handoff import Cancel, Order, PullDone, PullFailed, PullOrder
from prefill_client.vllm.channel import WorkerChannel
from prefill_client.vllm.items import PULL_THREADS, EngineFacts, StepOrders, check_rows, failure_of, worker_device
from prefill_client.vllm.prefetch import Prefetches

if TYPE_CHECKING:
    from common.config import PrefillConfig
    from prefill_client.consumer.client import EncoderCacheClient
    from prefill_client.consumer.pull import PulledItem

logger = logging.getLogger(__name__)

# How long the pull threads wait for each other while they map memory at start (seconds).
PREFAULT_WAIT_S = 30.0


class WorkerHalf(Protocol):
    """What a worker runs of a strategy, started once the model is resident (``start_worker_services``)."""

    def load(self, step: StepOrders, encoder_cache: dict[str, torch.Tensor]) -> None:
        """Put this step's items into ``encoder_cache`` (``start_load_caches``)."""

    def close(self) -> None: ...


class ShippedRows:
    """Worker side of the scheduler path: the verified rows came in the step's metadata."""

    @classmethod
    def start(cls, cfg: PrefillConfig, engine: EngineFacts, rank: int) -> ShippedRows:
        return cls(engine.dtype, worker_device())

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype = dtype
        self.device = device

    def load(self, step: StepOrders, encoder_cache: dict[str, torch.Tensor]) -> None:
        for identifier, rows in step.rows.items():
            if identifier not in encoder_cache:
                encoder_cache[identifier] = rows.to(device=self.device, dtype=self.dtype)

    def close(self) -> None:
        return


@dataclass
class _Landed:
    job: str
    rows: torch.Tensor


class WorkerLoader:
    """Worker side of the worker path: pulls what the scheduler orders into this rank's device."""

    def __init__(self, client: EncoderCacheClient, width: int | None, dtype: torch.dtype,
                 channel_address: str, rank: int, device: torch.device, prefault_bytes: int = 0,
                 prefetch_blocks: int = 0) -> None:
        """``prefetch_blocks``: blocks of items pulled ahead on prefetch hints this rank keeps at
        most (:class:`~.prefetch.Prefetches`); 0: it takes no hints."""
        self.client = client
        self.width = width
        self.dtype = dtype
        self.rank = rank
        self.device = device
        self._threads = concurrent.futures.ThreadPoolExecutor(PULL_THREADS, thread_name_prefix="epd-pull")
        if prefault_bytes and device.type == "cpu":
            self._prefault(prefault_bytes)
        self._lock = threading.Lock()
        self._landed: dict[str, _Landed] = {}
        self._running: set[str] = set()
        self._cancelled: set[str] = set()
        self.prefetches: Prefetches | None = None
        if prefetch_blocks > 0:
            self.prefetches = Prefetches(lambda placements: client.pull_placed(placements, keep_leases=True),
                                         prefetch_blocks)
        self.channel = WorkerChannel(channel_address, rank, self._order,
                                     self.prefetches.hint if self.prefetches is not None else None)

    @classmethod
    def start(cls, cfg: PrefillConfig, engine: EngineFacts, rank: int) -> WorkerLoader:
        from prefill_client.consumer.client import EncoderCacheClient

        device = worker_device()
        client = EncoderCacheClient.from_config(cfg, PrefillMetrics(), landing_device=device, probe_connections=True)
        logger.info("EpdCacheConnector worker rank %d: pulls into %s, landing pool of %d blocks", rank, device,
                    cfg.landing_blocks)
        return cls(client, engine.width, engine.dtype, engine.channel, rank, device, cfg.prefault_mib << 20,
                   cfg.prefetch_blocks)

    def _prefault(self, nbytes: int) -> None:
        """Start every pull thread, each mapping its share of ``nbytes`` for the rows it will gather
        (:func:`common.malloc.prefault`: the memory stays in that thread's malloc arena)."""
        started = time.perf_counter()
        meet = threading.Barrier(PULL_THREADS)  # one share per thread: each waits for the others

        def share() -> bool:
            done = prefault(nbytes // PULL_THREADS)
            try:
                meet.wait(timeout=PREFAULT_WAIT_S)
            except threading.BrokenBarrierError:
                pass
            return done

        futures = [self._threads.submit(share) for _ in range(PULL_THREADS)]
        finished, _ = concurrent.futures.wait(futures, timeout=2 * PREFAULT_WAIT_S)
        done = sum(f.result() for f in finished)
        logger.info("EpdCacheConnector worker rank %d: %d of %d pull threads mapped %d MiB for rows in %.0f ms",
                    self.rank, done, PULL_THREADS, nbytes >> 20, (time.perf_counter() - started) * 1e3)

    @property
    def landed(self) -> int:
        with self._lock:
            return len(self._landed)

    def load(self, step: StepOrders, encoder_cache: dict[str, torch.Tensor]) -> None:
        self.place(step.place, encoder_cache)
        self.drop(step.drop)

    def place(self, identifiers: Sequence[str], encoder_cache: dict[str, torch.Tensor]) -> None:
        """Put this step's items into ``encoder_cache`` (the scheduler ordered only rows every rank holds)."""
        with self._lock:
            for identifier in identifiers:
                if identifier in encoder_cache:
                    continue
                entry = self._landed.get(identifier)
                if entry is None:  # would be a broken promise of the scheduler: say it loudly
                    logger.error("EpdCacheConnector rank %d: told to place %s, which it does not hold",
                                 self.rank, identifier)
                    continue
                encoder_cache[identifier] = entry.rows

    def drop(self, pairs: Sequence[tuple[str, str]]) -> None:
        with self._lock:
            for identifier, job in pairs:
                entry = self._landed.get(identifier)
                if entry is not None and entry.job == job:
                    del self._landed[identifier]

    def _order(self, order: Order) -> None:
        """The channel's thread: must not block (a pull goes to the pool)."""
        if isinstance(order, PullOrder):
            with self._lock:
                self._running.add(order.job)
            self._threads.submit(self._pull, order)
        elif isinstance(order, Cancel):
            with self._lock:
                if order.job in self._running:
                    self._cancelled.add(order.job)
                for identifier in [i for i, e in self._landed.items() if e.job == order.job]:
                    del self._landed[identifier]

    def _pull(self, order: PullOrder) -> None:
        started = time.perf_counter()
        ahead: dict[str, PulledItem] = {}
        try:
            rest = list(order.placements)
            if self.prefetches is not None and rest:
                ahead, rest = self.prefetches.claim(rest, self.client.pull_timeout_s)
            pulled = [*ahead.values(), *(self.client.pull_placed(rest, keep_leases=True) if rest else [])]
            got = {item.mm_hash: item.embeddings for item in pulled}
            check_rows(order.expect, got, self.width)
            rows = {identifier: got[identifier].to(device=self.device, dtype=self.dtype) for identifier in order.expect}
        except Exception as exc:  # never the engine's problem: report it, the scheduler fails the request
            failure = failure_of(exc, f"rank {self.rank}: pull {order.job}")
            with self._lock:
                self._running.discard(order.job)
                self._cancelled.discard(order.job)
            logger.warning("EpdCacheConnector rank %d: pull %s failed: %s", self.rank, order.job, failure.why)
            self.channel.report(PullFailed(order.job, self.rank, failure.reason, failure.why))
            return
        with self._lock:
            self._running.discard(order.job)
            if order.job in self._cancelled:
                self._cancelled.discard(order.job)
                return
            for identifier, r in rows.items():
                self._landed[identifier] = _Landed(order.job, r)
        fetched = [item for item in pulled if item.source != "local"]
        prefetched = sum(item.source != "local" for item in ahead.values())
        self.channel.report(PullDone(order.job, self.rank, tuple(rows), len(fetched),
                                     sum(item.embeddings.numel() * item.embeddings.element_size() for item in fetched),
                                     time.perf_counter() - started, prefetched))

    def close(self) -> None:
        self._threads.shutdown(wait=True, cancel_futures=True)
        self.channel.close()
        if self.prefetches is not None:
            self.prefetches.close()
        self.client.close()
