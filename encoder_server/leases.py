"""Lease table pinning cache allocations while consumers pull them (encoder process).

A lease is granted when an item's location is handed to a consumer and ends
when the consumer releases it or when it expires ``ttl`` after the grant, so a
consumer that vanished cannot pin blocks forever. Expiry is lazy: a min-heap of
``(expires_at, lease_id)`` is popped by :meth:`LeaseTable.reap`, which the
owner calls at the start of every operation. A released lease leaves a stale
heap entry behind; the heap is rebuilt from the live leases when stale entries
outnumber live ones several times over, so memory stays proportional to the
live leases and every operation stays O(log n) amortized.

Lease ids are random 63-bit numbers, unique among live leases. A release
arrives as a NIXL notification, and the target of a notification does not
learn who sent it, so the id itself is the only credential a release
carries: sequential ids would let any peer release other consumers' leases
by counting.

Not thread-safe on its own: :class:`~encoder_server.cache_blocks.EncoderCacheBlocks`
calls it under its lock.
"""

from __future__ import annotations

import heapq
import logging
import math
import secrets
from dataclasses import dataclass
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

P = TypeVar("P")

# Rebuild the expiry heap once it holds this many times more entries than
# there are live leases (and is not tiny).
_COMPACT_RATIO = 4
_COMPACT_MIN = 64
LEASE_ID_BITS = 63  # fits int64 and uint64 alike; 0 is never issued


@dataclass(frozen=True, slots=True)
class Lease:
    """A consumer's claim on one allocation; ``expires_at`` is on the cache's clock."""

    lease_id: int
    mm_hash: str
    owner: str
    expires_at: float


@dataclass(frozen=True, slots=True)
class LeaseStats:
    """Lease counters since start-up; ``active`` is a point-in-time count."""

    active: int
    released: int
    expired: int
    rejected: int


@dataclass(slots=True)
class _LiveLease(Generic[P]):
    lease: Lease
    payload: P


class LeaseTable(Generic[P]):
    """Live leases keyed by id, each carrying the owner's payload (the pinned record)."""

    def __init__(self, ttl_s: float) -> None:
        if not ttl_s > 0:
            raise ValueError(f"lease ttl must be > 0 seconds, got {ttl_s}")
        self._ttl_s = ttl_s
        self._live: dict[int, _LiveLease[P]] = {}
        self._expiry: list[tuple[float, int]] = []
        self._released = 0
        self._expired = 0
        self._rejected = 0

    def __len__(self) -> int:
        return len(self._live)

    @property
    def next_expiry(self) -> float:
        """Earliest expiry in the heap (may be a released lease); ``inf`` when empty."""
        return self._expiry[0][0] if self._expiry else math.inf

    def stats(self) -> LeaseStats:
        return LeaseStats(len(self._live), self._released, self._expired, self._rejected)

    def grant(self, payload: P, mm_hash: str, owner: str, now: float) -> Lease:
        lease = Lease(self._new_id(), mm_hash, owner, now + self._ttl_s)
        self._live[lease.lease_id] = _LiveLease(lease, payload)
        heapq.heappush(self._expiry, (lease.expires_at, lease.lease_id))
        return lease

    def _new_id(self) -> int:
        """An unguessable id no live lease has (a repeat is astronomically rare, but checked)."""
        while True:
            lease_id = secrets.randbits(LEASE_ID_BITS)
            if lease_id and lease_id not in self._live:
                return lease_id

    def release(self, lease_id: int, owner: str | None, now: float) -> P | None:
        """End a live lease and return its payload; ``None`` (counted) when rejected.

        Rejected: unknown or already ended, expired (``expires_at <= now``), or
        ``owner`` given and different from the grantee. A rejected release
        changes nothing else; an expired lease is left for :meth:`reap`.
        """
        live = self._live.get(lease_id)
        if live is None or live.lease.expires_at <= now:
            self._rejected += 1
            logger.debug("release of unknown or expired lease %s rejected", lease_id)
            return None
        if owner is not None and owner != live.lease.owner:
            self._rejected += 1
            logger.warning(
                "release of lease %s by %r rejected: granted to %r", lease_id, owner, live.lease.owner
            )
            return None
        del self._live[lease_id]
        self._released += 1
        self._maybe_compact()
        return live.payload

    def reap(self, now: float) -> list[P]:
        """Remove every lease with ``expires_at <= now``; return their payloads."""
        expired: list[P] = []
        heap = self._expiry
        while heap and heap[0][0] <= now:
            _, lease_id = heapq.heappop(heap)
            live = self._live.pop(lease_id, None)
            if live is not None:  # None: released earlier, a stale heap entry
                self._expired += 1
                expired.append(live.payload)
                logger.info(
                    "lease %s on %s (owner %r) expired unreleased",
                    lease_id, live.lease.mm_hash, live.lease.owner,
                )
        return expired

    def _maybe_compact(self) -> None:
        if len(self._expiry) > _COMPACT_MIN and len(self._expiry) > _COMPACT_RATIO * len(self._live):
            self._expiry = [(live.lease.expires_at, lid) for lid, live in self._live.items()]
            heapq.heapify(self._expiry)
