"""A Lookup's answer, as the servicer builds it: every field from the allocation its lease pinned.

The servicer encodes the fields an allocation fixes once and reuses them in every answer
about it; these tests hold that reuse to the answer built from scratch, across an item
evicted and admitted again under the same mm_hash (new blocks, new generation).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import torch

from common.layout import CacheLayout
from common.metrics import EncoderMetrics
from common.placeholder import to_proto as placeholder_to_proto
from common.wire import pb2
from encoder_server.cache_blocks import EncoderCacheBlocks
from encoder_server.engine import EncoderEngine, Located
from encoder_server.preprocess import PreprocessConfig, Preprocessor
from encoder_server.service import EncoderCacheServicer
from tests.unit.test_engine_leases import BLOCK, GatedRunner, X, Y

TTL_MS = 30_000


class Context:
    """What the Lookup handler reads of a gRPC call: a deadline far away, done-callbacks kept."""

    def __init__(self) -> None:
        self.callbacks: list[Any] = []

    def time_remaining(self) -> float:
        return 10.0

    def add_done_callback(self, callback: Any) -> None:
        self.callbacks.append(callback)


def make_servicer(num_blocks: int = 4) -> EncoderCacheServicer:
    layout = CacheLayout(num_blocks=num_blocks, block_size=BLOCK, out_hidden_size=4, num_deepstack_levels=0,
                         dtype=torch.float32)
    cache = EncoderCacheBlocks(layout, 0, lease_ttl_ms=TTL_MS)
    metrics = EncoderMetrics()
    engine = EncoderEngine(cache=cache, preprocessor=Preprocessor(PreprocessConfig()), runner=GatedRunner(),
                           metrics=metrics, model_id="m", preprocess_fingerprint="p")
    return EncoderCacheServicer(
        engine=engine, metrics=metrics, model_id="m", layout=layout, incarnation_id="inc",
        handshake_extra=pb2.HandshakeResponse, min_hold_ms=0, lease_ttl_ms=TTL_MS, max_items=8,
        max_video_frames=8)


async def lookup(servicer: EncoderCacheServicer, mm_hash: str) -> pb2.ItemLocation:
    response = await servicer.Lookup(
        pb2.LookupRequest(model_id="m", consumer_id="c", mm_hashes=[mm_hash], incarnation_id="inc"), Context())
    assert response.incarnation_id == "inc" and len(response.results) == 1
    assert response.results[0].WhichOneof("outcome") == "location"
    return response.results[0].location


def from_scratch(located: Located, lease_id: int) -> pb2.ItemLocation:
    return pb2.ItemLocation(
        mm_hash=located.mm_hash, block_ids=located.block_ids, tokens_per_block=located.tokens_per_block,
        num_tokens=located.num_tokens, fingerprint=located.fingerprint, generation=located.generation,
        lease_id=lease_id, result=pb2.CACHE_RESULT_HIT, grid_thw=located.meta.grid_thw,
        placeholder=placeholder_to_proto(located.meta.placeholder), modality=located.meta.modality)


async def encode(servicer: EncoderCacheServicer, item: Any) -> Located:
    (located,) = await servicer.engine.encode([item], "c")
    assert isinstance(located, Located)
    assert servicer.engine.release([located.lease.lease_id], "c") == 1
    return located


def test_every_answer_carries_its_own_lease_and_the_allocation_it_pinned() -> None:
    async def scenario() -> None:
        servicer = make_servicer()
        await servicer.engine.start()
        try:
            x = await encode(servicer, X)
            assert x.meta.placeholder, "the tower's metadata travels in the answer"
            first, second = await lookup(servicer, x.mm_hash), await lookup(servicer, x.mm_hash)
            assert first.lease_id != second.lease_id
            for answer in (first, second):
                now_ms = time.time() * 1000
                assert now_ms < answer.lease_expiry_unix_ms <= now_ms + TTL_MS
                answer.ClearField("lease_expiry_unix_ms")
                assert answer == from_scratch(x, answer.lease_id)
        finally:
            await servicer.engine.stop()

    asyncio.run(scenario())


def test_an_item_admitted_again_is_answered_with_its_new_allocation() -> None:
    async def scenario() -> None:
        servicer = make_servicer(num_blocks=2)  # one usable block: Y evicts X, then X evicts Y
        await servicer.engine.start()
        try:
            x = await encode(servicer, X)
            before = await lookup(servicer, x.mm_hash)
            assert servicer.engine.release([before.lease_id], "c") == 1
            await encode(servicer, Y)
            x_again = await encode(servicer, X)
            assert x_again.mm_hash == x.mm_hash and x_again.generation > x.generation
            after = await lookup(servicer, x.mm_hash)
            assert after.generation == x_again.generation and tuple(after.block_ids) == x_again.block_ids
            after.ClearField("lease_expiry_unix_ms")
            assert after == from_scratch(x_again, after.lease_id)
        finally:
            await servicer.engine.stop()

    asyncio.run(scenario())
