"""epd-cache's own Qwen3-VL tower as the registry loads it: encoder, preprocessor, runner (encoder process)."""

from __future__ import annotations

import logging

import torch

from common.config import EncoderServerConfig, TowerChoice, TowerDtype
from common.layout import parse_dtype
from encoder_server.preprocess import PreprocessConfig, Preprocessor
from encoder_server.towers.base import LoadedTower, TowerSpec, checkpoint_model_type, computed_fingerprint, tower_dtype
from encoder_server.vision import EncoderRunner, load_encoder, native
from encoder_server.vision.config import QWEN3_VL_MODEL_TYPES
from encoder_server.vision.weights import declared_dtype

logger = logging.getLogger(__name__)


def accepts(weights: str | None) -> bool:
    """Qwen3-VL checkpoints, one that names no model type, and no checkpoint (the random tiny tower)."""
    if weights is None:
        return True
    model_type, _ = checkpoint_model_type(weights)
    return model_type is None or model_type in QWEN3_VL_MODEL_TYPES


def load(cfg: EncoderServerConfig) -> LoadedTower:
    """The encoder of ``--weights`` (random tiny without) in the ``--tower-dtype`` it resolves to."""
    declared, source = declared_dtype(cfg.weights) if cfg.weights is not None else ("float32", "random tower")
    dtype = tower_dtype(cfg, declared)
    logger.info("tower dtype %s (%s)", dtype,
                f"the checkpoint's, from {source}" if cfg.tower_dtype is TowerDtype.AUTO else "--tower-dtype")
    _warn_if_emulated(dtype, cfg.device)
    encoder = load_encoder(cfg.weights, device=cfg.device, dtype=parse_dtype(dtype))
    vision = encoder.config
    preprocess_config = PreprocessConfig.for_encoder(
        encoder, weights_dir=cfg.weights, max_image_pixels=cfg.max_image_pixels,
        max_video_frames=cfg.max_video_frames)

    def make_runner(block_size: int) -> EncoderRunner:
        # The attention kernel before the graphs: a first build takes about a minute, and
        # with --attention-kernel native a failure ends the start here.
        native.configure(cfg.attention_kernel, cfg.compile_cache_dir)
        if torch.device(cfg.device).type == "cpu":  # the kernel runs on host tensors only
            native.prepare()
        logger.info("encoder attention: %s", native.describe(vision.head_dim, cfg.device, encoder.dtype))
        return EncoderRunner(encoder, block_size=block_size, buckets=cfg.encoder_buckets,
                             backend=cfg.encoder_backend.value)

    return LoadedTower(SPEC.name, vision.out_hidden_size, vision.num_deepstack_levels,
                       Preprocessor(preprocess_config), make_runner, preprocess_config.params(),
                       computed_fingerprint(preprocess_config.fingerprint(), dtype), encoder.weights_digest)


def _warn_if_emulated(dtype: str, device: str) -> None:
    """Say so at start-up when this CPU has no units for the tower's dtype (it runs, several times slower)."""
    if not device.startswith("cpu") or dtype == "float32":
        return

    def has(probe: str) -> bool:  # torch's own CPU feature probes (private; absent in old releases: assume yes)
        fn = getattr(torch.cpu, probe, None)
        return True if fn is None else bool(fn())

    units = {"bfloat16": has("_is_avx512_bf16_supported") or has("_is_amx_tile_supported"),
             "float16": has("_is_amx_fp16_supported")}
    if not units.get(dtype, True):
        logger.warning("this CPU has no %s matrix units (AVX512-BF16 / AMX): the tower runs %s emulated, "
                       "slower than float32; --tower-dtype float32 is faster here (its rows get other mm_hashes, "
                       "so every encoder of a pool must be given the same)", dtype, dtype)


SPEC = TowerSpec(TowerChoice.QWEN3VL, accepts, load)
