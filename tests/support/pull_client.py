"""A consumer in its own process: encode or look up items on an encoder, save what it pulled.

Run as ``python -m tests.support.pull_client --encoder HOST:PORT --transport nixl
--out FILE.pt [--image PATH ...] [--video P1,P2,... ...] [--lookup MM_HASH ...]``.
It pulls every item through :class:`EncoderCacheClient` (verified: blocks,
then tags and generations), saves ``{mm_hash: embeddings}`` with
``torch.save`` and prints one JSON object: the items (mm_hash, source,
num_tokens, in argument order: images, videos, lookups) and the client's
pull counters. ``UCX_*`` variables are read from the environment at import,
so a test sets them on the process (as the two-host test does).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch

from prefill_client.consumer.client import EncoderCacheClient, PulledItem
from prefill_client.consumer.connection import MediaSpec

MODEL_ID = "tiny-qwen3-vl"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pull_client")
    parser.add_argument("--encoder", required=True)
    parser.add_argument("--transport", default="nixl")
    parser.add_argument("--out", required=True)
    parser.add_argument("--image", action="append", default=[])
    parser.add_argument("--video", action="append", default=[], help="comma-separated frame paths")
    parser.add_argument("--lookup", action="append", default=[])
    parser.add_argument("--consumer-id", default=None)
    parser.add_argument("--pull-timeout-s", type=float, default=10.0)
    return parser


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    specs = [MediaSpec.image(Path(p).read_bytes(), uuid=Path(p).name) for p in args.image]
    specs += [MediaSpec.video([Path(p).read_bytes() for p in v.split(",")], uuid=f"video {i}")
              for i, v in enumerate(args.video)]
    pulled: list[PulledItem] = []
    with EncoderCacheClient(args.encoder, MODEL_ID, transport_kind=args.transport, consumer_id=args.consumer_id,
                            pull_timeout_s=args.pull_timeout_s) as client:
        if specs:
            pulled += client.encode(specs)
        if args.lookup:
            found = client.lookup(args.lookup, require=True)
            pulled += [p for p in found if p is not None]
        sample = client.metrics.registry.get_sample_value
        counters = {"pulls": sample("epd_pulls_total") or 0.0, "pull_bytes": sample("epd_pull_bytes_total") or 0.0}
    torch.save({p.mm_hash: p.embeddings for p in pulled}, args.out)
    print(json.dumps({
        "items": [{"mm_hash": p.mm_hash, "source": p.source, "num_tokens": p.num_tokens} for p in pulled],
        **counters,
    }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
