"""Registered memory regions as plain numbers, and the NIXL descriptors built from them (both processes).

The encoder describes each of its two regions (cache buffer, stamp region) as
``base address, stride, count, device, memory type``; the handshake carries
exactly these integers, and a prefill worker builds its
own ``N x 3`` descriptor arrays from them. Nothing a peer sends is ever
deserialized into an object (NIXL's ``get_serialized_descs`` is pickle).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import torch

from common.errors import HandshakeError
from common.wire import pb2

U64_LIMIT = 1 << 64
# A peer's count becomes a descriptor array of 24 bytes per element on our
# side: bound it (4 Mi blocks is far above any cache) so a bad handshake
# cannot make us allocate gigabytes. Also keeps int32 indices valid.
MAX_REGION_COUNT = 1 << 22


class MemoryKind(str, enum.Enum):
    """NIXL memory segment type of a region."""

    DRAM = "DRAM"
    VRAM = "VRAM"


_TO_PROTO = {MemoryKind.DRAM: pb2.MEMORY_TYPE_DRAM, MemoryKind.VRAM: pb2.MEMORY_TYPE_VRAM}
_FROM_PROTO = {value: kind for kind, value in _TO_PROTO.items()}


@dataclass(frozen=True, slots=True)
class RegionDesc:
    """``count`` equal elements of ``stride_bytes`` each, starting at ``base_address``."""

    base_address: int
    stride_bytes: int
    count: int
    device_id: int = 0
    memory: MemoryKind = MemoryKind.DRAM

    def __post_init__(self) -> None:
        if not 0 < self.base_address < U64_LIMIT:
            raise ValueError(f"region base_address must be in 1..2**64-1, got {self.base_address}")
        if self.stride_bytes <= 0:
            raise ValueError(f"region stride_bytes must be > 0, got {self.stride_bytes}")
        if not 0 < self.count <= MAX_REGION_COUNT:
            raise ValueError(f"region count must be in 1..{MAX_REGION_COUNT}, got {self.count}")
        if not 0 <= self.device_id < (1 << 32):
            raise ValueError(f"region device_id must be in 0..2**32-1, got {self.device_id}")
        if self.base_address + self.stride_bytes * self.count > U64_LIMIT:
            raise ValueError(
                f"region {self.base_address:#x} + {self.count} x {self.stride_bytes} bytes "
                f"runs past the 64-bit address space"
            )

    @property
    def nbytes(self) -> int:
        return self.stride_bytes * self.count

    @property
    def end_address(self) -> int:
        return self.base_address + self.nbytes

    @classmethod
    def of_tensor(cls, tensor: torch.Tensor) -> RegionDesc:
        """The region of a contiguous tensor, one element per index of its first dimension."""
        if not tensor.is_contiguous():
            raise ValueError("a registered region must be a contiguous tensor")
        if tensor.dim() == 0 or tensor.shape[0] == 0 or tensor.numel() == 0:
            raise ValueError(f"a registered region needs at least one element, got shape {tuple(tensor.shape)}")
        if tensor.device.type == "cpu":
            memory, device_id = MemoryKind.DRAM, 0
        elif tensor.device.type == "cuda":
            memory, device_id = MemoryKind.VRAM, tensor.get_device()
        else:
            raise ValueError(f"NIXL cannot register memory on device {tensor.device}")
        nbytes = tensor.numel() * tensor.element_size()
        return cls(tensor.data_ptr(), nbytes // tensor.shape[0], tensor.shape[0], device_id, memory)

    def descriptors(self) -> np.ndarray:
        """``[count, 3]`` uint64 rows ``(address, stride_bytes, device_id)``, one per element."""
        out = np.empty((self.count, 3), dtype=np.uint64)
        out[:, 0] = np.uint64(self.base_address) + np.arange(self.count, dtype=np.uint64) * np.uint64(
            self.stride_bytes
        )
        out[:, 1] = self.stride_bytes
        out[:, 2] = self.device_id
        return out

    def to_proto(self) -> pb2.MemoryRegion:
        return pb2.MemoryRegion(
            base_address=self.base_address,
            stride_bytes=self.stride_bytes,
            count=self.count,
            device_id=self.device_id,
            memory_type=_TO_PROTO[self.memory],
        )

    @classmethod
    def from_proto(cls, msg: pb2.MemoryRegion, what: str) -> RegionDesc:
        """The region a peer described; ``HandshakeError`` naming ``what`` when the numbers are bad."""
        memory = _FROM_PROTO.get(msg.memory_type)
        if memory is None:
            raise HandshakeError(f"{what}: unsupported memory_type {msg.memory_type}")
        try:
            return cls(msg.base_address, msg.stride_bytes, msg.count, msg.device_id, memory)
        except ValueError as exc:
            raise HandshakeError(f"{what}: {exc}") from None
