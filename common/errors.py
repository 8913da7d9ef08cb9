"""The one error tree of the project (both processes).

Every error the project raises on purpose derives from ``EpdError`` and carries
the gRPC status it maps to, so the servicer aborts with
``context.abort(err.grpc_code, str(err))`` and a client maps a status back with
:func:`prefill_client.consumer.connection.status_error`::

    EpdError                      INTERNAL
    ├── ConfigError               INVALID_ARGUMENT   (also a ValueError)
    ├── InvalidRequestError       INVALID_ARGUMENT
    │   └── InvalidMediaError     INVALID_ARGUMENT   bad bytes, size, mode, frames
    ├── LimitExceededError        RESOURCE_EXHAUSTED too many items / pixels / bytes
    ├── AuthError                 UNAUTHENTICATED
    ├── HandshakeError            FAILED_PRECONDITION model/layout/version mismatch
    │   └── WeightsMismatchError  FAILED_PRECONDITION encoder's vision weights are not the expected ones
    ├── StaleIncarnationError     FAILED_PRECONDITION producer restarted: re-handshake
    ├── CacheFullError            RESOURCE_EXHAUSTED nothing evictable; retry_after_ms
    ├── NotFoundError             NOT_FOUND
    ├── ItemLostError             ABORTED            an item left the cache while its request ran: retry
    ├── ServiceDraining           UNAVAILABLE        encoder shutting down: use another
    ├── ServiceWarmingUp          UNAVAILABLE        encoder still starting: use another, retry later
    ├── TransportError            UNAVAILABLE        NIXL / mock transport failure
    │   ├── TransportUnavailable  FAILED_PRECONDITION no NIXL package installed
    │   ├── TransferTimeout       DEADLINE_EXCEEDED  our deadline passed; landing quarantined
    │   └── PeerDisconnected      UNAVAILABLE        remote agent gone
    ├── EncoderCallError          (its status)       an RPC to an encoder failed with no typed error above
    │   ├── EncoderUnreachable    UNAVAILABLE        down, or left the encoder list mid-call: use another
    │   └── EncoderCallTimeout    DEADLINE_EXCEEDED  no answer by our deadline: overloaded, not down
    ├── EncoderCacheReadError     INTERNAL           monolithic read: missing slot / token count
    └── ECLoadFailure             ABORTED            EPD consumer could not prove the data

``ECLoadFailure`` is what a prefill worker raises whenever it cannot prove an
embedding is the one it asked for; it is never a silent skip.
"""

from __future__ import annotations

import enum

import grpc


class EpdError(Exception):
    """Root of every error this project raises on purpose."""

    grpc_code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class ConfigError(EpdError, ValueError):
    """A configuration value is invalid; the message names it."""

    grpc_code = grpc.StatusCode.INVALID_ARGUMENT


class InvalidRequestError(EpdError):
    """A request field is malformed or out of range."""

    grpc_code = grpc.StatusCode.INVALID_ARGUMENT


class InvalidMediaError(InvalidRequestError):
    """A media item cannot be decoded or is outside the accepted limits."""

    def __init__(self, item: str, reason: str) -> None:
        prefix = f"invalid media item {item}: "
        reason = reason.removeprefix(prefix)  # relayed from an encoder, the reason says it already
        super().__init__(prefix + reason)
        self.item = item
        self.reason = reason


class LimitExceededError(EpdError):
    """A request is larger than a configured limit."""

    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class AuthError(EpdError):
    grpc_code = grpc.StatusCode.UNAUTHENTICATED


class HandshakeError(EpdError):
    """Producer and consumer disagree on model, layout or protocol version."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION


class WeightsMismatchError(HandshakeError):
    """The encoder serves vision weights other than the ones this consumer expects (a rolling update).

    The message names both digests. The client moves on to the next encoder in
    rendezvous order, as for an encoder that is down.
    """

    def __init__(self, target: str, expected: str, got: str) -> None:
        super().__init__(f"encoder {target} serves vision weights {got or '(none announced)'}, "
                         f"this consumer expects {expected}")
        self.target, self.expected, self.got = target, expected, got


class StaleIncarnationError(EpdError):
    """The request names a producer incarnation that is no longer running."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION


class CacheFullError(EpdError):
    """The cache cannot take the request even after evicting what is evictable."""

    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, retry_after_ms: int) -> None:
        super().__init__(f"{message} (retry after {retry_after_ms} ms)")
        self.retry_after_ms = retry_after_ms


class NotFoundError(EpdError):
    grpc_code = grpc.StatusCode.NOT_FOUND


class ItemLostError(EpdError):
    """An item's pinned allocation ended before its request could hand it out.

    A per-item outcome of Encode (never a whole-call failure): the item was
    evicted while the request waited, or its lease ended. Retrying the
    request encodes it again.
    """

    grpc_code = grpc.StatusCode.ABORTED


class ServiceDraining(EpdError):
    """The encoder is shutting down and takes no new work."""

    grpc_code = grpc.StatusCode.UNAVAILABLE


class ServiceWarmingUp(EpdError):
    """The encoder answers health but is still starting (loading, registering, building graphs).

    UNAVAILABLE like a draining encoder: a client moves on to the next encoder or retries
    later; the message says how far the start-up is.
    """

    grpc_code = grpc.StatusCode.UNAVAILABLE


class TransportError(EpdError):
    """The data path (NIXL or the mock agent) failed."""

    grpc_code = grpc.StatusCode.UNAVAILABLE


class TransportUnavailable(TransportError):
    """No NIXL binding is importable in this environment."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION


class TransferTimeout(TransportError):
    """A transfer did not complete by our deadline (NIXL itself has none)."""

    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED


class PeerDisconnected(TransportError):
    """The remote agent went away; the peer must handshake again."""


class EncoderCallError(EpdError):
    """An RPC to an encoder failed with a status no typed error above stands for (the consumer side's
    mapping, :func:`prefill_client.consumer.connection.status_error`); ``code`` is that status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class EncoderUnreachable(EncoderCallError):
    """The encoder did not take the call (UNAVAILABLE), or its channel closed under it (CANCELLED)."""

    grpc_code = grpc.StatusCode.UNAVAILABLE


class EncoderCallTimeout(EncoderCallError):
    """The encoder did not answer by the call's deadline."""

    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED


class EncoderCacheReadError(EpdError):
    """Monolithic mode: a scheduled item's slot is missing or its token count is wrong."""


class LoadFailureReason(str, enum.Enum):
    TAG_MISMATCH = "tag_mismatch"
    GENERATION_MISMATCH = "generation_mismatch"
    TOKEN_COUNT = "token_count"
    TIMEOUT = "timeout"
    DISCONNECT = "disconnect"
    EVICTED = "evicted"
    HANDSHAKE = "handshake"


class ECLoadFailure(EpdError):
    """An EPD consumer could not prove that pulled rows are the item it asked for."""

    grpc_code = grpc.StatusCode.ABORTED

    def __init__(
        self,
        reason: LoadFailureReason,
        mm_hash: str,
        *,
        block: int | None = None,
        expected: object = None,
        got: object = None,
        detail: str = "",
    ) -> None:
        parts = [f"EC load failure ({reason.value}) for mm_hash {mm_hash}"]
        if block is not None:
            parts.append(f"block {block}")
        if expected is not None or got is not None:
            parts.append(f"expected {expected}, got {got}")
        if detail:
            parts.append(detail)
        super().__init__(": ".join([parts[0], ", ".join(parts[1:])]) if len(parts) > 1 else parts[0])
        self.reason = reason
        self.mm_hash = mm_hash
        self.block = block
        self.expected = expected
        self.got = got
