"""An Encode gets its own deadline (the encoder's queue and its tower), the other calls ``rpc_timeout_s``;
an Encode in flight can be given up before it (its encoder stopped answering)."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from common.config import ProxyConfig
from common.config.shared import TlsConfig
from common.errors import EncoderUnreachable
from common.metrics import PrefillMetrics
from common.wire import SERVICE_NAME, pb2
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
    encode, lookup = Recorder(pb2.EncodeResponse()), Recorder(pb2.LookupResponse())
    conn._work = {"Encode": encode, "Lookup": lookup}  # type: ignore[dict-item]
    conn.encode([MediaSpec.image(b"png")])
    conn.lookup(["0" * 32])
    assert encode.timeouts == [45.0] and lookup.timeouts == [2.0]


def test_without_an_encode_deadline_an_encode_takes_the_rpc_deadline() -> None:
    conn = _connection(rpc_timeout_s=2.0)
    encode = Recorder(pb2.EncodeResponse())
    conn._work["Encode"] = encode  # type: ignore[assignment]
    conn.encode([MediaSpec.image(b"png")])
    assert encode.timeouts == [2.0]
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


class Stalled:
    """A gRPC server whose Encode and Lookup take the call and never answer (a frozen encoder's,
    as the client sees it); it records the Release requests it gets."""

    def __init__(self) -> None:
        self.taken = threading.Event()
        self.released: list[pb2.ReleaseRequest] = []
        self._stop = threading.Event()
        handlers = {
            "Encode": grpc.unary_unary_rpc_method_handler(self._stall, request_deserializer=None,
                                                          response_serializer=pb2.EncodeResponse.SerializeToString),
            "Lookup": grpc.unary_unary_rpc_method_handler(self._stall, request_deserializer=None,
                                                          response_serializer=pb2.LookupResponse.SerializeToString),
            "Release": grpc.unary_unary_rpc_method_handler(
                self._release, request_deserializer=pb2.ReleaseRequest.FromString,
                response_serializer=pb2.ReleaseResponse.SerializeToString),
        }
        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(4))
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def _stall(self, request: bytes, context: grpc.ServicerContext) -> Any:
        self.taken.set()
        self._stop.wait(30)
        context.abort(grpc.StatusCode.INTERNAL, "thawed")

    def _release(self, request: pb2.ReleaseRequest, context: grpc.ServicerContext) -> pb2.ReleaseResponse:
        self.released.append(request)
        return pb2.ReleaseResponse()

    def stop(self) -> None:
        self._stop.set()
        self.server.stop(0)


@pytest.fixture
def stalled() -> Iterator[Stalled]:
    server = Stalled()
    yield server
    server.stop()


@pytest.mark.parametrize("method", ["Encode", "Lookup"])
def test_a_call_in_flight_is_given_up_at_once_and_its_leases_by_call_id(stalled: Stalled, method: str) -> None:
    conn = EncoderConnection(f"127.0.0.1:{stalled.port}", "m", "c", None, PrefillMetrics(), tls=TlsConfig(),
                             rpc_timeout_s=60.0, encode_timeout_s=60.0)
    conn.peer = lambda: None  # type: ignore[method-assign,assignment,return-value]  # no handshake
    call = {"Encode": lambda: conn.encode([MediaSpec.image(b"png")]), "Lookup": lambda: conn.lookup(["0" * 32])}
    try:
        assert conn.give_up_calls("nothing in flight") == 0
        failed: list[BaseException] = []
        caller = threading.Thread(target=lambda: _catch(failed, call[method]))
        caller.start()
        assert stalled.taken.wait(10), f"the {method} never reached the server"
        start = time.monotonic()
        assert conn.give_up_calls("encoder X missed 2 readiness checks") == 1
        caller.join(10)
        assert not caller.is_alive() and time.monotonic() - start < 5.0  # not the call's 60 s
        [exc] = failed
        assert isinstance(exc, EncoderUnreachable) and exc.code == grpc.StatusCode.CANCELLED
        assert exc.details == "encoder X missed 2 readiness checks"
        deadline = time.monotonic() + 10
        while not stalled.released and time.monotonic() < deadline:
            time.sleep(0.01)
        [release] = stalled.released  # the call id, so that an answer still to come is refused
        assert len(release.call_ids) == 1 and release.call_ids[0].startswith(conn._call_prefix)
    finally:
        conn.close()


def _catch(into: list[BaseException], call: Any) -> None:
    try:
        call()
    except BaseException as exc:  # noqa: BLE001 - the test reads it
        into.append(exc)
