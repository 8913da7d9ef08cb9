"""The mock NIXL agent's own semantics and its fault-injection knobs (mock only, one process)."""

from __future__ import annotations

import json
import pickle
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from common.errors import HandshakeError, PeerDisconnected, TransferTimeout, TransportError
from common.transport import ConsumerTransport, MockFaults, MockNixlAgent, PostInfo, ProducerTransport
from common.transport.mock_errors import (
    nixlInvalidParamError,
    nixlNotAllowedError,
    nixlNotFoundError,
    nixlNotPostedError,
    nixlRepostActiveError,
)
from common.transport.regions import RegionDesc
from common.transport.shm import shm_allocator
from common.wire import pb2
from tests.support.deadlines import assert_ended_by, soon
from tests.transport.harness import LocalProducer, local_producer, reference_block


@pytest.fixture(scope="module")
def producer() -> Iterator[LocalProducer]:
    prod = local_producer("mock", seed=4)
    yield prod
    prod.close()


@pytest.fixture
def faults() -> MockFaults:
    return MockFaults()


@pytest.fixture
def consumer(faults: MockFaults) -> Iterator[ConsumerTransport]:
    transport = ConsumerTransport("mock", num_landing_blocks=4, agent_options={"faults": faults})
    yield transport
    transport.close()


def landed(consumer: ConsumerTransport, producer: LocalProducer, remote: list[int], local: np.ndarray) -> bool:
    return all(torch.equal(consumer.landing.tensor[lid], reference_block(4, r, producer.layout))
               for r, lid in zip(remote, local.tolist(), strict=True))


def test_in_progress_for_n_polls_then_done(producer: LocalProducer) -> None:
    faults = MockFaults(pending_polls=3)
    agent = MockNixlAgent("raw-consumer", faults=faults)
    try:
        dst = torch.zeros(2, 16, 128, dtype=torch.bfloat16)
        agent.register_memory(dst)
        name = agent.add_remote_agent(producer.transport.agent_metadata()).decode()
        remote = agent.prep_xfer_dlist(name, producer.transport.buffer_region.descriptors(), "DRAM")
        local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", RegionDesc.of_tensor(dst).descriptors(), "DRAM")
        handle = agent.make_prepped_xfer("READ", local, np.array([0, 1], np.int32), remote,
                                         np.array([5, 2], np.int32))
        with pytest.raises(nixlNotPostedError):
            agent.check_xfer_state(handle)
        assert agent.transfer(handle) == "PROC"
        with pytest.raises(nixlRepostActiveError):
            agent.transfer(handle)
        assert [agent.check_xfer_state(handle) for _ in range(4)] == ["PROC", "PROC", "PROC", "DONE"]
        assert torch.equal(dst[0], producer.buffer[5]) and torch.equal(dst[1], producer.buffer[2])
        handle.release()
    finally:
        agent.close()


def test_pending_polls_still_complete_through_the_consumer(
        consumer: ConsumerTransport, faults: MockFaults, producer: LocalProducer) -> None:
    peer = consumer.connect(producer.handshake)
    faults.pending_polls = 40
    ids = consumer.landing.acquire(2)
    assert ids is not None
    peer.read_blocks(np.array([1, 7], np.int32), ids, soon())
    assert landed(consumer, producer, [1, 7], ids)
    consumer.landing.release(ids)


def test_a_stall_times_out_quarantines_and_late_data_lands_after_it_clears(
        consumer: ConsumerTransport, faults: MockFaults, producer: LocalProducer) -> None:
    peer = consumer.connect(producer.handshake)
    landing = consumer.landing
    ids = landing.acquire(2)
    assert ids is not None
    landing.tensor[ids] = 0
    faults.stall = True
    deadline = soon(0.2)
    with pytest.raises(TransferTimeout):
        peer.read_blocks(np.array([3, 6], np.int32), ids, deadline)
    assert_ended_by(deadline)
    assert sorted(landing.quarantined_ids().tolist()) == sorted(ids.tolist())
    assert not landed(consumer, producer, [3, 6], ids)
    assert consumer.sweep_quarantine() == 0  # still stalled: no proof
    rest = landing.acquire(2)
    assert rest is not None and not set(rest.tolist()) & set(ids.tolist()) and landing.acquire(1) is None
    landing.release(rest)
    faults.stall = False
    assert consumer.sweep_quarantine() == 2  # the poll completes the transfer: proven quiet
    assert landed(consumer, producer, [3, 6], ids)  # late data: it would have hit a reused block
    assert landing.num_free == landing.num_blocks


def test_releasing_an_in_flight_handle_does_not_stop_its_data(producer: LocalProducer) -> None:
    faults = MockFaults(stall=True)
    agent = MockNixlAgent("raw-release", faults=faults)
    try:
        dst = torch.zeros(1, 16, 128, dtype=torch.bfloat16)
        agent.register_memory(dst)
        name = agent.add_remote_agent(producer.transport.agent_metadata()).decode()
        remote = agent.prep_xfer_dlist(name, producer.transport.buffer_region.descriptors(), "DRAM")
        local = agent.prep_xfer_dlist("", RegionDesc.of_tensor(dst).descriptors(), "DRAM")
        handle = agent.make_prepped_xfer("READ", local, [0], remote, [8])
        assert agent.transfer(handle) == "PROC"
        handle.release()
        agent.remove_remote_agent(name)
        assert not torch.equal(dst[0], producer.buffer[8])
        faults.stall = False
        agent.get_new_notifs()  # any later call makes progress
        assert torch.equal(dst[0], producer.buffer[8])
    finally:
        agent.close()


def test_a_disconnect_closes_the_peer_and_leaves_the_blocks_with_the_caller(
        consumer: ConsumerTransport, faults: MockFaults, producer: LocalProducer) -> None:
    peer = consumer.connect(producer.handshake, endpoint="e")
    ids = consumer.landing.acquire(1)
    assert ids is not None
    faults.disconnect = True
    with pytest.raises(PeerDisconnected):
        peer.read_blocks(np.array([1], np.int32), ids, soon())
    assert peer.closed and consumer.peer("e") is None
    consumer.landing.release(ids)  # not quarantined: the transfer is over
    faults.disconnect = False
    again = consumer.connect(producer.handshake, endpoint="e")
    assert again is not peer
    fingerprints, _ = again.read_tags(np.array([1], np.int32), soon())
    assert fingerprints.tolist() == [4001]


def test_a_stalled_transfer_is_proven_quiet_by_a_disconnect(
        consumer: ConsumerTransport, faults: MockFaults, producer: LocalProducer) -> None:
    peer = consumer.connect(producer.handshake)
    ids = consumer.landing.acquire(1)
    assert ids is not None
    faults.stall = True
    with pytest.raises(TransferTimeout):
        peer.read_blocks(np.array([2], np.int32), ids, soon(0.05))
    faults.disconnect = True
    assert consumer.sweep_quarantine() == 1


def test_registration_failure_is_a_transport_error(faults: MockFaults) -> None:
    faults.fail_registration = True
    transport = ProducerTransport("mock", agent_options={"faults": faults})
    buffer = shm_allocator((3, 2, 4), torch.bfloat16)
    stamps = shm_allocator((3, 2), torch.int64)
    with pytest.raises(TransportError, match="nixlBackendError"):
        transport.register(buffer, stamps)
    with pytest.raises(TransportError, match="not registered"):
        transport.agent_metadata()
    transport.close()


def test_mock_producer_regions_must_be_shared_memory() -> None:
    transport = ProducerTransport("mock")
    try:
        with pytest.raises(TransportError, match="allocate it with ProducerTransport.allocator"):
            transport.register(torch.zeros(3, 2, 4), torch.zeros(3, 2, dtype=torch.int64))
    finally:
        transport.close()


def test_a_callback_between_the_block_read_and_the_tag_read_sees_the_reuse(
        consumer: ConsumerTransport, faults: MockFaults, producer: LocalProducer) -> None:
    peer = consumer.connect(producer.handshake)
    posts: list[PostInfo] = []

    def reuse_block_5(info: PostInfo) -> None:
        posts.append(info)
        if info.index == 1:  # the tag READ, after the block READ completed
            producer.tags[5] = 99
            producer.generations[5] = 77

    faults.before_post = reuse_block_5
    ids = consumer.landing.acquire(2)
    assert ids is not None
    try:
        peer.read_blocks(np.array([5, 6], np.int32), ids, soon())
        fingerprints, generations = peer.read_tags(np.array([5, 6], np.int32), soon(), notif=b"bye")
    finally:
        consumer.landing.release(ids)
        producer.tags[5], producer.generations[5] = 4005, 4
    assert fingerprints.tolist() == [99, 4006] and generations.tolist() == [77, 4]
    assert [p.nbytes for p in posts] == [2 * producer.layout.bytes_per_block, 4 * 8]
    assert posts[0].remote == producer.transport.agent_name
    assert posts[0].notif == b"" and posts[1].notif == b"bye"  # the release rides on the tag READ
    received: list[bytes] = []
    deadline = soon(2.0)
    while not received and time.monotonic() < deadline:
        received += producer.transport.drain_notifications()
        time.sleep(0.005)
    assert received == [b"bye"]


def test_metadata_is_json_and_peer_metadata_is_never_unpickled(producer: LocalProducer) -> None:
    card = json.loads(producer.transport.agent_metadata())
    assert card["name"] == producer.transport.agent_name and card["regions"]
    consumer = ConsumerTransport("mock", num_landing_blocks=1)
    try:
        hostile = pb2.HandshakeResponse()
        hostile.CopyFrom(producer.handshake)
        hostile.agent_metadata = pickle.dumps({"name": producer.transport.agent_name})
        with pytest.raises(HandshakeError, match="not JSON"):
            consumer.connect(hostile)
        card["regions"][0]["segment"] = "../../etc/passwd"
        hostile.agent_metadata = json.dumps(card).encode()
        with pytest.raises(HandshakeError, match="invalid segment"):
            consumer.connect(hostile)
    finally:
        consumer.close()


def test_a_stale_dlist_cannot_be_used_and_a_known_name_cannot_change(producer: LocalProducer) -> None:
    agent = MockNixlAgent("raw-stale")
    prod = MockNixlAgent("raw-producer")
    try:
        first = shm_allocator((4, 64), torch.uint8)
        prod.register_memory(first)
        before = prod.get_agent_metadata()
        second = shm_allocator((4, 64), torch.uint8)
        prod.register_memory(second)
        after = prod.get_agent_metadata()
        dst = torch.zeros(4, 64, dtype=torch.uint8)
        agent.register_memory(dst)
        assert agent.add_remote_agent(before) == b"raw-producer"
        assert agent.add_remote_agent(before) == b"raw-producer"  # same metadata: no-op
        with pytest.raises(nixlNotAllowedError):
            agent.add_remote_agent(after)
        stale = agent.prep_xfer_dlist("raw-producer", RegionDesc.of_tensor(first).descriptors(), "DRAM")
        local = agent.prep_xfer_dlist("", RegionDesc.of_tensor(dst).descriptors(), "DRAM")
        agent.remove_remote_agent("raw-producer")
        agent.add_remote_agent(after)
        with pytest.raises(nixlInvalidParamError, match="stale dlist"):
            agent.make_prepped_xfer("READ", local, [0], stale, [0])
        with pytest.raises(nixlNotFoundError):
            agent.prep_xfer_dlist("raw-producer", RegionDesc.of_tensor(dst).descriptors(), "DRAM")
    finally:
        agent.close()
        prod.close()


def test_a_replaced_peer_keeps_its_agent_until_its_read_in_flight_ends(
        consumer: ConsumerTransport, faults: MockFaults, producer: LocalProducer) -> None:
    other = local_producer("mock", seed=5)
    try:
        old = consumer.connect(producer.handshake, endpoint="e")
        ids = consumer.landing.acquire(1)
        assert ids is not None
        consumer.landing.tensor[ids] = 0
        faults.stall = True
        errors: list[BaseException] = []

        def read() -> None:
            try:
                old.read_blocks(np.array([3], np.int32), ids, soon(10.0))
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        reader = threading.Thread(target=read)
        reader.start()
        deadline = soon(5.0)
        while old.outstanding_transfers == 0:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        new = consumer.connect(other.handshake, endpoint="e")
        assert new is not old and old.closed
        consumer.agent.make_connection(producer.transport.agent_name)  # still known: a READ is in flight
        faults.stall = False
        reader.join(timeout=10)
        assert not reader.is_alive() and not errors
        assert landed(consumer, producer, [3], ids)
        assert old.outstanding_transfers == 0
        with pytest.raises(nixlNotFoundError):  # removed once the READ ended
            consumer.agent.make_connection(producer.transport.agent_name)
        consumer.landing.release(ids)
    finally:
        other.close()
