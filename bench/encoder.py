"""Encoder throughput against transformers' Qwen3VLVisionModel, same weights, same batch, one run.

Builds a Qwen3-VL vision tower in transformers from a fixed seed (every
parameter randomized), saves it as a checkpoint and loads our encoder from
that checkpoint, so both hold the very same weights. One mixed batch of 8
images (224x224 up to 800x600, preprocessed by the encoder's own
preprocessing) is encoded by:

* ``transformers``: ``Qwen3VLVisionModel`` in eager mode (not compiled) with its default
  attention, SDPA, called once per frame: the reference every ratio is against;
* ``transformers_eager_attention``: the same model with ``attn_implementation="eager"``
  (matmul + softmax per frame), for comparison;
* ``embed``: our plain forward, ``VisionEncoder.embed``;
* ``serving_eager`` / ``serving_compiled``: what ``epd encoder`` runs,
  ``EncoderRunner.write`` into a cache buffer, eager and ``torch.compile``.

After one untimed call each (the compiled path compiles its graphs then), the
paths run interleaved, one call each per round, so all see the same machine
load; a path's rate is merged tokens over its median call time. Every path's
rows are checked against transformers'. The last line is one JSON object with
the ratios against transformers; the exit status is 1 if any path's rows
differ by more than the tolerance.

    python bench/encoder.py                      # tiny tower, 2 threads
    python bench/encoder.py --preset small --rounds 5
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.malloc import keep_freed_memory  # noqa: E402
from encoder_server.preprocess import PreprocessConfig, Preprocessor, ProcessedItem  # noqa: E402
from encoder_server.vision import EncoderRunner, VisionEncoder, default_tokens_per_block, load_encoder  # noqa: E402
from tests.support.media import image_bytes  # noqa: E402

logger = logging.getLogger(__name__)

# (width, height): from 224x224 up to 800x600, several aspect ratios.
IMAGE_SIZES = ((224, 224), (320, 240), (300, 400), (448, 448), (640, 360), (512, 512), (600, 800), (800, 600))
PRESETS: dict[str, dict[str, Any]] = {
    # the tiny tower our tests and the demo use
    "tiny": dict(depth=3, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
                 deepstack_visual_indexes=[0, 1], num_position_embeddings=64),
    # wider, so the matmuls weigh more than the per-op overhead
    "small": dict(depth=4, hidden_size=128, num_heads=4, intermediate_size=512, out_hidden_size=256,
                  deepstack_visual_indexes=[1, 2], num_position_embeddings=256),
}
BLOCK_SIZE = 64
TOLERANCE = 1e-4


def build_checkpoint(directory: Path, preset: dict[str, Any], seed: int) -> Any:
    """A transformers tower with every parameter drawn from ``seed``, saved where ``load_encoder`` reads it."""
    from safetensors.torch import save_file
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    config = Qwen3VLVisionConfig(patch_size=16, spatial_merge_size=2, temporal_patch_size=2, **preset)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = Qwen3VLVisionModel(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen3_vl", "vision_config": config.to_dict()}))
    save_file({"model.visual." + k: v.contiguous() for k, v in model.state_dict().items()},
              str(directory / "model.safetensors"))
    return model


def make_batch(encoder: VisionEncoder) -> list[ProcessedItem]:
    preprocessor = Preprocessor(PreprocessConfig.for_encoder(encoder))
    return [preprocessor.image(image_bytes(w, h, seed=i)) for i, (w, h) in enumerate(IMAGE_SIZES)]


class ServingPath:
    """``EncoderRunner.write`` into its own cache buffer, then the rows read back in item order."""

    def __init__(self, encoder: VisionEncoder, items: list[ProcessedItem], backend: str) -> None:
        self.runner = EncoderRunner(encoder, block_size=BLOCK_SIZE, backend=backend)
        self.items = items
        self.tpbs = [default_tokens_per_block(item.num_tokens, BLOCK_SIZE) for item in items]
        self.blocks: list[list[int]] = []
        next_block = 0
        for counts in self.tpbs:
            self.blocks.append(list(range(next_block, next_block + len(counts))))
            next_block += len(counts)
        self.scratch = next_block
        self.buffer = torch.zeros(next_block + 1, BLOCK_SIZE, encoder.fat_dim, dtype=encoder.dtype)
        self.batches = self.runner.plan_batches(items)

    def __call__(self) -> None:
        for batch in self.batches:
            self.runner.write([self.items[i] for i in batch], [self.blocks[i] for i in batch],
                              [self.tpbs[i] for i in batch], self.buffer, self.scratch)

    def rows(self) -> torch.Tensor:
        out = []
        for blocks, counts in zip(self.blocks, self.tpbs):
            out += [self.buffer[block, :count] for block, count in zip(blocks, counts)]
        return torch.cat(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="tower size")
    parser.add_argument("--rounds", type=int, default=9, help="timed rounds (one call of every path each)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--paths", default="transformers,transformers_eager_attention,embed,serving_eager,"
                                           "serving_compiled",
                        help="paths to run; transformers is the reference and always runs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--default-malloc", action="store_true",
                        help="leave glibc's malloc thresholds as they are (epd encoder sets them)")
    args = parser.parse_args(argv)
    malloc_kept = False if args.default_malloc else keep_freed_memory()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    wanted = {p.strip() for p in args.paths.split(",") if p.strip()} | {"transformers"}

    with tempfile.TemporaryDirectory(prefix="epd-bench-encoder-") as tmp:
        hf = build_checkpoint(Path(tmp), PRESETS[args.preset], args.seed)
        encoder = load_encoder(tmp)
    items = make_batch(encoder)
    tokens = sum(item.num_tokens for item in items)
    # Hugging Face's rows (each image's frame twice) for transformers and embed; the serving path takes the
    # items as the encoder's preprocessing makes them, an image's frame once (ProcessedItem.repeat).
    pixel_values = torch.cat([item.hf_pixel_values() for item in items])
    grid_thw = torch.tensor([list(item.grid_thw) for item in items])

    def transformers_rows() -> torch.Tensor:
        with torch.inference_mode():
            out = hf(pixel_values, grid_thw=grid_thw)
        return torch.cat([out.pooler_output, *out.deepstack_features], dim=-1)

    hf_eager = copy.deepcopy(hf)
    hf_eager.set_attn_implementation("eager")

    def transformers_eager_rows() -> torch.Tensor:
        with torch.inference_mode():
            out = hf_eager(pixel_values, grid_thw=grid_thw)
        return torch.cat([out.pooler_output, *out.deepstack_features], dim=-1)

    def embed_rows() -> torch.Tensor:
        return encoder.embed(pixel_values, grid_thw)

    rows_of: dict[str, Callable[[], torch.Tensor]] = {
        "transformers": transformers_rows, "transformers_eager_attention": transformers_eager_rows,
        "embed": embed_rows}
    calls: dict[str, Callable[[], Any]] = dict(rows_of)
    for name, backend in (("serving_eager", "eager"), ("serving_compiled", "compile")):
        if name in wanted:
            path = ServingPath(encoder, items, backend)
            calls[name] = path
            rows_of[name] = path.rows
    calls = {name: fn for name, fn in calls.items() if name in wanted}

    first_call_s: dict[str, float] = {}
    for name, fn in calls.items():
        began = time.perf_counter()
        fn()
        first_call_s[name] = round(time.perf_counter() - began, 3)
    reference = transformers_rows()
    diffs = {name: float((rows_of[name]() - reference).abs().max()) for name in calls if name != "transformers"}

    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(args.rounds):
        for name, fn in calls.items():
            began = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - began)
    median_ms = {name: statistics.median(samples) * 1e3 for name, samples in times.items()}
    for name in calls:
        print(f"{name:>17}: {median_ms[name]:8.2f} ms median, {tokens / median_ms[name] * 1e3:9.0f} tokens/s, "
              f"first call {first_call_s[name]} s" + (f", max diff {diffs[name]:.2e}" if name in diffs else ""),
              flush=True)

    base = median_ms["transformers"]
    summary: dict[str, object] = {
        "bench": "encoder",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "keep_freed_memory": malloc_kept,
        "preset": args.preset,
        "config": {"depth": encoder.config.depth, "hidden_size": encoder.config.hidden_size,
                   "fat_dim": encoder.fat_dim},
        "images": [list(s) for s in IMAGE_SIZES],
        "merged_tokens": tokens,
        "rounds": args.rounds,
        "median_ms": {name: round(ms, 2) for name, ms in median_ms.items()},
        "first_call_s": first_call_s,
        "max_abs_diff": diffs,
        "ratio_vs_transformers": {name: round(base / ms, 2) for name, ms in median_ms.items() if name != "transformers"},
    }
    print(json.dumps(summary))
    worst = max(diffs.values(), default=0.0)
    if worst > TOLERANCE:
        print(f"rows differ from transformers by {worst} (tolerance {TOLERANCE})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
