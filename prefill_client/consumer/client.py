"""The consumer library's entry: find items on encoders, pull them verified (any process that pulls or places).

:class:`EncoderCacheClient` is what ``epd proxy``, vLLM's scheduler and workers (the connector)
and the reference prefill worker use. It composes the pieces of this package:

- :mod:`.connection`: one encoder's channel, handshake (once per incarnation) and RPCs;
- :mod:`.pool` and :mod:`.routing`: the encoders known now, and which one an item goes to
  (rendezvous hashing, the next one when one is down);
- :mod:`.pull`: the verified pull (blocks, then tags, then the checks) and the local cache;
- :mod:`.known`: items already on the encoders (placed before, or by their derived mm_hash),
  found by Lookup instead of sent again;
- :mod:`.release`: leases given back in batches, in the name of whoever took them.

Requests are batched: one RPC per encoder for all of its items, and one block READ and one
tag READ for all of them (split only when the landing pool is too small). A pull that cannot
prove its data is an :class:`ECLoadFailure`, never a silent skip.

The client is synchronous and thread-safe; :class:`~prefill_client.consumer.aio.AsyncEncoderCacheClient`
wraps it for asyncio by running calls in worker threads.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import torch

from common.config import FailurePolicy, PrefillConfig, TlsConfig, TransportKind
from common.config.shared import DERIVE_MIN_BYTES
from common.errors import (
    CacheFullError,
    ECLoadFailure,
    EncoderCallError,
    EncoderCallTimeout,
    EncoderUnreachable,
    EpdError,
    HandshakeError,
    LoadFailureReason,
    PeerDisconnected,
    WeightsMismatchError,
)
from common.media import PreprocessParams
from common.metrics import PrefillMetrics
from common.transport import ConsumerTransport
from common.wire import pb2
from prefill_client.consumer.connection import EncoderConnection, MediaSpec
from prefill_client.consumer.known import KnownPlacements, distinct
from prefill_client.consumer.pool import DEFAULT_REFRESH_INTERVAL_S, EncoderDown, EncoderPool
from prefill_client.consumer.pull import LocalCache, PulledItem, Puller, load_failure
from prefill_client.consumer.recent import RecentMap
from prefill_client.consumer.release import KEPT, LeaseReleaser, OnBehalf
from prefill_client.handoff import Placement

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

_RETRYABLE = {
    LoadFailureReason.TAG_MISMATCH, LoadFailureReason.GENERATION_MISMATCH,
    LoadFailureReason.EVICTED, LoadFailureReason.TIMEOUT, LoadFailureReason.DISCONNECT,
}


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
        encode_timeout_s: float | None = None,
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
        lookup_min_bytes: int = DERIVE_MIN_BYTES,
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
        transport's connection set-up (:meth:`ConsumerTransport._probe`). ``lookup_min_bytes``:
        :meth:`place` looks an item it did not place before up by its derived mm_hash from this
        many bytes on (:mod:`.known`). ``encode_timeout_s``: the deadline of an Encode, which waits
        in the encoder's queue and runs its tower (None: ``rpc_timeout_s``, every call's)."""
        self.model_id = model_id
        self.weights_digest = weights_digest
        self.consumer_id = consumer_id or f"{socket.gethostname()}:{os.getpid()}"
        self.rpc_timeout_s = rpc_timeout_s
        self.encode_timeout_s = encode_timeout_s if encode_timeout_s is not None else rpc_timeout_s
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
        self._local = LocalCache(local_cache_blocks)
        self._where: RecentMap[str, str] = RecentMap()  # mm_hash -> encoder target it was found on
        self._releaser = LeaseReleaser()
        self._known = KnownPlacements(self._pool, self._where, self.consumer_id, self._calling, self.release_placed,
                                      lookup_min_bytes)
        self._puller = Puller(self.transport, self.metrics, pull_timeout_s, self._local, self._releaser, self._where)

    @property
    def pull_timeout_s(self) -> float:
        """How long a pull waits for each READ, and for free landing blocks (settable: the pulls
        that start afterwards use the new value)."""
        return self._puller.pull_timeout_s

    @pull_timeout_s.setter
    def pull_timeout_s(self, value: float) -> None:
        self._puller.pull_timeout_s = value

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
                by_target[self._target_of(h)].setdefault(h, []).append(i)
        for target, wanted in by_target.items():
            conn, locations = self._lookup_on(target, list(wanted))
            found = [loc for loc in locations if loc is not None]
            if require and len(found) < len(wanted):
                conn.release([loc.lease_id for loc in found])
                raise self._evicted(target, list(wanted), locations)
            for item in self._pull(conn, found):
                for i in wanted[item.mm_hash]:
                    out[i] = item
        return out

    def place(self, items: Sequence[MediaSpec]) -> list[Placement]:
        """Encode (or find) every item on its encoder, as :meth:`encode` does, but pull nothing:
        the leased locations, in order, for another process to pull (:meth:`pull_placed`).

        Items already on their encoders are looked up first (:mod:`.known`: remembered from an
        earlier placement, or big enough to look up by the mm_hash derived here); only the rest is
        sent in an Encode. The leases end when the puller releases them, or at the encoder's lease ttl.
        """
        out = self._known.find(items)
        rest = [i for i, p in enumerate(out) if p is None]
        if rest:
            try:
                placed = self._per_encoder([items[i] for i in rest], self._place_on)
            except BaseException:
                self.release_placed(distinct(out))
                raise
            for i, p in zip(rest, placed):
                out[i] = p
        return [p for p in out if p is not None]

    def locate(self, mm_hashes: Sequence[str]) -> list[Placement]:
        """Placements of items known by mm_hash (one Lookup RPC per encoder), leased to this
        client and pulled by nobody yet: :meth:`lookup` without the pull, for another process
        to pull (:meth:`pull_placed`). An item no encoder has is ``ECLoadFailure(evicted)``,
        and the leases already granted are given back."""
        by_target: dict[str, list[int]] = collections.defaultdict(list)
        for i, h in enumerate(mm_hashes):
            by_target[self._target_of(h)].append(i)
        out: list[Placement | None] = [None] * len(mm_hashes)
        try:
            for target, indices in by_target.items():
                wanted = [mm_hashes[i] for i in indices]
                conn, locations = self._lookup_on(target, wanted)
                for i, loc in zip(indices, locations):
                    if loc is not None:
                        out[i] = Placement(loc.mm_hash, target, conn.incarnation_id, loc, conn.weights_digest,
                                           self.consumer_id)
                if None in locations:
                    raise self._evicted(target, wanted, locations)
                self._where.update((h, target) for h in wanted)
        except BaseException:
            self.release_placed([p for p in out if p is not None])
            raise
        return [p for p in out if p is not None]

    def _target_of(self, mm_hash: str) -> str:
        """The encoder an item known by mm_hash is asked for: where it was last found, else its
        first ready encoder in rendezvous order (unknown, or its encoder left)."""
        target = self._where.get(mm_hash)
        if target is None or self._pool.conn(target) is None:
            target = self._route(functools.partial(str, mm_hash))
        return target

    def _lookup_on(self, target: str, wanted: Sequence[str]) -> tuple[EncoderConnection, list[pb2.ItemLocation | None]]:
        """One Lookup of ``wanted`` on ``target``. As for encode, an encoder that left, serves other
        weights or does not answer is a loud ``ECLoadFailure(handshake)``, not a raw status."""
        conn = self._pool.conn(target)
        if conn is None:
            raise self._fail(LoadFailureReason.HANDSHAKE, [], mm_hash=wanted[0],
                             detail=f"encoder {target} left the encoder list")
        try:
            return conn, conn.lookup(wanted)
        except WeightsMismatchError as exc:
            raise self._fail(LoadFailureReason.HANDSHAKE, [], mm_hash=wanted[0], detail=str(exc)) from exc
        except (EncoderUnreachable, EncoderCallTimeout) as exc:
            raise self._fail(LoadFailureReason.HANDSHAKE, [], mm_hash=wanted[0],
                             detail=f"encoder {target} unreachable: {exc.code.name}") from exc

    def _evicted(self, target: str, wanted: Sequence[str], locations: Sequence[pb2.ItemLocation | None]
                 ) -> ECLoadFailure:
        """The failure of a Lookup that did not find every item it was sure of (the first one missing)."""
        gone = next(h for h, loc in zip(wanted, locations) if loc is None)
        return self._fail(LoadFailureReason.EVICTED, [], mm_hash=gone, detail=f"{gone} is no longer on encoder {target}")

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
            except EncoderCallError as exc:
                raise self._fail(LoadFailureReason.HANDSHAKE, [], mm_hash=placements[indices[0]].mm_hash,
                                 detail=f"encoder {target} unreachable: {exc.code.name}") from exc
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
            except EpdError as exc:
                logger.warning("lease %d on %s not given back (%s): it ends at its ttl",
                               p.location.lease_id, p.encoder, exc)
                return
        if conn is not None and conn.incarnation_id == p.incarnation_id:
            self._releaser.add(self._releasing(conn, p.owner or None), [p.location.lease_id])

    def _releasing(self, conn: EncoderConnection, owner: str | None) -> EncoderConnection | OnBehalf:
        """Who gives leases back: ``conn`` for our own, on behalf of ``owner`` for handed-on ones."""
        return conn if owner is None or owner == self.consumer_id else OnBehalf(conn, owner)

    def media_params(self) -> tuple[PreprocessParams, str]:
        """Preprocessing parameters and fingerprint every encoder must share (layer-1 token counts)."""
        seen: tuple[PreprocessParams, str] | None = None
        for conn in self._pool.connections():
            target = conn.target
            try:
                params = conn.media_params
            except EncoderCallError as exc:
                logger.warning("encoder %s unreachable for its media parameters: %s", target, exc.code)
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
                                 rpc_timeout_s=self.rpc_timeout_s, encode_timeout_s=self.encode_timeout_s,
                                 tls=self._tls,
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
            done = self._pool.with_failover(
                items[indices[0]].key, target, lambda conn: call(conn, [items[i] for i in indices]))
            for i, result in zip(indices, done):
                out[i] = result
        return [r for r in out if r is not None]

    # --- encode + pull ----------------------------------------------------------------------

    @contextlib.contextmanager
    def _calling(self, conn: EncoderConnection, items: Sequence[MediaSpec]) -> Iterator[None]:
        """What an Encode call's failures mean: overloaded (a timeout, no fail-over), or the
        encoder unusable here (``EncoderDown``: the next one in rendezvous order)."""
        try:
            yield
        except EncoderCallTimeout as exc:  # overloaded, not down: no fail-over
            raise self._fail(LoadFailureReason.TIMEOUT, [], f"Encode on {conn.target}: {exc.details}",
                             mm_hash=items[0].key()) from exc
        except EncoderUnreachable as exc:
            raise EncoderDown(exc.details) from exc
        except (PeerDisconnected, WeightsMismatchError) as exc:
            raise EncoderDown(str(exc)) from exc

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
        self._where.update((loc.mm_hash, conn.target) for loc in locations)
        self._known.remember(conn, items, locations)
        return [Placement(loc.mm_hash, conn.target, conn.incarnation_id, loc, conn.weights_digest, self.consumer_id)
                for loc in locations]

    def _encode_admitted(self, conn: EncoderConnection, items: Sequence[MediaSpec]) -> list[pb2.ItemLocation]:
        """Encode, honouring RESOURCE_EXHAUSTED retry hints for at most one RPC timeout."""
        if any(item.cache_salt for item in items):
            conn.peer()
            if not conn.keys_cache_salt:
                # An encoder of before the salt would ignore it and answer the unsalted item's entry,
                # shared with every tenant: the items go to the next encoder, as if this one were down.
                raise EncoderDown(f"encoder {conn.target} does not key items by cache_salt (it predates the field)")
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
        """Pull and verify (:class:`Puller`). ``owner``: the consumer the leases were granted to, when
        not this one (placed items); ``keep_leases``: the caller gives them back."""
        return self._puller.pull(conn, locations, KEPT if keep_leases else self._releasing(conn, owner))

    def _fail(self, reason: LoadFailureReason, locs: Sequence[pb2.ItemLocation], detail: str = "",
              *, mm_hash: str = "") -> ECLoadFailure:
        return load_failure(self.metrics, reason, locs, detail, mm_hash=mm_hash)


__all__ = ["EncoderCacheClient", "PulledItem"]
