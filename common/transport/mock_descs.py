"""Descriptor lists of the mock NIXL agent (both processes).

The mock accepts what NIXL's ``register_memory`` / ``prep_xfer_dlist`` accept
in this project: a contiguous tensor, a list of tensors, or an ``N x 3``
uint64 array ``(address, length, device)`` with a memory type.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from common.transport.mock_errors import nixlInvalidParamError, nixlNotSupportedError

if TYPE_CHECKING:
    from common.transport.mock_agent import _Remote


@dataclass(frozen=True, slots=True)
class MockRegDList:
    """Registered memory: rows ``(address, length, device)``."""

    rows: tuple[tuple[int, int, int], ...]
    memory: str


@dataclass(slots=True, eq=False)
class MockDlistHandle:
    """A prepped descriptor list: local (``remote is None``) or of one remote agent incarnation.

    For a remote list ``addresses`` are where each descriptor's bytes sit in
    this process's read-only mapping of the remote segment.
    """

    remote: _Remote | None
    addresses: np.ndarray
    lengths: np.ndarray
    released: bool = field(default=False)

    def release(self) -> None:
        self.released = True


def _tensor_row(tensor: torch.Tensor) -> tuple[tuple[int, int, int], str]:
    if not tensor.is_contiguous():
        raise nixlInvalidParamError("mock: tensors must be contiguous")
    memory = "DRAM" if tensor.device.type == "cpu" else "VRAM"
    device = 0 if tensor.device.type == "cpu" else tensor.get_device()
    return (tensor.data_ptr(), tensor.numel() * tensor.element_size(), device), memory


def as_descriptors(descs: Any, mem_type: str | None) -> MockRegDList:
    """Rows and memory type of a tensor, a list of tensors, or an ``N x 3`` array."""
    if isinstance(descs, MockRegDList):
        return descs
    if isinstance(descs, torch.Tensor):
        row, memory = _tensor_row(descs)
        return MockRegDList((row,), memory)
    if isinstance(descs, (list, tuple)) and descs and all(isinstance(t, torch.Tensor) for t in descs):
        pairs = [_tensor_row(t) for t in descs]
        if len({memory for _, memory in pairs}) != 1:
            raise nixlInvalidParamError("mock: tensors on different memory types in one list")
        return MockRegDList(tuple(row for row, _ in pairs), pairs[0][1])
    if isinstance(descs, np.ndarray):
        if descs.ndim != 2 or descs.shape[1] != 3 or mem_type is None:
            raise nixlInvalidParamError("mock: an N x 3 array with a memory type is required")
        if mem_type not in ("DRAM", "VRAM"):
            raise nixlNotSupportedError(f"mock: memory type {mem_type!r}")
        rows = tuple((int(a), int(n), int(d)) for a, n, d in descs.astype(np.uint64).tolist())
        if any(n == 0 for _, n, _ in rows):
            raise nixlInvalidParamError("mock: zero-length descriptor")
        return MockRegDList(rows, mem_type)
    raise nixlInvalidParamError(f"mock: unsupported descriptor input {type(descs).__name__}")


def merge_runs(
    dst: np.ndarray, src: np.ndarray, lengths: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge descriptors contiguous on both sides into runs (NIXL merges them too)."""
    if len(dst) == 1:
        return dst, src, lengths
    brk = np.ones(len(dst), dtype=bool)
    brk[1:] = (dst[1:] != dst[:-1] + lengths[:-1]) | (src[1:] != src[:-1] + lengths[:-1])
    starts = np.flatnonzero(brk)
    return dst[starts], src[starts], np.add.reduceat(lengths, starts)
