"""``--tower-dtype``: the dtype the tower computes in, and the hashes it keeps apart."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from common.config import EncoderServerConfig, add_arguments, build
from common.errors import ConfigError
from encoder_server.preprocess import PreprocessConfig, ProcessedItem
from encoder_server.towers import load as load_tower
from encoder_server.towers.base import computed_fingerprint
from encoder_server.vision import default_tokens_per_block, load_encoder
from encoder_server.vision.weights import declared_dtype
from tests.support.checkpoints import write_vision_checkpoint

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


def _rows(dtype: str, backend: str = "eager") -> tuple[str, torch.dtype, torch.Tensor]:
    """The tiny tower loaded as ``epd encoder --tower-dtype dtype`` loads it; rows of one image
    through the serving path (``backend``), as float32."""
    tower = load_tower(build(EncoderServerConfig, None, {"EPD_TOWER_DTYPE": dtype, "EPD_ENCODER_BACKEND": backend}))
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


def _declaring(path: Path, **sections: dict[str, object]) -> Path:
    """``path``'s config.json with ``sections`` merged in (``root=`` for the top level)."""
    config = json.loads((path / "config.json").read_text())
    config.update(sections.pop("root", {}))
    for name, fields in sections.items():
        config.setdefault(name, {}).update(fields)
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_the_checkpoint_declares_the_dtype_as_vllm_reads_it(tmp_path: Path) -> None:
    path = write_vision_checkpoint(tmp_path / "a", seed=1)
    assert declared_dtype(path) == ("float32", "the vision tensors' stored dtype")
    # the config's dtype wins over the tensors', the root's over text_config's over vision_config's
    _declaring(path, vision_config={"dtype": "float16"})
    assert declared_dtype(path) == ("float16", "config.json vision_config.dtype")
    _declaring(path, text_config={"torch_dtype": "bfloat16"})
    assert declared_dtype(path) == ("bfloat16", "config.json text_config.torch_dtype")
    _declaring(path, root={"dtype": "float32"})
    assert declared_dtype(path) == ("float32", "config.json dtype")
    _declaring(path, root={"dtype": "torch.bfloat16"})
    assert declared_dtype(path)[0] == "bfloat16"
    _declaring(path, root={"dtype": "int8"})
    with pytest.raises(ConfigError, match="dtype is 'int8'.*--tower-dtype"):
        declared_dtype(path)
    # no dtype in the config: the vision tensors' own, when they share one
    stored = write_vision_checkpoint(tmp_path / "b", seed=1, dtype=torch.bfloat16)
    assert declared_dtype(stored) == ("bfloat16", "the vision tensors' stored dtype")


def test_auto_runs_a_bfloat16_checkpoint_in_bfloat16_under_bfloat16_hashes(tmp_path: Path) -> None:
    path = _declaring(write_vision_checkpoint(tmp_path / "a", seed=1), text_config={"dtype": "bfloat16"})
    env = {"EPD_WEIGHTS": str(path), "EPD_ENCODER_BACKEND": "eager"}
    auto = load_tower(build(EncoderServerConfig, None, env))
    forced = load_tower(build(EncoderServerConfig, None, {**env, "EPD_TOWER_DTYPE": "float32"}))
    assert auto.make_runner(BLOCK).encoder.dtype == torch.bfloat16
    assert forced.make_runner(BLOCK).encoder.dtype == torch.float32
    assert auto.fingerprint == computed_fingerprint(forced.fingerprint, "bfloat16") != forced.fingerprint
    assert auto.weights_digest == forced.weights_digest  # the files, whatever the dtype the tower runs in


def test_the_compiled_bfloat16_tower_writes_the_eager_ones_rows() -> None:
    """The compiled graph calls the same fused MLP linear (an opaque op to Inductor) and fuses the
    rest itself: its rows are the eager path's to bfloat16 rounding, both near float32's."""
    _, _, exact = _rows("float32")
    _, _, eager = _rows("bfloat16")
    _, dtype, compiled = _rows("bfloat16", "compile")
    assert dtype == torch.bfloat16 and torch.isfinite(compiled).all()
    scale = exact.abs().max()
    assert float((compiled - eager).abs().max() / scale) < 2e-2
    assert float((compiled - exact).abs().max() / scale) < 5e-2
