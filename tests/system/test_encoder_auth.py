"""Token auth and mTLS on the encoder's gRPC port; health stays open for probes."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.wire import PROTOCOL_VERSION, pb2, pb2_grpc
from epd_harness.procs import start_encoder
from tests.support.certs import make_pki

MODEL = "tiny-qwen3-vl"


def _handshake(channel: grpc.Channel, token: str | None = None) -> pb2.HandshakeResponse:
    metadata = (("authorization", f"Bearer {token}"),) if token is not None else ()
    return pb2_grpc.EncoderCacheServiceStub(channel).Handshake(
        pb2.HandshakeRequest(protocol_version=PROTOCOL_VERSION, model_id=MODEL), timeout=10, metadata=metadata)


def _health(channel: grpc.Channel) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status


def test_bearer_token_required_except_for_health(tmp_path) -> None:
    enc = start_encoder(tmp_path, "--transport", "mock", "--cache-blocks", "4", "--block-size", "16",
                        env={"EPD_AUTH_TOKEN": "s3cret"})
    try:
        channel = grpc.insecure_channel(enc.target)
        for token in (None, "wrong", "s3cret "):
            with pytest.raises(grpc.RpcError) as info:
                _handshake(channel, token)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert _handshake(channel, "s3cret").model_id == MODEL
        assert _health(channel) == health_pb2.HealthCheckResponse.SERVING
    finally:
        assert enc.terminate() == 0, enc.log()


def test_mtls_refuses_a_client_without_certificate(tmp_path) -> None:
    pki = make_pki(tmp_path)
    enc = start_encoder(tmp_path, "--transport", "mock", "--cache-blocks", "4", "--block-size", "16",
                        "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
                        "--tls-ca", str(pki.ca), "--health-port", "0")
    try:
        ca = pki.ca.read_bytes()
        with_cert = grpc.secure_channel(enc.target, grpc.ssl_channel_credentials(
            ca, pki.client_key.read_bytes(), pki.client_cert.read_bytes()))
        assert _handshake(with_cert).model_id == MODEL
        without_cert = grpc.secure_channel(enc.target, grpc.ssl_channel_credentials(ca))
        with pytest.raises(grpc.RpcError) as info:
            _handshake(without_cert)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        plaintext = grpc.insecure_channel(enc.target)
        with pytest.raises(grpc.RpcError):
            _handshake(plaintext)
        probe = grpc.insecure_channel(f"127.0.0.1:{enc.health_port}")
        assert _health(probe) == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as info:  # the probe port serves health only
            _handshake(probe)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        assert enc.terminate() == 0, enc.log()
