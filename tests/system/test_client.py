"""EncoderCacheClient against a real `epd encoder` process: verified pulls and every failure reason."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from common import media
from common.errors import CacheFullError, ECLoadFailure, InvalidMediaError, LoadFailureReason
from common.transport import PostInfo
from common.wire import pb2
from epd_harness.media import image_bytes, video_frames
from epd_harness.ports import free_port
from epd_harness.procs import start_encoder
from prefill_client.consumer.client import EncoderCacheClient
from prefill_client.consumer.connection import MediaSpec
from tests.support.reference import Reference, matches
from tests.transport_params import TRANSPORTS

MODEL = "tiny-qwen3-vl"
REF = Reference()


def _encode_when_admitted(client: EncoderCacheClient, data: bytes) -> None:
    """Encode, waiting out RESOURCE_EXHAUSTED while the previous lease release travels."""
    for _ in range(100):
        try:
            client.encode([MediaSpec.image(data)])
            return
        except CacheFullError as exc:
            time.sleep(exc.retry_after_ms / 1000)
    raise AssertionError("never admitted")


def _is_tag_read(info: PostInfo) -> bool:
    return info.nbytes % 16 == 0 and info.nbytes <= 16 * 64  # tags + generations: 16 bytes a block


def _once_before_tag_read(client: EncoderCacheClient, action: Callable[[], None],
                          posts: list[PostInfo] | None = None) -> Callable[[PostInfo], None]:
    """A mock ``before_post`` hook: at the client's next tag READ only, wait past the encoder's
    200 ms lease TTL (the pulled items become evictable), then run ``action``. ``posts`` records
    every READ posted up to then."""
    def hook(info: PostInfo) -> None:
        if posts is not None:
            posts.append(info)
        if not _is_tag_read(info):
            return
        client.transport.agent.faults.before_post = None
        time.sleep(0.3)
        action()

    return hook


@pytest.fixture(scope="module", params=TRANSPORTS)
def encoder(request, tmp_path_factory):
    enc = start_encoder(tmp_path_factory.mktemp("enc"), "--transport", request.param,
                        "--cache-blocks", "48", "--block-size", "64")
    yield enc
    assert enc.terminate() == 0, enc.log()


def test_pulled_embeddings_equal_a_local_reference_encode(encoder) -> None:
    images = [image_bytes(w, h, seed=s) for s, (w, h) in enumerate([(64, 64), (200, 120), (90, 300)])]
    frames = video_frames(64, 96, 4, seed=7)
    with EncoderCacheClient(encoder.target, MODEL, transport_kind=encoder.transport) as client:
        pulled = client.encode([MediaSpec.image(b) for b in images] + [MediaSpec.video(frames)])
        assert [p.source for p in pulled] == ["miss"] * 4
        refs = [REF.image(b) for b in images] + [REF.video(frames)]
        for p, ref in zip(pulled, refs):
            assert matches(p.embeddings, ref), p.mm_hash
        assert not matches(pulled[0].embeddings, refs[1])  # the check can tell items apart
        # The consumer-side cache serves a repeat without any transfer.
        pulls = client.metrics.pulls._value.get()
        again = client.encode([MediaSpec.image(images[0])])[0]
        assert again.source == "local" and torch_equal(again.embeddings, pulled[0].embeddings)
        assert client.metrics.pulls._value.get() == pulls
    with EncoderCacheClient(encoder.target, MODEL, transport_kind=encoder.transport) as fresh:
        found = fresh.lookup([pulled[1].mm_hash, "f" * 32])
        assert found[0] is not None and found[0].source == "hit" and matches(found[0].embeddings, refs[1])
        assert found[1] is None
        with pytest.raises(ECLoadFailure) as info:
            fresh.lookup(["e" * 32], require=True)
        assert info.value.reason is LoadFailureReason.EVICTED


def torch_equal(a, b) -> bool:  # type: ignore[no-untyped-def]
    import torch

    return bool(torch.equal(a, b))


def test_bad_media_is_a_typed_error_naming_the_item(encoder) -> None:
    with EncoderCacheClient(encoder.target, MODEL, transport_kind=encoder.transport) as client:
        with pytest.raises(InvalidMediaError, match="cat.png"):
            client.encode([MediaSpec.image(image_bytes(64, 64, seed=50)), MediaSpec.image(b"nope", uuid="cat.png")])


@pytest.mark.parametrize("reason", [LoadFailureReason.TAG_MISMATCH, LoadFailureReason.GENERATION_MISMATCH])
def test_block_reused_between_the_reads_is_caught(tmp_path, reason) -> None:
    """The mock runs a callback between the block READ and the tag READ: there the lease
    expires and the producer reuses the one usable block for another item (tag) or the
    same item again (generation). The pull must fail, naming the item and block."""
    enc = start_encoder(tmp_path, "--transport", "mock", "--cache-blocks", "2", "--block-size", "64",
                        "--min-hold-ms", "0", "--lease-ttl-ms", "200")
    a, b = image_bytes(64, 64, seed=1), image_bytes(64, 64, seed=2)
    try:
        with EncoderCacheClient(enc.target, MODEL, transport_kind="mock") as client, \
                EncoderCacheClient(enc.target, MODEL, transport_kind="mock") as other:
            def reuse() -> None:
                _encode_when_admitted(other, b)
                if reason is LoadFailureReason.GENERATION_MISMATCH:
                    _encode_when_admitted(other, a)  # same item, same block, new generation

            client.media_params()  # handshake first, so the hook sees only the pull's posts
            client.transport.agent.faults.before_post = _once_before_tag_read(client, reuse)
            with pytest.raises(ECLoadFailure) as info:
                client.encode([MediaSpec.image(a)])
            assert info.value.reason is reason
            assert info.value.block == 0
            assert client.metrics.load_failures.labels(reason=reason.value)._value.get() == 1
            # With the retry policy the same race is survived by re-requesting once.
            retry = EncoderCacheClient(enc.target, MODEL, transport_kind="mock", failure_policy="retry")
            with retry:
                retry.media_params()
                retry.transport.agent.faults.before_post = _once_before_tag_read(
                    retry, lambda: _encode_when_admitted(other, b))
                got = retry.encode([MediaSpec.image(a)])[0]
                assert matches(got.embeddings, REF.image(a))
    finally:
        assert enc.terminate() == 0, enc.log()


def test_stalled_transfer_times_out_and_quarantines_the_landing_blocks(tmp_path) -> None:
    enc = start_encoder(tmp_path, "--transport", "mock", "--cache-blocks", "8", "--block-size", "64")
    try:
        with EncoderCacheClient(enc.target, MODEL, transport_kind="mock", pull_timeout_s=0.3,
                                landing_blocks=4) as client:
            client.media_params()
            faults = client.transport.agent.faults
            faults.stall = True
            started = time.monotonic()
            with pytest.raises(ECLoadFailure) as info:
                client.encode([MediaSpec.image(image_bytes(64, 64, seed=3))])
            assert info.value.reason is LoadFailureReason.TIMEOUT
            assert time.monotonic() - started < 0.3 + 5.0  # our deadline, not a hang
            landing = client.transport.landing
            quarantined = set(landing.quarantined_ids().tolist())
            assert len(quarantined) == 1
            faults.stall = False
            # Later pulls never land in the quarantined block, and read correct data.
            for seed in range(10, 16):
                img = image_bytes(64, 64, seed=seed)
                got = client.encode([MediaSpec.image(img)])[0]
                assert matches(got.embeddings, REF.image(img))
            assert set(landing.quarantined_ids().tolist()) <= quarantined
    finally:
        assert enc.terminate() == 0, enc.log()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_restarted_producer_is_re_handshaken(tmp_path, transport) -> None:
    port = free_port()
    args = ("--transport", transport, "--cache-blocks", "8", "--block-size", "64", "--port", str(port))
    enc = start_encoder(tmp_path, *args, name="first")
    img1, img2 = image_bytes(64, 64, seed=21), image_bytes(96, 64, seed=22)
    try:
        with EncoderCacheClient(f"127.0.0.1:{port}", MODEL, transport_kind=transport) as client:
            assert matches(client.encode([MediaSpec.image(img1)])[0].embeddings, REF.image(img1))
            first = client.connection(client.targets[0]).incarnation_id
            client.release_placed(client.place([MediaSpec.image(img1)]))  # remembered under the first incarnation
            assert enc.terminate() == 0
            enc = start_encoder(tmp_path, *args, name="second")
            got = client.encode([MediaSpec.image(img2)])[0]
            assert matches(got.embeddings, REF.image(img2))
            assert client.connection(client.targets[0]).incarnation_id == enc.incarnation_id != first
            # Placed before the restart under the first incarnation: encoded again, not looked up.
            placed = client.place([MediaSpec.image(img1)])
            assert placed[0].incarnation_id == enc.incarnation_id and placed[0].location.result == pb2.CACHE_RESULT_MISS
            assert matches(client.pull_placed(placed)[0].embeddings, REF.image(img1))
    finally:
        enc.terminate()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_restarted_encoder_is_reconnected_before_a_request_needs_it(tmp_path, transport) -> None:
    """The client handshakes with its lone encoder when it is made, and again by itself once the
    encoder is back from a restart (its readiness lost, then regained): the transport is connected
    to the new incarnation, and the first request after the restart makes no handshake."""
    port = free_port()
    args = ("--transport", transport, "--cache-blocks", "8", "--block-size", "64", "--port", str(port))
    enc = start_encoder(tmp_path, *args, name="first")
    img = image_bytes(64, 96, seed=23)
    try:
        with EncoderCacheClient(f"127.0.0.1:{port}", MODEL, transport_kind=transport, membership_refresh_s=0.1,
                                probe_connections=True) as client:
            conn = client.connection(client.targets[0])
            handshakes = client.metrics.handshakes.labels(result="ok")
            assert conn is not None and conn.incarnation_id == enc.incarnation_id and handshakes._value.get() == 1
            assert enc.terminate() == 0
            enc = start_encoder(tmp_path, *args, name="second")
            give_up = time.monotonic() + 30.0  # the pool asks every 0.1 s: this bounds a loaded box's wait
            # Counted just after the incarnation is set: wait for both.
            while conn.incarnation_id != enc.incarnation_id or handshakes._value.get() < 2:
                assert time.monotonic() < give_up, f"never reconnected to {enc.incarnation_id}: {conn.incarnation_id}"
                time.sleep(0.05)
            assert handshakes._value.get() == 2
            assert matches(client.encode([MediaSpec.image(img)])[0].embeddings, REF.image(img))
            assert handshakes._value.get() == 2  # the request found the new incarnation connected
    finally:
        enc.terminate()


def test_two_encoders_spread_items_and_fail_over(tmp_path) -> None:
    a = start_encoder(tmp_path, "--transport", "mock", "--cache-blocks", "32", "--block-size", "64", name="a")
    b = start_encoder(tmp_path, "--transport", "mock", "--cache-blocks", "32", "--block-size", "64", name="b")
    images = [image_bytes(64, 64, seed=100 + i) for i in range(12)]
    try:
        with EncoderCacheClient([a.target, b.target], MODEL, transport_kind="mock", rpc_timeout_s=3) as client:
            pulled = client.encode([MediaSpec.image(img) for img in images])
            assert {p.encoder for p in pulled} == {a.target, b.target}
            for p, img in zip(pulled, images):
                assert matches(p.embeddings, REF.image(img))
            client.release_placed(client.place([MediaSpec.image(img) for img in images]))  # remembered where they are
            a.kill()
            more = [image_bytes(64, 64, seed=200 + i) for i in range(8)]
            pulled = client.encode([MediaSpec.image(img) for img in more])
            assert {p.encoder for p in pulled} == {b.target}
            for p, img in zip(pulled, more):
                assert matches(p.embeddings, REF.image(img))
            # The Lookup of the items remembered on a fails; they are encoded on b instead.
            placed = client.place([MediaSpec.image(img) for img in images])
            assert {p.encoder for p in placed} == {b.target}
            for p, img in zip(client.pull_placed(placed), images, strict=True):
                assert matches(p.embeddings, REF.image(img))
    finally:
        a.kill()
        assert b.terminate() == 0, b.log()


def test_one_bad_item_of_a_batched_pull_fails_alone(tmp_path) -> None:
    """Three items come back in one Encode answer and are pulled in one block READ and one tag READ.
    Between the two READs the first item is evicted and its block given to another item. The call
    raises ECLoadFailure(tag_mismatch) naming that item; the other two were verified and are kept
    (local cache), so a retry pulls only what failed."""
    enc = start_encoder(tmp_path, "--transport", "mock", "--cache-blocks", "4", "--block-size", "64",
                        "--min-hold-ms", "0", "--lease-ttl-ms", "200")
    a, b, c, d = (image_bytes(64, 64, seed=s) for s in (11, 12, 13, 14))
    try:
        with EncoderCacheClient(enc.target, MODEL, transport_kind="mock") as client, \
                EncoderCacheClient(enc.target, MODEL, transport_kind="mock") as other:
            client.media_params()
            posts: list[PostInfo] = []
            # Past the lease TTL all three are evictable, the first least recent: d takes its block.
            client.transport.agent.faults.before_post = _once_before_tag_read(
                client, lambda: _encode_when_admitted(other, d), posts)
            with pytest.raises(ECLoadFailure) as info:
                client.encode([MediaSpec.image(x) for x in (a, b, c)])
            assert info.value.reason is LoadFailureReason.TAG_MISMATCH
            assert len(posts) == 2, "one block READ and one tag READ for the whole batch"
            assert info.value.mm_hash == media.mm_hash(MODEL, client.media_params()[1], MediaSpec.image(a).key())
            # What the local cache holds, by mm_hash (its keys are (weights digest, mm_hash)).
            kept = [mm_hash for _, mm_hash in client._local._items]  # noqa: SLF001
            assert len(kept) == 2 and info.value.mm_hash not in kept
            for h, ref in zip(kept, (REF.image(b), REF.image(c))):
                assert matches(client.cached(h).embeddings, ref)
            # The retry finds the two locally and pulls only the first again.
            again = client.encode([MediaSpec.image(x) for x in (a, b, c)])
            assert [p.source for p in again] == ["miss", "local", "local"]
            assert matches(again[0].embeddings, REF.image(a))
    finally:
        assert enc.terminate() == 0, enc.log()


def test_placed_items_are_pulled_by_another_consumer_and_released_in_the_placers_name(encoder) -> None:
    """What epd proxy and the vLLM connector do: one client places, another pulls and releases."""
    import dataclasses

    from tests.support.scrape import scrape

    images = [image_bytes(120, 80, seed=40 + i) for i in range(3)]
    with EncoderCacheClient(encoder.target, MODEL, transport_kind=encoder.transport, consumer_id="placer") as placer, \
            EncoderCacheClient(encoder.target, MODEL, transport_kind=encoder.transport, consumer_id="puller") as puller:
        placed = placer.place([MediaSpec.image(b) for b in images])
        assert [p.owner for p in placed] == ["placer"] * 3 and placer.metrics.pulls._value.get() == 0
        assert scrape(encoder.metrics_port).get("epd_encoder_leases_active") >= 3
        # The third names the encoder otherwise than the puller knows it: found by mm_hash instead.
        renamed = dataclasses.replace(placed[2], encoder="elsewhere:1")
        pulled = puller.pull_placed([placed[0], placed[1], renamed])
        for p, data in zip(pulled, images):
            assert matches(p.embeddings, REF.image(data)), p.mm_hash
        assert [p.mm_hash for p in pulled] == [p.mm_hash for p in placed]
        deadline = time.monotonic() + 5
        while scrape(encoder.metrics_port).get("epd_encoder_leases_active") > 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        # The two placed leases went back in the placer's name; only the renamed one's remains (ttl).
        assert scrape(encoder.metrics_port).get("epd_encoder_leases_active") <= 1
        # A placement whose location names other blocks fails the check, loudly.
        fresh = placer.place([MediaSpec.image(image_bytes(64, 64, seed=49))])[0]
        loc = type(fresh.location)()
        loc.CopyFrom(fresh.location)
        loc.block_ids[0] = placed[0].location.block_ids[0]
        with pytest.raises(ECLoadFailure) as info:
            puller.pull_placed([dataclasses.replace(fresh, location=loc)])
        assert info.value.reason in (LoadFailureReason.TAG_MISMATCH, LoadFailureReason.GENERATION_MISMATCH)


def test_bytes_placed_before_are_looked_up_not_sent_again(encoder) -> None:
    """A client places bytes it placed before with one Lookup of the mm_hash the encoder answered
    then (not an Encode carrying them); what the Lookup does not find is encoded; a salt is another
    item. Every placement is pulled by another consumer, verified, and equals the reference."""
    from tests.support.scrape import scrape

    a, b, c = (image_bytes(96, 64, seed=60 + i) for i in range(3))

    def calls() -> tuple[float, float]:
        got = scrape(encoder.metrics_port)
        return (got.get("epd_encoder_requests_total", method="Encode", code="OK"),
                got.get("epd_encoder_requests_total", method="Lookup", code="OK"))

    with EncoderCacheClient(encoder.target, MODEL, transport_kind=encoder.transport, consumer_id="placer2") as placer, \
            EncoderCacheClient(encoder.target, MODEL, transport_kind=encoder.transport, consumer_id="puller2",
                               local_cache_blocks=0) as puller:  # every item READ from its placement
        first = placer.place([MediaSpec.image(a), MediaSpec.image(b)])
        before = calls()
        again = placer.place([MediaSpec.image(a), MediaSpec.image(c), MediaSpec.image(a)])
        after = calls()
        # a by one Lookup (named twice: one mm_hash asked, one lease shared), c by one Encode.
        assert (after[0] - before[0], after[1] - before[1]) == (1, 1)
        assert again[0].mm_hash == first[0].mm_hash and again[0].location.result == pb2.CACHE_RESULT_HIT
        assert again[2].location.lease_id == again[0].location.lease_id
        assert again[1].location.result == pb2.CACHE_RESULT_MISS
        # Under a salt the same bytes are another item: encoded, not looked up.
        salted = placer.place([MediaSpec.image(a, cache_salt="tenant-x")])[0]
        assert salted.mm_hash != first[0].mm_hash and salted.location.result == pb2.CACHE_RESULT_MISS
        assert calls()[1] == after[1]
        # What the client remembers is no longer on the encoder (here: a name it never had): encoded.
        key = (MediaSpec.image(b).key(), "")
        target, incarnation, _ = placer._known._placed.get(key)
        placer._known._placed[key] = (target, incarnation, "0" * 32)
        refound = placer.place([MediaSpec.image(b)])[0]
        assert refound.mm_hash == first[1].mm_hash and calls()[0] == after[0] + 2
        placed = [*first, again[0], again[1], salted, refound]  # again[2] is again[0]
        for p, data in zip(puller.pull_placed(placed), [a, b, a, c, a, b], strict=True):
            assert matches(p.embeddings, REF.image(data)), p.mm_hash


def test_big_bytes_another_client_placed_are_found_by_their_derived_mm_hash(encoder) -> None:
    """A client that never placed an item of DERIVE_MIN_BYTES or more finds it on its encoder with
    one Lookup of the mm_hash it derives from the bytes, as the encoder does (what another proxy or
    worker placed is not sent again); under a salt the same bytes are another item (the Lookup
    misses, an Encode places it); new big bytes cost a Lookup that misses, then an Encode; small
    new bytes go straight to an Encode. Every placement is pulled by another consumer, verified,
    and equals the reference."""
    from prefill_client.consumer.known import DERIVE_MIN_BYTES
    from tests.support.scrape import scrape

    big, new_big = (image_bytes(224, 224, seed=70 + i) for i in range(2))
    small, new_small = (image_bytes(64, 64, seed=72 + i) for i in range(2))
    assert min(len(big), len(new_big)) >= DERIVE_MIN_BYTES > max(len(small), len(new_small))

    def calls() -> tuple[float, float]:
        got = scrape(encoder.metrics_port)
        return (got.get("epd_encoder_requests_total", method="Encode", code="OK"),
                got.get("epd_encoder_requests_total", method="Lookup", code="OK"))

    def step(items: list[MediaSpec]) -> tuple[pb2.ItemLocation, tuple[float, float]]:
        before = calls()
        placement = other.place(items)[0]
        after = calls()
        placements.append(placement)
        return placement.location, (after[0] - before[0], after[1] - before[1])

    placements = []
    with EncoderCacheClient(encoder.target, MODEL, transport_kind=encoder.transport, consumer_id="placer3") as placer, \
            EncoderCacheClient(encoder.target, MODEL, transport_kind=encoder.transport, consumer_id="placer4") as other, \
            EncoderCacheClient(encoder.target, MODEL, transport_kind=encoder.transport, consumer_id="puller3",
                               local_cache_blocks=0) as puller:
        first = placer.place([MediaSpec.image(big)])[0]
        placements.append(first)
        loc, moved = step([MediaSpec.image(small)])  # other's first call: its handshake, then an Encode
        assert moved == (1, 0) and loc.result == pb2.CACHE_RESULT_MISS
        loc, moved = step([MediaSpec.image(big)])
        assert moved == (0, 1), "bytes on the encoder were sent again"
        assert loc.mm_hash == first.mm_hash and loc.result == pb2.CACHE_RESULT_HIT
        loc, moved = step([MediaSpec.image(big, cache_salt="tenant-y")])
        assert moved == (1, 1) and loc.mm_hash != first.mm_hash and loc.result == pb2.CACHE_RESULT_MISS
        loc, moved = step([MediaSpec.image(new_big)])
        assert moved == (1, 1) and loc.result == pb2.CACHE_RESULT_MISS
        loc, moved = step([MediaSpec.image(new_small)])
        assert moved == (1, 0) and loc.result == pb2.CACHE_RESULT_MISS
        sent = [big, small, big, big, new_big, new_small]
        for p, data in zip(puller.pull_placed(placements), sent, strict=True):
            assert matches(p.embeddings, REF.image(data)), p.mm_hash
