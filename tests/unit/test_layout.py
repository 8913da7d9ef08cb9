from __future__ import annotations

import pytest
import torch

from common.errors import ConfigError
from common.layout import (
    AUTO_BLOCK_BYTES,
    AUTO_BLOCK_MAX_ROWS,
    AUTO_BLOCK_MIN_ROWS,
    CacheLayout,
    auto_block_size,
    auto_num_blocks,
    cache_block_size,
    compute_fat_dim,
    encoder_cache_size,
)


def test_reference_block_size_qwen3_vl() -> None:
    # attention block 2048 post-patch tokens / 2x2 merge = 512 cache rows per block
    assert cache_block_size(2048, 4) == 512


def test_reference_fat_dim_qwen3_vl_32b() -> None:
    # out_hidden_size 5120, three deepstack levels -> 5120 x 4
    assert compute_fat_dim(5120, 3) == 20480


def test_auto_sizing_rule() -> None:
    size = encoder_cache_size(max_num_batched_tokens=8192, max_tokens_per_mm_item=16384)
    assert size == 16384
    assert auto_num_blocks(size, 512) == 33  # 32 usable + scratch
    assert auto_num_blocks(513, 512) == 3  # a partial block rounds up
    layout = CacheLayout.auto(block_size=512, out_hidden_size=5120, num_deepstack_levels=3,
                              cache_size_tokens=size)
    assert layout.num_blocks == 33
    assert layout.scratch_block_id == 32
    assert layout.num_usable_blocks == 32


@pytest.mark.parametrize(
    "row_bytes, rows",
    [
        (1, 64),
        (64 * 3 * 2, 64),  # the tiny model: 64 wide, 2 deepstack levels, bf16
        (2048 * 4 * 2, 64),  # 16 KiB rows: 64 rows make exactly 1 MiB
        (2048 * 4 * 2 + 2, 32),  # one element more and 64 rows pass 1 MiB
        (4096 * 4 * 2, 32),
        (5120 * 4 * 2, 16),  # 40 KiB rows: 16 rows = 640 KiB, 32 would pass 1 MiB
        (5120 * 4 * 4, 16),  # float32: even 16 rows pass 1 MiB; the floor holds
        (1 << 20, 16),
    ],
)
def test_auto_block_size_from_row_bytes(row_bytes: int, rows: int) -> None:
    assert auto_block_size(row_bytes) == rows


def test_auto_block_size_is_a_bounded_power_of_two_within_the_byte_target() -> None:
    for row_bytes in range(2, 200_000, 998):
        rows = auto_block_size(row_bytes)
        assert AUTO_BLOCK_MIN_ROWS <= rows <= AUTO_BLOCK_MAX_ROWS and rows & (rows - 1) == 0
        assert rows * row_bytes <= AUTO_BLOCK_BYTES or rows == AUTO_BLOCK_MIN_ROWS
        # the largest such: twice the rows would pass the byte target or the cap
        assert 2 * rows > AUTO_BLOCK_MAX_ROWS or 2 * rows * row_bytes > AUTO_BLOCK_BYTES


@pytest.mark.parametrize("row_bytes", [0, -384])
def test_auto_block_size_rejects_empty_rows_naming_the_value(row_bytes: int) -> None:
    with pytest.raises(ConfigError, match=f"row_bytes must be > 0, got {row_bytes}"):
        auto_block_size(row_bytes)


def test_bytes_per_block_by_dtype() -> None:
    bf16 = CacheLayout(4, 512, 5120, 3, torch.bfloat16)
    assert bf16.fat_dim == 20480
    assert bf16.bytes_per_block == 512 * 20480 * 2
    assert bf16.buffer_bytes == 4 * bf16.bytes_per_block
    assert bf16.shape == (4, 512, 20480)
    f32 = CacheLayout(4, 16, 8, 0, torch.float32)
    assert f32.bytes_per_block == 16 * 8 * 4


def test_blocks_for_tokens() -> None:
    layout = CacheLayout(10, 256, 64)
    assert [layout.blocks_for_tokens(n) for n in (1, 256, 257, 7680)] == [1, 1, 2, 30]
    with pytest.raises(ValueError, match="num_tokens"):
        layout.blocks_for_tokens(0)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(num_blocks=1, block_size=4, out_hidden_size=8), "num_blocks"),
        (dict(num_blocks=4, block_size=0, out_hidden_size=8), "block_size"),
        (dict(num_blocks=4, block_size=4, out_hidden_size=0), "out_hidden_size"),
        (dict(num_blocks=4, block_size=4, out_hidden_size=8, dtype=torch.int8), "dtype"),
    ],
)
def test_invalid_layouts_name_the_value(kwargs: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        CacheLayout(**kwargs)


def test_block_size_needs_whole_merge() -> None:
    with pytest.raises(ConfigError, match="multiple"):
        cache_block_size(2050, 4)


def test_compatibility_hash_covers_what_must_match() -> None:
    base = CacheLayout(10, 256, 64, 1)
    h = base.compatibility_hash("m", 1)
    assert h == CacheLayout(99, 256, 64, 1).compatibility_hash("m", 1)  # block count is local
    assert h != base.compatibility_hash("other", 1)
    assert h != base.compatibility_hash("m", 2)
    assert h != CacheLayout(10, 128, 64, 1).compatibility_hash("m", 1)
    assert h != CacheLayout(10, 256, 64, 2).compatibility_hash("m", 1)
    assert h != CacheLayout(10, 256, 64, 1, torch.float16).compatibility_hash("m", 1)
