"""A prefill worker that takes leases and never releases them, to be killed by a test (its own process).

Run as ``python -m tests.reliability.lease_holder --transport KIND --images N``.
It waits for ``go HOST:PORT`` on stdin, encodes ``N`` distinct images there
through the client library (handshake, then ``Encode``: each item comes back
leased), prints ``EPD HELD <lease ids>`` and then sleeps -- never pulling, so
never releasing -- until stdin closes or two minutes pass.
"""

from __future__ import annotations

import argparse
import select
import sys
import time

from common.config import TlsConfig
from common.errors import CacheFullError
from common.metrics import PrefillMetrics
from common.transport import ConsumerTransport
from epd_harness.media import image_bytes
from prefill_client.consumer.connection import EncoderConnection, MediaSpec

MODEL = "tiny-qwen3-vl"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--transport", required=True)
    parser.add_argument("--images", type=int, default=4)
    parser.add_argument("--seed", type=int, default=9000)
    args = parser.parse_args()
    transport = ConsumerTransport(args.transport, num_landing_blocks=4, name_prefix="lease-holder")
    line = sys.stdin.readline().split()
    if len(line) != 2 or line[0] != "go":
        raise SystemExit(f"expected 'go HOST:PORT', got {line!r}")
    conn = EncoderConnection(line[1], MODEL, "lease-holder", transport, PrefillMetrics(),
                             rpc_timeout_s=10.0, tls=TlsConfig())
    leases: list[int] = []
    give_up = time.monotonic() + 30.0
    for i in range(args.images):
        item = MediaSpec.image(image_bytes(64, 64, seed=args.seed + i))
        while True:
            try:
                leases += [loc.lease_id for loc in conn.encode([item])]
                break
            except CacheFullError as exc:  # evicted blocks still inside their hold
                if time.monotonic() > give_up:
                    raise
                time.sleep(exc.retry_after_ms / 1000)
    sys.stdout.write("EPD HELD " + ",".join(str(lease) for lease in leases) + "\n")
    sys.stdout.flush()
    # Hold them: wait for stdin to close (the test's end), at most two minutes.
    deadline = time.monotonic() + 120.0
    while (remaining := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([sys.stdin], [], [], remaining)
        if ready and not sys.stdin.readline():
            break


if __name__ == "__main__":
    main()
