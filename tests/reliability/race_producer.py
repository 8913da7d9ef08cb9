"""The racing producer of the reuse-race tests: real cache blocks re-allocated in a tight loop (its own process).

Run as ``python -m tests.reliability.race_producer --kind mock|nixl --directory PATH``.
It registers an :class:`EncoderCacheBlocks` (min hold 0, no leases: the
situation of a consumer whose lease expired) with a :class:`ProducerTransport`,
prints ``EPD READY <hex HandshakeResponse>``, then loops until stdin closes or
``--max-seconds`` pass: pick an item; if present, sometimes re-allocate it
(free + allocate: same item, new generation, often the same block), else
allocate it, evicting LRU items when the cache is full; write its rows *after*
the allocation stamped tag and generation; publish the location. It ends
with ``EPD DONE <iterations> <same-item re-allocations> <evictions>``.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import threading
import time
from pathlib import Path

from common.transport import ProducerTransport
from common.wire import PROTOCOL_VERSION, pb2
from encoder_server.cache_blocks import EncoderCacheBlocks
from encoder_server.service import layout_to_proto
from tests.reliability.race import H_EVICTIONS, H_ITERATIONS, H_SAME_ITEM, Directory, RaceSpec

PREFIX = "EPD "


def _say(text: str) -> None:
    sys.stdout.write(PREFIX + text + "\n")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kind", required=True)
    parser.add_argument("--directory", required=True, type=Path)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--same-item-rate", type=float, default=0.5,
                        help="chance that a present item is re-allocated instead of touched")
    parser.add_argument("--pause-us", type=float, default=0.0, help="sleep between iterations")
    parser.add_argument("--max-seconds", type=float, default=120.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    spec = RaceSpec()
    layout = spec.layout
    transport = ProducerTransport(args.kind, name_prefix="race-producer")
    cache = EncoderCacheBlocks(layout, 0, lease_ttl_ms=1, allocator=transport.allocator)
    transport.register(cache.buffer, cache.stamps)
    hs = pb2.HandshakeResponse(protocol_version=PROTOCOL_VERSION, model_id="reuse-race",
                               incarnation_id=transport.incarnation_id, layout=layout_to_proto(layout))
    transport.fill_handshake(hs)
    directory = Directory(args.directory, spec)
    rows = [spec.rows(k) for k in range(spec.num_items)]
    hashes = [spec.mm_hash(k) for k in range(spec.num_items)]
    plans = [spec.tokens_per_block(k) for k in range(spec.num_items)]

    stop = threading.Event()

    def watch_stdin() -> None:
        for _ in sys.stdin:
            pass
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    _say("READY " + hs.SerializeToString().hex())

    rng = random.Random(args.seed)
    pause = args.pause_us / 1e6
    deadline = time.monotonic() + args.max_seconds
    buffer = cache.buffer
    while not stop.is_set() and time.monotonic() < deadline:
        k = rng.randrange(spec.num_items)
        h, plan = hashes[k], plans[k]
        if cache.contains(h):
            if rng.random() >= args.same_item_rate:
                cache.touch(h)
                directory.bump(H_ITERATIONS)
                continue
            cache.free(h)  # drop it and allocate it again: same item, new generation
            directory.bump(H_SAME_ITEM)
        blocks = cache.allocate(h, plan)
        if blocks is None:
            evicted = cache.evict_lru(len(plan))
            for _ in evicted:
                directory.bump(H_EVICTIONS)
            blocks = cache.allocate(h, plan)
            if blocks is None:
                raise RuntimeError(f"no room for item {k} after evicting {evicted}")
        # allocate() stamped tag and generation; the rows come only now, as in the encoder.
        offset = 0
        for block, n in zip(blocks, plan):
            buffer[block, :n].copy_(rows[k][offset:offset + n])
            offset += n
        cache.mark_written(h)
        directory.publish(k, cache.get_generation(h), blocks)
        directory.bump(H_ITERATIONS)
        if pause:
            time.sleep(pause)
    _say(f"DONE {directory.header(H_ITERATIONS)} {directory.header(H_SAME_ITEM)} "
         f"{directory.header(H_EVICTIONS)}")
    directory.close()
    transport.close()


if __name__ == "__main__":
    main()
