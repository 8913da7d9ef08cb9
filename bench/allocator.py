"""Throughput and per-call cost of the encoder's block allocator (encoder process code, run by hand).

Usage: ``python bench/allocator.py [--seconds 2] [--blocks 4096]
[--block-size 64] [--item-blocks 1,4] [--ops 20000] [--repeats 5]``.
Prints one line per measurement, then one JSON object on the last line.

**Pairs per second** (``--seconds`` split evenly over four cases, each timed
in rounds of ``--round-pairs`` pairs; the headline number of a case is its
best round, as ``timeit`` reports, because other processes on a shared
machine only ever slow a round down; the median is reported beside it):

- ``single_block`` / ``eight_block``: ``allocate(h, [block_size] * k)`` then
  ``free(h)``, min_hold 0 on the real clock (``time.monotonic``), mm_hashes
  cycling through a pool of recurring items, as when evicted items come back
  (the tag fingerprint then comes from its memo);
- ``single_block_fresh_hash``: every pair a never-seen mm_hash, so the
  fingerprint is computed each time;
- ``single_block_hold_cycle``: allocate + mark_written + free with min_hold
  100 ms on an injected clock advanced 0.5 ms per call, so every freed block
  goes through the hold heap before it is reused (three calls per pair).

**Per-call cost** (median over ``--repeats`` rounds of ``--ops`` operations,
min_hold 0, real clock, for each ``--item-blocks`` size):

- ``admit_us``: ``allocate`` (stamps tag + generation) + ``mark_written``
  + ``free`` of one item, the whole life of a miss; fresh hashes every time,
  so the fingerprint memo never helps;
- ``lease_us``: ``acquire`` + ``release`` of a lease on a cached item (what a
  Lookup hit and its release cost the allocator);
- ``evict_us``: on a full cache, ``evict_lru_counted`` of one item plus the
  ``allocate`` + ``mark_written`` of the item that takes its blocks;
- ``occupancy_us``: one ``occupancy()`` snapshot (taken once per step for the
  gauges).

JSON keys: ``single_block_pairs_per_s``, ``eight_block_pairs_per_s``,
``single_block_fresh_hash_pairs_per_s``, ``single_block_hold_cycle_pairs_per_s``
(each also with ``_median``), the run's settings, and ``results``: one
``{"item_blocks", "admit_us", "lease_us", "evict_us", "occupancy_us"}`` per
item size.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.layout import CacheLayout  # noqa: E402
from encoder_server.cache_blocks import EncoderCacheBlocks  # noqa: E402

POOL = 4096  # recurring mm_hashes, fewer than the fingerprint memo holds


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0,
                        help="measuring time of the pairs-per-second cases, all together")
    parser.add_argument("--round-pairs", type=int, default=5000, help="pairs per timed round")
    parser.add_argument("--blocks", type=int, default=4096, help="cache blocks, scratch included")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--item-blocks", default="1,4",
                        help="comma-separated blocks per item (per-call costs)")
    parser.add_argument("--ops", type=int, default=20000,
                        help="operations per timed round (per-call costs)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed rounds, median reported (per-call costs)")
    args = parser.parse_args(argv)
    if args.seconds <= 0 or args.round_pairs <= 0 or args.ops <= 0 or args.repeats <= 0:
        parser.error("--seconds, --round-pairs, --ops and --repeats must be > 0")
    if args.blocks < 9:
        parser.error("--blocks must be >= 9 (eight-block items plus scratch)")
    return args


def _layout(blocks: int, block_size: int) -> CacheLayout:
    # A narrow row keeps the buffer small: the allocator never touches its contents.
    return CacheLayout(num_blocks=blocks, block_size=block_size, out_hidden_size=8)


# ------------------------------------------------------------ pairs per second
def _rounds(run_round: Callable[[list[str]], None], names: Callable[[int], list[str]],
            round_pairs: int, seconds: float) -> list[float]:
    """Pairs per second of each round, as many rounds as fit in ``seconds`` (at least 3).

    ``names(first)`` builds a round's mm_hashes before its timer starts.
    """
    rates: list[float] = []
    deadline = time.perf_counter() + seconds
    first = 0
    while len(rates) < 3 or time.perf_counter() < deadline:
        hashes = names(first)
        t0 = time.perf_counter()
        run_round(hashes)
        rates.append(round_pairs / (time.perf_counter() - t0))
        first += round_pairs
        if len(rates) >= 10_000:
            break
    return rates


def _pool_names(n: int) -> Callable[[int], list[str]]:
    pool = [f"sha256:{i:064x}" for i in range(POOL)]
    return lambda first: [pool[(first + i) % POOL] for i in range(n)]


def _fresh_names(n: int) -> Callable[[int], list[str]]:
    return lambda first: [f"fresh:{first + i:064x}" for i in range(n)]


def bench_pairs(blocks_per_item: int, *, fresh: bool, args: argparse.Namespace) -> list[float]:
    cache = EncoderCacheBlocks(_layout(args.blocks, args.block_size), 0)
    tpb = [args.block_size] * blocks_per_item
    allocate, free = cache.allocate, cache.free

    def run_round(hashes: list[str]) -> None:
        for h in hashes:
            if allocate(h, tpb) is None:
                raise SystemExit("allocate refused with min_hold 0: the benchmark is broken")
            free(h)

    names = _fresh_names(args.round_pairs) if fresh else _pool_names(args.round_pairs)
    rates = _rounds(run_round, names, args.round_pairs, args.seconds / 4)
    occ = cache.occupancy()
    if occ.active_blocks != 0 or occ.free_blocks != args.blocks - 1:
        raise SystemExit(f"blocks leaked: {occ}")
    return rates


def bench_hold_cycle(args: argparse.Namespace) -> list[float]:
    now = [0.0]

    def clock() -> float:
        now[0] += 0.0005
        return now[0]

    cache = EncoderCacheBlocks(_layout(args.blocks, args.block_size), 100, clock=clock)
    tpb = [args.block_size]
    allocate, mark_written, free = cache.allocate, cache.mark_written, cache.free

    def run_round(hashes: list[str]) -> None:
        for h in hashes:
            if allocate(h, tpb) is None:
                raise SystemExit("cache too small for the hold window: raise --blocks")
            mark_written(h)
            free(h)

    rates = _rounds(run_round, _pool_names(args.round_pairs), args.round_pairs, args.seconds / 4)
    if cache.num_held_blocks == 0:
        raise SystemExit("no block went through the hold heap")
    return rates


# -------------------------------------------------------------- per-call cost
class Hashes:
    """Distinct 32-hex-digit mm_hashes, never repeated in a run."""

    def __init__(self) -> None:
        self._n = 0

    def take(self, n: int) -> list[str]:
        out = [f"{self._n + i:032x}" for i in range(n)]
        self._n += n
        return out


def median_us(run: Callable[[], int], repeats: int) -> float:
    """Median over rounds of (round time / operations in it), in microseconds."""
    per_op = []
    for _ in range(repeats):
        started = time.perf_counter()
        ops = run()
        per_op.append((time.perf_counter() - started) / ops * 1e6)
    return round(statistics.median(per_op), 3)


def bench_ops(blocks: int, block_size: int, item_blocks: int, ops: int, repeats: int) -> dict[str, float]:
    layout = _layout(blocks, block_size)
    cache = EncoderCacheBlocks(layout, 0, lease_ttl_ms=600_000)
    tpb = [block_size] * item_blocks
    hashes = Hashes()

    def admit() -> int:
        for h in hashes.take(ops):
            if cache.allocate(h, tpb) is None:
                raise SystemExit("cache full during the admit round")
            cache.mark_written(h)
            cache.free(h)
        return ops

    cached = hashes.take(min(64, layout.num_usable_blocks // item_blocks))
    for h in cached:
        cache.allocate(h, tpb)
        cache.mark_written(h)

    def lease() -> int:
        for i in range(ops):
            got = cache.acquire(cached[i % len(cached)], owner="bench")
            assert got is not None
            cache.release(got.lease_id, owner="bench")
        return ops

    def evict() -> int:
        # Fill every block first (untimed would be nicer, but filling is the admit path measured above).
        while cache.can_admit([item_blocks]) and cache.num_free_blocks >= item_blocks:
            h = hashes.take(1)[0]
            cache.allocate(h, tpb)
            cache.mark_written(h)
        for h in hashes.take(ops):
            _, evicted = cache.evict_lru_counted(item_blocks)
            if evicted < item_blocks or cache.allocate(h, tpb) is None:
                raise SystemExit("eviction did not make room")
            cache.mark_written(h)
        return ops

    def occupancy() -> int:
        for _ in range(ops):
            cache.occupancy()
        return ops

    row: dict[str, float] = {"item_blocks": item_blocks}
    for name, fn in (("admit_us", admit), ("lease_us", lease), ("occupancy_us", occupancy)):
        fn()  # warm-up round
        row[name] = median_us(fn, repeats)
    evict()  # fills the cache, then warms up
    row["evict_us"] = median_us(evict, repeats)
    occ = cache.occupancy()
    if occ.active_blocks + occ.free_blocks + occ.held_blocks != layout.num_usable_blocks:
        raise SystemExit(f"occupancy invariant broken: {occ}")
    return row


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result: dict[str, object] = {}
    cases: dict[str, Callable[[], list[float]]] = {
        "single_block": lambda: bench_pairs(1, fresh=False, args=args),
        "eight_block": lambda: bench_pairs(8, fresh=False, args=args),
        "single_block_fresh_hash": lambda: bench_pairs(1, fresh=True, args=args),
        "single_block_hold_cycle": lambda: bench_hold_cycle(args),
    }
    for name, run in cases.items():
        rates = run()
        best, median = max(rates), statistics.median(rates)
        print(f"{name:<24} best {best:>10,.0f} pairs/s, median {median:>10,.0f} ({len(rates)} rounds)",
              flush=True)
        result[f"{name}_pairs_per_s"] = round(best)
        result[f"{name}_pairs_per_s_median"] = round(median)

    results = []
    for n in (int(x) for x in args.item_blocks.split(",")):
        row = bench_ops(args.blocks, args.block_size, n, args.ops, args.repeats)
        print(f"item of {n} block(s): admit {row['admit_us']:.2f} us, lease {row['lease_us']:.2f} us, "
              f"evict+admit {row['evict_us']:.2f} us, occupancy {row['occupancy_us']:.2f} us", flush=True)
        results.append(row)

    result.update(
        pairs_min_hold_ms=0,
        pairs_clock="time.monotonic (hold_cycle: injected, +0.5 ms per call, min_hold 100 ms)",
        blocks=args.blocks,
        block_size=args.block_size,
        round_pairs=args.round_pairs,
        results=results,
        python=platform.python_version(),
        torch=torch.__version__,
        cpus=os.cpu_count(),
        load_avg_1m=round(os.getloadavg()[0], 2),
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
