"""One consumer's connection to one encoder: channel, handshake, RPCs (any process that pulls or places).

A connection handshakes lazily, once per producer incarnation: the answer
names the incarnation, and a response carrying another one (the encoder
restarted) drops the NIXL peer and handshakes again before anything is read,
so no READ ever goes through descriptors of a previous incarnation.
"""

from __future__ import annotations

import functools
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from common import media
from common.config import READINESS_SERVICE, TlsConfig
from common.errors import (
    ECLoadFailure,
    EncoderUnreachable,
    EpdError,
    HandshakeError,
    InvalidMediaError,
    LimitExceededError,
    LoadFailureReason,
    WeightsMismatchError,
)
from common.layout import CacheLayout
from common.metrics import PrefillMetrics
from common.transport import ConsumerTransport, ProducerPeer
from common.wire import PROTOCOL_VERSION, SERVICE_NAME, pb2, pb2_grpc
from prefill_client.consumer.messages import (  # MediaSpec and content_key: imported from here too
    MediaSpec,
    announces_params,
    content_key,
    encode_request_bytes,
    layout_from_proto,
    params_from_proto,
    status_error,
)

logger = logging.getLogger(__name__)

__all__ = ["MIN_RELEASE_TIMEOUT_S", "EncoderConnection", "MediaSpec", "content_key"]

# A Release that fails pins its items until their leases expire (30 s by default), so it
# gets at least this long even when the caller's own calls have tight deadlines.
MIN_RELEASE_TIMEOUT_S = 2.0


class _GivenUp(Exception):
    """A call cancelled by :meth:`EncoderConnection.give_up_calls`."""


class EncoderConnection:
    """gRPC channel + handshake + NIXL peer for one encoder target.

    ``transport`` None: a connection that only asks :meth:`readiness` (the proxy's readiness
    probe); it refuses to handshake.
    """

    def __init__(
        self,
        target: str,
        model_id: str,
        consumer_id: str,
        transport: ConsumerTransport | None,
        metrics: PrefillMetrics,
        *,
        rpc_timeout_s: float,
        tls: TlsConfig,
        encode_timeout_s: float | None = None,
        expected_weights_digest: str | None = None,
    ) -> None:
        self.target = target
        self.expected_weights_digest = expected_weights_digest
        self.weights_digest = ""  # announced by the current incarnation
        self.encoder_id = ""  # the name it announces (survives restarts); "" until the first handshake
        self.model_id = model_id
        self.consumer_id = consumer_id
        self.transport = transport
        self.metrics = metrics
        self.rpc_timeout_s = rpc_timeout_s
        self.encode_timeout_s = encode_timeout_s if encode_timeout_s is not None else rpc_timeout_s
        self._metadata = (("authorization", f"Bearer {tls.auth_token}"),) if tls.auth_token else ()
        self._tls = tls
        self._open_calls()
        self._lock = threading.Lock()
        self._release_lock = threading.Lock()  # not _lock: that one is held across a handshake
        self._releases: set[grpc.Future[pb2.ReleaseResponse]] = set()
        self._working = 0  # Encode and Lookup calls in flight
        self._work_generation = 0  # channels given up so far (give_up_calls)
        self._gave_up = ""  # why the last one was given up
        self._call_prefix = secrets.token_hex(8)  # call ids: unique per connection object, never reused
        self._calls = 0
        self._peer: ProducerPeer | None = None
        self.incarnation_id = ""
        self._layout: CacheLayout | None = None
        self._media: tuple[media.PreprocessParams | None, str] | None = None
        self.tower = ""
        self.keys_cache_salt = False  # announced by the current incarnation: it may be sent salted items

    @staticmethod
    def _open_channel(target: str, tls: TlsConfig) -> grpc.Channel:
        options = [
            ("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20),
            # gRPC's default back-off between reconnects grows to two minutes, and calls fail at
            # once meanwhile: a restarted encoder would stay unreachable long after it is up.
            ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        if tls.ca or tls.cert:
            def read(path: str | None) -> bytes | None:
                if path is None:
                    return None
                with open(path, "rb") as f:
                    return f.read()
            creds = grpc.ssl_channel_credentials(read(tls.ca), read(tls.key), read(tls.cert))
            return grpc.secure_channel(target, creds, options=options)
        return grpc.insecure_channel(target, options=options)

    def _open_calls(self) -> None:
        """Open the channel and the calls on it. Every call shares one channel: calls spread over
        two took 0.3-0.6 ms longer each (each channel's machinery idles between its calls), so
        giving calls up (:meth:`give_up_calls`) replaces the whole channel."""
        self._channel = channel = self._open_channel(self.target, self._tls)
        self._stub = pb2_grpc.EncoderCacheServiceStub(channel)
        self._health_check: grpc.UnaryUnaryMultiCallable[
            health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse] = channel.unary_unary(
                "/grpc.health.v1.Health/Check", request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                response_deserializer=health_pb2.HealthCheckResponse.FromString)
        # The calls that wait on the encoder's work, by name; Encode takes its request already in
        # wire format (encode_request_bytes).
        self._work: dict[str, grpc.UnaryUnaryMultiCallable[Any, Any]] = {
            "Encode": channel.unary_unary(f"/{SERVICE_NAME}/Encode", request_serializer=None,
                                          response_deserializer=pb2.EncodeResponse.FromString),
            "Lookup": self._stub.Lookup,
        }

    # --- handshake -----------------------------------------------------------------------

    @property
    def layout(self) -> CacheLayout:
        self.peer()
        assert self._layout is not None
        return self._layout

    @property
    def media_params(self) -> tuple[media.PreprocessParams, str]:
        """The encoder's preprocessing parameters and their fingerprint (from the handshake)."""
        self.peer()
        assert self._media is not None
        params, fingerprint = self._media
        if params is None:
            raise HandshakeError(
                f"encoder {self.target} runs the {self.tower} tower: its items' token counts come from the "
                f"model's own processor, not from parameters a consumer can apply (serve it through vLLM "
                f"with EpdCacheConnector)")
        return params, fingerprint

    def mm_hash_of(self, item: MediaSpec) -> tuple[str, str] | None:
        """(incarnation, mm_hash) under which the encoder's incarnation of the last handshake (none
        made here) keys ``item``: this connection's model id, the encoder's preprocessing
        fingerprint, the item's bytes and salt, as an Encode of the item would. None before a
        handshake, and for a salted item on an encoder that does not key by salt.

        Read while a new handshake may be setting these fields (the incarnation last): a mix of two
        incarnations' fields gives an mm_hash the Lookup does not find, or an answer the caller
        drops because the incarnation moved; never another item's entry."""
        announced = self._media
        if announced is None or (item.cache_salt and not self.keys_cache_salt):
            return None
        return self.incarnation_id, media.mm_hash(self.model_id, announced[1], item.key(), item.cache_salt)

    @property
    def processor_is_ours(self) -> bool:
        """The encoder preprocesses by the parameters it announced (epd-cache's own tower), not with
        the model's own processor. From the last handshake, none made here (False before the first)."""
        return self._media is not None and self._media[0] is not None

    def peer(self) -> ProducerPeer:
        """The NIXL peer of the current incarnation, handshaking first if needed."""
        with self._lock:
            if self._peer is None:
                self._handshake()
            assert self._peer is not None
            return self._peer

    def _handshake(self) -> None:
        if self.transport is None:
            raise HandshakeError(f"the connection to encoder {self.target} only asks readiness (no transport)")
        request = pb2.HandshakeRequest(
            protocol_version=PROTOCOL_VERSION, model_id=self.model_id, consumer_id=self.consumer_id)
        try:
            resp = self._stub.Handshake(request, timeout=self.rpc_timeout_s, metadata=self._metadata)
        except grpc.RpcError as exc:
            self.metrics.handshakes.labels(result=exc.code().name.lower()).inc()
            raise status_error(exc) from exc
        layout = layout_from_proto(resp.layout)
        local_hash = layout.compatibility_hash(self.model_id, PROTOCOL_VERSION)
        if resp.compatibility_hash != local_hash or resp.model_id != self.model_id:
            self.metrics.handshakes.labels(result="mismatch").inc()
            raise HandshakeError(
                f"compatibility mismatch with {self.target}: local {self.model_id!r}/{local_hash}, "
                f"remote {resp.model_id!r}/{resp.compatibility_hash}")
        expected = self.expected_weights_digest
        if expected is not None and resp.weights_digest != expected:
            # Checked before connecting: nothing is read from an encoder of other weights.
            self.metrics.handshakes.labels(result="weights_mismatch").inc()
            raise WeightsMismatchError(self.target, expected, resp.weights_digest)
        self._peer = self.transport.connect(resp, endpoint=self.target)
        self.weights_digest = resp.weights_digest
        self.encoder_id = resp.encoder_id
        self._layout = layout
        self.tower = resp.tower  # its name, for messages; what it does is in what it announces
        self.keys_cache_salt = resp.keys_cache_salt
        params = params_from_proto(resp.preprocess) if announces_params(resp.preprocess) else None
        self._media = (params, resp.preprocess.fingerprint)
        self.incarnation_id = resp.incarnation_id
        self.metrics.handshakes.labels(result="ok").inc()
        logger.info("handshook with encoder %s (incarnation %s, transport %s, vision weights %s)",
                    self.target, resp.incarnation_id[:8], resp.transport, resp.weights_digest or "-")

    def recheck(self) -> bool:
        """Handshake again now, as the pool does when an encoder it lost is ready again: True when it
        answers as another incarnation (restarted: its NIXL peer is replaced now, as the next call
        would have done), False when it is the one known (nothing changes: the transport keeps the
        peer it has). Before any handshake, the first one."""
        with self._lock:
            before = self.incarnation_id
            self._handshake()
            return self.incarnation_id != before

    def reset(self) -> None:
        """Forget the peer: the next call handshakes again."""
        with self._lock:
            self._peer = None
            self.incarnation_id = ""

    # --- RPCs --------------------------------------------------------------------------------

    def _call(self, rpc: Callable[..., Any], build: Callable[[str, str], object],
              timeout_s: float | None = None) -> Any:
        """One RPC against the current incarnation (``build(incarnation_id, call_id)`` makes the
        request), with a deadline of ``timeout_s`` (None: ``rpc_timeout_s``); a changed
        incarnation re-handshakes once.

        Each attempt gets a fresh ``call_id``. When its deadline passes, the encoder may have
        answered anyway (its clock runs behind ours by the request's way there), with leases
        nobody would release by id: the call is given up by its id (:meth:`abandon`), which
        releases them, or refuses the answer if it is still to come. (A connection that broke
        needs no such care: an encoder that is gone took its leases with it.)
        """
        for attempt in range(2):
            self.peer()
            call_id = self._new_call_id()
            request = build(self.incarnation_id, call_id)
            try:
                resp = rpc(request, timeout=timeout_s or self.rpc_timeout_s, metadata=self._metadata)
            except _GivenUp:
                self.abandon([call_id])  # it may wake and answer
                raise EncoderUnreachable(grpc.StatusCode.CANCELLED, self._gave_up) from None
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    self.abandon([call_id])
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION and "incarnation" in (exc.details() or ""):
                    self.reset()
                    continue
                raise status_error(exc) from exc
            if resp.incarnation_id != self.incarnation_id:
                self.abandon([call_id])  # leases of another incarnation than we will pull from
                self.reset()
                continue
            return resp
        raise HandshakeError(f"encoder {self.target} changed incarnation twice during one call")

    def encode(self, items: Sequence[MediaSpec]) -> list[pb2.ItemLocation]:
        resp = self._call(functools.partial(self._work_call, "Encode"), lambda incarnation, call_id: (
            encode_request_bytes(self.model_id, self.consumer_id, incarnation, items, call_id)), self.encode_timeout_s)
        results = list(resp.results)
        for i, result in enumerate(results):
            if result.WhichOneof("outcome") == "error":
                # The call fails as a whole for the caller: no location of it will be pulled.
                self.release([r.location.lease_id for r in results if r.WhichOneof("outcome") == "location"])
                label = f"item {i}" + (f" ({items[i].uuid})" if items[i].uuid else "")
                raise self._item_error(label, result.error)
        return [r.location for r in results]

    def _work_call(self, method: str, request: Any, *, timeout: float, metadata: tuple[tuple[str, str], ...]) -> Any:
        """An Encode or Lookup RPC (``method``); :class:`_GivenUp` when :meth:`give_up_calls` closed
        its channel under it. (A blocking call: a future would add a thread hand-off, about 0.5 ms
        a call on two cores.)"""
        with self._release_lock:
            generation, call = self._work_generation, self._work[method]
            self._working += 1
        try:
            return call(request, timeout=timeout, metadata=metadata)
        except (grpc.RpcError, ValueError) as exc:  # ValueError: started on a channel closed just before
            if generation != self._work_generation:
                raise _GivenUp() from exc
            raise
        finally:
            with self._release_lock:
                self._working -= 1

    def give_up_calls(self, why: str) -> int:
        """Cancel the Encode and Lookup calls in flight (the encoder stopped answering: ``why``):
        each fails at once with :class:`EncoderUnreachable` (CANCELLED, ``why``), its leases given
        up by call id, so that its items go to the next encoder instead of waiting out the call's
        deadline. The channel is closed under them and a new one opened: the other calls in flight
        to the stopped encoder end too (a release among them leaves its leases to the encoder's
        lease ttl). Returns how many Encode and Lookup calls were in flight."""
        with self._release_lock:
            if not self._working:
                return 0
            given_up, old = self._working, self._channel
            self._gave_up = why
            self._work_generation += 1
            self._open_calls()
        old.close()
        return given_up

    def _item_error(self, label: str, error: pb2.ItemError) -> EpdError:
        """Our typed error for one item's failure in an Encode answer."""
        code, message = error.code, error.message
        if code == grpc.StatusCode.INVALID_ARGUMENT.value[0]:
            return InvalidMediaError(label, message)
        if code in (grpc.StatusCode.ABORTED.value[0], grpc.StatusCode.NOT_FOUND.value[0]):
            # Evicted (or its lease ended) while the request ran: retryable.
            self.metrics.load_failures.labels(reason=LoadFailureReason.EVICTED.value).inc()
            return ECLoadFailure(LoadFailureReason.EVICTED, error.mm_hash or label,
                                 detail=f"{label} on {self.target}: {message}")
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]:
            return LimitExceededError(f"{label}: {message}")
        return EpdError(f"{label}: {message}")

    def lookup(self, mm_hashes: Sequence[str]) -> list[pb2.ItemLocation | None]:
        resp = self._call(functools.partial(self._work_call, "Lookup"), lambda incarnation, call_id: pb2.LookupRequest(
            model_id=self.model_id, consumer_id=self.consumer_id, mm_hashes=mm_hashes, incarnation_id=incarnation,
            call_id=call_id))
        return [r.location if r.WhichOneof("outcome") == "location" else None for r in resp.results]

    def release(self, lease_ids: Sequence[int], owner: str | None = None) -> None:
        """Give leases back without waiting for the answer (best effort: an unreleased lease expires).

        ``owner``: the consumer the leases were granted to, when it is not this one (leases an
        ``epd proxy`` took and handed on with the item); the encoder checks it.

        Releases run on failure paths and from the batching releaser: nobody
        waits on a slow or frozen encoder for them. The RPC still has its
        deadline, and :meth:`close` waits (bounded) for the ones in flight.
        """
        if lease_ids:
            self._send_release(pb2.ReleaseRequest(consumer_id=owner or self.consumer_id, lease_ids=lease_ids),
                               f"{len(lease_ids)} leases")

    def abandon(self, call_ids: Sequence[str]) -> None:
        """Give up calls whose answers we will not read: the encoder releases every lease they
        granted (or refuses the answer still to come). Best effort and not waited for, as
        :meth:`release`."""
        if call_ids:
            self._send_release(pb2.ReleaseRequest(consumer_id=self.consumer_id, call_ids=call_ids),
                               f"the leases of {len(call_ids)} abandoned calls")

    def _new_call_id(self) -> str:
        with self._release_lock:
            self._calls += 1
            return f"{self._call_prefix}-{self._calls}"

    def _send_release(self, request: pb2.ReleaseRequest, what: str) -> None:
        future = self._stub.Release.future(
            request, timeout=max(self.rpc_timeout_s, MIN_RELEASE_TIMEOUT_S), metadata=self._metadata)
        target = self.target
        with self._release_lock:
            self._releases.add(future)

        def done(call: grpc.Future[pb2.ReleaseResponse]) -> None:
            with self._release_lock:
                self._releases.discard(call)
            if call.cancelled():  # the channel closed first
                return
            exc = call.exception()
            if exc is not None:
                code = exc.code() if isinstance(exc, grpc.RpcError) else exc
                logger.warning("release of %s on %s failed: %s", what, target, code)

        future.add_done_callback(done)

    def readiness(self, timeout_s: float) -> grpc.Future[health_pb2.HealthCheckResponse]:
        """Ask the encoder's ``grpc.health.v1`` for ``readiness`` (SERVING once warmed up, NOT_SERVING
        while warming up or draining), without waiting: the pool probes every encoder at once."""
        call: grpc.Future[health_pb2.HealthCheckResponse] = self._health_check.future(
            health_pb2.HealthCheckRequest(service=READINESS_SERVICE), timeout=timeout_s, metadata=self._metadata)
        return call

    def close(self) -> None:
        """Close the channel once the releases in flight are answered (at most their deadline)."""
        with self._release_lock:
            pending = list(self._releases)
        give_up = time.monotonic() + max(self.rpc_timeout_s, MIN_RELEASE_TIMEOUT_S)
        for future in pending:
            try:
                future.exception(timeout=max(0.0, give_up - time.monotonic()))
            except (grpc.FutureTimeoutError, grpc.FutureCancelledError):
                pass
        self.reset()
        self._channel.close()
