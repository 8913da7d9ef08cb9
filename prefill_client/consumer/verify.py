"""Checks and copies of a verified pull, as pure functions over numbers and tensors (any process that pulls).

:func:`verify_item` is the rule: rows READ for a location are its item only if
every block's tag, READ *after* the rows, equals the fingerprint recomputed
here from the ``mm_hash`` and every generation equals the location's.
:func:`verify_batch` applies it to a whole batch in two list comparisons
and falls back to :func:`verify_item` only to name what failed.
:func:`gather_batch` copies every item's real rows out of the landing blocks
in one indexed copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from common.device import settle
from common.errors import ECLoadFailure, LoadFailureReason
from common.fingerprint import cached_fingerprint as fingerprint_of
from common.wire import pb2


def check_location(loc: pb2.ItemLocation, block_size: int) -> None:
    """``ECLoadFailure(token_count)`` unless ``loc``'s blocks can hold exactly its tokens."""
    tpb = list(loc.tokens_per_block)
    if (not loc.block_ids or len(tpb) != len(loc.block_ids) or sum(tpb) != loc.num_tokens
            or any(not 0 < n <= block_size for n in tpb)):
        raise ECLoadFailure(
            LoadFailureReason.TOKEN_COUNT, loc.mm_hash,
            detail=f"blocks {list(loc.block_ids)} with tokens {tpb} do not hold {loc.num_tokens} tokens")


def verify_item(loc: pb2.ItemLocation, tags: np.ndarray | Sequence[int], gens: np.ndarray | Sequence[int]) -> None:
    """Prove that rows READ for ``loc`` are its item, from the tags and generations READ *after* them.

    ``tags[j]`` and ``gens[j]`` are what block ``loc.block_ids[j]`` carried
    when the second READ ran. The expected fingerprint is recomputed here from
    the ``mm_hash`` (the location's own copy is only cross-checked). Raises
    :class:`ECLoadFailure` (``tag_mismatch`` or ``generation_mismatch``)
    naming the first block that does not prove it; returns quietly otherwise.
    """
    n = len(loc.block_ids)
    if len(tags) != n or len(gens) != n:
        raise ValueError(f"{n} blocks but {len(tags)} tags and {len(gens)} generations")
    expected = fingerprint_of(loc.mm_hash)
    if loc.fingerprint != expected:
        raise ECLoadFailure(LoadFailureReason.TAG_MISMATCH, loc.mm_hash,
                            detail=f"location fingerprint {loc.fingerprint} != {expected}")
    for j, block in enumerate(loc.block_ids):
        tag, gen = int(tags[j]), int(gens[j])
        if tag != expected:
            raise ECLoadFailure(LoadFailureReason.TAG_MISMATCH, loc.mm_hash, block=block,
                                expected=expected, got=tag)
        if gen != loc.generation:
            raise ECLoadFailure(LoadFailureReason.GENERATION_MISMATCH, loc.mm_hash, block=block,
                                expected=loc.generation, got=gen)


def gather_rows(landing: torch.Tensor, local_ids: np.ndarray, tokens_per_block: Sequence[int]) -> torch.Tensor:
    """The item's rows out of landing blocks ``local_ids``, as a new tensor (landing blocks get reused)."""
    rows = [landing[int(b), :n] for b, n in zip(local_ids, tokens_per_block)]
    return torch.cat(rows) if len(rows) > 1 else rows[0].clone()


def verify_batch(locs: Sequence[pb2.ItemLocation], tags: np.ndarray | Sequence[int],
                 gens: np.ndarray | Sequence[int]) -> list[ECLoadFailure | None]:
    """:func:`verify_item` for consecutive items; ``tags``/``gens`` hold their blocks in order.

    Returns, per item, ``None`` (proven) or the ``ECLoadFailure`` it raised:
    one item's failure does not condemn the others of the batch.
    """
    counts = [len(loc.block_ids) for loc in locs]
    if len(tags) != sum(counts) or len(gens) != sum(counts):
        raise ValueError(f"{sum(counts)} blocks but {len(tags)} tags and {len(gens)} generations")
    expected = [fingerprint_of(loc.mm_hash) for loc in locs]
    # The common case in plain Python: for a batch's few dozen blocks, list comparisons
    # cost a fraction of numpy's per-call overhead.
    want_tags = [fp for fp, n in zip(expected, counts) for _ in range(n)]
    want_gens = [loc.generation for loc, n in zip(locs, counts) for _ in range(n)]
    if (all(loc.fingerprint == fp for loc, fp in zip(locs, expected))
            and _as_list(tags) == want_tags and _as_list(gens) == want_gens):
        return [None] * len(locs)
    out: list[ECLoadFailure | None] = []
    offset = 0
    for loc, n in zip(locs, counts):
        try:
            verify_item(loc, tags[offset:offset + n], gens[offset:offset + n])
            out.append(None)
        except ECLoadFailure as exc:
            out.append(exc)
        offset += n
    return out


def _as_list(values: np.ndarray | Sequence[int]) -> list[int]:
    return values.tolist() if isinstance(values, np.ndarray) else list(values)


def gather_batch(landing: torch.Tensor, local_ids: np.ndarray, locs: Sequence[pb2.ItemLocation]
                 ) -> list[torch.Tensor]:
    """Every item's real rows out of landing blocks ``local_ids`` (the items' blocks in order).

    One indexed copy into a new tensor (landing blocks get reused); each item
    gets a view of its rows in it.
    """
    block_size = landing.shape[1]
    tpb = np.fromiter((n for loc in locs for n in loc.tokens_per_block), dtype=np.int64, count=len(local_ids))
    total = int(tpb.sum())
    starts = np.repeat(np.cumsum(tpb) - tpb, tpb)  # first output row of each row's block
    rows = np.repeat(local_ids.astype(np.int64) * block_size, tpb) + (np.arange(total) - starts)
    flat = landing.view(-1, landing.shape[2]).index_select(0, torch.from_numpy(rows).to(landing.device))
    settle(landing.device)  # the landing blocks go back next, and the next READ may land in them
    out: list[torch.Tensor] = []
    offset = 0
    for loc in locs:
        out.append(flat[offset:offset + loc.num_tokens])
        offset += loc.num_tokens
    return out
