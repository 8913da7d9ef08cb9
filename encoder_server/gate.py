"""The cache service's registration with gRPC, in place before the encoder exists.

The encoder binds its port within seconds of starting, so that health answers
while the graphs build (minutes with compiled graphs), and gRPC fixes its
handlers when the server starts. This module registers them and holds the
:class:`CacheServiceGate` they route through. It imports neither torch nor the
engine: the process binds before it loads them.

Requests are registered with :func:`add_to_server`, not the generated
helper: its deserializers raise inside gRPC on bytes that are not a valid
message, which the client sees as ``UNKNOWN``. Ours hand the handler a
:class:`MalformedRequest` instead, answered ``INVALID_ARGUMENT``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import grpc
from google.protobuf.message import DecodeError, Message

from common.errors import ServiceWarmingUp
from common.metrics import EncoderMetrics
from common.wire import SERVICE_NAME, pb2
from encoder_server.encode_request import parse_encode_request

if TYPE_CHECKING:
    from encoder_server.service import EncoderCacheServicer

logger = logging.getLogger(__name__)

Context = grpc.aio.ServicerContext[Any, Any]


@dataclass(frozen=True, slots=True)
class MalformedRequest:
    """What the deserializer hands a handler for bytes that are not a valid request message."""

    message_type: str
    detail: str


def _tolerant(message: type[Message], parse: Callable[[bytes], object] | None = None
              ) -> Callable[[bytes], object]:
    def deserialize(data: bytes) -> object:
        try:
            return (parse or message.FromString)(data)
        except DecodeError as exc:
            return MalformedRequest(message.DESCRIPTOR.full_name, str(exc))

    return deserialize


def add_to_server(gate: CacheServiceGate, server: grpc.aio.Server) -> None:
    """Register the service like the generated helper does, with deserializers that never raise.

    Every handler goes through ``gate``: the server is up before the servicer exists.
    """
    signatures: dict[str, tuple[type[Message], type[Message]]] = {
        "Handshake": (pb2.HandshakeRequest, pb2.HandshakeResponse),
        "Encode": (pb2.EncodeRequest, pb2.EncodeResponse),
        "Lookup": (pb2.LookupRequest, pb2.LookupResponse),
        "Release": (pb2.ReleaseRequest, pb2.ReleaseResponse),
    }
    # Encode requests are read without copying their media (encode_request.py).
    parsers: dict[str, Callable[[bytes], object]] = {"Encode": parse_encode_request}
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            gate.route(name), request_deserializer=_tolerant(request, parsers.get(name)),
            response_serializer=response.SerializeToString)
        for name, (request, response) in signatures.items()
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


async def abort_call(context: Context, code: grpc.StatusCode, message: str) -> None:
    """``context.abort``, for a call whose caller may be gone.

    When the caller's deadline passed or it cancelled, gRPC has ended the call
    already and sending a status fails inside gRPC (which logs a traceback for
    what is an ordinary outcome): end the handler as cancelled instead.
    """
    try:
        await context.abort(code, message)
    except grpc.aio.AbortError:
        raise
    except Exception:  # noqa: BLE001 - gRPC's failed send has no public type
        logger.debug("call ended before its %s status could be sent: %s", code.name, message)
        raise asyncio.CancelledError from None


class CacheServiceGate:
    """What every cache RPC goes through: refused until the encoder is ready, then the servicer.

    Until :meth:`open` hands it the servicer, each call is refused with
    :class:`ServiceWarmingUp` (``UNAVAILABLE``, saying how far the start-up is),
    as a draining encoder refuses new work. Nothing reaches an engine that
    does not exist yet, and no handshake is answered before the cache is
    registered (the agent metadata it carries is a snapshot taken after
    registration).
    """

    def __init__(self, metrics: EncoderMetrics) -> None:
        self.metrics = metrics
        # What the refusal says; the warm-up thread replaces it as it goes (one reference, no lock needed).
        self.progress = "starting"
        self._servicer: EncoderCacheServicer | None = None

    def open(self, servicer: EncoderCacheServicer) -> None:
        """From now on every call goes to ``servicer``."""
        self._servicer = servicer

    def route(self, method: str) -> Callable[[Any, Context], Awaitable[Any]]:
        """The handler gRPC registers for ``method``."""

        async def call(request: Any, context: Context) -> Any:
            servicer = self._servicer
            if servicer is None:
                await self._refuse(method, context)
            handler: Callable[[Any, Context], Awaitable[Any]] = getattr(servicer, method)
            return await handler(request, context)

        return call

    async def _refuse(self, method: str, context: Context) -> NoReturn:
        err = ServiceWarmingUp(f"encoder is warming up ({self.progress}); retry later or use another encoder")
        self.metrics.requests.labels(method=method, code=err.grpc_code.name).inc()
        await abort_call(context, err.grpc_code, str(err))
        raise AssertionError("unreachable")  # context.abort always raises
