"""Per-frame position tables for the vision tower, computed on the host (encoder process).

Two things depend only on a frame's patch grid ``(h, w)``, never on pixels:
the bilinear taps that resample the learned square position table to the grid,
and the ``(row, col)`` coordinates the 2-D rotary embedding rotates by. Both
are produced here, in the order ``pixel_values`` rows come in (merge blocks of
``merge x merge`` patches, blocks in raster order), and cached per grid. They
are the "packing metadata" the static graph takes as plain inputs, so the
graph itself has no data-dependent shapes.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=256)
def frame_positions(height: int, width: int, merge: int) -> torch.Tensor:
    """``[h*w, 2]`` int64 ``(row, col)`` of each patch, in merge-block order.

    The returned tensor is shared by the cache: treat it as read-only.
    """
    if height % merge or width % merge:
        raise ValueError(f"patch grid {height}x{width} is not a multiple of merge size {merge}")
    rows = torch.arange(height).view(height // merge, merge, 1, 1).expand(-1, -1, width // merge, merge)
    cols = torch.arange(width).view(1, 1, width // merge, merge).expand(height // merge, merge, -1, -1)
    # (block_row, in_row, block_col, in_col) -> (block_row, block_col, in_row, in_col)
    rows = rows.permute(0, 2, 1, 3).reshape(-1)
    cols = cols.permute(0, 2, 1, 3).reshape(-1)
    return torch.stack([rows, cols], dim=-1)


def _axis_taps(coord: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Bilinear (align-corners) source taps on one axis: floor, floor+1, fraction."""
    scale = (side - 1) / max(size - 1, 1)
    src = coord.to(torch.float32) * scale
    low = src.floor()
    frac = src - low
    lo = low.to(torch.int64).clamp(0, side - 1)
    hi = (lo + 1).clamp(max=side - 1)
    return lo, hi, frac


@functools.lru_cache(maxsize=256)
def frame_interpolation(height: int, width: int, merge: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices ``[h*w, 4]`` into the flattened ``side x side`` position table and
    their bilinear weights ``[h*w, 4]`` (float32), in merge-block order.

    Equivalent to resizing the table to ``h x w`` with
    ``F.interpolate(mode="bilinear", align_corners=True)``, as Qwen3-VL does.
    The returned tensors are shared by the cache: treat them as read-only.
    """
    pos = frame_positions(height, width, merge)
    r_lo, r_hi, r_frac = _axis_taps(pos[:, 0], height, side)
    c_lo, c_hi, c_frac = _axis_taps(pos[:, 1], width, side)
    indices = torch.stack(
        [r_lo * side + c_lo, r_lo * side + c_hi, r_hi * side + c_lo, r_hi * side + c_hi], dim=-1
    )
    weights = torch.stack(
        [(1 - r_frac) * (1 - c_frac), (1 - r_frac) * c_frac, r_frac * (1 - c_frac), r_frac * c_frac], dim=-1
    )
    return indices, weights


def frame_tables(
    frames: Sequence[tuple[int, int]], merge: int, side: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Interpolation indices, weights and positions of frames ``(h, w)`` lying back to back.

    ``[rows, 4]`` int64, ``[rows, 4]`` float32 and ``[rows, 2]`` int64, ``rows = sum(h * w)``.
    """
    taps = [frame_interpolation(h, w, merge, side) for h, w in frames]
    return (torch.cat([index for index, _ in taps]), torch.cat([weight for _, weight in taps]),
            torch.cat([frame_positions(h, w, merge) for h, w in frames]))
