"""The vision tower's 2-D rotary position embedding: angles per patch, and q and k rotated by them (encoder process).

A quarter of each head's dimensions rotates by the patch's row, a quarter by its column
(then doubled for rotate-half). The angles are computed once per launch
(:func:`rotary_cos_sin`, one opaque op in a compiled graph) and every layer rotates by them
(:func:`rotate_qk`: the native kernel's one pass in eager bfloat16 on a CPU).
"""

from __future__ import annotations

import torch
from torch import nn

from encoder_server.vision import native
from encoder_server.vision.config import VisionConfig


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rotate the two halves of ``x``'s last dim by the angles whose ``cos, sin`` are given (half width).

    The reference's ``x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)``, in float32
    whatever the weights' dtype, as the reference model does.
    """
    if x.dtype == torch.float32 or torch.compiler.is_compiling() or x.requires_grad:
        first, second = x.float().chunk(2, dim=-1)
        return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1).to(dtype)
    # Eager, narrower than float32: the same products and sums, each written once into one float32
    # tensor (the mixed-dtype ops widen x as they read it), with no widened copy of x and no cat.
    first, second = x.chunk(2, dim=-1)
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    low, high = out.chunk(2, dim=-1)
    torch.mul(first, cos, out=low)
    low.sub_(second * sin)
    torch.mul(second, cos, out=high)
    high.add_(first * sin)
    return out.to(dtype)


def rotate_qk(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """:func:`rotate` of ``qk [rows, 2, heads, dim]`` by ``cos, sin [rows, dim/2]``, shared by q and k.

    Eager bfloat16 on a CPU: the native kernel's one pass (same float32 math, rounded once).
    """
    kernel = native.bf16_kernel_for(qk) if dtype == torch.bfloat16 else None
    if kernel is not None:
        out: torch.Tensor = kernel.rotary_bf16(qk, cos, sin)
        return out
    return rotate(qk, cos[:, None, None], sin[:, None, None], dtype)


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
        """``positions [..., 2]`` (row, col) -> ``cos, sin [..., head_dim / 2]`` float32.

        Each half of a head rotates by the same angles (see :func:`rotate`), so one half's are returned.
        """
        return _rotary_cos_sin(positions, self.inv_freq)


def _rotary_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq  # [..., 2, head_dim/4]
    angles = freqs.flatten(-2)  # row frequencies, then column frequencies
    return angles.cos(), angles.sin()


@torch.library.custom_op("epd::rotary_cos_sin", mutates_args=())
def rotary_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`RotaryEmbedding.forward` as one opaque step of a compiled graph, computed once per launch.

    Left to itself, Inductor inlines the angles' ``cos`` and ``sin`` into every
    layer's rotary kernel, where they run scalar (a half head is too narrow for
    its vector loop): 0.9 ms a layer for 8,192 rows on the development host, to
    apply what costs tens of microseconds to compute once.
    """
    cos, sin = _rotary_cos_sin(positions, inv_freq)
    return cos.contiguous(), sin.contiguous()


@rotary_cos_sin.register_fake
def _rotary_cos_sin_shape(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (*positions.shape[:-1], positions.shape[-1] * inv_freq.shape[0])
    return positions.new_empty(shape, dtype=torch.float32), positions.new_empty(shape, dtype=torch.float32)
