"""The cached, static-shape encoder path: pack, launch, write into the cache (encoder process).

:class:`EncoderRunner` takes preprocessed items and the cache blocks allocated
for them, packs their frames into bucket-shaped launches (see :mod:`.packing`),
builds each launch's metadata on the host and runs the aliased-write graph
(see :mod:`.backends`), which scatters every output row straight into
``buffer[block, row]``. Padding rows land in the scratch block. The buffer is
never replaced: ``write`` returns the very object it was given.

On the eager and compiled backends a launch is one flat sequence of frames
attending each to itself, so a bucket is only a row count: any frames whose
rows fit go together. Eager launches are not padded at all; compiled ones
only to the backend's row multiple (its graphs take any row count in their
bucket's range). The Neuron backend packs frames into masked attention
blocks of ``attention_block`` tokens instead (see :mod:`.packing`), padded
to the bucket. :attr:`EncoderRunner.real_tokens` and ``computed_tokens``
count what the launches held and what they computed.

Buckets are in **merged tokens** (cache rows); ``max_batch_tokens`` is the
largest bucket. A batch of several items must fit in it (the caller splits
with :meth:`EncoderRunner.plan_batches`). A single item may be larger: its
frames are spread over several launches, and a frame larger than the
attention block runs in an exact-size launch (eager on every backend but
Neuron) so it never forces a recompile.

Not thread-safe: one encoder thread drives a runner.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from common.device import settle
from common.errors import ConfigError
from encoder_server.preprocess import ProcessedItem
from encoder_server.vision.backends import LaunchInputs, Layout, make_backend, padded_tokens
from encoder_server.vision.model import VisionEncoder
from encoder_server.vision.packing import BucketShape, FrameRef, Launch, bucket_shapes, plan_launches
from encoder_server.vision.positions import frame_interpolation, frame_positions

logger = logging.getLogger(__name__)

# Neuron only (masked blocks): 512 merged tokens = 2048 patches, the reference design's
# encoder attention block; the default preprocessing caps an image at 512 tokens, so every
# image fits one. A masked block costs O(block^2) whatever the frames in it, so bigger blocks
# waste compute on small images; smaller ones send large frames to the exact path.
DEFAULT_ATTENTION_BLOCK = 512
DEFAULT_BUCKETS: tuple[int, ...] = (64, 256, 512, 1024, 2048)


def default_tokens_per_block(num_tokens: int, block_size: int) -> list[int]:
    """Full blocks, then a partial last one: ``[bs, bs, ..., num_tokens % bs]``."""
    if num_tokens <= 0 or block_size <= 0:
        raise ValueError(f"num_tokens and block_size must be > 0, got {num_tokens} and {block_size}")
    full, rest = divmod(num_tokens, block_size)
    return [block_size] * full + ([rest] if rest else [])


def item_rows(index: int, num_tokens: int, blocks: Sequence[int], counts: Sequence[int], block_size: int,
              num_blocks: int, scratch: int, seen: dict[int, int]) -> torch.Tensor:
    """Flat buffer row of each of item ``index``'s tokens, after checking its blocks.

    ``seen`` maps the blocks of the batch's earlier items to their item and gains this one's.
    """
    if len(blocks) != len(counts) or not blocks:
        raise ValueError(f"item {index}: {len(blocks)} block ids but {len(counts)} tokens_per_block")
    if sum(counts) != num_tokens:
        raise ValueError(f"item {index}: tokens_per_block {list(counts)} sum to {sum(counts)}, "
                         f"item has {num_tokens} tokens")
    rows: list[torch.Tensor] = []
    for block, count in zip(blocks, counts):
        if not 0 <= block < num_blocks:
            raise ValueError(f"item {index}: block id {block} is outside [0, {num_blocks})")
        # The scratch block holds garbage by definition, so writing an item
        # there (a warm-up run) is allowed; any other block has one owner.
        if block in seen and block != scratch:
            raise ValueError(f"block {block} is given to item {seen[block]} and item {index}")
        if not 0 < count <= block_size:
            raise ValueError(f"item {index}: block {block} would hold {count} rows, block size is {block_size}")
        seen[block] = index
        rows.append(torch.arange(count, dtype=torch.int64) + block * block_size)
    return torch.cat(rows)


class EncoderRunner:
    """Runs the encoder graph over bucketed, block-packed batches into the cache buffer."""

    def __init__(
        self,
        encoder: VisionEncoder,
        *,
        block_size: int,
        buckets: Sequence[int] | None = None,
        backend: str = "auto",
        attention_block: int = DEFAULT_ATTENTION_BLOCK,
        pad_to_bucket: bool | None = None,
    ) -> None:
        """``pad_to_bucket``: None pads where the backend needs static shapes; True pads eager
        launches too, so they run exactly the inputs a compiled graph would see."""
        if block_size <= 0:
            raise ConfigError(f"block_size must be > 0, got {block_size}")
        self.encoder = encoder
        self.block_size = block_size
        sizes = tuple(buckets if buckets is not None else DEFAULT_BUCKETS)
        self._backend = make_backend(backend, encoder, sizes)
        self.backend: str = self._backend.name
        self._layout = self._backend.layout
        self._pad = self._backend.static_shapes or bool(pad_to_bucket)
        if self._layout is Layout.FRAMES:
            # One "block" per launch, the whole bucket: frames only need to fit its rows.
            attention_block = max(sizes, default=0)
        self._shapes = bucket_shapes(sizes, attention_block)
        self.buckets: tuple[int, ...] = tuple(s.tokens for s in self._shapes)
        self.max_batch_tokens: int = self.buckets[-1]
        self.attention_block = attention_block
        # Merged tokens of the items written, and of the launches that ran them (padding included).
        self.real_tokens = 0
        self.computed_tokens = 0
        logger.info("encoder runner: backend %s, buckets %s (merged tokens), %s layout",
                    self.backend, self.buckets, self._layout.value)

    # --- batching ---------------------------------------------------------------------

    def plan_batches(self, items: Sequence[ProcessedItem]) -> list[list[int]]:
        """Split item indices, in order, into batches ``write`` accepts (oversize items alone)."""
        batches: list[list[int]] = []
        current: list[int] = []
        used = 0
        for index, item in enumerate(items):
            if item.num_tokens > self.max_batch_tokens:
                if current:
                    batches.append(current)
                    current, used = [], 0
                batches.append([index])
                continue
            if used + item.num_tokens > self.max_batch_tokens:
                batches.append(current)
                current, used = [], 0
            current.append(index)
            used += item.num_tokens
        if current:
            batches.append(current)
        return batches

    # --- the write path ---------------------------------------------------------------

    def write(
        self,
        items: Sequence[ProcessedItem],
        block_ids: Sequence[Sequence[int]],
        tokens_per_block: Sequence[Sequence[int]],
        buffer: torch.Tensor,
        scratch_block_id: int,
    ) -> torch.Tensor:
        """Encode ``items`` and write token ``i`` of each into its blocks, in order.

        Block ``j`` of an item holds its next ``tokens_per_block[j]`` rows from row 0.
        The scratch block may be named (warm-up); no other block may be named twice.
        Returns ``buffer`` itself. Raises ValueError on inconsistent arguments or a
        batch of several items over ``max_batch_tokens``; nothing is written then.
        """
        self._check_buffer(buffer, scratch_block_id)
        if not (len(items) == len(block_ids) == len(tokens_per_block)):
            raise ValueError(
                f"items, block_ids and tokens_per_block differ in length: "
                f"{len(items)}, {len(block_ids)}, {len(tokens_per_block)}"
            )
        if not items:
            return buffer
        total = sum(item.num_tokens for item in items)
        if len(items) > 1 and total > self.max_batch_tokens:
            raise ValueError(
                f"batch of {len(items)} items has {total} tokens, more than the largest bucket "
                f"{self.max_batch_tokens}; split it with plan_batches()"
            )
        dests = self._destinations(items, block_ids, tokens_per_block, buffer.shape[0], scratch_block_id)
        frames = [
            FrameRef(index, frame, item.grid_thw[1] * item.grid_thw[2] // self.encoder.config.merge_unit)
            for index, item in enumerate(items)
            for frame in range(item.grid_thw[0])
        ]
        if self._layout is Layout.FRAMES:
            # Embed each item's patches once (a matmul per item); packing then moves rows of
            # hidden_size, not the pixels' patch_dim (24x narrower for Qwen3-VL).
            with torch.no_grad():
                sources = [self.encoder.embed_patches(item.pixel_values.to(self.encoder.device), item.repeat)
                           for item in items]
        else:
            # the blocks graph (Neuron) takes pixels of one static width: a still's rows are expanded
            sources = [item.hf_pixel_values().to(self.encoder.dtype) for item in items]
        for launch in plan_launches(frames, self._shapes):
            inputs = self._launch_inputs(launch, items, sources, dests, scratch_block_id)
            self.real_tokens += launch.real_tokens
            self.computed_tokens += int(inputs.dest.shape[0])
            result = self._backend.run(launch.shape, launch.exact, inputs, buffer)
            if result.data_ptr() != buffer.data_ptr():
                raise RuntimeError(f"backend {self.backend} returned a tensor that is not the cache buffer")
            logger.debug("launch %s: %d real tokens of %d", launch.shape, launch.real_tokens, launch.shape.tokens)
        settle(buffer.device)  # written means on the device: the answer naming these blocks goes out next
        return buffer

    def warmup(self, buffer: torch.Tensor, scratch_block_id: int,
               on_bucket: Callable[[int, int], None] | None = None) -> None:
        """Build every bucket's graph now (compile/trace); writes only into the scratch block.

        A compile takes seconds to minutes per bucket, so each bucket is logged with its time
        and ``on_bucket(ready, total)`` is called after it, for the server to report progress;
        an exception it raises stops the warm-up there.
        """
        self._check_buffer(buffer, scratch_block_id)
        for index, shape in enumerate(self._shapes, 1):
            started = time.perf_counter()
            launch = Launch(shape, (), exact=False)
            self._backend.run(shape, False, self._launch_inputs(launch, [], [], [], scratch_block_id), buffer)
            logger.info("warm-up bucket %d/%d (shape %s): %.1f s",
                        index, len(self._shapes), shape, time.perf_counter() - started)
            if on_bucket is not None:
                on_bucket(index, len(self._shapes))

    # --- helpers ----------------------------------------------------------------------

    def _check_buffer(self, buffer: torch.Tensor, scratch_block_id: int) -> None:
        fat_dim = self.encoder.fat_dim
        if buffer.dim() != 3 or buffer.shape[1] != self.block_size or buffer.shape[2] != fat_dim:
            raise ValueError(
                f"cache buffer shape {tuple(buffer.shape)} is not [num_blocks, {self.block_size}, {fat_dim}]"
            )
        if not buffer.is_contiguous():
            raise ValueError("cache buffer must be contiguous")
        if buffer.device != self.encoder.device:
            raise ValueError(f"cache buffer is on {buffer.device}, the encoder on {self.encoder.device}")
        if not 0 <= scratch_block_id < buffer.shape[0]:
            raise ValueError(f"scratch_block_id {scratch_block_id} outside [0, {buffer.shape[0]})")

    def _destinations(
        self,
        items: Sequence[ProcessedItem],
        block_ids: Sequence[Sequence[int]],
        tokens_per_block: Sequence[Sequence[int]],
        num_blocks: int,
        scratch: int,
    ) -> list[torch.Tensor]:
        """Flat buffer row of every token of every item, after checking all of it."""
        cfg = self.encoder.config
        seen: dict[int, int] = {}
        dests: list[torch.Tensor] = []
        for index, (item, blocks, counts) in enumerate(zip(items, block_ids, tokens_per_block)):
            t, h, w = item.grid_thw
            if h % cfg.spatial_merge_size or w % cfg.spatial_merge_size or t <= 0:
                raise ValueError(f"item {index}: grid {item.grid_thw} does not fit merge size {cfg.spatial_merge_size}")
            if item.repeat not in (1, cfg.temporal_patch_size) or (item.repeat > 1 and t != 1):
                raise ValueError(f"item {index}: repeat {item.repeat} with grid {item.grid_thw}: rows stand for 1 "
                                 f"or, with t 1, {cfg.temporal_patch_size} (the temporal patch) copies of a frame")
            width = cfg.patch_dim // item.repeat
            if tuple(item.pixel_values.shape) != (t * h * w, width):
                raise ValueError(
                    f"item {index}: pixel_values shape {tuple(item.pixel_values.shape)} does not match "
                    f"grid {item.grid_thw} and patch_dim {width} (repeat {item.repeat})"
                )
            if item.num_tokens != t * h * w // cfg.merge_unit:
                raise ValueError(f"item {index}: num_tokens {item.num_tokens} != t*h*w/merge^2 of {item.grid_thw}")
            dests.append(item_rows(index, item.num_tokens, blocks, counts, self.block_size, num_blocks, scratch, seen))
        return dests

    def _launch_inputs(
        self,
        launch: Launch,
        items: Sequence[ProcessedItem],
        sources: Sequence[torch.Tensor],
        dests: Sequence[torch.Tensor],
        scratch: int,
    ) -> LaunchInputs:
        """Inputs of one launch; ``sources[i]``: item ``i``'s patch embeddings (frames layout) or pixels."""
        cfg = self.encoder.config
        unit, merge, side = cfg.merge_unit, cfg.spatial_merge_size, cfg.num_grid_per_side
        frames_layout = self._layout is Layout.FRAMES
        block_rows = launch.shape.block_tokens * unit
        if frames_layout and not self._pad and launch.blocks:
            # Padded only to the backend's row multiple (a warm-up launch, no frames: the whole bucket).
            tokens = launch.real_tokens if launch.exact else padded_tokens(
                launch.real_tokens, self._backend.row_multiple, launch.shape.tokens)
            total = tokens * unit
        else:
            total = launch.shape.tokens * unit
        # Each frame's first row: back to back (frames layout) or from its block's start.
        placed: list[tuple[int, FrameRef]] = []
        cursor = 0
        for b, block in enumerate(launch.blocks):
            if not frames_layout:
                cursor = b * block_rows
            for ref in block:
                placed.append((cursor, ref))
                cursor += ref.tokens * unit
        pieces: dict[str, list[torch.Tensor]] = {"patches": [], "index": [], "weight": [], "positions": [],
                                                 "segments": [], "dest": []}
        device, dtype = self.encoder.device, self.encoder.dtype
        width = cfg.hidden_size if frames_layout else cfg.patch_dim

        def pad(start: int, end: int) -> None:
            rows = end - start
            if rows:
                pieces["patches"].append(torch.zeros(rows, width, dtype=dtype, device=device))
                pieces["index"].append(torch.zeros(rows, 4, dtype=torch.int64))
                pieces["weight"].append(torch.zeros(rows, 4, dtype=torch.float32))
                pieces["positions"].append(torch.zeros(rows, 2, dtype=torch.int64))
                pieces["segments"].append(torch.full((rows,), -1, dtype=torch.int32))
                # Padding rows go to the scratch block, spread over its rows.
                tokens = torch.arange(start // unit, end // unit, dtype=torch.int64)
                pieces["dest"].append(tokens % self.block_size + scratch * self.block_size)

        cursor = 0
        for segment, (start, ref) in enumerate(placed):
            pad(cursor, start)
            item = items[ref.item]
            _, h, w = item.grid_thw
            rows = h * w
            pieces["patches"].append(sources[ref.item][ref.frame * rows:(ref.frame + 1) * rows])
            index, weight = frame_interpolation(h, w, merge, side)
            pieces["index"].append(index)
            pieces["weight"].append(weight)
            pieces["positions"].append(frame_positions(h, w, merge))
            pieces["segments"].append(torch.full((rows,), segment, dtype=torch.int32))
            pieces["dest"].append(dests[ref.item][ref.frame * ref.tokens:(ref.frame + 1) * ref.tokens])
            cursor = start + rows
        pad(cursor, total)
        if frames_layout:
            lengths = [ref.tokens * unit for _, ref in placed]
            slots = launch.shape.tokens if self._pad else (self._backend.frame_slots or len(lengths))
            frames = torch.tensor(lengths + [0] * (slots - len(lengths)), dtype=torch.int64)
            segments = torch.empty(0, dtype=torch.int32)
        else:
            frames = torch.empty(0, dtype=torch.int64)
            segments = torch.cat(pieces["segments"])
        return LaunchInputs(
            patches=torch.cat(pieces["patches"]).to(device, non_blocking=True),
            interp_index=torch.cat(pieces["index"]).to(device, non_blocking=True),
            interp_weight=torch.cat(pieces["weight"]).to(device, non_blocking=True),
            positions=torch.cat(pieces["positions"]).to(device, non_blocking=True),
            frames=frames,
            segments=segments.to(device, non_blocking=True),
            dest=torch.cat(pieces["dest"]).to(device, non_blocking=True),
        )


__all__ = ["DEFAULT_ATTENTION_BLOCK", "DEFAULT_BUCKETS", "BucketShape", "EncoderRunner", "default_tokens_per_block"]
