"""Lease table pinning cache allocations while consumers pull them (encoder process).

A lease pins one allocation and carries its location (:class:`Allocation`),
taken at the grant, so whoever holds the lease never re-reads the slot map.
It ends when the consumer releases it or when it expires ``ttl`` after the
location was handed out, so a consumer that vanished cannot pin blocks
forever. A lease taken by a request that is still running (waiting for its
misses) is *pending*: it does not expire until the request hands the location
out (:meth:`LeaseTable.start`) or gives it back. Its ttl must not run while
nobody outside the encoder knows the lease exists: otherwise a request that
waits longer than the ttl answers with an item that may be gone. Pending
leases still end at a ceiling (``pending_ttl``), a backstop against a request
that never finishes; the engine bounds every request well below it. Expiry is lazy: a min-heap of
``(expires_at, lease_id)`` is popped by :meth:`LeaseTable.reap`, which the
owner calls at the start of every operation. A released lease leaves a stale
heap entry behind; the heap is rebuilt from the live leases when stale entries
outnumber live ones several times over, so memory stays proportional to the
live leases and every operation stays O(log n) amortized.

Lease ids are random 63-bit numbers, unique among live leases. A release
arrives as a NIXL notification, and the target of a notification does not
learn who sent it, so the id itself is the only credential a release
carries: sequential ids would let any peer release other consumers' leases
by counting. They come from the operating system's CSPRNG (``os.urandom``,
which ``secrets`` reads too) a batch at a time, so that granting one (every
Lookup does) costs no system call.

Not thread-safe on its own: :class:`~encoder_server.cache_blocks.EncoderCacheBlocks`
calls it under its lock.
"""

from __future__ import annotations

import array
import dataclasses
import heapq
import logging
import math
import os
from dataclasses import dataclass
from typing import Generic, TypeVar

from encoder_server.cache_records import Allocation

logger = logging.getLogger(__name__)

P = TypeVar("P")

# Rebuild the expiry heap once it holds this many times more entries than
# there are live leases (and is not tiny).
_COMPACT_RATIO = 4
_COMPACT_MIN = 64
LEASE_ID_BITS = 63  # fits int64 and uint64 alike; 0 is never issued
_ID_BATCH = 256  # random ids read from the OS per system call


@dataclass(frozen=True, slots=True)
class Lease:
    """A consumer's claim on one allocation; ``expires_at`` is on the cache's clock.

    ``pending`` until the location is handed out: its ``expires_at`` is then
    the backstop ceiling, not the ttl.
    """

    lease_id: int
    mm_hash: str
    owner: str
    expires_at: float
    allocation: Allocation
    pending: bool = False


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

    def __init__(self, ttl_s: float, pending_ttl_s: float = math.inf) -> None:
        if not ttl_s > 0:
            raise ValueError(f"lease ttl must be > 0 seconds, got {ttl_s}")
        if not pending_ttl_s > 0:
            raise ValueError(f"pending lease ttl must be > 0 seconds, got {pending_ttl_s}")
        self._ttl_s = ttl_s
        self._pending_ttl_s = pending_ttl_s
        self._live: dict[int, _LiveLease[P]] = {}
        self._expiry: list[tuple[float, int]] = []
        self._released = 0
        self._expired = 0
        self._rejected = 0
        self._ids: array.array[int] = array.array("Q")  # random 64-bit words not used yet

    def __len__(self) -> int:
        return len(self._live)

    @property
    def next_expiry(self) -> float:
        """Earliest expiry in the heap (may be a released lease); ``inf`` when empty."""
        return self._expiry[0][0] if self._expiry else math.inf

    def stats(self) -> LeaseStats:
        return LeaseStats(len(self._live), self._released, self._expired, self._rejected)

    def grant(
        self, payload: P, mm_hash: str, owner: str, now: float, allocation: Allocation, *, pending: bool = False
    ) -> Lease:
        """A new lease; ``pending`` ones expire only at the ceiling until :meth:`start`."""
        expires_at = now + (self._pending_ttl_s if pending else self._ttl_s)
        lease = Lease(self._new_id(), mm_hash, owner, expires_at, allocation, pending)
        self._live[lease.lease_id] = _LiveLease(lease, payload)
        if expires_at < math.inf:
            heapq.heappush(self._expiry, (expires_at, lease.lease_id))
        return lease

    def payload(self, lease_id: int) -> P:
        """The payload of a live lease (``KeyError`` if it is not live)."""
        return self._live[lease_id].payload

    def start(self, lease_id: int, now: float) -> Lease | None:
        """Hand a lease's location out: its ttl runs from ``now``. ``None`` if it is no longer live.

        Starting a lease that is not pending renews it. The old heap entry stays
        behind as a stale one: :meth:`reap` checks the live expiry.
        """
        live = self._live.get(lease_id)
        if live is None or live.lease.expires_at <= now:
            return None
        lease = dataclasses.replace(live.lease, expires_at=now + self._ttl_s, pending=False)
        live.lease = lease
        heapq.heappush(self._expiry, (lease.expires_at, lease_id))
        self._maybe_compact()
        return lease

    def _new_id(self) -> int:
        """An unguessable id no live lease has (a repeat is astronomically rare, but checked)."""
        while True:
            if not self._ids:
                self._ids = array.array("Q", os.urandom(8 * _ID_BATCH))
            lease_id = self._ids.pop() >> (64 - LEASE_ID_BITS)
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
            live = self._live.get(lease_id)
            # None: released earlier; a later expiry: started or renewed since. Both are stale entries.
            if live is not None and live.lease.expires_at <= now:
                del self._live[lease_id]
                self._expired += 1
                expired.append(live.payload)
                logger.info(
                    "lease %s on %s (owner %r) expired unreleased%s",
                    lease_id, live.lease.mm_hash, live.lease.owner,
                    " while its request was still running" if live.lease.pending else "",
                )
        return expired

    def _maybe_compact(self) -> None:
        if len(self._expiry) > _COMPACT_MIN and len(self._expiry) > _COMPACT_RATIO * len(self._live):
            self._expiry = [(live.lease.expires_at, lid) for lid, live in self._live.items()
                            if live.lease.expires_at < math.inf]
            heapq.heapify(self._expiry)
