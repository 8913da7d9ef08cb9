"""Frame attention: the native CPU kernel against torch's SDPA on the same frames, one run (run by hand).

The frames are those of ``bench/encoder.py``'s batch (8 images of 224x224 up to
800x600 after the encoder's preprocessing: 256 to 1,900 patches each), with
``--heads`` x ``--head-dim`` (the tiny tower's 2 x 16 by default). ``q, k, v``
are views of one ``[rows, 3, heads, head_dim]`` tensor, as the tower makes
them. The two paths run interleaved, one call each per round, so both see the
same machine load; each reports its median time of one call (one layer's
attention), and the kernel's largest difference from SDPA.

    python bench/attention.py
    python bench/attention.py --heads 16 --head-dim 64 --rounds 10

The last line of stdout is one JSON object; exit status 1 when the kernel is
not available here (it says why).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.errors import ConfigError  # noqa: E402
from encoder_server.vision import native  # noqa: E402
from encoder_server.vision.model import sdpa_frame_attention  # noqa: E402

# Patches per frame of bench/encoder.py's batch (its images' grids, h * w).
FRAMES = (256, 320, 432, 784, 880, 1024, 1900, 1900)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    try:
        kernel = native.build()
    except ConfigError as exc:
        print(f"native attention kernel unavailable: {exc}", file=sys.stderr)
        return 1
    generator = torch.Generator().manual_seed(0)
    qkv = torch.randn(sum(FRAMES), 3, args.heads, args.head_dim, generator=generator)
    q, k, v = qkv.unbind(1)
    frames = torch.tensor(FRAMES)
    paths = {"native": lambda: kernel.frame_attention(q, k, v, frames),
             "sdpa": lambda: sdpa_frame_attention(q, k, v, frames)}
    diff = float((paths["native"]() - paths["sdpa"]()).abs().max())
    samples: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(args.rounds):
        for name, fn in paths.items():
            started = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - started)
    median_ms = {name: round(statistics.median(v) * 1e3, 2) for name, v in samples.items()}
    print(f"native {median_ms['native']} ms, SDPA {median_ms['sdpa']} ms a layer "
          f"({median_ms['sdpa'] / median_ms['native']:.2f}x), max diff {diff:.1e}")
    print(json.dumps({"bench": "attention", "torch": torch.__version__, "threads": torch.get_num_threads(),
                      "heads": args.heads, "head_dim": args.head_dim, "frames": list(FRAMES),
                      "rounds": args.rounds, "median_ms": median_ms,
                      "sdpa_over_native": round(median_ms["sdpa"] / median_ms["native"], 2),
                      "max_abs_diff": diff}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
