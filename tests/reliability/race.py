"""The reuse race: items, their reference rows, and the location directory a racing producer publishes (both processes).

A producer process (:mod:`tests.reliability.race_producer`) owns a real
:class:`~encoder_server.cache_blocks.EncoderCacheBlocks` registered with a
real :class:`~common.transport.ProducerTransport` and re-allocates blocks as
fast as it can: other items (eviction) and the same item again (the ABA case).
After each allocation it writes the item's rows -- after the stamp, as the
encoder does -- and publishes the item's location in a small file-backed
directory that the test process maps.

The directory is a seqlock per item: the writer makes ``seq`` odd, writes
the entry, makes it even; a reader retries until it reads the same even
``seq`` before and after. Entries are int64 (single-copy atomic on every
platform this runs on), so a reader never sees a torn location, only a stale
one -- which is exactly what a consumer holding an expired lease has.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from common.fingerprint import mm_hash_fingerprint
from common.layout import CacheLayout
from common.wire import pb2

MAX_BLOCKS_PER_ITEM = 2
# Header words: producer iterations, re-allocations of a present item (ABA), evictions.
HEADER_WORDS = 4
H_ITERATIONS, H_SAME_ITEM, H_EVICTIONS = 0, 1, 2
ENTRY_WORDS = 3 + MAX_BLOCKS_PER_ITEM  # seq, generation, block count, block ids
_READ_ATTEMPTS = 10_000


@dataclass(frozen=True, slots=True)
class RaceSpec:
    """A tiny cache and more items than fit, so every allocation evicts or reuses."""

    num_blocks: int = 6  # 5 usable + scratch
    block_size: int = 16
    out_hidden_size: int = 32
    num_items: int = 8

    @property
    def layout(self) -> CacheLayout:
        return CacheLayout(self.num_blocks, self.block_size, self.out_hidden_size, 0, torch.bfloat16)

    def mm_hash(self, item: int) -> str:
        return hashlib.blake2b(f"race-item-{item}".encode(), digest_size=16).hexdigest()

    def tokens_per_block(self, item: int) -> list[int]:
        """Every third item spans two blocks; the others fill part of one."""
        half = self.block_size // 2
        if item % 3 == 0:
            return [self.block_size, half]
        return [half + 1 + item % half]

    def rows(self, item: int) -> torch.Tensor:
        """The item's embedding rows: distinct per item and per row, identical in every process."""
        generator = torch.Generator().manual_seed(7919 * (item + 1))
        n = sum(self.tokens_per_block(item))
        return torch.randn((n, self.out_hidden_size), generator=generator).to(torch.bfloat16)

    def words(self) -> int:
        return HEADER_WORDS + self.num_items * ENTRY_WORDS


class Directory:
    """The producer's published item locations, in a file both processes map."""

    def __init__(self, path: Path, spec: RaceSpec, *, create: bool = False) -> None:
        self.spec = spec
        if create:
            np.zeros(spec.words(), dtype=np.int64).tofile(path)
        self._words = np.memmap(path, dtype=np.int64, mode="r+", shape=(spec.words(),))
        self._entries = self._words[HEADER_WORDS:].reshape(spec.num_items, ENTRY_WORDS)

    def header(self, word: int) -> int:
        return int(self._words[word])

    def bump(self, word: int) -> None:
        self._words[word] += 1

    def publish(self, item: int, generation: int, block_ids: list[int]) -> None:
        entry = self._entries[item]
        entry[0] += 1  # odd: being written
        entry[1] = generation
        entry[2] = len(block_ids)
        entry[3:3 + len(block_ids)] = block_ids
        entry[0] += 1  # even: complete

    def location(self, item: int) -> pb2.ItemLocation | None:
        """The item's last published location (``None`` before the first), never torn."""
        entry = self._entries[item]
        for _ in range(_READ_ATTEMPTS):
            seq = int(entry[0])
            if seq % 2:
                time.sleep(0)
                continue
            generation, count = int(entry[1]), int(entry[2])
            blocks = [int(b) for b in entry[3:3 + count]]
            if int(entry[0]) != seq:
                continue
            if seq == 0:
                return None
            spec = self.spec
            tpb = spec.tokens_per_block(item)
            h = spec.mm_hash(item)
            return pb2.ItemLocation(
                mm_hash=h, block_ids=blocks, tokens_per_block=tpb, num_tokens=sum(tpb),
                fingerprint=mm_hash_fingerprint(h), generation=generation)
        raise TimeoutError(f"directory entry of item {item} never settled")

    def close(self) -> None:
        self._words.flush()
        del self._entries, self._words
