"""The proxy's HTTP errors, and what the caller hears when encoding a request's items fails (proxy process).

:class:`HttpError` is an answer for the caller (status, OpenAI-style error body, headers).
:data:`ENCODE_ERRORS` is the one mapping from the project's error tree (:mod:`common.errors`)
and gRPC's to such an answer; :func:`encode_rule` reads it along the error's class, most
specific first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from common.errors import (
    CacheFullError,
    ECLoadFailure,
    EncoderCallError,
    EpdError,
    HandshakeError,
    InvalidMediaError,
    InvalidRequestError,
    LimitExceededError,
    LoadFailureReason,
    WeightsMismatchError,
)

INVALID = "invalid_request_error"
UNAVAILABLE = "service_unavailable"
AUTHENTICATION = "authentication_error"
RATE_LIMITED = "rate_limit_error"
SERVER_ERROR = "server_error"  # a backend failed the request: its answer, explained
FIXED_MODEL_SOURCE = "--model-id"  # where the model id came from when the proxy was started with one


class HttpError(Exception):
    """An answer for the caller: status, OpenAI-style error body, extra headers."""

    def __init__(self, status: int, message: str, *, kind: str = INVALID,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.headers = headers or {}

    def response(self) -> web.Response:
        body = {"error": {"message": str(self), "type": self.kind, "code": self.status}}
        return web.json_response(body, status=self.status, headers=self.headers)


@dataclass(frozen=True, slots=True)
class EncodeRule:
    """How the caller hears of one kind of encoding failure.

    ``message`` is formatted with ``exc`` (the error), ``name`` (its class name), ``code`` and
    ``details`` (a gRPC status), ``model``, ``source`` (where the model id came from) and
    ``hint``. ``when``: the rule holds only for errors it accepts. ``retry_after``: a
    ``Retry-After`` header from the error's ``retry_after_ms``. ``drops_client``: the
    encoders refused the model id, so the proxy forgets its client for that model.
    """

    error: type[BaseException]
    status: int
    kind: str
    message: str
    when: Callable[[BaseException], bool] | None = None
    retry_after: bool = False
    drops_client: bool = False

    def answer(self, exc: BaseException, model: str, source: str) -> HttpError:
        """The caller's answer for ``exc``, raised placing the items of ``model`` (from ``source``)."""
        message = self.message.format(exc=exc, name=type(exc).__name__, model=model, source=source,
                                      hint=_hint(source))
        headers = None
        if self.retry_after and isinstance(exc, CacheFullError):
            headers = {"Retry-After": str(max(1, -(-exc.retry_after_ms // 1000)))}
        return HttpError(self.status, message, kind=self.kind, headers=headers)


def _timed_out(exc: BaseException) -> bool:
    """A load failure of an RPC that outlived its deadline."""
    return isinstance(exc, ECLoadFailure) and exc.reason is LoadFailureReason.TIMEOUT


def _unreachable(exc: BaseException) -> bool:
    """A load failure that means no encoder could be reached (rather than one that failed the items)."""
    return isinstance(exc, ECLoadFailure) and exc.reason in (LoadFailureReason.HANDSHAKE, LoadFailureReason.DISCONNECT)


def _hint(source: str) -> str:
    """Which model id to fix when the encoders refuse the proxy's."""
    if source == FIXED_MODEL_SOURCE:
        return "epd proxy's --model-id must be the encoders'"
    return ("the encoders' --model-id must be the name vLLM serves the model under, or start epd proxy "
            "with --model-id set to the encoders'")


# Errors of placing a request's items -> the caller's answer; looked up along the error's class,
# most specific first (the first rule of a class that holds wins). The encoder's handshake
# message names both model ids ("this encoder serves 'X', request names 'Y'").
ENCODE_ERRORS: tuple[EncodeRule, ...] = (
    EncodeRule(InvalidMediaError, 400, INVALID, "{exc}"),
    EncodeRule(LimitExceededError, 400, INVALID, "{exc}"),
    # The encoder refused a field of the request's items (INVALID_ARGUMENT): the request's to fix.
    EncodeRule(InvalidRequestError, 400, INVALID, "the encoders refused the request: {exc}"),
    EncodeRule(CacheFullError, 429, RATE_LIMITED, "{exc}", retry_after=True),
    EncodeRule(ECLoadFailure, 503, UNAVAILABLE, "encoding failed: {exc}", when=_unreachable),
    # An encoder took the call and did not answer by the deadline: overloaded, not down.
    EncodeRule(ECLoadFailure, 504, UNAVAILABLE, "encoding timed out: {exc} (the encoders are busy: retry; add "
                                                "encoders, or raise --encode-timeout-s)", when=_timed_out),
    EncodeRule(ECLoadFailure, 502, UNAVAILABLE, "encoding failed: {exc}"),
    EncodeRule(EncoderCallError, 503, UNAVAILABLE, "encoder error: {exc}"),  # "CODE: details"
    EncodeRule(WeightsMismatchError, 502, UNAVAILABLE, "encoding failed: {exc}"),
    EncodeRule(HandshakeError, 502, UNAVAILABLE, "the encoders refused the handshake for model {model!r} "
                                                 "(from {source}): {exc} ({hint})", drops_client=True),
    EncodeRule(EpdError, 502, UNAVAILABLE, "encoding failed: {name}: {exc}"),
)

ENCODE_FAILURES: tuple[type[BaseException], ...] = tuple(dict.fromkeys(rule.error for rule in ENCODE_ERRORS))
"""The errors :data:`ENCODE_ERRORS` answers (for an ``except``); any other is a bug, not an answer."""


def encode_rule(exc: BaseException) -> EncodeRule:
    """The rule of :data:`ENCODE_ERRORS` for ``exc``, one of :data:`ENCODE_FAILURES`."""
    for cls in type(exc).__mro__:
        for rule in ENCODE_ERRORS:
            if rule.error is cls and (rule.when is None or rule.when(exc)):
                return rule
    raise TypeError(f"no HTTP answer for {type(exc).__name__}: {exc}") from exc
