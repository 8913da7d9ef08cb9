"""Encoder throughput against transformers' Qwen3VLVisionModel, same weights, same batch, one run.

For each preset (by default the vision towers of Qwen3-VL-2B, -4B and -8B),
builds a Qwen3-VL vision tower in transformers from a fixed seed (every
parameter randomized), saves it as a checkpoint and loads our encoder from
that checkpoint, so both hold the very same weights. The real towers encode
4 images of 160 merged tokens each (640 in all, a prefill's worth of images
at default resolution); the ``tiny`` and ``small`` test towers a mixed batch
of 8 images (224x224 up to 800x600). Images are preprocessed by the
encoder's own preprocessing, and the batch is encoded by:

* ``transformers``: ``Qwen3VLVisionModel`` in eager mode (not compiled) with its default
  attention, SDPA, called once per frame: the reference every ratio is against;
* ``transformers_eager_attention``: the same model with ``attn_implementation="eager"``
  (matmul + softmax per frame), for comparison;
* ``embed``: our plain forward, ``VisionEncoder.embed``;
* ``serving_eager`` / ``serving_compiled``: what ``epd encoder`` runs,
  ``EncoderRunner.write`` into a cache buffer, eager and ``torch.compile``
  (default buckets; the merged tokens each path computed, padding included,
  are reported against the batch's: ``padding``);
* ``matmuls``: the tower's matrix multiplications alone (every ``nn.Linear``
  of the tower at the rows it sees in this batch, same weights, nothing
  else): a floor for any implementation in that dtype on this BLAS, so
  ``floor_ratio`` (transformers over it) bounds every path's ratio, and
  ``bound_ratio`` bounds it tighter: transformers over the matmuls plus the
  attention's multiply-adds (``4 L^2 hidden`` a frame of ``L`` patches, a
  layer) done at the matmuls' own rate, softmax free.

Every preset runs in each ``--dtype`` (float32 and bfloat16 by default). In bfloat16 both
sides hold the weights rounded to bfloat16 and compute as their code does in that dtype
(transformers' tower cast with ``.to(bfloat16)``, ours loaded with ``dtype=bfloat16``, as
``epd encoder --tower-dtype bfloat16`` loads it); every path, transformers' included, is then
checked against the float32 tower on the same rounded weights, and ours may differ from it by
at most twice what transformers' bfloat16 tower does. bfloat16 matmuls run on a CPU's AMX or
AVX-512 BF16 units where it has them; ``matmuls`` is then the floor in bfloat16.

After one untimed call each (the compiled path compiles its graphs then), the
paths run interleaved, one call each per round, so all see the same machine
load; a path's rate is merged tokens over its median call time. Every path's
rows are checked against transformers'. The last line is one JSON object with
the ratios against transformers; the exit status is 1 if any path's rows
differ by more than the tolerance.

    python bench/encoder.py                          # the Qwen3-VL 2B, 4B and 8B towers, 2 threads
    python bench/encoder.py --dtype bfloat16         # the same towers in bfloat16 only
    python bench/encoder.py --preset qwen3-vl-2b --rounds 5
    python bench/encoder.py --preset tiny --rounds 15  # the test tower
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
from epd_harness.media import image_bytes  # noqa: E402

logger = logging.getLogger(__name__)

# (width, height): from 224x224 up to 800x600, several aspect ratios.
IMAGE_SIZES = ((224, 224), (320, 240), (300, 400), (448, 448), (640, 360), (512, 512), (600, 800), (800, 600))
# 160 merged tokens each (a 32x32-pixel cell is one merged token), four aspect ratios: 640 in all.
REAL_IMAGE_SIZES = ((512, 320), (320, 512), (640, 256), (256, 640))
_QWEN3_VL_SMALL = dict(depth=24, hidden_size=1024, num_heads=16, intermediate_size=4096,
                       deepstack_visual_indexes=[5, 11, 17], num_position_embeddings=2304,
                       hidden_act="gelu_pytorch_tanh")
PRESETS: dict[str, dict[str, Any]] = {
    # The vision towers of the released Qwen3-VL checkpoints (their config.json): heads of 64 for
    # 2B and 4B (hidden 1024, 16 heads), of 72 for 8B and up (hidden 1152, 16 heads).
    "qwen3-vl-2b": dict(_QWEN3_VL_SMALL, out_hidden_size=2048),
    "qwen3-vl-4b": dict(_QWEN3_VL_SMALL, out_hidden_size=2560),
    "qwen3-vl-8b": dict(depth=27, hidden_size=1152, num_heads=16, intermediate_size=4304, out_hidden_size=4096,
                        deepstack_visual_indexes=[8, 16, 24], num_position_embeddings=2304,
                        hidden_act="gelu_pytorch_tanh"),
    # the tiny tower our tests and the demo use
    "tiny": dict(depth=3, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
                 deepstack_visual_indexes=[0, 1], num_position_embeddings=64),
    # wider, so the matmuls weigh more than the per-op overhead
    "small": dict(depth=4, hidden_size=128, num_heads=4, intermediate_size=512, out_hidden_size=256,
                  deepstack_visual_indexes=[1, 2], num_position_embeddings=256),
}
REAL_PRESETS = ("qwen3-vl-2b", "qwen3-vl-4b", "qwen3-vl-8b")
DEFAULT_PATHS = "transformers,serving_eager,serving_compiled,matmuls"
ALL_PATHS = "transformers,transformers_eager_attention,embed,serving_eager,serving_compiled,matmuls"
BLOCK_SIZE = 64
# Largest difference from transformers' rows allowed, relative to the largest of its values: float32
# sums in another order differ by a few ulp a layer, so the absolute difference grows with the
# activations' scale (random weights of std 0.2 make them large in a deep, wide tower).
TOLERANCE = 1e-5


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


def make_batch(encoder: VisionEncoder, sizes: tuple[tuple[int, int], ...]) -> list[ProcessedItem]:
    preprocessor = Preprocessor(PreprocessConfig.for_encoder(encoder))
    return [preprocessor.image(image_bytes(w, h, seed=i)) for i, (w, h) in enumerate(sizes)]


class Matmuls:
    """Every ``nn.Linear`` of the tower at the rows it sees for this batch, and nothing else."""

    def __init__(self, encoder: VisionEncoder, items: list[ProcessedItem]) -> None:
        cfg, dtype = encoder.config, encoder.dtype
        patches = sum(item.num_tokens for item in items) * cfg.merge_unit
        still = cfg.patch_dim // cfg.temporal_patch_size
        # The patch embedding as our encoder runs it on stills (one frame against the summed kernel).
        self.calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = [
            (torch.randn(patches, still, dtype=dtype), encoder.patch_embed._summed_weight(),
             encoder.patch_embed.proj.bias)]
        inputs: dict[int, torch.Tensor] = {}

        def rows(n: int, width: int) -> torch.Tensor:
            if width not in inputs or inputs[width].shape[0] != n:
                inputs[width] = torch.randn(n, width, dtype=dtype)
            return inputs[width]

        for block in encoder.blocks:
            for linear in (block.attn.qkv, block.attn.proj, block.mlp.linear_fc1, block.mlp.linear_fc2):
                self.calls.append((rows(patches, linear.in_features), linear.weight, linear.bias))
        for merger in (encoder.merger, *encoder.deepstack_merger_list):
            for linear in (merger.linear_fc1, merger.linear_fc2):
                self.calls.append((rows(patches // cfg.merge_unit, linear.in_features), linear.weight, linear.bias))

        self.flops = sum(2 * x.shape[0] * x.shape[1] * weight.shape[0] for x, weight, _ in self.calls)
        frame_patches = [item.grid_thw[1] * item.grid_thw[2] for item in items for _ in range(item.grid_thw[0])]
        self.attention_flops = cfg.depth * sum(4 * n * n * cfg.hidden_size for n in frame_patches)

    def __call__(self) -> None:
        with torch.inference_mode():
            for x, weight, bias in self.calls:
                torch.nn.functional.linear(x, weight, bias)


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


def run_preset(name: str, args: argparse.Namespace, wanted: set[str], dtype: torch.dtype) -> dict[str, Any]:
    """Every wanted path on one preset's tower in ``dtype``, interleaved; the preset's summary."""
    with tempfile.TemporaryDirectory(prefix="epd-bench-encoder-") as tmp:
        hf = build_checkpoint(Path(tmp), PRESETS[name], args.seed)
        encoder = load_encoder(tmp, dtype=dtype)
    exact: Any = None  # bfloat16: the float32 tower on the same (rounded) weights, which every path is held to
    if dtype != torch.float32:
        with torch.no_grad():
            for param in hf.parameters():
                param.copy_(param.to(dtype))
        exact, hf = hf, copy.deepcopy(hf).to(dtype)
    sizes = REAL_IMAGE_SIZES if name in REAL_PRESETS else IMAGE_SIZES
    items = make_batch(encoder, sizes)
    tokens = sum(item.num_tokens for item in items)
    # Hugging Face's rows (each image's frame twice) for transformers and embed; the serving path takes the
    # items as the encoder's preprocessing makes them, an image's frame once (ProcessedItem.repeat).
    pixel_values = torch.cat([item.hf_pixel_values() for item in items]).to(dtype)
    grid_thw = torch.tensor([list(item.grid_thw) for item in items])

    def transformers_rows(model: Any = hf) -> torch.Tensor:
        with torch.inference_mode():
            out = model(pixel_values, grid_thw=grid_thw)
        return torch.cat([out.pooler_output, *out.deepstack_features], dim=-1)

    rows_of: dict[str, Callable[[], torch.Tensor]] = {"transformers": transformers_rows}
    if "transformers_eager_attention" in wanted:
        hf_eager = copy.deepcopy(hf)
        hf_eager.set_attn_implementation("eager")
        rows_of["transformers_eager_attention"] = lambda: transformers_rows(hf_eager)
    if "embed" in wanted:
        rows_of["embed"] = lambda: encoder.embed(pixel_values, grid_thw)
    calls: dict[str, Callable[[], Any]] = dict(rows_of)
    serving: dict[str, ServingPath] = {}
    for path_name, backend in (("serving_eager", "eager"), ("serving_compiled", "compile")):
        if path_name in wanted:
            serving[path_name] = calls[path_name] = ServingPath(encoder, items, backend)
            rows_of[path_name] = serving[path_name].rows
    matmuls = Matmuls(encoder, items) if "matmuls" in wanted else None
    if matmuls is not None:
        calls["matmuls"] = matmuls

    first_call_s: dict[str, float] = {}
    for path_name, fn in calls.items():
        began = time.perf_counter()
        fn()
        first_call_s[path_name] = round(time.perf_counter() - began, 3)
    if exact is None:
        reference = transformers_rows()
        held_to = [n for n in rows_of if n != "transformers"]
    else:
        reference = transformers_rows(exact).float()
        held_to = list(rows_of)
        del exact
    scale = float(reference.abs().max())
    diffs = {n: float((rows_of[n]().float() - reference).abs().max()) / scale for n in held_to}
    for path in serving.values():  # count the timed calls only
        path.runner.real_tokens = path.runner.computed_tokens = 0

    times: dict[str, list[float]] = {path_name: [] for path_name in calls}
    for _ in range(args.rounds):
        for path_name, fn in calls.items():
            began = time.perf_counter()
            fn()
            times[path_name].append(time.perf_counter() - began)
    median_ms = {path_name: statistics.median(samples) * 1e3 for path_name, samples in times.items()}
    padding = {n: round(p.runner.computed_tokens / p.runner.real_tokens - 1, 4) for n, p in serving.items()}
    print(f"{name} ({str(dtype).removeprefix('torch.')}): {tokens} merged tokens in {len(items)} images",
          flush=True)
    for path_name in calls:
        extra = ""
        if path_name in diffs:
            extra += f", max diff {diffs[path_name]:.1e} of the largest value"
        if path_name in padding:
            extra += f", padding {padding[path_name]:.1%}"
        print(f"  {path_name:>28}: {median_ms[path_name]:9.1f} ms median, "
              f"{tokens / median_ms[path_name] * 1e3:8.0f} tokens/s, first call {first_call_s[path_name]} s{extra}",
              flush=True)
    base = median_ms["transformers"]
    floor: dict[str, float] = {}
    if matmuls is not None:
        bound_ms = median_ms["matmuls"] * (1 + matmuls.attention_flops / matmuls.flops)
        print(f"  {'matmuls + attention at their rate':>28}: {bound_ms:9.1f} ms "
              f"({matmuls.flops / median_ms['matmuls'] / 1e6:.0f} GFLOP/s)", flush=True)
        floor = {"floor_ratio": round(base / median_ms["matmuls"], 3), "bound_ratio": round(base / bound_ms, 3),
                 "matmul_gflops": round(matmuls.flops / 1e9, 1),
                 "attention_gflops": round(matmuls.attention_flops / 1e9, 1)}
    cfg = encoder.config
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "config": {"depth": cfg.depth, "hidden_size": cfg.hidden_size, "num_heads": cfg.num_heads,
                   "head_dim": cfg.head_dim, "out_hidden_size": cfg.out_hidden_size,
                   "deepstack_visual_indexes": list(cfg.deepstack_visual_indexes), "fat_dim": encoder.fat_dim},
        "images": [list(size) for size in sizes],
        "merged_tokens": tokens,
        "rounds": args.rounds,
        "median_ms": {n: round(ms, 2) for n, ms in median_ms.items()},
        "first_call_s": first_call_s,
        "max_rel_diff": diffs,
        "padding": padding,
        "ratio_vs_transformers": {n: round(base / ms, 3) for n, ms in median_ms.items()
                                  if n not in ("transformers", "matmuls")},
        **floor,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--preset", default=",".join(REAL_PRESETS),
                        help=f"towers, comma separated, of {sorted(PRESETS)}")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (one call of every path each)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--paths", default=DEFAULT_PATHS,
                        help=f"paths to run, of {ALL_PATHS}; transformers is the reference and always runs")
    parser.add_argument("--dtype", default="float32,bfloat16",
                        help="weight and activation dtypes, comma separated, of float32 and bfloat16: "
                             "every path runs in each (bfloat16: every path, transformers' too, is held to "
                             "the float32 tower on the same rounded weights)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--default-malloc", action="store_true",
                        help="leave glibc's malloc thresholds as they are (epd encoder sets them)")
    args = parser.parse_args(argv)
    presets = [p.strip() for p in args.preset.split(",") if p.strip()]
    unknown = [p for p in presets if p not in PRESETS]
    if unknown or not presets:
        parser.error(f"unknown preset(s) {unknown}; choose from {sorted(PRESETS)}")
    wanted = {p.strip() for p in args.paths.split(",") if p.strip()} | {"transformers"}
    if wanted - set(ALL_PATHS.split(",")):
        parser.error(f"unknown path(s) {sorted(wanted - set(ALL_PATHS.split(',')))}; choose from {ALL_PATHS}")
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    chosen = [d.strip() for d in args.dtype.split(",") if d.strip()]
    if not chosen or set(chosen) - set(dtypes):
        parser.error(f"--dtype {args.dtype!r}: choose from {sorted(dtypes)}")
    malloc_kept = False if args.default_malloc else keep_freed_memory()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    # "qwen3-vl-2b" is the float32 run, "qwen3-vl-2b:bfloat16" the other.
    results = {name if d == "float32" else f"{name}:{d}": run_preset(name, args, wanted, dtypes[d])
               for d in chosen for name in presets}
    print(json.dumps({"bench": "encoder", "torch": torch.__version__, "threads": torch.get_num_threads(),
                      "keep_freed_memory": malloc_kept, "presets": results}))
    failed = False
    for key, result in results.items():
        diffs = dict(result["max_rel_diff"])
        # float32: every path within TOLERANCE of transformers. bfloat16: within twice transformers'
        # own bfloat16 error against the float32 tower (and at least TOLERANCE).
        limit = TOLERANCE if result["dtype"] == "float32" else max(TOLERANCE, 2 * diffs.pop("transformers"))
        worst = max(diffs.values(), default=0.0)
        if worst > limit:
            print(f"{key}: rows differ from the reference by {worst:.2e} of the largest value (limit {limit:.2e})",
                  file=sys.stderr)
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
