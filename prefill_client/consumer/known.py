"""Items already on the encoders, found by Lookup instead of sent again (any process that places).

:meth:`EncoderCacheClient.place <prefill_client.consumer.client.EncoderCacheClient.place>`
asks :class:`KnownPlacements` first. It finds an item's mm_hash two ways:

- **remembered**: for the last items this client placed, the mm_hash their encoder answered for
  those bytes under that ``cache_salt``, with the encoder and its incarnation;
- **derived**: for an item of ``min_bytes`` (:data:`DERIVE_MIN_BYTES`) or more that it does not
  remember, the mm_hash its encoder (the first ready one in its rendezvous order, handshaken
  before) keys it by, computed here as the encoder computes it (model id, the preprocessing
  fingerprint the encoder announced, the bytes' digest, the salt). So an image another proxy,
  another worker or an earlier run of this one placed is found without sending its bytes. An
  item the Lookup misses is routed again by the Encode path (the rendezvous order is cheap; the
  look here is not counted as routing, ``counted=False``).

Either way it is one Lookup per encoder, and a Lookup answers only the entry an Encode of the same
bytes would answer. What it does not find is left to the Encode path, which decides what a missing
item or a down encoder means.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from collections.abc import Callable, Sequence

from common.config.shared import DERIVE_MIN_BYTES
from common.errors import ECLoadFailure, EpdError
from common.wire import pb2
from prefill_client.consumer.connection import EncoderConnection, MediaSpec
from prefill_client.consumer.pool import EncoderPool
from prefill_client.consumer.recent import RecentMap
from prefill_client.handoff import Placement

logger = logging.getLogger(__name__)

Calling = Callable[[EncoderConnection, Sequence[MediaSpec]], contextlib.AbstractContextManager[None]]


def distinct(placements: Sequence[Placement | None]) -> list[Placement]:
    """Each placement once (an item named twice shares one, and one lease)."""
    return list({id(p): p for p in placements if p is not None}.values())


class KnownPlacements:
    """(content key, cache_salt) -> (encoder target, its incarnation, mm_hash) of the items placed,
    and the mm_hash of the others derived.

    ``calling`` maps an RPC's failures as an Encode's (a timeout fails the call; an encoder that
    is down is :class:`~prefill_client.consumer.pool.EncoderDown`); ``where`` learns where items
    were found; ``release`` gives back placements a failed call had already been granted.
    ``min_bytes``: the smallest item looked up by its derived mm_hash.
    """

    def __init__(self, pool: EncoderPool, where: RecentMap[str, str], consumer_id: str, calling: Calling,
                 release: Callable[[Sequence[Placement]], None], min_bytes: int = DERIVE_MIN_BYTES) -> None:
        self._pool, self._where, self._consumer_id = pool, where, consumer_id
        self._calling, self._release = calling, release
        self._min_bytes = min_bytes
        self._placed: RecentMap[tuple[str, str], tuple[str, str, str]] = RecentMap()

    def remember(self, conn: EncoderConnection, items: Sequence[MediaSpec],
                 locations: Sequence[pb2.ItemLocation]) -> None:
        """``items`` were placed on ``conn`` at ``locations`` (an Encode's answer, in order)."""
        self._placed.update(((item.key(), item.cache_salt), (conn.target, conn.incarnation_id, loc.mm_hash))
                            for item, loc in zip(items, locations))

    def find(self, items: Sequence[MediaSpec]) -> list[Placement | None]:
        """Placements of the items already on the encoders, by one Lookup per encoder of their
        remembered or derived mm_hashes; None for the rest (new, small and not remembered, no longer
        found, or on an encoder that left, restarted or is not ready)."""
        out: list[Placement | None] = [None] * len(items)
        groups: dict[tuple[str, str], dict[str, list[int]]] = collections.defaultdict(dict)
        for i, item in enumerate(items):
            where = self._placed.get((item.key(), item.cache_salt)) or self._derived(item)
            if where is not None:
                target, incarnation, mm_hash = where
                groups[(target, incarnation)].setdefault(mm_hash, []).append(i)
        try:
            for (target, incarnation), wanted in groups.items():
                self._find_on(target, incarnation, wanted, items, out)
        except BaseException:
            self._release(distinct(out))
            raise
        return out

    def _derived(self, item: MediaSpec) -> tuple[str, str, str] | None:
        """(target, incarnation, mm_hash) of ``item`` on the encoder an Encode would send it to, when
        it is big enough to be worth a Lookup and that encoder was handshaken before."""
        if sum(len(frame) for frame in item.frames) < self._min_bytes:
            return None
        order = self._pool.order(item.key, counted=False)
        conn = self._pool.conn(order[0]) if order else None
        derived = conn.mm_hash_of(item) if conn is not None else None
        return None if derived is None else (order[0], *derived)

    def _find_on(self, target: str, incarnation: str, wanted: dict[str, list[int]], items: Sequence[MediaSpec],
                 out: list[Placement | None]) -> None:
        """One Lookup of ``wanted`` (mm_hash -> indices of ``items``) on ``target``; fills ``out``."""
        conn = self._pool.conn(target)
        if conn is None or conn.incarnation_id != incarnation or not self._pool.ready(target):
            return
        try:
            # A timeout fails the call as an Encode's would (overloaded: no second try);
            # an encoder that is down or refuses is left to the Encode path's fail-over.
            with self._calling(conn, [items[i] for indices in wanted.values() for i in indices]):
                locations = conn.lookup(list(wanted))
        except ECLoadFailure:
            raise
        except EpdError as exc:
            logger.debug("lookup of %d known items on %s failed (%s): encoding them", len(wanted), target, exc)
            return
        if conn.incarnation_id != incarnation:  # it restarted meanwhile: its answer is its new cache's
            conn.release([loc.lease_id for loc in locations if loc is not None])
            return
        for indices, loc in zip(wanted.values(), locations):
            if loc is not None:
                placement = Placement(loc.mm_hash, target, incarnation, loc, conn.weights_digest, self._consumer_id)
                for i in indices:
                    out[i] = placement
        self._where.update((h, target) for h, loc in zip(wanted, locations) if loc is not None)

