"""Landing blocks and tag slots a consumer READs into, with quarantine (prefill process).

A prefill worker READs remote blocks into its own registered landing blocks
and the remote tags into small registered tag slots. Both are numbered slots
handed out by a :class:`SlotPool`.

Quarantine rule. NIXL has no transfer timeout and releasing an in-flight
READ does not stop its data (measured: with a frozen producer, data landed
after the handle was released and after ``remove_remote_agent``). So when our
deadline passes, the slots of that READ are *quarantined*: they leave their
caller and are not handed out again until the
transfer is **proven quiet** — a later poll of the kept transfer handle says
``DONE`` or ``ERR``, or reports the peer disconnected. Removing the remote
agent is not proof; slots whose proof became impossible stay out for good.
``sweep()`` runs the proofs; ``acquire()`` calls it when slots are short.
The same happens when a poll fails without saying how the transfer ended.
Releasing a quarantined slot is a no-op, so callers may always release.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from common.errors import HandshakeError
from common.wire import pb2

logger = logging.getLogger(__name__)

QuietProbe = Callable[[], bool]
"""Returns True once the quarantined transfer can no longer write (and from then on)."""

# Largest landing block accepted from a handshake: the consumer allocates
# num_landing_blocks of them, so a bad layout must not size that freely.
MAX_BLOCK_BYTES = 1 << 30
_FREE, _HELD, _QUARANTINED = 0, 1, 2
_STATE_NAMES = {_FREE: "free", _HELD: "held", _QUARANTINED: "quarantined"}
_PROTO_DTYPES = {
    pb2.D_TYPE_BFLOAT16: torch.bfloat16,
    pb2.D_TYPE_FLOAT16: torch.float16,
    pb2.D_TYPE_FLOAT32: torch.float32,
}


@dataclass(frozen=True, slots=True)
class LandingShape:
    """Rows per block, row width and dtype of one landing block (the producer's block)."""

    block_size: int
    fat_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.fat_dim <= 0:
            raise ValueError(f"block_size and fat_dim must be > 0, got {self.block_size} and {self.fat_dim}")

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.fat_dim * torch.empty((), dtype=self.dtype).element_size()

    @classmethod
    def from_proto(cls, layout: pb2.CacheLayout) -> LandingShape:
        dtype = _PROTO_DTYPES.get(layout.dtype)
        if dtype is None:
            raise HandshakeError(f"producer layout has unsupported dtype {layout.dtype}")
        try:
            shape = cls(layout.block_size, layout.fat_dim, dtype)
        except ValueError as exc:
            raise HandshakeError(f"producer layout: {exc}") from None
        if shape.bytes_per_block > MAX_BLOCK_BYTES:
            raise HandshakeError(f"producer layout has {shape.bytes_per_block} bytes per block; "
                                 f"at most {MAX_BLOCK_BYTES} are accepted")
        return shape


def checked_ids(ids: object, limit: int, what: str, *, unique: bool = False) -> np.ndarray:
    """``ids`` as a 1-D integer array after checking each is in ``0..limit-1`` (and, with
    ``unique``, that none repeats); ``ValueError`` naming the first bad one otherwise.

    Runs several times on every pull: plain Python over the (short) list is cheaper than
    a chain of numpy calls on tiny arrays.
    """
    arr = np.asarray(ids)
    if arr.ndim != 1 or arr.size == 0 or arr.dtype.kind not in "iu":
        raise ValueError(f"{what}s must be a non-empty 1-D integer array, got {ids!r}")
    values = arr.tolist()
    if min(values) < 0 or max(values) >= limit:
        bad = next(v for v in values if not 0 <= v < limit)
        raise ValueError(f"{what} {bad} is outside 0..{limit - 1}")
    if unique and len(set(values)) != len(values):
        raise ValueError(f"{what}s repeat: {values}")
    return arr


@dataclass(slots=True, eq=False)
class _Quarantined:
    ids: np.ndarray
    probe: QuietProbe


class SlotPool:
    """Free list of ``size`` numbered slots; held, free or quarantined, never two at once."""

    def __init__(
        self,
        size: int,
        *,
        what: str = "slot",
        clock: Callable[[], float] = time.monotonic,
        sweep_interval_s: float = 0.01,
    ) -> None:
        if size <= 0:
            raise ValueError(f"a {what} pool needs at least one slot, got {size}")
        self.size = size
        self.what = what
        self._clock = clock
        self._sweep_interval_s = sweep_interval_s
        self._lock = threading.Lock()
        self._sweep_lock = threading.Lock()
        # A bytearray: per-slot reads and writes cost tens of nanoseconds, against
        # microseconds for numpy's fancy indexing on the few ids of one pull.
        self._state = bytearray(size)  # every slot _FREE (0)
        self._free: collections.deque[int] = collections.deque(range(size))
        self._quarantine: list[_Quarantined] = []
        self._last_sweep = float("-inf")

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_quarantined(self) -> int:
        return self._state.count(_QUARANTINED)

    @property
    def num_held(self) -> int:
        return self._state.count(_HELD)

    def quarantined_ids(self) -> np.ndarray:
        return np.flatnonzero(np.frombuffer(self._state, dtype=np.int8) == _QUARANTINED).astype(np.int32)

    def _ids(self, ids: object) -> tuple[np.ndarray, list[int]]:
        arr = checked_ids(ids, self.size, f"{self.what} id", unique=True)
        return arr, arr.tolist()

    def _require(self, values: list[int], state: int, action: str) -> None:
        for slot in values:
            if self._state[slot] != state:
                state_name = _STATE_NAMES[self._state[slot]]
                raise ValueError(f"cannot {action} {self.what} {slot}: it is {state_name}")

    def acquire(self, n: int) -> np.ndarray | None:
        """``n`` held slot ids (int32), or ``None`` when fewer are free (capacity, not an error)."""
        if n <= 0:
            raise ValueError(f"acquire needs n >= 1, got {n}")
        if self._quarantine and (len(self._free) < n
                                 or self._clock() - self._last_sweep >= self._sweep_interval_s):
            self.sweep()
        with self._lock:
            if len(self._free) < n:
                return None
            taken = [self._free.popleft() for _ in range(n)]
            for slot in taken:
                self._state[slot] = _HELD
            return np.array(taken, dtype=np.int32)

    def check_held(self, ids: object) -> np.ndarray:
        """``ids`` as an integer array after checking each is held (handed out and not returned)."""
        arr, values = self._ids(ids)
        with self._lock:
            self._require(values, _HELD, "use")
        return arr

    def held_ids(self, ids: object) -> tuple[np.ndarray, list[int]]:
        """:meth:`check_held` that also returns the ids as a list: ``(int32 array, list)``.

        Every pull checks its landing ids with this, often while the CPU caches
        are cold from the previous pull's copy, when each Python call costs
        several times its warm price; so the common case is one pass over the
        list, and only a bad input takes :meth:`check_held`'s way to its error.
        """
        arr = np.asarray(ids)
        if arr.ndim == 1 and arr.dtype.kind in "iu":
            values = arr.tolist()
            state, size = self._state, self.size
            if values and len(set(values)) == len(values):
                with self._lock:
                    for slot in values:
                        if not (0 <= slot < size and state[slot] == _HELD):
                            break
                    else:
                        return arr.astype(np.int32, copy=False), values
        return self.check_held(ids).astype(np.int32, copy=False), arr.tolist()

    def release(self, ids: object) -> None:
        """Return held slots. Quarantined ones are skipped (they return once proven quiet), so a
        caller may always release in ``finally``; releasing a free slot is an error."""
        _, values = self._ids(ids)
        with self._lock:
            values = [slot for slot in values if self._state[slot] != _QUARANTINED]
            self._require(values, _HELD, "release")
            for slot in values:
                self._state[slot] = _FREE
            self._free.extend(values)

    def quarantine(self, ids: object, probe: QuietProbe) -> None:
        """Take held slots from their caller until ``probe()`` proves their transfer quiet."""
        arr, values = self._ids(ids)
        with self._lock:
            self._require(values, _HELD, "quarantine")
            for slot in values:
                self._state[slot] = _QUARANTINED
            self._quarantine.append(_Quarantined(arr, probe))
        logger.warning("quarantined %s(s) %s until their transfer is proven quiet", self.what, arr.tolist())

    def sweep(self) -> int:
        """Run the quarantine proofs; returns how many slots came back."""
        if not self._sweep_lock.acquire(blocking=False):
            return 0  # another thread is sweeping; a probe must not run twice at once
        try:
            with self._lock:
                entries = list(self._quarantine)
                self._last_sweep = self._clock()
            proven: list[_Quarantined] = []
            for entry in entries:
                try:
                    if entry.probe():
                        proven.append(entry)
                except Exception:
                    logger.warning("quiet probe of %s(s) %s failed; they stay quarantined",
                                   self.what, entry.ids.tolist(), exc_info=True)
            returned = 0
            with self._lock:
                for entry in proven:
                    self._quarantine.remove(entry)
                    for slot in entry.ids.tolist():
                        self._state[slot] = _FREE
                    self._free.extend(entry.ids.tolist())
                    returned += entry.ids.size
            if returned:
                logger.info("%d %s(s) proven quiet and back in service", returned, self.what)
            return returned
        finally:
            self._sweep_lock.release()


class LandingPool(SlotPool):
    """The consumer's landing blocks: ``tensor[num_blocks, block_size, fat_dim]`` plus a free list."""

    def __init__(
        self,
        num_blocks: int,
        shape: LandingShape,
        tensor: torch.Tensor,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        expected = (num_blocks, shape.block_size, shape.fat_dim)
        if tuple(tensor.shape) != expected or tensor.dtype != shape.dtype or not tensor.is_contiguous():
            raise ValueError(
                f"landing tensor must be contiguous {expected} {shape.dtype}, "
                f"got {tuple(tensor.shape)} {tensor.dtype}")
        super().__init__(num_blocks, what="landing block", clock=clock)
        self.shape = shape
        self.tensor = tensor

    @property
    def num_blocks(self) -> int:
        return self.size
