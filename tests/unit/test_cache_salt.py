"""Tenant isolation by ``cache_salt``: the salted mm_hash, the engine's entries per salt, the wire.

The same bytes under two salts are two items everywhere the encoder keys anything (the
device cache, leases, coalescing, the input cache); no salt is exactly the mm_hash of
before, so every existing hash stays valid.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import Sequence

import pytest
import torch
from grpc_health.v1 import health_pb2
from prometheus_client import CollectorRegistry

from common import media
from common.layout import CacheLayout
from common.metrics import EncoderMetrics, InputProcessorMetrics
from common.wire import pb2
from encoder_server.cache_blocks import EncoderCacheBlocks
from encoder_server.encode_request import parse_encode_request
from encoder_server.engine import EncoderEngine, Failed, Located, MediaInput
from encoder_server.preprocess import PreprocessConfig, Preprocessor, ProcessedItem
from epd_harness.media import image_bytes
from prefill_client.consumer.client import EncoderCacheClient
from prefill_client.consumer.messages import MediaSpec, encode_request_bytes
from prefill_client.consumer.routing import rendezvous_order
from prefill_client.reference.chat import MediaItem
from prefill_client.reference.input_processor import InputProcessor

MM_HASH = re.compile(r"^[0-9a-f]{32}$")
MODEL, FINGERPRINT = "tiny-qwen3-vl", "fp"
CONTENT = media.content_hash("image", [b"tenant image bytes"])
IMAGE = image_bytes(64, 64, seed=11)  # 64 tokens: one block


def _blake2b(person: bytes, parts: Sequence[str]) -> str:
    h = hashlib.blake2b(digest_size=16, person=person)
    for part in parts:
        data = part.encode()
        h.update(len(data).to_bytes(4, "little") + data)
    return h.hexdigest()


def test_no_salt_is_the_mm_hash_of_before() -> None:
    # The value the code computed before salts existed: every stored hash and test stays valid.
    assert media.mm_hash(MODEL, FINGERPRINT, CONTENT) == "26b413dc2d2b7c35dc583156d4214f22"
    assert media.mm_hash(MODEL, FINGERPRINT, CONTENT, "") == media.mm_hash(MODEL, FINGERPRINT, CONTENT)
    assert media.mm_hash(MODEL, FINGERPRINT, CONTENT) == _blake2b(b"epd-mmhash-v1", (MODEL, FINGERPRINT, CONTENT))


def test_a_salted_mm_hash_is_derived_from_the_salt_and_the_unsalted_one() -> None:
    unsalted = media.mm_hash(MODEL, FINGERPRINT, CONTENT)
    salts = ["a", "b", "tenant-1", "tenant-1 ", "é" * 256, "\x00"]
    salted = [media.mm_hash(MODEL, FINGERPRINT, CONTENT, s) for s in salts]
    for salt, h in zip(salts, salted):
        assert MM_HASH.match(h), h  # what Lookup and the vLLM connector accept
        assert h == _blake2b(b"epd-mmsalt-v1", (salt, unsalted))
    assert len(set(salted) | {unsalted}) == len(salts) + 1
    # The salt is not an input of the unsalted parts: a salt never collides with another model id.
    assert media.mm_hash(MODEL, FINGERPRINT, CONTENT, "x") != media.mm_hash(MODEL + "x", FINGERPRINT, CONTENT)


def test_the_reference_worker_hashes_unsalted_items_as_the_encoder_does() -> None:
    processor = InputProcessor(MODEL, media.PreprocessParams(), FINGERPRINT, InputProcessorMetrics(CollectorRegistry()))
    info, _ = processor.process(MediaItem.image(IMAGE))
    engine = _engine()
    assert info.mm_hash == engine.mm_hash(MediaInput("image", (IMAGE,)).content_hash())


class _Runner:
    """Writes the run number into every row of each item it encodes; counts the items it encoded.

    Items that arrive together may share one run (the engine batches them), so tests count items.
    """

    max_batch_tokens = 256

    def __init__(self) -> None:
        self.runs = 0
        self.encoded = 0

    def write(self, items: Sequence[ProcessedItem], block_ids: Sequence[Sequence[int]],
              tokens_per_block: Sequence[Sequence[int]], buffer: torch.Tensor, scratch_block_id: int) -> torch.Tensor:
        self.runs += 1
        self.encoded += len(items)
        for blocks, counts in zip(block_ids, tokens_per_block):
            for b, n in zip(blocks, counts):
                buffer[b, :n] = float(self.runs)
        return buffer


def _engine() -> EncoderEngine:
    layout = CacheLayout(num_blocks=8, block_size=64, out_hidden_size=4, num_deepstack_levels=0, dtype=torch.float32)
    return EncoderEngine(cache=EncoderCacheBlocks(layout, 0, lease_ttl_ms=60_000),
                         preprocessor=Preprocessor(PreprocessConfig()), runner=_Runner(),
                         metrics=EncoderMetrics(), model_id=MODEL, preprocess_fingerprint=FINGERPRINT)


def test_the_same_bytes_under_two_salts_are_two_entries() -> None:
    async def scenario() -> None:
        engine = _engine()
        await engine.start()
        try:
            a, b = (MediaInput("image", (IMAGE,), cache_salt=s) for s in ("tenant-a", "tenant-b"))
            # Both tenants at once: each is encoded (nothing coalesces across salts).
            first = await asyncio.gather(engine.encode([a], "proxy"), engine.encode([b], "proxy"))
            (loc_a,), (loc_b,) = first
            assert isinstance(loc_a, Located) and isinstance(loc_b, Located)
            assert not loc_a.hit and not loc_b.hit and loc_a.mm_hash != loc_b.mm_hash
            assert set(loc_a.block_ids).isdisjoint(loc_b.block_ids)
            assert engine.runner.encoded == 2  # type: ignore[attr-defined]
            # Nor is the decoded input: tenant b's miss decoded its own bytes again.
            layer1 = [engine.metrics.registry.get_sample_value(f"vllm:mm_cache_{n}_total") for n in ("queries", "hits")]
            assert layer1 == [2.0, 0.0]
            assert loc_a.mm_hash == media.mm_hash(MODEL, FINGERPRINT, a.content_hash(), "tenant-a")

            # The unsalted item is a third one; before it is encoded, its mm_hash finds nothing.
            unsalted = engine.mm_hash(a.content_hash())
            (missing,) = engine.lookup([unsalted], "probe")
            assert isinstance(missing, Failed) and "not in the encoder cache" in str(missing.error)
            (plain,) = await engine.encode([MediaInput("image", (IMAGE,))], "proxy")
            assert isinstance(plain, Located) and not plain.hit and plain.mm_hash == unsalted

            # Each tenant's second request is a hit on its own entry; one request may mix tenants.
            again = await engine.encode([b, a], "proxy")
            assert [(r.hit, r.mm_hash, r.block_ids) for r in again if isinstance(r, Located)] == [
                (True, loc_b.mm_hash, loc_b.block_ids), (True, loc_a.mm_hash, loc_a.block_ids)]
            assert engine.runner.encoded == 3  # type: ignore[attr-defined]
        finally:
            await engine.stop()

    asyncio.run(scenario())


def test_salted_images_take_the_copy_free_path_and_parse_as_protobuf_does() -> None:
    items = [MediaSpec.image(IMAGE, uuid="u", cache_salt="tenant-a"), MediaSpec.image(IMAGE, cache_salt="b")]
    data = encode_request_bytes(MODEL, "c", "", items)
    assert pb2.EncodeRequest.FromString(data).items[0].cache_salt == "tenant-a"
    view = parse_encode_request(data)
    assert [(i.uuid, i.cache_salt) for i in view.items] == [("u", "tenant-a"), ("", "b")]
    assert all(isinstance(i.frames[0], memoryview) for i in view.items)  # not protobuf's copies


class _Serving:
    def result(self) -> health_pb2.HealthCheckResponse:
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


class _Encoder:
    """What the client uses of a connection; ``keys_cache_salt`` as the handshake announced it."""

    def __init__(self, target: str, keys_cache_salt: bool) -> None:
        self.target, self.encoder_id, self.incarnation_id, self.weights_digest = target, target, "", ""
        self.keys_cache_salt = keys_cache_salt
        self.encoded: list[list[MediaSpec]] = []

    def peer(self) -> None:
        self.incarnation_id = "inc"

    def readiness(self, timeout_s: float) -> _Serving:
        return _Serving()

    def encode(self, items: Sequence[MediaSpec]) -> list[pb2.ItemLocation]:
        self.encoded.append(list(items))
        return [pb2.ItemLocation(mm_hash=media.mm_hash(MODEL, FINGERPRINT, i.key(), i.cache_salt)) for i in items]

    def close(self) -> None:
        pass


def test_salted_items_go_only_to_encoders_that_key_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """An encoder of before the field would ignore the salt and answer the unsalted item's entry, shared
    with every tenant: the client sends salted items to the next encoder instead, unsalted ones as before."""
    spec = MediaSpec.image(IMAGE, cache_salt="tenant-a")
    old, new = sorted(["h1:1", "h2:2"], key=lambda t: rendezvous_order(spec.key(), ["h1:1", "h2:2"]).index(t))
    encoders = {old: _Encoder(old, keys_cache_salt=False), new: _Encoder(new, keys_cache_salt=True)}
    monkeypatch.setattr(EncoderCacheClient, "_connection", lambda self, target: encoders[target])
    client = EncoderCacheClient([old, new], MODEL, transport=object(), membership_refresh_s=0)  # type: ignore[arg-type]
    try:
        (plain,) = client.place([MediaSpec.image(IMAGE)])
        assert plain.encoder == old and plain.mm_hash == media.mm_hash(MODEL, FINGERPRINT, spec.key())
        (placed,) = client.place([spec])
        assert placed.encoder == new and encoders[new].encoded == [[spec]] and len(encoders[old].encoded) == 1
        assert placed.mm_hash == media.mm_hash(MODEL, FINGERPRINT, spec.key(), "tenant-a")
    finally:
        client.close()
