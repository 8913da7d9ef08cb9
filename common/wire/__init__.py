"""Wire protocol shared by the encoder and prefill processes.

The ``encoder_cache_pb2*`` modules beside this file are generated from
``proto/epd/v1/encoder_cache.proto`` by ``python -m common.wire.codegen`` and
committed; a test regenerates them and fails on any difference.
"""

from __future__ import annotations

from common.wire import encoder_cache_pb2 as pb2
from common.wire import encoder_cache_pb2_grpc as pb2_grpc

# Protocol version history (bump on any change a peer must know about):
#   1 - first version: Handshake / Encode / Lookup / Release; blocks are read
#       before tags and generations; leases released by RPC or by the NIXL
#       notification on the tag read.
#   2 - item content digests (the input of every mm_hash) are BLAKE3 instead of
#       BLAKE2b: a version-1 peer would name the same bytes by another mm_hash.
#       The handshake's stamp_region (per block: tag, then generation, 16 bytes)
#       replaces tag_region and generation_region. ItemError carries the item's
#       mm_hash; an item lost while its Encode ran is a per-item ABORTED.
#   Added within 2, since a peer of before ignores them: MediaItem.cache_salt and
#   HandshakeResponse.keys_cache_salt. A bump would refuse every older client; instead a
#   consumer sends a salted item only to an encoder announcing keys_cache_salt.
PROTOCOL_VERSION = 2

SERVICE_NAME = "epd.v1.EncoderCacheService"

__all__ = ["PROTOCOL_VERSION", "SERVICE_NAME", "pb2", "pb2_grpc"]
