"""The NIXL transport boundary shared by the encoder (producer) and prefill workers (consumers).

Reading path: :mod:`.binding` (the only NIXL import, states, error mapping,
agent creation) -> :mod:`.regions` (regions as plain numbers, descriptors)
-> :mod:`.producer` (encoder side) -> :mod:`.consumer` and :mod:`.peer`
(prefill side: handshake to prepped dlists, block READ then tag READ) ->
:mod:`.handles` (polling, releasing and quarantining posted READs) ->
:mod:`.landing` (landing blocks, tag slots, the quarantine rule) ->
:mod:`.notify` (lease releases on the tag READ) -> :mod:`.mock_agent` and
:mod:`.shm` (the shared-memory stand-in used where NIXL is absent).

Nothing here imports NIXL at import time; :func:`load_nixl` does, once.
"""

from __future__ import annotations

from common.transport.binding import (
    NIXL_EXTRA_HINT,
    AgentLike,
    TransferState,
    binding_errors,
    create_agent,
    load_nixl,
    nixl_available,
    resolve_transport_kind,
    translate_error,
)
from common.transport.consumer import ConsumerTransport
from common.transport.landing import LandingPool, LandingShape, SlotPool
from common.transport.mock_agent import MockFaults, MockNixlAgent, PostInfo
from common.transport.notify import decode_release_notification, encode_release_notification
from common.transport.peer import ProducerPeer
from common.transport.producer import ProducerTransport, TensorAllocator
from common.transport.regions import MemoryKind, RegionDesc
from common.transport.shm import shm_allocator, sweep_stale_segments

__all__ = [
    "NIXL_EXTRA_HINT",
    "AgentLike",
    "ConsumerTransport",
    "LandingPool",
    "LandingShape",
    "MemoryKind",
    "MockFaults",
    "MockNixlAgent",
    "PostInfo",
    "ProducerPeer",
    "ProducerTransport",
    "RegionDesc",
    "SlotPool",
    "TensorAllocator",
    "TransferState",
    "binding_errors",
    "create_agent",
    "decode_release_notification",
    "encode_release_notification",
    "load_nixl",
    "nixl_available",
    "resolve_transport_kind",
    "shm_allocator",
    "sweep_stale_segments",
    "translate_error",
]
