"""Encoder write-path throughput per bucket: eager vs torch.compile (encoder process code).

Fills each bucket exactly with 64-token images and writes them into a cache
buffer through ``EncoderRunner.write`` (the aliased path). After one untimed
call per backend (the compiled one compiles its graph then), the backends run
*interleaved*, one write each per round, so both see the same machine load; the
reported rate is merged tokens divided by the median write time. The compiled
rows are checked against the eager ones. The last line of output is one JSON
object; the exit status is 1 if compiled and eager rows differ.

    python bench/encoder.py                       # tiny tower, buckets 64,256,512
    python bench/encoder.py --threads 1 --buckets 64,256 --seconds 1

The first compiled call of each bucket compiles its graph (tens of seconds on
a small CPU, a few with a warm Inductor cache); ``--budget-s`` bounds the run by
skipping the buckets not yet started once it is spent.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from encoder_server.preprocess import ProcessedItem  # noqa: E402
from encoder_server.vision import EncoderRunner, default_tokens_per_block, load_encoder  # noqa: E402
from encoder_server.vision.model import VisionEncoder  # noqa: E402

logger = logging.getLogger(__name__)

IMAGE_GRID = (1, 16, 16)  # 256 patches = 64 merged tokens per image
BLOCK_SIZE = 64


def make_items(encoder: VisionEncoder, tokens: int, seed: int) -> list[ProcessedItem]:
    cfg = encoder.config
    t, h, w = IMAGE_GRID
    per_item = t * h * w // cfg.merge_unit
    generator = torch.Generator().manual_seed(seed)
    return [
        ProcessedItem(torch.randn(t * h * w, cfg.patch_dim, generator=generator), IMAGE_GRID, per_item, "image")
        for _ in range(max(1, tokens // per_item))
    ]


def bench_bucket(runners: dict[str, EncoderRunner], encoder: VisionEncoder, bucket: int,
                 seconds: float) -> dict[str, object]:
    items = make_items(encoder, bucket, seed=bucket)
    tpbs = [default_tokens_per_block(item.num_tokens, BLOCK_SIZE) for item in items]
    blocks, next_block = [], 0
    for counts in tpbs:
        blocks.append(list(range(next_block, next_block + len(counts))))
        next_block += len(counts)
    scratch = next_block
    buffers = {name: torch.zeros(scratch + 1, BLOCK_SIZE, encoder.fat_dim) for name in runners}
    tokens = sum(item.num_tokens for item in items)
    row: dict[str, object] = {"bucket": bucket, "tokens": tokens}
    for name, runner in runners.items():
        start = time.perf_counter()
        runner.write(items, blocks, tpbs, buffers[name], scratch)  # compiles where the backend compiles
        row[f"{name}_first_call_s"] = round(time.perf_counter() - start, 3)
    times: dict[str, list[float]] = {name: [] for name in runners}
    start = time.perf_counter()
    while len(times[next(iter(runners))]) < 5 or time.perf_counter() - start < seconds * len(runners):
        for name, runner in runners.items():
            began = time.perf_counter()
            runner.write(items, blocks, tpbs, buffers[name], scratch)
            times[name].append(time.perf_counter() - began)
    for name, samples in times.items():
        row[f"{name}_tokens_per_s"] = round(tokens / statistics.median(samples), 1)
        row[f"{name}_runs"] = len(samples)
    reference = next(iter(buffers.values()))[:scratch]
    row["max_abs_diff"] = max(float((b[:scratch] - reference).abs().max()) for b in buffers.values())
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--buckets", default="64,256,512", help="bucket sizes in merged tokens")
    parser.add_argument("--attention-block", type=int, default=512, help="merged tokens per attention block")
    parser.add_argument("--seconds", type=float, default=1.0, help="timed seconds per bucket and backend")
    parser.add_argument("--budget-s", type=float, default=90.0,
                        help="start no new bucket after this many seconds (compiles are slow)")
    parser.add_argument("--backends", default="eager,compile", help="backends to compare")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    buckets = tuple(int(b) for b in args.buckets.split(","))
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]

    encoder = load_encoder(seed=0)
    runners = {name: EncoderRunner(encoder, block_size=BLOCK_SIZE, buckets=buckets,
                                   attention_block=args.attention_block, backend=name) for name in backends}
    results: list[dict[str, object]] = []
    wins = compared = 0
    worst = 0.0
    skipped: list[int] = []
    started = time.perf_counter()
    for bucket in buckets:
        if time.perf_counter() - started > args.budget_s:
            skipped.append(bucket)
            continue
        row = bench_bucket(runners, encoder, bucket, args.seconds)
        results.append(row)
        worst = max(worst, float(str(row["max_abs_diff"])))
        print("bucket %5d: %s" % (bucket, ", ".join(
            f"{name} {row[f'{name}_tokens_per_s']} tokens/s (first call {row[f'{name}_first_call_s']} s)"
            for name in runners)), flush=True)
        if "eager" in runners and "compile" in runners:
            compared += 1
            wins += float(str(row["compile_tokens_per_s"])) > float(str(row["eager_tokens_per_s"]))

    summary: dict[str, object] = {
        "bench": "encoder",
        "device": "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "config": {"depth": encoder.config.depth, "hidden_size": encoder.config.hidden_size,
                   "fat_dim": encoder.fat_dim, "attention_block": args.attention_block},
        "unit": "merged tokens per second (median write)",
        "buckets": results,
        "skipped_buckets": skipped,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    if compared:
        summary["faster"] = "compile" if wins * 2 > compared else "eager"
    print(json.dumps(summary))
    if worst > 1e-4:
        print(f"compiled and eager rows differ by {worst}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
