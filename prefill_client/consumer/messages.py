"""What a consumer sends an encoder and reads back (any process that pulls or places): the media
items and the ``Encode`` request's wire bytes, the handshake's layout and preprocessing
parameters, and our typed error for a failed RPC's status. :mod:`.connection` makes the calls.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from common import media
from common.errors import (
    AuthError,
    CacheFullError,
    EncoderCallError,
    EncoderCallTimeout,
    EncoderUnreachable,
    EpdError,
    HandshakeError,
    InvalidRequestError,
    LimitExceededError,
)
from common.layout import CacheLayout
from common.wire import pb2

_PROTO_DTYPES = {pb2.D_TYPE_BFLOAT16: "bfloat16", pb2.D_TYPE_FLOAT16: "float16", pb2.D_TYPE_FLOAT32: "float32"}
_RETRY_HINT = re.compile(r"retry after (\d+) ms")


@dataclass(frozen=True, slots=True)
class MediaSpec:
    """An item to encode, as the client sends it; its content digest is computed once, when first needed.

    ``cache_salt``: the tenant's (vLLM's ``cache_salt``); the encoder keys the item by it too,
    so tenants of different salts never share its entry. "" is none.
    """

    kind: str  # "image" | "video"
    frames: tuple[bytes, ...]  # one entry for an image
    fps: float = 0.0
    uuid: str = ""
    cache_salt: str = ""
    _key: str | None = field(default=None, init=False, repr=False, compare=False)

    def key(self) -> str:
        """The digest of the item's bytes (routing key, input of its mm_hash); memoized.

        Without the salt: the same bytes go to the same encoder whatever the tenant, which
        keeps an encoder's share of the items when tenants are added.
        """
        if self._key is None:
            object.__setattr__(self, "_key", media.content_hash(self.kind, self.frames, self.fps))
        assert self._key is not None
        return self._key

    @classmethod
    def image(cls, data: bytes, uuid: str = "", cache_salt: str = "") -> MediaSpec:
        return cls("image", (data,), 0.0, uuid, cache_salt)

    @classmethod
    def video(cls, frames: Sequence[bytes], fps: float = 0.0, uuid: str = "", cache_salt: str = "") -> MediaSpec:
        return cls("video", tuple(frames), fps, uuid, cache_salt)

    def to_proto(self) -> pb2.MediaItem:
        if self.kind == "image":
            return pb2.MediaItem(image=self.frames[0], uuid=self.uuid, cache_salt=self.cache_salt)
        return pb2.MediaItem(video=pb2.VideoFrames(frames=self.frames, fps=self.fps), uuid=self.uuid,
                             cache_salt=self.cache_salt)


def content_key(item: MediaSpec) -> str:
    """Digest of an item's bytes: the routing key (the only variable input of its mm_hash)."""
    return item.key()


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        if not n:
            out.append(low)
            return bytes(out)
        out.append(low | 0x80)


def _length_delimited(field_number: int, size: int) -> bytes:
    """Key and length of a length-delimited field (wire type 2); the payload follows."""
    return _varint(field_number << 3 | 2) + _varint(size)


_ITEMS_FIELD = pb2.EncodeRequest.DESCRIPTOR.fields_by_name["items"].number
_IMAGE_FIELD = pb2.MediaItem.DESCRIPTOR.fields_by_name["image"].number
_UUID_FIELD = pb2.MediaItem.DESCRIPTOR.fields_by_name["uuid"].number
_SALT_FIELD = pb2.MediaItem.DESCRIPTOR.fields_by_name["cache_salt"].number


def encode_request_bytes(model_id: str, consumer_id: str, incarnation_id: str, items: Sequence[MediaSpec],
                         call_id: str = "") -> bytes:
    """An ``EncodeRequest`` in protobuf wire format, each image's bytes copied once.

    Built through protobuf, every image is copied into the message and again
    into the serialized string: 40 ms for 30 512x512 PNGs here, twice what
    gRPC takes to send them. Protobuf reads concatenated fields as one
    message, so the small fields are serialized by protobuf and each image
    item is framed here (videos go through protobuf). A test checks the bytes
    parse to exactly the message protobuf would build.
    """
    head = pb2.EncodeRequest(model_id=model_id, consumer_id=consumer_id, incarnation_id=incarnation_id,
                             call_id=call_id)
    parts = [head.SerializeToString()]
    for item in items:
        if item.kind == "image":
            image = item.frames[0]
            inner = [_length_delimited(_IMAGE_FIELD, len(image)), image]
            for number, text in ((_UUID_FIELD, item.uuid), (_SALT_FIELD, item.cache_salt)):
                if text:  # protobuf writes no empty string either
                    data = text.encode()
                    inner += [_length_delimited(number, len(data)), data]
        else:
            inner = [item.to_proto().SerializeToString()]
        parts += [_length_delimited(_ITEMS_FIELD, sum(len(p) for p in inner)), *inner]
    return b"".join(parts)


def layout_from_proto(msg: pb2.CacheLayout) -> CacheLayout:
    from common.layout import parse_dtype

    if msg.dtype not in _PROTO_DTYPES:
        raise HandshakeError(f"encoder announced unknown cache dtype {msg.dtype}")
    layout = CacheLayout(msg.num_blocks, msg.block_size, msg.out_hidden_size,
                         msg.num_deepstack_levels, parse_dtype(_PROTO_DTYPES[msg.dtype]))
    if layout.fat_dim != msg.fat_dim or layout.bytes_per_block != msg.bytes_per_block:
        raise HandshakeError(
            f"encoder layout is inconsistent: fat_dim {msg.fat_dim} / bytes_per_block "
            f"{msg.bytes_per_block}, expected {layout.fat_dim} / {layout.bytes_per_block}")
    return layout


def params_from_proto(p: pb2.PreprocessParams) -> media.PreprocessParams:
    if not (p.patch_size and p.merge_size and p.temporal_patch_size and p.max_pixels):
        raise HandshakeError(f"encoder sent incomplete preprocessing parameters: {p}")
    return media.PreprocessParams(
        p.patch_size, p.merge_size, p.temporal_patch_size, p.min_pixels, p.max_pixels,
        p.video_min_pixels or None, p.video_max_pixels or None, p.video_sample_fps or None)


def announces_params(p: pb2.PreprocessParams) -> bool:
    """Whether an encoder preprocesses by parameters it announces (epd-cache's own tower), not with
    the model's own processor (the vLLM tower announces none: every field 0). Some fields set and
    others not is an incomplete announcement, refused by :func:`params_from_proto`."""
    return any((p.patch_size, p.merge_size, p.temporal_patch_size, p.max_pixels))


def status_error(exc: grpc.RpcError) -> EpdError:
    """Our typed error for a failed RPC: what the caller must act on (cache full, bad request,
    refused credentials or handshake), else :class:`EncoderCallError` by status (unreachable,
    timed out, or any other status, named)."""
    code, details = exc.code(), exc.details() or ""
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        hint = _RETRY_HINT.search(details)
        if hint:
            return CacheFullError(details.split(" (retry after")[0], int(hint.group(1)))
        return LimitExceededError(details)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequestError(details)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return AuthError(details)
    if code == grpc.StatusCode.FAILED_PRECONDITION and "incarnation" not in details:
        return HandshakeError(details)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return EncoderUnreachable(code, details)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return EncoderCallTimeout(code, details)
    return EncoderCallError(code, details)
