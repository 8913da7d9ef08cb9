"""End-to-end time to first token through the reference prefill worker: encoder hit vs miss (run by hand).

Starts ``epd encoder`` in its own process (eager encoder graphs, one block
of 64 rows per default image), then, for each concurrency level, builds
that many prefill workers in this process, each with its own
:class:`EncoderCacheClient` (its own NIXL agent and landing blocks, as
separate prefill processes would have) through the same factory as
``epd prefill``, and runs them in as many threads, all released at once:

- **miss**: every request carries an image no one has sent before: Lookup
  (not there), Encode (the encoder runs), NIXL pull, merge, prefill;
- **hit**: every request carries an image the encoder already holds (encoded
  beforehand by a separate client, untimed) that this worker has never seen:
  Lookup, NIXL pull, merge, prefill.

Each request's text comes first and is unique, so the prefix cache never
covers the image; every worker serves one untimed request of each kind
first. TTFT is the worker's own measure (request in -> first token out).
Each client sends ``--requests`` of each kind, more at low concurrency so
that every level has at least ``--min-requests`` samples per kind.
The workers are threads of one process (they share its GIL and torch runs
one intra-op thread each); the encoder is its own process. Counts are
bounded: ``--requests`` per client per kind.

Usage: ``python bench/e2e.py [--concurrency 1,4,16] [--requests 4] [--image-size 256]
[--min-requests 16] [--transport auto|nixl|mock] [--quick]``. The last line of stdout is one JSON object:
``{"ttft_ms": {"c1": {"miss": {"p50", "p90", "mean", "max", "n"}, "hit": {...}}, ...},
"requests_per_s": {"c1": {"miss", "hit"}, ...}, ...}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.config import PrefillConfig  # noqa: E402
from common.metrics import PrefillMetrics  # noqa: E402
from epd_harness.media import image_bytes  # noqa: E402
from epd_harness.procs import bench_encoder_args, start_encoder  # noqa: E402
from prefill_client.reference.chat import ChatRequest, MediaItem  # noqa: E402
from prefill_client.reference.cli import build_worker  # noqa: E402
from prefill_client.consumer.client import EncoderCacheClient  # noqa: E402
from prefill_client.consumer.connection import MediaSpec  # noqa: E402
from prefill_client.reference.worker import PrefillWorker  # noqa: E402

MODEL_ID = "tiny-qwen3-vl"
PHASE_TIMEOUT_S = 600.0
EXPECTED_LAYER = {"miss": "encoder-miss", "hit": "encoder-hit"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--concurrency", default="1,4,16", help="comma-separated concurrent clients")
    parser.add_argument("--requests", type=int, default=4, help="timed requests per client and kind")
    parser.add_argument("--image-size", type=int, default=256, help="square image side in pixels (256: 64 tokens)")
    parser.add_argument("--transport", default="auto", help="auto, nixl or mock")
    parser.add_argument("--min-requests", type=int, default=16,
                        help="timed requests per level and kind at least (clients send more at low concurrency)")
    parser.add_argument("--quick", action="store_true", help="2 requests per client and kind, at least 4 per level")
    return parser.parse_args(argv)


class Images:
    """Distinct images, never repeated across the whole run."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._next = 0

    def take(self, n: int) -> list[bytes]:
        out = [image_bytes(self.size, self.size, seed=1000 + self._next + i) for i in range(n)]
        self._next += n
        return out


def request(tag: str, image: bytes) -> ChatRequest:
    # Unique text first: the prompts diverge in the first prefix block.
    return ChatRequest.user(f"{tag}: what is in this picture?", MediaItem.image(image, label=tag))


def run_phase(workers: Sequence[PrefillWorker], batches: Sequence[Sequence[ChatRequest]], kind: str
              ) -> tuple[list[float], float]:
    """Each worker serves its batch in its own thread, all released at once; TTFTs (s) and the wall time."""
    barrier = threading.Barrier(len(workers) + 1)
    ttfts: list[list[float]] = [[] for _ in workers]
    errors: list[BaseException] = []

    def serve(i: int) -> None:
        try:
            barrier.wait(PHASE_TIMEOUT_S)
            for req in batches[i]:
                result = workers[i].prefill(req)
                layer = result.items[0].layer
                if layer != EXPECTED_LAYER[kind]:
                    raise RuntimeError(f"a {kind} request was served as {layer}")
                ttfts[i].append(result.ttft_s)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=serve, args=(i,), daemon=True) for i in range(len(workers))]
    for t in threads:
        t.start()
    barrier.wait(PHASE_TIMEOUT_S)
    started = time.perf_counter()
    for t in threads:
        t.join(PHASE_TIMEOUT_S)
    wall = time.perf_counter() - started
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in threads):
        raise SystemExit(f"{kind} phase did not finish within {PHASE_TIMEOUT_S} s")
    return [x for per in ttfts for x in per], wall


def stats_ms(values: Sequence[float]) -> dict[str, float]:
    ms = sorted(v * 1e3 for v in values)
    return {
        "p50": round(statistics.median(ms), 2),
        "p90": round(ms[min(len(ms) - 1, int(0.9 * len(ms)))], 2),
        "mean": round(statistics.fmean(ms), 2),
        "max": round(ms[-1], 2),
        "n": len(ms),
    }


Summary = dict[str, dict[str, float]]


def run_level(c: int, k: int, target: str, transport: str, images: Images) -> tuple[Summary, dict[str, float]]:
    base = dataclasses.replace(PrefillConfig(), encoders=(target,), transport=transport, max_model_len=1024)
    built = [build_worker(dataclasses.replace(base, consumer_id=f"bench-c{c}-w{i}"), PrefillMetrics())
             for i in range(c)]
    workers = [w for _, w in built]
    try:
        # Warm-up, untimed: one miss and one hit per worker (handshake, NIXL wire-up, graph shapes).
        warm_hit = images.take(c)
        with EncoderCacheClient(target, MODEL_ID, transport_kind=transport, consumer_id=f"seed-c{c}") as seeder:
            seeder.encode([MediaSpec.image(b) for b in warm_hit])
            hit_images = images.take(c * k)
            for j in range(0, len(hit_images), 16):
                seeder.encode([MediaSpec.image(b) for b in hit_images[j:j + 16]])
        run_phase(workers, [[request(f"warm-miss-c{c}-w{i}", b)] for i, b in enumerate(images.take(c))], "miss")
        run_phase(workers, [[request(f"warm-hit-c{c}-w{i}", warm_hit[i])] for i in range(c)], "hit")

        miss_images = images.take(c * k)
        miss, miss_wall = run_phase(
            workers, [[request(f"miss-c{c}-w{i}-{j}", miss_images[i * k + j]) for j in range(k)] for i in range(c)],
            "miss")
        hit, hit_wall = run_phase(
            workers, [[request(f"hit-c{c}-w{i}-{j}", hit_images[i * k + j]) for j in range(k)] for i in range(c)],
            "hit")
    finally:
        for client, _ in built:
            client.close()
    ttft = {"miss": stats_ms(miss), "hit": stats_ms(hit)}
    rate = {"miss": round(len(miss) / miss_wall, 2), "hit": round(len(hit) / hit_wall, 2)}
    return ttft, rate


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    levels = [int(c) for c in args.concurrency.split(",")]
    k, floor = (2, 4) if args.quick else (args.requests, args.min_requests)
    per_client = {c: max(k, -(-floor // c)) for c in levels}
    num_images = sum(c * (2 * per_client[c] + 2) for c in levels)  # hit + miss, plus two warm-ups each
    tokens = (args.image_size // 32) ** 2
    blocks_per_image = -(-max(64, tokens) // 64)
    images = Images(args.image_size)
    out: dict[str, object] = {
        "clients": "threads in one process, one EncoderCacheClient + worker each",
        "torch_threads": 1, "image_size": args.image_size,
        "requests_per_client": {f"c{c}": per_client[c] for c in levels},
        "ttft_ms": {}, "requests_per_s": {},
    }
    with tempfile.TemporaryDirectory(prefix="epd-bench-") as tmp:
        encoder = start_encoder(Path(tmp), *bench_encoder_args(args.transport, num_images * blocks_per_image + 8))
        target, transport = encoder.target, encoder.transport
        out["transport"] = transport
        try:
            for c in levels:
                ttft, rate = run_level(c, per_client[c], target, transport, images)
                out["ttft_ms"][f"c{c}"] = ttft  # type: ignore[index]
                out["requests_per_s"][f"c{c}"] = rate  # type: ignore[index]
                print(f"c{c}: miss ttft p50 {ttft['miss']['p50']:.1f} ms p90 {ttft['miss']['p90']:.1f} ms "
                      f"({rate['miss']:.1f} req/s) | hit ttft p50 {ttft['hit']['p50']:.1f} ms "
                      f"p90 {ttft['hit']['p90']:.1f} ms ({rate['hit']:.1f} req/s)", flush=True)
        finally:
            encoder.terminate()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
