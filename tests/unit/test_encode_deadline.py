"""An Encode gets its own deadline (the encoder's queue and its tower), the other calls ``rpc_timeout_s``."""

from __future__ import annotations

from typing import Any

import pytest

from common.config import ProxyConfig
from common.config.shared import TlsConfig
from common.metrics import PrefillMetrics
from common.wire import pb2
from prefill_client.consumer.client import EncoderCacheClient
from prefill_client.consumer.connection import EncoderConnection, MediaSpec
from prefill_client.proxy.clients import new_client


class Recorder:
    """An RPC stand-in: records each call's deadline, answers ``answer``."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.timeouts: list[float] = []

    def __call__(self, request: Any, *, timeout: float, metadata: Any) -> Any:
        self.timeouts.append(timeout)
        return self.answer


def _connection(**deadlines: float) -> EncoderConnection:
    conn = EncoderConnection("127.0.0.1:9", "m", "c", None, PrefillMetrics(), tls=TlsConfig(), **deadlines)
    conn.peer = lambda: None  # type: ignore[method-assign,assignment,return-value]  # no handshake
    return conn


def test_an_encode_waits_its_own_deadline_and_a_lookup_the_rpc_deadline() -> None:
    conn = _connection(rpc_timeout_s=2.0, encode_timeout_s=45.0)
    conn._encode_raw = Recorder(pb2.EncodeResponse())  # type: ignore[assignment]
    lookup = Recorder(pb2.LookupResponse())
    conn._stub.Lookup = lookup  # type: ignore[method-assign]
    conn.encode([MediaSpec.image(b"png")])
    conn.lookup(["0" * 32])
    assert conn._encode_raw.timeouts == [45.0] and lookup.timeouts == [2.0]  # type: ignore[attr-defined]


def test_without_an_encode_deadline_an_encode_takes_the_rpc_deadline() -> None:
    conn = _connection(rpc_timeout_s=2.0)
    conn._encode_raw = Recorder(pb2.EncodeResponse())  # type: ignore[assignment]
    conn.encode([MediaSpec.image(b"png")])
    assert conn._encode_raw.timeouts == [2.0]  # type: ignore[attr-defined]
    client = EncoderCacheClient("127.0.0.1:9", "m", transport_kind="mock", rpc_timeout_s=2.0, landing_blocks=1)
    try:
        assert client.encode_timeout_s == 2.0  # a library client's default
    finally:
        client.close()


def test_the_proxy_gives_its_clients_the_encode_deadline() -> None:
    cfg = ProxyConfig(encoders=("127.0.0.1:9",), backends=("http://127.0.0.1:8",), transport="mock",
                      rpc_timeout_s=3.0, encode_timeout_s=75.0)
    assert ProxyConfig().encode_timeout_s == 60.0
    client = new_client(cfg, "m")
    try:
        assert (client.rpc_timeout_s, client.encode_timeout_s) == (3.0, 75.0)
    finally:
        client.close()


@pytest.mark.parametrize("value", [0.0, -1.0])
def test_an_encode_deadline_must_be_positive(value: float) -> None:
    with pytest.raises(Exception, match="encode_timeout_s"):
        ProxyConfig(encoders=("a:1",), backends=("http://b",), encode_timeout_s=value)
