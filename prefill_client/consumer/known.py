"""Items a client placed before, found again by Lookup, not sent again (any process that places).

:class:`KnownPlacements` remembers, for the last items :meth:`EncoderCacheClient.place
<prefill_client.consumer.client.EncoderCacheClient.place>` placed, the mm_hash their encoder
answered for those bytes under that ``cache_salt``, with the encoder and its incarnation. The
next placement of the same bytes is one Lookup of that mm_hash per encoder; what it does not
find is left to the Encode path, which decides what a missing item or a down encoder means.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from collections.abc import Callable, Sequence

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
    """(content key, cache_salt) -> (encoder target, its incarnation, mm_hash) of the items placed.

    ``calling`` maps an RPC's failures as an Encode's (a timeout fails the call; an encoder that
    is down is :class:`~prefill_client.consumer.pool.EncoderDown`); ``where`` learns where items
    were found; ``release`` gives back placements a failed call had already been granted.
    """

    def __init__(self, pool: EncoderPool, where: RecentMap[str, str], consumer_id: str, calling: Calling,
                 release: Callable[[Sequence[Placement]], None]) -> None:
        self._pool, self._where, self._consumer_id = pool, where, consumer_id
        self._calling, self._release = calling, release
        self._placed: RecentMap[tuple[str, str], tuple[str, str, str]] = RecentMap()

    def remember(self, conn: EncoderConnection, items: Sequence[MediaSpec],
                 locations: Sequence[pb2.ItemLocation]) -> None:
        """``items`` were placed on ``conn`` at ``locations`` (an Encode's answer, in order)."""
        self._placed.update(((item.key(), item.cache_salt), (conn.target, conn.incarnation_id, loc.mm_hash))
                            for item, loc in zip(items, locations))

    def find(self, items: Sequence[MediaSpec]) -> list[Placement | None]:
        """Placements of the items placed before, by one Lookup per encoder of the mm_hashes it
        answered then; None for the rest (new, forgotten, no longer found, or on an encoder that
        left, restarted or is not ready)."""
        out: list[Placement | None] = [None] * len(items)
        groups: dict[tuple[str, str], dict[str, list[int]]] = collections.defaultdict(dict)
        for i, item in enumerate(items):
            known = self._placed.get((item.key(), item.cache_salt))
            if known is not None:
                target, incarnation, mm_hash = known
                groups[(target, incarnation)].setdefault(mm_hash, []).append(i)
        try:
            for (target, incarnation), wanted in groups.items():
                self._find_on(target, incarnation, wanted, items, out)
        except BaseException:
            self._release(distinct(out))
            raise
        return out

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

