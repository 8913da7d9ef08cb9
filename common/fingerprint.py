"""Content fingerprints stamped into cache block tags (both processes).

Definition, language independent::

    fingerprint(mm_hash) = int64_le(BLAKE2b-64(utf8(mm_hash)))   # signed
    if that is 0, the fingerprint is 1

BLAKE2b-64 is BLAKE2b with an 8-byte digest, no key, no salt, no
personalization (``hashlib.blake2b(data, digest_size=8)``). The bytes are read
as a little-endian two's-complement int64, the type of the tag region. Zero is
reserved for "empty block", so the one input that would hash to 0 is mapped to
1. Python's ``hash()`` is never used: it is salted per process.
"""

from __future__ import annotations

import functools
import hashlib

EMPTY_TAG = 0


def mm_hash_fingerprint(mm_hash: str) -> int:
    """Return the non-zero signed int64 tag for ``mm_hash``."""
    if not isinstance(mm_hash, str) or not mm_hash:
        raise ValueError(f"mm_hash must be a non-empty str, got {mm_hash!r}")
    digest = hashlib.blake2b(mm_hash.encode("utf-8"), digest_size=8).digest()
    value = int.from_bytes(digest, "little", signed=True)
    return value if value != EMPTY_TAG else 1


@functools.lru_cache(maxsize=1 << 16)
def cached_fingerprint(mm_hash: str) -> int:
    """:func:`mm_hash_fingerprint`, memoized (bounded): both sides compute it for the same
    items again and again (every allocation, every answer, every verified pull)."""
    return mm_hash_fingerprint(mm_hash)
