"""Merge of cached encoder rows into the hidden states, inside the prefill graph (prefill process).

Everything here is shape-static: the number of blocks, the block size and the
hidden length are fixed at warm-up, and where each row lands is data
(``encoder_positions``, built by :mod:`prefill_client.reference.positions`). So the
functions compile with ``torch.compile(fullgraph=True)`` once and never
recompile as positions change. The steps are ``index_select`` (gather the
scheduled blocks out of the whole buffer) -> flatten -> ``index_put_`` (scatter
each row to its hidden row). Rows marked with the sentinel ``num_tokens`` go
to a dummy row past the end that is dropped.

Two entry points share that scatter:

- :func:`merge_multimodal_embeddings` is functional: it appends the dummy row
  to a copy of ``hidden``. Inside a larger graph the copy fuses with whatever
  produced ``hidden`` (the token embedding).
- :func:`merge_multimodal_embeddings_padded` writes in place into a
  ``[num_tokens + 1, D]`` buffer whose last row is the dummy, for a worker
  that keeps a persistent embeddings buffer: no allocation, no copy of the
  text rows, only the image rows move.

Deepstack models store ``fat_dim = out_hidden_size * (1 + levels)`` per row;
:func:`split_deepstack` cuts the merged fat rows back into the main
embedding and one tensor per deepstack level.
"""

from __future__ import annotations

import logging

import torch

from common.layout import compute_fat_dim

logger = logging.getLogger(__name__)


def _gather_rows(
    blocks: torch.Tensor, encoder_positions: torch.Tensor, block_ids: torch.Tensor | None
) -> torch.Tensor:
    """``[max_blocks * block_size, D]`` rows in the order of ``encoder_positions``.

    The checks read shapes and dtypes only, which are static: under
    ``torch.compile`` they become guards, not graph breaks.
    """
    if blocks.dim() != 3:
        raise ValueError(f"blocks must be [blocks, block_size, D], got shape {tuple(blocks.shape)}")
    if block_ids is not None:
        if block_ids.dim() != 1 or block_ids.dtype != torch.int64:
            raise ValueError(
                f"block_ids must be a 1-D int64 tensor, got {block_ids.dtype} "
                f"shape {tuple(block_ids.shape)}"
            )
        # The reference passes the whole buffer plus an index and gathers
        # in-graph; a compiler fuses this gather into the scatter below.
        blocks = blocks.index_select(0, block_ids)
    if encoder_positions.dtype != torch.int64 or tuple(encoder_positions.shape) != tuple(blocks.shape[:2]):
        raise ValueError(
            f"encoder_positions must be int64 of shape {tuple(blocks.shape[:2])}, got "
            f"{encoder_positions.dtype} shape {tuple(encoder_positions.shape)}"
        )
    return blocks.reshape(-1, blocks.shape[-1])


def merge_multimodal_embeddings_padded(
    padded_hidden: torch.Tensor,
    blocks: torch.Tensor,
    encoder_positions: torch.Tensor,
    block_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scatter encoder rows into ``padded_hidden [num_tokens + 1, D]`` in place.

    The last row is the dummy that absorbs sentinel rows (value
    ``num_tokens``); its content afterwards is undefined. ``blocks`` is
    ``[max_blocks, block_size, D]``, or the whole buffer when ``block_ids
    [max_blocks]`` selects from it. Blocks may have another dtype than the
    hidden states (bf16 cache, f32 activations): rows are cast on the way.
    Returns the view of the first ``num_tokens`` rows.
    """
    if padded_hidden.dim() != 2 or padded_hidden.shape[0] < 1:
        raise ValueError(
            f"padded_hidden must be [num_tokens + 1, D], got shape {tuple(padded_hidden.shape)}"
        )
    rows = _gather_rows(blocks, encoder_positions, block_ids)
    if rows.shape[-1] != padded_hidden.shape[-1]:
        raise ValueError(
            f"block row width {rows.shape[-1]} differs from hidden width {padded_hidden.shape[-1]}"
        )
    # accumulate=False: each real row is written once (check_filled proves it);
    # sentinel rows race on the dummy row, and any winner is fine there.
    padded_hidden.index_put_((encoder_positions.reshape(-1),), rows.to(padded_hidden.dtype))
    return padded_hidden[:-1]


def merge_multimodal_embeddings(
    hidden: torch.Tensor,
    blocks: torch.Tensor,
    encoder_positions: torch.Tensor,
    block_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Return ``hidden [num_tokens, D]`` with encoder rows placed at ``encoder_positions``.

    ``hidden`` itself is not modified. Sentinel rows (value ``num_tokens``)
    never reach a real row. See :func:`merge_multimodal_embeddings_padded`
    for the shapes.
    """
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [num_tokens, D], got shape {tuple(hidden.shape)}")
    padded = torch.cat([hidden, hidden.new_zeros(1, hidden.shape[1])])
    return merge_multimodal_embeddings_padded(padded, blocks, encoder_positions, block_ids)


def new_padded_hidden(
    num_tokens: int, dim: int, *, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """A zeroed ``[num_tokens + 1, dim]`` buffer for the in-place merge."""
    if num_tokens <= 0 or dim <= 0:
        raise ValueError(f"num_tokens and dim must be > 0, got {num_tokens} and {dim}")
    return torch.zeros(num_tokens + 1, dim, dtype=dtype, device=device)


def split_deepstack(
    rows: torch.Tensor, out_hidden_size: int, num_levels: int
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Cut ``[N, fat_dim]`` rows into the main ``[N, H]`` part and ``num_levels`` ``[N, H]`` parts.

    The parts are column views of ``rows`` (no copy).
    """
    fat_dim = compute_fat_dim(out_hidden_size, num_levels)
    if rows.shape[-1] != fat_dim:
        raise ValueError(
            f"rows are {rows.shape[-1]} wide, expected out_hidden_size {out_hidden_size} "
            f"x (1 + {num_levels} deepstack levels) = {fat_dim}"
        )
    main, *levels = torch.split(rows, out_hidden_size, dim=-1)
    return main, levels


def merge_deepstack_embeddings(
    hidden: torch.Tensor,
    blocks: torch.Tensor,
    encoder_positions: torch.Tensor,
    *,
    num_levels: int,
    block_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Merge fat rows into ``hidden [num_tokens, H]`` and return the deepstack levels too.

    Returns ``(merged [N, H], [level_k [N, H] ...])``: each level holds the
    encoder's level-``k`` rows at the merged positions and zeros elsewhere,
    which is what a deepstack decoder adds to its hidden states.
    """
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [num_tokens, H], got shape {tuple(hidden.shape)}")
    num_tokens, out_hidden_size = hidden.shape
    fat = hidden.new_zeros(num_tokens + 1, compute_fat_dim(out_hidden_size, num_levels))
    fat[:num_tokens, :out_hidden_size] = hidden
    merged = merge_multimodal_embeddings_padded(fat, blocks, encoder_positions, block_ids)
    return split_deepstack(merged, out_hidden_size, num_levels)
