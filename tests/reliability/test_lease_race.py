"""Leases that expire, or callers that leave, mid-request never yield a wrong embedding or a stuck lease.

Through the public API only: real ``epd encoder`` processes, real NIXL where
installed, several client processes (:mod:`tests.reliability.lease_race_client`)
calling :meth:`EncoderCacheClient.encode` on random pairs of 24 images.

* **Race**: a cache only a few blocks larger than one request, no minimum
  hold, and leases of 1 ms, 20 ms and the default. Items are evicted and
  re-allocated under the same ``mm_hash`` while requests wait for their
  misses. Every delivered embedding is compared with what a second encoder
  (same weights, a large cache) delivered for the same image: over 10,000
  deliveries in all, none may differ, and no call may end ``INTERNAL`` /
  ``UNKNOWN`` or in an untyped error. ``ECLoadFailure`` and typed per-item
  errors are allowed: they are the loud outcomes.
* **Callers that leave**: the defaults (100 ms hold, 30 s leases) and
  clients whose RPC deadlines (30, 100, 300 ms) are shorter than many of
  their encodes. Once they stop, no lease stays active (read from
  ``/metrics`` long before any lease could have expired), and the encoder
  still serves a correct embedding. An answer can reach a caller after its
  deadline passed (the encoder's clock runs behind by the request's way
  there): the caller then gives the call up by its ``call_id``, and this
  test failed on a loaded box before it did.
"""

from __future__ import annotations

import math
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from epd_harness.media import image_bytes
from epd_harness.procs import EncoderProcess
from prefill_client.consumer.client import EncoderCacheClient
from prefill_client.consumer.connection import MediaSpec
from tests.reliability.conftest import SHARED_TRANSPORT
from tests.reliability.support import MODEL, SERVING, health, occupancy, start_encoder_soon, wait_until
from tests.support.json_lines import last_json_object
from tests.support.outcomes import untyped
from tests.support.reference import matches

REPO_ROOT = Path(__file__).resolve().parents[2]
CLIENTS = 3
DELIVERIES_PER_SETTING = 3_400  # three settings: over 10,000 in all
SECONDS_PER_SETTING = 150.0  # a bound, not the expected time
# Sides from 64 to 320 px: one or two 64-row blocks each; a request of two needs at most four.
SIZES = [(64, 64), (96, 128), (128, 96), (160, 160), (256, 256), (200, 320), (320, 200), (320, 320)]
IMAGES = [image_bytes(*SIZES[i % len(SIZES)], seed=9000 + i) for i in range(24)]
RACE_CACHE = ("--cache-blocks", "7", "--block-size", "64", "--min-hold-ms", "0")


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every image's embedding as a second encoder with a large cache delivers it, saved for the clients."""
    tmp = tmp_path_factory.mktemp("lease-race-ref")
    enc = start_encoder_soon(tmp, "--transport", SHARED_TRANSPORT, name="reference").result()
    try:
        with EncoderCacheClient(enc.target, MODEL, transport_kind=SHARED_TRANSPORT) as client:
            refs = [p.embeddings.clone() for j in range(0, len(IMAGES), 8)
                    for p in client.encode([MediaSpec.image(b) for b in IMAGES[j:j + 8]])]
    finally:
        assert enc.terminate() == 0, enc.log()[-4000:]
    path = tmp / "media.pt"
    torch.save({"images": IMAGES, "refs": refs}, path)
    return path


def run_clients(enc: EncoderProcess, media: Path, *, seconds: float, max_delivered: int,
                rpc_timeouts: list[float] | None = None, local_cache_blocks: int = 0) -> list[dict]:
    """Start the client processes together; each runs until its count or time is reached."""
    procs = []
    for k in range(CLIENTS):
        cmd = [sys.executable, "-m", "tests.reliability.lease_race_client", "--encoder", enc.target,
               "--transport", SHARED_TRANSPORT, "--media", str(media), "--seed", str(k),
               "--seconds", str(seconds), "--max-delivered", str(max_delivered),
               "--local-cache-blocks", str(local_cache_blocks)]
        if rpc_timeouts is not None:
            cmd += ["--rpc-timeout-s", str(rpc_timeouts[k])]
        procs.append(subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    reports = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=seconds + 120)
            assert proc.returncode == 0, err[-4000:]
            reports.append(last_json_object(out))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    return reports


def summarize(reports: list[dict]) -> tuple[int, list[dict], Counter[str], Counter[str]]:
    outcomes: Counter[str] = Counter()
    sources: Counter[str] = Counter()
    wrong: list[dict] = []
    for r in reports:
        outcomes.update(r["outcomes"])
        sources.update(r["sources"])
        wrong += r["wrong"]
    return sum(r["delivered"] for r in reports), wrong, outcomes, sources


@pytest.mark.slow
@pytest.mark.parametrize("lease_ttl_ms", [1, 20, None], ids=["lease-1ms", "lease-20ms", "lease-default"])
def test_no_wrong_embedding_when_leases_expire_mid_request(
        tmp_path: Path, references: Path, lease_ttl_ms: int | None) -> None:
    ttl = () if lease_ttl_ms is None else ("--lease-ttl-ms", str(lease_ttl_ms))
    enc = start_encoder_soon(tmp_path, "--transport", SHARED_TRANSPORT, *RACE_CACHE, *ttl).result()
    try:
        reports = run_clients(enc, references, seconds=SECONDS_PER_SETTING,
                              max_delivered=math.ceil(DELIVERIES_PER_SETTING / CLIENTS))
        delivered, wrong, outcomes, sources = summarize(reports)
        print(f"lease ttl {lease_ttl_ms}: delivered {delivered} {dict(sources)}, outcomes {dict(outcomes)}")
        assert wrong == [], f"wrong embeddings delivered: {wrong[:10]}"
        assert untyped(outcomes) == {}, f"untyped failures: {untyped(outcomes)}"
        assert delivered >= DELIVERIES_PER_SETTING, f"only {delivered} deliveries: {dict(outcomes)}"
        assert sources["hit"] > 0 and sources["miss"] > 0, sources  # both paths raced
        assert health(enc.target) == SERVING
        assert "Traceback" not in enc.log(), enc.log()[-4000:]
    finally:
        assert enc.terminate() == 0, enc.log()[-4000:]


@pytest.mark.slow
def test_callers_that_leave_leave_no_lease(tmp_path: Path, references: Path) -> None:
    # Defaults for hold and leases; a cache of 32 usable blocks, so clients also meet "cache full".
    enc = start_encoder_soon(tmp_path, "--transport", SHARED_TRANSPORT, "--cache-blocks", "33",
                             "--block-size", "64").result()
    try:
        # With their local caches on, clients also give back the leases of items they already
        # hold by a Release RPC: one that fails pins the item for the whole lease ttl.
        reports = run_clients(enc, references, seconds=10.0, max_delivered=10**9,
                              rpc_timeouts=[0.03, 0.1, 0.3], local_cache_blocks=8)
        delivered, wrong, outcomes, _ = summarize(reports)
        print(f"short deadlines: delivered {delivered}, outcomes {dict(outcomes)}")
        assert wrong == [], f"wrong embeddings delivered: {wrong[:10]}"
        assert untyped(outcomes) == {}, outcomes
        assert outcomes["ec_load_failure:timeout"] > 0, f"no caller ever gave up: {dict(outcomes)}"
        # Leases default to 30 s: any lease pinned by an answer nobody read would still be active.
        wait_until(lambda: occupancy(enc)[3] == 0, 2.0, "no lease active once the clients stopped")
        assert health(enc.target) == SERVING
        refs = torch.load(references)["refs"]
        with EncoderCacheClient(enc.target, MODEL, transport_kind=SHARED_TRANSPORT) as client:
            pulled = client.encode([MediaSpec.image(IMAGES[i]) for i in range(4)])
        assert all(matches(p.embeddings, refs[i]) for i, p in enumerate(pulled))
        assert "Traceback" not in enc.log(), enc.log()[-4000:]
    finally:
        assert enc.terminate() == 0, enc.log()[-4000:]
