"""What a client remembers of items it placed or pulled: bounded, least recently used first out (any process that places or pulls).

A proxy runs for weeks and sees millions of distinct images; what it keeps per item must not
grow with them. Forgetting is always safe here: an item the client forgot is encoded or
looked up as if it were new.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Hashable, Iterable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

RECENT_ITEMS = 16_384  # a client's two maps (where found, what it placed) hold about 7 MB when full (measured)


class RecentMap(Generic[K, V]):
    """A map of at most ``capacity`` entries; setting or reading an entry makes it the newest.
    Thread-safe (the client's calls run on several threads)."""

    def __init__(self, capacity: int = RECENT_ITEMS) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._items: collections.OrderedDict[K, V] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def __setitem__(self, key: K, value: V) -> None:
        with self._lock:
            self._set(key, value)

    def update(self, pairs: Iterable[tuple[K, V]]) -> None:
        with self._lock:
            for key, value in pairs:
                self._set(key, value)

    def pop(self, key: K) -> V | None:
        with self._lock:
            return self._items.pop(key, None)

    def _set(self, key: K, value: V) -> None:
        self._items[key] = value
        self._items.move_to_end(key)
        if len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items
