"""Peer lifecycle, handshake checks and request validation, against both agents in one process."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

from common.errors import HandshakeError, PeerDisconnected, TransportError
from common.transport import ConsumerTransport
from common.wire import pb2
from tests.support.deadlines import soon
from tests.transport.harness import LocalProducer, local_producer, reference_block


@pytest.fixture(scope="module")
def pair(kind: str) -> Iterator[tuple[LocalProducer, LocalProducer]]:
    first, second = local_producer(kind, seed=1), local_producer(kind, seed=2)
    yield first, second
    first.close()
    second.close()


@pytest.fixture
def consumer(kind: str) -> Iterator[ConsumerTransport]:
    transport = ConsumerTransport(kind, num_landing_blocks=8)
    yield transport
    transport.close()


@pytest.fixture(scope="module")
def shared_consumer(kind: str) -> Iterator[ConsumerTransport]:
    transport = ConsumerTransport(kind, num_landing_blocks=8)
    yield transport
    transport.close()


def assert_blocks(consumer: ConsumerTransport, producer: LocalProducer, seed: int, remote: list[int],
                  local: np.ndarray) -> None:
    for r, lid in zip(remote, local.tolist(), strict=True):
        assert torch.equal(consumer.landing.tensor[lid], reference_block(seed, r, producer.layout)), (r, lid)


def test_a_new_incarnation_at_an_endpoint_replaces_the_peer(
        consumer: ConsumerTransport, pair: tuple[LocalProducer, LocalProducer]) -> None:
    first, second = pair
    old = consumer.connect(first.handshake, endpoint="a")
    assert consumer.connect(first.handshake, endpoint="a") is old
    ids = consumer.landing.acquire(2)
    assert ids is not None
    old.read_blocks(np.array([3, 5], dtype=np.int32), ids, soon())
    assert_blocks(consumer, first, 1, [3, 5], ids)

    new = consumer.connect(second.handshake, endpoint="a")
    assert new is not old and old.closed and consumer.peer("a") is new
    with pytest.raises(PeerDisconnected):
        old.read_blocks(np.array([3, 5], dtype=np.int32), ids, soon())
    new.read_blocks(np.array([3, 5], dtype=np.int32), ids, soon())
    assert_blocks(consumer, second, 2, [3, 5], ids)

    # The first producer is still alive: reached again, it gets a fresh peer (agent re-added).
    again = consumer.connect(first.handshake, endpoint="b")
    assert again is not old and not again.closed
    again.read_blocks(np.array([4], dtype=np.int32), ids[:1], soon())
    assert_blocks(consumer, first, 1, [4], ids[:1])
    consumer.landing.release(ids)


def test_without_an_endpoint_peers_of_different_producers_coexist(
        consumer: ConsumerTransport, pair: tuple[LocalProducer, LocalProducer]) -> None:
    first, second = pair
    a, b = consumer.connect(first.handshake), consumer.connect(second.handshake)
    assert a is not b and not a.closed and not b.closed
    ids = consumer.landing.acquire(2)
    assert ids is not None
    a.read_blocks(np.array([1], dtype=np.int32), ids[:1], soon())
    b.read_blocks(np.array([1], dtype=np.int32), ids[1:], soon())
    assert_blocks(consumer, first, 1, [1], ids[:1])
    assert_blocks(consumer, second, 2, [1], ids[1:])
    consumer.landing.release(ids)


def test_two_endpoints_reaching_one_incarnation_share_its_peer(
        consumer: ConsumerTransport, pair: tuple[LocalProducer, LocalProducer]) -> None:
    first, _ = pair
    via_a = consumer.connect(first.handshake, endpoint="a")
    assert consumer.connect(first.handshake, endpoint="b") is via_a


BAD_HANDSHAKES = [
    (lambda hs: setattr(hs, "transport", "carrier-pigeon"), "transport"),
    (lambda hs: setattr(hs, "agent_name", ""), "agent_name"),
    (lambda hs: setattr(hs, "agent_metadata", b"\x80\x04garbage"), "add producer agent"),
    (lambda hs: setattr(hs, "agent_name", hs.agent_name + "-other"), "metadata is agent"),
    (lambda hs: setattr(hs.buffer_region, "stride_bytes", hs.buffer_region.stride_bytes + 2), "stride"),
    (lambda hs: setattr(hs.stamp_region, "count", hs.stamp_region.count - 1), "stamp_region"),
    (lambda hs: setattr(hs.stamp_region, "stride_bytes", 8), "stamp_region"),
    (lambda hs: setattr(hs.stamp_region, "memory_type", pb2.MEMORY_TYPE_UNSPECIFIED), "memory_type"),
    (lambda hs: setattr(hs.buffer_region, "base_address", 0), "base_address"),
    (lambda hs: setattr(hs.layout, "dtype", pb2.D_TYPE_UNSPECIFIED), "dtype"),
    (lambda hs: setattr(hs.buffer_region, "base_address", 16), "prep the regions"),
]


@pytest.mark.parametrize(("mutate", "message"), BAD_HANDSHAKES, ids=[m for _, m in BAD_HANDSHAKES])
def test_bad_handshakes_are_refused_and_leave_the_consumer_usable(
        shared_consumer: ConsumerTransport, pair: tuple[LocalProducer, LocalProducer],
        mutate: Callable[[pb2.HandshakeResponse], None], message: str) -> None:
    consumer = shared_consumer
    first, _ = pair
    bad = pb2.HandshakeResponse()
    bad.CopyFrom(first.handshake)
    mutate(bad)
    with pytest.raises(HandshakeError, match=message):
        consumer.connect(bad, endpoint="a")
    peer = consumer.connect(first.handshake, endpoint="a")
    ids = consumer.landing.acquire(1)
    assert ids is not None
    peer.read_blocks(np.array([2], dtype=np.int32), ids, soon())
    assert_blocks(consumer, first, 1, [2], ids)
    consumer.landing.release(ids)


def test_a_different_block_layout_is_refused(kind: str, pair: tuple[LocalProducer, LocalProducer]) -> None:
    first, _ = pair
    consumer = ConsumerTransport(kind, num_landing_blocks=2)
    try:
        consumer.connect(first.handshake)
        other = pb2.HandshakeResponse()
        other.CopyFrom(first.handshake)
        other.layout.fat_dim *= 2
        other.layout.bytes_per_block *= 2
        other.buffer_region.stride_bytes *= 2
        with pytest.raises(HandshakeError, match="differs from this consumer's landing blocks"):
            consumer.connect(other, endpoint="other")
    finally:
        consumer.close()


def test_bad_indices_are_value_errors_naming_the_id(
        consumer: ConsumerTransport, pair: tuple[LocalProducer, LocalProducer]) -> None:
    peer = consumer.connect(pair[0].handshake)
    landing = consumer.landing
    ids = landing.acquire(2)
    assert ids is not None
    with pytest.raises(ValueError, match="remote block id 9 is outside"):
        peer.read_blocks(np.array([1, 9], dtype=np.int32), ids, soon())
    with pytest.raises(ValueError, match="2 remote block ids but 1"):
        peer.read_blocks(np.array([1, 2], dtype=np.int32), ids[:1], soon())
    with pytest.raises(ValueError, match="non-empty"):
        peer.read_blocks(np.array([], dtype=np.int32), ids[:0], soon())
    with pytest.raises(ValueError, match="integer"):
        peer.read_tags(np.array([1.0, 2.0]), soon())
    free = next(i for i in range(landing.num_blocks) if i not in ids.tolist())
    with pytest.raises(ValueError, match=f"landing block {free}: it is free"):
        peer.read_blocks(np.array([1], dtype=np.int32), np.array([free], dtype=np.int32), soon())
    landing.release(ids)
    with pytest.raises(ValueError, match="it is free"):
        landing.release(ids)


def test_reads_refuse_an_event_loop_thread_and_the_async_variants_work(
        consumer: ConsumerTransport, pair: tuple[LocalProducer, LocalProducer]) -> None:
    first, _ = pair
    peer = consumer.connect(first.handshake)
    ids = consumer.landing.acquire(1)
    assert ids is not None
    remote = np.array([6], dtype=np.int32)

    async def main() -> tuple[np.ndarray, np.ndarray]:
        with pytest.raises(RuntimeError, match="worker thread"):
            peer.read_blocks(remote, ids, soon())
        await peer.read_blocks_async(remote, ids, soon())
        return await peer.read_tags_async(remote, soon())

    fingerprints, generations = asyncio.run(main())
    assert fingerprints.tolist() == [1006] and generations.tolist() == [1]
    assert_blocks(consumer, first, 1, [6], ids)
    consumer.landing.release(ids)


def test_concurrent_reads_from_many_threads_land_exactly(
        consumer: ConsumerTransport, pair: tuple[LocalProducer, LocalProducer]) -> None:
    first, _ = pair
    peer = consumer.connect(first.handshake)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(15):
                remote = rng.choice(8, size=2, replace=False).astype(np.int32)
                ids = None
                while ids is None:
                    ids = consumer.landing.acquire(2)
                try:
                    peer.read_blocks(remote, ids, soon())
                    fingerprints, _ = peer.read_tags(remote, soon())
                    assert fingerprints.tolist() == [1000 + r for r in remote.tolist()]
                    assert_blocks(consumer, first, 1, remote.tolist(), ids)
                finally:
                    consumer.landing.release(ids)
        except BaseException as exc:  # surfaced in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert consumer.landing.num_free == consumer.landing.num_blocks


def test_connect_after_close_is_an_error(kind: str, pair: tuple[LocalProducer, LocalProducer]) -> None:
    consumer = ConsumerTransport(kind, num_landing_blocks=1)
    consumer.close()
    with pytest.raises(TransportError, match="closed"):
        consumer.connect(pair[0].handshake)
