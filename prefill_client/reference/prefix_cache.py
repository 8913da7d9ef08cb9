"""Layer 2b of the prefill worker: KV of full token blocks, keyed by content (prefill process).

A block's key is a hash chain, as in the reference::

    hash(parent_hash, block_token_ids, ((mm_hash, item_offset - block_start), ...))

with one ``(mm_hash, rel_offset)`` pair for every media item whose placeholder
range intersects the block, in sequence order. ``rel_offset`` is where the
item's first placeholder sits relative to the block's first token (negative
when the item began in an earlier block), so a block hits only when the token
ids, the identity of every image in it and the image's position all match:
two same-sized images (identical placeholder ids) or the same image shifted by
one token miss. The parent hash makes every key depend on the whole prefix.

Only full blocks are cached. Lookups return the leading run of cached blocks;
the worker caps the run so that at least the last prompt token is computed
(its logits give the first token), which is what makes an identical replay a
hit of every block but the one holding the last token.

Eviction is LRU over blocks. A request refreshes its blocks deepest-first, so
a chain's parents are always more recent than its children and a chain is
evicted from its tail: a reachable prefix never loses a middle block.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import threading
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

BlockHash = bytes

_PERSON = b"epd-prefix-v1"
# Parent of the first block: a fixed value, so the first block is keyed like any other.
ROOT_HASH: BlockHash = hashlib.blake2b(b"root", digest_size=16, person=_PERSON).digest()


@dataclass(frozen=True, slots=True)
class MediaRange:
    """An item's placeholders in the sequence, named by its ``mm_hash``."""

    mm_hash: str
    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


def hash_block(
    parent: BlockHash, token_ids: Sequence[int], extra_keys: Sequence[tuple[str, int]]
) -> BlockHash:
    """Key of one block: its parent's key, its token ids and its media extra keys."""
    h = hashlib.blake2b(digest_size=16, person=_PERSON)
    h.update(parent)
    h.update(len(token_ids).to_bytes(4, "little"))
    h.update(array("q", token_ids).tobytes())
    for mm_hash, rel_offset in extra_keys:
        data = mm_hash.encode()
        h.update(len(data).to_bytes(4, "little"))
        h.update(data)
        h.update(rel_offset.to_bytes(8, "little", signed=True))
    return h.digest()


def block_extra_keys(
    num_blocks: int, block_size: int, items: Iterable[MediaRange]
) -> list[list[tuple[str, int]]]:
    """Per full block, ``(mm_hash, item.offset - block_start)`` of each item intersecting it."""
    extras: list[list[tuple[str, int]]] = [[] for _ in range(num_blocks)]
    for item in sorted(items, key=lambda r: r.offset):
        if item.length <= 0 or item.offset < 0:
            raise ValueError(f"item {item.mm_hash} has an empty or negative range {item}")
        first, last = item.offset // block_size, (item.end - 1) // block_size
        for b in range(first, min(last, num_blocks - 1) + 1):
            extras[b].append((item.mm_hash, item.offset - b * block_size))
    return extras


def block_hashes(token_ids: Sequence[int], items: Iterable[MediaRange], block_size: int) -> list[BlockHash]:
    """Keys of every full block of ``token_ids`` (a trailing partial block has none)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    num_blocks = len(token_ids) // block_size
    extras = block_extra_keys(num_blocks, block_size, items)
    out: list[BlockHash] = []
    parent = ROOT_HASH
    for b in range(num_blocks):
        parent = hash_block(parent, token_ids[b * block_size:(b + 1) * block_size], extras[b])
        out.append(parent)
    return out


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """The leading run of cached blocks of one lookup."""

    num_blocks: int
    kv: tuple[torch.Tensor, ...]  # per block [layers, 2, block_size, kv_heads, head_dim]


class PrefixCache:
    """KV blocks by block hash, LRU, bounded in blocks. Thread-safe."""

    def __init__(self, block_size: int, capacity_blocks: int) -> None:
        if block_size <= 0 or capacity_blocks <= 0:
            raise ValueError(
                f"prefix cache block_size and capacity_blocks must be > 0, got {block_size} and {capacity_blocks}")
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self._blocks: collections.OrderedDict[BlockHash, torch.Tensor] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.evicted_blocks = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: BlockHash) -> bool:
        with self._lock:
            return block_hash in self._blocks

    def lookup(self, hashes: Sequence[BlockHash], max_blocks: int | None = None) -> PrefixHit:
        """The cached KV of the leading blocks of ``hashes``, stopping at the first miss."""
        limit = len(hashes) if max_blocks is None else max(0, min(max_blocks, len(hashes)))
        found: list[torch.Tensor] = []
        with self._lock:
            for block_hash in hashes[:limit]:
                kv = self._blocks.get(block_hash)
                if kv is None:
                    break
                found.append(kv)
        return PrefixHit(len(found), tuple(found))

    def store(self, hashes: Sequence[BlockHash], kv: Sequence[torch.Tensor], first: int) -> None:
        """Store the KV of blocks ``hashes[first:]`` and mark all of ``hashes`` as just used.

        Each KV block is ``[layers, 2, block_size, kv_heads, head_dim]``. The
        request's blocks are refreshed deepest first and eviction runs only
        afterwards, so what goes is other requests' least recent tails (or,
        when one request alone exceeds the capacity, its own deepest blocks).
        """
        if len(kv) != len(hashes) - first:
            raise ValueError(f"{len(kv)} KV blocks for {len(hashes) - first} new block hashes")
        for block in kv:
            if block.dim() != 5 or block.shape[1] != 2 or block.shape[2] != self.block_size:
                raise ValueError(
                    f"a KV block must be [layers, 2, {self.block_size}, kv_heads, head_dim], "
                    f"got {tuple(block.shape)}")
        with self._lock:
            for block_hash, block in zip(hashes[first:], kv):
                # An existing key names the same prefix, hence the same KV: keep it.
                self._blocks.setdefault(block_hash, block)
            for block_hash in reversed(hashes):
                if block_hash in self._blocks:
                    self._blocks.move_to_end(block_hash)
            while len(self._blocks) > self.capacity_blocks:
                self._blocks.popitem(last=False)
                self.evicted_blocks += 1
