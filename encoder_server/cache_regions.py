"""Allocation and stamping of the encoder cache's three regions (encoder process).

The buffer, the tag region and the generation region are allocated once, by a
pluggable allocator (the transport passes one that places them in shared
memory; the default is ``torch.zeros`` on a device), and are never reallocated:
their addresses are registered with the transport and sent in the handshake.

:class:`DeviceStamper` writes a tag and a generation into a list of blocks.
On the CPU it writes through a ``memoryview`` of the same memory: a scalar
store costs a small fraction of a torch indexing call, and allocate sits on
the request path. On an accelerator it fills through an index tensor and then
synchronizes, so the stamp is complete before the encoder graph that writes
the data is launched, whatever stream that graph runs on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from common.errors import ConfigError
from common.layout import TAG_DTYPE, CacheLayout

logger = logging.getLogger(__name__)

TensorAllocator = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
"""Returns a zeroed, contiguous tensor of the given shape and dtype."""


def zeros_allocator(device: str | torch.device) -> TensorAllocator:
    """The default allocator: ``torch.zeros`` on ``device``."""
    dev = torch.device(device)

    def allocate(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=dev)

    return allocate


def _checked(tensor: object, shape: tuple[int, ...], dtype: torch.dtype, name: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise ConfigError(f"allocator returned {type(tensor).__name__} for {name}, expected a torch.Tensor")
    if tuple(tensor.shape) != shape or tensor.dtype != dtype:
        raise ConfigError(
            f"allocator returned {name} of shape {tuple(tensor.shape)} dtype {tensor.dtype}, "
            f"expected shape {shape} dtype {dtype}"
        )
    if not tensor.is_contiguous():
        raise ConfigError(f"allocator returned a non-contiguous {name}")
    return tensor


def allocate_regions(
    layout: CacheLayout, device: str | torch.device, allocator: TensorAllocator | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(buffer, mm_hash_tags, block_generations)`` for ``layout``, checked."""
    alloc = allocator if allocator is not None else zeros_allocator(device)
    buffer = _checked(alloc(layout.shape, layout.dtype), layout.shape, layout.dtype, "buffer")
    tags = _checked(alloc((layout.num_blocks,), TAG_DTYPE), (layout.num_blocks,), TAG_DTYPE, "mm_hash_tags")
    generations = _checked(
        alloc((layout.num_blocks,), TAG_DTYPE), (layout.num_blocks,), TAG_DTYPE, "block_generations"
    )
    if not (buffer.device == tags.device == generations.device):
        raise ConfigError(
            f"allocator placed the regions on different devices: buffer {buffer.device}, "
            f"tags {tags.device}, generations {generations.device}"
        )
    # 0 means "empty" to a consumer; make sure, whatever the allocator did.
    tags.zero_()
    generations.zero_()
    logger.info(
        "encoder cache regions: %d blocks x %d rows x %d (%s, %d bytes) on %s",
        layout.num_blocks, layout.block_size, layout.fat_dim, layout.dtype,
        layout.buffer_bytes, buffer.device,
    )
    return buffer, tags, generations


def _synchronizer(device: torch.device) -> Callable[[], None]:
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        current = accelerator.current_accelerator()
        if current is not None and current.type == device.type:
            return lambda: accelerator.synchronize(device)
    backend = getattr(torch, device.type, None)
    sync = getattr(backend, "synchronize", None)
    if callable(sync):
        return lambda: sync(device)
    raise ConfigError(f"no way to synchronize device {device}: cannot order tag stamps before writes")


def _int64_view(tensor: torch.Tensor) -> memoryview:
    return tensor.numpy().data.cast("B").cast("q")


class DeviceStamper:
    """Writes ``(fingerprint, generation)`` into blocks of the tag and generation regions."""

    __slots__ = ("_tags", "_generations", "_host_tags", "_host_generations", "_sync")

    def __init__(self, tags: torch.Tensor, generations: torch.Tensor) -> None:
        self._tags = tags
        self._generations = generations
        self._host_tags: memoryview | None = None
        self._host_generations: memoryview | None = None
        self._sync: Callable[[], None] | None = None
        if tags.device.type == "cpu":
            # Views of the same memory (shared memory included), no copies;
            # cast to "q" so every platform stores 8-byte signed integers.
            self._host_tags = _int64_view(tags)
            self._host_generations = _int64_view(generations)
        else:
            self._sync = _synchronizer(tags.device)

    def stamp(self, block_ids: Sequence[int], fingerprint: int, generation: int) -> None:
        host_tags, host_generations = self._host_tags, self._host_generations
        if host_tags is not None and host_generations is not None:
            for block in block_ids:
                host_tags[block] = fingerprint
                host_generations[block] = generation
            return
        index = torch.tensor(block_ids, dtype=torch.int64).to(self._tags.device, non_blocking=False)
        self._tags.index_fill_(0, index, fingerprint)
        self._generations.index_fill_(0, index, generation)
        if self._sync is not None:
            self._sync()
