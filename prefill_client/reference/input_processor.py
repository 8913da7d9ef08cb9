"""Layer 1 of the prefill worker: content hash -> mm_hash, grid, placeholder count (prefill process).

The worker runs this on every media item of every request, before any prefix
logic, exactly as the reference's input processor does: each item is one
``vllm:mm_cache_queries``, and a content hash seen before is a
``vllm:mm_cache_hits``. Nothing here calls the encoder: the grid comes from
the image header (EXIF aware) and the encoder's preprocessing parameters
(from the handshake), and the ``mm_hash`` from the model id, the parameters'
fingerprint and the content hash — the same three inputs the encoder hashes,
so the worker can key its prefix cache before it asks the encoder anything.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from common import media
from common.errors import HandshakeError, InvalidMediaError
from common.metrics import InputProcessorMetrics
from prefill_client.reference.chat import MediaItem

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class MediaInfo:
    """What layer 1 knows about an item without decoding it."""

    content_hash: str
    mm_hash: str
    grid_thw: tuple[int, int, int]
    num_tokens: int  # placeholders in the prompt = rows the encoder produces


class InputProcessor:
    """LRU of :class:`MediaInfo` by content hash, counting layer-1 metrics."""

    def __init__(
        self,
        model_id: str,
        params: media.PreprocessParams,
        preprocess_fingerprint: str,
        metrics: InputProcessorMetrics,
        *,
        capacity: int = 1024,
    ) -> None:
        if capacity <= 0:
            raise ValueError(f"input-processor capacity must be > 0, got {capacity}")
        sizes = (params.patch_size, params.merge_size, params.temporal_patch_size, params.min_pixels,
                 params.max_pixels)
        # Zeros here mean an encoder that did not announce its preprocessing: every
        # placeholder count would be wrong, so refuse before hashing anything.
        if min(sizes) <= 0 or params.min_pixels > params.max_pixels or not preprocess_fingerprint:
            raise HandshakeError(
                f"encoder announced unusable preprocessing parameters {params} "
                f"(fingerprint {preprocess_fingerprint!r})")
        self.model_id = model_id
        self.params = params
        self.preprocess_fingerprint = preprocess_fingerprint
        self.metrics = metrics
        self.capacity = capacity
        self._lru: collections.OrderedDict[str, MediaInfo] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._lru)

    def process(self, item: MediaItem) -> tuple[MediaInfo, bool]:
        """The item's info and whether layer 1 had it (every call is a query)."""
        key = item.content_hash()
        self.metrics.mm_cache_queries.inc()
        with self._lock:
            info = self._lru.get(key)
            if info is not None:
                self._lru.move_to_end(key)
                self.metrics.mm_cache_hits.inc()
                return info, True
        info = self._compute(item, key)
        with self._lock:
            self._lru[key] = info
            while len(self._lru) > self.capacity:
                self._lru.popitem(last=False)
        return info, False

    def _compute(self, item: MediaItem, content_hash: str) -> MediaInfo:
        label = item.label or item.kind
        if item.kind == "image":
            height, width = media.probe_image_size(item.frames[0], label)
            grid = self._grid(lambda: media.image_grid(height, width, self.params), label)
        else:
            sizes = {media.probe_image_size(f, f"{label} frame {i}") for i, f in enumerate(item.frames)}
            if len(sizes) != 1:
                raise InvalidMediaError(label, f"frames of one video must share a size, got {sorted(sizes)}")
            height, width = sizes.pop()
            grid = self._grid(lambda: media.video_grid(len(item.frames), height, width, self.params, item.fps), label)
        tokens = media.num_tokens(grid, self.params.merge_size)
        if tokens <= 0:
            raise InvalidMediaError(label, f"grid {grid} gives no tokens at merge size {self.params.merge_size}")
        mm_hash = media.mm_hash(self.model_id, self.preprocess_fingerprint, content_hash)
        return MediaInfo(content_hash, mm_hash, grid, tokens)

    @staticmethod
    def _grid(compute: Callable[[], tuple[int, int, int]], label: str) -> tuple[int, int, int]:
        try:
            return compute()
        except ValueError as exc:  # size or aspect ratio out of bounds
            raise InvalidMediaError(label, str(exc)) from exc
