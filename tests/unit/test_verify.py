"""The batch checks of a verified pull (prefill_client.consumer.verify), on plain numbers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.errors import ECLoadFailure, LoadFailureReason
from common.fingerprint import mm_hash_fingerprint
from common.wire import pb2
from prefill_client.consumer.verify import gather_batch, verify_batch

HASHES = ["a" * 32, "b" * 32, "c" * 32]


def locations() -> list[pb2.ItemLocation]:
    blocks = [[4], [7, 2], [9]]
    tpb = [[3], [4, 1], [2]]
    return [pb2.ItemLocation(mm_hash=h, block_ids=b, tokens_per_block=t, num_tokens=sum(t),
                             fingerprint=mm_hash_fingerprint(h), generation=10 + i)
            for i, (h, b, t) in enumerate(zip(HASHES, blocks, tpb))]


def stamps(locs: list[pb2.ItemLocation]) -> tuple[np.ndarray, np.ndarray]:
    tags = [mm_hash_fingerprint(loc.mm_hash) for loc in locs for _ in loc.block_ids]
    gens = [loc.generation for loc in locs for _ in loc.block_ids]
    return np.array(tags, dtype=np.int64), np.array(gens, dtype=np.int64)


def test_a_proven_batch_has_no_verdicts() -> None:
    locs = locations()
    assert verify_batch(locs, *stamps(locs)) == [None, None, None]


@pytest.mark.parametrize(("index", "reason"), [(0, LoadFailureReason.TAG_MISMATCH),
                                                (2, LoadFailureReason.GENERATION_MISMATCH)])
def test_one_bad_block_condemns_only_its_item(index: int, reason: LoadFailureReason) -> None:
    locs = locations()
    tags, gens = stamps(locs)
    if reason is LoadFailureReason.TAG_MISMATCH:
        tags[2] = 12345  # the second block of the second item
    else:
        gens[3] += 1  # the third item's only block
    verdicts = verify_batch(locs, tags, gens)
    bad = 1 if reason is LoadFailureReason.TAG_MISMATCH else 2
    assert [v is None for v in verdicts] == [i != bad for i in range(3)]
    failure = verdicts[bad]
    assert isinstance(failure, ECLoadFailure) and failure.reason is reason
    assert failure.mm_hash == HASHES[bad] and failure.block == locs[bad].block_ids[-1]


def test_a_location_naming_the_wrong_fingerprint_fails_even_when_the_stamps_match_it() -> None:
    locs = locations()
    locs[0].fingerprint = 99
    tags, gens = stamps(locs)
    verdicts = verify_batch(locs, tags, gens)
    assert isinstance(verdicts[0], ECLoadFailure) and verdicts[1:] == [None, None]


def test_gather_batch_copies_each_items_real_rows_in_order() -> None:
    locs = locations()
    landing = torch.arange(6 * 4 * 2, dtype=torch.float32).view(6, 4, 2)  # 6 landing blocks of 4 rows
    local = np.array([5, 0, 3, 1], dtype=np.int32)  # where the four blocks landed
    rows = gather_batch(landing, local, locs)
    assert torch.equal(rows[0], landing[5, :3])
    assert torch.equal(rows[1], torch.cat([landing[0, :4], landing[3, :1]]))
    assert torch.equal(rows[2], landing[1, :2])
    landing.zero_()  # a copy: the landing blocks are reused
    assert rows[0].abs().sum() > 0
