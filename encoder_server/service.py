"""gRPC servicer of the encoder process: validation, proto conversion, status mapping.

Every handler maps our errors to their gRPC status with one
``context.abort(err.grpc_code, str(err))``; anything unexpected is logged and
answered ``INTERNAL`` (never ``UNKNOWN``). Work that can block (hashing,
decoding, the encoder graph, NIXL) runs off the event loop inside the engine.

Handlers are registered with gRPC by :mod:`encoder_server.gate`, before this
servicer exists: bytes that are not a valid message reach a handler as a
:class:`~encoder_server.gate.MalformedRequest`, answered ``INVALID_ARGUMENT``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
from prometheus_client import Counter

from common.errors import (
    EpdError,
    HandshakeError,
    InvalidRequestError,
    LimitExceededError,
    ServiceDraining,
    StaleIncarnationError,
)
from common.layout import CacheLayout, dtype_name
from common.media import PreprocessParams
from common.metrics import EncoderMetrics
from common.placeholder import ItemMeta
from common.placeholder import to_proto as placeholder_to_proto
from common.wire import PROTOCOL_VERSION, pb2, pb2_grpc
from encoder_server.call_leases import MAX_CALL_ID_CHARS, CallLeases
from encoder_server.encode_request import EncodeView, ItemView
from encoder_server.engine import EncoderEngine, Failed, Located, MediaInput
from encoder_server.gate import Context, MalformedRequest, abort_call

logger = logging.getLogger(__name__)

MAX_LABEL_CHARS = 256
MAX_LOOKUPS_PER_REQUEST = 1024
MAX_RELEASES_PER_REQUEST = 4096
# An answer needs a moment to reach its caller: with less of the deadline left,
# the leases in it are given back and the call ends DEADLINE_EXCEEDED.
ANSWER_MARGIN_S = 0.002
_MM_HASH = re.compile(r"^[0-9a-f]{32}$")

DTYPE_TO_PROTO = {
    "bfloat16": pb2.D_TYPE_BFLOAT16,
    "float16": pb2.D_TYPE_FLOAT16,
    "float32": pb2.D_TYPE_FLOAT32,
}

Req = TypeVar("Req")
Resp = TypeVar("Resp")


def layout_to_proto(layout: CacheLayout) -> pb2.CacheLayout:
    return pb2.CacheLayout(
        num_blocks=layout.num_blocks,
        block_size=layout.block_size,
        fat_dim=layout.fat_dim,
        dtype=DTYPE_TO_PROTO[dtype_name(layout.dtype)],
        scratch_block_id=layout.scratch_block_id,
        bytes_per_block=layout.bytes_per_block,
        out_hidden_size=layout.out_hidden_size,
        num_deepstack_levels=layout.num_deepstack_levels,
    )


def params_to_proto(params: PreprocessParams, fingerprint: str) -> pb2.PreprocessParams:
    return pb2.PreprocessParams(
        patch_size=params.patch_size, merge_size=params.merge_size,
        temporal_patch_size=params.temporal_patch_size, min_pixels=params.min_pixels,
        max_pixels=params.max_pixels, fingerprint=fingerprint,
        video_min_pixels=params.video_min_pixels or 0, video_max_pixels=params.video_max_pixels or 0,
        video_sample_fps=params.video_sample_fps or 0.0)


def _rpc(method: str) -> Callable[[Callable[..., Awaitable[Resp]]], Callable[..., Awaitable[Resp]]]:
    """Count the call and turn errors into statuses."""

    def wrap(fn: Callable[..., Awaitable[Resp]]) -> Callable[..., Awaitable[Resp]]:
        @functools.wraps(fn)
        async def handler(self: EncoderCacheServicer, request: Any, context: Context) -> Resp:
            code = grpc.StatusCode.OK
            try:
                if isinstance(request, MalformedRequest):
                    raise InvalidRequestError(
                        f"{method} request is not a valid {request.message_type}: {request.detail}")
                return await fn(self, request, context)
            except EpdError as err:
                code = err.grpc_code
                await abort_call(context, code, str(err))
            except asyncio.TimeoutError:
                code = grpc.StatusCode.DEADLINE_EXCEEDED
                await abort_call(context, code, f"{method} did not finish within the call's deadline")
            except asyncio.CancelledError:
                code = grpc.StatusCode.CANCELLED
                raise
            except Exception:
                code = grpc.StatusCode.INTERNAL
                logger.exception("%s failed", method)
                await abort_call(context, code, f"{method} failed inside the encoder; see its log")
            finally:
                self._count(method, code)
            raise AssertionError("unreachable")  # context.abort always raises

        return handler

    return wrap


class EncoderCacheServicer(pb2_grpc.EncoderCacheServiceServicer):
    """Handshake / Encode / Lookup / Release over an :class:`EncoderEngine`."""

    def __init__(
        self,
        *,
        engine: EncoderEngine,
        metrics: EncoderMetrics,
        model_id: str,
        layout: CacheLayout,
        incarnation_id: str,
        handshake_extra: Callable[[], pb2.HandshakeResponse],
        min_hold_ms: int,
        lease_ttl_ms: int,
        max_items: int,
        max_video_frames: int,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.model_id = model_id
        self.layout = layout
        self.incarnation_id = incarnation_id
        self._handshake_extra = handshake_extra
        self.min_hold_ms = min_hold_ms
        self.lease_ttl_ms = lease_ttl_ms
        self.max_items = max_items
        self.max_video_frames = max_video_frames
        self.compatibility_hash = layout.compatibility_hash(model_id, PROTOCOL_VERSION)
        self.draining = False
        self.calls = CallLeases(lease_ttl_ms / 1000.0)
        self._request_counters: dict[tuple[str, grpc.StatusCode], Counter] = {}
        # generation -> (mm_hash, metadata, encoded fields): see _allocation_fields. Live allocations
        # are fewer than the blocks, so past that many entries most are evicted ones and all go.
        self._locations: dict[int, tuple[str, ItemMeta, bytes]] = {}
        self._max_locations = layout.num_blocks

    # --- checks ----------------------------------------------------------------------

    def _check_model(self, model_id: str) -> None:
        if model_id != self.model_id:
            raise HandshakeError(
                f"model_id mismatch: this encoder serves {self.model_id!r}, request names {model_id!r}")

    def _check_incarnation(self, incarnation_id: str) -> None:
        if incarnation_id and incarnation_id != self.incarnation_id:
            raise StaleIncarnationError(
                f"encoder incarnation changed: request names {incarnation_id!r}, "
                f"this encoder is {self.incarnation_id!r}; handshake again")

    def _check_layout(self, expected: pb2.CacheLayout) -> None:
        ours = layout_to_proto(self.layout)
        for name in ("block_size", "fat_dim", "dtype", "out_hidden_size", "num_deepstack_levels"):
            want = getattr(expected, name)
            have = getattr(ours, name)
            if want and want != have:
                raise HandshakeError(f"layout mismatch on {name}: encoder has {have}, consumer expects {want}")

    @staticmethod
    def _check_label(kind: str, value: str, limit: int = MAX_LABEL_CHARS) -> None:
        if len(value) > limit:
            raise InvalidRequestError(f"{kind} is {len(value)} characters; at most {limit}")

    def _count(self, method: str, code: grpc.StatusCode) -> None:
        # labels() checks and joins its arguments on every call; the child of a pair never changes.
        key = (method, code)
        counter = self._request_counters.get(key)
        if counter is None:
            counter = self._request_counters[key] = self.metrics.requests.labels(method=method, code=code.name)
        counter.inc()

    # --- handlers --------------------------------------------------------------------

    @_rpc("Handshake")
    async def Handshake(self, request: pb2.HandshakeRequest, context: Context
                        ) -> pb2.HandshakeResponse:
        if request.protocol_version != PROTOCOL_VERSION:
            raise HandshakeError(
                f"protocol version mismatch: encoder speaks {PROTOCOL_VERSION}, "
                f"consumer sent {request.protocol_version}")
        self._check_model(request.model_id)
        self._check_label("consumer_id", request.consumer_id)
        if request.HasField("expected_layout"):
            self._check_layout(request.expected_layout)
        response = self._handshake_extra()
        response.protocol_version = PROTOCOL_VERSION
        response.model_id = self.model_id
        response.incarnation_id = self.incarnation_id
        response.layout.CopyFrom(layout_to_proto(self.layout))
        response.min_hold_ms = self.min_hold_ms
        response.lease_ttl_ms = self.lease_ttl_ms
        response.compatibility_hash = self.compatibility_hash
        logger.info("handshake from consumer %r", request.consumer_id)
        return response

    @_rpc("Encode")
    async def Encode(self, request: EncodeView, context: Context) -> pb2.EncodeResponse:
        self._check_model(request.model_id)
        self._check_incarnation(request.incarnation_id)
        self._check_label("consumer_id", request.consumer_id)
        self._check_label("call_id", request.call_id, MAX_CALL_ID_CHARS)
        self._refuse_if_draining()
        if not request.items:
            raise InvalidRequestError("Encode needs at least one item")
        if len(request.items) > self.max_items:
            raise LimitExceededError(
                f"request has {len(request.items)} items; this encoder accepts at most {self.max_items}")
        media = [self._media(i, item) for i, item in enumerate(request.items)]
        results = await self.engine.encode(media, request.consumer_id, timeout=context.time_remaining())
        self._deliver_or_drop(context, results, request.consumer_id, request.call_id)
        return pb2.EncodeResponse(
            results=[self._result(item.uuid, r) for item, r in zip(request.items, results)],
            incarnation_id=self.incarnation_id)

    @_rpc("Lookup")
    async def Lookup(self, request: pb2.LookupRequest, context: Context) -> pb2.LookupResponse:
        # Each read of a request's string field builds a new str: read each once.
        consumer_id, call_id = request.consumer_id, request.call_id
        self._check_model(request.model_id)
        self._check_incarnation(request.incarnation_id)
        self._check_label("consumer_id", consumer_id)
        self._check_label("call_id", call_id, MAX_CALL_ID_CHARS)
        self._refuse_if_draining()
        if len(request.mm_hashes) > MAX_LOOKUPS_PER_REQUEST:
            raise LimitExceededError(
                f"request looks up {len(request.mm_hashes)} items; at most {MAX_LOOKUPS_PER_REQUEST}")
        hashes = list(request.mm_hashes)
        for h in hashes:
            if not _MM_HASH.match(h):
                raise InvalidRequestError(f"mm_hash {h[:80]!r} is not 32 lowercase hex digits")
        results = self.engine.lookup(hashes, consumer_id)
        self._deliver_or_drop(context, results, consumer_id, call_id)
        response = pb2.LookupResponse(incarnation_id=self.incarnation_id)
        for r in results:
            self._fill(response.results.add(), "", r)
        return response

    @_rpc("Release")
    async def Release(self, request: pb2.ReleaseRequest, context: Context) -> pb2.ReleaseResponse:
        self._check_label("consumer_id", request.consumer_id)
        if len(request.lease_ids) > MAX_RELEASES_PER_REQUEST:
            raise LimitExceededError(
                f"request releases {len(request.lease_ids)} leases; at most {MAX_RELEASES_PER_REQUEST}")
        if len(request.call_ids) > MAX_RELEASES_PER_REQUEST:
            raise LimitExceededError(
                f"request gives up {len(request.call_ids)} calls; at most {MAX_RELEASES_PER_REQUEST}")
        for call_id in request.call_ids:
            self._check_label("call_id", call_id, MAX_CALL_ID_CHARS)
        lease_ids = list(request.lease_ids)
        self.calls.released(request.consumer_id, lease_ids)
        released = self.engine.release(lease_ids, request.consumer_id)
        for call_id in request.call_ids:
            if call_id:
                released += self._drop(self.calls.abandon(request.consumer_id, call_id), request.consumer_id)
        return pb2.ReleaseResponse(released=released)

    # --- delivery --------------------------------------------------------------------

    def _deliver_or_drop(
        self, context: Context, results: list[Located | Failed], consumer_id: str, call_id: str
    ) -> None:
        """Leave no lease behind in an answer its caller will never read.

        A caller that gave up before the answer is ready cancels the handler
        (the engine gives its leases back). Two windows remain: the deadline
        is too close to send the answer, or it passes while the answer is on
        its way. In the first we answer ``DEADLINE_EXCEEDED`` and release the
        leases now; for the second a done-callback releases them when the call
        ended past (or within the margin of) its deadline. Releasing a lease
        whose answer did arrive costs nothing in safety (the consumer's stamp
        READ still proves the data); it only stops pinning the item.

        Neither window can be closed by a clock here: the caller's deadline
        passes first by however long its request took to be read. So a call
        with a ``call_id`` is remembered with its leases (:mod:`.call_leases`):
        a caller that gave up releases it by that id, and an answer its caller
        gave up on before it was ready is dropped here.
        """
        lease_ids = [r.lease.lease_id for r in results if isinstance(r, Located)]
        wanted = self.calls.answered(consumer_id, call_id, lease_ids) if call_id else True
        if not lease_ids:
            return
        if not wanted:
            self._drop(lease_ids, consumer_id)
            raise asyncio.TimeoutError
        remaining = context.time_remaining()
        if remaining is not None and remaining < ANSWER_MARGIN_S:
            self._drop(lease_ids, consumer_id)
            raise asyncio.TimeoutError

        def after(ctx: Context) -> None:
            # Within the margin of the deadline the caller may have given up first (its clock
            # and ours differ by the time the request took to arrive): drop rather than pin.
            left = ctx.time_remaining()
            if left is not None and left < ANSWER_MARGIN_S:
                self._drop(lease_ids, consumer_id)

        # types-grpcio declares the callback type as a class, not a protocol: no function matches it.
        context.add_done_callback(after)  # type: ignore[arg-type]

    def _drop(self, lease_ids: list[int], consumer_id: str) -> int:
        if not lease_ids:
            return 0
        self.calls.released(consumer_id, lease_ids)
        dropped = self.engine.release(lease_ids, consumer_id)
        if dropped:
            self.metrics.leases_dropped.inc(dropped)
            logger.info("dropped %d leases of an answer %r did not receive in time", dropped, consumer_id)
        return dropped

    # --- conversion ------------------------------------------------------------------

    def _refuse_if_draining(self) -> None:
        if self.draining:
            raise ServiceDraining("encoder is draining for shutdown; use another encoder")

    def _media(self, index: int, item: ItemView) -> MediaInput:
        self._check_label(f"item {index} uuid", item.uuid)
        self._check_label(f"item {index} cache_salt", item.cache_salt)
        if item.kind == "image":
            return MediaInput("image", item.frames, None, item.uuid, item.cache_salt)
        if item.kind == "video":
            return MediaInput("video", item.frames, item.fps if item.fps > 0 else None, item.uuid, item.cache_salt)
        raise InvalidRequestError(f"item {index} carries neither an image nor a video")

    def _result(self, uuid: str, result: Located | Failed) -> pb2.ItemResult:
        out = pb2.ItemResult()
        self._fill(out, uuid, result)
        return out

    def _fill(self, out: pb2.ItemResult, uuid: str, result: Located | Failed) -> None:
        """Write one item's answer into the empty ``out``."""
        if isinstance(result, Failed):
            err = result.error
            out.CopyFrom(pb2.ItemResult(uuid=uuid, error=pb2.ItemError(
                code=err.grpc_code.value[0], message=str(err), mm_hash=result.mm_hash)))
            return
        out.uuid = uuid
        location = out.location
        location.MergeFromString(self._allocation_fields(result))
        lease = result.lease
        location.lease_id = lease.lease_id
        location.lease_expiry_unix_ms = max(0, int((time.time() + (lease.expires_at - time.monotonic())) * 1000))
        location.result = pb2.CACHE_RESULT_HIT if result.hit else pb2.CACHE_RESULT_MISS

    def _allocation_fields(self, result: Located) -> bytes:
        """The location's fields that its allocation fixes (all but the lease's and the hit), encoded.

        Encoded once per allocation, not per answer: building them (the placeholder fields
        above all) was most of a Lookup's conversion. A generation names one allocation of
        this cache; the hash and the metadata object are compared too, so an entry that does
        not match is rebuilt, never answered.
        """
        meta = result.meta
        cached = self._locations.get(result.generation)
        if cached is not None and cached[0] == result.mm_hash and cached[1] is meta:
            return cached[2]
        if len(self._locations) >= self._max_locations:
            self._locations.clear()  # a live allocation's entry comes back with its next answer
        encoded = pb2.ItemLocation(
            mm_hash=result.mm_hash,
            block_ids=result.block_ids,
            tokens_per_block=result.tokens_per_block,
            num_tokens=result.num_tokens,
            fingerprint=result.fingerprint,
            generation=result.generation,
            grid_thw=meta.grid_thw,
            placeholder=placeholder_to_proto(meta.placeholder),
            modality=meta.modality,
        ).SerializeToString()
        self._locations[result.generation] = (result.mm_hash, meta, encoded)
        return encoded
