"""Step 4, towers: Qwen3-VL towers on the device vs transformers' (device check step process a preset; driver launches).

Random weights at real dimensions, in bfloat16: the serving path, eager and compiled, against
transformers' tower on the same weights; tokens/s, and each path's largest difference from the
float32 tower on the same (rounded) weights (``bench/encoder.py``'s rule: ours within twice
transformers' own bfloat16 error). The driver gives each preset its share of the step's budget.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from bench import encoder as tower_bench
from bench.device.report import Partial
from bench.device.shapes import TOWER_DTYPE, Shapes, sync
from encoder_server.vision import load_encoder

if TYPE_CHECKING:
    from bench.device.driver import Run


class DeviceServingPath(tower_bench.ServingPath):
    """bench/encoder.py's serving path with its cache buffer on the encoder's device."""

    def __init__(self, encoder: Any, items: list[Any], backend: str) -> None:  # noqa: D107
        super().__init__(encoder, items, backend)
        self.buffer = self.buffer.to(encoder.device)


def hf_rows(output: Any) -> torch.Tensor:
    """Transformers' tower output as cache rows: merged tokens, then the deepstack levels."""
    if isinstance(output, tuple):
        merged, deepstack = output[0], output[1]
    else:
        merged, deepstack = output.pooler_output, output.deepstack_features
    return torch.cat([merged, *deepstack], dim=-1)


def role_tower(p: Partial, shapes: Shapes, args: argparse.Namespace) -> None:
    device = torch.device(shapes.device)
    name = args.preset
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference in float32, convolution included
    torch.backends.cudnn.allow_tf32 = False
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="epd-device-check-tower-") as tmp:
        hf = tower_bench.build_checkpoint(Path(tmp), tower_bench.PRESETS[name], seed=0)
        encoder = load_encoder(tmp, device=device, dtype=TOWER_DTYPE)
    with torch.no_grad():  # both sides hold the weights rounded to bfloat16 (as bench/encoder.py)
        for param in hf.parameters():
            param.copy_(param.to(TOWER_DTYPE))
    exact = hf.to(device)
    hf16 = copy.deepcopy(exact).to(TOWER_DTYPE)
    sizes = shapes.tower_images or (tower_bench.REAL_IMAGE_SIZES if name in tower_bench.REAL_PRESETS
                                    else tower_bench.IMAGE_SIZES)
    items = tower_bench.make_batch(encoder, sizes)
    tokens = sum(item.num_tokens for item in items)
    pixels = torch.cat([item.hf_pixel_values() for item in items]).to(device)
    grid = torch.tensor([list(item.grid_thw) for item in items], device=device)
    cfg = encoder.config
    p.data.update(preset=name, dtype="bfloat16", device=str(device), images=[list(s) for s in sizes],
                  merged_tokens=tokens, setup_s=round(time.monotonic() - started, 1),
                  config={"depth": cfg.depth, "hidden_size": cfg.hidden_size, "num_heads": cfg.num_heads,
                          "out_hidden_size": cfg.out_hidden_size, "fat_dim": encoder.fat_dim},
                  first_call_s={}, max_rel_diff={})
    p.save()

    def transformers(model: Any = hf16, dtype: torch.dtype = TOWER_DTYPE) -> torch.Tensor:
        with torch.inference_mode():
            return hf_rows(model(pixels.to(dtype), grid_thw=grid))

    serving = {"serving_eager": DeviceServingPath(encoder, items, "eager"),
               "serving_compiled": DeviceServingPath(encoder, items, "compile")}
    calls: dict[str, Callable[[], Any]] = {"transformers": transformers, **serving}
    rows_of: dict[str, Callable[[], torch.Tensor]] = {"transformers": transformers,
                                                      **{k: v.rows for k, v in serving.items()}}
    reference = transformers(exact, torch.float32).float()
    scale = float(reference.abs().max())
    del exact
    diffs = p.data["max_rel_diff"]
    limit = max(tower_bench.TOLERANCE, 2 * diffs.setdefault("transformers", float(
        (transformers().float() - reference).abs().max()) / scale))
    p.data["limit"] = limit

    def measure(paths: list[str]) -> None:
        """First call of each new path (the compiled one compiles here), then interleaved timed rounds."""
        for path in paths:
            if path in p.data["first_call_s"]:
                continue
            began = time.perf_counter()
            calls[path]()
            sync(device)
            p.data["first_call_s"][path] = round(time.perf_counter() - began, 2)
            diffs[path] = float((rows_of[path]().float() - reference).abs().max()) / scale
            p.save()
        times: dict[str, list[float]] = {path: [] for path in paths}
        for _ in range(shapes.tower_rounds):
            for path in paths:
                sync(device)
                began = time.perf_counter()
                calls[path]()
                sync(device)
                times[path].append(time.perf_counter() - began)
        median_ms = {path: statistics.median(samples) * 1e3 for path, samples in times.items()}
        base = median_ms["transformers"]
        p.data.update(
            rounds=shapes.tower_rounds, median_ms={k: round(v, 3) for k, v in median_ms.items()},
            tokens_per_s={k: round(tokens / v * 1e3) for k, v in median_ms.items()},
            ratio_vs_transformers={k: round(base / v, 3) for k, v in median_ms.items() if k != "transformers"},
            padding={k: round(serving[k].runner.computed_tokens / serving[k].runner.real_tokens - 1, 4)
                     for k in paths if k in serving})
        p.save()

    # Eager first: a compile that runs past the budget still leaves the eager numbers.
    measure(["transformers", "serving_eager"])
    measure(["transformers", "serving_eager", "serving_compiled"])
    p.data["ok"] = all(diffs[k] <= limit for k in serving) and all(v > 0 for v in p.data["median_ms"].values())


def run_towers(run: Run, budget: float) -> dict[str, Any]:
    """The step: one process a preset, each within its share of ``budget``; the first failure is the step's error."""
    presets: dict[str, Any] = {}
    data: dict[str, Any] = {"ok": False, "presets": presets}
    total_end = time.monotonic() + budget
    names = run.shapes.tower_presets
    for i, name in enumerate(names):
        left = total_end - time.monotonic()
        later = run.shapes.reserve["towers"] / len(names) * (len(names) - i - 1)
        share = min(run.shapes.budgets["towers"], left - later) if i < len(names) - 1 else left
        if share < 5:
            presets[name] = {"ok": False, "skipped": "no time left in the run's budget"}
            continue
        presets[name] = run.child("tower", share, "--preset", name, log=f"tower-{name}.log")
        run.report["steps"]["towers"] = data
        run.save()
    data["ok"] = all(r.get("ok") for r in presets.values())
    failed = [(name, r) for name, r in presets.items() if not r.get("ok")]
    if failed:
        name, r = failed[0]
        error = r.get("error") or {"type": "Failed", "message": r.get("skipped") or "rows outside the limit"}
        data["error"] = {**error, "message": f"{name}: {error.get('message', '')}"}
    return data
