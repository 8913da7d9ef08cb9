"""Benchmark of the in-graph merge against a plain copy of the same bytes (run by hand).

Default workload: 30 images x 256 tokens at fat_dim 2048 in bf16, gathered from
a cache buffer through a block-id index (the reference's "whole buffer plus a
block-id index tensor") and scattered into 8192 hidden rows (512 text tokens
between the images). Every variant is timed round-robin in the same run, so a
noisy neighbour slows them all alike; the median of the repeats is reported.

Keys of the JSON object on the last line:

- ``eager_ms`` / ``compiled_ms``: the in-place merge into a persistent
  ``[num_tokens + 1, D]`` buffer (:func:`merge_multimodal_embeddings_padded`),
  eager and ``torch.compile(fullgraph=True)`` (inductor);
- ``eager_functional_ms`` / ``compiled_functional_ms``: the functional form
  (:func:`merge_multimodal_embeddings`), which also copies the text rows into
  a fresh buffer;
- ``copy_ms``: ``Tensor.copy_`` of items x tokens x fat_dim elements between
  two preallocated tensors; ``compiled_over_copy`` = compiled_ms / copy_ms;
- ``hidden_clone_ms``: ``hidden.clone()``, a fresh allocation plus a copy of
  every hidden row, which is what the functional form adds when ``hidden`` is
  a graph input (on CPU, first-touch page faults dominate it).

Usage: ``python bench/merge.py [--items 30 --tokens-per-item 256 --dim 2048]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.layout import parse_dtype  # noqa: E402
from prefill_client.reference.merge import (  # noqa: E402
    merge_multimodal_embeddings,
    merge_multimodal_embeddings_padded,
    new_padded_hidden,
)
from prefill_client.reference.positions import ItemPlacement, build_encoder_positions  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=30)
    parser.add_argument("--tokens-per-item", type=int, default=256)
    parser.add_argument("--dim", type=int, default=2048, help="fat_dim of a cached row")
    parser.add_argument("--text-tokens", type=int, default=512)
    parser.add_argument("--buffer-blocks", type=int, default=64, help="cache buffer blocks (scratch included)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.items >= args.buffer_blocks:
        raise SystemExit(f"--buffer-blocks {args.buffer_blocks} must exceed --items {args.items}")
    device = torch.device(args.device)
    dtype = parse_dtype(args.dtype)
    gen = torch.Generator().manual_seed(args.seed)
    block_size = args.tokens_per_item
    num_tokens = args.items * args.tokens_per_item + args.text_tokens

    # Images spread through the text: an even share of the text before each one.
    gap = args.text_tokens // (args.items + 1)
    usable = torch.randperm(args.buffer_blocks - 1, generator=gen)[: args.items].tolist()
    items = [
        ItemPlacement.dense(f"img{i}", (usable[i],), args.tokens_per_item,
                            offset=gap * (i + 1) + i * args.tokens_per_item, block_size=block_size)
        for i in range(args.items)
    ]
    pmap = build_encoder_positions(items, num_tokens=num_tokens, max_blocks=args.items,
                                   block_size=block_size)
    positions = pmap.encoder_positions.to(device)
    block_ids = pmap.block_ids.to(device)
    buffer = torch.randn(args.buffer_blocks, block_size, args.dim, generator=gen).to(device, dtype)
    hidden = torch.randn(num_tokens, args.dim, generator=gen).to(device, dtype)
    padded = new_padded_hidden(num_tokens, args.dim, dtype=dtype, device=device)
    padded[:num_tokens] = hidden
    copy_src = torch.randn(args.items * args.tokens_per_item, args.dim, generator=gen).to(device, dtype)
    copy_dst = torch.empty_like(copy_src)

    compiled_padded = torch.compile(merge_multimodal_embeddings_padded, fullgraph=True)
    compiled_functional = torch.compile(merge_multimodal_embeddings, fullgraph=True)
    variants: dict[str, Callable[[], object]] = {
        "eager_ms": lambda: merge_multimodal_embeddings_padded(padded, buffer, positions, block_ids),
        "compiled_ms": lambda: compiled_padded(padded, buffer, positions, block_ids),
        "eager_functional_ms": lambda: merge_multimodal_embeddings(hidden, buffer, positions, block_ids),
        "compiled_functional_ms": lambda: compiled_functional(hidden, buffer, positions, block_ids),
        "copy_ms": lambda: copy_dst.copy_(copy_src),
        # What the functional form pays on top: a fresh buffer for the text rows.
        "hidden_clone_ms": lambda: hidden.clone(),
    }

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    start = time.perf_counter()
    reference = merge_multimodal_embeddings(hidden, buffer, positions, block_ids)
    for name in ("compiled_ms", "compiled_functional_ms"):
        got = variants[name]()
        if not (isinstance(got, torch.Tensor) and torch.equal(got, reference)):
            raise SystemExit(f"{name}: compiled merge differs from eager")
    sync()
    print(f"compiled both variants in {time.perf_counter() - start:.1f} s", flush=True)

    samples: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(args.warmup + args.repeats):
        for name, run in variants.items():  # round-robin: drift hits every variant alike
            sync()
            t0 = time.perf_counter()
            run()
            sync()
            if i >= args.warmup:
                samples[name].append((time.perf_counter() - t0) * 1e3)

    result: dict[str, object] = {
        name: round(statistics.median(values), 3) for name, values in samples.items()
    }
    result["compiled_over_copy"] = round(
        statistics.median(samples["compiled_ms"]) / statistics.median(samples["copy_ms"]), 3
    )
    result.update(
        items=args.items, tokens_per_item=args.tokens_per_item, fat_dim=args.dim,
        num_tokens=num_tokens, dtype=args.dtype, device=str(device),
        threads=torch.get_num_threads(), repeats=args.repeats,
        copy_bytes=copy_src.numel() * copy_src.element_size(),
    )
    for name in variants:
        print(f"{name:>24}: median {result[name]} ms  (min {min(samples[name]):.3f})")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
