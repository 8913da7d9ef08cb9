"""Tenant isolation by ``cache_salt`` with a real ``epd encoder`` (mock transport): the same image
under two salts is two entries, each tenant's repeat is a hit on its own, the unsalted mm_hash
finds none of them; through ``epd proxy`` before a fake vLLM, the body keeps its ``cache_salt``
and the items' uuids differ per salt."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from common import media
from common import metrics as names
from common.wire import PROTOCOL_VERSION, pb2, pb2_grpc
from epd_harness.media import image_bytes
from epd_harness.procs import EncoderProcess, start_encoder
from epd_harness.vllm import Server, chat_body, start_proxy
from prefill_client.consumer.client import EncoderCacheClient
from prefill_client.consumer.connection import MediaSpec
from prefill_client.handoff import from_params
from tests.support.fake_vllm import FakeVllm
from tests.support.scrape import scrape

pytestmark = pytest.mark.timeout(240)

MODEL = "tiny-qwen3-vl"  # the encoder's default model id


@dataclass
class Stack:
    encoder: EncoderProcess
    backend: FakeVllm
    proxy: Server
    stub: pb2_grpc.EncoderCacheServiceStub
    fingerprint: str  # the encoder's preprocessing fingerprint, an input of every mm_hash


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp: Path = tmp_path_factory.mktemp("cache-salt")
    # A short drain: the proxy's leases are left to their ttl, which the encoder would wait for on SIGTERM.
    encoder = start_encoder(tmp, "--transport", "mock", "--cache-blocks", "64", "--block-size", "64",
                            "--drain-grace-s", "1")
    backend = FakeVllm(MODEL)
    proxy: Server | None = None
    try:
        proxy = start_proxy(tmp / "proxy.log", [encoder.target], [backend.url], "--transport", "mock")
        stub = pb2_grpc.EncoderCacheServiceStub(grpc.insecure_channel(encoder.target))
        hs = stub.Handshake(pb2.HandshakeRequest(protocol_version=PROTOCOL_VERSION, model_id=MODEL,
                                                 consumer_id="t"), timeout=10)
        assert hs.keys_cache_salt  # what a consumer checks before it sends a salted item
        yield Stack(encoder, backend, proxy, stub, hs.preprocess.fingerprint)
    finally:
        if proxy is not None:
            proxy.stop()
        backend.close()
        encoder.terminate()


def _encode(stack: Stack, image: bytes, salt: str) -> pb2.ItemLocation:
    resp = stack.stub.Encode(pb2.EncodeRequest(model_id=MODEL, consumer_id="t", items=[
        pb2.MediaItem(image=image, uuid="u", cache_salt=salt)]), timeout=60)
    (result,) = resp.results
    assert result.WhichOneof("outcome") == "location", result
    return result.location


def _lookup(stack: Stack, *hashes: str) -> list[pb2.ItemResult]:
    return list(stack.stub.Lookup(pb2.LookupRequest(model_id=MODEL, consumer_id="t", mm_hashes=hashes),
                                  timeout=10).results)


def _release(stack: Stack, *locations: pb2.ItemLocation) -> None:
    stack.stub.Release(pb2.ReleaseRequest(consumer_id="t", lease_ids=[loc.lease_id for loc in locations]),
                       timeout=10)


def test_two_tenants_same_image_are_two_entries_and_the_unsalted_hash_finds_neither(stack: Stack) -> None:
    image = image_bytes(64, 64, seed=31)
    unsalted = media.mm_hash(MODEL, stack.fingerprint, media.content_hash("image", [image]))
    before = scrape(stack.encoder.metrics_port)
    a1, b1 = _encode(stack, image, "tenant-a"), _encode(stack, image, "tenant-b")
    assert (a1.result, b1.result) == (pb2.CACHE_RESULT_MISS, pb2.CACHE_RESULT_MISS)
    assert a1.mm_hash == media.mm_hash(MODEL, stack.fingerprint, media.content_hash("image", [image]), "tenant-a")
    assert len({a1.mm_hash, b1.mm_hash, unsalted}) == 3 and set(a1.block_ids).isdisjoint(b1.block_ids)
    after = scrape(stack.encoder.metrics_port)
    assert after.delta(before, names.DEVICE_EC_MISSES + "_total") == 2
    # The second tenant's miss decoded the image again: layer 1 is not shared across salts.
    assert after.delta(before, names.MM_CACHE_HITS + "_total") == 0

    # Each tenant's repeat is a hit on its own entry, and only on it.
    a2, b2 = _encode(stack, image, "tenant-a"), _encode(stack, image, "tenant-b")
    assert (a2.result, a2.mm_hash, list(a2.block_ids)) == (pb2.CACHE_RESULT_HIT, a1.mm_hash, list(a1.block_ids))
    assert (b2.result, b2.mm_hash, list(b2.block_ids)) == (pb2.CACHE_RESULT_HIT, b1.mm_hash, list(b1.block_ids))
    assert scrape(stack.encoder.metrics_port).delta(after, names.DEVICE_EC_MISSES + "_total") == 0

    # Lookup is by mm_hash: the unsalted one finds nothing, a tenant's finds that tenant's entry alone.
    (plain,) = _lookup(stack, unsalted)
    assert plain.WhichOneof("outcome") == "error" and plain.error.code == grpc.StatusCode.NOT_FOUND.value[0]
    found_a, found_b = _lookup(stack, a1.mm_hash, b1.mm_hash)
    assert (found_a.location.mm_hash, list(found_a.location.block_ids)) == (a1.mm_hash, list(a1.block_ids))
    assert (found_b.location.mm_hash, list(found_b.location.block_ids)) == (b1.mm_hash, list(b1.block_ids))
    # No salt is the item of before: a third entry, under the unsalted mm_hash.
    plain_item = _encode(stack, image, "")
    assert (plain_item.result, plain_item.mm_hash) == (pb2.CACHE_RESULT_MISS, unsalted)
    _release(stack, a1, b1, a2, b2, found_a.location, found_b.location, plain_item)


def test_a_salt_over_the_bound_is_invalid_argument_naming_the_field(stack: Stack) -> None:
    with pytest.raises(grpc.RpcError) as info:
        _encode(stack, image_bytes(64, 64, seed=32), "s" * 257)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "item 0 cache_salt is 257 characters; at most 256" in info.value.details()


def test_the_client_pulls_salted_items_verified(stack: Stack) -> None:
    image = image_bytes(64, 96, seed=33)
    with EncoderCacheClient(stack.encoder.target, MODEL, transport_kind="mock", consumer_id="salted") as client:
        a, b, plain = client.encode([MediaSpec.image(image, cache_salt=s) for s in ("tenant-a", "tenant-b", "")])
    assert len({a.mm_hash, b.mm_hash, plain.mm_hash}) == 3
    # Three entries of one image: the same rows under three names.
    assert a.embeddings.equal(b.embeddings) and a.embeddings.equal(plain.embeddings)


def _chat(stack: Stack, image: bytes, salt: str | None) -> dict[str, Any]:
    body = chat_body(MODEL, ["data:image/png;base64," + base64.b64encode(image).decode()], "what is it?")
    if salt is not None:
        body["cache_salt"] = salt
    resp = httpx.post(stack.proxy.url + "/v1/chat/completions", json=body, timeout=60.0)
    assert resp.status_code == 200, resp.text + stack.proxy.log()[-3000:]
    return stack.backend.chats[-1]


def test_through_the_proxy_the_salt_reaches_vllm_and_names_the_item(stack: Stack) -> None:
    image = image_bytes(80, 64, seed=34)
    sent = {salt: _chat(stack, image, salt) for salt in ("tenant-a", "tenant-b", None)}
    uuids = {salt: body["messages"][0]["content"][0]["uuid"] for salt, body in sent.items()}
    assert sent["tenant-a"]["cache_salt"] == "tenant-a" and sent["tenant-b"]["cache_salt"] == "tenant-b"
    assert "cache_salt" not in sent[None]
    content = media.content_hash("image", [image])
    assert uuids == {salt: media.mm_hash(MODEL, stack.fingerprint, content, salt or "") for salt in uuids}
    assert len(set(uuids.values())) == 3
    # Each placement names its own tenant's entry: pulled as the connector would, under that mm_hash.
    with EncoderCacheClient(stack.encoder.target, MODEL, transport_kind="mock", consumer_id="connector") as puller:
        for salt, body in sent.items():
            (placed,) = from_params(body["ec_transfer_params"]).values()
            assert placed.mm_hash == uuids[salt]
            (pulled,) = puller.pull_placed([placed])
            assert pulled.mm_hash == uuids[salt]
    # A tenant's repeat is a hit on its own entry: nothing encoded, the same name.
    before = scrape(stack.encoder.metrics_port)
    again = _chat(stack, image, "tenant-b")
    assert scrape(stack.encoder.metrics_port).delta(before, names.DEVICE_EC_MISSES + "_total") == 0
    (placed,) = from_params(again["ec_transfer_params"]).values()
    assert placed.mm_hash == uuids["tenant-b"] and again["cache_salt"] == "tenant-b"
    with EncoderCacheClient(stack.encoder.target, MODEL, transport_kind="mock", consumer_id="connector") as puller:
        puller.pull_placed([placed])
