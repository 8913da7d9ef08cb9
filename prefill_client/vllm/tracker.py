"""``PullTracker``: what both pull strategies' scheduler halves share (vLLM scheduler process).

vLLM's scheduler asks the connector, for each waiting request, whether its items are available
(``ensure_cache_available``), which requests cannot be served (``take_unavailable_requests``),
what to tell the workers this step (``build_connector_meta``) and when a request is gone
(``request_finished``). A strategy (:mod:`.scheduler`) decides how an item gets in hand; this
base keeps the rest once: which requests use which item, the requests that failed and whether
vLLM was told, the thread pool for RPCs, the step's orders, and how a failure is counted.

Rule for ``load_failures``: every failed pull is counted once, in the metrics ``/metrics``
serves (the scheduler's): an ``ECLoadFailure`` of the tracker's own client is counted by that
client when it raises it; every other failure (:func:`~.items.failure_of`: shapes, other errors,
anything unexpected; a rank's report; a deadline) is counted here.
"""

from __future__ import annotations

import abc
import concurrent.futures
import logging
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Generic, TypeVar

from common.errors import ConfigError
from prefill_client.handoff import from_params
from prefill_client.vllm.items import PULL_THREADS, Failure, StepOrders, Wanted, wanted_items

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from common.metrics import PrefillMetrics
    from prefill_client.consumer.client import EncoderCacheClient
    from prefill_client.handoff import Placement

logger = logging.getLogger(__name__)

HeldT = TypeVar("HeldT")


class PullTracker(abc.ABC, Generic[HeldT]):
    """Says an item "is available" only while it holds what makes it so (``HeldT``: the rows
    themselves, or the pull whose rows every rank holds), for as long as a request uses it."""

    def __init__(self, client: EncoderCacheClient, thread_name: str, idle_wait_s: float = 0.0) -> None:
        """``idle_wait_s``: how long ``ensure`` may wait for a request's items while the engine has
        nothing else to run (:meth:`ensure`); 0: never."""
        self.client = client
        self.idle_wait_s = idle_wait_s
        self.metrics: PrefillMetrics = client.metrics
        # Pulls, lookups and lease releases block on the network: never on the scheduler's thread.
        self._threads = concurrent.futures.ThreadPoolExecutor(PULL_THREADS, thread_name_prefix=thread_name)
        self._held: dict[str, HeldT] = {}  # identifier -> what makes it available
        self._users: defaultdict[str, set[str]] = defaultdict(set)  # identifier -> request ids
        self._unavailable: dict[str, str] = {}  # request id -> why, until vLLM takes it
        self._reported: set[str] = set()  # taken by vLLM: never available again
        self._step = StepOrders()
        # Placements handed to a pull, which gives their leases back (the others go back at the end).
        self._taken: set[tuple[str, int, str]] = set()
        self._stepping: set[str] = set()  # requests the last step ran that have not finished
        self._waited = False  # this step (until take_step) waited, or runs a request already

    # --- vLLM's scheduler-side hooks (through the connector) ---------------------------------

    def has(self, identifier: str) -> bool:
        return identifier in self._held

    def ensure(self, request: Request, num_computed_tokens: int) -> bool:
        """True once every item the request still needs is available; else starts what gets it.

        While the engine has nothing else to run (no other request ran in the last step), waits up
        to ``idle_wait_s`` for the items instead of answering "not yet" at once. An engine whose
        every request is deferred steps empty and sleeps a millisecond between steps; each empty
        step wakes every worker, which then contends with the pull for the cores and the GIL, and
        the item found in hand is scheduled only a step later. Waiting here schedules it in this
        very step. One request a step waits, the first deferred one, and none once the step runs a
        request: the others order their pulls and wait their turn as before. Requests that arrive
        meanwhile wait at most ``idle_wait_s``; a busy engine never waits.
        """
        rid = request.request_id
        ready = self._ensure(request, num_computed_tokens)
        if ready or self._waited or self.idle_wait_s <= 0 or any(r != rid for r in self._stepping):
            self._waited |= ready  # this step runs the request: no later one of the step may hold it up
            return ready
        self._waited = True  # one wait a step: the requests after this one order their pulls and go on
        give_up = time.monotonic() + self.idle_wait_s
        while not ready and rid not in self._unavailable:
            left = give_up - time.monotonic()
            if left <= 0:
                break
            self._wait_for_news(left)
            ready = self._ensure(request, num_computed_tokens)
        return ready

    def _ensure(self, request: Request, num_computed_tokens: int) -> bool:
        self.progress()
        rid = request.request_id
        if rid in self._unavailable or rid in self._reported:
            return False
        wanted = wanted_items(request, num_computed_tokens)
        for w in wanted:
            self._users[w.identifier].add(rid)
        missing = [w for w in wanted if w.identifier not in self._held]
        return not missing or self._fetch(request, wanted, missing)

    def take_unavailable(self) -> set[str]:
        self.progress()
        out = set(self._unavailable)
        self._reported |= out
        self._unavailable.clear()
        return out

    def allocated(self, identifier: str) -> None:
        """vLLM made room for the item in this step: tell the workers to put it into ``encoder_cache``."""
        held = self._held.get(identifier)
        if held is not None:
            self._order_place(identifier, held)

    def take_step(self, scheduled: Iterable[str] = ()) -> StepOrders:
        """This step's orders to the workers (the connector's metadata), once; ``scheduled``: the
        ids of the requests the step runs (the engine is idle once they finished)."""
        self._stepping = set(scheduled)
        self._waited = False
        out, self._step = self._step, StepOrders()
        return out

    def finished(self, request: Request) -> None:
        rid = request.request_id
        self._stepping.discard(rid)
        self._request_gone(rid)
        self._give_back_unused(request)
        self._unavailable.pop(rid, None)
        self._reported.discard(rid)
        for feature in request.mm_features:
            users = self._users.get(feature.identifier)
            if users is None:
                continue
            users.discard(rid)
            if not users:
                del self._users[feature.identifier]
                self._unused(feature.identifier, self._held.pop(feature.identifier, None))

    def progress(self) -> None:
        """Take what finished in the background (called from every hook that decides)."""

    def _wait_for_news(self, timeout_s: float) -> None:
        """Block until something :meth:`progress` takes may have arrived, at most ``timeout_s``."""
        time.sleep(min(timeout_s, 0.001))

    def close(self) -> None:
        self._threads.shutdown(wait=True, cancel_futures=True)
        self.client.close()

    # --- what a strategy decides -------------------------------------------------------------

    @abc.abstractmethod
    def _fetch(self, request: Request, wanted: Sequence[Wanted], missing: Sequence[Wanted]) -> bool:
        """Get ``missing`` in hand (or go on getting it); True when ``wanted`` is available now."""

    @abc.abstractmethod
    def _order_place(self, identifier: str, held: HeldT) -> None:
        """Put what ``held`` stands for into this step's orders (:meth:`allocated`)."""

    def _request_gone(self, rid: str) -> None:
        """The request ended (``finished``): forget what belongs to it alone."""

    def _unused(self, identifier: str, held: HeldT | None) -> None:
        """No request uses the item any more; ``held``: what made it available, if anything."""

    # --- shared by both ----------------------------------------------------------------------

    def _take(self, placements: Sequence[Placement]) -> None:
        """``placements`` go to a pull: it gives their leases back."""
        self._taken.update(_lease_key(p) for p in placements)

    def _give_back_unused(self, request: Request) -> None:
        """The finished request's placements that no pull took: their items were in hand already
        (rows held for another request, or in vLLM's own caches: a later turn of a conversation
        whose image the prefix cache covers). Their leases go back now instead of pinning the
        items on the encoders for the whole lease ttl."""
        try:
            placed = from_params(getattr(request, "ec_transfer_params", None))
        except ConfigError:
            return  # the request failed on them
        if not placed:
            return
        keyed = [(p, _lease_key(p)) for p in placed.values()]
        unused = [p for p, key in keyed if key not in self._taken]
        self._taken.difference_update(key for _, key in keyed)
        if unused:
            try:
                self._threads.submit(self._release, unused)
            except RuntimeError:  # the connector shut down: these leases end at the encoder's ttl
                pass

    def _release(self, placements: Sequence[Placement]) -> None:
        """Give the leases of ``placements`` back (a pool thread), in their placer's name."""
        self.client.release_placed(list(placements))

    def _placed(self, request: Request) -> dict[str, Placement] | None:
        """The placements the proxy handed on with the request; None (and the request fails) when malformed."""
        try:
            return from_params(getattr(request, "ec_transfer_params", None))
        except ConfigError as exc:
            self._fail(request.request_id, f"bad ec_transfer_params: {exc}")
            return None

    def _pull_failed(self, rid: str | None, failure: Failure) -> None:
        """Count ``failure`` (the rule above) and fail request ``rid`` with it (None: nobody waits any more)."""
        if not failure.counted:
            self.metrics.load_failures.labels(reason=failure.reason.value).inc()
        if rid is not None:
            self._fail(rid, failure.why)

    def _fail(self, rid: str, why: str) -> None:
        logger.warning("EpdCacheConnector: request %s fails: %s", rid, why)
        self._unavailable[rid] = why


def _lease_key(p: Placement) -> tuple[str, int, str]:
    return p.encoder, p.location.lease_id, p.mm_hash
