"""Qwen3-VL-compatible vision tower (encoder process).

Conv3d patch embedding, a learned position table resampled to each frame's
grid, 2-D rotary attention, pre-norm transformer blocks, the 2x2 patch merger
and the deepstack mergers. Module and parameter names are the Hugging Face
ones, so a checkpoint's ``model.visual.*`` tensors load by name.

Every frame (one temporal patch of an item) is independent through the whole
tower: attention is per frame, the mergers act on ``merge x merge``
neighbours of one frame. Two ways to run many frames at once:

* :meth:`VisionEncoder.forward_frames` (the fast path: :meth:`embed`, and the
  eager and compiled serving graphs): frames lie back to back in one flat
  sequence of patches and each attends to itself only (:func:`frame_attention`:
  a native kernel on AVX2 and AVX-512 CPUs, else one unmasked SDPA call per
  run of equal-length frames). Attention costs the sum of each frame's
  square, and every other layer runs on rows, so the rows of a batch pay for
  nothing but themselves (and the bucket's tail padding).
* :meth:`VisionEncoder.forward_blocks` (the Neuron graph, where every shape
  must be static): ``[n, L]`` attention blocks with a boolean mask per frame.

An output row is ``concat(main merger, deepstack_1 .. deepstack_k)`` with the
deepstack levels in layer order: ``fat_dim = out_hidden_size * (1 + k)``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from encoder_server.vision import native
from encoder_server.vision.config import VisionConfig
from encoder_server.vision.positions import frame_tables
from encoder_server.vision.rotary import RotaryEmbedding, rotary_cos_sin, rotate, rotate_qk

logger = logging.getLogger(__name__)


class TanhGELU(nn.Module):
    """GELU, tanh approximation (``gelu_pytorch_tanh``).

    The same function as ``x * sigmoid(2u)`` with ``u = sqrt(2/pi) (x + 0.044715 x^3)``
    (``0.5 (1 + tanh u) = sigmoid(2u)``), in the form each path runs fastest: in a compiled
    graph as that expression (Inductor's CPU code vectorizes ``exp`` far better than ``tanh``:
    0.24 against 0.57 ms for ``[8192, 64]`` on the development host); eager in float32 on a
    CPU with the native kernel, its ``gelu_tanh`` (0.17 against torch's 1.14 ms on an AVX2
    host); elsewhere torch's fused kernel. They agree to a few ulp.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return x * torch.sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x))
        kernel = native.elementwise_kernel_for(x)
        if kernel is not None:
            out: torch.Tensor = kernel.gelu_tanh(x)
            return out
        return F.gelu(x, approximate="tanh")


def _activation(name: str) -> nn.Module:
    if name == "gelu_pytorch_tanh":
        return TanhGELU()
    if name == "gelu":
        return nn.GELU()
    if name == "silu":
        return nn.SiLU()
    return nn.ReLU()


_ONEDNN: bool = (bool(torch.backends.mkldnn.is_available())  # type: ignore[no-untyped-call]
                 and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
# oneDNN's bfloat16 linear needs AVX-512 (or AMX); on an AVX2-only CPU it cannot build the
# primitive at all, and the tower takes PyTorch's own bfloat16 matmul.
_ONEDNN_BF16: bool = _ONEDNN and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _onednn_linear_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Eager float32 inference on a CPU with oneDNN: the patch embedding may take its matmul."""
    return (_ONEDNN and x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and x.dim() == 2 and not torch.is_grad_enabled() and not torch.compiler.is_compiling())


def _onednn_bf16_linear_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Eager bfloat16 inference on a CPU with oneDNN: a linear may take its activation as a post-op."""
    return (_ONEDNN_BF16 and x.device.type == "cpu" and x.dtype == torch.bfloat16
            and weight.dtype == torch.bfloat16 and not torch.is_grad_enabled())


@torch.library.custom_op("epd::linear_gelu_tanh", mutates_args=())
def linear_gelu_tanh(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(x @ weight.T + bias)`` in one oneDNN call (CPU, bfloat16), the GELU on the float32 accumulator.

    A custom op so that a compiled graph calls it as one opaque step too (Inductor's own
    lowering of the fused linear refuses the tanh GELU).
    """
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "gelu", [], "tanh")
    return out


@linear_gelu_tanh.register_fake
def _linear_gelu_tanh_shape(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


class PatchEmbed(nn.Module):
    """Conv3d with stride = kernel = (temporal, patch, patch) over one patch per row."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel_size=kernel, stride=kernel, bias=True)
        # The kernel summed over time (stills' rows), with the weight's identity and version it was summed from.
        self._summed: tuple[tuple[int, int, torch.dtype, torch.device], torch.Tensor] | None = None

    def forward(self, patches: torch.Tensor, repeat: int = 1) -> torch.Tensor:
        """``[rows, patch_dim]`` patches -> ``[rows, hidden]``.

        ``repeat`` T: rows of one frame, ``[rows, patch_dim / T]``. A still's temporal patch
        is its frame T times, so its convolution is the frame's against the kernel summed
        over time: a T-th of the bytes and the work.
        """
        # A stride-equals-kernel convolution over exactly one window is a matmul;
        # the matmul form keeps the static graph free of conv lowering.
        out_channels, temporal = self.proj.weight.shape[0], self.proj.weight.shape[2]
        if repeat == 1:
            weight = self.proj.weight.reshape(out_channels, -1)
        elif repeat == temporal:
            weight = self._summed_weight()
        else:
            raise ValueError(f"repeat {repeat}: rows stand for 1 or {temporal} (the temporal patch) copies of a frame")
        if patches.shape[-1] != weight.shape[1]:
            raise ValueError(f"patches shape {tuple(patches.shape)}: expected (..., {weight.shape[1]}) "
                             f"for repeat {repeat}")
        x = patches.to(weight.dtype)
        if _onednn_linear_applies(x, weight):
            # Tall and narrow (patch_dim 1536 in, hidden_size out): oneDNN's matmul ran it
            # 1.6-1.8x faster than the default BLAS on the development host, same float32 math.
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, weight, self.proj.bias, "none", [], "")
            return out
        return F.linear(x, weight, self.proj.bias)

    def _summed_weight(self) -> torch.Tensor:
        """``[out, C*P*P]``: the kernel summed over time, summed again only when the weight changes.

        Every call on stills needs it, and for a full-size tower it is megabytes to read.
        """
        weight = self.proj.weight
        key = (weight.data_ptr(), weight._version, weight.dtype, weight.device)
        if self._summed is None or self._summed[0] != key:
            self._summed = (key, weight.detach().sum(dim=2).reshape(weight.shape[0], -1))
        return self._summed[1]


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=True)
        self.act_fn = _activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.act_fn, TanhGELU) and _onednn_bf16_linear_applies(x, self.linear_fc1.weight):
            # oneDNN applies the GELU to the float32 accumulator before rounding to bfloat16: one
            # pass instead of two over [rows, intermediate] (14.9 against 31.4 ms for 2,560 x 1,024
            # -> 4,096 on an AMX host, the GELU alone 20), and rounded once, not twice.
            hidden: torch.Tensor = linear_gelu_tanh(x, self.linear_fc1.weight, self.linear_fc1.bias)
        else:
            hidden = self.act_fn(self.linear_fc1(x))
        out: torch.Tensor = self.linear_fc2(hidden)
        return out


def frame_runs(frame_lengths: list[int]) -> list[tuple[int, int, int]]:
    """``(first row, frames, rows per frame)`` of each run of equal, consecutive frame lengths.

    A length of 0 ends the list (the rest of the sequence is padding).
    """
    runs: list[tuple[int, int, int]] = []
    start = 0
    for length in frame_lengths:
        if length <= 0:
            break
        if runs and runs[-1][2] == length:
            first, count, _ = runs[-1]
            runs[-1] = (first, count + 1, length)
        else:
            runs.append((start, 1, length))
        start += length
    return runs


@torch.library.custom_op("epd::frame_attention", mutates_args=())
def frame_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, frame_lengths: torch.Tensor) -> torch.Tensor:
    """Attention of each frame to itself over a flat sequence: ``q, k, v [rows, heads, head_dim]``.

    ``frame_lengths`` (int64, on the host) lists the frames' row counts in
    order, from row 0, padded with zeros to a static length; rows after the
    last frame are padding and come out as zeros. No work crosses frames. On
    an x86-64 CPU with AVX2 (or AVX-512), in float32, the native kernel
    computes it (:mod:`.native`), elsewhere :func:`sdpa_frame_attention`. A
    custom op: compiled graphs keep static shapes and call it as one opaque
    step, whatever the frames in a launch.
    """
    kernel = native.kernel_for(q)
    if kernel is not None:
        out: torch.Tensor = kernel.frame_attention(q, k, v, frame_lengths)
        return out
    return sdpa_frame_attention(q, k, v, frame_lengths)


def sdpa_frame_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         frame_lengths: torch.Tensor) -> torch.Tensor:
    """:func:`frame_attention` with torch's SDPA: one unmasked call per run of equal-length frames.

    Every frame gets the backend's fast kernel (flash attention on CUDA and CPU).
    """
    total, heads, head_dim = q.shape
    parts: list[torch.Tensor] = []
    end = 0
    for first, count, length in frame_runs(frame_lengths.tolist()):
        end = first + count * length
        # [count*length, heads, dim] -> [count, heads, length, dim]; SDPA takes the strides as they
        # are and lays its output out as [count, length, heads, dim], so the way back is a view.
        qs, ks, vs = (t[first:end].view(count, length, heads, head_dim).transpose(1, 2) for t in (q, k, v))
        parts.append(F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2).reshape(-1, heads, head_dim))
    if end < total:
        parts.append(q.new_zeros(total - end, heads, head_dim))
    if len(parts) == 1:
        return parts[0]
    return torch.cat(parts)


@frame_attention.register_fake
def _frame_attention_shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           frame_lengths: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(q)


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.qkv = nn.Linear(config.hidden_size, config.hidden_size * 3, bias=True)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frames: torch.Tensor) -> torch.Tensor:
        """Flat ``x [rows, hidden]``, ``cos, sin [rows, head_dim]``; ``frames``: see :func:`frame_attention`."""
        rows, hidden = x.shape
        qkv = self.qkv(x).view(rows, 3, self.num_heads, self.head_dim)
        v = qkv[:, 2]
        # q and k rotate together: [rows, 2, heads, dim] against [rows, 1, 1, dim/2]
        q, k = rotate_qk(qkv[:, :2], cos, sin, v.dtype).unbind(1)
        out = frame_attention(q, k, v, frames)
        projected: torch.Tensor = self.proj(out.reshape(rows, hidden))
        return projected

    def forward_masked(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Blocks ``x [n, L, hidden]``, ``cos, sin [n, L, head_dim]``, ``mask [n, 1, L, L]`` bool."""
        blocks, length, hidden = x.shape
        qkv = self.qkv(x).view(blocks, length, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # [blocks, heads, length, head_dim]
        cos_h, sin_h = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = rotate(q, cos_h, sin_h, v.dtype), rotate(k, cos_h, sin_h, v.dtype)
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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frames: torch.Tensor) -> torch.Tensor:
        return self._mlp(x + self.attn(self.norm1(x), cos, sin, frames))

    def forward_masked(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self._mlp(x + self.attn.forward_masked(self.norm1(x), cos, sin, mask))

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
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


class VisionEncoder(nn.Module):
    """The vision tower; see the module docstring for the block convention."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.fat_dim = config.fat_dim
        # Of the weights it was loaded with (common.weights_digest); set by load_encoder.
        self.weights_digest = ""
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

    def forward_frames(
        self,
        patches: torch.Tensor,
        interp_index: torch.Tensor,
        interp_weight: torch.Tensor,
        positions: torch.Tensor,
        frames: torch.Tensor,
    ) -> torch.Tensor:
        """Encode frames lying back to back in one flat sequence of ``rows`` patches.

        patches ``[rows, hidden_size]``, the patch embeddings (:meth:`embed_patches`:
        items are embedded before they are packed, so packing moves rows of
        ``hidden_size``, not of ``patch_dim``); interp_index ``[rows, 4]`` int64 and
        interp_weight ``[rows, 4]`` (see :func:`.positions.frame_interpolation`);
        positions ``[rows, 2]`` (row, col); frames: the frames' patch counts, int64
        on the host (see :func:`frame_attention`). Returns ``[rows / merge**2, fat_dim]``.
        """
        x = self._add_position_table(patches, interp_index, interp_weight)
        cos, sin = rotary_cos_sin(positions, self.rotary_pos_emb.inv_freq)
        return self._layers(x, lambda block, h: block(h, cos, sin, frames))

    def embed_patches(self, pixels: torch.Tensor, repeat: int = 1) -> torch.Tensor:
        """``[rows, patch_dim]`` pixels (``[rows, patch_dim / T]`` with ``repeat`` T, see
        :class:`~encoder_server.preprocess.ProcessedItem`) -> ``[rows, hidden_size]`` patch embeddings."""
        out: torch.Tensor = self.patch_embed(pixels, repeat)
        return out

    def forward_blocks(
        self,
        pixels: torch.Tensor,
        interp_index: torch.Tensor,
        interp_weight: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """Encode ``n`` attention blocks of ``L`` patches each, attention restricted by ``mask``.

        The inputs of :meth:`forward_frames` shaped ``[n, L, ...]``, and mask
        ``[n, 1, L, L]`` bool. Returns ``[n * L / merge**2, fat_dim]``; ``L`` is a
        multiple of merge**2 and every frame starts at a multiple of it.
        """
        x = self._add_position_table(self.patch_embed(pixels), interp_index, interp_weight)
        cos, sin = self.rotary_pos_emb(positions)
        return self._layers(x, lambda block, h: block.forward_masked(h, cos, sin, mask))

    def _add_position_table(self, x: torch.Tensor, interp_index: torch.Tensor,
                            interp_weight: torch.Tensor) -> torch.Tensor:
        table = self.pos_embed(interp_index)  # [..., 4, hidden]
        out: torch.Tensor = x + (table * interp_weight.unsqueeze(-1)).sum(dim=-2).to(x.dtype)
        return out

    def _layers(self, x: torch.Tensor, run: Callable[[VisionBlock, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        # Blocks run in layer order, so the deepstack features come out in layer
        # order too (the order the language model adds them in).
        deepstack: list[torch.Tensor] = []
        for layer, block in enumerate(self.blocks):
            x = run(block, x)  # type: ignore[arg-type]
            slot = self._deepstack_slot.get(layer)
            if slot is not None:
                deepstack.append(self.deepstack_merger_list[slot](x))
        return torch.cat([self.merger(x), *deepstack], dim=-1)

    @torch.inference_mode()
    def embed(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> torch.Tensor:
        """Plain forward in the Hugging Face convention: ``[sum t*h*w / merge**2, fat_dim]``.

        The same path the serving graph takes (:meth:`forward_frames`), without padding.
        ``pixel_values`` may also hold stills' rows of one frame (``[rows, patch_dim / T]``, every
        grid's t 1: :class:`~encoder_server.preprocess.ProcessedItem` with ``repeat`` T).
        """
        grids = _grid_list(grid_thw)
        cfg = self.config
        total = sum(t * h * w for t, h, w in grids)
        still_dim = cfg.patch_dim // cfg.temporal_patch_size
        repeat = 1
        if (pixel_values.dim() == 2 and pixel_values.shape == (total, still_dim) and cfg.temporal_patch_size > 1
                and all(t == 1 for t, _, _ in grids)):
            repeat = cfg.temporal_patch_size
        elif pixel_values.dim() != 2 or pixel_values.shape != (total, cfg.patch_dim):
            stills = f", or ({total}, {still_dim}) for stills' rows of one frame" if cfg.temporal_patch_size > 1 else ""
            raise ValueError(
                f"pixel_values shape {tuple(pixel_values.shape)} does not match grid_thw {grids}: "
                f"expected ({total}, {cfg.patch_dim}){stills}"
            )
        for grid in grids:
            if grid[1] % cfg.spatial_merge_size or grid[2] % cfg.spatial_merge_size:
                raise ValueError(f"grid {grid} is not a multiple of merge size {cfg.spatial_merge_size}")
        frames = [(h, w) for t, h, w in grids for _ in range(t)]
        index, weight, positions = frame_tables(frames, cfg.spatial_merge_size, cfg.num_grid_per_side)
        device = self.device
        return self.forward_frames(
            self.embed_patches(pixel_values.to(device), repeat), index.to(device), weight.to(device),
            positions.to(device), torch.tensor([h * w for h, w in frames], dtype=torch.int64))


def _grid_list(grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> list[tuple[int, int, int]]:
    rows = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else [list(g) for g in grid_thw]
    grids: list[tuple[int, int, int]] = []
    for row in rows:
        if len(row) != 3 or any(int(v) <= 0 for v in row):
            raise ValueError(f"grid_thw rows must be three positive ints, got {row!r}")
        grids.append((int(row[0]), int(row[1]), int(row[2])))
    return grids
