"""glibc malloc settings for processes that move tens of MB per RPC (encoder and prefill processes).

An ``Encode`` of 30 images is a 24 MB message: the client frames it, gRPC
copies it, the encoder receives it into fresh buffers, and all of them are
freed a few milliseconds later. With glibc's defaults such buffers live just
above its dynamic mmap threshold or at the top of the heap, and are given back
to the kernel when freed (``munmap``, or a heap trim past ``2 x`` the
threshold); the next request maps them again, and every page of them faults
and is zeroed by the kernel. Measured (``bench/hit_path.py``, BENCHMARKS.md
"Hit path"): a cached ``Encode`` of 30 images took 80 ms with the defaults and
32-34 ms with freed memory kept, and the echo server it is compared with
31 ms against 21 ms.

:func:`keep_freed_memory` fixes the mmap threshold at 64 MiB and the trim
threshold at 256 MiB (``mallopt``), so buffers up to 64 MiB come from the heap
and up to 256 MiB of freed heap stay mapped for reuse: a process's resident
memory may stay that much above its live data. It runs once at the start of
``epd encoder`` and ``epd prefill`` (``--keep-freed-memory``). A library user
(a vLLM worker holding an :class:`~prefill_client.consumer.client.EncoderCacheClient`)
can call it, or set glibc's own ``MALLOC_MMAP_THRESHOLD_`` /
``MALLOC_TRIM_THRESHOLD_``; when either is set in the environment this
module leaves malloc alone. Elsewhere than glibc it does nothing.

Keeping freed memory does not help memory that was never freed: a vLLM worker's encoder cache
holds every pulled item until it evicts one, so until then each new item's rows are fresh pages
(a 224 px Qwen3-VL image in float32: 2 MiB, 512 page faults, 1.5-12 ms of a pull on 2 cores
against 0.4 ms for its READ). :func:`prefault` maps and touches memory in the calling thread's
malloc arena and frees it again: with the thresholds above it stays mapped, and that thread's
next allocations take it without a fault.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform
from collections.abc import Mapping

logger = logging.getLogger(__name__)

MMAP_THRESHOLD_BYTES = 64 << 20
TRIM_THRESHOLD_BYTES = 256 << 20
# mallopt parameters (<malloc.h>)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
PREFAULT_PIECE_BYTES = 2 << 20
_kept = False  # keep_freed_memory set the thresholds in this process


def keep_freed_memory(environ: Mapping[str, str] = os.environ) -> bool:
    """Set glibc's mmap and trim thresholds (see the module docstring); ``True`` if they were set."""
    if platform.libc_ver()[0] != "glibc":
        return False
    preset = [name for name in _ENV if name in environ]
    if preset:
        logger.info("malloc: thresholds left as %s sets them", ", ".join(preset))
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    # mallopt returns 1 on success, 0 on error.
    done = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
                and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1)
    global _kept
    _kept = _kept or done
    if done:
        logger.info("malloc: buffers up to %d MiB from the heap, up to %d MiB of freed memory kept for reuse",
                    MMAP_THRESHOLD_BYTES >> 20, TRIM_THRESHOLD_BYTES >> 20)
    else:
        logger.warning("malloc: mallopt refused the thresholds; large messages will page-fault fresh memory")
    return done


def prefault(nbytes: int, piece: int = PREFAULT_PIECE_BYTES) -> bool:
    """Map and touch ``nbytes`` of heap in the calling thread's malloc arena, in ``piece``-sized
    allocations, then free them; ``True`` if done.

    Only once :func:`keep_freed_memory` set the thresholds in this process (else glibc would give
    the memory straight back): the arena then keeps it mapped, and the calling thread's next
    allocations up to about ``nbytes`` in all, each under the 64 MiB mmap threshold, take it
    without a page fault; memory they free later is reused the same way. The process's resident
    memory grows by ``nbytes`` at once instead of as it is used.
    """
    if not _kept or nbytes <= 0:
        return False
    pieces: list[bytearray] = []
    try:
        for _ in range(-(-nbytes // piece)):
            pieces.append(bytearray(piece))  # zero-filled: every page written, so mapped
    except MemoryError:
        logger.warning("malloc: could not prefault %d MiB (got %d MiB)", nbytes >> 20, len(pieces) * piece >> 20)
    done = bool(pieces)
    pieces.clear()
    return done
