from __future__ import annotations

import grpc
import pytest

from common import errors
from common.errors import ECLoadFailure, EpdError, LoadFailureReason

EXPECTED = {
    errors.EpdError: grpc.StatusCode.INTERNAL,
    errors.ConfigError: grpc.StatusCode.INVALID_ARGUMENT,
    errors.InvalidRequestError: grpc.StatusCode.INVALID_ARGUMENT,
    errors.InvalidMediaError: grpc.StatusCode.INVALID_ARGUMENT,
    errors.LimitExceededError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.AuthError: grpc.StatusCode.UNAUTHENTICATED,
    errors.HandshakeError: grpc.StatusCode.FAILED_PRECONDITION,
    errors.WeightsMismatchError: grpc.StatusCode.FAILED_PRECONDITION,
    errors.StaleIncarnationError: grpc.StatusCode.FAILED_PRECONDITION,
    errors.CacheFullError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.NotFoundError: grpc.StatusCode.NOT_FOUND,
    errors.ItemLostError: grpc.StatusCode.ABORTED,
    errors.ServiceDraining: grpc.StatusCode.UNAVAILABLE,
    errors.ServiceWarmingUp: grpc.StatusCode.UNAVAILABLE,
    errors.TransportError: grpc.StatusCode.UNAVAILABLE,
    errors.TransportUnavailable: grpc.StatusCode.FAILED_PRECONDITION,
    errors.TransferTimeout: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.PeerDisconnected: grpc.StatusCode.UNAVAILABLE,
    errors.EncoderCallError: grpc.StatusCode.INTERNAL,
    errors.EncoderUnreachable: grpc.StatusCode.UNAVAILABLE,
    errors.EncoderCallTimeout: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.EncoderCacheReadError: grpc.StatusCode.INTERNAL,
    errors.ECLoadFailure: grpc.StatusCode.ABORTED,
}


@pytest.mark.parametrize("cls, code", list(EXPECTED.items()), ids=lambda v: getattr(v, "__name__", str(v)))
def test_grpc_status_mapping(cls: type[EpdError], code: grpc.StatusCode) -> None:
    assert issubclass(cls, EpdError)
    assert cls.grpc_code == code


def test_every_error_class_is_mapped() -> None:
    defined = {
        obj for obj in vars(errors).values()
        if isinstance(obj, type) and issubclass(obj, EpdError)
    }
    assert defined == set(EXPECTED)


def test_config_error_is_a_value_error() -> None:
    assert issubclass(errors.ConfigError, ValueError)


def test_ec_load_failure_names_item_block_and_values() -> None:
    err = ECLoadFailure(LoadFailureReason.TAG_MISMATCH, "abc", block=7, expected=11, got=-3)
    text = str(err)
    for needle in ("tag_mismatch", "abc", "block 7", "expected 11", "got -3"):
        assert needle in text
    assert (err.reason, err.mm_hash, err.block, err.expected, err.got) == (
        LoadFailureReason.TAG_MISMATCH, "abc", 7, 11, -3)


def test_cache_full_carries_retry_hint() -> None:
    err = errors.CacheFullError("no evictable blocks", retry_after_ms=100)
    assert err.retry_after_ms == 100
    assert "retry after 100 ms" in str(err)


def test_invalid_media_names_item_and_reason() -> None:
    err = errors.InvalidMediaError("item 2 (uuid cat)", "truncated PNG")
    assert "item 2 (uuid cat)" in str(err) and "truncated PNG" in str(err)


class _Status(grpc.RpcError):
    """A failed call as grpc raises it."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@pytest.mark.parametrize("code, details, cls", [
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "cache full (retry after 250 ms)", errors.CacheFullError),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "request has 40 items; at most 32", errors.LimitExceededError),
    (grpc.StatusCode.INVALID_ARGUMENT, "model_id is empty", errors.InvalidRequestError),
    (grpc.StatusCode.UNAUTHENTICATED, "bad token", errors.AuthError),
    (grpc.StatusCode.FAILED_PRECONDITION, "model_id mismatch", errors.HandshakeError),
    (grpc.StatusCode.UNAVAILABLE, "connection refused", errors.EncoderUnreachable),
    (grpc.StatusCode.CANCELLED, "channel closed", errors.EncoderUnreachable),
    (grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded", errors.EncoderCallTimeout),
    (grpc.StatusCode.INTERNAL, "boom", errors.EncoderCallError),
    (grpc.StatusCode.UNKNOWN, "exception in handler", errors.EncoderCallError),
])
def test_every_failed_call_becomes_a_typed_error(code: grpc.StatusCode, details: str, cls: type[EpdError]) -> None:
    from prefill_client.consumer.messages import status_error

    err = status_error(_Status(code, details))
    assert type(err) is cls
    if isinstance(err, errors.EncoderCallError):
        assert (err.code, err.details, str(err)) == (code, details, f"{code.name}: {details}")
    if isinstance(err, errors.CacheFullError):
        assert err.retry_after_ms == 250
