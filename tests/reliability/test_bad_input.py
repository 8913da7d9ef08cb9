"""Hostile input through the real gRPC API: each case gets its documented status, nothing else moves.

Every case runs against one live encoder that cached a canary item first.
After each one: the status is the one the README documents (never
``UNKNOWN`` or ``INTERNAL``), the encoder still answers SERVING, its leases
(and, for refused input, its whole occupancy) are back at the baseline, and
the canary is still cached at the same blocks under the same generation.
A hypothesis run then throws generated requests and raw bytes at it.
"""

from __future__ import annotations

import io
import math
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from common.transport import ConsumerTransport
from common.wire import PROTOCOL_VERSION, SERVICE_NAME, pb2
from epd_harness.media import image_bytes, video_frames
from prefill_client.consumer.client import EncoderCacheClient
from tests.reliability.conftest import MAX_ITEMS, MAX_MESSAGE_BYTES, MAX_VIDEO_FRAMES, SharedEncoder
from tests.reliability.support import MODEL, SERVING, health, occupancy, wait_until
from tests.support.reference import Reference, matches

OK = grpc.StatusCode.OK
INVALID = grpc.StatusCode.INVALID_ARGUMENT
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
NOT_FOUND = grpc.StatusCode.NOT_FOUND
DOCUMENTED = {OK, INVALID, EXHAUSTED, PRECONDITION, NOT_FOUND}
_CODES = {code.value[0]: code for code in grpc.StatusCode}


# --- payloads -----------------------------------------------------------------------------------


def encoded(image: Image.Image, fmt: str, **options: object) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **options)
    return out.getvalue()


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_bomb(side: int = 8192) -> bytes:
    """A real decompression bomb: a ``side`` x ``side`` grayscale PNG of zeros, ~64 KiB for 64 Mpx."""
    squeeze = zlib.compressobj(9)
    row = b"\x00" * (side + 1)  # filter byte + pixels
    body = b"".join(squeeze.compress(row) for _ in range(side)) + squeeze.flush()
    ihdr = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", body) + _chunk(b"IEND", b"")


def animated_gif() -> bytes:
    frames = [Image.fromarray(np.full((64, 64), 40 * i, dtype=np.uint8)).convert("P") for i in range(3)]
    return encoded(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=40, loop=0)


def sixteen_bit_png() -> bytes:
    return encoded(Image.fromarray((np.arange(64 * 64, dtype=np.uint16) * 16).reshape(64, 64)), "PNG")


def cmyk_jpeg() -> bytes:
    rng = np.random.default_rng(5)
    return encoded(Image.fromarray(rng.integers(0, 256, (64, 64, 4), dtype=np.uint8), "CMYK"), "JPEG")


GOOD = image_bytes(64, 64, seed=31)


# --- the API as a hostile client sees it ---------------------------------------------------------


class Api:
    """Sends one request; returns the status it got (per item where the reply carries one)."""

    def __init__(self, shared: SharedEncoder) -> None:
        self.shared = shared
        self.stub = shared.stub

    def call(self, method: str, request: object) -> tuple[grpc.StatusCode, object]:
        try:
            return OK, getattr(self.stub, method)(request, timeout=30)
        except grpc.RpcError as exc:
            return exc.code(), exc.details()

    def raw(self, method: str, payload: bytes) -> grpc.StatusCode:
        call = self.shared.channel.unary_unary(f"/{SERVICE_NAME}/{method}", request_serializer=lambda b: b,
                                               response_deserializer=lambda b: b)
        try:
            call(payload, timeout=30)
            return OK
        except grpc.RpcError as exc:
            return exc.code()

    def item(self, item: pb2.MediaItem, consumer: str = "hostile") -> grpc.StatusCode:
        """Encode one item; the per-item status (leases of successes are released at once)."""
        code, resp = self.call("Encode", pb2.EncodeRequest(model_id=MODEL, consumer_id=consumer, items=[item]))
        if code != OK:
            return code
        result = resp.results[0]  # type: ignore[attr-defined]
        if result.WhichOneof("outcome") == "error":
            assert result.error.message, "an item error must say why"
            return _CODES[result.error.code]
        self.stub.Release(pb2.ReleaseRequest(consumer_id=consumer, lease_ids=[result.location.lease_id]),
                          timeout=10)
        return OK

    def image(self, data: bytes) -> grpc.StatusCode:
        return self.item(pb2.MediaItem(image=data, uuid="hostile.img"))

    def video(self, frames: list[bytes], fps: float = 0.0) -> grpc.StatusCode:
        return self.item(pb2.MediaItem(video=pb2.VideoFrames(frames=frames, fps=fps), uuid="hostile.mp4"))

    def encode(self, **fields: object) -> grpc.StatusCode:
        fields.setdefault("model_id", MODEL)
        fields.setdefault("consumer_id", "hostile")
        return self.call("Encode", pb2.EncodeRequest(**fields))[0]

    def handshake(self, **fields: object) -> grpc.StatusCode:
        fields.setdefault("protocol_version", PROTOCOL_VERSION)
        fields.setdefault("model_id", MODEL)
        return self.call("Handshake", pb2.HandshakeRequest(**fields))[0]

    def lookup(self, hashes: list[str], **fields: object) -> grpc.StatusCode:
        code, resp = self.call("Lookup", pb2.LookupRequest(model_id=MODEL, consumer_id="hostile", mm_hashes=hashes,
                                                           **fields))
        if code != OK:
            return code
        codes = set()
        for result in resp.results:  # type: ignore[attr-defined]
            if result.WhichOneof("outcome") == "location":
                self.stub.Release(pb2.ReleaseRequest(consumer_id="hostile", lease_ids=[result.location.lease_id]),
                                  timeout=10)
                codes.add(OK)
            else:
                codes.add(_CODES[result.error.code])
        assert len(codes) == 1, codes
        return codes.pop()


def others_leases(api: Api) -> grpc.StatusCode:
    """Another client's lease ids cannot be released by anyone but it."""
    code, resp = api.call("Encode", pb2.EncodeRequest(model_id=MODEL, consumer_id="victim",
                                                      items=[pb2.MediaItem(image=GOOD)]))
    assert code == OK
    lease = resp.results[0].location.lease_id  # type: ignore[attr-defined]
    guesses = [lease, lease - 1, lease + 1, 1, 2, 3]
    for thief in ("attacker", ""):
        stolen = api.stub.Release(pb2.ReleaseRequest(consumer_id=thief, lease_ids=guesses), timeout=10)
        assert stolen.released == 0
    assert occupancy(api.shared.enc)[3] == api.shared.baseline[3] + 1  # still live
    assert api.stub.Release(pb2.ReleaseRequest(consumer_id="victim", lease_ids=[lease]), timeout=10).released == 1
    return OK


def unknown_lease_ids(api: Api) -> grpc.StatusCode:
    resp = api.stub.Release(pb2.ReleaseRequest(consumer_id="hostile", lease_ids=[0, 1, 2**63, 2**64 - 1]),
                            timeout=10)
    assert resp.released == 0
    return OK


@dataclass(frozen=True)
class Case:
    name: str
    send: Callable[[Api], grpc.StatusCode]
    expect: grpc.StatusCode
    caches: bool = False  # a valid item: it stays cached (occupancy grows, leases do not)


CASES = [
    # Media that cannot be decoded, or is outside the limits: the item fails, the request stands.
    Case("zero-byte image", lambda a: a.image(b""), INVALID),
    Case("non-image bytes", lambda a: a.image(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"), INVALID),
    Case("truncated png", lambda a: a.image(image_bytes(96, 96, seed=1)[:300]), INVALID),
    Case("truncated jpeg", lambda a: a.image(image_bytes(96, 96, seed=2, fmt="JPEG")[:300]), INVALID),
    Case("png signature only", lambda a: a.image(b"\x89PNG\r\n\x1a\n"), INVALID),
    Case("random bytes", lambda a: a.image(np.random.default_rng(3).bytes(2048)), INVALID),
    Case("format not accepted (bmp)", lambda a: a.image(encoded(Image.new("RGB", (64, 64)), "BMP")), INVALID),
    Case("100000x1 image", lambda a: a.image(encoded(Image.new("L", (100_000, 1)), "PNG")), INVALID),
    Case("decompression bomb", lambda a: a.image(png_bomb()), INVALID),
    Case("video over the frame limit", lambda a: a.video(video_frames(32, 32, MAX_VIDEO_FRAMES + 1)), INVALID),
    Case("video without frames", lambda a: a.video([]), INVALID),
    Case("video frames of two sizes", lambda a: a.video(video_frames(64, 64, 1) + video_frames(32, 32, 1)), INVALID),
    Case("video with a bad frame", lambda a: a.video(video_frames(64, 64, 1) + [b"junk"]), INVALID),
    Case("video fps infinite", lambda a: a.video(video_frames(64, 64, 2, seed=4), fps=math.inf), INVALID),
    # Request-level refusals.
    Case("item with neither image nor video", lambda a: a.encode(items=[pb2.MediaItem(uuid="x")]), INVALID),
    Case("no items", lambda a: a.encode(items=[]), INVALID),
    Case("too many items", lambda a: a.encode(items=[pb2.MediaItem(image=GOOD)] * (MAX_ITEMS + 1)), EXHAUSTED),
    Case("oversized message", lambda a: a.image(b"\x89PNG" + b"\x00" * (MAX_MESSAGE_BYTES + 1024)), EXHAUSTED),
    Case("malformed protobuf (Encode)", lambda a: a.raw("Encode", b"\x1a\xff\xff\xff\xff\x0f"), INVALID),
    Case("malformed protobuf (Handshake)", lambda a: a.raw("Handshake", b"\xff\xff\xff"), INVALID),
    Case("invalid utf-8 in a string field", lambda a: a.raw("Lookup", b"\x12\x02\xff\xfe"), INVALID),
    Case("consumer id too long", lambda a: a.encode(consumer_id="c" * 1000, items=[pb2.MediaItem(image=GOOD)]),
         INVALID),
    Case("uuid too long", lambda a: a.encode(items=[pb2.MediaItem(image=GOOD, uuid="u" * 1000)]), INVALID),
    Case("cache salt too long", lambda a: a.encode(items=[pb2.MediaItem(image=GOOD, cache_salt="s" * 257)]),
         INVALID),
    Case("unknown lookups", lambda a: a.lookup(["0" * 32, "f" * 32]), NOT_FOUND),
    Case("lookup of a malformed hash", lambda a: a.lookup(["../../etc/passwd"]), INVALID),
    Case("too many lookups", lambda a: a.lookup(["0" * 32] * 1025), EXHAUSTED),
    Case("wrong model id (Encode)", lambda a: a.encode(model_id="other-model", items=[pb2.MediaItem(image=GOOD)]),
         PRECONDITION),
    Case("wrong model id (Handshake)", lambda a: a.handshake(model_id="other-model"), PRECONDITION),
    Case("wrong protocol version", lambda a: a.handshake(protocol_version=PROTOCOL_VERSION + 1), PRECONDITION),
    Case("protocol version 2**32-1", lambda a: a.handshake(protocol_version=2**32 - 1), PRECONDITION),
    Case("layout fields out of range", lambda a: a.handshake(
        expected_layout=pb2.CacheLayout(block_size=2**32 - 1, fat_dim=2**32 - 1)), PRECONDITION),
    Case("stale incarnation id", lambda a: a.encode(incarnation_id="f" * 32, items=[pb2.MediaItem(image=GOOD)]),
         PRECONDITION),
    Case("too many lease ids", lambda a: a.call("Release", pb2.ReleaseRequest(lease_ids=[1] * 4097))[0], EXHAUSTED),
    Case("unknown and out-of-range lease ids", unknown_lease_ids, OK),
    Case("lease ids of another client", others_leases, OK, caches=True),
    # Odd but valid media: documented to be accepted (first frame, converted to RGB, resized).
    Case("1x1 image", lambda a: a.image(encoded(Image.new("RGB", (1, 1), (9, 9, 9)), "PNG")), OK, caches=True),
    Case("cmyk jpeg", lambda a: a.image(cmyk_jpeg()), OK, caches=True),
    Case("16-bit grayscale png", lambda a: a.image(sixteen_bit_png()), OK, caches=True),
    Case("animated gif", lambda a: a.image(animated_gif()), OK, caches=True),
    Case("video fps NaN (no sampling)", lambda a: a.video(video_frames(64, 64, 2, seed=5), fps=math.nan), OK,
         caches=True),
]


def test_the_corpus_is_large_enough() -> None:
    assert len(CASES) >= 25 and len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hostile_input_gets_its_documented_status(shared_encoder: SharedEncoder, case: Case) -> None:
    api = Api(shared_encoder)
    before = occupancy(shared_encoder.enc)
    status = case.send(api)
    assert status not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
    assert status == case.expect, f"{case.name}: {status}"
    assert health(shared_encoder.enc.target) == SERVING
    shared_encoder.leases_back()
    if case.caches:
        active, free, held, _ = occupancy(shared_encoder.enc)
        assert active + free + held == before[0] + before[1] + before[2]
    else:  # refused input allocates nothing and leaves nothing held
        wait_until(lambda: occupancy(shared_encoder.enc) == before, 5.0, f"{case.name}: occupancy unchanged")
    assert shared_encoder.canary_unchanged()
    assert shared_encoder.enc.proc.poll() is None


def test_forged_release_notifications_are_ignored(shared_encoder: SharedEncoder) -> None:
    """A peer holding the agent metadata sends garbage and guessed releases over NIXL: nothing changes."""
    from common.transport import encode_release_notification

    api = Api(shared_encoder)
    code, resp = api.call("Encode", pb2.EncodeRequest(model_id=MODEL, consumer_id="victim",
                                                      items=[pb2.MediaItem(image=GOOD)]))
    assert code == OK
    lease = resp.results[0].location.lease_id  # type: ignore[attr-defined]
    hs = shared_encoder.stub.Handshake(pb2.HandshakeRequest(protocol_version=PROTOCOL_VERSION, model_id=MODEL),
                                       timeout=10)
    forger = ConsumerTransport(shared_encoder.enc.transport, num_landing_blocks=1, name_prefix="forger")
    try:
        peer = forger.connect(hs, endpoint="victim-encoder")
        guesses = [lease ^ (1 << bit) for bit in range(63)] + list(range(1, 1000))
        for message in (b"", b"EPDR", b"\xff" * 64, encode_release_notification(guesses)):
            forger.agent.send_notif(peer.agent_name, message)

        def delivered() -> bool:
            forger.agent.get_new_notifs()  # progress our agent: NIXL sends notifications as it progresses
            return shared_encoder.enc.log().count("malformed notification") >= 3

        wait_until(delivered, 5.0, "the forged notifications reached the encoder")
        assert occupancy(shared_encoder.enc)[3] == shared_encoder.baseline[3] + 1  # the victim's lease lives
        assert health(shared_encoder.enc.target) == SERVING
    finally:
        forger.close()
    assert shared_encoder.stub.Release(pb2.ReleaseRequest(consumer_id="victim", lease_ids=[lease]),
                                       timeout=10).released == 1
    shared_encoder.leases_back()


# --- generated requests ----------------------------------------------------------------------------

VALID_IMAGES = [image_bytes(64, 64, seed=s) for s in range(3)]
uint32 = st.integers(0, 2**32 - 1)
names = st.one_of(st.just(MODEL), st.text(max_size=40))
labels = st.text(max_size=300)
image_data = st.one_of(st.sampled_from(VALID_IMAGES), st.binary(max_size=2048),
                       st.sampled_from(VALID_IMAGES).map(lambda b: b[: len(b) // 2]))
fps = st.one_of(st.just(0.0), st.floats(allow_nan=True, allow_infinity=True, width=32))
media_items = st.one_of(
    st.builds(lambda d, u, s: pb2.MediaItem(image=d, uuid=u, cache_salt=s), image_data, labels,
              st.one_of(st.just(""), labels)),
    st.builds(lambda fr, f, u: pb2.MediaItem(video=pb2.VideoFrames(frames=fr, fps=f), uuid=u),
              st.lists(image_data, max_size=MAX_VIDEO_FRAMES + 2), fps, labels),
    st.builds(lambda u: pb2.MediaItem(uuid=u), labels),
)
requests = st.one_of(
    st.builds(lambda m, c, items, inc: ("Encode", pb2.EncodeRequest(model_id=m, consumer_id=c, items=items,
                                                                     incarnation_id=inc)),
              names, labels, st.lists(media_items, max_size=MAX_ITEMS + 2), st.sampled_from(["", "x" * 32])),
    st.builds(lambda m, c, h: ("Lookup", pb2.LookupRequest(model_id=m, consumer_id=c, mm_hashes=h)),
              names, labels, st.lists(st.one_of(st.text(max_size=40), st.from_regex(r"\A[0-9a-f]{32}\Z")),
                                      max_size=8)),
    st.builds(lambda c, ids: ("Release", pb2.ReleaseRequest(consumer_id=c, lease_ids=ids)),
              labels, st.lists(st.integers(0, 2**64 - 1), max_size=16)),
    st.builds(lambda v, m, bs, fd, dt: ("Handshake", pb2.HandshakeRequest(
        protocol_version=v, model_id=m, expected_layout=pb2.CacheLayout(block_size=bs, fat_dim=fd, dtype=dt))),
        st.one_of(st.just(PROTOCOL_VERSION), uint32), names, uint32, uint32, st.integers(0, 3)),
    st.builds(lambda method, payload: (method, payload),
              st.sampled_from(["Encode", "Lookup", "Release", "Handshake"]), st.binary(max_size=512)),
)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(request=requests)
def test_generated_requests_get_documented_statuses(shared_encoder: SharedEncoder, request: tuple[str, object]
                                                    ) -> None:
    api = Api(shared_encoder)
    method, message = request
    if isinstance(message, bytes):
        code = api.raw(method, message)
    else:
        code, resp = api.call(method, message)
        if code == OK and method in ("Encode", "Lookup"):
            for result in resp.results:  # type: ignore[attr-defined]
                if result.WhichOneof("outcome") == "location":
                    shared_encoder.stub.Release(pb2.ReleaseRequest(
                        consumer_id=message.consumer_id, lease_ids=[result.location.lease_id]),  # type: ignore
                        timeout=10)
                else:
                    assert _CODES[result.error.code] in DOCUMENTED, result.error
    assert code in DOCUMENTED, f"{method}: {code}"
    assert health(shared_encoder.enc.target) == SERVING


def test_after_all_of_it_the_canary_pulls_correctly(shared_encoder: SharedEncoder) -> None:
    shared_encoder.leases_back()
    assert shared_encoder.canary_unchanged()
    with EncoderCacheClient(shared_encoder.enc.target, MODEL, transport_kind=shared_encoder.enc.transport) as client:
        pulled = client.lookup([shared_encoder.canary.mm_hash])[0]
        assert pulled is not None and pulled.source == "hit"
        assert matches(pulled.embeddings, Reference().image(shared_encoder.canary_image))
