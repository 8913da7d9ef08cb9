"""Consumer library of the prefill process: handshake, pull, verify (prefill process).

:class:`EncoderCacheClient` asks an encoder for item locations over gRPC and
pulls the rows over NIXL in the order that makes a wrong embedding impossible
to miss:

1. READ the item's blocks into our landing blocks and wait (with a deadline);
2. only then READ the blocks' tags and generations (a second transfer);
3. compare each tag with ``mm_hash_fingerprint(mm_hash)`` computed here and
   each generation with the one the location named (:mod:`prefill_client.consumer.verify`);
4. give the leases back, in batches off the pull path (:mod:`prefill_client.consumer.release`).

Requests are batched: one RPC per encoder for all of its items, and one block
READ and one tag READ for all of them (split only when the landing pool is
too small).

The producer stamps tag and generation before it writes any row and never
writes a block again until it re-allocates it (which re-stamps both), so a
match read *after* the data proves the data was the item's. Anything else is
an :class:`ECLoadFailure`, never a silent skip.

The client is synchronous and thread-safe; :class:`AsyncEncoderCacheClient`
wraps it for asyncio by running calls in worker threads.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import grpc
import numpy as np
import torch

from common.config import FailurePolicy, PrefillConfig, TlsConfig, TransportKind
from common.errors import (
    CacheFullError,
    ECLoadFailure,
    EpdError,
    HandshakeError,
    LoadFailureReason,
    PeerDisconnected,
    TransferTimeout,
    TransportError,
    WeightsMismatchError,
)
from common.media import PreprocessParams
from common.metrics import PrefillMetrics
from common.transport import ConsumerTransport
from common.wire import pb2
from prefill_client.consumer.connection import EncoderConnection, MediaSpec
from prefill_client.handoff import Placement
from prefill_client.consumer.release import LeaseReleaser
from prefill_client.consumer.pool import DEFAULT_REFRESH_INTERVAL_S, EncoderPool
from prefill_client.consumer.verify import check_location, gather_batch, gather_rows, verify_batch, verify_item

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

# Statuses of a call whose encoder is gone: down, or left the list (its channel closed under the call).
_GONE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)

_RETRYABLE = {
    LoadFailureReason.TAG_MISMATCH, LoadFailureReason.GENERATION_MISMATCH,
    LoadFailureReason.EVICTED, LoadFailureReason.TIMEOUT, LoadFailureReason.DISCONNECT,
}


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


@dataclass(frozen=True, slots=True)
class _OnBehalf:
    """Releases leases granted to another consumer (``owner``) through ``conn``: a placed item's."""

    conn: EncoderConnection
    owner: str

    def release(self, lease_ids: Sequence[int]) -> None:
        self.conn.release(lease_ids, owner=self.owner)


class _Kept:
    """Releases nothing: the leases are the caller's to give back (``pull_placed(keep_leases=True)``)."""

    def release(self, lease_ids: Sequence[int]) -> None:
        return


_KEPT = _Kept()


class _LocalCache:
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


class EncoderCacheClient:
    """Encode / lookup items on one or more encoders and pull them, verified."""

    def __init__(
        self,
        targets: str | Sequence[str],
        model_id: str,
        *,
        consumer_id: str | None = None,
        transport: ConsumerTransport | None = None,
        transport_kind: TransportKind | str = TransportKind.AUTO,
        rpc_timeout_s: float = 10.0,
        pull_timeout_s: float = 2.0,
        failure_policy: FailurePolicy | str = FailurePolicy.FAIL,
        landing_blocks: int = 256,
        local_cache_blocks: int = 1024,
        metrics: PrefillMetrics | None = None,
        tls: TlsConfig | None = None,
        weights_digest: str | None = None,
        membership_refresh_s: float = DEFAULT_REFRESH_INTERVAL_S,
        landing_device: str | torch.device = "cpu",
        probe_connections: bool = False,
    ) -> None:
        """``weights_digest``: the vision weights this client's model expects
        (:func:`common.weights_digest.checkpoint_digest` of its checkpoint); encoders announcing
        another digest are refused (:class:`WeightsMismatchError`) and their items go to the
        next encoder. None accepts any encoder, and keeps items of different weights apart.
        ``membership_refresh_s``: how often the targets are resolved again and every encoder's
        readiness asked (:class:`~prefill_client.consumer.pool.EncoderPool`; 0: only at start).
        ``landing_device``: where the NIXL-registered landing pool lives, and so the pulled rows
        (a GPU's memory on CUDA: the READ lands on the device). ``probe_connections``: read one
        tag from each encoder as it is connected, so the first request does not pay the
        transport's connection set-up (:meth:`ConsumerTransport._probe`)."""
        self.model_id = model_id
        self.weights_digest = weights_digest
        self.consumer_id = consumer_id or f"{socket.gethostname()}:{os.getpid()}"
        self.rpc_timeout_s = rpc_timeout_s
        self.pull_timeout_s = pull_timeout_s
        self.failure_policy = FailurePolicy(failure_policy)
        self.metrics = metrics if metrics is not None else PrefillMetrics()
        self._own_transport = transport is None
        self.transport = transport if transport is not None else ConsumerTransport(
            TransportKind(transport_kind), num_landing_blocks=landing_blocks, device=landing_device,
            probe_timeout_s=pull_timeout_s if probe_connections else 0.0)
        self._tls = tls or TlsConfig()
        self._pool = EncoderPool([targets] if isinstance(targets, str) else list(targets), self._connection,
                                 self.metrics, refresh_interval_s=membership_refresh_s)
        if weights_digest is None:
            logger.info("no expected vision weights digest: encoders of any weights are accepted")
        self._local = _LocalCache(local_cache_blocks)
        self._where: dict[str, str] = {}  # mm_hash -> encoder target it was found on
        self._releaser = LeaseReleaser()

    @classmethod
    def from_config(cls, cfg: PrefillConfig, metrics: PrefillMetrics | None = None, *,
                    landing_device: str | torch.device = "cpu", probe_connections: bool = False
                    ) -> EncoderCacheClient:
        """The client ``epd prefill`` and the vLLM connector build from their settings."""
        return cls(
            cfg.encoders, cfg.model_id, consumer_id=cfg.consumer_id, transport_kind=cfg.transport,
            rpc_timeout_s=cfg.rpc_timeout_s, pull_timeout_s=cfg.pull_timeout_s,
            failure_policy=cfg.failure_policy, landing_blocks=cfg.landing_blocks,
            local_cache_blocks=cfg.local_cache_blocks, metrics=metrics, tls=cfg.tls,
            weights_digest=cfg.weights_digest, membership_refresh_s=cfg.membership_refresh_s,
            landing_device=landing_device, probe_connections=probe_connections)

    # --- public API ------------------------------------------------------------------------

    def encode(self, items: Sequence[MediaSpec]) -> list[PulledItem]:
        """Encode (or find) every item on its encoder and pull it, verified, in order.

        One Encode RPC per encoder for all of its items, then one block READ and
        one tag READ per encoder (split only when the landing pool is too
        small). Items are hashed for routing only when there is more than one
        encoder to choose from.
        """
        return self._per_encoder(items, self._encode_on)

    def lookup(self, mm_hashes: Sequence[str], *, require: bool = False) -> list[PulledItem | None]:
        """Pull items known by mm_hash; ``None`` where no encoder has the item.

        One Lookup RPC per encoder for all of its items and one pull for all
        it found. With ``require=True`` a missing item is
        ``ECLoadFailure(evicted)`` instead (the caller held a location for it,
        so it was there and is gone); the other items' leases are given back.
        """
        out: list[PulledItem | None] = [None] * len(mm_hashes)
        by_target: dict[str, dict[str, list[int]]] = collections.defaultdict(dict)
        for i, h in enumerate(mm_hashes):
            local = self._local.get(self._digest_for(h), h)
            if local is not None:
                out[i] = dataclasses.replace(local, source="local")
            else:
                target = self._where.get(h)
                if target is None or self._pool.conn(target) is None:  # unknown, or its encoder left
                    target = self._route(functools.partial(str, h))
                by_target[target].setdefault(h, []).append(i)
        for target, wanted in by_target.items():
            conn = self._pool.conn(target)
            if conn is None:
                raise self._fail(LoadFailureReason.HANDSHAKE, [], mm_hash=next(iter(wanted)),
                                 detail=f"encoder {target} left the encoder list")
            try:
                locations = conn.lookup(list(wanted))
            except WeightsMismatchError as exc:
                raise self._fail(LoadFailureReason.HANDSHAKE, [], mm_hash=next(iter(wanted)),
                                 detail=str(exc)) from exc
            except grpc.RpcError as exc:
                if exc.code() not in _GONE + (grpc.StatusCode.DEADLINE_EXCEEDED,):
                    raise
                # As for encode: an encoder that does not answer is a loud ECLoadFailure, not a raw status.
                raise self._fail(LoadFailureReason.HANDSHAKE, [], mm_hash=next(iter(wanted)),
                                 detail=f"encoder {target} unreachable: {exc.code().name}") from exc
            found = [loc for loc in locations if loc is not None]
            if require and len(found) < len(wanted):
                conn.release([loc.lease_id for loc in found])
                gone = next(h for h, loc in zip(wanted, locations) if loc is None)
                raise self._fail(LoadFailureReason.EVICTED, [], detail=f"{gone} is no longer on encoder {target}",
                                 mm_hash=gone)
            for item in self._pull(conn, found):
                for i in wanted[item.mm_hash]:
                    out[i] = item
        return out

    def place(self, items: Sequence[MediaSpec]) -> list[Placement]:
        """Encode (or find) every item on its encoder, as :meth:`encode` does, but pull nothing:
        the leased locations, in order, for another process to pull (:meth:`pull_placed`).

        The leases end when that process releases them, or at the encoder's lease ttl.
        """
        return self._per_encoder(items, self._place_on)

    def locate(self, mm_hashes: Sequence[str]) -> list[Placement]:
        """Placements of items known by mm_hash (one Lookup RPC per encoder), leased to this
        client and pulled by nobody yet: :meth:`lookup` without the pull, for another process
        to pull (:meth:`pull_placed`). An item no encoder has is ``ECLoadFailure(evicted)``,
        and the leases already granted are given back."""
        by_target: dict[str, list[int]] = collections.defaultdict(list)
        for i, h in enumerate(mm_hashes):
            target = self._where.get(h)
            if target is None or self._pool.conn(target) is None:
                target = self._route(functools.partial(str, h))
            by_target[target].append(i)
        out: list[Placement | None] = [None] * len(mm_hashes)
        try:
            for target, indices in by_target.items():
                conn = self._pool.conn(target)
                wanted = [mm_hashes[i] for i in indices]
                if conn is None:
                    raise self._fail(LoadFailureReason.HANDSHAKE, [], mm_hash=wanted[0],
                                     detail=f"encoder {target} left the encoder list")
                try:
                    locations = conn.lookup(wanted)
                except WeightsMismatchError as exc:
                    raise self._fail(LoadFailureReason.HANDSHAKE, [], mm_hash=wanted[0], detail=str(exc)) from exc
                except grpc.RpcError as exc:
                    if exc.code() not in _GONE + (grpc.StatusCode.DEADLINE_EXCEEDED,):
                        raise
                    raise self._fail(LoadFailureReason.HANDSHAKE, [], mm_hash=wanted[0],
                                     detail=f"encoder {target} unreachable: {exc.code().name}") from exc
                for i, loc in zip(indices, locations):
                    if loc is not None:
                        out[i] = Placement(loc.mm_hash, target, conn.incarnation_id, loc, conn.weights_digest,
                                           self.consumer_id)
                gone = [h for h, loc in zip(wanted, locations) if loc is None]
                if gone:
                    raise self._fail(LoadFailureReason.EVICTED, [], mm_hash=gone[0],
                                     detail=f"{gone[0]} is no longer on encoder {target}")
                self._where.update((h, target) for h in wanted)
        except BaseException:
            self.release_placed([p for p in out if p is not None])
            raise
        return [p for p in out if p is not None]

    def pull_placed(self, placements: Sequence[Placement], *, keep_leases: bool = False) -> list[PulledItem]:
        """Pull placed items, verified, in order; one block READ and one tag READ per encoder.

        A placement of another incarnation than the encoder's current one (it restarted), or of
        an encoder this client does not know by that name, is looked up by mm_hash instead. An
        item no longer found is ``ECLoadFailure(evicted)``; any failure fails the call, and
        every lease is given back, except with ``keep_leases``: then the placements' leases are
        the caller's to give back (:meth:`release_placed`), once every process that pulls the
        same placements is done (the vLLM connector's tensor-parallel ranks). Leases this call
        takes itself (a stale placement looked up again) are always given back.
        """
        out: list[PulledItem | None] = [None] * len(placements)
        by_target: dict[str, list[int]] = collections.defaultdict(list)
        stale: list[int] = []
        for i, p in enumerate(placements):
            # The local copy must be of the weights this client expects, else of the weights the
            # encoder named by the placement announced to us (never the placement's own claim).
            conn = self._pool.conn(p.encoder)
            digest = self.weights_digest or (conn.weights_digest if conn is not None and conn.incarnation_id else None)
            local = self._local.get(digest, p.mm_hash)
            if local is not None:
                if not keep_leases:
                    self._release_placed(p)
                out[i] = dataclasses.replace(local, source="local")
            else:
                by_target[p.encoder].append(i)
        for target, indices in by_target.items():
            conn = self._pool.conn(target)
            if conn is None:  # named otherwise here (or gone): find the items by mm_hash instead
                stale += indices
                continue
            try:
                conn.peer()
            except grpc.RpcError as exc:
                raise self._fail(LoadFailureReason.HANDSHAKE, [], mm_hash=placements[indices[0]].mm_hash,
                                 detail=f"encoder {target} unreachable: {exc.code().name}") from exc
            except (HandshakeError, PeerDisconnected) as exc:
                raise self._fail(LoadFailureReason.HANDSHAKE, [], mm_hash=placements[indices[0]].mm_hash,
                                 detail=str(exc)) from exc
            current = [i for i in indices if placements[i].incarnation_id == conn.incarnation_id]
            stale += [i for i in indices if placements[i].incarnation_id != conn.incarnation_id]
            self._where.update((placements[i].mm_hash, target) for i in indices)
            by_owner: dict[str, list[int]] = collections.defaultdict(list)
            for i in current:
                by_owner[placements[i].owner].append(i)
            for owner, group in by_owner.items():
                pulled = self._pull(conn, [placements[i].location for i in group], owner=owner or None,
                                    keep_leases=keep_leases)
                for i, item in zip(group, pulled):
                    out[i] = item
        if stale:
            found = self.lookup([placements[i].mm_hash for i in stale], require=True)
            for i, again in zip(stale, found):
                out[i] = again
        return [p for p in out if p is not None]

    def release_placed(self, placements: Sequence[Placement], *, handshake: bool = False) -> None:
        """Give back the leases of placements that will not be pulled (or were pulled elsewhere).

        ``handshake``: first handshake with an encoder this client has not talked to yet (a
        client that only tracks pulls other processes make), up to the RPC deadline; an encoder
        that does not answer keeps its leases until their ttl.
        """
        for p in placements:
            self._release_placed(p, handshake)

    def _release_placed(self, p: Placement, handshake: bool = False) -> None:
        conn = self._pool.conn(p.encoder)
        if conn is not None and handshake and not conn.incarnation_id:
            try:
                conn.peer()
            except (grpc.RpcError, EpdError) as exc:
                logger.warning("lease %d on %s not given back (%s): it ends at its ttl",
                               p.location.lease_id, p.encoder, exc)
                return
        if conn is not None and conn.incarnation_id == p.incarnation_id:
            self._releaser.add(self._releasing(conn, p.owner or None), [p.location.lease_id])

    def _releasing(self, conn: EncoderConnection, owner: str | None) -> EncoderConnection | _OnBehalf:
        """Who gives leases back: ``conn`` for our own, on behalf of ``owner`` for handed-on ones."""
        return conn if owner is None or owner == self.consumer_id else _OnBehalf(conn, owner)

    def media_params(self) -> tuple[PreprocessParams, str]:
        """Preprocessing parameters and fingerprint every encoder must share (layer-1 token counts)."""
        seen: tuple[PreprocessParams, str] | None = None
        for conn in self._pool.connections():
            target = conn.target
            try:
                params = conn.media_params
            except grpc.RpcError as exc:
                logger.warning("encoder %s unreachable for its media parameters: %s", target, exc.code())
                continue
            except WeightsMismatchError as exc:
                logger.warning("%s; not asked for its media parameters", exc)
                continue
            if seen is not None and params != seen:
                raise HandshakeError(f"encoders disagree on preprocessing: {seen} vs {target}: {params}")
            seen = params
        if seen is None:
            raise ECLoadFailure(LoadFailureReason.HANDSHAKE, "-", detail="no encoder reachable")
        return seen

    def cached(self, mm_hash: str) -> PulledItem | None:
        """The consumer-side cache of pulled items (no RPC, no NIXL)."""
        return self._local.get(self._digest_for(mm_hash), mm_hash)

    def _digest_for(self, mm_hash: str) -> str | None:
        """The weights digest an item must have been pulled with to be served from the local cache:
        the expected one, else that of the encoder it was last found on (None if not known)."""
        if self.weights_digest is not None:
            return self.weights_digest
        target = self._where.get(mm_hash)
        conn = self._pool.conn(target) if target is not None else None
        return conn.weights_digest if conn is not None and conn.incarnation_id else None

    def close(self) -> None:
        self._releaser.close()
        self._pool.close()
        if self._own_transport:
            self.transport.close()

    def __enter__(self) -> EncoderCacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def targets(self) -> tuple[str, ...]:
        """The encoders known now (they follow the target list while the client runs)."""
        return self._pool.targets

    def connection(self, target: str) -> EncoderConnection | None:
        """The connection to a known encoder (its handshake state, its incarnation)."""
        return self._pool.conn(target)

    # --- routing ---------------------------------------------------------------------------

    def _connection(self, target: str) -> EncoderConnection:
        return EncoderConnection(target, self.model_id, self.consumer_id, self.transport, self.metrics,
                                 rpc_timeout_s=self.rpc_timeout_s, tls=self._tls,
                                 expected_weights_digest=self.weights_digest)

    def _route(self, key: Callable[[], str]) -> str:
        """The encoder for a new item: the first ready one in its rendezvous order (its key, a
        content digest, is computed only when there is a choice)."""
        return self._pool.order(key)[0]

    def _per_encoder(self, items: Sequence[MediaSpec],
                     call: Callable[[EncoderConnection, Sequence[MediaSpec]], list[_T]]) -> list[_T]:
        """``call(conn, its items)`` once per encoder the items route to (with fail-over); results in order."""
        out: list[_T | None] = [None] * len(items)
        by_target: dict[str, list[int]] = collections.defaultdict(list)
        for i, item in enumerate(items):
            by_target[self._route(item.key)].append(i)
        for target, indices in by_target.items():
            done = self._with_failover(
                items[indices[0]].key, target, lambda conn: call(conn, [items[i] for i in indices]))
            for i, result in zip(indices, done):
                out[i] = result
        return [r for r in out if r is not None]

    def _with_failover(self, key: Callable[[], str], first: str,
                       call: Callable[[EncoderConnection], list[_T]]) -> list[_T]:
        """Run ``call(conn)`` on the item's encoder, moving down the rendezvous order when one is down."""
        reasons: list[str] = []
        for target in self._failover_order(key, first):
            conn = self._pool.conn(target)
            if conn is None:  # left the list meanwhile
                reasons.append(f"{target}: left the encoder list")
                continue
            try:
                return call(conn)
            except _EncoderDown as exc:
                logger.warning("encoder %s is down (%s); trying the next one", target, exc)
                self._pool.report_down(target)
                reasons.append(f"{target}: {exc}")
        raise self._fail(LoadFailureReason.HANDSHAKE, [], mm_hash=key(),
                         detail=f"no encoder reachable ({'; '.join(reasons) or 'none known'})")

    def _failover_order(self, key: Callable[[], str], first: str) -> Iterator[str]:
        """``first``, then every other known encoder in the item's order; the rest (and the key) are
        computed only when the first choice is down. Encoders that joined while the call ran are
        tried too: the order is taken again until it names none that was not tried."""
        tried = {first}
        yield first
        while True:
            fresh = [t for t in self._pool.order(key) if t not in tried]
            if not fresh:
                return
            for target in fresh:
                tried.add(target)
                yield target

    # --- encode + pull ----------------------------------------------------------------------

    @contextlib.contextmanager
    def _calling(self, conn: EncoderConnection, items: Sequence[MediaSpec]) -> Iterator[None]:
        """What an Encode call's failures mean: overloaded (a timeout, no fail-over), or the
        encoder unusable here (``_EncoderDown``: the next one in rendezvous order)."""
        try:
            yield
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # overloaded, not down: no fail-over
                raise self._fail(LoadFailureReason.TIMEOUT, [], f"Encode on {conn.target}: {exc.details()}",
                                 mm_hash=items[0].key()) from exc
            if exc.code() in _GONE:
                raise _EncoderDown(str(exc.details())) from exc
            raise
        except (PeerDisconnected, WeightsMismatchError) as exc:
            raise _EncoderDown(str(exc)) from exc

    def _encode_on(self, conn: EncoderConnection, items: Sequence[MediaSpec]) -> list[PulledItem]:
        attempts = 2 if self.failure_policy is FailurePolicy.RETRY else 1
        with self._calling(conn, items):
            for attempt in range(attempts):
                try:
                    return self._pull(conn, self._encode_admitted(conn, items))
                except ECLoadFailure as exc:  # from the answer (an item left the cache) or from the pull
                    if attempt + 1 < attempts and exc.reason in _RETRYABLE:
                        logger.warning("retrying after %s", exc)
                        continue
                    raise
        raise AssertionError("unreachable")

    def _place_on(self, conn: EncoderConnection, items: Sequence[MediaSpec]) -> list[Placement]:
        with self._calling(conn, items):
            locations = self._encode_admitted(conn, items)
        for loc in locations:
            self._where[loc.mm_hash] = conn.target
        return [Placement(loc.mm_hash, conn.target, conn.incarnation_id, loc, conn.weights_digest, self.consumer_id)
                for loc in locations]

    def _encode_admitted(self, conn: EncoderConnection, items: Sequence[MediaSpec]) -> list[pb2.ItemLocation]:
        """Encode, honouring RESOURCE_EXHAUSTED retry hints for at most one RPC timeout."""
        give_up = time.monotonic() + self.rpc_timeout_s
        while True:
            try:
                return conn.encode(items)
            except CacheFullError as exc:
                wait = exc.retry_after_ms / 1000.0
                if time.monotonic() + wait > give_up:
                    raise
                time.sleep(wait)

    def _pull(self, conn: EncoderConnection, locations: Sequence[pb2.ItemLocation],
              owner: str | None = None, keep_leases: bool = False) -> list[PulledItem]:
        """Pull, then verify, every location; local-cache hits need no transfer. ``owner``: the
        consumer the leases were granted to, when not this one (placed items); ``keep_leases``:
        the caller gives them back."""
        results: list[PulledItem | None] = [None] * len(locations)
        todo: list[int] = []
        for i, loc in enumerate(locations):
            local = self._local.get(conn.weights_digest, loc.mm_hash)
            if local is not None:
                results[i] = dataclasses.replace(local, source="local")
            else:
                todo.append(i)
        releasing: EncoderConnection | _OnBehalf | _Kept = _KEPT if keep_leases else self._releasing(conn, owner)
        self._releaser.add(releasing, [loc.lease_id for loc, r in zip(locations, results) if r is not None])
        if todo:
            for i, item in zip(todo, self._pull_verified(conn, [locations[i] for i in todo], releasing)):
                results[i] = item
        return [r for r in results if r is not None]

    def _pull_verified(self, conn: EncoderConnection, locs: Sequence[pb2.ItemLocation],
                       releasing: EncoderConnection | _OnBehalf | _Kept) -> list[PulledItem]:
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
                    releasing: EncoderConnection | _OnBehalf | _Kept) -> list[PulledItem]:
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
                raise self._fail(LoadFailureReason.TIMEOUT, locs, str(exc)) from exc
            local = np.asarray(local_ids, dtype=np.int32)
            peer = conn.peer()
            try:
                # The rows, then, only once they are in, the tags and generations that prove them.
                tags, gens = peer.read_blocks_and_tags(remote, local, self.pull_timeout_s)
            except TransferTimeout as exc:
                raise self._fail(LoadFailureReason.TIMEOUT, locs, str(exc)) from exc
            except (PeerDisconnected, TransportError) as exc:
                # Any other failed READ leaves the peer in doubt: drop it, handshake next time.
                conn.reset()
                leases_pinned = False  # or expire at their ttl, if the encoder lives on
                raise self._fail(LoadFailureReason.DISCONNECT, locs, str(exc)) from exc
            self._releaser.add(releasing, lease_ids)
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
            self._local.put(item, len(loc.block_ids))
            self._where[loc.mm_hash] = conn.target
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

    def _fail(self, reason: LoadFailureReason, locs: Sequence[pb2.ItemLocation], detail: str = "",
              *, mm_hash: str = "", block: int | None = None, expected: object = None,
              got: object = None) -> ECLoadFailure:
        self.metrics.load_failures.labels(reason=reason.value).inc()
        name = mm_hash or (locs[0].mm_hash if locs else "?")
        return ECLoadFailure(reason, name, block=block, expected=expected, got=got, detail=detail)


class _EncoderDown(EpdError):
    """An encoder did not answer, or serves other weights; the item moves to the next encoder in rendezvous order."""


class AsyncEncoderCacheClient:
    """asyncio face of :class:`EncoderCacheClient`: each call runs in a worker thread."""

    def __init__(self, client: EncoderCacheClient) -> None:
        self.client = client

    async def encode(self, items: Sequence[MediaSpec]) -> list[PulledItem]:
        return await asyncio.to_thread(self.client.encode, items)

    async def lookup(self, mm_hashes: Sequence[str]) -> list[PulledItem | None]:
        return await asyncio.to_thread(self.client.lookup, mm_hashes)

    async def close(self) -> None:
        await asyncio.to_thread(self.client.close)


__all__ = [
    "AsyncEncoderCacheClient", "EncoderCacheClient", "HandshakeError", "Placement", "PulledItem", "check_location",
    "gather_batch", "gather_rows", "verify_batch", "verify_item",
]
