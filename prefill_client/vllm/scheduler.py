"""The scheduler halves of the two pull strategies (vLLM scheduler process).

Both extend :class:`~.tracker.PullTracker` (who uses which item, failed requests, the thread
pool, the step's orders, the failure ladder); each decides how an item gets in hand.

- :class:`SchedulerPulls` (``pull_on=scheduler``): the scheduler pulls into host memory in its
  threads and ships the verified rows to every worker inside the step's metadata.
- :class:`WorkerPulls` (``pull_on=worker``): the scheduler orders each pull from every
  tensor-parallel rank over the side channel (:mod:`.channel`), holds the leases, and says an
  item "is available" only once **every** rank reported its rows verified; it never touches a
  row. The step's metadata carries the ids to place and to drop, so a drop can never overtake
  the step that places the same rows. The ranks' half is :class:`~.worker.WorkerLoader`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from common.errors import LoadFailureReason
from prefill_client.handoff import Cancel, PullDone, PullFailed, PullOrder, Report
from prefill_client.vllm.channel import SchedulerChannel
from prefill_client.vllm.items import EngineFacts, Failure, Wanted, check_rows, failure_of
from prefill_client.vllm.tracker import PullTracker

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from common.config import PrefillConfig
    from common.metrics import PrefillMetrics
    from prefill_client.consumer.client import EncoderCacheClient
    from prefill_client.handoff import Placement

# Workers join at engine start; a channel still short of ranks after this fails requests, loudly.
WORKER_JOIN_TIMEOUT_S = 120.0


class SchedulerPulls(PullTracker[torch.Tensor]):
    """The scheduler path: pulls in the background; says "available" only for rows in hand."""

    @classmethod
    def start(cls, cfg: PrefillConfig, engine: EngineFacts, metrics: PrefillMetrics) -> SchedulerPulls:
        from prefill_client.consumer.client import EncoderCacheClient

        return cls(EncoderCacheClient.from_config(cfg, metrics, probe_connections=True), engine.width,
                   cfg.idle_pull_wait_ms / 1e3)

    def __init__(self, client: EncoderCacheClient, width: int | None, idle_wait_s: float = 0.0) -> None:
        super().__init__(client, "epd-pull", idle_wait_s)
        self.width = width
        # request id -> its pull and the placements it holds leases for (given back if it never starts)
        self._jobs: dict[str, tuple[concurrent.futures.Future[dict[str, torch.Tensor]], list[Placement]]] = {}

    def _fetch(self, request: Request, wanted: Sequence[Wanted], missing: Sequence[Wanted]) -> bool:
        rid = request.request_id
        job = self._jobs.get(rid)
        if job is None:
            placed = self._placed(request)
            if placed is not None:
                mine = [placed[w.identifier] for w in missing if w.identifier in placed]
                self._take(mine)
                self._jobs[rid] = (self._threads.submit(self._pull, missing, placed), mine)
            return False
        if not job[0].done():
            return False
        del self._jobs[rid]
        try:
            rows = job[0].result()
        except Exception as exc:  # never the engine's problem: fail the request, say what happened
            self._pull_failed(rid, failure_of(exc, f"pull for request {rid}"))
            return False
        self._held.update(rows)
        return all(w.identifier in self._held for w in wanted)

    def _wait_for_news(self, timeout_s: float) -> None:
        running = [future for future, _ in self._jobs.values() if not future.done()]
        if running:
            concurrent.futures.wait(running, timeout_s, concurrent.futures.FIRST_COMPLETED)
        else:  # a finished pull is taken by the next look; nothing to block on
            super()._wait_for_news(timeout_s)

    def _pull(self, missing: Sequence[Wanted], placed: Mapping[str, Placement]) -> dict[str, torch.Tensor]:
        """Pool thread: one verified pull for the request's missing items (bounded by the client's
        deadlines), each checked against the shape the model and the prompt expect."""
        with_location = [placed[w.identifier] for w in missing if w.identifier in placed]
        by_lookup = [w.identifier for w in missing if w.identifier not in placed]
        out: dict[str, torch.Tensor] = {}
        if with_location:
            for item in self.client.pull_placed(with_location):
                out[item.mm_hash] = item.embeddings
        if by_lookup:
            for ident, looked_up in zip(by_lookup, self.client.lookup(by_lookup, require=True)):
                assert looked_up is not None  # require=True raises instead
                out[ident] = looked_up.embeddings
        check_rows({w.identifier: w.num_embeds for w in missing}, out, self.width)
        return out

    def _order_place(self, identifier: str, held: torch.Tensor) -> None:
        self._step.rows[identifier] = held

    def _request_gone(self, rid: str) -> None:
        job = self._jobs.pop(rid, None)
        if job is not None and job[0].cancel():  # never started: its leases are still out
            self._release(job[1])
        # (one already running ends within the client's deadlines and gives its leases back)


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


class WorkerPulls(PullTracker[str]):
    """Scheduler side of the worker path: orders, tracking across ranks, leases; never rows.

    What it holds of an available item: the job whose rows every rank holds.
    """

    @classmethod
    def start(cls, cfg: PrefillConfig, engine: EngineFacts, metrics: PrefillMetrics) -> WorkerPulls:
        from prefill_client.consumer.client import EncoderCacheClient

        # This client pulls nothing (the workers do): it looks items up and gives leases back.
        client = EncoderCacheClient.from_config(
            dataclasses.replace(cfg, landing_blocks=1, local_cache_blocks=1), metrics)
        return cls(client, SchedulerChannel(engine.channel, engine.ranks), cfg.landing_blocks,
                   idle_wait_s=cfg.idle_pull_wait_ms / 1e3)

    def __init__(self, client: EncoderCacheClient, channel: SchedulerChannel, landing_blocks: int,
                 job_deadline_s: float | None = None, idle_wait_s: float = 0.0) -> None:
        """``job_deadline_s``: how long every rank has to report a pull; past it the request fails
        (by default what the client's own deadlines allow a pull: two RPCs, four transfer waits, 5 s)."""
        super().__init__(client, "epd-locate", idle_wait_s)
        self.job_deadline_s = job_deadline_s if job_deadline_s is not None else (
            2 * client.rpc_timeout_s + 4 * client.pull_timeout_s + 5.0)
        self.channel = channel
        self.landing_blocks = landing_blocks
        self._ids = itertools.count()
        self._started = time.monotonic()
        self._inflight: dict[str, _Job] = {}  # identifier -> job pulling it
        self._jobs: dict[str, _Job] = {}
        self._blocks_in_flight = 0
        self._alive: set[str] = set()  # requests vLLM asked about and did not finish yet

    def close(self) -> None:
        super().close()
        self.channel.close()

    # --- the strategy ------------------------------------------------------------------------

    def _fetch(self, request: Request, wanted: Sequence[Wanted], missing: Sequence[Wanted]) -> bool:
        rid = request.request_id
        self._alive.add(rid)
        if not self.channel.ready:
            waited = time.monotonic() - self._started
            if waited > WORKER_JOIN_TIMEOUT_S:
                self._fail(rid, f"only {self.channel.joined} of {self.channel.ranks} vLLM workers joined the "
                                f"connector's channel ({self.channel.address}) in {waited:.0f} s")
            return False
        new = [w for w in missing if w.identifier not in self._inflight]  # others' jobs pull the rest
        if new:
            self._start(request, new)
        return False

    def _order_place(self, identifier: str, held: str) -> None:
        self._step.place.append(identifier)

    def _request_gone(self, rid: str) -> None:
        self._alive.discard(rid)

    def _unused(self, identifier: str, held: str | None) -> None:
        if held is not None:
            self._step.drop.append((identifier, held))
            return
        job = self._inflight.get(identifier)
        if job is not None and not any(i in self._users for i in job.identifiers):
            self._end(job, cancel=True)  # nobody waits for any of its items any more

    # --- jobs --------------------------------------------------------------------------------

    def _start(self, request: Request, new: list[Wanted]) -> None:
        placed = self._placed(request)
        if placed is None:
            return
        with_location = [placed[w.identifier] for w in new if w.identifier in placed]
        blocks = sum(len(p.location.block_ids) for p in with_location)
        if self._blocks_in_flight and self._blocks_in_flight + blocks > self.landing_blocks:
            return  # the workers' landing pools are spoken for: this request waits its turn
        self._take(with_location)
        job = _Job(f"{next(self._ids)}", request.request_id, new, with_location)
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
        self.channel.send(PullOrder(job.job_id, tuple(job.placements),
                                    {w.identifier: w.num_embeds for w in job.wanted}))

    def _wait_for_news(self, timeout_s: float) -> None:
        # A lookup ends on a pool thread, not on the channel: look up from it every millisecond then.
        locating = any(job.locating is not None for job in self._jobs.values())
        self.channel.wait(min(timeout_s, 0.001) if locating else timeout_s)

    def progress(self) -> None:
        """Take finished lookups and the workers' reports (called from every hook that decides)."""
        for job in [j for j in self._jobs.values() if j.locating is not None and j.locating.done()]:
            assert job.locating is not None
            try:
                job.placements += job.locating.result()
            except Exception as exc:
                self._failed(job, failure_of(exc, f"lookup for request {job.rid}"))
                continue
            job.locating = None
            self._send(job)
        for report in self.channel.poll():
            self._report(report)
        now = time.monotonic()
        for job in [j for j in self._jobs.values() if j.sent and now - j.started > self.job_deadline_s]:
            silent = sorted(set(range(self.channel.ranks)) - job.ok)
            self._failed(job, Failure(
                LoadFailureReason.TIMEOUT,
                f"EC load failure (timeout) for mm_hash {job.identifiers[0]}: tensor-parallel rank(s) "
                f"{silent} did not report the pull within {self.job_deadline_s:.1f} s"))

    def _report(self, report: Report) -> None:
        job = self._jobs.get(report.job)
        if job is None:
            return  # a job already failed or cancelled: its late reports change nothing
        if isinstance(report, PullFailed):
            # The rank's client counted it in its own metrics, which nobody serves: count it here.
            self._failed(job, Failure(report.reason, f"{report.why} (tensor-parallel rank {report.rank})"))
            return
        self._done(job, report)

    def _done(self, job: _Job, report: PullDone) -> None:
        if set(report.ok) != set(job.identifiers):
            self._failed(job, Failure(LoadFailureReason.TOKEN_COUNT,
                                      f"rank {report.rank} reported {sorted(report.ok)} of {job.identifiers}"))
            return
        if report.rank == 0:  # every rank pulls the same bytes: the metrics count one rank's pulls
            self.metrics.pulls.inc(report.pulled)
            self.metrics.pull_bytes.inc(report.nbytes)
            self.metrics.pulls_prefetched.inc(report.prefetched)
            if report.pulled:
                self.metrics.pull_latency.observe(report.seconds)
        job.ok.add(report.rank)
        if len(job.ok) >= self.channel.ranks:
            for identifier in job.identifiers:
                self._held[identifier] = job.job_id
            self._end(job, cancel=False)

    def _failed(self, job: _Job, failure: Failure) -> None:
        self._pull_failed(job.rid if job.rid in self._alive else None, failure)
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
                self.channel.send(Cancel(job.job_id))
        if job.locating is not None:
            # A lookup still running hands its leases to this job's release when it ends.
            job.locating.add_done_callback(self._release_located)
        if job.placements:
            self._threads.submit(self._release, list(job.placements))

    def _release(self, placements: Sequence[Placement]) -> None:
        self.client.release_placed(list(placements), handshake=True)

    def _release_located(self, done: concurrent.futures.Future[list[Placement]]) -> None:
        if not done.cancelled() and done.exception() is None:
            self._release(done.result())
