"""Benchmark of the reference worker's prefill step: eager vs torch.compile, per bucket.

Runs the static-shape step (embed -> merge -> LM layers on top of a cached
prefix) for a few (new tokens, prefix tokens) pairs with a tiny LM and
prints the median step time of each; the last line is one JSON object.

    python bench/prefill_graph.py [--compile] [--iters 20] [--hidden 64] [--levels 2] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from common.config import CacheMode
from prefill_client.reference.graph import PrefillGraph
from prefill_client.reference.lm import LMConfig, build_lm
from prefill_client.reference.positions import ItemPlacement
from prefill_client.reference.tokenizer import Special

CASES = ((100, 0), (40, 96), (300, 256))  # (new tokens, prefix tokens); prefix is block-aligned


def run_case(graph: PrefillGraph, rows: torch.Tensor, new: int, prefix: int, iters: int) -> dict[str, float]:
    c = graph.config
    image = min(64, new - 4)
    tokens = [int(Special.USER)] + [int(Special.IMAGE)] * image + [65] * (new - 1 - image)
    placements = [ItemPlacement.dense("img", range((image + 31) // 32), image, prefix + 1, 32)]
    kv = [torch.randn(c.num_layers, 2, 16, c.num_kv_heads, c.head_dim) for _ in range(prefix // 16)]
    kwargs = dict(start=prefix, prefix_kv=kv, rows=rows, placements=placements,
                  spans=[("img", prefix + 1, image)], mode=CacheMode.EPD)
    started = time.perf_counter()
    graph.run(tokens, **kwargs)  # first call: compile (or warm-up) for this bucket pair
    first_ms = (time.perf_counter() - started) * 1e3
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        graph.run(tokens, **kwargs)
        times.append((time.perf_counter() - t0) * 1e3)
    return {"new_tokens": new, "prefix_tokens": prefix, "first_call_ms": round(first_ms, 2),
            "median_ms": round(statistics.median(times), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--levels", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    lm = build_lm(LMConfig(hidden_size=args.hidden, num_deepstack_levels=args.levels), seed=0)
    graph = PrefillGraph(lm, max_model_len=1024, max_items=8, compile=args.compile)
    rows = torch.randn(64, 32, args.hidden * (1 + args.levels))
    results = []
    for new, prefix in CASES:
        r = run_case(graph, rows, new, prefix, args.iters)
        print(f"new={new:4d} prefix={prefix:4d}: first call {r['first_call_ms']:9.1f} ms, "
              f"median {r['median_ms']:7.3f} ms")
        results.append(r)
    print(json.dumps({"bench": "prefill_graph", "graph": "compiled" if args.compile else "eager",
                      "torch": torch.__version__, "threads": torch.get_num_threads(), "cases": results}))


if __name__ == "__main__":
    main()
