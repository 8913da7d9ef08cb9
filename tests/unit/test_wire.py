"""The committed generated code matches the schema, and the schema lints."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from common import wire
from common.wire import codegen


def test_generated_code_has_not_drifted(tmp_path) -> None:
    codegen.generate(tmp_path)
    for name in codegen.generated_names():
        fresh = (tmp_path / name).read_text()
        committed = (codegen.OUT_DIR / name).read_text()
        assert fresh == committed, (
            f"common/wire/{name} is stale: run `python -m common.wire.codegen` and commit")


def test_generated_modules_import_as_a_package() -> None:
    text = (codegen.OUT_DIR / "encoder_cache_pb2_grpc.py").read_text()
    assert "from common.wire import encoder_cache_pb2" in text
    assert "from epd.v1" not in text
    assert wire.pb2_grpc.EncoderCacheServiceStub is not None


def test_service_shape() -> None:
    service = wire.pb2.DESCRIPTOR.services_by_name["EncoderCacheService"]
    assert service.full_name == wire.SERVICE_NAME
    assert sorted(m.name for m in service.methods) == ["Encode", "Handshake", "Lookup", "Release"]


def test_buf_lint_standard(repo_root, venv_bin) -> None:
    buf = shutil.which("buf", path=str(venv_bin)) or shutil.which("buf")
    if buf is None:
        pytest.skip("buf is not installed (it comes with the test extra, buf-bin)")
    result = subprocess.run([buf, "lint"], cwd=repo_root, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("incarnation", ["", "f" * 32])
def test_hand_framed_encode_request_parses_to_what_protobuf_builds(incarnation: str) -> None:
    from prefill_client.consumer.messages import MediaSpec, encode_request_bytes

    big = bytes(range(256)) * 1200  # a length that needs a three-byte varint
    items = [MediaSpec.image(b"\x89PNG small"), MediaSpec.image(big, uuid="label é"),
             MediaSpec.video([b"f1", b"frame-two"], fps=2.5, uuid="clip"), MediaSpec.image(b""),
             MediaSpec.image(b"salted", cache_salt="tenant ü"), MediaSpec.image(big, uuid="both", cache_salt="s" * 300),
             MediaSpec.video([b"f1"], fps=1.0, cache_salt="tenant-b")]
    framed = encode_request_bytes("model", "consumer", incarnation, items, call_id="call-7")
    built = wire.pb2.EncodeRequest(model_id="model", consumer_id="consumer", incarnation_id=incarnation,
                                   items=[i.to_proto() for i in items], call_id="call-7")
    assert wire.pb2.EncodeRequest.FromString(framed) == built
    if not incarnation:  # without incarnation and call ids the fields come in number order, as protobuf writes them
        built.ClearField("call_id")
        assert encode_request_bytes("model", "consumer", "", items) == built.SerializeToString()


def test_encode_request_fast_path_reads_what_protobuf_reads() -> None:
    """The encoder's copy-free reader agrees with protobuf on well-formed and odd requests alike."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from encoder_server.encode_request import from_message, parse_encode_request
    from prefill_client.consumer.messages import MediaSpec, encode_request_bytes

    def normalized(view):  # memoryviews compare by content
        return (view.model_id, view.consumer_id, view.incarnation_id, view.call_id,
                [(i.kind, tuple(bytes(f) for f in i.frames), i.fps, i.uuid, i.cache_salt) for i in view.items])

    texts = st.text(max_size=8)
    items = st.lists(st.one_of(
        st.builds(lambda b, u, s: MediaSpec.image(b, uuid=u, cache_salt=s), st.binary(max_size=300), texts, texts),
        st.builds(lambda fs, u, s: MediaSpec.video(fs, fps=2.0, uuid=u, cache_salt=s),
                  st.lists(st.binary(max_size=9), max_size=3), texts, texts)), max_size=4)

    @settings(max_examples=150, deadline=None)
    @given(texts, texts, texts, items, st.binary(max_size=12), texts)
    def check(model: str, consumer: str, incarnation: str, specs: list, tail: bytes, call_id: str) -> None:
        data = encode_request_bytes(model, consumer, incarnation, specs, call_id)
        expected = normalized(from_message(wire.pb2.EncodeRequest.FromString(data)))
        assert normalized(parse_encode_request(data)) == expected
        # Odd trailing bytes (unknown fields, truncation, bad UTF-8...): the same outcome as protobuf.
        try:
            want = normalized(from_message(wire.pb2.EncodeRequest.FromString(data + tail)))
        except Exception as exc:  # noqa: BLE001 - compared below
            with pytest.raises(type(exc)):
                parse_encode_request(data + tail)
        else:
            assert normalized(parse_encode_request(data + tail)) == want

    check()
