"""``--tower-dtype``: the dtype the tower computes in, and the hashes it keeps apart."""

from __future__ import annotations

import argparse

import pytest
import torch

from common.config import EncoderServerConfig, add_arguments, build
from common.errors import ConfigError
from encoder_server.preprocess import PreprocessConfig, ProcessedItem
from encoder_server.server import _load_tower, computed_fingerprint
from encoder_server.vision import default_tokens_per_block, load_encoder

BLOCK = 16


def test_an_unknown_tower_dtype_is_refused_naming_it() -> None:
    with pytest.raises(ConfigError, match="int8"):
        build(EncoderServerConfig, None, {"EPD_TOWER_DTYPE": "int8"})
    assert build(EncoderServerConfig, None, {}).tower_dtype == "auto"
    parser = argparse.ArgumentParser()
    add_arguments(parser, EncoderServerConfig)
    assert build(EncoderServerConfig, parser.parse_args(["--tower-dtype", "bfloat16"])).tower_dtype == "bfloat16"


def test_float32_keeps_the_preprocessing_fingerprint_and_other_dtypes_get_their_own() -> None:
    base = "0" * 32
    assert computed_fingerprint(base, "float32") == base
    bf16, fp16 = computed_fingerprint(base, "bfloat16"), computed_fingerprint(base, "float16")
    assert len({base, bf16, fp16}) == 3 and len(bf16) == len(base)
    assert computed_fingerprint(base, "bfloat16") == bf16  # stable: a restart keeps its hashes
    assert computed_fingerprint("1" * 32, "bfloat16") != bf16


def _rows(dtype: str) -> tuple[str, torch.dtype, torch.Tensor]:
    """The tiny tower loaded as ``epd encoder --tower-dtype dtype`` loads it; rows of one image
    through the serving path (eager), as float32."""
    tower = _load_tower(build(EncoderServerConfig, None, {"EPD_TOWER_DTYPE": dtype, "EPD_ENCODER_BACKEND": "eager"}))
    runner = tower.make_runner(BLOCK)
    encoder = runner.encoder
    grid = (1, 8, 12)
    values = torch.randn(8 * 12, encoder.config.patch_dim, generator=torch.Generator().manual_seed(3))
    item = ProcessedItem(values, grid, 8 * 12 // 4, "image")
    counts = default_tokens_per_block(item.num_tokens, BLOCK)
    buffer = torch.full((len(counts) + 1, BLOCK, encoder.fat_dim), float("nan"), dtype=encoder.dtype)
    runner.write([item], [list(range(len(counts)))], [counts], buffer, len(counts))
    rows = torch.cat([buffer[b, :n] for b, n in enumerate(counts)]).float()
    return tower.fingerprint, encoder.dtype, rows


@pytest.mark.parametrize(("name", "dtype", "limit"), [("bfloat16", torch.bfloat16, 5e-2),
                                                     ("float16", torch.float16, 5e-3)])
def test_a_narrower_tower_computes_in_its_dtype_under_its_own_hashes(name: str, dtype: torch.dtype,
                                                                       limit: float) -> None:
    fp_default, dtype_default, exact = _rows("auto")
    fp_narrow, dtype_narrow, rows = _rows(name)
    assert dtype_default == torch.float32 and dtype_narrow == dtype
    # float32 keeps its preprocessing's fingerprint, the hashes of every earlier release
    assert fp_default == PreprocessConfig.for_encoder(load_encoder()).fingerprint() != fp_narrow
    assert torch.isfinite(rows).all()
    error = float((rows - exact).abs().max() / exact.abs().max())
    # 8 (bfloat16) or 11 (float16) bits of mantissa: the rows are near float32's, and not equal to them
    assert 0 < error < limit, error
