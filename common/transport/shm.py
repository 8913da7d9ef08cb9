"""POSIX shared-memory tensors for the mock transport (encoder allocates; prefill maps read-only).

The mock agent moves bytes between processes the way cross-memory-attach
does, but through files in ``/dev/shm``: the encoder allocates its regions
with :func:`shm_allocator`, the mock agent finds the segment behind each
registered address (:func:`find_segment`) and names it in its metadata, and a
consumer's mock agent maps that segment read-only (:func:`map_segment_readonly`)
and copies from it. Linux only (``/dev/shm``, ``mmap`` through libc).

Segments are named ``epd-mock-<pid namespace>-<pid>-<16 hex>``, created
``0600``, and unlinked when their last tensor is garbage collected. The
creator holds an exclusive ``flock`` on each segment for its lifetime, so
segments left behind by killed processes are recognised by a free lock (not
by a pid, which may be reused or belong to another PID namespace sharing
``/dev/shm``) and swept at the next allocation (:func:`sweep_stale_segments`);
segments of other PID namespaces are never touched. Real NIXL needs none of
this: any memory works with UCX.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import fcntl
import logging
import math
import os
import re
import secrets
import stat
import threading
import weakref
from dataclasses import dataclass

import torch

from common.errors import TransportError

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "epd-mock-"
SEGMENT_NAME = re.compile(r"^epd-mock-([0-9]{1,20})-([0-9]{1,10})-([0-9a-f]{16})$")

_PROT_READ = 0x1
_PROT_WRITE = 0x2
_MAP_SHARED = 0x01
_MAP_FIXED_NOREPLACE = 0x100000
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


@dataclass(frozen=True, slots=True)
class SegmentRef:
    """Where a registered address lives: segment name, offset into it, segment size."""

    name: str
    offset: int
    size: int


@dataclass(frozen=True, slots=True)
class _Owned:
    name: str
    address: int
    size: int
    lock_fd: int  # held open with an exclusive flock: "my creator is alive"


_registry_lock = threading.Lock()
_owned: dict[int, _Owned] = {}  # start address -> segment this process created
_starts: list[int] = []
_swept = False


def _mmap(fd: int, size: int, prot: int, address: int | None) -> int:
    flags = _MAP_SHARED | (_MAP_FIXED_NOREPLACE if address else 0)
    result = _libc.mmap(address or None, size, prot, flags, fd, 0)
    if result is None or result == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {size} bytes failed: {os.strerror(err)}")
    return int(result)


def _unmap(address: int, size: int) -> None:
    if _libc.munmap(address, size) != 0:
        logger.warning("munmap(%#x, %d) failed: errno %d", address, size, ctypes.get_errno())


def _release_owned(address: int, size: int, name: str, lock_fd: int) -> None:
    with _registry_lock:
        if _owned.pop(address, None) is not None:
            _starts.remove(address)
    _unmap(address, size)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(SHM_DIR, name))
    os.close(lock_fd)


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _abandoned(path: str) -> bool:
    """True when nobody holds the segment's creator lock (its creator exited)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    finally:
        os.close(fd)  # also drops the lock if we got it
    return True


def sweep_stale_segments() -> int:
    """Unlink this PID namespace's segments whose creator exited; returns how many."""
    removed = 0
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    namespace = str(_pid_namespace())
    for name in names:
        match = SEGMENT_NAME.match(name)
        if match is None or match.group(1) != namespace:
            continue
        path = os.path.join(SHM_DIR, name)
        if not _abandoned(path):
            continue
        with contextlib.suppress(OSError):
            os.unlink(path)
            removed += 1
    if removed:
        logger.info("removed %d shared-memory segments left by exited processes", removed)
    return removed


def shm_allocator(shape: tuple[int, ...], dtype: torch.dtype, *, address: int | None = None) -> torch.Tensor:
    """A zeroed, contiguous CPU tensor in a new POSIX shared-memory segment.

    ``address`` maps the segment exactly there (``MAP_FIXED_NOREPLACE``) or
    fails: tests use it to restart a producer at the same addresses.
    """
    global _swept
    if not _swept:
        _swept = True
        sweep_stale_segments()
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    size = max(nbytes, 1)
    name = f"{SEGMENT_PREFIX}{_pid_namespace()}-{os.getpid()}-{secrets.token_hex(8)}"
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise TransportError(f"cannot create shared-memory segment {path}: {exc}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held until the segment is released
        os.ftruncate(fd, size)
        mapped = _mmap(fd, size, _PROT_READ | _PROT_WRITE, address)
    except OSError as exc:
        os.close(fd)
        os.unlink(path)
        where = f" at {address:#x}" if address else ""
        raise TransportError(f"cannot map {size} bytes of shared memory{where}: {exc}") from exc
    if address and mapped != address:  # a kernel without MAP_FIXED_NOREPLACE treats it as a hint
        _unmap(mapped, size)
        os.close(fd)
        os.unlink(path)
        raise TransportError(f"shared memory wanted at {address:#x} was mapped at {mapped:#x}")
    # The ctypes array is the buffer torch keeps alive (views included); when
    # the last one goes, the finalizer unmaps, unlinks and drops the lock.
    buffer = (ctypes.c_ubyte * size).from_address(mapped)
    weakref.finalize(buffer, _release_owned, mapped, size, name, fd)
    with _registry_lock:
        _owned[mapped] = _Owned(name, mapped, size, fd)
        bisect.insort(_starts, mapped)
    flat = torch.frombuffer(buffer, dtype=torch.uint8)[:nbytes]
    return flat.view(dtype).view(shape)


def find_segment(address: int, length: int) -> SegmentRef | None:
    """The segment this process allocated that holds ``[address, address + length)``, if any."""
    with _registry_lock:
        i = bisect.bisect_right(_starts, address) - 1
        if i < 0:
            return None
        seg = _owned[_starts[i]]
    if address + length > seg.address + seg.size:
        return None
    return SegmentRef(seg.name, address - seg.address, seg.size)


class ReadOnlyMapping:
    """A read-only view of another process's segment; unmapped when garbage collected."""

    __slots__ = ("name", "address", "size", "__weakref__")

    def __init__(self, name: str, address: int, size: int) -> None:
        self.name = name
        self.address = address
        self.size = size
        weakref.finalize(self, _unmap, address, size)


def map_segment_readonly(name: str, min_size: int) -> ReadOnlyMapping:
    """Map segment ``name`` (which must look like ours and hold ``min_size`` bytes) read-only."""
    if SEGMENT_NAME.match(name) is None:
        raise ValueError(f"{name!r} is not a mock transport segment name")
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ValueError(f"cannot open shared-memory segment {name}: {exc}") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"shared-memory segment {name} is not a regular file")
        if info.st_size < max(min_size, 1):
            raise ValueError(f"shared-memory segment {name} has {info.st_size} bytes, needs {min_size}")
        address = _mmap(fd, info.st_size, _PROT_READ, None)
    except OSError as exc:
        raise ValueError(f"cannot map shared-memory segment {name}: {exc}") from exc
    finally:
        os.close(fd)
    return ReadOnlyMapping(name, address, info.st_size)
