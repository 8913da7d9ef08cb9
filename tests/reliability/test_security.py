"""Security: no cache poisoning, only the two regions exposed, nothing deserialized from a peer, unguessable leases.

Authentication (bearer token, mTLS, health left open for probes) is proven in
``tests/system/test_encoder_auth.py``.
"""

from __future__ import annotations

import asyncio
import pickle
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from common import media
from common.config import CacheConfig, EncoderServerConfig
from common.errors import TransportError
from common.transport import binding, create_agent, load_nixl
from common.transport import producer as producer_module
from common.transport.binding import agent_name_of
from common.transport.mock_wire import AgentCard
from common.wire import PROTOCOL_VERSION, pb2, pb2_grpc
from encoder_server.cache_records import Allocation
from encoder_server.leases import LeaseTable
from epd_harness.media import image_bytes
from prefill_client.consumer.client import EncoderCacheClient
from prefill_client.consumer.connection import MediaSpec, content_key
from tests.reliability.conftest import SharedEncoder
from tests.reliability.support import MODEL
from tests.support.reference import Reference, matches
from tests.transport_params import TRANSPORTS

REF = Reference()


# --- cache poisoning -------------------------------------------------------------------------------


def test_content_b_is_never_retrievable_under_the_key_of_content_a(shared_encoder: SharedEncoder) -> None:
    """The key is computed by the encoder from the bytes it received; a client-chosen label never is one."""
    stub, kind = shared_encoder.stub, shared_encoder.enc.transport
    a, b, absent = (image_bytes(64, 64, seed=s) for s in (601, 602, 603))

    def encode(data: bytes, uuid: str) -> pb2.ItemLocation:
        loc = stub.Encode(pb2.EncodeRequest(model_id=MODEL, consumer_id="mallory",
                                            items=[pb2.MediaItem(image=data, uuid=uuid)]), timeout=60).results[0]
        stub.Release(pb2.ReleaseRequest(consumer_id="mallory", lease_ids=[loc.location.lease_id]), timeout=10)
        return loc.location

    loc_a = encode(a, "a.png")
    with EncoderCacheClient(shared_encoder.enc.target, MODEL, transport_kind=kind) as client:
        fingerprint = client.media_params()[1]
        key_absent = media.mm_hash(MODEL, fingerprint, content_key(MediaSpec.image(absent)))
        assert loc_a.mm_hash == media.mm_hash(MODEL, fingerprint, content_key(MediaSpec.image(a)))
        # B sent under labels naming A's key (present) and a key that is not cached yet.
        for label in (loc_a.mm_hash, key_absent):
            loc_b = encode(b, label)
            assert loc_b.mm_hash not in (loc_a.mm_hash, key_absent)
            assert set(loc_b.block_ids).isdisjoint(loc_a.block_ids)
        found = stub.Lookup(pb2.LookupRequest(model_id=MODEL, consumer_id="alice",
                                              mm_hashes=[loc_a.mm_hash, key_absent]), timeout=10).results
        assert (list(found[0].location.block_ids), found[0].location.generation) == \
            (list(loc_a.block_ids), loc_a.generation)
        stub.Release(pb2.ReleaseRequest(consumer_id="alice", lease_ids=[found[0].location.lease_id]), timeout=10)
        assert found[1].WhichOneof("outcome") == "error"
        assert found[1].error.code == grpc.StatusCode.NOT_FOUND.value[0]
        # What a victim pulls under either key is the content that key was computed from.
        pulled_a = client.lookup([loc_a.mm_hash])[0]
        assert pulled_a is not None and matches(pulled_a.embeddings, REF.image(a))
        assert not matches(pulled_a.embeddings, REF.image(b))
        assert client.lookup([key_absent]) == [None]
        pulled = client.encode([MediaSpec.image(absent)])[0]
        assert pulled.mm_hash == key_absent and matches(pulled.embeddings, REF.image(absent))


# --- what is registered with NIXL ------------------------------------------------------------------


class RecordingAgent:
    """Wraps a real (or mock) agent and records every range registered with it."""

    def __init__(self, agent: Any, ranges: list[tuple[int, int]]) -> None:
        self._agent = agent
        self._ranges = ranges

    def register_memory(self, reg_list: Any, *args: Any, **kwargs: Any) -> Any:
        assert isinstance(reg_list, torch.Tensor), f"registered something other than a tensor: {reg_list!r}"
        self._ranges.append((reg_list.data_ptr(), reg_list.numel() * reg_list.element_size()))
        return self._agent.register_memory(reg_list, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)


def _regions(hs: pb2.HandshakeResponse) -> list[tuple[int, int]]:
    return sorted((r.base_address, r.stride_bytes * r.count)
                  for r in (hs.buffer_region, hs.stamp_region))


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_the_encoder_registers_only_its_cache_and_stamp_regions(
        kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from encoder_server.server import EncoderServer

    registered: list[tuple[int, int]] = []
    real_create: Callable[..., Any] = producer_module.create_agent
    monkeypatch.setattr(producer_module, "create_agent",
                        lambda *a, **k: RecordingAgent(real_create(*a, **k), registered))
    config = EncoderServerConfig(transport=kind, port=0, metrics_port=-1, encoder_backend="eager",  # type: ignore
                                 cache=CacheConfig(num_blocks=8, block_size=64))

    async def start_and_handshake() -> pb2.HandshakeResponse:
        server = EncoderServer(config)
        try:
            await server.start()
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                return await pb2_grpc.EncoderCacheServiceStub(channel).Handshake(
                    pb2.HandshakeRequest(protocol_version=PROTOCOL_VERSION, model_id=MODEL), timeout=10)
        finally:
            await server.stop()

    hs = asyncio.run(start_and_handshake())
    assert sorted(registered) == _regions(hs), "the encoder registered memory beyond its two regions"
    buffer = hs.buffer_region
    assert buffer.count == 8 and buffer.stride_bytes == hs.layout.bytes_per_block
    if kind == "mock":  # the metadata lists exactly what a peer may map
        card = AgentCard.decode(hs.agent_metadata)
        assert sorted((r.address, r.length) for r in card.regions) == _regions(hs)


def test_a_peer_cannot_address_memory_outside_the_two_regions(shared_encoder: SharedEncoder) -> None:
    """With the live encoder's metadata, descriptors inside each region are accepted, any byte outside refused."""
    hs = shared_encoder.stub.Handshake(pb2.HandshakeRequest(protocol_version=PROTOCOL_VERSION, model_id=MODEL),
                                       timeout=10)
    kind = shared_encoder.enc.transport
    agent = create_agent(kind, "boundary-probe", **({"progress_thread": False} if kind == "nixl" else {}))
    try:
        name = agent_name_of(agent.add_remote_agent(hs.agent_metadata))
        ranges = _regions(hs)
        for start, length in ranges:
            end = start + length
            inside = [(start, 8), (end - 8, 8), (start, length)]
            outside = [(start - 8, 8), (end, 8), (end - 4, 8), (start - 4, 8)]
            for addr, n in inside:
                agent.release_dlist_handle(_prep(agent, name, addr, n))
            for addr, n in outside:
                if any(s <= addr and addr + n <= s + ln for s, ln in ranges):
                    continue  # adjacent regions: this probe lies inside a neighbour
                with pytest.raises(TransportError):
                    with binding.binding_errors(f"prep {addr:#x}+{n}"):
                        _prep(agent, name, addr, n)
    finally:
        close = getattr(agent, "close", None)
        if callable(close):
            close()


def _prep(agent: Any, name: str, addr: int, n: int) -> Any:
    return agent.prep_xfer_dlist(name, np.array([[addr, n, 0]], dtype=np.uint64), "DRAM")


# --- nothing deserialized from a peer --------------------------------------------------------------


def test_the_consumer_path_never_unpickles_or_deserializes_descriptors(
        shared_encoder: SharedEncoder, monkeypatch: pytest.MonkeyPatch) -> None:
    called: list[str] = []

    def refuse(name: str) -> Callable[..., Any]:
        def refused(*args: Any, **kwargs: Any) -> Any:
            called.append(name)
            raise AssertionError(f"{name} called on the consumer path")

        return refused

    for name in ("loads", "load", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse(f"pickle.{name}"))
    kind = shared_encoder.enc.transport
    if kind == "nixl":
        monkeypatch.setattr(load_nixl().nixl_agent, "deserialize_descs", refuse("nixl_agent.deserialize_descs"))
    img = image_bytes(80, 64, seed=604)
    with EncoderCacheClient(shared_encoder.enc.target, MODEL, transport_kind=kind) as client:
        pulled = client.encode([MediaSpec.image(img)])[0]  # handshake, connect, Encode, block READ, tag READ
        again = client.lookup([pulled.mm_hash])[0]
    assert matches(pulled.embeddings, REF.image(img))
    assert again is not None and torch.equal(again.embeddings, pulled.embeddings)
    assert called == []


# --- lease ids ----------------------------------------------------------------------------------------


def test_lease_ids_are_unguessable_63_bit_numbers() -> None:
    """A release notification does not say who sent it: the id alone must be a secret."""
    table: LeaseTable[int] = LeaseTable(ttl_s=60.0)
    where = Allocation((0,), (1,), 1, 1)
    ids = np.array([table.grant(i, "h", "owner", 0.0, where).lease_id for i in range(20_000)], dtype=np.uint64)
    assert len(np.unique(ids)) == ids.size
    assert int(ids.min()) > 0 and int(ids.max()) < 2**63
    assert not np.any(np.diff(ids.astype(np.int64)) == 1), "consecutive grants are neighbours"
    bits = (ids[:, None] >> np.arange(63, dtype=np.uint64)) & np.uint64(1)
    share = bits.mean(axis=0)
    assert bool(((share > 0.45) & (share < 0.55)).all()), f"biased bits: {share}"
