"""What each mode of the device check runs: shapes, budgets, names (device check driver and step processes)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from bench import encoder as tower_bench

ROOT = Path(__file__).resolve().parents[2]
# The script every process of the check runs: the driver, and each step with ``--role``.
ENTRY = ROOT / "bench" / "device_check.py"
MODEL_ID = "device-check"
STEPS = ("encoder", "pulls", "throughput", "towers", "merge")
TOWER_DTYPE = torch.bfloat16


@dataclasses.dataclass(frozen=True)
class Shapes:
    """What one mode runs: the GPU's real shapes, or tiny ones for the CPU."""

    device: str
    encoder_preset: str  # tower the encoder serves (bench/encoder.py PRESETS), random weights
    images: tuple[tuple[int, int], ...]  # pulled items: images (w, h) ...
    video: tuple[int, int, int]  # ... and one video (w, h, frames)
    cache_blocks: int
    landing_blocks: int
    block_sizes: tuple[int, ...]  # throughput: bytes per block
    batches: tuple[int, ...]  # throughput: blocks per pull
    row_bytes: int
    repeats: int
    min_seconds: float
    tower_presets: tuple[str, ...]
    tower_images: tuple[tuple[int, int], ...] | None  # None: bench/encoder.py's batch for the preset
    tower_rounds: int
    merge_args: tuple[str, ...]  # bench/merge.py arguments besides --device
    budgets: dict[str, float]  # seconds per step at most (towers: per preset)
    reserve: dict[str, float]  # seconds kept for each step while earlier ones run


GPU = Shapes(
    # The video (8 temporal patches of 196 merged tokens) keeps the GPU busy for milliseconds after
    # the encoder's write is launched: long enough for a pull that does not wait for it to see it.
    device="cuda", encoder_preset="qwen3-vl-2b",
    images=(*tower_bench.REAL_IMAGE_SIZES, (448, 448)), video=(448, 448, 16),
    cache_blocks=96, landing_blocks=64,
    block_sizes=(64 << 10, 256 << 10, 1 << 20, 4 << 20), batches=(1, 4, 8, 16, 32), row_bytes=4096,
    repeats=10, min_seconds=0.25,
    tower_presets=("qwen3-vl-2b", "qwen3-vl-8b"), tower_images=None, tower_rounds=10,
    merge_args=("--repeats", "20"),
    budgets={"encoder": 90, "pulls": 60, "throughput": 75, "towers": 130, "merge": 45},
    reserve={"encoder": 30, "pulls": 20, "throughput": 20, "towers": 60, "merge": 20},
)
CPU = Shapes(
    device="cpu", encoder_preset="tiny",
    images=((64, 64), (200, 120)), video=(64, 96, 2),
    cache_blocks=32, landing_blocks=16,
    block_sizes=(64 << 10,), batches=(1, 4), row_bytes=4096,
    repeats=3, min_seconds=0.0,
    tower_presets=("tiny",), tower_images=((224, 224), (320, 240)), tower_rounds=2,
    merge_args=("--items", "2", "--tokens-per-item", "16", "--dim", "64", "--text-tokens", "16",
                "--buffer-blocks", "4", "--repeats", "3", "--warmup", "1"),
    budgets={"encoder": 90, "pulls": 60, "throughput": 60, "towers": 120, "merge": 90},
    reserve={"encoder": 10, "pulls": 10, "throughput": 10, "towers": 20, "merge": 10},
)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
