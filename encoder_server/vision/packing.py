"""Bucket shapes and frame packing for the static-shape encoder graph (encoder process).

Buckets and attention blocks are counted in **merged tokens** (cache rows);
one merged token is ``merge**2`` patches. A bucket of ``b`` tokens is a graph
input of ``num_blocks`` attention blocks of ``block_tokens`` each:

* ``b <= attention_block``: one block of ``b`` tokens (small batches pay for a
  small attention, not for the largest one);
* ``b > attention_block``: ``b / attention_block`` blocks (``b`` must be a multiple).

The unit of packing is the *frame* (one temporal patch of an item): frames are
independent through the whole tower, so frames of several items, or the
frames of one long video, can go to any block of any launch. A frame never
straddles two blocks; attention inside a block is masked per frame. Frames are
placed first-fit-decreasing; a frame larger than every block runs alone in an
exact-size launch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from common.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BucketShape:
    """Static shape of one graph: ``num_blocks`` attention blocks of ``block_tokens`` merged tokens."""

    num_blocks: int
    block_tokens: int

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_tokens


@dataclass(frozen=True, slots=True)
class FrameRef:
    """One frame (temporal patch) of one item of a batch."""

    item: int  # index in the batch
    frame: int  # temporal index in the item
    tokens: int  # merged tokens in the frame


@dataclass(frozen=True, slots=True)
class Launch:
    """One graph run: frames placed into the blocks of a shape."""

    shape: BucketShape
    blocks: tuple[tuple[FrameRef, ...], ...]  # at most shape.num_blocks, each within block_tokens
    exact: bool  # True: a one-off shape outside the bucket set (oversize frames)

    @property
    def real_tokens(self) -> int:
        return sum(f.tokens for block in self.blocks for f in block)


def bucket_shapes(buckets: Sequence[int], attention_block: int) -> tuple[BucketShape, ...]:
    """Validate bucket sizes (merged tokens) and map each to its block geometry."""
    if attention_block <= 0:
        raise ConfigError(f"attention_block must be > 0, got {attention_block}")
    sizes = sorted(set(int(b) for b in buckets))
    if not sizes or sizes[0] <= 0:
        raise ConfigError(f"buckets must be positive token counts, got {list(buckets)}")
    shapes: list[BucketShape] = []
    for size in sizes:
        if size <= attention_block:
            shapes.append(BucketShape(1, size))
        elif size % attention_block:
            raise ConfigError(
                f"bucket {size} is larger than attention_block {attention_block} but not a multiple of it"
            )
        else:
            shapes.append(BucketShape(size // attention_block, attention_block))
    return tuple(shapes)


def first_fit(frames: Sequence[FrameRef], num_blocks: int, block_tokens: int) -> list[list[FrameRef]] | None:
    """Place frames (already sorted largest first) into at most ``num_blocks`` blocks; None if they do not fit."""
    blocks: list[list[FrameRef]] = []
    free: list[int] = []
    for frame in frames:
        if frame.tokens > block_tokens:
            return None
        for index, room in enumerate(free):
            if frame.tokens <= room:
                blocks[index].append(frame)
                free[index] -= frame.tokens
                break
        else:
            if len(blocks) == num_blocks:
                return None
            blocks.append([frame])
            free.append(block_tokens - frame.tokens)
    return blocks


def plan_launches(frames: Sequence[FrameRef], shapes: Sequence[BucketShape]) -> list[Launch]:
    """Split a batch's frames into launches, each on the smallest bucket that holds it."""
    largest = max(shapes, key=lambda s: s.tokens)
    cap = max(s.block_tokens for s in shapes)
    launches: list[Launch] = []

    # Frames larger than any block: exact-size launches, equal frames side by side.
    oversize: dict[int, list[FrameRef]] = {}
    for frame in frames:
        if frame.tokens > cap:
            oversize.setdefault(frame.tokens, []).append(frame)
    for tokens, group in sorted(oversize.items()):
        per_launch = max(1, largest.tokens // tokens)
        for start in range(0, len(group), per_launch):
            chunk = group[start:start + per_launch]
            launches.append(Launch(BucketShape(len(chunk), tokens), tuple((f,) for f in chunk), exact=True))

    # The rest: first-fit decreasing into launches of the largest bucket ...
    ordered = sorted((f for f in frames if f.tokens <= cap), key=lambda f: (-f.tokens, f.item, f.frame))
    groups: list[list[list[FrameRef]]] = []
    rooms: list[list[int]] = []
    for frame in ordered:
        placed = False
        for blocks, free in zip(groups, rooms):
            for index, room in enumerate(free):
                if frame.tokens <= room:
                    blocks[index].append(frame)
                    free[index] -= frame.tokens
                    placed = True
                    break
            if not placed and len(blocks) < largest.num_blocks and frame.tokens <= largest.block_tokens:
                blocks.append([frame])
                free.append(largest.block_tokens - frame.tokens)
                placed = True
            if placed:
                break
        if not placed:
            groups.append([[frame]])
            rooms.append([largest.block_tokens - frame.tokens])

    # ... then each launch shrinks to the smallest bucket its frames fit in.
    for blocks in groups:
        members = sorted((f for b in blocks for f in b), key=lambda f: (-f.tokens, f.item, f.frame))
        total = sum(f.tokens for f in members)
        chosen: tuple[BucketShape, list[list[FrameRef]]] = (largest, blocks)
        for shape in sorted(shapes, key=lambda s: s.tokens):
            if shape.tokens < total:
                continue
            packed = first_fit(members, shape.num_blocks, shape.block_tokens)
            if packed is not None:
                chosen = (shape, packed)
                break
        launches.append(Launch(chosen[0], tuple(tuple(b) for b in chosen[1]), exact=False))
    return launches
