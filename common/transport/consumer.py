"""The consumer side of the data path: one agent, landing pool, peers per producer incarnation (prefill process).

A prefill worker owns one :class:`ConsumerTransport`: one NIXL (or mock)
agent with one lock, the landing pool and the tag slots (registered and
prepped once, sized from the first handshake's layout unless given), and a
:class:`~common.transport.peer.ProducerPeer` per producer incarnation.

``connect(handshake)`` returns the live peer of that incarnation, or builds
one: descriptors from the handshake's numbers only, ``add_remote_agent``,
remote dlists prepped once. A new incarnation for the same endpoint closes
the old peer first (its dlists are released; its remote agent is removed as
soon as none of its timed-out transfers is in flight — removal is no fence,
see :mod:`common.transport.landing`), so a restarted producer, even at the
same addresses, is never read through a stale dlist.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from common.config import TransportKind
from common.errors import HandshakeError, PeerDisconnected, TransferTimeout, TransportError
from common.layout import STAMP_BYTES
from common.transport.binding import (
    LOCAL_AGENT,
    AgentLike,
    agent_name_of,
    binding_errors,
    create_agent,
    resolve_transport_kind,
)
from common.transport.landing import LandingPool, LandingShape, SlotPool
from common.transport.peer import LocalSide, ProducerPeer
from common.transport.regions import RegionDesc
from common.wire import pb2

logger = logging.getLogger(__name__)

# Consumers whose transport closed with transfers still unproven: their
# landing memory and agent stay alive, or late data could land in freed memory.
_RETIRED: list[tuple[object, ...]] = []
# Metadata problems found while adding a producer are handshake problems.
_HANDSHAKE_ERRORS = {
    "nixlMismatchError": HandshakeError,
    "nixlNotAllowedError": HandshakeError,
    "nixlNotFoundError": HandshakeError,
    "nixlInvalidParamError": HandshakeError,
    "nixlBackendError": HandshakeError,
}


class ConsumerTransport:
    """One consumer agent, its landing pool and tag slots, and its producer peers."""

    def __init__(
        self,
        kind: TransportKind | str = TransportKind.AUTO,
        *,
        num_landing_blocks: int = 256,
        landing_shape: LandingShape | None = None,
        num_tag_slots: int | None = None,
        device: str | torch.device = "cpu",
        name_prefix: str = "epd-prefill",
        agent_options: Mapping[str, Any] | None = None,
        probe_timeout_s: float = 0.0,
    ) -> None:
        """``probe_timeout_s``: when > 0, each new producer peer is read from once (one tag)
        within that long as it is connected (see :meth:`_probe`)."""
        if num_landing_blocks <= 0:
            raise ValueError(f"num_landing_blocks must be > 0, got {num_landing_blocks}")
        self.kind = resolve_transport_kind(kind)
        self.num_landing_blocks = num_landing_blocks
        self.probe_timeout_s = probe_timeout_s
        # Concurrent requests hold distinct landing blocks, so twice as many tag
        # slots leave room for slots quarantined by timed-out tag reads.
        self.num_tag_slots = num_tag_slots or 2 * num_landing_blocks
        self.device = torch.device(device)
        if self.kind is TransportKind.MOCK and self.device.type != "cpu":
            raise TransportError(f"the mock transport lands in host memory only, not {self.device}")
        self.agent_name = f"{name_prefix}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        options = dict(agent_options or {})
        if self.kind is TransportKind.NIXL:
            # Our reads poll the agent; NIXL's progress thread would spin a core
            # (measured: 72 % of one while idle) for nothing.
            options.setdefault("progress_thread", False)
        self._agent: AgentLike = create_agent(self.kind, self.agent_name, **options)
        self._lock = threading.Lock()  # the agent lock: NIXL agents are not thread-safe
        self._peers_lock = threading.RLock()
        self._side: LocalSide | None = None
        self._registrations: list[Any] = []
        self._by_agent: dict[str, ProducerPeer] = {}  # live and draining peers, by remote agent name
        self._endpoints: dict[str, str] = {}  # endpoint -> agent name of its current peer
        self._closed = False
        if landing_shape is not None:
            self._local_side(landing_shape)

    # --- local side ---------------------------------------------------------------------------

    @property
    def agent(self) -> AgentLike:
        return self._agent

    @property
    def landing(self) -> LandingPool:
        """The landing pool; sized from the first handshake unless a shape was given."""
        if self._side is None:
            raise TransportError("the landing pool is sized by the first handshake; connect first")
        return self._side.landing

    @property
    def tag_slots(self) -> SlotPool:
        """Where tag READs land; slots of timed-out tag READs are quarantined like landing blocks."""
        if self._side is None:
            raise TransportError("the tag slots are registered with the landing pool; connect first")
        return self._side.tag_slots

    def _local_side(self, shape: LandingShape) -> LocalSide:
        if self._side is not None:
            have = self._side.landing.shape
            if have != shape:
                raise HandshakeError(
                    f"producer block layout {shape} differs from this consumer's landing blocks {have}")
            return self._side
        blocks = torch.zeros((self.num_landing_blocks, shape.block_size, shape.fat_dim), dtype=shape.dtype,
                             device=self.device)
        # Per row a tag and a generation: row i < num_landing_blocks is landing block i's own (the
        # tag READ of read_blocks_and_tags, whose caller holds that block); the rows after them
        # are the pool of tag slots read_tags takes from.
        tags = torch.zeros((self.num_landing_blocks + self.num_tag_slots, 2), dtype=torch.int64)
        landing_region, tag_region = RegionDesc.of_tensor(blocks), RegionDesc.of_tensor(tags)
        with self._lock, binding_errors("register the landing pool"):
            self._registrations.append(self._agent.register_memory(blocks))
            self._registrations.append(self._agent.register_memory(tags))
            blocks_dlist = self._agent.prep_xfer_dlist(
                LOCAL_AGENT, landing_region.descriptors(), landing_region.memory.value)
            tags_dlist = self._agent.prep_xfer_dlist(LOCAL_AGENT, tag_region.descriptors(), "DRAM")
        self._side = LocalSide(
            agent=self._agent, lock=self._lock,
            landing=LandingPool(self.num_landing_blocks, shape, blocks),
            tag_slots=SlotPool(self.num_tag_slots, what="tag slot"), tag_slot_row=self.num_landing_blocks,
            tag_values=tags.numpy(), tag_words=memoryview(tags.numpy().data).cast("B").cast("q"),
            blocks_dlist=blocks_dlist, tags_dlist=tags_dlist,
            on_closed=self._peer_closed, on_drained=self._peer_drained,
        )
        logger.info("consumer %s (%s): %d landing blocks of %d bytes, %d tag slots", self.agent_name,
                    self.kind.value, self.num_landing_blocks, shape.bytes_per_block, self.num_tag_slots)
        return self._side

    # --- peers -----------------------------------------------------------------------------------

    def connect(self, handshake: pb2.HandshakeResponse, endpoint: str | None = None) -> ProducerPeer:
        """The peer for ``handshake``'s producer incarnation, reused or built (and prepped) now.

        ``endpoint`` names where the producer was reached (``host:port``):
        a new incarnation at the same endpoint closes the peer of the old one.
        Without it, peers are keyed by incarnation only and an old one closes
        when it disconnects or when :meth:`close` is called on it.
        """
        if self._closed:
            raise TransportError("consumer transport is closed")
        hs = handshake
        if hs.transport and hs.transport != self.kind.value:
            raise HandshakeError(f"producer serves transport {hs.transport!r}, this consumer uses "
                                 f"{self.kind.value!r}")
        for field in ("incarnation_id", "agent_name", "agent_metadata"):
            if not getattr(hs, field):
                raise HandshakeError(f"handshake has no {field}")
        shape = LandingShape.from_proto(hs.layout)
        buffer = RegionDesc.from_proto(hs.buffer_region, "buffer_region")
        stamps = RegionDesc.from_proto(hs.stamp_region, "stamp_region")
        if hs.layout.num_blocks and buffer.count != hs.layout.num_blocks:
            raise HandshakeError(f"buffer_region has {buffer.count} blocks, the layout {hs.layout.num_blocks}")
        if buffer.stride_bytes != shape.bytes_per_block:
            raise HandshakeError(f"buffer_region stride {buffer.stride_bytes} bytes does not match the "
                                 f"layout's {shape.bytes_per_block} bytes per block")
        if stamps.stride_bytes != STAMP_BYTES or stamps.count != buffer.count:
            raise HandshakeError(f"stamp_region must be {buffer.count} x {STAMP_BYTES} bytes, got "
                                 f"{stamps.count} x {stamps.stride_bytes}")
        with self._peers_lock:
            side = self._local_side(shape)
            peer = self._by_agent.get(hs.agent_name)
            if peer is not None and (peer.closed or peer.incarnation_id != hs.incarnation_id
                                     or peer.metadata != hs.agent_metadata
                                     or (peer.buffer_region, peer.stamp_region) != (buffer, stamps)):
                # NIXL refuses a known name with new metadata: the old one must go first.
                self._remove_agent(peer, forced=True)
                peer = None
            if peer is None:
                peer = self._open_peer(side, hs, buffer, stamps)
                self._by_agent[peer.agent_name] = peer
                if self.probe_timeout_s > 0:
                    self._probe(peer)
            if endpoint is not None:
                previous = self._endpoints.get(endpoint)
                self._endpoints[endpoint] = peer.agent_name
                if previous is not None and previous != peer.agent_name \
                        and previous not in self._endpoints.values():
                    old = self._by_agent.get(previous)
                    if old is not None:
                        old.close()
            return peer

    def _open_peer(
        self, side: LocalSide, hs: pb2.HandshakeResponse, buffer: RegionDesc, stamps: RegionDesc
    ) -> ProducerPeer:
        name = hs.agent_name
        with self._lock:
            with binding_errors(f"add producer agent {name!r}", _HANDSHAKE_ERRORS):
                added = agent_name_of(self._agent.add_remote_agent(hs.agent_metadata))
            if added != name:
                if added not in self._by_agent:
                    self._forget_agent(added)
                raise HandshakeError(f"handshake names agent {name!r} but its metadata is agent {added!r}")
            try:
                with binding_errors(f"prep the regions of {name!r}", _HANDSHAKE_ERRORS):
                    blocks_dlist = self._agent.prep_xfer_dlist(name, buffer.descriptors(), buffer.memory.value)
                    tags_dlist = self._agent.prep_xfer_dlist(name, stamps.descriptors(), stamps.memory.value)
                # Connect now rather than inside the first request's deadline.
                with binding_errors(f"connect to {name!r}"):
                    self._agent.make_connection(name)
            except Exception:
                self._forget_agent(name)
                raise
        logger.info("prepped producer %s (incarnation %s): %d blocks of %d bytes at %#x",
                    name, hs.incarnation_id[:8], buffer.count, buffer.stride_bytes, buffer.base_address)
        return ProducerPeer(
            side, agent_name=name, incarnation_id=hs.incarnation_id, metadata=bytes(hs.agent_metadata),
            buffer_region=buffer, stamp_region=stamps,
            blocks_dlist=blocks_dlist, tags_dlist=tags_dlist,
        )

    def _probe(self, peer: ProducerPeer) -> None:
        """One tag READ right after connecting: the first transfer completes the connection's
        wire-up, which UCX progresses only while this agent is polled (it has no progress
        thread). Left for later, that wire-up has been seen to miss the first request's deadline
        in a process whose core is busy (a vLLM worker). Best effort: a probe that fails is logged."""
        try:
            peer.read_tags(np.zeros(1, dtype=np.int32), time.monotonic() + self.probe_timeout_s)
        except (TransferTimeout, TransportError, PeerDisconnected) as exc:
            logger.warning("first READ from producer %s did not complete: %s", peer.agent_name, exc)

    def _forget_agent(self, name: str) -> None:
        """``remove_remote_agent`` for clean-up paths (caller holds the agent lock): log, never raise."""
        try:
            with binding_errors(f"remove producer agent {name!r}"):
                self._agent.remove_remote_agent(name)
        except TransportError as exc:
            logger.warning("%s", exc)

    def _peer_closed(self, peer: ProducerPeer) -> None:
        with self._peers_lock:
            for endpoint in [e for e, n in self._endpoints.items() if n == peer.agent_name]:
                del self._endpoints[endpoint]
            if peer.outstanding_transfers == 0:
                self._remove_agent(peer, forced=False)
            else:
                logger.info("keeping agent %s until its %d outstanding transfers end or are proven quiet",
                            peer.agent_name, peer.outstanding_transfers)

    def _peer_drained(self, peer: ProducerPeer) -> None:
        with self._peers_lock:
            if peer.closed and self._by_agent.get(peer.agent_name) is peer:
                self._remove_agent(peer, forced=False)

    def _remove_agent(self, peer: ProducerPeer, *, forced: bool) -> None:
        """Forget ``peer``'s remote agent (caller holds the peers lock)."""
        if not peer.closed:
            peer.close()  # re-enters _peer_closed, which may already remove it
        if self._by_agent.get(peer.agent_name) is not peer:
            return
        if forced and peer.outstanding_transfers:
            logger.warning("removing agent %s with %d transfers outstanding: slots they may still write "
                           "stay quarantined for good", peer.agent_name, peer.outstanding_transfers)
        del self._by_agent[peer.agent_name]
        with self._lock:
            self._forget_agent(peer.agent_name)

    def peer(self, endpoint: str) -> ProducerPeer | None:
        """The current peer at ``endpoint``, if one is open."""
        with self._peers_lock:
            name = self._endpoints.get(endpoint)
            return None if name is None else self._by_agent.get(name)

    def sweep_quarantine(self) -> int:
        """Run the quarantine proofs of landing blocks and tag slots; returns slots returned."""
        if self._side is None:
            return 0
        return self._side.landing.sweep() + self._side.tag_slots.sweep()

    def close(self) -> None:
        """Close every peer and deregister the landing pool."""
        with self._peers_lock:
            if self._closed:
                return
            self._closed = True
            for peer in list(self._by_agent.values()):
                self._remove_agent(peer, forced=True)
        side = self._side
        if side is not None and (side.landing.num_quarantined or side.tag_slots.num_quarantined):
            # Late data may still land: the memory it lands in must outlive us.
            logger.warning("consumer %s closed with quarantined slots: its memory and agent stay alive",
                           self.agent_name)
            _RETIRED.append((self._agent, side.landing.tensor, side.tag_values))
            return
        with self._lock:
            for reg in self._registrations:
                try:
                    with binding_errors("deregister landing memory"):
                        self._agent.deregister_memory(reg)
                except TransportError as exc:
                    logger.warning("%s", exc)
            self._registrations.clear()
        close = getattr(self._agent, "close", None)
        if callable(close):
            close()
