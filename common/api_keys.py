"""API keys a caller presents as ``Authorization: Bearer KEY`` (``epd proxy``'s front door, and the
prefetch middleware in vLLM's API server, which checks vLLM's own keys).

Keys are kept as SHA-256 digests and compared with :func:`hmac.compare_digest`, every one of
them, so the time a check takes says nothing about any key (nor its length).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable


class ApiKeys:
    """The keys a caller may present; none: every caller is let in."""

    def __init__(self, keys: Iterable[str]) -> None:
        # Digests, not the keys: equal lengths, so compare_digest's time depends on no key's length.
        self._digests = tuple(dict.fromkeys(hashlib.sha256(key.encode()).digest() for key in keys))

    def __len__(self) -> int:
        return len(self._digests)

    def allows(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` header is ``Bearer KEY`` with one of the keys. Every key is
        compared, whichever matches, so the time taken does not tell which one came close."""
        scheme, _, token = (authorization or "").strip().partition(" ")
        digest = hashlib.sha256(token.strip().encode()).digest()
        match = False
        for known in self._digests:
            match |= hmac.compare_digest(digest, known)
        return match and scheme.lower() == "bearer"
