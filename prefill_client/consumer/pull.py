"""The verified pull: blocks, then tags, then the checks, then the leases go back (any process that pulls).

:meth:`Puller.pull` reads an item's blocks into landing blocks and waits (with a deadline),
only then reads the blocks' tags and generations (a second transfer), and compares each with
what the location named (:mod:`prefill_client.consumer.verify`). The producer stamps tag and
generation before it writes any row and never writes a block again until it re-allocates it,
so a match read *after* the data proves the data was the item's; anything else is an
:class:`ECLoadFailure`. Verified items are kept in a bounded local cache (:class:`LocalCache`).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from common.errors import ECLoadFailure, LoadFailureReason, PeerDisconnected, TransferTimeout, TransportError
from common.metrics import PrefillMetrics
from common.transport import ConsumerTransport
from common.wire import pb2
from prefill_client.consumer.connection import EncoderConnection
from prefill_client.consumer.recent import RecentMap
from prefill_client.consumer.release import LeaseReleaser, OnBehalf, Kept
from prefill_client.consumer.verify import check_location, gather_batch, verify_batch

Releaser = EncoderConnection | OnBehalf | Kept


@dataclass(frozen=True, slots=True)
class PulledItem:
    """A verified item: its rows and where they came from."""

    mm_hash: str
    embeddings: torch.Tensor  # [num_tokens, fat_dim], the cache dtype
    grid_thw: tuple[int, ...]
    encoder: str
    source: str  # "local" (consumer cache), "hit" (encoder had it), "miss" (encoder ran)
    weights_digest: str = ""  # of the encoder's vision weights (common.weights_digest)

    @property
    def num_tokens(self) -> int:
        return int(self.embeddings.shape[0])


class LocalCache:
    """Pulled items by (weights digest, mm_hash), LRU, bounded in blocks of the producer layout.

    The digest is part of the key: the same mm_hash from encoders of other weights is another item.
    """

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self._items: collections.OrderedDict[tuple[str, str], tuple[PulledItem, int]] = collections.OrderedDict()
        self._blocks = 0
        self._lock = threading.Lock()

    def get(self, digest: str | None, mm_hash: str) -> PulledItem | None:
        """The item, if pulled from an encoder of weights ``digest`` (None: not known yet, so no item)."""
        if digest is None:
            return None
        key = (digest, mm_hash)
        with self._lock:
            entry = self._items.get(key)
            if entry is None:
                return None
            self._items.move_to_end(key)
            return entry[0]

    def put(self, item: PulledItem, blocks: int) -> None:
        key = (item.weights_digest, item.mm_hash)
        with self._lock:
            if blocks > self.capacity_blocks or key in self._items:
                return
            self._items[key] = (item, blocks)
            self._blocks += blocks
            while self._blocks > self.capacity_blocks:
                _, (_, old) = self._items.popitem(last=False)
                self._blocks -= old


def load_failure(metrics: PrefillMetrics, reason: LoadFailureReason, locs: Sequence[pb2.ItemLocation],
                 detail: str = "", *, mm_hash: str = "") -> ECLoadFailure:
    """The ``ECLoadFailure`` of an item (``mm_hash``, else the first location's), counted by reason."""
    metrics.load_failures.labels(reason=reason.value).inc()
    return ECLoadFailure(reason, mm_hash or (locs[0].mm_hash if locs else "?"), detail=detail)


class Puller:
    """Pulls locations of one consumer: its transport's landing pool, its local cache, its releaser.

    ``where`` (mm_hash -> encoder target) learns where each verified item was found.
    """

    def __init__(self, transport: ConsumerTransport, metrics: PrefillMetrics, pull_timeout_s: float,
                 local: LocalCache, releaser: LeaseReleaser, where: RecentMap[str, str]) -> None:
        self.transport = transport
        self.metrics = metrics
        self.pull_timeout_s = pull_timeout_s
        self.local = local
        self.releaser = releaser
        self.where = where

    def pull(self, conn: EncoderConnection, locations: Sequence[pb2.ItemLocation],
             releasing: Releaser) -> list[PulledItem]:
        """Pull, then verify, every location; local-cache hits need no transfer. ``releasing``
        gives the leases back (this consumer's, another's it pulls for, or nobody: the caller's)."""
        results: list[PulledItem | None] = [None] * len(locations)
        todo: list[int] = []
        for i, loc in enumerate(locations):
            local = self.local.get(conn.weights_digest, loc.mm_hash)
            if local is not None:
                results[i] = dataclasses.replace(local, source="local")
            else:
                todo.append(i)
        self.releaser.add(releasing, [loc.lease_id for loc, r in zip(locations, results) if r is not None])
        if todo:
            for i, item in zip(todo, self._pull_verified(conn, [locations[i] for i in todo], releasing)):
                results[i] = item
        return [r for r in results if r is not None]

    def _pull_verified(self, conn: EncoderConnection, locs: Sequence[pb2.ItemLocation],
                       releasing: Releaser) -> list[PulledItem]:
        """Pull ``locs`` in as few transfers as the landing pool allows; every lease ends on every path."""
        landing = self.transport.landing
        room = landing.num_blocks - landing.num_quarantined
        chunks: list[list[pb2.ItemLocation]] = [[]]
        blocks = 0
        for loc in locs:  # consecutive items while they fit the pool; an item too large goes alone
            if chunks[-1] and blocks + len(loc.block_ids) > room:
                chunks.append([])
                blocks = 0
            chunks[-1].append(loc)
            blocks += len(loc.block_ids)
        out: list[PulledItem] = []
        for n, chunk in enumerate(chunks):
            try:
                out += self._pull_chunk(conn, chunk, releasing)
            except BaseException:
                # Chunks never tried still hold leases nobody will release after a tag READ.
                releasing.release([loc.lease_id for later in chunks[n + 1:] for loc in later])
                raise
        return out

    def _pull_chunk(self, conn: EncoderConnection, locs: Sequence[pb2.ItemLocation],
                    releasing: Releaser) -> list[PulledItem]:
        """One block READ, then one tag READ, then the checks of every item; then the leases go back.

        Items that verify are kept (local cache) even when another item of the
        chunk fails; the call then raises that item's ``ECLoadFailure``. Leases
        are released by the batching releaser once the tag READ is done, and
        at once by RPC when anything fails before it; not when the encoder's
        agent is gone: a dead encoder's leases died with it, and calling it
        would only start gRPC's reconnect back-off, which could refuse the
        first call to its restarted successor.
        """
        layout = conn.layout
        landing = self.transport.landing
        lease_ids = [loc.lease_id for loc in locs]
        leases_pinned = True
        local_ids: np.ndarray | None = None
        started = time.perf_counter()
        try:
            for loc in locs:
                self._check_location(loc, layout.block_size)
            remote = np.fromiter((b for loc in locs for b in loc.block_ids), dtype=np.int32)
            if len(remote) > landing.num_blocks - landing.num_quarantined:
                raise TransportError(
                    f"item {locs[0].mm_hash} needs {len(remote)} landing blocks; the pool has "
                    f"{landing.num_blocks} ({landing.num_quarantined} quarantined): raise --landing-blocks")
            try:
                local_ids = self._acquire_landing(len(remote))
            except TransferTimeout as exc:
                raise self._failure(LoadFailureReason.TIMEOUT, locs, str(exc)) from exc
            local = np.asarray(local_ids, dtype=np.int32)
            peer = conn.peer()
            try:
                # The rows, then, only once they are in, the tags and generations that prove them.
                tags, gens = peer.read_blocks_and_tags(remote, local, self.pull_timeout_s)
            except TransferTimeout as exc:
                raise self._failure(LoadFailureReason.TIMEOUT, locs, str(exc)) from exc
            except (PeerDisconnected, TransportError) as exc:
                # Any other failed READ leaves the peer in doubt: drop it, handshake next time.
                conn.reset()
                leases_pinned = False  # or expire at their ttl, if the encoder lives on
                raise self._failure(LoadFailureReason.DISCONNECT, locs, str(exc)) from exc
            self.releaser.add(releasing, lease_ids)
            leases_pinned = False
            verdicts = verify_batch(locs, tags, gens)
            rows = gather_batch(landing.tensor, local, locs)
        except BaseException:
            if leases_pinned:
                releasing.release(lease_ids)
            raise
        finally:
            # Blocks of a timed-out READ were quarantined by the transport; releasing a
            # quarantined id is a no-op, so this is right on every path.
            if local_ids is not None:
                landing.release(local_ids)
        self.metrics.pull_latency.observe(time.perf_counter() - started)
        self.metrics.pulls.inc(len(locs))
        self.metrics.pull_bytes.inc(len(remote) * layout.bytes_per_block)
        out: list[PulledItem] = []
        failure: ECLoadFailure | None = None
        for loc, verdict, embeddings in zip(locs, verdicts, rows):
            if verdict is not None:
                self.metrics.load_failures.labels(reason=verdict.reason.value).inc()
                failure = failure or verdict
                continue
            item = PulledItem(loc.mm_hash, embeddings, tuple(loc.grid_thw), conn.target,
                              "hit" if loc.result == pb2.CACHE_RESULT_HIT else "miss", conn.weights_digest)
            self.local.put(item, len(loc.block_ids))
            self.where[loc.mm_hash] = conn.target
            out.append(item)
        if failure is not None:
            raise failure
        return out

    def _acquire_landing(self, n: int) -> np.ndarray:
        """Landing blocks for one pull; concurrent pulls may hold them all for a moment."""
        landing = self.transport.landing
        give_up = time.monotonic() + self.pull_timeout_s
        while True:
            ids = landing.acquire(n)
            if ids is not None:
                return ids
            if time.monotonic() > give_up:
                raise TransferTimeout(
                    f"no {n} free landing blocks within {self.pull_timeout_s} s "
                    f"({landing.num_held} held by other pulls, {landing.num_quarantined} quarantined)")
            time.sleep(0.001)

    def _check_location(self, loc: pb2.ItemLocation, block_size: int) -> None:
        try:
            check_location(loc, block_size)
        except ECLoadFailure as exc:
            self.metrics.load_failures.labels(reason=exc.reason.value).inc()
            raise

    def _failure(self, reason: LoadFailureReason, locs: Sequence[pb2.ItemLocation], detail: str = "") -> ECLoadFailure:
        return load_failure(self.metrics, reason, locs, detail)
