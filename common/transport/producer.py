"""The producer side of the data path: registered cache regions and lease-release notifications (encoder process).

The encoder registers its two regions once — cache buffer and stamp region
(per block: tag, then generation) — and then only answers handshakes with
:attr:`ProducerTransport.agent_name`, :meth:`agent_metadata` and the regions
as plain numbers, and drains the notifications consumers attach to their tag
READs (:meth:`drain_notifications`).

The agent name is fresh per process incarnation (NIXL refuses a known name
with new metadata, and consumers key peers by it). For the mock transport the
regions must be readable by other processes, so allocate them with
:attr:`allocator` (POSIX shared memory); with real NIXL the default
allocation on any device is fine (``allocator`` is ``None``).

Progress. A READ over one-sided lanes (cross-memory-attach, RDMA) needs no
work here, but TCP lanes, connection set-up and notifications need this
agent's UCX worker to make progress, and a consumer's READ issued after it
sent a notification completes only once this side has progressed (measured:
+0.9 ms per READ with a 1 ms poll). NIXL's own progress thread spins
(measured: 72 % of a core while idle), so by default a thread of ours polls
the agent instead, collecting notifications as it goes: every
``progress_interval_s`` (50 us) while consumers are active — within
``hot_window_s`` of the last notification — and every
``idle_progress_interval_s`` (2 ms) otherwise. The poller's real wake-up
latency is what a pull pays (measured on a loaded 2-core VM: about 0.5 ms
per pull, against 0.2 ms with NIXL's thread). ``progress_interval_s=None``
selects NIXL's thread; ``"auto"`` (the default) selects it when this process
may run on at least ``NIXL_THREAD_MIN_CPUS`` CPUs, the poller otherwise.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch

from common.config import TransportKind
from common.errors import TransportError
from common.transport.binding import AgentLike, binding_errors, create_agent, resolve_transport_kind
from common.transport.regions import RegionDesc
from common.transport.shm import find_segment, shm_allocator
from common.wire import pb2

logger = logging.getLogger(__name__)

TensorAllocator = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]

DEFAULT_PROGRESS_INTERVAL_S = 50e-6
NIXL_THREAD_MIN_CPUS = 8
DEFAULT_IDLE_PROGRESS_INTERVAL_S = 2e-3
DEFAULT_HOT_WINDOW_S = 0.5
# Notifications kept between drains; past this the oldest are dropped (a
# dropped lease release only means the lease expires by its TTL).
MAX_PENDING_NOTIFICATIONS = 65536


class ProducerTransport:
    """The encoder's agent: registers the cache regions once and drains lease releases."""

    def __init__(
        self,
        kind: TransportKind | str = TransportKind.AUTO,
        *,
        name_prefix: str = "epd-encoder",
        agent_options: Mapping[str, Any] | None = None,
        progress_interval_s: float | Literal["auto"] | None = "auto",
        idle_progress_interval_s: float = DEFAULT_IDLE_PROGRESS_INTERVAL_S,
        hot_window_s: float = DEFAULT_HOT_WINDOW_S,
    ) -> None:
        self.kind = resolve_transport_kind(kind)
        self.incarnation_id = uuid.uuid4().hex
        self.agent_name = f"{name_prefix}-{os.getpid()}-{self.incarnation_id[:12]}"
        options = dict(agent_options or {})
        if isinstance(progress_interval_s, (int, float)) and not progress_interval_s > 0:
            raise ValueError(f"progress_interval_s must be > 0, 'auto' or None, got {progress_interval_s}")
        if progress_interval_s == "auto":
            affinity = getattr(os, "sched_getaffinity", None)
            cpus = len(affinity(0)) if affinity is not None else os.cpu_count() or 1
            progress_interval_s = None if cpus >= NIXL_THREAD_MIN_CPUS else DEFAULT_PROGRESS_INTERVAL_S
        # The mock needs no progress here: its consumers copy and it receives on its own thread.
        self._poll_interval_s = progress_interval_s if self.kind is TransportKind.NIXL else None
        self._idle_interval_s = max(idle_progress_interval_s, progress_interval_s or 0.0)
        self._hot_window_s = hot_window_s
        self._last_notification = float("-inf")
        if self.kind is TransportKind.NIXL:
            options.setdefault("progress_thread", progress_interval_s is None)
        self._agent: AgentLike = create_agent(self.kind, self.agent_name, **options)
        self._lock = threading.Lock()  # NIXL agents are not thread-safe
        self._registrations: list[Any] = []
        self._regions: tuple[RegionDesc, RegionDesc] | None = None
        self._metadata = b""
        self._pending: collections.deque[bytes] = collections.deque(maxlen=MAX_PENDING_NOTIFICATIONS)
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        self._closed = False

    @property
    def allocator(self) -> TensorAllocator | None:
        """Allocator for the two regions: shared memory for the mock, ``None`` (default) for NIXL."""
        return shm_allocator if self.kind is TransportKind.MOCK else None

    def register(self, buffer: torch.Tensor, stamps: torch.Tensor) -> None:
        """Register ``buffer[num_blocks, block_size, fat_dim]`` and ``stamps int64[num_blocks, 2]``, once."""
        if self._closed:
            raise TransportError("producer transport is closed")
        if self._regions is not None:
            raise TransportError(f"agent {self.agent_name} already registered its regions")
        if buffer.dim() != 3:
            raise ValueError(f"buffer must be [num_blocks, block_size, fat_dim], got shape {tuple(buffer.shape)}")
        if stamps.dtype != torch.int64 or tuple(stamps.shape) != (buffer.shape[0], 2):
            raise ValueError(f"stamps must be int64[{buffer.shape[0]}, 2], got {stamps.dtype} "
                             f"{tuple(stamps.shape)}")
        named = (("buffer", buffer), ("stamps", stamps))
        regions = tuple(RegionDesc.of_tensor(t) for _, t in named)
        if self.kind is TransportKind.MOCK:
            for (what, _), region in zip(named, regions, strict=True):
                if find_segment(region.base_address, region.nbytes) is None:
                    raise TransportError(
                        f"mock transport: the {what} is not in shared memory, so no other process can "
                        f"read it; allocate it with ProducerTransport.allocator")
        with self._lock:
            try:
                for what, tensor in named:
                    with binding_errors(f"register the {what} of agent {self.agent_name}"):
                        self._registrations.append(self._agent.register_memory(tensor))
                # Take the metadata only now: it is a snapshot of what is registered.
                with binding_errors(f"metadata of agent {self.agent_name}"):
                    self._metadata = bytes(self._agent.get_agent_metadata())
            except Exception:
                self._deregister_locked()
                raise
        self._regions = (regions[0], regions[1])
        if self._poll_interval_s is not None:
            self._poller = threading.Thread(target=self._poll, name=f"progress-{self.agent_name}", daemon=True)
            self._poller.start()
        progress = ("-" if self.kind is TransportKind.MOCK else "NIXL thread" if self._poll_interval_s is None
                    else f"poller {self._poll_interval_s * 1e6:.0f}/{self._idle_interval_s * 1e6:.0f} us")
        logger.info("agent %s (%s) registered %d blocks of %d bytes at %#x; progress: %s", self.agent_name,
                    self.kind.value, regions[0].count, regions[0].stride_bytes, regions[0].base_address,
                    progress)

    def _registered(self) -> tuple[RegionDesc, RegionDesc]:
        if self._regions is None:
            raise TransportError(f"agent {self.agent_name} has not registered its regions yet")
        return self._regions

    def agent_metadata(self) -> bytes:
        """The agent metadata for the handshake, taken after registration."""
        self._registered()
        return self._metadata

    @property
    def buffer_region(self) -> RegionDesc:
        return self._registered()[0]

    @property
    def stamp_region(self) -> RegionDesc:
        return self._registered()[1]

    def fill_handshake(self, response: pb2.HandshakeResponse) -> pb2.HandshakeResponse:
        """Set the transport fields of a handshake answer (agent, metadata, regions, kind)."""
        buffer, stamps = self._registered()
        response.agent_name = self.agent_name
        response.agent_metadata = self._metadata
        response.buffer_region.CopyFrom(buffer.to_proto())
        response.stamp_region.CopyFrom(stamps.to_proto())
        response.transport = self.kind.value
        return response

    @property
    def collects_in_background(self) -> bool:
        """Whether our poller collects the notifications: :meth:`drain_notifications` then only takes
        what it collected (no agent call, no lock), cheap enough for an event loop."""
        return self._poller is not None

    def drain_notifications(self) -> list[bytes]:
        """Notifications that arrived since the last call; decode them, never trust them.

        Without our poller this first collects them from the agent, which may block.
        """
        if not self._closed and self._poller is None:
            self._collect()
        out: list[bytes] = []
        while True:
            try:
                out.append(self._pending.popleft())
            except IndexError:
                return out

    def _collect(self) -> None:
        """Progress the agent once and keep what notifications it delivered."""
        with self._lock, binding_errors(f"notifications of agent {self.agent_name}"):
            by_sender = self._agent.get_new_notifs()
        if not by_sender:
            return
        self._last_notification = time.monotonic()
        for messages in by_sender.values():
            if len(self._pending) + len(messages) > MAX_PENDING_NOTIFICATIONS:
                logger.warning("agent %s: notifications not drained; dropping the oldest", self.agent_name)
            self._pending.extend(bytes(m) for m in messages)

    def _poll(self) -> None:
        hot = self._poll_interval_s or DEFAULT_PROGRESS_INTERVAL_S
        interval = self._idle_interval_s
        while not self._stop.wait(interval):
            try:
                self._collect()
            except Exception:
                logger.exception("progress poll of agent %s failed", self.agent_name)
                self._stop.wait(1.0)
            active = time.monotonic() - self._last_notification < self._hot_window_s
            interval = hot if active else self._idle_interval_s

    def _deregister_locked(self) -> None:
        for reg in reversed(self._registrations):
            try:
                with binding_errors(f"deregister memory of agent {self.agent_name}"):
                    self._agent.deregister_memory(reg)
            except TransportError as exc:
                logger.warning("%s", exc)
        self._registrations.clear()

    def close(self) -> None:
        """Deregister the regions (the agent itself goes with this object)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._poller is not None:
            self._poller.join(timeout=5.0)
        with self._lock:
            self._deregister_locked()
        close = getattr(self._agent, "close", None)
        if callable(close):
            close()
