"""A client process of the lease race: random pairs of images through the public API, every delivery judged.

Run as ``python -m tests.reliability.lease_race_client --encoder HOST:PORT --media FILE.pt
--seed N --seconds S --max-delivered N [--rpc-timeout-s T]``. ``FILE.pt`` holds
``{"images": [bytes, ...], "refs": [tensor, ...]}``: the images and their
embeddings as a second encoder (same weights, a large cache) delivered them.
The loop calls :meth:`EncoderCacheClient.encode` (the client's local cache off
unless ``--local-cache-blocks`` says otherwise) and compares every delivered embedding with its reference. It prints one
JSON object: delivered and wrong counts, each wrong item's worst difference,
and every failure by kind (:func:`tests.support.outcomes.classify`).
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import random
import sys
import time

import torch

from prefill_client.consumer.client import EncoderCacheClient
from prefill_client.consumer.connection import MediaSpec
from tests.support.outcomes import classify
from tests.support.reference import matches

MODEL_ID = "tiny-qwen3-vl"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="lease_race_client")
    parser.add_argument("--encoder", required=True)
    parser.add_argument("--transport", default="nixl")
    parser.add_argument("--media", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--max-delivered", type=int, required=True)
    parser.add_argument("--rpc-timeout-s", type=float, default=10.0)
    parser.add_argument("--pull-timeout-s", type=float, default=5.0)
    parser.add_argument("--local-cache-blocks", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)

    media = torch.load(args.media)
    images: list[bytes] = media["images"]
    refs: list[torch.Tensor] = media["refs"]
    rng = random.Random(args.seed)
    delivered = requests = 0
    wrong: list[dict[str, object]] = []
    outcomes: collections.Counter[str] = collections.Counter()
    sources: collections.Counter[str] = collections.Counter()
    stop_at = time.monotonic() + args.seconds
    with EncoderCacheClient(args.encoder, MODEL_ID, transport_kind=args.transport,
                            local_cache_blocks=args.local_cache_blocks, rpc_timeout_s=args.rpc_timeout_s, pull_timeout_s=args.pull_timeout_s,
                            consumer_id=f"race-client-{args.seed}") as client:
        while time.monotonic() < stop_at and delivered < args.max_delivered:
            picks = rng.sample(range(len(images)), 2)
            requests += 1
            try:
                pulled = client.encode([MediaSpec.image(images[i]) for i in picks])
            except Exception as exc:  # noqa: BLE001 - every outcome is classified and reported
                outcomes[classify(exc)] += 1
                continue
            outcomes["ok"] += 1
            for i, item in zip(picks, pulled):
                delivered += 1
                sources[item.source] += 1
                if not matches(item.embeddings, refs[i]):
                    diff = (item.embeddings.float() - refs[i].float()).abs().max().item() \
                        if item.embeddings.shape == refs[i].shape else float("inf")
                    wrong.append({"image": i, "mm_hash": item.mm_hash, "source": item.source,
                                  "max_diff": diff})
    print(json.dumps({"requests": requests, "delivered": delivered, "wrong": wrong,
                      "outcomes": dict(outcomes), "sources": dict(sources)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
