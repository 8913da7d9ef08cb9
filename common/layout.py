"""Cache buffer layout math shared by the encoder and prefill processes.

The encoder owns ``buffer[num_blocks, block_size, fat_dim]``; the last block is
scratch (absorbs bucket-padding writes, never allocated). Consumers size their
landing blocks and NIXL descriptors from the same numbers, so everything here
is a pure function of a few integers and a dtype.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from common.errors import ConfigError

# dtype <-> wire name. bf16 is the default: the reference design stores merged
# embeddings in the language model's activation dtype.
DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
TAG_DTYPE = torch.int64
TAG_BYTES = 8
# Per block in the stamp region: [fingerprint (the tag), generation], int64 each.
STAMP_BYTES = 2 * TAG_BYTES


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ConfigError(f"unsupported cache dtype {dtype}; expected one of {sorted(DTYPES)}")


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ConfigError(f"unsupported cache dtype {name!r}; expected one of {sorted(DTYPES)}") from None


def compute_fat_dim(out_hidden_size: int, num_deepstack_levels: int) -> int:
    """Row width of one cached token: the main output plus each deepstack level."""
    if out_hidden_size <= 0 or num_deepstack_levels < 0:
        raise ConfigError(
            f"out_hidden_size must be > 0 and num_deepstack_levels >= 0, "
            f"got {out_hidden_size} and {num_deepstack_levels}"
        )
    return out_hidden_size * (1 + num_deepstack_levels)


def cache_block_size(encoder_attention_block_size: int, merge_factor: int) -> int:
    """Post-merger tokens per attention block (the reference's block size)."""
    if encoder_attention_block_size <= 0 or merge_factor <= 0:
        raise ConfigError(
            f"attention block size and merge factor must be > 0, "
            f"got {encoder_attention_block_size} and {merge_factor}"
        )
    if encoder_attention_block_size % merge_factor:
        raise ConfigError(
            f"attention block size {encoder_attention_block_size} is not a multiple "
            f"of merge factor {merge_factor}"
        )
    return encoder_attention_block_size // merge_factor


def encoder_cache_size(max_num_batched_tokens: int, max_tokens_per_mm_item: int) -> int:
    """Token budget of the encoder cache, as vLLM's EncoderCacheManager sizes it."""
    return max(max_num_batched_tokens, max_tokens_per_mm_item)


# Rows per block when none is configured (auto_block_size). An item takes whole blocks, so its last block is
# half padding on average: the fewer rows per block, the less of the cache is padding. On the mixed image
# workload of bench/layout.py (10,000 images of 64..510 tokens) 64 rows waste 6.9 % and 128 rows 9.0 %, so 64
# is the most rows that keeps padding at or below 8 %. Rows wider than 16 KiB get fewer rows, down to blocks
# of about 1 MiB: less padding (32 rows: 3.7 %) for a few percent of pull time, as a pull pays per block
# (BENCHMARKS.md, "Cache layout"). Never fewer than 16 rows: that bounds the blocks of a 512-token item, so
# the descriptors of its pull and the allocator's work, at 32.
AUTO_BLOCK_BYTES = 1 << 20
AUTO_BLOCK_MAX_ROWS = 64
AUTO_BLOCK_MIN_ROWS = 16


def auto_block_size(row_bytes: int) -> int:
    """Default rows per block for rows of ``row_bytes`` (``fat_dim`` times the dtype's size).

    The largest power of two from ``AUTO_BLOCK_MIN_ROWS`` to ``AUTO_BLOCK_MAX_ROWS`` whose block holds at
    most ``AUTO_BLOCK_BYTES``, or the floor when even that is larger: 64 rows up to 16 KiB rows (the tiny
    model's 384-byte rows included), 32 up to 32 KiB, 16 beyond.
    """
    if row_bytes <= 0:
        raise ConfigError(f"row_bytes must be > 0, got {row_bytes}")
    rows = AUTO_BLOCK_MAX_ROWS
    while rows > AUTO_BLOCK_MIN_ROWS and rows * row_bytes > AUTO_BLOCK_BYTES:
        rows //= 2
    return rows


def auto_num_blocks(cache_size_tokens: int, block_size: int) -> int:
    """``ceil(cache_size / block_size) + 1``: the +1 is the scratch block."""
    if cache_size_tokens <= 0 or block_size <= 0:
        raise ConfigError(
            f"cache size and block size must be > 0, got {cache_size_tokens} and {block_size}"
        )
    return math.ceil(cache_size_tokens / block_size) + 1


@dataclass(frozen=True, slots=True)
class CacheLayout:
    """Shape and dtype of the encoder cache buffer."""

    num_blocks: int
    block_size: int
    out_hidden_size: int
    num_deepstack_levels: int = 0
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        if self.num_blocks < 2:
            raise ConfigError(
                f"num_blocks must be >= 2 (one usable block plus scratch), got {self.num_blocks}"
            )
        if self.block_size <= 0:
            raise ConfigError(f"block_size must be > 0, got {self.block_size}")
        compute_fat_dim(self.out_hidden_size, self.num_deepstack_levels)
        dtype_name(self.dtype)

    @classmethod
    def auto(
        cls,
        *,
        block_size: int,
        out_hidden_size: int,
        num_deepstack_levels: int = 0,
        cache_size_tokens: int,
        dtype: torch.dtype = torch.bfloat16,
    ) -> CacheLayout:
        return cls(
            num_blocks=auto_num_blocks(cache_size_tokens, block_size),
            block_size=block_size,
            out_hidden_size=out_hidden_size,
            num_deepstack_levels=num_deepstack_levels,
            dtype=dtype,
        )

    @property
    def fat_dim(self) -> int:
        return compute_fat_dim(self.out_hidden_size, self.num_deepstack_levels)

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_row(self) -> int:
        return self.fat_dim * self.element_size

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_row

    @property
    def buffer_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def scratch_block_id(self) -> int:
        return self.num_blocks - 1

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.num_blocks, self.block_size, self.fat_dim)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Whole blocks an item of ``num_tokens`` rows occupies (one item per block)."""
        if num_tokens <= 0:
            raise ValueError(f"num_tokens must be > 0, got {num_tokens}")
        return math.ceil(num_tokens / self.block_size)

    def compatibility_hash(self, model_id: str, protocol_version: int) -> str:
        """Hash over exactly what producer and consumer must agree on."""
        text = "|".join(
            str(part)
            for part in (
                protocol_version,
                model_id,
                self.block_size,
                self.out_hidden_size,
                self.num_deepstack_levels,
                dtype_name(self.dtype),
            )
        )
        return hashlib.sha256(text.encode()).hexdigest()[:16]
