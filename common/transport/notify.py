"""Lease-release notifications a READ can carry (a consumer writes, the encoder reads).

A NIXL READ can carry a message that the *target* agent receives when the
transfer completes, so a consumer may release leases on its stamp READ. The
encoder accepts them from any consumer. This project's client does not send
them: a READ with a notification waits for the encoder's agent to make
progress, so it releases by a batched Release RPC instead
(:mod:`prefill_client.consumer.release`). The encoder decodes whatever arrives and
must not trust it: every malformed message is a ``ValueError`` naming what is
wrong.

Layout (little-endian): ``b"EPDR"``, version byte, three zero bytes,
``uint32`` count, then ``count`` ``uint64`` lease ids.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np

RELEASE_MAGIC = b"EPDR"
RELEASE_VERSION = 1
# One tag READ covers one request; 4096 leases is far above any request and
# keeps the message well under a UCX eager / datagram size.
MAX_RELEASE_LEASES = 4096
_HEADER = struct.Struct("<4sB3xI")


def encode_release_notification(lease_ids: Sequence[int]) -> bytes:
    """The notification releasing ``lease_ids`` (each a uint64)."""
    ids = [int(lease) for lease in lease_ids]
    if len(ids) > MAX_RELEASE_LEASES:
        raise ValueError(f"{len(ids)} leases in one notification; at most {MAX_RELEASE_LEASES}")
    for lease in ids:
        if not 0 <= lease < (1 << 64):
            raise ValueError(f"lease id {lease} is not a uint64")
    return _HEADER.pack(RELEASE_MAGIC, RELEASE_VERSION, len(ids)) + np.asarray(ids, dtype="<u8").tobytes()


def decode_release_notification(msg: bytes) -> list[int]:
    """The lease ids in ``msg``; ``ValueError`` on anything but a well-formed notification."""
    if not isinstance(msg, (bytes, bytearray, memoryview)):
        raise ValueError(f"notification must be bytes, got {type(msg).__name__}")
    data = bytes(msg)
    if len(data) < _HEADER.size:
        raise ValueError(f"notification of {len(data)} bytes is shorter than its {_HEADER.size}-byte header")
    magic, version, count = _HEADER.unpack_from(data)
    if magic != RELEASE_MAGIC:
        raise ValueError(f"notification magic {magic!r} is not {RELEASE_MAGIC!r}")
    if version != RELEASE_VERSION:
        raise ValueError(f"notification version {version} is not {RELEASE_VERSION}")
    if count > MAX_RELEASE_LEASES:
        raise ValueError(f"notification claims {count} leases; at most {MAX_RELEASE_LEASES}")
    expected = _HEADER.size + 8 * count
    if len(data) != expected:
        raise ValueError(f"notification of {len(data)} bytes; {count} leases need exactly {expected}")
    return [int(lease) for lease in np.frombuffer(data, dtype="<u8", offset=_HEADER.size)]
