"""The engine's answer for an item is the allocation its lease pinned, or a typed per-item error.

Deterministic reproductions of the interleaving behind wrong embeddings: a
request pins a hit, then waits for its miss; meanwhile the hit's lease would
expire, the item is freed and re-allocated under the same ``mm_hash`` by
another request (new blocks, new generation, stamped but not yet written).
The encoder graph is a fake that writes a value per run and blocks on a gate,
so every step happens exactly when the test says. Cache time is a fake clock.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Sequence

import grpc
import pytest
import torch

from common.errors import ItemLostError
from common.layout import CacheLayout
from common.metrics import EncoderMetrics
from encoder_server.cache_blocks import EncoderCacheBlocks
from encoder_server.engine import EncoderEngine, Failed, Located, MediaInput
from encoder_server.preprocess import PreprocessConfig, Preprocessor, ProcessedItem
from epd_harness.media import image_bytes

BLOCK = 64  # a 64x64 image is 64 tokens (Qwen3-VL's minimum): one block
X = MediaInput("image", (image_bytes(64, 64, seed=1),))
Y = MediaInput("image", (image_bytes(64, 64, seed=2),))
Z = MediaInput("image", (image_bytes(64, 64, seed=3),))
W = MediaInput("image", (image_bytes(64, 64, seed=4),))


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class GatedRunner:
    """Writes ``run number`` into every row of each item; each run waits for the test to open it."""

    max_batch_tokens = 4 * BLOCK

    def __init__(self) -> None:
        self.runs = 0
        self.entered = threading.Semaphore(0)
        self.gates: list[threading.Event] = []
        self.auto = True  # runs pass without waiting until a test closes the gate

    def write(self, items: Sequence[ProcessedItem], block_ids: Sequence[Sequence[int]],
              tokens_per_block: Sequence[Sequence[int]], buffer: torch.Tensor, scratch_block_id: int) -> torch.Tensor:
        self.runs += 1
        value = float(self.runs)
        gate = threading.Event()
        self.gates.append(gate)
        self.entered.release()
        if not self.auto:
            assert gate.wait(30), "the test never opened this run"
        for blocks, counts in zip(block_ids, tokens_per_block):
            for b, n in zip(blocks, counts):
                buffer[b, :n] = value
        return buffer


def make_engine(*, num_blocks: int = 6, pending_ttl_ms: int = 600_000) -> tuple[EncoderEngine, FakeClock, GatedRunner]:
    clock = FakeClock()
    layout = CacheLayout(num_blocks=num_blocks, block_size=BLOCK, out_hidden_size=4, num_deepstack_levels=0,
                         dtype=torch.float32)
    # Hostile settings: no hold, leases of a millisecond.
    cache = EncoderCacheBlocks(layout, 0, lease_ttl_ms=1, pending_lease_ttl_ms=pending_ttl_ms, clock=clock)
    runner = GatedRunner()
    engine = EncoderEngine(cache=cache, preprocessor=Preprocessor(PreprocessConfig()), runner=runner,
                           metrics=EncoderMetrics(), model_id="m", preprocess_fingerprint="p")
    return engine, clock, runner


async def wait_entered(runner: GatedRunner) -> None:
    assert await asyncio.to_thread(runner.entered.acquire, True, 30), "encoder run never started"


def rows(engine: EncoderEngine, loc: Located) -> torch.Tensor:
    return torch.cat([engine.cache.buffer[b, :n] for b, n in zip(loc.block_ids, loc.tokens_per_block)])


Scenario = Callable[[EncoderEngine, FakeClock, GatedRunner, Located], Awaitable[None]]


def run_scenario(body: Scenario, **engine_options: int) -> None:
    """Start an engine, cache X (its first run, ungated) and give its lease back, then run ``body``
    with every later encoder run held at its gate; afterwards open every gate and stop."""

    async def scenario() -> None:
        engine, clock, runner = make_engine(**engine_options)
        await engine.start()
        try:
            first = (await engine.encode([X], "seed"))[0]
            assert isinstance(first, Located) and not first.hit
            await wait_entered(runner)
            assert engine.release([first.lease.lease_id], "seed") == 1
            runner.auto = False
            await body(engine, clock, runner, first)
        finally:
            for gate in runner.gates:
                gate.set()
            await engine.stop()

    asyncio.run(scenario())


async def until(predicate: Callable[[], bool]) -> None:
    for _ in range(400):
        if predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition never held")


def test_answer_is_the_pinned_allocation_after_expiry_eviction_and_reallocation() -> None:
    async def body(engine: EncoderEngine, clock: FakeClock, runner: GatedRunner, first: Located) -> None:
        x_hash = engine.mm_hash(X.content_hash())
        # Request A: X is a hit (pinned, pending), Y a miss whose run is held at the gate.
        a = asyncio.create_task(engine.encode([X, Y], "a"))
        await wait_entered(runner)
        # A thousand lease ttls pass while A waits: its pending lease on X must hold.
        clock.now += 1.0
        engine.housekeeping()
        assert engine.cache.num_pinned_items == 1 and engine.cache.lease_stats.expired == 0
        # Force the interleaving anyway: X leaves the slot map and B re-allocates it
        # (new blocks, new generation, stamped, not yet written: B's run waits at the gate).
        engine.cache.free(x_hash)
        b = asyncio.create_task(engine.encode([X], "b"))
        await until(lambda: engine.cache.contains(x_hash))
        new_ids = engine.cache.get_block_ids(x_hash)
        assert set(new_ids).isdisjoint(first.block_ids)
        runner.gates[-1].set()  # A's run (Y) finishes; B's run (X again) starts and waits
        x, y = await asyncio.wait_for(a, 30)
        await wait_entered(runner)

        assert isinstance(x, Located) and isinstance(y, Located)
        assert x.hit and not y.hit
        assert x.block_ids == first.block_ids and x.generation == first.generation
        assert torch.all(rows(engine, x) == 1.0), "A must get the rows written by the first run"
        assert torch.all(rows(engine, y) == 2.0)
        assert torch.all(engine.cache.mm_hash_tags[list(x.block_ids)] == x.fingerprint)

        runner.gates[-1].set()
        (x_again,) = await asyncio.wait_for(b, 30)
        assert isinstance(x_again, Located) and not x_again.hit
        assert x_again.generation > first.generation and list(x_again.block_ids) == new_ids
        assert torch.all(rows(engine, x_again) == 3.0)

    run_scenario(body)


def test_a_lease_that_ended_while_its_request_waited_is_a_typed_per_item_error() -> None:
    async def body(engine: EncoderEngine, clock: FakeClock, runner: GatedRunner, first: Located) -> None:
        a = asyncio.create_task(engine.encode([X, Y], "a"))
        await wait_entered(runner)
        clock.now += 0.05  # past even the pending ceiling: the backstop ends A's lease on X
        engine.housekeeping()
        assert engine.cache.num_pinned_items == 0
        # X is evicted and its block re-used for Z or W while A still waits.
        c = asyncio.create_task(engine.encode([Z, W], "c"))
        await until(lambda: not engine.cache.contains(engine.mm_hash(X.content_hash())))
        runner.gates[-1].set()
        x, y = await asyncio.wait_for(a, 30)
        assert isinstance(x, Failed) and isinstance(x.error, ItemLostError)
        assert x.error.grpc_code is grpc.StatusCode.ABORTED and x.mm_hash in str(x.error)
        assert isinstance(y, Located) and torch.all(rows(engine, y) == 2.0)
        await wait_entered(runner)
        runner.gates[-1].set()
        await asyncio.wait_for(c, 30)

    run_scenario(body, pending_ttl_ms=50, num_blocks=4)  # three usable: X, Y, and one free


def test_a_cancelled_request_leaves_no_lease() -> None:
    async def body(engine: EncoderEngine, clock: FakeClock, runner: GatedRunner, first: Located) -> None:
        a = asyncio.create_task(engine.encode([X, Y], "a"))
        await wait_entered(runner)
        assert engine.cache.lease_stats.active == 1  # the hit, pending
        a.cancel()
        with pytest.raises(asyncio.CancelledError):
            await a
        runner.gates[-1].set()  # the run completes; its only waiter is gone
        await until(lambda: engine.cache.is_written(engine.mm_hash(Y.content_hash())))
        assert engine.cache.lease_stats.active == 0 and engine.cache.num_pinned_items == 0

    run_scenario(body)


def test_a_miss_finished_by_another_request_while_it_decoded_is_a_hit_not_a_rewrite() -> None:
    # A misses Y and decodes it; meanwhile B misses Y too, runs it and is answered. A must
    # then lease B's allocation. Writing Y again into those live blocks would race readers,
    # and an eviction mid-run would hand the blocks to another item under the writer.
    async def body(engine: EncoderEngine, clock: FakeClock, runner: GatedRunner, first: Located) -> None:
        decode, entered, gate = engine._decode, threading.Event(), threading.Event()
        calls = 0

        def gated_decode(source: MediaInput, index: int) -> ProcessedItem:
            nonlocal calls
            calls += 1
            if calls == 1:  # A's decode waits; B's passes
                entered.set()
                assert gate.wait(30), "the test never let A's decode finish"
            return decode(source, index)

        engine._decode = gated_decode  # type: ignore[method-assign]
        a = asyncio.create_task(engine.encode([Y], "a"))
        assert await asyncio.to_thread(entered.wait, 30)
        b = asyncio.create_task(engine.encode([Y], "b"))
        await wait_entered(runner)
        runner.gates[-1].set()
        (y_b,) = await asyncio.wait_for(b, 30)
        assert isinstance(y_b, Located) and not y_b.hit
        runs = runner.runs
        runner.auto = True  # a second run of Y, the bug, must not wait at a gate
        gate.set()
        (y_a,) = await asyncio.wait_for(a, 30)

        assert runner.runs == runs, "Y was encoded again into the blocks B had been handed"
        assert isinstance(y_a, Located) and y_a.hit
        assert y_a.block_ids == y_b.block_ids and y_a.generation == y_b.generation
        assert y_a.lease.lease_id != y_b.lease.lease_id
        assert torch.all(rows(engine, y_a) == float(runs))
        assert engine.cache.lease_stats.active == 2  # A's and B's leases, each its own

    run_scenario(body)


def test_a_failure_after_a_run_fails_its_requests_and_the_encoder_serves_on() -> None:
    async def body(engine: EncoderEngine, clock: FakeClock, runner: GatedRunner, first: Located) -> None:
        runner.auto = True
        mark_written = engine.cache.mark_written
        y_hash = engine.mm_hash(Y.content_hash())

        def failing(mm_hash: str) -> None:
            if mm_hash == y_hash:
                raise ValueError(f"injected failure for {mm_hash}")
            mark_written(mm_hash)

        engine.cache.mark_written = failing  # type: ignore[method-assign]
        y, z = await asyncio.wait_for(engine.encode([Y, Z], "a"), 30)
        assert isinstance(y, Failed) and "injected failure" in str(y.error)
        assert not engine.cache.contains(y_hash), "Y's unwritten blocks must go back to free"
        # Z ran in the same batch; whether it was marked before Y's failure or not, its
        # request gets an answer, and a later request is served by the same batcher.
        assert isinstance(z, (Located, Failed))
        (w,) = await asyncio.wait_for(engine.encode([W], "b"), 30)
        assert isinstance(w, Located) and not w.hit
        occ = engine.cache.occupancy()
        assert occ.active_blocks == occ.items  # one block per present item: nothing leaked

    run_scenario(body)
