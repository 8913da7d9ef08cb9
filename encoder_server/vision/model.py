"""Qwen3-VL-compatible vision tower (encoder process).

Conv3d patch embedding, a learned position table resampled to each frame's
grid, 2-D rotary attention, pre-norm transformer blocks, the 2x2 patch merger
and the deepstack mergers. Module and parameter names are the Hugging Face
ones, so a checkpoint's ``model.visual.*`` tensors load by name.

The tower is written over *attention blocks*: ``forward_blocks`` takes
``[n, L, ...]`` tensors where each of the ``n`` blocks attends only within
itself, optionally restricted further by a boolean mask (segments of packed
frames). Every frame is independent through the whole tower (attention is
per frame, the mergers act on ``merge x merge`` neighbours of one frame), so:

* :meth:`VisionEncoder.embed` runs frames of equal size as blocks with no mask;
* the cached static-shape path packs frames of many items into fixed-size
  blocks and masks attention per frame (see :mod:`.runner`).

An output row is ``concat(main merger, deepstack_1 .. deepstack_k)`` with the
deepstack levels in layer order: ``fat_dim = out_hidden_size * (1 + k)``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from encoder_server.vision.config import VisionConfig
from encoder_server.vision.positions import frame_interpolation, frame_positions

logger = logging.getLogger(__name__)


def _activation(name: str) -> nn.Module:
    if name == "gelu_pytorch_tanh":
        return nn.GELU(approximate="tanh")
    if name == "gelu":
        return nn.GELU()
    if name == "silu":
        return nn.SiLU()
    return nn.ReLU()


class PatchEmbed(nn.Module):
    """Conv3d with stride = kernel = (temporal, patch, patch) over one patch per row."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel_size=kernel, stride=kernel, bias=True)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        # A stride-equals-kernel convolution over exactly one window is a matmul;
        # the matmul form keeps the static graph free of conv lowering.
        weight = self.proj.weight.reshape(self.proj.out_channels, -1)
        return F.linear(patches.to(weight.dtype), weight, self.proj.bias)


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=True)
        self.act_fn = _activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear_fc2(self.act_fn(self.linear_fc1(x)))
        return out


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.qkv = nn.Linear(config.hidden_size, config.hidden_size * 3, bias=True)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size, bias=True)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        blocks, length, hidden = x.shape
        qkv = self.qkv(x).view(blocks, length, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # [blocks, heads, length, head_dim]
        # Rotary in float32 whatever the weights' dtype, as the reference model does.
        cos_h, sin_h = cos.unsqueeze(1), sin.unsqueeze(1)
        qf, kf = q.float(), k.float()
        q = (qf * cos_h + _rotate_half(qf) * sin_h).to(v.dtype)
        k = (kf * cos_h + _rotate_half(kf) * sin_h).to(v.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        projected: torch.Tensor = self.proj(out.transpose(1, 2).reshape(blocks, length, hidden))
        return projected


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attn = VisionAttention(config)
        self.mlp = VisionMLP(config)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, mask)
        out: torch.Tensor = x + self.mlp(self.norm2(x))
        return out


class PatchMerger(nn.Module):
    """``merge x merge`` neighbouring patches -> one token of ``out_hidden_size``.

    The main merger normalizes each patch before concatenating (pre-shuffle);
    the deepstack mergers normalize the concatenation (post-shuffle).
    """

    def __init__(self, config: VisionConfig, *, postshuffle_norm: bool) -> None:
        super().__init__()
        self.merged_size = config.hidden_size * config.merge_unit
        self.postshuffle_norm = postshuffle_norm
        norm_size = self.merged_size if postshuffle_norm else config.hidden_size
        self.norm = nn.LayerNorm(norm_size, eps=config.layer_norm_eps)
        self.linear_fc1 = nn.Linear(self.merged_size, self.merged_size)
        self.act_fn = nn.GELU()
        self.linear_fc2 = nn.Linear(self.merged_size, config.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.postshuffle_norm:
            merged = self.norm(x.reshape(-1, self.merged_size))
        else:
            merged = self.norm(x).reshape(-1, self.merged_size)
        out: torch.Tensor = self.linear_fc2(self.act_fn(self.linear_fc1(merged)))
        return out


class RotaryEmbedding(nn.Module):
    """Axial 2-D rotary: a quarter of the head dim rotates by row, a quarter by column."""

    inv_freq: torch.Tensor

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        axis_dim = config.head_dim // 2
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, axis_dim, 2, dtype=torch.float32) / axis_dim))
        # Not a checkpoint tensor: derived from the config, like the HF model's.
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [..., 2]`` (row, col) -> ``cos, sin [..., head_dim]`` float32."""
        freqs = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq  # [..., 2, head_dim/4]
        angles = freqs.flatten(-2)  # row frequencies, then column frequencies
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()


class VisionEncoder(nn.Module):
    """The vision tower; see the module docstring for the block convention."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.fat_dim = config.fat_dim
        self.patch_embed = PatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.rotary_pos_emb = RotaryEmbedding(config)
        self.blocks = nn.ModuleList([VisionBlock(config) for _ in range(config.depth)])
        self.merger = PatchMerger(config, postshuffle_norm=False)
        self.deepstack_merger_list = nn.ModuleList(
            [PatchMerger(config, postshuffle_norm=True) for _ in config.deepstack_visual_indexes]
        )
        self._deepstack_slot = {layer: slot for slot, layer in enumerate(config.deepstack_visual_indexes)}

    @property
    def device(self) -> torch.device:
        return self.pos_embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.pos_embed.weight.dtype

    def forward_blocks(
        self,
        pixels: torch.Tensor,
        interp_index: torch.Tensor,
        interp_weight: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """Encode ``n`` attention blocks of ``L`` patches each.

        pixels ``[n, L, patch_dim]``; interp_index ``[n, L, 4]`` int64 and
        interp_weight ``[n, L, 4]`` (see :func:`.positions.frame_interpolation`);
        positions ``[n, L, 2]`` (row, col); mask ``[n, 1, L, L]`` bool or None.
        Returns ``[n * L / merge**2, fat_dim]``; ``L`` is a multiple of merge**2 and
        every frame starts at a multiple of it.
        """
        x = self.patch_embed(pixels)
        table = self.pos_embed(interp_index)  # [n, L, 4, hidden]
        x = x + (table * interp_weight.unsqueeze(-1)).sum(dim=-2).to(x.dtype)
        cos, sin = self.rotary_pos_emb(positions)
        # Blocks run in layer order, so the deepstack features come out in layer
        # order too (the order the language model adds them in).
        deepstack: list[torch.Tensor] = []
        for layer, block in enumerate(self.blocks):
            x = block(x, cos, sin, mask)
            slot = self._deepstack_slot.get(layer)
            if slot is not None:
                deepstack.append(self.deepstack_merger_list[slot](x))
        return torch.cat([self.merger(x), *deepstack], dim=-1)

    @torch.inference_mode()
    def embed(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> torch.Tensor:
        """Plain forward in the Hugging Face convention: ``[sum t*h*w / merge**2, fat_dim]``."""
        grids = _grid_list(grid_thw)
        cfg = self.config
        merge, unit = cfg.spatial_merge_size, cfg.merge_unit
        total = sum(t * h * w for t, h, w in grids)
        if pixel_values.dim() != 2 or pixel_values.shape != (total, cfg.patch_dim):
            raise ValueError(
                f"pixel_values shape {tuple(pixel_values.shape)} does not match grid_thw {grids}: "
                f"expected ({total}, {cfg.patch_dim})"
            )
        out = torch.empty(total // unit, self.fat_dim, dtype=self.dtype, device=self.device)
        # Frames of the same grid run together as blocks; no mask: a block is one frame.
        starts_by_shape: dict[tuple[int, int], list[int]] = {}
        offset = 0
        for t, h, w in grids:
            if h % merge or w % merge:
                raise ValueError(f"grid {(t, h, w)} is not a multiple of merge size {merge}")
            for _ in range(t):
                starts_by_shape.setdefault((h, w), []).append(offset)
                offset += h * w
        pixels = pixel_values.to(self.device)
        for (h, w), starts in starts_by_shape.items():
            frame = h * w
            rows = torch.cat([torch.arange(s, s + frame) for s in starts]).to(self.device)
            index, weight = frame_interpolation(h, w, merge, cfg.num_grid_per_side)
            n = len(starts)
            result = self.forward_blocks(
                pixels.index_select(0, rows).view(n, frame, -1),
                index.to(self.device).expand(n, -1, -1),
                weight.to(self.device).expand(n, -1, -1),
                frame_positions(h, w, merge).to(self.device).expand(n, -1, -1),
                None,
            )
            dest = torch.cat([torch.arange(s // unit, (s + frame) // unit) for s in starts]).to(self.device)
            out.index_copy_(0, dest, result.to(out.dtype))
        return out


def _grid_list(grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> list[tuple[int, int, int]]:
    rows = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else [list(g) for g in grid_thw]
    grids: list[tuple[int, int, int]] = []
    for row in rows:
        if len(row) != 3 or any(int(v) <= 0 for v in row):
            raise ValueError(f"grid_thw rows must be three positive ints, got {row!r}")
        grids.append((int(row[0]), int(row[1]), int(row[2])))
    return grids
