"""Prefetch: a held item's pull starts when vLLM's API server receives the request, not when the
scheduler reaches it (vLLM API server process: :class:`EpdPrefetch`; vLLM worker process:
:class:`Prefetches`).

Without it a held image's pull is on the request's critical path: vLLM's API server renders the
request (for a chat, milliseconds), hands it to the engine, the scheduler orders the pull (the
worker path, :mod:`.scheduler`) and waits for every rank's rows. With it:

1. ``epd proxy`` repeats the placements it put into ``ec_transfer_params`` in the request's
   ``X-Epd-Prefetch`` header (:func:`prefill_client.handoff.prefetch_hint`);
2. :class:`EpdPrefetch`, an ASGI middleware vLLM's API server runs when started with
   ``--middleware prefill_client.vllm.prefetch.EpdPrefetch``, sends that header's bytes, as they
   are, to each tensor-parallel worker of its engine over ZeroMQ (one ``PUSH`` per rank to the
   address :func:`~.channel.prefetch_address` names) and hands the request on unchanged; it
   parses nothing and never waits;
   A request vLLM's key check will refuse (``--api-key``) sends none.
3. each worker (:class:`Prefetches`, part of :class:`~.worker.WorkerLoader`) pulls those
   placements on threads of its own and keeps the pulled items, by placement, until the
   scheduler's order for them comes; the order then takes them instead of pulling (waiting for a
   prefetch still under way at most the pull deadline), checks their shapes and reports as before.

What does not change: the scheduler decides, orders, tracks ranks and gives leases back exactly
as without prefetch, and every row was pulled by the same verified pull (block READ, then tag
READ, generation and fingerprint checks). A prefetch never gives a lease back (the scheduler's
job does), and only an order with the very same placement (encoder, incarnation, lease,
generation, blocks) takes its items. So a hint that is lost, late, malformed, forged or stale
costs at most a pull that fails or is never used: the order then pulls by itself. What a
worker keeps ahead is bounded (``prefetch_blocks``) and forgotten after :data:`KEEP_S`.

One engine per API server: with vLLM's own data parallelism behind one API server the
middleware cannot tell which engine will get the request, and sends no hints (it says so once).
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from common.api_keys import ApiKeys
from common.errors import ConfigError
from prefill_client.handoff import PREFETCH_HEADER, Placement, from_hint

if TYPE_CHECKING:
    from prefill_client.consumer.pull import PulledItem

logger = logging.getLogger(__name__)

MIDDLEWARE = "prefill_client.vllm.prefetch.EpdPrefetch"  # what ``vllm serve --middleware`` takes
KEEP_S = 30.0  # a prefetched item no order took by then is forgotten (its request never reached the scheduler)
PREFETCH_THREADS = 2  # per worker, beside its pull threads: orders never queue behind hints
SEND_QUEUE = 64  # hints the API server queues per rank for a worker that is slow to take them; the rest are dropped

_HEADER = PREFETCH_HEADER.lower().encode("latin-1")

PlacementKey = tuple[str, str, str, int, int, tuple[int, ...]]


def placement_key(p: Placement) -> PlacementKey:
    """What an order's placement must share with a hint's for the hint's pull to stand for it."""
    loc = p.location
    return p.mm_hash, p.encoder, p.incarnation_id, int(loc.lease_id), int(loc.generation), tuple(loc.block_ids)


# --- vLLM worker process ---------------------------------------------------------------------


@dataclass
class _Ahead:
    future: concurrent.futures.Future[dict[str, PulledItem]]
    blocks: int
    when: float


class Prefetches:
    """A worker's pulls started on hints, by placement, until an order takes them.

    ``pull``: the worker's verified pull of placements, keeping their leases (the client's
    ``pull_placed(..., keep_leases=True)``). ``max_blocks``: blocks of items kept ahead at most
    (running or done); a hint that would pass it makes room by forgetting the oldest.
    """

    def __init__(self, pull: Callable[[list[Placement]], list[PulledItem]], max_blocks: int,
                 keep_s: float = KEEP_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._pull = pull
        self.max_blocks = max_blocks
        self.keep_s = keep_s
        self._clock = clock
        self._threads = concurrent.futures.ThreadPoolExecutor(PREFETCH_THREADS, thread_name_prefix="epd-prefetch")
        self._ahead: collections.OrderedDict[PlacementKey, _Ahead] = collections.OrderedDict()
        self._blocks = 0
        self._lock = threading.Lock()
        self.refused = 0  # hints that were malformed or too large to keep

    @property
    def blocks(self) -> int:
        with self._lock:
            return self._blocks

    def __len__(self) -> int:
        with self._lock:
            return len(self._ahead)

    def hint(self, data: bytes) -> None:
        """Start pulling what a hint names (the channel's thread: never blocks, never raises)."""
        try:
            placed = from_hint(data)
        except ConfigError as exc:
            self.refused += 1
            logger.debug("EpdCacheConnector: prefetch hint dropped: %s", exc)
            return
        now = self._clock()
        with self._lock:
            self._expire(now)
            new = [p for p in placed.values() if placement_key(p) not in self._ahead]
            blocks = [len(p.location.block_ids) for p in new]
            if not new:
                return
            if sum(blocks) > self.max_blocks:
                self.refused += 1
                return
            while self._ahead and self._blocks + sum(blocks) > self.max_blocks:
                self._forget(next(iter(self._ahead)))
            try:
                future = self._threads.submit(self._run, new)
            except RuntimeError:  # shutting down
                return
            for p, n in zip(new, blocks):
                self._ahead[placement_key(p)] = _Ahead(future, n, now)
            self._blocks += sum(blocks)

    def claim(self, placements: Sequence[Placement], wait_s: float) -> tuple[dict[str, PulledItem], list[Placement]]:
        """The items prefetched for ``placements`` (by mm_hash) and the placements left to pull.

        A prefetch under way is waited for, at most ``wait_s``; one not started yet is cancelled;
        one that failed or is late leaves its placement to the caller's own pull. Whatever the
        outcome, a claimed entry is forgotten.
        """
        with self._lock:
            taken = [(p, self._forget(placement_key(p))) for p in placements]
        got: dict[str, PulledItem] = {}
        rest: list[Placement] = []
        for p, ahead in taken:
            item = None
            if ahead is not None and not ahead.future.cancel():
                try:
                    item = ahead.future.result(timeout=wait_s).get(p.mm_hash)
                except Exception as exc:  # failed, cancelled or late: the order's own pull says why
                    logger.debug("EpdCacheConnector: prefetch of %s not used: %s", p.mm_hash, exc)
            if item is None:
                rest.append(p)
            else:
                got[p.mm_hash] = item
        return got, rest

    def close(self) -> None:
        self._threads.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            self._ahead.clear()
            self._blocks = 0

    def _run(self, placements: list[Placement]) -> dict[str, PulledItem]:
        return {item.mm_hash: item for item in self._pull(placements)}

    def _forget(self, key: PlacementKey) -> _Ahead | None:
        ahead = self._ahead.pop(key, None)
        if ahead is not None:
            self._blocks -= ahead.blocks
        return ahead

    def _expire(self, now: float) -> None:
        while self._ahead:
            key, oldest = next(iter(self._ahead.items()))
            if now - oldest.when < self.keep_s:
                return
            self._forget(key)


# --- vLLM API server process -----------------------------------------------------------------


class EpdPrefetch:
    """ASGI middleware for vLLM's API server: a request's ``X-Epd-Prefetch`` header goes to every
    tensor-parallel worker of the engine as it is, before the request goes on, unchanged.

    ``vllm serve ... --middleware prefill_client.vllm.prefetch.EpdPrefetch`` (with the connector
    on the worker path). The engine is the one in the app's ``state.vllm_config``; sending never
    blocks (a worker not listening, or behind, loses the hint, which only starts a pull earlier).
    """

    def __init__(self, app: Callable[..., Any]) -> None:
        self.app = app
        # Built at start-up (or at the first hint), when the engine's config is known.
        self._sockets: list[Any] | None = None
        self._ctx: Any = None
        self._keys = ApiKeys(())  # vLLM's API keys (none: it takes every request): a hint goes only with one it takes
        self.sent = 0
        self.dropped = 0

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope.get("type") == "lifespan" and self._sockets is None:
            self._connect(scope)  # at start-up, so that the first request's hint finds the connections made
        elif scope.get("type") == "http" and scope.get("method") == "POST":
            hint = authorization = None
            for name, value in scope.get("headers", ()):  # one pass; most requests carry no hint
                if name == _HEADER:
                    hint = value
                elif name == b"authorization":
                    authorization = value
            if hint is not None:
                self._send(scope, hint, authorization)
        await self.app(scope, receive, send)

    def _send(self, scope: dict[str, Any], hint: bytes, authorization: bytes | None) -> None:
        sockets = self._sockets if self._sockets is not None else self._connect(scope)
        if not sockets or not self._authorized(authorization):
            return
        import zmq

        for sock in sockets:
            try:
                sock.send(hint, zmq.NOBLOCK)
                self.sent += 1
            except zmq.ZMQError:  # no worker connected on that rank, or its queue is full
                self.dropped += 1

    def _authorized(self, authorization: bytes | None) -> bool:
        """Whether vLLM takes a request of this ``Authorization`` (every one when it has no keys)."""
        return not self._keys or self._keys.allows(authorization.decode("latin-1") if authorization else None)

    def _connect(self, scope: dict[str, Any]) -> list[Any]:
        """One PUSH per tensor-parallel rank of the app's engine (none, said once, when it cannot tell)."""
        self._sockets = []
        app = scope.get("app")
        state = getattr(app, "state", None)
        config = getattr(state, "vllm_config", None)
        args = getattr(state, "args", None)
        given = getattr(args, "api_key", None) or [os.environ.get("VLLM_API_KEY")]
        # vLLM adds its key check before the middleware given with --middleware, so this one runs
        # first: a request that check will refuse sends no hint.
        self._keys = ApiKeys(k for k in ([given] if isinstance(given, str) else given) if k)
        if config is None:
            logger.warning("EpdPrefetch: the app has no state.vllm_config (not vLLM's API server?): no prefetch hints")
            return self._sockets
        parallel = config.parallel_config
        if parallel.data_parallel_size > 1:
            logger.warning("EpdPrefetch: %d data-parallel engines behind this API server, and which one gets a "
                           "request is not known here: no prefetch hints", parallel.data_parallel_size)
            return self._sockets
        import zmq

        from prefill_client.vllm.channel import address, prefetch_address

        self._ctx = zmq.Context()
        base = address(config)
        for rank in range(parallel.tensor_parallel_size):
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only for a worker that is there
            sock.setsockopt(zmq.SNDHWM, SEND_QUEUE)
            sock.connect(prefetch_address(base, rank))
            self._sockets.append(sock)
        logger.info("EpdPrefetch: prefetch hints go to %d worker(s) at %s", len(self._sockets),
                    prefetch_address(base, 0).removesuffix("0") + "N")
        return self._sockets
