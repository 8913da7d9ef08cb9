"""Monolithic mode: the prefill side reads a real EncoderCacheBlocks in the same process."""

from __future__ import annotations

import pytest
import torch

from common import media
from common.config import CacheMode
from common.errors import ECLoadFailure, EncoderCacheReadError
from common.layout import CacheLayout
from common.metrics import PrefillMetrics
from encoder_server.cache_blocks import EncoderCacheBlocks
from prefill_client.consumer.client import PulledItem
from prefill_client.consumer.connection import content_key
from prefill_client.reference.merge import merge_deepstack_embeddings
from prefill_client.reference.monolithic import EncodedItem, MonolithicReader, MonolithicSource
from prefill_client.reference.positions import build_encoder_positions
from prefill_client.reference.rows import ScheduledItem, StagingRows
from prefill_client.reference.worker import PrefillWorker
from tests.support.prefill_fakes import (
    FAT_DIM, FINGERPRINT, FRESH, LIMITS, MODEL_ID, PARAMS, TURN1, TURN2, TURN3, FakeSource, make_lm, rows_for,
    spec_tokens,
)

CACHE_BLOCK = 16


def make_cache(num_blocks: int = 24, block_size: int = CACHE_BLOCK, fat_dim: int = FAT_DIM) -> EncoderCacheBlocks:
    layout = CacheLayout(num_blocks, block_size, fat_dim // 3, 2, torch.bfloat16)
    return EncoderCacheBlocks(layout, min_hold_time_ms=0)


def write(cache: EncoderCacheBlocks, mm_hash: str, rows: torch.Tensor) -> list[int]:
    """What the encoder graph does: allocate, scatter the rows into the blocks, mark written."""
    bs = cache.layout.block_size
    n = rows.shape[0]
    tpb = [bs] * (n // bs) + ([n % bs] if n % bs else [])
    ids = cache.allocate(mm_hash, tpb)
    assert ids is not None
    start = 0
    for b, k in zip(ids, tpb):
        cache.buffer[b, :k] = rows[start:start + k]
        start += k
    cache.mark_written(mm_hash)
    return ids


class FakeLocalEncoder:
    """An in-process encoder writing into the shared cache; ``runs`` counts layer-3 misses."""

    def __init__(self, cache: EncoderCacheBlocks, token_skew: int = 0) -> None:
        self.cache = cache
        self.token_skew = token_skew
        self.runs = 0

    def encode(self, items):
        out = []
        for spec in items:
            h = media.mm_hash(MODEL_ID, FINGERPRINT, content_key(spec))
            grid, n = spec_tokens(spec)
            hit = self.cache.is_written(h)
            if not hit:
                self.runs += 1
                write(self.cache, h, rows_for(h, n + self.token_skew))
            out.append(EncodedItem(h, grid, hit))
        return out


# --- the reader ----------------------------------------------------------------------------


def test_rows_come_straight_from_the_cache_buffer():
    cache = make_cache()
    rows = rows_for("a" * 32, 20)
    ids = write(cache, "a" * 32, rows)
    reader = MonolithicReader(cache)
    got = reader.rows("a" * 32)
    assert ids == [0, 1] and torch.equal(got, rows)
    assert got.data_ptr() == cache.buffer[0].data_ptr()  # consecutive blocks: a view, no copy


def test_rows_of_non_consecutive_blocks_are_gathered_in_order():
    cache = make_cache(num_blocks=5, block_size=4, fat_dim=6)
    for h in "wxyz":
        write(cache, h * 32, torch.zeros(4, 6, dtype=torch.bfloat16))
    cache.free("x" * 32)
    cache.free("z" * 32)
    rows = torch.arange(36, dtype=torch.bfloat16).view(6, 6)
    assert write(cache, "b" * 32, rows) == [1, 3]
    assert torch.equal(MonolithicReader(cache).rows("b" * 32), rows)


def test_placement_uses_the_items_own_blocks_and_ignores_the_tags():
    cache = make_cache()
    ids = write(cache, "a" * 32, rows_for("a" * 32, 20))
    cache.mm_hash_tags.zero_()  # tags belong to EPD readers; monolithic mode never reads them
    p = MonolithicReader(cache).placement("a" * 32, 20, offset=7)
    assert (p.block_ids, p.tokens_per_block, p.num_tokens, p.offset) == (tuple(ids), (16, 4), 20, 7)


def test_missing_unwritten_and_freed_slots_raise():
    cache = make_cache()
    reader = MonolithicReader(cache)
    with pytest.raises(EncoderCacheReadError, match="no slot"):
        reader.placement("a" * 32, 4, 0)
    with pytest.raises(EncoderCacheReadError, match="no slot"):
        reader.rows("a" * 32)
    cache.allocate("b" * 32, [4])
    with pytest.raises(EncoderCacheReadError, match="not written"):
        reader.placement("b" * 32, 4, 0)
    write(cache, "c" * 32, rows_for("c" * 32, 4))
    cache.free("c" * 32)
    with pytest.raises(EncoderCacheReadError, match="no slot"):
        reader.place([ScheduledItem("c" * 32, 0, 4)], (0, 8))


def test_token_count_disagreement_raises_encoder_cache_read_error_not_ec_load_failure():
    cache = make_cache()
    write(cache, "a" * 32, rows_for("a" * 32, 20))
    with pytest.raises(EncoderCacheReadError, match="expected 21, got 20") as info:
        MonolithicReader(cache).placement("a" * 32, 21, 0)
    assert not isinstance(info.value, ECLoadFailure)


@pytest.mark.parametrize("window", [(0, 64), (10, 40), (24, 30)])
def test_monolithic_merge_equals_the_epd_staging_merge(window):
    cache = make_cache()
    items = {"a" * 32: (3, 20), "b" * 32: (25, 9)}  # mm_hash -> (offset, tokens)
    pulled = {}
    for h, (_, n) in items.items():
        rows = rows_for(h, n)
        write(cache, h, rows)
        pulled[h] = PulledItem(h, rows, (1, 2, 2), "fake", "miss")
    scheduled = [ScheduledItem(h, off, n, pulled[h]) for h, (off, n) in items.items()]
    num_tokens = 64
    hidden = torch.randn(num_tokens, FAT_DIM // 3, generator=torch.Generator().manual_seed(0))
    outs = []
    for store in (MonolithicReader(cache), StagingRows(FAT_DIM, num_blocks=12, block_size=8)):
        buffer, placements = store.place(scheduled, window)
        pmap = build_encoder_positions(placements, num_tokens=num_tokens, max_blocks=12,
                                       block_size=store.block_size, window=window)
        outs.append(merge_deepstack_embeddings(hidden, buffer, pmap.encoder_positions, num_levels=2,
                                               block_ids=pmap.block_ids))
    (mono_main, mono_levels), (epd_main, epd_levels) = outs
    assert torch.equal(mono_main, epd_main)
    assert all(torch.equal(a, b) for a, b in zip(mono_levels, epd_levels))
    # And the rows landed where the window says: item a's token k at row 3 + k - window start.
    lo = max(window[0], 3)
    if lo < min(window[1], 23):
        expected = rows_for("a" * 32, 20)[lo - 3, : FAT_DIM // 3].float()
        assert torch.equal(mono_main[lo - window[0]], expected)


# --- the worker in monolithic mode -------------------------------------------------------------


def make_mono_worker(token_skew: int = 0):
    cache = make_cache(num_blocks=32)
    encoder = FakeLocalEncoder(cache, token_skew)
    source = MonolithicSource(cache, encoder, PARAMS, FINGERPRINT)
    worker = PrefillWorker(source, make_lm(), model_id=MODEL_ID, metrics=PrefillMetrics(),
                           limits=LIMITS, rows=source.reader)
    return worker, encoder, cache


def test_worker_in_monolithic_mode_matches_the_epd_worker():
    mono, encoder, _ = make_mono_worker()
    epd = PrefillWorker(FakeSource(), make_lm(), model_id=MODEL_ID, metrics=PrefillMetrics(), limits=LIMITS)
    assert mono.mode is CacheMode.MONOLITHIC and epd.mode is CacheMode.EPD
    for request in (TURN1, TURN2, TURN3, TURN3, FRESH):
        a, b = mono.prefill(request), epd.prefill(request)
        assert [i.layer for i in a.items] == [i.layer for i in b.items]
        assert a.first_token == b.first_token and a.prefix_hit_tokens == b.prefix_hit_tokens
        torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=1e-5)
    assert encoder.runs == 1
    sample = mono.metrics.registry.get_sample_value
    assert sample("vllm_neuron:scheduler_encoder_cache_queries_total") == 3.0
    assert sample("vllm_neuron:scheduler_encoder_cache_hits_total") == 2.0


def test_evicted_item_outside_the_prefix_is_encoded_again():
    worker, encoder, cache = make_mono_worker()
    first = worker.prefill(TURN1)
    cache.free(first.items[0].mm_hash)
    res = worker.prefill(TURN3)  # the new occurrence is outside the prefix hit
    assert [i.layer for i in res.items] == ["prefix", "encoder-miss"]
    assert encoder.runs == 2


def test_worker_token_count_disagreement_is_encoder_cache_read_error():
    worker, _, _ = make_mono_worker(token_skew=1)
    with pytest.raises(EncoderCacheReadError, match="expected 64, got 65"):
        worker.prefill(TURN1)
    assert worker.metrics.registry.get_sample_value(
        "epd_ec_load_failures_total", {"reason": "token_count"}) is None
