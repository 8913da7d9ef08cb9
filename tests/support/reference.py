"""A local reference encode: what the encoder must have written for an item."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property

import torch

from encoder_server.preprocess import PreprocessConfig, Preprocessor
from encoder_server.vision import load_encoder


class Reference:
    """The default encoder (same seed as ``epd encoder`` without --weights), or the one of
    checkpoint ``weights`` (as ``epd encoder --weights``), run plainly."""

    def __init__(self, weights: str | None = None) -> None:
        self.weights = weights

    @cached_property
    def encoder(self):  # type: ignore[no-untyped-def]
        return load_encoder(self.weights)

    @cached_property
    def preprocessor(self) -> Preprocessor:
        return Preprocessor(PreprocessConfig.for_encoder(self.encoder))

    @torch.no_grad()
    def image(self, data: bytes) -> torch.Tensor:
        item = self.preprocessor.image(data)
        return self.encoder.embed(item.pixel_values, torch.tensor([item.grid_thw]))

    @torch.no_grad()
    def video(self, frames: Sequence[bytes], fps: float | None = None) -> torch.Tensor:
        item = self.preprocessor.video(frames, fps=fps)
        return self.encoder.embed(item.pixel_values, torch.tensor([item.grid_thw]))


def matches(pulled: torch.Tensor, reference: torch.Tensor) -> bool:
    """Rows equal up to the cache dtype's rounding (bf16: ~3 significant digits)."""
    if pulled.shape != reference.shape:
        return False
    return bool(torch.allclose(pulled.float(), reference.float(), rtol=2e-2, atol=2e-2))
