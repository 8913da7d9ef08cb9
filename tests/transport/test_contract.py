"""The transport contract, against the mock agent and real NIXL, with the producer in another process."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from common.errors import PeerDisconnected, TransferTimeout
from common.transport import (
    ConsumerTransport,
    ProducerPeer,
    decode_release_notification,
    encode_release_notification,
    sweep_stale_segments,
)
from tests.support.deadlines import assert_ended_by, soon
from tests.transport.harness import FIXED_ADDRESS, HelperLayout, ProducerProcess

LAYOUT = HelperLayout()
USABLE_BLOCKS = LAYOUT.num_blocks - 1  # the last block is scratch


def tag_of(seed: int, block: int) -> int:
    return seed * 1000 + block  # what the helper's fill(seed) stamps


@pytest.fixture(scope="module")
def producers_pair(kind: str) -> Iterator[tuple[ProducerProcess, ProducerProcess]]:
    """The producer every test reads from, and the one that replaces it after it is killed.

    Both map their regions at the same addresses. The first uses TCP lanes
    only (``UCX_TLS=tcp,self``): then a frozen producer stalls block READs
    too (cross-memory-attach would copy from a stopped process); the mock
    agent behaves that way anyway. The second uses UCX's default lanes. It is
    started now, in parallel, to save time; the consumer meets it only after
    the first is killed, as a restarted producer.
    """
    first = ProducerProcess(kind, seed=3, address=FIXED_ADDRESS, env={"UCX_TLS": "tcp,self"})
    second = ProducerProcess(kind, seed=8, address=FIXED_ADDRESS)
    try:
        yield first, second
    finally:
        first.kill()
        second.kill()
        sweep_stale_segments()


@pytest.fixture(scope="module")
def producer(producers_pair: tuple[ProducerProcess, ProducerProcess]) -> ProducerProcess:
    return producers_pair[0]


@pytest.fixture(scope="module")
def consumer(kind: str) -> Iterator[ConsumerTransport]:
    transport = ConsumerTransport(kind, num_landing_blocks=16)
    yield transport
    transport.close()


@pytest.fixture(scope="module")
def peer(consumer: ConsumerTransport, producer: ProducerProcess) -> ProducerPeer:
    return consumer.connect(producer.handshake, endpoint="encoder-0")


def test_random_block_subsets_land_exactly(consumer: ConsumerTransport, producer: ProducerProcess,
                                           peer: ProducerPeer) -> None:
    rng = np.random.default_rng(1234)
    landing = consumer.landing
    for _ in range(12):
        n = int(rng.integers(1, landing.num_blocks + 1))
        remote = rng.choice(USABLE_BLOCKS, size=n, replace=False).astype(np.int32)
        held = landing.acquire(landing.num_blocks)
        assert held is not None
        local = rng.permutation(held)[:n].astype(np.int32)
        landing.tensor.fill_(-7.0)
        try:
            peer.read_blocks(remote, local, soon())
            for r, lid in zip(remote.tolist(), local.tolist(), strict=True):
                assert torch.equal(landing.tensor[lid], producer.reference(r)), (r, lid)
            untouched = np.setdiff1d(held, local)
            assert bool((landing.tensor[untouched] == -7.0).all())
        finally:
            landing.release(held)


def test_tags_and_generations_are_a_second_read_after_the_blocks(
        consumer: ConsumerTransport, producer: ProducerProcess, peer: ProducerPeer) -> None:
    seed = producer.seed
    remote = np.array([4, 9, 2], dtype=np.int32)
    landing = consumer.landing
    local = landing.acquire(3)
    assert local is not None
    try:
        peer.read_blocks(remote, local, soon())
        producer.stamp(9, 777, 42)  # block 9 is reused between the two READs
        fingerprints, generations = peer.read_tags(remote, soon())
    finally:
        landing.release(local)
        producer.stamp(9, tag_of(seed, 9), seed)
    assert fingerprints.dtype == np.int64 and generations.dtype == np.int64
    assert fingerprints.tolist() == [tag_of(seed, 4), 777, tag_of(seed, 2)]
    assert generations.tolist() == [seed, 42, seed]
    for r, lid in zip(remote.tolist(), local.tolist(), strict=True):
        assert torch.equal(landing.tensor[lid], producer.reference(r))


@pytest.fixture(scope="module")
def default_lanes_peer(kind: str, consumer: ConsumerTransport) -> Iterator[tuple[ProducerProcess, ProducerPeer]]:
    """A producer on UCX's default lanes: a same-host block READ completes inside its post."""
    helper = ProducerProcess(kind, seed=5)
    try:
        reader = consumer.connect(helper.handshake, endpoint="encoder-default-lanes")
        ids = consumer.landing.acquire(1)
        assert ids is not None
        try:  # the first READ sets up the lane (it is polled); the next ones complete at post
            reader.read_blocks(np.array([0], dtype=np.int32), ids, soon())
        finally:
            consumer.landing.release(ids)
        yield helper, reader
    finally:
        helper.kill()


class Posts:
    """Counts the consumer agent's posts and polls, and runs ``before(n)`` before its post ``n`` (0-based)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, agent: Any, before: Callable[[int], None]) -> None:
        self.posts = 0
        self.polls: list[int] = []  # how many posts had been made at each poll
        transfer, check = agent.transfer, agent.check_xfer_state

        def hooked_transfer(handle: Any, *args: Any) -> Any:
            before(self.posts)
            self.posts += 1
            return transfer(handle, *args)

        def hooked_check(handle: Any) -> Any:
            self.polls.append(self.posts)
            return check(handle)

        monkeypatch.setattr(agent, "transfer", hooked_transfer)
        monkeypatch.setattr(agent, "check_xfer_state", hooked_check)


@pytest.mark.parametrize("block_read", ["in flight", "done at post"])
def test_blocks_and_tags_in_one_call_read_the_tags_only_after_the_blocks(
        kind: str, consumer: ConsumerTransport, producer: ProducerProcess, peer: ProducerPeer,
        monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest, block_read: str) -> None:
    # The block READ either completes inside its post (then the tag READ is posted under the same
    # hold of the agent lock) or is polled to completion first. Either way the blocks' data is in
    # place when the tag READ is posted, and a block reused in between shows in the tags.
    source, reader = producer, peer  # the TCP lanes: a READ is in flight after its post
    if block_read == "done at post" and kind == "nixl":
        source, reader = request.getfixturevalue("default_lanes_peer")
    elif block_read == "in flight" and kind == "mock":  # the mock completes at post unless told otherwise
        monkeypatch.setattr(consumer.agent.faults, "pending_polls", 2)  # type: ignore[attr-defined]
    seed = source.seed
    remote = np.array([4, 9, 2], dtype=np.int32)
    landing = consumer.landing
    pool = consumer.tag_slots.num_free
    local = landing.acquire(3)
    assert local is not None
    landing.tensor[local] = 0

    def before_post(n: int) -> None:
        if n == 1:  # the tag READ: the blocks must have landed already
            for r, lid in zip(remote.tolist(), local.tolist(), strict=True):
                assert torch.equal(landing.tensor[lid], source.reference(r)), "tag READ posted before the data"
            source.stamp(9, 777, 42)  # block 9 is reused between the two READs

    posts = Posts(monkeypatch, consumer.agent, before_post)
    try:
        fingerprints, generations = reader.read_blocks_and_tags(remote, local, 5.0)
        with pytest.raises(ValueError, match="remote block id 99"):
            reader.read_blocks_and_tags(np.array([99], dtype=np.int32), local[:1], 5.0)
    finally:
        landing.release(local)
        source.stamp(9, tag_of(seed, 9), seed)
    assert posts.posts == 2
    if kind == "mock":  # deterministic: the block READ was polled before the tag READ's post, or nothing was
        assert (1 in posts.polls) if block_read == "in flight" else not posts.polls
    assert fingerprints == [tag_of(seed, 4), 777, tag_of(seed, 2)]
    assert generations == [seed, 42, seed]
    for r, lid in zip(remote.tolist(), local.tolist(), strict=True):
        assert torch.equal(landing.tensor[lid], source.reference(r))
    assert consumer.tag_slots.num_free == pool  # the tags land in the landing blocks' own rows


@pytest.mark.parametrize("freeze", ["before the call", "between the READs"])
def test_a_read_timing_out_in_one_call_quarantines_the_landing_blocks(
        consumer: ConsumerTransport, producer: ProducerProcess, peer: ProducerPeer,
        monkeypatch: pytest.MonkeyPatch, freeze: str) -> None:
    # Frozen before the call, the block READ times out and the tag READ made for it is released
    # without ever being posted. Frozen between the READs, the tag READ times out; it may still
    # write the landing blocks' tag rows. Either way the landing blocks stay out of use until
    # the READ is proven quiet, and the tag slots are not touched.
    landing = consumer.landing

    def before_post(n: int) -> None:
        if n == 1 and freeze == "between the READs":
            producer.pause()

    posts = Posts(monkeypatch, consumer.agent, before_post)
    local = landing.acquire(2)
    assert local is not None
    landing.tensor[local] = 0
    pool = consumer.tag_slots.num_free
    if freeze == "before the call":
        producer.pause()
    try:
        deadline = soon(0.3)
        with pytest.raises(TransferTimeout):
            peer.read_blocks_and_tags(np.array([5, 6], dtype=np.int32), local, 0.3)
        assert_ended_by(deadline)
        assert posts.posts == (1 if freeze == "before the call" else 2)
        assert sorted(landing.quarantined_ids().tolist()) == sorted(local.tolist())
        landing.release(local)  # a no-op: they belong to the quarantine now
        assert consumer.sweep_quarantine() == 0 and landing.num_quarantined == 2
        assert consumer.tag_slots.num_free == pool and consumer.tag_slots.num_quarantined == 0
    finally:
        producer.resume()
    _await_quarantine_lifted(consumer)
    for r, lid in zip((5, 6), local.tolist(), strict=True):  # the data landed, late or not
        assert torch.equal(landing.tensor[lid], producer.reference(r))
    assert landing.num_free == landing.num_blocks and not peer.closed


def _await_quarantine_lifted(consumer: ConsumerTransport) -> None:
    """Sweep until no landing block or tag slot is quarantined (the producer has resumed)."""
    limit = soon(10.0)
    while consumer.landing.num_quarantined or consumer.tag_slots.num_quarantined:
        assert time.monotonic() < limit, "the quarantine never lifted after the producer resumed"
        consumer.sweep_quarantine()
        time.sleep(0.01)


def test_lease_release_notification_reaches_the_producer(producer: ProducerProcess, peer: ProducerPeer) -> None:
    leases = [7, (1 << 64) - 1, 123_456_789]
    fingerprints, _ = peer.read_tags(np.array([1], dtype=np.int32), soon(),
                                     notif=encode_release_notification(leases))
    assert fingerprints.tolist() == [tag_of(producer.seed, 1)]
    messages = producer.drain(expect=1)
    assert [decode_release_notification(m) for m in messages] == [leases]


def test_stalled_peer_times_out_on_time_and_quarantines_until_quiet(
        consumer: ConsumerTransport, producer: ProducerProcess, peer: ProducerPeer) -> None:
    landing = consumer.landing
    remote = np.array([3, 11], dtype=np.int32)
    producer.pause()
    try:
        stuck = landing.acquire(2)
        assert stuck is not None
        landing.tensor[stuck] = 0
        deadline = soon(0.3)
        with pytest.raises(TransferTimeout):
            peer.read_blocks(remote, stuck, deadline)
        assert_ended_by(deadline)
        assert sorted(landing.quarantined_ids().tolist()) == sorted(stuck.tolist())
        landing.release(stuck)  # a no-op: they belong to the quarantine now
        assert sorted(landing.quarantined_ids().tolist()) == sorted(stuck.tolist())

        deadline = soon(0.3)
        with pytest.raises(TransferTimeout):
            peer.read_tags(remote, deadline, notif=encode_release_notification([1]))
        assert_ended_by(deadline)

        # Frozen producer: nothing is proven quiet, the quarantined blocks are never handed out.
        assert consumer.sweep_quarantine() == 0
        for _ in range(3):
            others = landing.acquire(landing.num_blocks - 2)
            assert others is not None and not set(others.tolist()) & set(stuck.tolist())
            assert landing.acquire(1) is None
            landing.release(others)
    finally:
        producer.resume()
    _await_quarantine_lifted(consumer)
    assert landing.num_free == landing.num_blocks
    # The late data did land in the quarantined blocks: reusing them early would have been wrong.
    for r, lid in zip(remote.tolist(), stuck.tolist(), strict=True):
        assert torch.equal(landing.tensor[lid], producer.reference(r))
    assert not peer.closed
    ids = landing.acquire(2)
    assert ids is not None
    peer.read_blocks(remote, ids, soon())
    landing.release(ids)


# Keep last: it kills the module's producer.
def test_killed_producer_disconnects_and_its_restart_at_the_same_address_is_read_fresh(
        consumer: ConsumerTransport, producers_pair: tuple[ProducerProcess, ProducerProcess],
        peer: ProducerPeer) -> None:
    first, second = producers_pair
    old = peer
    assert consumer.connect(first.handshake, endpoint="encoder-0") is old
    landing = consumer.landing
    ids = landing.acquire(2)
    assert ids is not None
    try:
        remote = np.array([1, 6], dtype=np.int32)
        old.read_blocks(remote, ids, soon())
        assert torch.equal(landing.tensor[ids[0]], first.reference(1))

        first.kill()
        with pytest.raises(PeerDisconnected):
            old.read_blocks(remote, ids, soon(2.0))
        assert old.closed and consumer.peer("encoder-0") is None
        with pytest.raises(PeerDisconnected, match="handshake again"):
            old.read_tags(remote, soon())

        before, after = first.handshake, second.handshake
        for region in ("buffer_region", "stamp_region"):
            assert getattr(before, region) == getattr(after, region)  # same addresses, same numbers
        assert before.incarnation_id != after.incarnation_id and before.agent_name != after.agent_name

        new = consumer.connect(after, endpoint="encoder-0")
        assert new is not old and consumer.peer("encoder-0") is new
        new.read_blocks(remote, ids, soon())
        for r, lid in zip(remote.tolist(), ids.tolist(), strict=True):
            assert torch.equal(landing.tensor[lid], second.reference(r))
            assert not torch.equal(landing.tensor[lid], first.reference(r))
        fingerprints, generations = new.read_tags(remote, soon())
        assert fingerprints.tolist() == [tag_of(8, 1), tag_of(8, 6)] and generations.tolist() == [8, 8]
    finally:
        landing.release(ids)
