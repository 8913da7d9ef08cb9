"""The leases each answered call handed out, so a caller that gave up can give back what it never read.

A consumer whose Encode or Lookup deadline passes stops listening, but the
encoder may already have sent the answer: its leases then pin their items
for the whole lease ttl (30 s by default) and nobody will release them by id.
The answer-margin check in the service narrows that window; it cannot close
it, because the caller's clock runs ahead of ours by however long the request
took to be read here (3.5 ms left on our clock when the caller had already
given up, measured on a loaded box). So the caller names each call
(``call_id``) and, when it gives up, releases the call itself
(``ReleaseRequest.call_ids``):

* answered already: every lease of the answer is released;
* not answered yet (the handler still runs, its own deadline a little later
  than the caller's): the call is marked abandoned, and its answer, when it
  comes, gives its leases back and ends ``DEADLINE_EXCEEDED`` instead.

Entries are keyed by ``(consumer_id, call_id)``, so a consumer can only give
up its own calls. They live no longer than their leases can (the lease ttl
after the answer) and leave as soon as their leases are released by id;
abandoned marks live :data:`ABANDONED_TTL_S`. Both are capped, oldest first:
past the cap a lost answer falls back to the lease ttl, as before.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterable

MAX_CALL_ID_CHARS = 64
MAX_CALLS = 65_536  # answered calls remembered; beyond, the oldest falls back to its lease ttl
MAX_ABANDONED = 4_096
# A handler outlives its caller's deadline by the time the request took to be read here;
# the engine bounds a request to 120 s, so no answer comes later than that.
ABANDONED_TTL_S = 120.0

Key = tuple[str, str]  # (consumer_id, call_id)


class CallLeases:
    """``(consumer, call) -> lease ids`` of recent answers, and the calls their callers gave up on."""

    def __init__(self, lease_ttl_s: float, *, max_calls: int = MAX_CALLS, max_abandoned: int = MAX_ABANDONED,
                 abandoned_ttl_s: float = ABANDONED_TTL_S) -> None:
        if not lease_ttl_s > 0:
            raise ValueError(f"lease ttl must be > 0 seconds, got {lease_ttl_s}")
        self.lease_ttl_s = lease_ttl_s
        self.max_calls = max_calls
        self.max_abandoned = max_abandoned
        self.abandoned_ttl_s = abandoned_ttl_s
        self._leases: dict[Key, tuple[set[int], float]] = {}  # lease ids, when the entry expires
        self._call_of: dict[int, Key] = {}
        self._expiry: collections.deque[tuple[float, Key]] = collections.deque()  # answer order = expiry order
        self._abandoned: collections.OrderedDict[Key, float] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._leases)

    @property
    def num_abandoned(self) -> int:
        return len(self._abandoned)

    def answered(self, consumer_id: str, call_id: str, lease_ids: Iterable[int], now: float | None = None) -> bool:
        """Remember the leases of an answer about to be sent; ``False`` if its caller gave up on it
        already (the caller must then give the leases back and not answer)."""
        now = time.monotonic() if now is None else now
        self._expire(now)
        key = (consumer_id, call_id)
        if self._abandoned.pop(key, None) is not None:
            return False
        ids = set(lease_ids)
        if not ids:
            return True
        self._forget(key)  # a reused call id: the newest answer is the one it names
        until = now + self.lease_ttl_s
        self._leases[key] = (ids, until)
        for lease_id in ids:
            self._call_of[lease_id] = key
        self._expiry.append((until, key))
        while len(self._leases) > self.max_calls:
            until, oldest = self._expiry.popleft()
            entry = self._leases.get(oldest)
            if entry is not None and entry[1] <= until:
                self._forget(oldest)
        return True

    def abandon(self, consumer_id: str, call_id: str, now: float | None = None) -> list[int]:
        """The caller gave up on the call: the lease ids its answer granted (to release), or none
        yet, and then the answer to come is refused."""
        now = time.monotonic() if now is None else now
        self._expire(now)
        key = (consumer_id, call_id)
        ids = self._forget(key)
        if ids is None:
            self._abandoned[key] = now + self.abandoned_ttl_s
            self._abandoned.move_to_end(key)
            while len(self._abandoned) > self.max_abandoned:
                self._abandoned.popitem(last=False)
            return []
        return sorted(ids)

    def released(self, consumer_id: str, lease_ids: Iterable[int]) -> None:
        """Leases ``consumer_id`` gave back by id: their calls no longer need remembering (ids
        of another consumer's calls are left alone, as the lease table refuses them)."""
        for lease_id in lease_ids:
            key = self._call_of.get(lease_id)
            if key is None or key[0] != consumer_id:
                continue
            del self._call_of[lease_id]
            entry = self._leases.get(key)
            if entry is not None:
                entry[0].discard(lease_id)
                if not entry[0]:
                    del self._leases[key]

    def _forget(self, key: Key) -> set[int] | None:
        entry = self._leases.pop(key, None)
        if entry is None:
            return None
        for lease_id in entry[0]:
            self._call_of.pop(lease_id, None)
        return entry[0]

    def _expire(self, now: float) -> None:
        # An entry whose lease ttl passed pins nothing any more. Stale deque entries (released,
        # or a call id answered again later) name a key that is gone or expires later.
        while self._expiry and self._expiry[0][0] <= now:
            until, key = self._expiry.popleft()
            entry = self._leases.get(key)
            if entry is not None and entry[1] <= until:
                self._forget(key)
        while self._abandoned:
            key, until = next(iter(self._abandoned.items()))
            if until > now:
                break
            del self._abandoned[key]
