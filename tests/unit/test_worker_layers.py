"""The reference worker's layer path and metric deltas, with a fake embedding source.

The five situations are the reference's "when each metric fires" table:
cold turn, text follow-up, same image at a new position, identical replay,
same image with different text.
"""

from __future__ import annotations

import pytest
import torch

from common.config import CacheMode
from common.errors import ECLoadFailure, HandshakeError, LimitExceededError, LoadFailureReason
from common.media import PreprocessParams
from common.metrics import PrefillMetrics
from prefill_client.reference.chat import ChatRequest, MediaItem
from prefill_client.reference.positions import ItemPlacement
from prefill_client.reference.rows import StagingRows
from prefill_client.reference.worker import PrefillWorker, WorkerLimits
from tests.support.prefill_fakes import (
    BLOCK, FRESH, HIDDEN, IMG, LEVELS, LIMITS, MODEL_ID, TURN1, TURN2, TURN3, FakeSource, make_lm, png,
)

COUNTERS = {
    "mm_q": "vllm:mm_cache_queries_total",
    "mm_h": "vllm:mm_cache_hits_total",
    "prefix_q": "vllm:prefix_cache_queries_total",
    "prefix_h": "vllm:prefix_cache_hits_total",
    "sched_q": "vllm_neuron:scheduler_encoder_cache_queries_total",
    "sched_h": "vllm_neuron:scheduler_encoder_cache_hits_total",
}

def make_worker(source=None, **kw):
    source = source if source is not None else FakeSource()
    kw.setdefault("limits", LIMITS)
    return PrefillWorker(source, make_lm(), model_id=MODEL_ID, metrics=PrefillMetrics(), **kw), source


def values(worker):
    reg = worker.metrics.registry
    return {k: reg.get_sample_value(name) or 0.0 for k, name in COUNTERS.items()}


def run(worker, request):
    before = values(worker)
    result = worker.prefill(request)
    after = values(worker)
    return result, {k: after[k] - before[k] for k in after}


def test_five_situations_follow_the_reference_table():
    worker, source = make_worker()

    # Turn 1 (cold): layer 1 misses, no prefix hit, 2a misses, the encoder runs once.
    res, d = run(worker, TURN1)
    reusable1 = (res.prompt_tokens - 1) // BLOCK
    assert d == {"mm_q": 1, "mm_h": 0, "prefix_q": reusable1, "prefix_h": 0, "sched_q": 1, "sched_h": 0}
    assert [i.layer for i in res.items] == ["encoder-miss"]
    assert res.items[0].num_tokens == 64 and res.prefix_hit_tokens == 0
    assert source.encoder_runs == 1
    h = res.items[0].mm_hash
    assert source.cached_calls == [h] and source.lookup_calls == [[h]] and source.encode_calls == [[h]]
    stored1 = res.prompt_tokens // BLOCK

    # Turn 2 (text follow-up): the image is inside the prefix hit: no 2a query, no source call at all.
    source.cached_calls.clear()
    res, d = run(worker, TURN2)
    assert d == {"mm_q": 1, "mm_h": 1, "prefix_q": (res.prompt_tokens - 1) // BLOCK, "prefix_h": stored1,
                 "sched_q": 0, "sched_h": 0}
    assert [i.layer for i in res.items] == ["prefix"]
    assert res.prefix_hit_tokens == stored1 * BLOCK
    assert source.cached_calls == [] and len(source.lookup_calls) == 1 and len(source.encode_calls) == 1
    stored2 = res.prompt_tokens // BLOCK

    # Turn 3 (same image, new position): both items are layer-1 hits; the new
    # occurrence is outside the prefix hit, so 2a is queried and hits.
    res, d = run(worker, TURN3)
    assert d == {"mm_q": 2, "mm_h": 2, "prefix_q": (res.prompt_tokens - 1) // BLOCK, "prefix_h": stored2,
                 "sched_q": 1, "sched_h": 1}
    assert [i.layer for i in res.items] == ["prefix", "local"]
    assert res.items[0].mm_hash == res.items[1].mm_hash and res.items[1].offset > res.prefix_hit_tokens
    turn3_logits = res.logits

    # Replay (identical request): every block but the one holding the last token hits.
    res, d = run(worker, TURN3)
    reusable = (res.prompt_tokens - 1) // BLOCK
    assert d == {"mm_q": 2, "mm_h": 2, "prefix_q": reusable, "prefix_h": reusable, "sched_q": 0, "sched_h": 0}
    assert [i.layer for i in res.items] == ["prefix", "prefix"]
    torch.testing.assert_close(res.logits, turn3_logits, rtol=0, atol=1e-4)

    # Fresh (same image, different text): a partial hit on the image's leading blocks.
    res, d = run(worker, FRESH)
    reusable = (res.prompt_tokens - 1) // BLOCK
    image_blocks = (3 + 64) // BLOCK  # BOS, USER, VISION_START, then 64 placeholders
    assert d == {"mm_q": 1, "mm_h": 1, "prefix_q": reusable, "prefix_h": image_blocks, "sched_q": 1, "sched_h": 1}
    assert 0 < image_blocks < reusable
    assert [i.layer for i in res.items] == ["local"]

    # Layer 3 never ran again after the cold turn.
    assert source.encoder_runs == 1


@pytest.mark.parametrize("request_", [TURN3, FRESH], ids=["turn3", "fresh-partial-image"])
def test_warm_step_gives_the_logits_of_a_cold_prefill(request_):
    warm, _ = make_worker()
    for r in (TURN1, TURN2, TURN3, FRESH):
        if r is request_:
            break
        warm.prefill(r)
    warm_res = warm.prefill(request_)
    assert warm_res.prefix_hit_tokens > 0
    cold, _ = make_worker()
    cold_res = cold.prefill(request_)
    assert cold_res.prefix_hit_tokens == 0
    assert warm_res.first_token == cold_res.first_token
    torch.testing.assert_close(warm_res.logits, cold_res.logits, rtol=0, atol=1e-4)


def test_image_rows_change_the_output():
    worker, source = make_worker()
    base = worker.prefill(TURN1)
    other = ChatRequest.user(MediaItem.image(png(256, 256, seed=2)), "Describe this picture in detail please.")
    res = worker.prefill(other)
    assert res.prompt_tokens == base.prompt_tokens and res.prefix_hit_tokens == 0  # same ids, other image
    assert not torch.allclose(res.logits, base.logits)


def test_same_item_twice_in_a_cold_request_is_encoded_once():
    worker, source = make_worker()
    res, d = run(worker, ChatRequest.user(IMG, "first", IMG, "second"))
    assert [i.layer for i in res.items] == ["encoder-miss", "local"]
    assert d["sched_q"] == 2 and d["sched_h"] == 1 and d["mm_q"] == 2 and d["mm_h"] == 1
    assert source.encode_calls == [[res.items[0].mm_hash]] and source.encoder_runs == 1


def test_item_known_to_the_encoder_only_is_a_lookup_hit():
    source = FakeSource()
    first, _ = make_worker(source)
    first.prefill(TURN1)
    source.local.clear()  # another worker: the encoder has it, this worker does not
    second, _ = make_worker(source)
    res, d = run(second, TURN1)
    assert [i.layer for i in res.items] == ["encoder-hit"]
    assert d["sched_q"] == 1 and d["sched_h"] == 1
    assert len(source.encode_calls) == 1 and source.encoder_runs == 1


def test_video_and_image_in_one_request():
    frames = [png(64, 64, seed=10 + i) for i in range(4)]  # grid (2, 4, 4) -> 8 placeholders
    request = ChatRequest.user(MediaItem.video(frames, fps=2.0), "then", MediaItem.image(png(64, 64, seed=3)), "?")
    worker, source = make_worker()
    res = worker.prefill(request)
    assert [(i.kind, i.num_tokens, i.layer) for i in res.items] == [
        ("video", 8, "encoder-miss"), ("image", 4, "encoder-miss")]
    again = worker.prefill(request)
    # 25 prompt tokens: block 0 (the video at 3..10) hits, the image at 17..20 is outside it.
    assert again.prompt_tokens == 25 and again.prefix_hit_tokens == BLOCK
    assert [i.layer for i in again.items] == ["prefix", "local"]
    assert again.first_token == res.first_token


def test_token_count_disagreement_is_an_ec_load_failure():
    worker, _ = make_worker(FakeSource(token_skew=1))
    with pytest.raises(ECLoadFailure) as info:
        worker.prefill(TURN1)
    assert info.value.reason is LoadFailureReason.TOKEN_COUNT
    assert info.value.expected == 64 and info.value.got == 65
    reg = worker.metrics.registry
    assert reg.get_sample_value("epd_ec_load_failures_total", {"reason": "token_count"}) == 1.0
    assert len(worker.prefix_cache) == 0  # nothing computed, nothing stored


class ShiftedRows(StagingRows):
    """A row store with an off-by-one placement: the post-gather check must catch it."""

    def place(self, items, window):
        buffer, placements = super().place(items, window)
        return buffer, [ItemPlacement(p.mm_hash, p.block_ids, p.tokens_per_block, p.num_tokens, p.offset + 1)
                        for p in placements]


def test_post_gather_check_catches_a_misplaced_item():
    fat = HIDDEN * (1 + LEVELS)
    rows = ShiftedRows(fat, num_blocks=64, block_size=32)
    worker, _ = make_worker(rows=rows)
    assert worker.mode is CacheMode.EPD
    with pytest.raises(ECLoadFailure, match="token_count"):
        worker.prefill(TURN1)


def test_an_encoder_hashing_differently_is_refused():
    worker, _ = make_worker(FakeSource(model_id="another-model"))
    with pytest.raises(HandshakeError, match="model id or preprocessing"):
        worker.prefill(TURN1)


def test_limits_are_enforced_before_any_encoder_call():
    source = FakeSource()
    worker, _ = make_worker(source, limits=WorkerLimits(max_model_len=64, max_items=1, prefix_block_size=BLOCK))
    with pytest.raises(LimitExceededError, match="max_model_len 64"):
        worker.prefill(TURN1)
    with pytest.raises(LimitExceededError, match="2 media items"):
        worker.prefill(ChatRequest.user(IMG, IMG))
    assert source.encode_calls == []


def test_graph_sees_bucketed_shapes_only():
    worker, _ = make_worker()
    for r in (TURN1, TURN2, TURN3, TURN3, FRESH):
        worker.prefill(r)
    for t_pad, p_pad, _ in worker.graph.shapes_seen:
        assert t_pad >= 64 and t_pad & (t_pad - 1) == 0
        assert p_pad >= 64 and p_pad & (p_pad - 1) == 0


class UnannouncedParams(FakeSource):
    def media_params(self):
        return PreprocessParams(0, 0, 0, 0, 0), ""


def test_unusable_preprocessing_parameters_are_refused():
    worker, source = make_worker(UnannouncedParams())
    with pytest.raises(HandshakeError, match="unusable preprocessing parameters"):
        worker.prefill(TURN1)
    assert source.encode_calls == []
