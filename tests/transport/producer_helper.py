"""A minimal producer process for the transport tests: registers its two regions and obeys stdin.

Run as ``python -m tests.transport.producer_helper --kind mock|nixl ...``.
Prints ``EPD READY <hex HandshakeResponse>``, then answers one ``EPD`` line
per command: ``fill SEED``, ``stamp BLOCK TAG GEN``, ``drain N TIMEOUT_MS``.
Exits when stdin closes.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import torch

from common.transport import ProducerTransport, shm_allocator
from common.wire import PROTOCOL_VERSION, pb2
from tests.transport.harness import PREFIX, HelperLayout, reference_block

_REGION_ALIGN = 2 << 20


def _say(text: str) -> None:
    sys.stdout.write(PREFIX + text + "\n")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kind", required=True)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--num-blocks", type=int, default=33)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--fat-dim", type=int, default=128)
    parser.add_argument("--address", type=lambda s: int(s, 0), default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    layout = HelperLayout(args.num_blocks, args.block_size, args.fat_dim)

    transport = ProducerTransport(args.kind, name_prefix="test-producer")
    n = layout.num_blocks
    if args.address is not None:
        # Same addresses in every run: a restarted producer looks identical but for its agent.
        buf_bytes = -(-n * layout.bytes_per_block // _REGION_ALIGN) * _REGION_ALIGN
        buffer = shm_allocator((n, layout.block_size, layout.fat_dim), torch.bfloat16, address=args.address)
        stamps = shm_allocator((n, 2), torch.int64, address=args.address + buf_bytes)
    else:
        alloc = transport.allocator or (lambda shape, dtype: torch.zeros(shape, dtype=dtype))
        buffer = alloc((n, layout.block_size, layout.fat_dim), torch.bfloat16)
        stamps = alloc((n, 2), torch.int64)
    tags, gens = stamps[:, 0], stamps[:, 1]

    def fill(seed: int) -> None:
        for block in range(n):
            buffer[block].copy_(reference_block(seed, block, layout))
            tags[block] = seed * 1000 + block
            gens[block] = seed

    fill(args.seed)
    transport.register(buffer, stamps)
    hs = pb2.HandshakeResponse(protocol_version=PROTOCOL_VERSION, model_id="transport-test",
                               incarnation_id=transport.incarnation_id, layout=layout.to_proto())
    transport.fill_handshake(hs)
    _say("READY " + hs.SerializeToString().hex())

    received: list[bytes] = []
    for line in sys.stdin:
        words = line.split()
        try:
            if words[0] == "fill":
                fill(int(words[1]))
                _say("OK")
            elif words[0] == "stamp":
                block, tag, gen = (int(w) for w in words[1:4])
                tags[block], gens[block] = tag, gen
                _say("OK")
            elif words[0] == "drain":
                expect, deadline = int(words[1]), time.monotonic() + int(words[2]) / 1000
                while True:
                    received += transport.drain_notifications()
                    if len(received) >= expect or time.monotonic() >= deadline:
                        break
                    time.sleep(0.005)
                _say("NOTIFS " + ",".join(m.hex() for m in received))
                received = []
            else:
                _say(f"ERROR unknown command {words[0]!r}")
        except Exception as exc:  # report to the test instead of dying silently
            _say(f"ERROR {type(exc).__name__}: {exc}")
    transport.close()


if __name__ == "__main__":
    main()
