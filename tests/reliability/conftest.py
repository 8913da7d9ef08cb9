"""Fixtures of the reliability suite: one shared encoder for the input and security checks."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest

from common.transport import sweep_stale_segments
from common.wire import pb2, pb2_grpc
from epd_harness.media import image_bytes
from epd_harness.procs import EncoderProcess, start_encoder
from tests.reliability.support import MODEL, occupancy, wait_until
from tests.transport_params import NIXL_OK

# Real NIXL where it is installed: hostile peers meet the production data path.
SHARED_TRANSPORT = "nixl" if NIXL_OK else "mock"

# Small limits keep the hostile payloads small; the README lists the flags.
MAX_ITEMS = 8
MAX_VIDEO_FRAMES = 8
MAX_MESSAGE_BYTES = 4 << 20
CACHE_BLOCKS = 33  # 32 usable


@dataclass
class SharedEncoder:
    """An encoder with one item cached before any hostile input arrives (the canary)."""

    enc: EncoderProcess
    stub: pb2_grpc.EncoderCacheServiceStub
    channel: grpc.Channel
    canary_image: bytes
    canary: pb2.ItemLocation  # its location when it was cached
    baseline: tuple[int, int, int, int]  # (active, free, held, leases) with the canary cached, unleased

    def canary_unchanged(self) -> bool:
        """The canary is still cached at the same blocks under the same generation (so never rewritten)."""
        found = self.stub.Lookup(pb2.LookupRequest(model_id=MODEL, consumer_id="canary",
                                                   mm_hashes=[self.canary.mm_hash]), timeout=10).results[0]
        if found.WhichOneof("outcome") != "location":
            return False
        loc = found.location
        self.stub.Release(pb2.ReleaseRequest(consumer_id="canary", lease_ids=[loc.lease_id]), timeout=10)
        return (list(loc.block_ids), loc.generation) == (list(self.canary.block_ids), self.canary.generation)

    def leases_back(self) -> None:
        wait_until(lambda: occupancy(self.enc)[3] == self.baseline[3], 5.0, "leases back to the baseline")


@pytest.fixture(scope="package")
def shared_encoder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedEncoder]:
    enc = start_encoder(
        tmp_path_factory.mktemp("shared-encoder"), "--transport", SHARED_TRANSPORT, "--cache-blocks", str(CACHE_BLOCKS),
        "--block-size", "64", "--max-items", str(MAX_ITEMS), "--max-video-frames", str(MAX_VIDEO_FRAMES),
        "--max-message-bytes", str(MAX_MESSAGE_BYTES))
    channel = grpc.insecure_channel(enc.target, options=[("grpc.max_send_message_length", 64 << 20)])
    try:
        stub = pb2_grpc.EncoderCacheServiceStub(channel)
        canary_image = image_bytes(64, 64, seed=4242)
        canary = stub.Encode(pb2.EncodeRequest(model_id=MODEL, consumer_id="canary",
                                               items=[pb2.MediaItem(image=canary_image)]), timeout=60).results[0]
        loc = canary.location
        stub.Release(pb2.ReleaseRequest(consumer_id="canary", lease_ids=[loc.lease_id]), timeout=10)
        wait_until(lambda: occupancy(enc)[3] == 0, 5.0, "canary lease released")
        yield SharedEncoder(enc, stub, channel, canary_image, loc, occupancy(enc))
    finally:
        channel.close()
        assert enc.terminate() == 0, enc.log()
        sweep_stale_segments()
