"""The reference prefill worker: cache layers, merge and a static-shape prefill (prefill process).

One request goes through the layers of the design in this order, each
counting its metrics on the worker's registry:

1. **input processor** (layer 1) on every media item of the request, hit or
   not: ``mm_cache_queries`` +1 per item, ``mm_cache_hits`` +1 when its
   content hash was seen (:mod:`prefill_client.reference.input_processor`);
2. the prompt is rendered with one placeholder per merged token
   (:mod:`prefill_client.reference.tokenizer`);
3. **prefix cache** (layer 2b): every full block before the last prompt token
   is a ``prefix_cache_queries``; the leading run of cached blocks are
   ``prefix_cache_hits`` (the run stops at the first miss). An item whose
   placeholders lie entirely inside that run needs nothing more: its
   embedding is baked into the cached KV;
4. **logical encoder cache** (layer 2a), only for items with placeholders
   outside the prefix hit: ``scheduler_encoder_cache_queries`` +1 per item;
   a hit when this worker already holds its rows (``source.cached``), when
   the same item was resolved earlier in this request, or when the encoder
   has it (``source.lookup``); the rest go to ``source.encode`` in one call;
5. the rows of the window are merged into the embeddings, the LM runs over
   the new tokens on top of the cached prefix KV, full blocks are stored in
   the prefix cache and the first token is the argmax of the last logits.

Each item reports which layer served it: ``prefix``, ``local``,
``encoder-hit`` or ``encoder-miss`` (the encoder ran for it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from common.config import CacheMode
from common.errors import ECLoadFailure, HandshakeError, LimitExceededError
from common.media import PreprocessParams
from common.metrics import PrefillMetrics
from prefill_client.reference.chat import ChatRequest, MediaItem
from prefill_client.consumer.client import PulledItem
from prefill_client.consumer.connection import MediaSpec
from prefill_client.reference.graph import PrefillGraph, bucket
from prefill_client.reference.input_processor import InputProcessor, MediaInfo
from prefill_client.reference.lm import TinyLM
from prefill_client.reference.prefix_cache import MediaRange, PrefixCache, block_hashes
from prefill_client.reference.rows import RowStore, ScheduledItem, StagingRows
from prefill_client.reference.tokenizer import MediaPart, RenderedPrompt, TextPart, render_chat

logger = logging.getLogger(__name__)

PREFIX, LOCAL, ENCODER_HIT, ENCODER_MISS = "prefix", "local", "encoder-hit", "encoder-miss"
_LAYER_OF_SOURCE = {"local": LOCAL, "hit": ENCODER_HIT, "miss": ENCODER_MISS}


class EmbeddingSource(Protocol):
    """What the worker needs from :class:`prefill_client.consumer.client.EncoderCacheClient`."""

    def encode(self, items: Sequence[MediaSpec]) -> list[PulledItem]: ...

    def lookup(self, mm_hashes: Sequence[str]) -> list[PulledItem | None]: ...

    def cached(self, mm_hash: str) -> PulledItem | None: ...

    def media_params(self) -> tuple[PreprocessParams, str]: ...


@dataclass(frozen=True, slots=True)
class ItemReport:
    """How one media item of a request was served."""

    index: int
    kind: str
    mm_hash: str
    offset: int
    num_tokens: int
    mm_cache_hit: bool  # layer 1
    layer: str  # prefix | local | encoder-hit | encoder-miss


@dataclass(frozen=True, slots=True)
class PrefillResult:
    first_token: int
    ttft_s: float
    prompt_tokens: int
    prefix_hit_tokens: int
    computed_tokens: int
    items: tuple[ItemReport, ...]
    logits: torch.Tensor  # [vocab], float32
    graph_shape: tuple[int, int, int]


@dataclass(frozen=True, slots=True)
class WorkerLimits:
    """Sizes fixed at start-up (they decide the graph's shapes)."""

    max_model_len: int = 8192
    max_items: int = 64
    prefix_block_size: int = 16
    prefix_cache_blocks: int = 4096
    mm_cache_items: int = 1024
    staging_block_size: int = 32
    min_bucket: int = 64


class PrefillWorker:
    """Serve chat requests through the cache layers onto a small static-shape LM."""

    def __init__(
        self,
        source: EmbeddingSource,
        lm: TinyLM,
        *,
        model_id: str,
        metrics: PrefillMetrics | None = None,
        limits: WorkerLimits = WorkerLimits(),
        rows: RowStore | None = None,
        compile: bool = False,
        device: str | torch.device = "cpu",
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.source = source
        self.model_id = model_id
        self.metrics = metrics if metrics is not None else PrefillMetrics()
        self.limits = limits
        c = lm.config
        self.out_hidden_size = c.hidden_size
        self.num_deepstack_levels = c.num_deepstack_levels
        self.fat_dim = c.hidden_size * (1 + c.num_deepstack_levels)
        self.graph = PrefillGraph(
            lm, max_model_len=limits.max_model_len, max_items=limits.max_items,
            min_bucket=limits.min_bucket, compile=compile, device=device)
        self.rows: RowStore = rows if rows is not None else StagingRows(
            self.fat_dim, block_size=limits.staging_block_size,
            num_blocks=self.graph.max_blocks(self._max_token_bucket(), limits.staging_block_size),
            dtype=self.graph.dtype, device=device)
        self.prefix_cache = PrefixCache(limits.prefix_block_size, limits.prefix_cache_blocks)
        self._clock = clock
        self._inputs: InputProcessor | None = None
        # One request at a time: the staging buffer and the graph are shared state.
        self._lock = threading.Lock()

    def _max_token_bucket(self) -> int:
        return bucket(self.limits.max_model_len, self.limits.min_bucket)

    @property
    def mode(self) -> CacheMode:
        return self.rows.mode

    @property
    def input_processor(self) -> InputProcessor:
        """Layer 1; built on first use from the encoder's preprocessing parameters (handshake)."""
        if self._inputs is None:
            params, fingerprint = self.source.media_params()
            self._inputs = InputProcessor(
                self.model_id, params, fingerprint, self.metrics, capacity=self.limits.mm_cache_items)
        return self._inputs

    # --- the request path ----------------------------------------------------------------

    def prefill(self, request: ChatRequest) -> PrefillResult:
        """Run one request; raises ECLoadFailure (EPD) / EncoderCacheReadError (monolithic)."""
        with self._lock:
            return self._prefill(request)

    def _prefill(self, request: ChatRequest) -> PrefillResult:
        started = self._clock()
        media = request.media
        if len(media) > self.limits.max_items:
            raise LimitExceededError(f"request has {len(media)} media items, the limit is {self.limits.max_items}")
        # Layer 1: every item, before any prefix logic.
        infos: list[tuple[MediaInfo, bool]] = [self.input_processor.process(m) for m in media]
        prompt = self._render(request, infos)
        tokens, spans = prompt.token_ids, prompt.spans
        if len(tokens) > self.limits.max_model_len:
            raise LimitExceededError(
                f"prompt of {len(tokens)} tokens exceeds max_model_len {self.limits.max_model_len}")
        ranges = [MediaRange(infos[s.index][0].mm_hash, s.offset, s.length) for s in spans]

        # Layer 2b: blocks before the last token; the last token is always computed.
        bs = self.limits.prefix_block_size
        hashes = block_hashes(tokens, ranges, bs)
        reusable = (len(tokens) - 1) // bs
        hit = self.prefix_cache.lookup(hashes, max_blocks=reusable)
        self.metrics.prefix_cache_queries.inc(reusable)
        self.metrics.prefix_cache_hits.inc(hit.num_blocks)
        start = hit.num_blocks * bs

        # Layer 2a, then the encoder, for items not entirely inside the prefix hit.
        layers: dict[int, str] = {}
        pending = [i for i, r in enumerate(ranges) if r.end > start]
        for i, r in enumerate(ranges):
            if r.end <= start:
                layers[i] = PREFIX
        pulled = self._resolve(pending, media, ranges, layers)

        scheduled = [ScheduledItem(ranges[i].mm_hash, ranges[i].offset, ranges[i].length, pulled.get(i))
                     for i in pending]
        window = (start, len(tokens))
        try:
            buffer, placements = self.rows.place(scheduled, window)
            step = self.graph.run(
                tokens[start:], start=start, prefix_kv=hit.kv, rows=buffer, placements=placements,
                spans=[(r.mm_hash, r.offset, r.length) for r in ranges], mode=self.mode)
        except ECLoadFailure as exc:
            # Raised by this worker's own checks (the client counts the failures it raises).
            self.metrics.load_failures.labels(reason=exc.reason.value).inc()
            raise
        self._store_blocks(hashes, hit.num_blocks, step.kv)
        first = int(torch.argmax(step.logits))
        ttft = self._clock() - started
        reports = tuple(
            ItemReport(i, media[i].kind, r.mm_hash, r.offset, r.length, infos[i][1], layers[i])
            for i, r in enumerate(ranges))
        logger.debug("prefill: %d tokens, %d from prefix, first token %d, %.1f ms",
                     len(tokens), start, first, ttft * 1e3)
        return PrefillResult(first, ttft, len(tokens), start, len(tokens) - start, reports, step.logits, step.shape)

    @staticmethod
    def _render(request: ChatRequest, infos: Sequence[tuple[MediaInfo, bool]]) -> RenderedPrompt:
        messages: list[tuple[str, list[TextPart | MediaPart]]] = []
        k = 0
        for message in request.messages:
            parts: list[TextPart | MediaPart] = []
            for part in message.parts:
                if isinstance(part, MediaItem):
                    parts.append(MediaPart(part.kind, infos[k][0].num_tokens))
                    k += 1
                else:
                    parts.append(TextPart(part))
            messages.append((message.role, parts))
        return render_chat(messages)

    def _resolve(
        self, pending: Sequence[int], media: Sequence[MediaItem], ranges: Sequence[MediaRange],
        layers: dict[int, str],
    ) -> dict[int, PulledItem]:
        """Layer 2a for each pending item, then one lookup and one encode for the rest."""
        out: dict[int, PulledItem] = {}
        resolved: dict[str, PulledItem] = {}
        first_of: dict[str, int] = {}  # mm_hash -> first pending item that carries it
        for i in pending:
            h = ranges[i].mm_hash
            self.metrics.scheduler_queries.inc()
            if h in first_of:  # already scheduled by this request: its rows serve both
                self.metrics.scheduler_hits.inc()
                layers[i] = LOCAL
                continue
            first_of[h] = i
            item = self.source.cached(h)
            if item is not None:
                self.metrics.scheduler_hits.inc()
                resolved[h] = item
                layers[i] = LOCAL
        missing = [h for h in first_of if h not in resolved]
        if missing:
            for h, item in zip(missing, self.source.lookup(missing), strict=True):
                if item is not None:
                    self.metrics.scheduler_hits.inc()
                    resolved[h] = item
                    layers[first_of[h]] = _LAYER_OF_SOURCE.get(item.source, ENCODER_HIT)
        to_encode = [h for h in missing if h not in resolved]
        if to_encode:
            specs = [self._spec(media[first_of[h]], first_of[h]) for h in to_encode]
            for h, item in zip(to_encode, self.source.encode(specs), strict=True):
                if item.mm_hash != h:
                    raise HandshakeError(
                        f"the encoder named item {first_of[h]} {item.mm_hash}, this worker computed {h}: "
                        "model id or preprocessing parameters differ")
                resolved[h] = item
                layers[first_of[h]] = _LAYER_OF_SOURCE.get(item.source, ENCODER_MISS)
        for i in pending:
            out[i] = resolved[ranges[i].mm_hash]
        return out

    @staticmethod
    def _spec(item: MediaItem, index: int) -> MediaSpec:
        uuid = item.label or f"item {index}"
        if item.kind == "image":
            return MediaSpec.image(item.frames[0], uuid)
        return MediaSpec.video(item.frames, item.fps, uuid)

    def _store_blocks(self, hashes: Sequence[bytes], first: int, kv: torch.Tensor) -> None:
        """KV of the full blocks computed by this step, cloned out of the step's output."""
        bs = self.limits.prefix_block_size
        start = first * bs
        blocks = [kv[:, :, b * bs - start:(b + 1) * bs - start].clone() for b in range(first, len(hashes))]
        self.prefix_cache.store(hashes, blocks, first)
