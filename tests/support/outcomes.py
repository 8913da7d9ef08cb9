"""Names for the outcomes of client calls under load (test processes).

A clear, typed outcome gets a short name; anything else (an ``INTERNAL`` /
``UNKNOWN`` status, an exception that is not one of the errors a caller is
told to expect) is named ``untyped:...``, and the tests fail on those.
"""

from __future__ import annotations

import grpc

from common.errors import CacheFullError, ECLoadFailure, EncoderCallError, LimitExceededError


def classify(exc: BaseException) -> str:
    if isinstance(exc, CacheFullError):
        return "cache_full"
    if isinstance(exc, LimitExceededError):
        return "limit"
    if isinstance(exc, ECLoadFailure):
        return f"ec_load_failure:{exc.reason.value}"
    if isinstance(exc, EncoderCallError):  # a status with no typed error of its own
        if exc.code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
            return f"untyped:{exc.code.name}:{exc.details}"
        return f"status:{exc.code.name}"
    return f"untyped:{type(exc).__name__}:{exc}"


def untyped(outcomes: dict[str, int]) -> dict[str, int]:
    return {name: n for name, n in outcomes.items() if name.startswith("untyped")}
