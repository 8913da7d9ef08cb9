"""Padding waste of the cache layout: rows per block against a mixed image workload (run by hand, seconds).

An item takes whole blocks (never two items in one block), so the rows between an item's last token and
the end of its last block are padding: allocated, never written or read. This script measures how much of
the cache that is on a fixed workload, for several rows-per-block values and for the default layout
(``CacheConfig()`` with ``block_size`` unset, resolved by ``CacheConfig.layout`` from the row width).

Workload (numpy ``default_rng(--seed)``, seed 0 by default): ``--images`` images (10,000), each with its
long side uniform in 224..1920 pixels and its aspect ratio (width:height) uniform among 1:1, 4:3, 3:4, 16:9
and 9:16; the short side is the long side times the ratio, rounded. Each image's merged tokens (its cache
rows) come from the project's own code, not a copy of the rule: ``common.media.image_grid``, which applies
the same ``smart_resize`` as the encoder's ``Preprocessor``, with the encoder's default preprocessing
(``PreprocessConfig.for_encoder`` of the tiny ``VisionConfig``: 64..512 merged tokens per image).

Waste = (allocated rows - used rows) / allocated rows over the whole workload. The default layout depends
on the row width (``fat_dim`` times the dtype's size), so it is reported for the tiny model (the project's
default encoder: 64 wide, 2 deepstack levels) and for wider rows (``out_hidden_size`` 2048, 4096 and 5120
with 3 deepstack levels, bf16). Target: every default wastes at most 8 %; the exit status is 1 otherwise.

Usage: ``python bench/layout.py [--block-sizes 16,32,64,128,256,512] [--images 10000] [--seed 0]``.
Prints one line per layout, then one JSON object on the last line: ``{"bench": "layout", "workload",
"tokens", "results": [{"block_size", "allocated_rows", "used_rows", "waste"}], "defaults":
[{"out_hidden_size", "deepstack_levels", "row_bytes", "block_size", "block_bytes", "waste"}], "target"}``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.config import CacheConfig  # noqa: E402
from common.media import image_grid, num_tokens  # noqa: E402
from encoder_server.preprocess import PreprocessConfig  # noqa: E402
from encoder_server.vision.config import VisionConfig  # noqa: E402

LONG_SIDE = (224, 1920)  # pixels, both included
ASPECT_RATIOS = ((1, 1), (4, 3), (3, 4), (16, 9), (9, 16))  # width : height
MAX_WASTE = 0.08
TINY = VisionConfig()
# (out_hidden_size, deepstack levels) of the rows the default layout is reported for: the tiny model first.
WIDTHS = ((TINY.out_hidden_size, TINY.num_deepstack_levels), (2048, 3), (4096, 3), (5120, 3))


def workload(images: int, seed: int) -> list[tuple[int, int]]:
    """(height, width) of each image, drawn as the module docstring says."""
    rng = np.random.default_rng(seed)
    sizes = []
    for _ in range(images):
        long_side = int(rng.integers(LONG_SIDE[0], LONG_SIDE[1] + 1))
        w, h = ASPECT_RATIOS[int(rng.integers(len(ASPECT_RATIOS)))]
        short_side = max(1, round(long_side * min(w, h) / max(w, h)))
        sizes.append((short_side, long_side) if w >= h else (long_side, short_side))
    return sizes


def waste(tokens: list[int], block_size: int) -> tuple[int, int, float]:
    """(allocated rows, used rows, padding share of the allocated rows)."""
    used = sum(tokens)
    allocated = sum(math.ceil(t / block_size) * block_size for t in tokens)
    return allocated, used, (allocated - used) / allocated


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--block-sizes", default="16,32,64,128,256,512", help="comma-separated rows per block")
    parser.add_argument("--images", type=int, default=10_000, help="images in the workload")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload")
    args = parser.parse_args(argv)
    block_sizes = [int(b) for b in args.block_sizes.split(",")]
    if args.images <= 0 or any(b <= 0 for b in block_sizes):
        parser.error("--images and every block size must be > 0")
    started = time.perf_counter()

    preprocess = PreprocessConfig.for_encoder(TINY)
    params = preprocess.params()
    tokens = [num_tokens(image_grid(h, w, params), params.merge_size) for h, w in workload(args.images, args.seed)]
    print(f"{len(tokens)} images, long side {LONG_SIDE[0]}..{LONG_SIDE[1]}, aspect ratios "
          f"{', '.join(f'{w}:{h}' for w, h in ASPECT_RATIOS)}: {min(tokens)}..{max(tokens)} merged tokens, "
          f"mean {sum(tokens) / len(tokens):.1f}")

    results = []
    for block_size in block_sizes:
        allocated, used, share = waste(tokens, block_size)
        results.append({"block_size": block_size, "allocated_rows": allocated, "used_rows": used,
                        "waste": round(share, 4)})
        print(f"{block_size:>4} rows per block: padding {100 * share:5.2f} % of {allocated:,} allocated rows")

    defaults = []
    for hidden, levels in WIDTHS:
        layout = CacheConfig().layout(hidden, levels)
        _, _, share = waste(tokens, layout.block_size)
        defaults.append({"out_hidden_size": hidden, "deepstack_levels": levels, "row_bytes": layout.bytes_per_row,
                         "block_size": layout.block_size, "block_bytes": layout.bytes_per_block,
                         "waste": round(share, 4)})
        print(f"default layout, out_hidden_size {hidden} x (1 + {levels}) in {CacheConfig().dtype} "
              f"({layout.bytes_per_row:,} B rows): {layout.block_size} rows per block "
              f"({layout.bytes_per_block:,} B), padding {100 * share:5.2f} %")

    worst = max(float(d["waste"]) for d in defaults)
    met = worst <= MAX_WASTE
    print(f"target: every default layout wastes at most {100 * MAX_WASTE:.0f} %: "
          f"{'met' if met else 'NOT met'} (worst {100 * worst:.2f} %)")
    print(json.dumps({
        "bench": "layout",
        "workload": {"images": args.images, "seed": args.seed, "long_side": list(LONG_SIDE),
                     "aspect_ratios": [f"{w}:{h}" for w, h in ASPECT_RATIOS],
                     "min_pixels": preprocess.min_pixels, "max_pixels": preprocess.max_pixels},
        "tokens": {"min": min(tokens), "max": max(tokens), "mean": round(sum(tokens) / len(tokens), 1),
                   "total": sum(tokens)},
        "results": results,
        "defaults": defaults,
        "target": {"rule": f"waste <= {MAX_WASTE} for every default layout", "worst_waste": worst, "met": met},
        "seconds": round(time.perf_counter() - started, 2),
    }))
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
