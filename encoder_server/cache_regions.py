"""Allocation and stamping of the encoder cache's two regions (encoder process).

The buffer and the stamp region (per block: its tag, then its generation,
int64 each, so one 16-byte descriptor READs both) are allocated once, by a
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(buffer, stamps)`` for ``layout``, checked; ``stamps[b] = [tag, generation]`` of block ``b``."""
    alloc = allocator if allocator is not None else zeros_allocator(device)
    buffer = _checked(alloc(layout.shape, layout.dtype), layout.shape, layout.dtype, "buffer")
    shape = (layout.num_blocks, 2)
    stamps = _checked(alloc(shape, TAG_DTYPE), shape, TAG_DTYPE, "stamps")
    if buffer.device != stamps.device:
        raise ConfigError(
            f"allocator placed the regions on different devices: buffer {buffer.device}, stamps {stamps.device}")
    # 0 means "empty" to a consumer; make sure, whatever the allocator did.
    stamps.zero_()
    logger.info(
        "encoder cache regions: %d blocks x %d rows x %d (%s, %d bytes) on %s",
        layout.num_blocks, layout.block_size, layout.fat_dim, layout.dtype,
        layout.buffer_bytes, buffer.device,
    )
    return buffer, stamps


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
    """Writes ``(fingerprint, generation)`` into blocks of the stamp region."""

    __slots__ = ("_stamps", "_host", "_sync")

    def __init__(self, stamps: torch.Tensor) -> None:
        self._stamps = stamps
        self._host: memoryview | None = None
        self._sync: Callable[[], None] | None = None
        if stamps.device.type == "cpu":
            # A view of the same memory (shared memory included), no copy; cast to "q"
            # so every platform stores 8-byte signed integers: tag at 2b, generation at 2b+1.
            self._host = _int64_view(stamps)
        else:
            self._sync = _synchronizer(stamps.device)

    def stamp(self, block_ids: Sequence[int], fingerprint: int, generation: int) -> None:
        host = self._host
        if host is not None:
            for block in block_ids:
                host[2 * block] = fingerprint
                host[2 * block + 1] = generation
            return
        index = torch.tensor(block_ids, dtype=torch.int64).to(self._stamps.device, non_blocking=False)
        self._stamps[:, 0].index_fill_(0, index, fingerprint)
        self._stamps[:, 1].index_fill_(0, index, generation)
        if self._sync is not None:
            self._sync()
