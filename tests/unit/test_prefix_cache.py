from __future__ import annotations

import pytest
import torch

from prefill_client.reference.prefix_cache import (
    ROOT_HASH,
    MediaRange,
    PrefixCache,
    block_extra_keys,
    block_hashes,
    hash_block,
)

B = 4


def kv(value: float, block_size: int = B) -> torch.Tensor:
    return torch.full((2, 2, block_size, 1, 2), value)


def test_extra_keys_name_every_item_intersecting_a_block_with_its_relative_offset():
    # item A at 2..9 spans blocks 0, 1, 2; item B at 10..11 sits in block 2.
    extras = block_extra_keys(3, B, [MediaRange("b", 10, 2), MediaRange("a", 2, 8)])
    assert extras == [[("a", 2)], [("a", -2)], [("a", -6), ("b", 2)]]


def test_extra_keys_ignore_the_trailing_partial_block():
    assert block_extra_keys(1, B, [MediaRange("a", 3, 4)]) == [[("a", 3)]]


def test_extra_keys_reject_an_empty_range():
    with pytest.raises(ValueError, match="empty or negative"):
        block_extra_keys(2, B, [MediaRange("a", 1, 0)])


def test_only_full_blocks_are_hashed_and_the_chain_starts_at_the_root():
    tokens = list(range(10))
    hashes = block_hashes(tokens, [], B)
    assert len(hashes) == 2
    assert hashes[0] == hash_block(ROOT_HASH, tokens[:4], [])
    assert hashes[1] == hash_block(hashes[0], tokens[4:8], [])


def test_same_tokens_different_image_differ_and_identical_inputs_agree():
    tokens = [7] * 12  # placeholder ids are identical for any image of the same size
    a = block_hashes(tokens, [MediaRange("img-a", 0, 12)], B)
    b = block_hashes(tokens, [MediaRange("img-b", 0, 12)], B)
    assert a == block_hashes(list(tokens), [MediaRange("img-a", 0, 12)], B)
    assert all(x != y for x, y in zip(a, b))


def test_same_image_one_token_later_misses_every_block_it_touches():
    tokens = [1, 2, 3, 4, 9, 9, 9, 9, 9, 9, 9, 9]
    at4 = block_hashes(tokens, [MediaRange("img", 4, 8)], B)
    at5 = block_hashes(tokens, [MediaRange("img", 5, 7)], B)
    assert at4[0] == at5[0]  # block 0 has no image in either
    assert at4[1] != at5[1] and at4[2] != at5[2]


def test_a_different_first_block_changes_every_later_key():
    one = block_hashes([1] * 4 + [5] * 8, [], B)
    two = block_hashes([2] * 4 + [5] * 8, [], B)
    assert one[1:] != two[1:] and one[1] != two[1]


def test_lookup_returns_the_leading_run_and_stops_at_the_first_miss():
    cache = PrefixCache(B, 10)
    hashes = block_hashes(list(range(16)), [], B)
    cache.store(hashes[:2], [kv(0), kv(1)], 0)
    cache.store(hashes[3:4], [kv(3)], 0)  # block 3 cached, block 2 not
    hit = cache.lookup(hashes)
    assert hit.num_blocks == 2
    assert [float(t.flatten()[0]) for t in hit.kv] == [0.0, 1.0]
    assert cache.lookup(hashes, max_blocks=1).num_blocks == 1
    assert cache.lookup(hashes, max_blocks=0).num_blocks == 0


def test_store_keeps_existing_blocks_and_checks_shapes():
    cache = PrefixCache(B, 10)
    hashes = block_hashes(list(range(8)), [], B)
    cache.store(hashes, [kv(1), kv(2)], 0)
    cache.store(hashes, [kv(9)], 1)  # same key: same prefix, the first KV stays
    assert float(cache.lookup(hashes).kv[1].flatten()[0]) == 2.0
    with pytest.raises(ValueError, match="KV blocks for"):
        cache.store(hashes, [kv(1)], 0)
    with pytest.raises(ValueError, match="must be \\[layers, 2, 4"):
        cache.store(hashes, [kv(1, block_size=3)], 1)
    with pytest.raises(ValueError, match="must be > 0"):
        PrefixCache(0, 1)


def test_eviction_takes_chain_tails_first_so_a_prefix_stays_reachable():
    cache = PrefixCache(B, 4)
    chain_a = block_hashes([1] * 12, [], B)  # 3 blocks
    chain_b = block_hashes([2] * 8, [], B)  # 2 blocks
    cache.store(chain_a, [kv(1), kv(2), kv(3)], 0)
    cache.store(chain_b, [kv(4), kv(5)], 0)  # 5 > 4: one block of chain A goes
    assert cache.evicted_blocks == 1
    assert chain_a[2] not in cache and chain_a[0] in cache and chain_a[1] in cache
    assert cache.lookup(chain_a).num_blocks == 2
    assert cache.lookup(chain_b).num_blocks == 2
    # Using chain A again makes it the most recent: chain B's tail goes next.
    cache.store(chain_a, [kv(3)], 2)
    assert chain_b[1] not in cache and chain_b[0] in cache
    assert cache.lookup(chain_a).num_blocks == 3
