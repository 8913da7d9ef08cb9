"""The encoder cache's sizing and hold policy, and the layout it resolves to (every process).

The encoder sizes its buffer from it; a prefill worker in monolithic mode reads the same
hold rules.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass

from common.config.builder import require, setting, settle_choices
from common.config.choices import CacheDtype, CacheMode

if typing.TYPE_CHECKING:
    from common.layout import CacheLayout

# Hold before a freed block may be reused: none when encoder and prefill share
# a process, 100 ms in EPD mode so a remote reader can finish its pull.
MONOLITHIC_MIN_HOLD_MS = 0
EPD_MIN_HOLD_MS = 100


@dataclass(frozen=True)
class CacheConfig:
    """Encoder cache sizing and hold policy (``encoder_cache_*`` in the reference)."""

    mode: CacheMode = setting(
        CacheMode.EPD, env="EPD_CACHE_MODE", flag="--cache-mode",
        help="epd (remote readers, 100 ms default hold) or monolithic (0 ms hold)")
    block_size: int | None = setting(
        None, env="EPD_BLOCK_SIZE",
        help="cache rows (merged tokens) per block; default from the row width: the largest power of two in "
             "16..64 whose block is at most 1 MiB, else 16 (64 for the tiny model; padding at most 8 %, "
             "bench/layout.py)")
    num_blocks: int | None = setting(
        None, env="EPD_CACHE_BLOCKS", flag="--cache-blocks",
        help="encoder_cache_num_blocks: total blocks including the scratch block; "
             "overrides --cache-bytes and --cache-tokens")
    cache_bytes: int | None = setting(
        None, env="EPD_CACHE_BYTES",
        help="size the buffer to at most this many bytes (scratch block included)")
    cache_tokens: int = setting(
        16384, env="EPD_CACHE_TOKENS",
        help="encoder_cache_size in tokens when no block count or byte size is given; "
             "blocks = ceil(tokens / block_size) + 1")
    min_hold_ms: int | None = setting(
        None, env="EPD_MIN_HOLD_MS",
        help="encoder_cache_min_hold_time_ms; default 100 in epd mode, 0 in monolithic")
    lease_ttl_ms: int = setting(
        30000, env="EPD_LEASE_TTL_MS",
        help="a lease not released within this time expires and unpins its item")
    dtype: CacheDtype = setting(
        CacheDtype.BFLOAT16, env="EPD_CACHE_DTYPE", flag="--cache-dtype",
        help="cache buffer dtype: bfloat16, float16, float32")

    def __post_init__(self) -> None:
        settle_choices(self)
        for name in ("cache_tokens", "lease_ttl_ms"):
            require(getattr(self, name) > 0, name, getattr(self, name), "must be > 0")
        if self.block_size is not None:
            require(self.block_size > 0, "block_size", self.block_size, "must be > 0")
        if self.num_blocks is not None:
            require(self.num_blocks >= 2, "num_blocks", self.num_blocks, "must be >= 2")
        if self.cache_bytes is not None:
            require(self.cache_bytes > 0, "cache_bytes", self.cache_bytes, "must be > 0")
        if self.min_hold_ms is not None:
            require(self.min_hold_ms >= 0, "min_hold_ms", self.min_hold_ms, "must be >= 0")

    @property
    def effective_min_hold_ms(self) -> int:
        if self.min_hold_ms is not None:
            return self.min_hold_ms
        return EPD_MIN_HOLD_MS if self.mode is CacheMode.EPD else MONOLITHIC_MIN_HOLD_MS

    def layout(self, out_hidden_size: int, num_deepstack_levels: int) -> CacheLayout:
        """The buffer layout for an encoder with the given output width.

        An unset ``block_size`` is resolved here, from the row width, because only the encoder's model
        knows it; everything downstream (block count, buffer, handshake) reads the layout's value.
        """
        from common.layout import CacheLayout, auto_block_size, auto_num_blocks, compute_fat_dim, parse_dtype

        dtype = parse_dtype(self.dtype.value)
        block_size = self.block_size
        if block_size is None:
            block_size = auto_block_size(compute_fat_dim(out_hidden_size, num_deepstack_levels) * dtype.itemsize)
        probe = CacheLayout(2, block_size, out_hidden_size, num_deepstack_levels, dtype)
        if self.num_blocks is not None:
            num_blocks = self.num_blocks
        elif self.cache_bytes is not None:
            num_blocks = self.cache_bytes // probe.bytes_per_block
            require(num_blocks >= 2, "cache_bytes", self.cache_bytes,
                    f"holds fewer than 2 blocks of {probe.bytes_per_block} bytes")
        else:
            num_blocks = auto_num_blocks(self.cache_tokens, block_size)
        return dataclasses.replace(probe, num_blocks=num_blocks)
