"""Two encoders of one model_id with different vision weights: a client takes embeddings only from
the weights it expects (a rolling update's old and new pods side by side), through real processes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from common.errors import ECLoadFailure, LoadFailureReason, WeightsMismatchError
from common.weights_digest import checkpoint_digest
from epd_harness.media import image_bytes
from epd_harness.procs import EncoderProcess, start_encoder
from prefill_client.consumer.client import EncoderCacheClient
from prefill_client.consumer.connection import MediaSpec
from prefill_client.consumer.routing import rendezvous_order
from tests.support.checkpoints import write_vision_checkpoint
from tests.support.reference import Reference, matches

MODEL = "tiny-qwen3-vl"


@pytest.fixture(scope="module")
def pods(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[EncoderProcess, str, Reference]]]:
    """Encoder "A" serving checkpoint A and encoder "B" serving checkpoint B (mock transport)."""
    out: dict[str, tuple[EncoderProcess, str, Reference]] = {}
    try:
        for name, seed in (("A", 11), ("B", 12)):
            path = write_vision_checkpoint(tmp_path_factory.mktemp(f"ckpt{name}"), seed=seed)
            enc = start_encoder(tmp_path_factory.mktemp(f"enc{name}"), "--transport", "mock",
                                "--weights", str(path), "--cache-dtype", "float32", "--encoder-id", f"enc-{name}")
            out[name] = (enc, checkpoint_digest(path), Reference(str(path)))
        yield out
    finally:
        for enc, _, _ in out.values():
            enc.terminate()


def _image_preferring(target: str, client: EncoderCacheClient) -> bytes:
    """An image whose rendezvous order, as ``client`` ranks its encoders, puts ``target`` first."""
    conns = [client.connection(t) for t in client.targets]
    names = {c.target: c.encoder_id for c in conns if c is not None and c.encoder_id}
    for seed in range(200):
        data = image_bytes(64, 64, seed=seed)
        if rendezvous_order(MediaSpec.image(data).key(), list(client.targets), names)[0] == target:
            return data
    raise AssertionError("no image prefers " + target)


def test_a_client_takes_rows_only_from_the_weights_it_expects(pods: dict[str, tuple[EncoderProcess, str, Reference]]
                                                              ) -> None:
    (enc_a, digest_a, ref_a), (enc_b, digest_b, ref_b) = pods["A"], pods["B"]
    assert digest_a != digest_b
    targets = [enc_a.target, enc_b.target]
    for expected, ref, other_ref in ((digest_a, ref_a, ref_b), (digest_b, ref_b, ref_a)):
        with EncoderCacheClient(targets, MODEL, transport_kind="mock", weights_digest=expected) as client:
            on_b = _image_preferring(enc_b.target, client)  # B first in this client's rendezvous order
            refusals = client.metrics.handshakes.labels(result="weights_mismatch")._value.get()
            [item] = client.encode([MediaSpec.image(on_b)])
            assert item.weights_digest == expected
            conn = client.connection(item.encoder)
            assert conn is not None and conn.encoder_id == ("enc-A" if expected == digest_a else "enc-B")
            assert item.encoder == (enc_a.target if expected == digest_a else enc_b.target)
            assert matches(item.embeddings, ref.image(on_b))
            assert not matches(item.embeddings, other_ref.image(on_b))  # the weights really differ
            if expected == digest_a:  # B, refused at the client's start, is not even tried: routed away
                assert refusals == 1
                assert client.metrics.handshakes.labels(result="weights_mismatch")._value.get() == refusals
                assert client.metrics.routed_away._value.get() == 1


def test_refusal_names_both_digests(pods: dict[str, tuple[EncoderProcess, str, Reference]]) -> None:
    (_, digest_a, _), (enc_b, digest_b, _) = pods["A"], pods["B"]
    data = image_bytes(64, 64, seed=1)
    with EncoderCacheClient([enc_b.target], MODEL, transport_kind="mock", weights_digest=digest_a) as client:
        with pytest.raises(ECLoadFailure) as encode_err:
            client.encode([MediaSpec.image(data)])
        assert encode_err.value.reason is LoadFailureReason.HANDSHAKE
        assert digest_a in str(encode_err.value) and digest_b in str(encode_err.value)
        with pytest.raises(ECLoadFailure) as lookup_err:
            client.lookup(["0" * 32])
        assert digest_a in str(lookup_err.value) and digest_b in str(lookup_err.value)
        assert client.connection(enc_b.target).encoder_id == ""  # refused: nothing taken from it
        with pytest.raises(WeightsMismatchError) as direct:
            client.connection(enc_b.target).peer()  # type: ignore[union-attr]
        assert (direct.value.expected, direct.value.got) == (digest_a, digest_b)


def test_without_an_expectation_items_are_kept_apart_by_digest(
        pods: dict[str, tuple[EncoderProcess, str, Reference]]) -> None:
    (enc_a, digest_a, ref_a), (enc_b, digest_b, ref_b) = pods["A"], pods["B"]
    data = image_bytes(80, 48, seed=3)
    with EncoderCacheClient([enc_a.target], MODEL, transport_kind="mock") as on_a, \
            EncoderCacheClient([enc_b.target], MODEL, transport_kind="mock") as on_b:
        [a] = on_a.encode([MediaSpec.image(data)])
        [b] = on_b.encode([MediaSpec.image(data)])
        assert a.mm_hash == b.mm_hash  # the same item for both, by content
        assert (a.weights_digest, b.weights_digest) == (digest_a, digest_b)
        assert matches(a.embeddings, ref_a.image(data)) and matches(b.embeddings, ref_b.image(data))
        kept = on_a.cached(a.mm_hash)
        assert kept is not None and kept.weights_digest == digest_a
