"""Elastic encoders: hits before and after a fourth encoder joins a running client, and how soon it is used.

Starts three `epd encoder` processes (eager graphs, real NIXL where installed)
and lists them in a file that one client follows (``file:PATH``, refreshed
every ``--refresh-s``; its local cache off, so every request asks an encoder).
The workload is ``--items`` distinct images, requested one per call, round
after round:

1. one round encodes them all (misses), the next measures ``hit_rate_before``;
2. a fourth encoder is started and appended to the file; rounds go on and
   ``seconds_until_new_encoder_used`` is the time from the file write to the
   first item the new encoder serves;
3. ``hit_rate_after_scale_up`` counts each item's first request once the
   client knows the new encoder: the items whose rendezvous order now puts
   the new encoder first (about a quarter) are encoded there again; every
   other item stays a hit where it was.

Every pulled item is compared with the first pull of the same image (rows
equal). The last line of stdout is one JSON object.

Usage: ``python bench/elastic.py [--transport auto|nixl|mock] [--items 192] [--refresh-s 0.5]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from epd_harness.media import image_bytes  # noqa: E402
from epd_harness.procs import bench_encoder_args, start_encoder  # noqa: E402
from prefill_client.consumer.client import EncoderCacheClient, PulledItem  # noqa: E402
from prefill_client.consumer.connection import MediaSpec  # noqa: E402

MODEL = "tiny-qwen3-vl"
USE_TIMEOUT_S = 60.0


def one_round(client: EncoderCacheClient, images: list[bytes], first: dict[int, torch.Tensor]
              ) -> list[PulledItem]:
    """Request every image once (one call each); check each against its first pull."""
    out = []
    for i, data in enumerate(images):
        [item] = client.encode([MediaSpec.image(data)])
        if i in first and not torch.equal(item.embeddings, first[i]):
            raise SystemExit(f"image {i}: rows from {item.encoder} differ from its first pull")
        first.setdefault(i, item.embeddings)
        out.append(item)
    return out


def hit_rate(items: list[PulledItem]) -> float:
    return round(sum(item.source == "hit" for item in items) / len(items), 3)


def run(args: argparse.Namespace, workdir: Path) -> dict[str, object]:
    images = [image_bytes(64 + 16 * (i % 4), 64 + 16 * (i % 4), seed=9000 + i) for i in range(args.items)]
    blocks = 4 * args.items + 2
    encoders = []
    try:
        for i in range(4):
            (workdir / f"enc{i}").mkdir()
        for i in range(3):
            encoders.append(start_encoder(workdir / f"enc{i}", *bench_encoder_args(args.transport, blocks)))
        targets = [e.target for e in encoders]
        listing = workdir / "encoders.txt"
        listing.write_text("\n".join(targets) + "\n")
        first: dict[int, torch.Tensor] = {}
        with EncoderCacheClient(f"file:{listing}", MODEL, transport_kind=args.transport, local_cache_blocks=0,
                                membership_refresh_s=args.refresh_s) as client:
            one_round(client, images, first)  # misses: every item encoded once
            before = one_round(client, images, first)
            encoders.append(start_encoder(workdir / "enc3", *bench_encoder_args(args.transport, blocks)))
            new = encoders[-1].target
            listing.write_text("\n".join([*targets, new]) + "\n")
            listed = time.monotonic()
            # Steady load goes on; each item's first request once the client knows the new encoder
            # says whether the scale-up cost it its hit.
            after: dict[int, PulledItem] = {}
            used_after: float | None = None
            while len(after) < len(images):
                if time.monotonic() - listed > USE_TIMEOUT_S:
                    raise SystemExit(f"the client did not use the new encoder within {USE_TIMEOUT_S} s")
                for i, data in enumerate(images):
                    known = new in client.targets
                    [item] = client.encode([MediaSpec.image(data)])
                    if not torch.equal(item.embeddings, first[i]):
                        raise SystemExit(f"image {i}: rows from {item.encoder} differ from its first pull")
                    if item.encoder == new and used_after is None:
                        used_after = time.monotonic() - listed
                    if known and i not in after:
                        after[i] = item
            moved = sum(item.encoder == new for item in after.values())
            assert used_after is not None
    finally:
        for encoder in encoders:
            encoder.terminate()
    return {
        "transport": encoders[0].transport if encoders else args.transport,
        "items": args.items,
        "refresh_s": args.refresh_s,
        "hit_rate_before": hit_rate(before),
        "hit_rate_after_scale_up": hit_rate(list(after.values())),
        "items_on_new_encoder": moved,
        "seconds_until_new_encoder_used": round(used_after, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--transport", default="auto", help="auto, nixl or mock")
    parser.add_argument("--items", type=int, default=192,
                        help="distinct images (the share that moves spreads by about 3 %% at 192)")
    parser.add_argument("--refresh-s", type=float, default=0.5, help="the client's membership refresh")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="epd-elastic-") as tmp:
        out = run(args, Path(tmp))
    print(f"hit rate {out['hit_rate_before']} before, {out['hit_rate_after_scale_up']} after a fourth encoder "
          f"joined ({out['items_on_new_encoder']} of {out['items']} items moved to it); first used "
          f"{out['seconds_until_new_encoder_used']} s after it was listed")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
