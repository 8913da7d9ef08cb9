"""Fakes shared by the prefill worker tests: media bytes and an in-memory embedding source."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from common import media
from common.media import PreprocessParams
from epd_harness.media import image_bytes
from prefill_client.reference.chat import ChatRequest, MediaItem
from prefill_client.consumer.client import PulledItem
from prefill_client.consumer.connection import MediaSpec, content_key
from prefill_client.reference.lm import LMConfig, TinyLM, build_lm
from prefill_client.reference.worker import WorkerLimits

MODEL_ID = "tiny-qwen3-vl"
FINGERPRINT = "fake-preprocess-v1"
# Fixed here (not the library defaults) so the token geometry the tests assert stays put.
PARAMS = PreprocessParams(16, 2, 2, 56 * 56, 28 * 28 * 1280, video_sample_fps=None)
HIDDEN = 64
LEVELS = 2
FAT_DIM = HIDDEN * (1 + LEVELS)
BLOCK = 16  # prefix-cache block of the test worker
LIMITS = WorkerLimits(max_model_len=512, max_items=8, prefix_block_size=BLOCK, prefix_cache_blocks=256)


def png(width: int, height: int, seed: int) -> bytes:
    """A small PNG whose pixels depend on ``seed`` (distinct seeds, distinct bytes)."""
    return image_bytes(width, height, seed=seed)


IMG = MediaItem.image(png(256, 256, seed=1))  # 256x256 -> grid (1, 16, 16) -> 64 placeholders
# The reference's multi-turn conversation: each turn re-sends the whole history.
TURN1 = ChatRequest.user(IMG, "Describe this picture in detail please.")
TURN2 = TURN1.then("assistant", "It is noise.").then("user", "What colours are in it?")
TURN3 = TURN2.then("assistant", "Many.").then("user", IMG, "And this one, what do you see here?")
FRESH = ChatRequest.user(IMG, "A different question entirely.")


def make_lm() -> TinyLM:
    return build_lm(LMConfig(hidden_size=HIDDEN, num_deepstack_levels=LEVELS), seed=0)


def rows_for(mm_hash: str, num_tokens: int, fat_dim: int = FAT_DIM,
             dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The encoder output of an item: a pure function of its mm_hash."""
    gen = torch.Generator().manual_seed(int(mm_hash[:12], 16))
    return torch.randn(num_tokens, fat_dim, generator=gen).to(dtype)


def spec_tokens(spec: MediaSpec, params: PreprocessParams = PARAMS) -> tuple[tuple[int, int, int], int]:
    """Grid and token count the encoder would give (computed independently of the worker)."""
    h, w = media.probe_image_size(spec.frames[0])
    if spec.kind == "image":
        grid = media.image_grid(h, w, params)
    else:
        grid = media.video_grid(len(spec.frames), h, w, params, spec.fps)
    return grid, media.num_tokens(grid, params.merge_size)


class FakeSource:
    """Same methods as EncoderCacheClient: an 'encoder' dict plus a consumer-side dict.

    ``encoder_runs`` counts items the fake encoder computed (layer-3 misses);
    ``token_skew`` adds rows to every encoded item (to provoke a token-count failure).
    """

    def __init__(self, *, model_id: str = MODEL_ID, token_skew: int = 0) -> None:
        self.model_id = model_id
        self.encoder: dict[str, PulledItem] = {}
        self.local: dict[str, PulledItem] = {}
        self.encoder_runs = 0
        self.encode_calls: list[list[str]] = []
        self.lookup_calls: list[list[str]] = []
        self.cached_calls: list[str] = []
        self.token_skew = token_skew

    def media_params(self) -> tuple[PreprocessParams, str]:
        return PARAMS, FINGERPRINT

    def cached(self, mm_hash: str) -> PulledItem | None:
        self.cached_calls.append(mm_hash)
        return self.local.get(mm_hash)

    def lookup(self, mm_hashes: Sequence[str]) -> list[PulledItem | None]:
        self.lookup_calls.append(list(mm_hashes))
        out: list[PulledItem | None] = []
        for h in mm_hashes:
            if h in self.local:
                out.append(self.local[h])
            elif h in self.encoder:
                item = self.encoder[h]
                self.local[h] = PulledItem(h, item.embeddings, item.grid_thw, "fake", "local")
                out.append(PulledItem(h, item.embeddings, item.grid_thw, "fake", "hit"))
            else:
                out.append(None)
        return out

    def encode(self, items: Sequence[MediaSpec]) -> list[PulledItem]:
        hashes = [media.mm_hash(self.model_id, FINGERPRINT, content_key(s)) for s in items]
        self.encode_calls.append(hashes)
        out = []
        for spec, h in zip(items, hashes):
            if h in self.encoder:
                item = self.encoder[h]
                out.append(PulledItem(h, item.embeddings, item.grid_thw, "fake", "hit"))
                continue
            grid, n = spec_tokens(spec)
            self.encoder_runs += 1
            item = PulledItem(h, rows_for(h, n + self.token_skew), grid, "fake", "miss")
            self.encoder[h] = item
            self.local[h] = PulledItem(h, item.embeddings, grid, "fake", "local")
            out.append(item)
        return out
