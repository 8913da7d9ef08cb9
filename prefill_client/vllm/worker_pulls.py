"""The connector's worker-side path: every worker pulls into its own device, the scheduler tracks.

Scheduler (:class:`WorkerPulls`): decides which request's items to pull and when, holds the
leases, and says an item "is available" only once **every** rank reported its rows verified;
it never touches a row. Worker (:class:`WorkerLoader`, one per tensor-parallel rank): pulls the
ordered items with the client library (one block READ, one tag READ, the checks) into a landing
pool registered with NIXL on its own device, checks each item's shape against the model, and
keeps the rows until the step that gathers them puts them into ``encoder_cache``.

What travels where (:mod:`prefill_client.vllm.channel`): orders and reports on the side
channel; the ids to place and to drop in the step's connector metadata, so a drop can never
overtake the step that places the same rows.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from common.config import PrefillConfig
from common.errors import ConfigError, ECLoadFailure, EpdError, LoadFailureReason
from common.metrics import PrefillMetrics
from prefill_client.vllm.channel import SchedulerChannel, WorkerChannel
from prefill_client.vllm.items import Wanted, shape_problem, wanted_items, worker_device
from prefill_client.handoff import KEY, from_params, to_params

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from prefill_client.consumer.client import EncoderCacheClient
    from prefill_client.handoff import Placement

logger = logging.getLogger(__name__)

PULL_THREADS = 2
# Workers join at engine start; a channel still short of ranks after this fails requests, loudly.
WORKER_JOIN_TIMEOUT_S = 120.0


@dataclass
class _Job:
    """One batched pull of some of a request's items, by every rank."""

    job_id: str
    rid: str
    wanted: list[Wanted]
    placements: list[Placement] = field(default_factory=list)
    locating: concurrent.futures.Future[list[Placement]] | None = None
    sent: bool = False
    blocks: int = 0
    ok: set[int] = field(default_factory=set)  # ranks whose rows are in and verified
    started: float = field(default_factory=time.monotonic)

    @property
    def identifiers(self) -> list[str]:
        return [w.identifier for w in self.wanted]


@dataclass
class StepOrders:
    """What the step's connector metadata tells the workers, in step order."""

    place: list[str] = field(default_factory=list)  # identifiers to put into encoder_cache
    drop: list[tuple[str, str]] = field(default_factory=list)  # (identifier, job): rows nobody needs any more


class WorkerPulls:
    """Scheduler side of the worker path: orders, tracking across ranks, leases; never rows."""

    def __init__(self, client: EncoderCacheClient, channel: SchedulerChannel, landing_blocks: int,
                 job_deadline_s: float | None = None) -> None:
        """``job_deadline_s``: how long every rank has to report a pull; past it the request fails
        (by default what the client's own deadlines allow a pull: two RPCs, four transfer waits, 5 s)."""
        self.client = client
        self.job_deadline_s = job_deadline_s if job_deadline_s is not None else (
            2 * client.rpc_timeout_s + 4 * client.pull_timeout_s + 5.0)
        self.metrics = client.metrics
        self.channel = channel
        self.landing_blocks = landing_blocks
        self._ids = itertools.count()
        self._started = time.monotonic()
        # Lookups and lease releases are RPCs: never on the scheduler's thread.
        self._threads = concurrent.futures.ThreadPoolExecutor(PULL_THREADS, thread_name_prefix="epd-locate")
        self._ready: dict[str, str] = {}  # identifier -> job whose rows every rank holds
        self._inflight: dict[str, _Job] = {}  # identifier -> job pulling it
        self._jobs: dict[str, _Job] = {}
        self._blocks_in_flight = 0
        self._users: defaultdict[str, set[str]] = defaultdict(set)  # identifier -> request ids
        self._alive: set[str] = set()
        self._unavailable: dict[str, str] = {}  # request id -> why
        self._reported: set[str] = set()
        self._orders = StepOrders()

    # --- vLLM's scheduler-side hooks ---------------------------------------------------------

    def has(self, identifier: str) -> bool:
        return identifier in self._ready

    def ensure(self, request: Request, num_computed_tokens: int) -> bool:
        self.progress()
        rid = request.request_id
        if rid in self._unavailable or rid in self._reported:
            return False
        self._alive.add(rid)
        wanted = wanted_items(request, num_computed_tokens)
        for w in wanted:
            self._users[w.identifier].add(rid)
        missing = [w for w in wanted if w.identifier not in self._ready]
        if not missing:
            return True
        if not self.channel.ready:
            waited = time.monotonic() - self._started
            if waited > WORKER_JOIN_TIMEOUT_S:
                self._fail(rid, f"only {self.channel.joined} of {self.channel.ranks} vLLM workers joined the "
                                f"connector's channel ({self.channel.address}) in {waited:.0f} s")
            return False
        new = [w for w in missing if w.identifier not in self._inflight]  # others' jobs pull the rest
        if new:
            self._start(rid, new, getattr(request, "ec_transfer_params", None))
        return False

    def take_unavailable(self) -> set[str]:
        self.progress()
        out = set(self._unavailable)
        self._reported |= out
        self._unavailable.clear()
        return out

    def allocated(self, identifier: str) -> None:
        if identifier in self._ready:
            self._orders.place.append(identifier)

    def take_orders(self) -> StepOrders:
        out, self._orders = self._orders, StepOrders()
        return out

    def finished(self, request: Request) -> None:
        rid = request.request_id
        self._alive.discard(rid)
        self._unavailable.pop(rid, None)
        self._reported.discard(rid)
        for feature in request.mm_features:
            users = self._users.get(feature.identifier)
            if users is None:
                continue
            users.discard(rid)
            if users:
                continue
            del self._users[feature.identifier]
            job_id = self._ready.pop(feature.identifier, None)
            if job_id is not None:
                self._orders.drop.append((feature.identifier, job_id))
                continue
            job = self._inflight.get(feature.identifier)
            if job is not None and not any(i in self._users for i in job.identifiers):
                self._end(job, cancel=True)  # nobody waits for any of its items any more

    def close(self) -> None:
        self._threads.shutdown(wait=True, cancel_futures=True)
        self.channel.close()
        self.client.close()

    # --- jobs --------------------------------------------------------------------------------

    def _start(self, rid: str, new: list[Wanted], params: Mapping[str, Any] | None) -> None:
        try:
            placed = from_params(params)
        except ConfigError as exc:
            self._fail(rid, f"bad ec_transfer_params: {exc}")
            return
        with_location = [placed[w.identifier] for w in new if w.identifier in placed]
        blocks = sum(len(p.location.block_ids) for p in with_location)
        if self._blocks_in_flight and self._blocks_in_flight + blocks > self.landing_blocks:
            return  # the workers' landing pools are spoken for: this request waits its turn
        job = _Job(f"{next(self._ids)}", rid, new, with_location)
        self._jobs[job.job_id] = job
        for w in new:
            self._inflight[w.identifier] = job
        by_lookup = [w.identifier for w in new if w.identifier not in placed]
        if by_lookup:
            job.locating = self._threads.submit(self.client.locate, by_lookup)
        else:
            self._send(job)

    def _send(self, job: _Job) -> None:
        job.blocks = sum(len(p.location.block_ids) for p in job.placements)
        job.sent = True
        job.started = time.monotonic()
        self._blocks_in_flight += job.blocks
        self.channel.send({"op": "pull", "job": job.job_id, "items": to_params(job.placements)[KEY]["items"],
                           "expect": {w.identifier: w.num_embeds for w in job.wanted}})

    def progress(self) -> None:
        """Take finished lookups and the workers' reports (called from every hook that decides)."""
        for job in [j for j in self._jobs.values() if j.locating is not None and j.locating.done()]:
            assert job.locating is not None
            try:
                job.placements += job.locating.result()
            except ECLoadFailure as exc:  # counted by the client
                self._failed(job, str(exc), None)
                continue
            except EpdError as exc:
                self._failed(job, f"{type(exc).__name__}: {exc}", LoadFailureReason.HANDSHAKE.value)
                continue
            except Exception as exc:
                logger.exception("EpdCacheConnector: lookup for request %s failed unexpectedly", job.rid)
                self._failed(job, f"{type(exc).__name__}: {exc}", LoadFailureReason.HANDSHAKE.value)
                continue
            job.locating = None
            self._send(job)
        for msg in self.channel.poll():
            self._report(msg)
        now = time.monotonic()
        for job in [j for j in self._jobs.values() if j.sent and now - j.started > self.job_deadline_s]:
            silent = sorted(set(range(self.channel.ranks)) - job.ok)
            self._failed(job, f"EC load failure (timeout) for mm_hash {job.identifiers[0]}: tensor-parallel "
                              f"rank(s) {silent} did not report the pull within {self.job_deadline_s:.1f} s",
                         LoadFailureReason.TIMEOUT.value)

    def _report(self, msg: Mapping[str, Any]) -> None:
        job = self._jobs.get(str(msg.get("job")))
        if job is None:
            return  # a job already failed or cancelled: its late reports change nothing
        rank = int(msg["rank"])
        if msg.get("op") == "failed":
            self._failed(job, f"{msg.get('why')} (tensor-parallel rank {rank})", str(msg.get("reason")))
            return
        if set(msg.get("ok", ())) != set(job.identifiers):
            self._failed(job, f"rank {rank} reported {sorted(msg.get('ok', ()))} of {job.identifiers}",
                         LoadFailureReason.TOKEN_COUNT.value)
            return
        if rank == 0:  # every rank pulls the same bytes: the metrics count one rank's pulls
            self.metrics.pulls.inc(int(msg.get("pulled", 0)))
            self.metrics.pull_bytes.inc(int(msg.get("bytes", 0)))
            if msg.get("pulled"):
                self.metrics.pull_latency.observe(float(msg.get("seconds", 0.0)))
        job.ok.add(rank)
        if len(job.ok) >= self.channel.ranks:
            for identifier in job.identifiers:
                self._ready[identifier] = job.job_id
            self._end(job, cancel=False)

    def _failed(self, job: _Job, why: str, reason: str | None) -> None:
        if reason is not None:
            self.metrics.load_failures.labels(reason=reason).inc()
        if job.rid in self._alive:
            self._fail(job.rid, why)
        self._end(job, cancel=True)

    def _end(self, job: _Job, *, cancel: bool) -> None:
        """The job is over: forget it, give its leases back once (in the placer's name), and with
        ``cancel`` tell the ranks to throw away what they landed of it."""
        self._jobs.pop(job.job_id, None)
        for identifier in job.identifiers:
            if self._inflight.get(identifier) is job:
                del self._inflight[identifier]
        if job.sent:
            self._blocks_in_flight -= job.blocks
            if cancel:
                self.channel.send({"op": "cancel", "job": job.job_id})
        if job.locating is not None:
            # A lookup still running hands its leases to this job's release when it ends.
            job.locating.add_done_callback(self._release_located)
        if job.placements:
            self._threads.submit(self.client.release_placed, list(job.placements), handshake=True)

    def _release_located(self, done: concurrent.futures.Future[list[Placement]]) -> None:
        if not done.cancelled() and done.exception() is None:
            self.client.release_placed(done.result(), handshake=True)

    def _fail(self, rid: str, why: str) -> None:
        logger.warning("EpdCacheConnector: request %s fails: %s", rid, why)
        self._unavailable[rid] = why


@dataclass
class _Landed:
    job: str
    rows: torch.Tensor


class WorkerLoader:
    """Worker side of the worker path: pulls what the scheduler orders into this rank's device."""

    def __init__(self, client: EncoderCacheClient, width: int | None, dtype: torch.dtype,
                 channel_address: str, rank: int, device: torch.device) -> None:
        self.client = client
        self.width = width
        self.dtype = dtype
        self.rank = rank
        self.device = device
        self._threads = concurrent.futures.ThreadPoolExecutor(PULL_THREADS, thread_name_prefix="epd-pull")
        self._lock = threading.Lock()
        self._landed: dict[str, _Landed] = {}
        self._running: set[str] = set()
        self._cancelled: set[str] = set()
        self.channel = WorkerChannel(channel_address, rank, self._order)

    @classmethod
    def start(cls, cfg: PrefillConfig, width: int | None, dtype: torch.dtype, channel_address: str,
              rank: int) -> WorkerLoader:
        from prefill_client.consumer.client import EncoderCacheClient

        device = worker_device()
        client = EncoderCacheClient.from_config(cfg, PrefillMetrics(), landing_device=device, probe_connections=True)
        logger.info("EpdCacheConnector worker rank %d: pulls into %s, landing pool of %d blocks", rank, device,
                    cfg.landing_blocks)
        return cls(client, width, dtype, channel_address, rank, device)

    @property
    def landed(self) -> int:
        with self._lock:
            return len(self._landed)

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

    def _order(self, msg: Mapping[str, Any]) -> None:
        op, job = msg.get("op"), str(msg.get("job"))
        if op == "pull":
            with self._lock:
                self._running.add(job)
            self._threads.submit(self._pull, job, msg)
        elif op == "cancel":
            with self._lock:
                if job in self._running:
                    self._cancelled.add(job)
                for identifier in [i for i, e in self._landed.items() if e.job == job]:
                    del self._landed[identifier]
        else:
            logger.error("EpdCacheConnector rank %d: unknown order %r", self.rank, op)

    def _pull(self, job: str, msg: Mapping[str, Any]) -> None:
        started = time.perf_counter()
        try:
            placed = from_params({KEY: {"items": msg["items"]}})
            expect: Mapping[str, int] = msg["expect"]
            pulled = self.client.pull_placed(list(placed.values()), keep_leases=True) if placed else []
            rows: dict[str, torch.Tensor] = {}
            for item in pulled:
                problem = shape_problem(item.mm_hash, item.embeddings, int(expect[item.mm_hash]), self.width)
                if problem is not None:
                    raise _ShapeProblem(problem)
                rows[item.mm_hash] = item.embeddings.to(device=self.device, dtype=self.dtype)
            gone = [i for i in expect if i not in rows]
            if gone:
                raise _ShapeProblem(f"item {gone[0]} was not delivered")
        except ECLoadFailure as exc:
            self._failed(job, exc.reason.value, str(exc))
            return
        except _ShapeProblem as exc:
            self._failed(job, LoadFailureReason.TOKEN_COUNT.value, str(exc))
            return
        except (EpdError, ConfigError) as exc:
            self._failed(job, LoadFailureReason.HANDSHAKE.value, f"{type(exc).__name__}: {exc}")
            return
        except Exception as exc:  # never the engine's problem: fail the request, say what happened
            logger.exception("EpdCacheConnector rank %d: pull %s failed unexpectedly", self.rank, job)
            self._failed(job, LoadFailureReason.HANDSHAKE.value, f"{type(exc).__name__}: {exc}")
            return
        with self._lock:
            self._running.discard(job)
            if job in self._cancelled:
                self._cancelled.discard(job)
                return
            for identifier, r in rows.items():
                self._landed[identifier] = _Landed(job, r)
        fetched = [item for item in pulled if item.source != "local"]
        self.channel.report({"op": "done", "job": job, "ok": list(rows), "pulled": len(fetched),
                             "bytes": sum(item.embeddings.numel() * item.embeddings.element_size()
                                          for item in fetched),
                             "seconds": time.perf_counter() - started})

    def _failed(self, job: str, reason: str, why: str) -> None:
        with self._lock:
            self._running.discard(job)
            self._cancelled.discard(job)
        logger.warning("EpdCacheConnector rank %d: pull %s failed: %s", self.rank, job, why)
        self.channel.report({"op": "failed", "job": job, "reason": reason, "why": why})

    def close(self) -> None:
        self._threads.shutdown(wait=True, cancel_futures=True)
        self.channel.close()
        self.client.close()


class _ShapeProblem(Exception):
    pass
