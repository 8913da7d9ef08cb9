"""Layer 1 of the encoder's caches: preprocessed items by mm_hash, LRU, bounded in bytes (encoder process)."""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from encoder_server.engine import ProcessedItem


class InputCache:
    """Preprocessed items (pixel tensors) by mm_hash, so a miss of a known image skips decoding.

    By mm_hash rather than by content: it carries the item's cache salt, so one tenant's
    decoded pixels never speed up another tenant's miss of the same bytes.
    """

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._items: collections.OrderedDict[str, ProcessedItem] = collections.OrderedDict()
        self._bytes = 0

    def get(self, key: str) -> ProcessedItem | None:
        item = self._items.get(key)
        if item is not None:
            self._items.move_to_end(key)
        return item

    def put(self, key: str, item: ProcessedItem) -> None:
        size = item.nbytes
        if size > self.capacity_bytes or key in self._items:
            return
        self._items[key] = item
        self._bytes += size
        while self._bytes > self.capacity_bytes:
            _, old = self._items.popitem(last=False)
            self._bytes -= old.nbytes
