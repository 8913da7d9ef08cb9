"""`epd encoder` as a real process on port 0: handshake, encode, lookup, release, limits, health."""

from __future__ import annotations

import concurrent.futures
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common import metrics
from common.config import LIVENESS_SERVICE, READINESS_SERVICE
from common.fingerprint import mm_hash_fingerprint
from common.wire import PROTOCOL_VERSION, SERVICE_NAME, pb2, pb2_grpc
from epd_harness.media import image_bytes
from epd_harness.procs import EncoderProcess, start_encoder
from tests.support.scrape import scrape
from tests.transport_params import TRANSPORTS

MODEL = "tiny-qwen3-vl"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _stub(enc: EncoderProcess) -> pb2_grpc.EncoderCacheServiceStub:
    return pb2_grpc.EncoderCacheServiceStub(grpc.insecure_channel(enc.target))


def _scrape(enc: EncoderProcess) -> dict[str, float]:
    return scrape(enc.metrics_port).samples


@pytest.fixture(scope="module", params=TRANSPORTS)
def encoder(request, tmp_path_factory):
    enc = start_encoder(tmp_path_factory.mktemp("enc"), "--transport", request.param, "--cache-blocks", "64",
                        "--block-size", "64")
    yield enc
    assert enc.terminate() == 0, enc.log()


def _encode(stub, *images: bytes, consumer: str = "t") -> pb2.EncodeResponse:
    return stub.Encode(pb2.EncodeRequest(
        model_id=MODEL, consumer_id=consumer,
        items=[pb2.MediaItem(image=b, uuid=f"u{i}") for i, b in enumerate(images)]), timeout=60)


def test_handshake_answers_everything_a_consumer_needs(encoder) -> None:
    resp = _stub(encoder).Handshake(pb2.HandshakeRequest(
        protocol_version=PROTOCOL_VERSION, model_id=MODEL, consumer_id="t"), timeout=10)
    assert resp.model_id == MODEL and resp.incarnation_id == encoder.incarnation_id
    assert resp.transport == encoder.transport
    assert resp.agent_name and resp.agent_metadata
    assert resp.layout.block_size == 64 and resp.layout.num_blocks == 64
    assert resp.layout.scratch_block_id == 63
    assert resp.buffer_region.count == 64 and resp.buffer_region.base_address != 0
    assert resp.buffer_region.stride_bytes == resp.layout.bytes_per_block
    assert resp.stamp_region.count == 64 and resp.stamp_region.stride_bytes == 16
    assert resp.min_hold_ms == 100
    assert resp.preprocess.patch_size > 0 and resp.preprocess.fingerprint


@pytest.mark.parametrize(
    "request_kwargs, needle",
    [
        (dict(protocol_version=PROTOCOL_VERSION, model_id="other-model"), "other-model"),
        (dict(protocol_version=PROTOCOL_VERSION + 7, model_id=MODEL), str(PROTOCOL_VERSION + 7)),
        (dict(protocol_version=PROTOCOL_VERSION, model_id=MODEL,
              expected_layout=pb2.CacheLayout(block_size=4096)), "block_size"),
        (dict(protocol_version=PROTOCOL_VERSION, model_id=MODEL,
              expected_layout=pb2.CacheLayout(dtype=pb2.D_TYPE_FLOAT32)), "dtype"),
        (dict(protocol_version=PROTOCOL_VERSION, model_id=MODEL,
              expected_layout=pb2.CacheLayout(fat_dim=7)), "fat_dim"),
    ],
)
def test_handshake_mismatch_is_failed_precondition_naming_both_sides(encoder, request_kwargs, needle) -> None:
    with pytest.raises(grpc.RpcError) as info:
        _stub(encoder).Handshake(pb2.HandshakeRequest(consumer_id="t", **request_kwargs), timeout=10)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert needle in info.value.details()


def test_encode_lookup_release_lifecycle(encoder) -> None:
    stub = _stub(encoder)
    img = image_bytes(96, 64, seed=11)
    first = _encode(stub, img).results[0].location
    assert first.result == pb2.CACHE_RESULT_MISS
    assert len(first.mm_hash) == 32
    assert first.fingerprint == mm_hash_fingerprint(first.mm_hash)
    assert sum(first.tokens_per_block) == first.num_tokens > 0
    assert len(first.block_ids) == len(first.tokens_per_block)
    assert all(0 <= b < 63 for b in first.block_ids)
    assert first.generation > 0 and first.lease_id
    assert first.lease_expiry_unix_ms > time.time() * 1000

    again = _encode(stub, img).results[0].location
    assert again.result == pb2.CACHE_RESULT_HIT
    assert (list(again.block_ids), again.generation) == (list(first.block_ids), first.generation)

    looked = stub.Lookup(pb2.LookupRequest(model_id=MODEL, consumer_id="t", mm_hashes=[first.mm_hash, "0" * 32]),
                         timeout=10)
    hit, miss = looked.results
    assert hit.location.mm_hash == first.mm_hash and list(hit.location.block_ids) == list(first.block_ids)
    assert miss.WhichOneof("outcome") == "error" and miss.error.code == grpc.StatusCode.NOT_FOUND.value[0]

    leases = [first.lease_id, again.lease_id, hit.location.lease_id]
    assert stub.Release(pb2.ReleaseRequest(consumer_id="someone-else", lease_ids=leases), timeout=10).released == 0
    assert stub.Release(pb2.ReleaseRequest(consumer_id="t", lease_ids=leases), timeout=10).released == 3
    assert stub.Release(pb2.ReleaseRequest(consumer_id="t", lease_ids=leases), timeout=10).released == 0


def test_a_call_given_up_by_its_id_gives_back_its_answer_and_refuses_one_to_come(encoder) -> None:
    """What a caller whose deadline passed does: its answer's leases end now, not at their ttl."""
    stub = _stub(encoder)
    img = image_bytes(80, 64, seed=12)
    item = [pb2.MediaItem(image=img)]
    answered = stub.Encode(pb2.EncodeRequest(model_id=MODEL, consumer_id="t", items=item, call_id="c1"), timeout=60)
    lease = answered.results[0].location.lease_id
    assert stub.Release(pb2.ReleaseRequest(consumer_id="other", call_ids=["c1"]), timeout=10).released == 0
    assert stub.Release(pb2.ReleaseRequest(consumer_id="t", call_ids=["c1"]), timeout=10).released == 1
    assert stub.Release(pb2.ReleaseRequest(consumer_id="t", lease_ids=[lease]), timeout=10).released == 0

    # Given up before it is answered: the answer is refused and its lease dropped.
    dropped = _scrape(encoder).get(metrics.EPD_LEASES_DROPPED + "_total", 0.0)
    assert stub.Release(pb2.ReleaseRequest(consumer_id="t", call_ids=["c2"]), timeout=10).released == 0
    with pytest.raises(grpc.RpcError) as info:
        stub.Encode(pb2.EncodeRequest(model_id=MODEL, consumer_id="t", items=item, call_id="c2"), timeout=60)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert _scrape(encoder)[metrics.EPD_LEASES_DROPPED + "_total"] == dropped + 1

    looked = stub.Lookup(pb2.LookupRequest(model_id=MODEL, consumer_id="t", call_id="c3",
                                           mm_hashes=[answered.results[0].location.mm_hash]), timeout=10)
    assert looked.results[0].WhichOneof("outcome") == "location"
    assert stub.Release(pb2.ReleaseRequest(consumer_id="t", call_ids=["c3"]), timeout=10).released == 1

    with pytest.raises(grpc.RpcError) as info:
        stub.Release(pb2.ReleaseRequest(consumer_id="t", call_ids=["x" * 65]), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "call_id" in info.value.details()


def test_sixteen_concurrent_encodes_of_one_new_image_run_the_encoder_once(encoder) -> None:
    stub = _stub(encoder)
    img = image_bytes(80, 80, seed=1234)
    before = _scrape(encoder)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        responses = list(pool.map(lambda _: _encode(stub, img, consumer="c16"), range(16)))
    locations = [r.results[0].location for r in responses]
    assert len({(tuple(loc.block_ids), loc.generation) for loc in locations}) == 1
    assert sum(loc.result == pb2.CACHE_RESULT_MISS for loc in locations) == 1
    after = _scrape(encoder)
    delta = {k: after[k] - before.get(k, 0.0) for k in (
        metrics.DEVICE_EC_QUERIES + "_total", metrics.DEVICE_EC_MISSES + "_total")}
    assert delta == {metrics.DEVICE_EC_QUERIES + "_total": 16, metrics.DEVICE_EC_MISSES + "_total": 1}
    stub.Release(pb2.ReleaseRequest(consumer_id="c16", lease_ids=[loc.lease_id for loc in locations]), timeout=10)


def test_bad_media_fails_per_item_and_the_rest_succeeds(encoder) -> None:
    resp = _encode(_stub(encoder), image_bytes(64, 64, seed=3), b"\x89PNG\r\n\x1a\n truncated", b"")
    good, truncated, empty = resp.results
    assert good.WhichOneof("outcome") == "location"
    for bad, uuid in ((truncated, "u1"), (empty, "u2")):
        assert bad.WhichOneof("outcome") == "error"
        assert bad.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert uuid in bad.error.message and bad.uuid == uuid


@pytest.mark.parametrize(
    "request_kwargs, code",
    [
        (dict(model_id="nope", items=[pb2.MediaItem(image=b"x")]), grpc.StatusCode.FAILED_PRECONDITION),
        (dict(model_id=MODEL, items=[]), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(model_id=MODEL, items=[pb2.MediaItem()]), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(model_id=MODEL, items=[pb2.MediaItem(image=b"x")] * 65), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (dict(model_id=MODEL, call_id="x" * 65, items=[pb2.MediaItem(image=b"x")]), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(model_id=MODEL, incarnation_id="stale", items=[pb2.MediaItem(image=b"x")]),
         grpc.StatusCode.FAILED_PRECONDITION),
    ],
)
def test_request_level_errors(encoder, request_kwargs, code) -> None:
    with pytest.raises(grpc.RpcError) as info:
        _stub(encoder).Encode(pb2.EncodeRequest(consumer_id="t", **request_kwargs), timeout=10)
    assert info.value.code() == code


def test_metrics_parse_and_hold_the_occupancy_invariant(encoder) -> None:
    values = _scrape(encoder)
    active = values[metrics.DEVICE_EC_ACTIVE_BLOCKS]
    free = values[metrics.DEVICE_EC_FREE_BLOCKS]
    held = values[metrics.DEVICE_EC_HELD_BLOCKS]
    assert active + free + held == 63
    assert values[metrics.DEVICE_EC_ACTIVE_REAL_TOKENS] <= active * 64


def test_reflection_lists_the_services(encoder) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(grpc.insecure_channel(encoder.target))
    responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                          timeout=10)
    names = {s.name for r in responses for s in r.list_services_response.service}
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= names


def test_exhaustion_is_immediate_and_clears_after_release(tmp_path) -> None:
    # 3 usable blocks of 64 rows; a 128x128 image is 16 merged tokens at patch 16 / merge 2: one block each.
    enc = start_encoder(tmp_path, "--transport", "mock", "--cache-blocks", "4", "--block-size", "64",
                        "--min-hold-ms", "100")
    try:
        stub = _stub(enc)
        # 512x512 is 256 merged tokens = 4 blocks > the 3 that exist: a per-item error, never a stall.
        too_big = _encode(stub, image_bytes(512, 512, seed=7), image_bytes(128, 128, seed=0)).results
        assert too_big[0].error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert "needs 4 blocks" in too_big[0].error.message
        stub.Release(pb2.ReleaseRequest(consumer_id="t", lease_ids=[too_big[1].location.lease_id]), timeout=10)
        held = [_encode(stub, image_bytes(128, 128, seed=s)).results[0].location for s in range(3)]
        assert len({b for loc in held for b in loc.block_ids}) == 3
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            _encode(stub, image_bytes(128, 128, seed=99))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "retry after" in info.value.details()
        assert time.monotonic() - started < 5.0, "exhaustion must be answered at once, not after a stall"
        stub.Release(pb2.ReleaseRequest(consumer_id="t", lease_ids=[loc.lease_id for loc in held]), timeout=10)
        for _ in range(50):  # the evicted blocks need their 100 ms hold; the hint says when
            try:
                loc = _encode(stub, image_bytes(128, 128, seed=99)).results[0].location
                break
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                time.sleep(0.05)
        else:
            pytest.fail("encode never succeeded after the leases were released")
        assert loc.result == pb2.CACHE_RESULT_MISS
    finally:
        assert enc.terminate() == 0, enc.log()


def _health(target: str, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(target))
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def test_health_and_graceful_shutdown_with_a_lease_outstanding(tmp_path) -> None:
    enc = start_encoder(tmp_path, "--transport", "mock", "--cache-blocks", "8", "--block-size", "64",
                        "--drain-grace-s", "30")
    try:
        for service in ("", LIVENESS_SERVICE, READINESS_SERVICE, SERVICE_NAME):
            assert _health(enc.target, service) == SERVING
        stub = _stub(enc)
        loc = _encode(stub, image_bytes(64, 64, seed=5)).results[0].location
        enc.proc.send_signal(15)
        deadline = time.monotonic() + 10
        while _health(enc.target, READINESS_SERVICE) == SERVING:
            assert time.monotonic() < deadline, "readiness still SERVING after SIGTERM"
            time.sleep(0.05)
        assert enc.proc.poll() is None, "exited while a lease was outstanding"
        with pytest.raises(grpc.RpcError) as info:
            _encode(stub, image_bytes(64, 64, seed=6))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        stub.Release(pb2.ReleaseRequest(consumer_id="t", lease_ids=[loc.lease_id]), timeout=10)
        assert enc.proc.wait(20) == 0
    finally:
        enc.kill()
