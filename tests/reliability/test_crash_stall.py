"""Crash and stall: a killed encoder, a frozen encoder, and a killed prefill worker holding leases.

One flow per transport, against real ``epd encoder`` processes:

1. kill -9 the encoder while a block READ is in flight: the pull fails with
   ``ECLoadFailure(disconnect)`` long before its deadline; the client then
   re-handshakes with the encoder restarted on the same port and pulls
   correct rows;
2. SIGSTOP that encoder while a READ is in flight: ``ECLoadFailure(timeout)``
   at its deadline; after SIGCONT the late data lands in the quarantined
   landing block and nowhere else, and later requests read correct rows;
3. kill -9 a prefill worker that holds leases pinning every block: new items
   are refused while they live, then the leases expire and the blocks serve
   new items again.

The encoders run with ``UCX_TLS=tcp,self``: with cross-memory-attach a READ
copies from a stopped process, so freezing it would not stall anything.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from common import metrics
from common.errors import ECLoadFailure, LoadFailureReason
from common.wire import pb2, pb2_grpc
from epd_harness.media import image_bytes
from epd_harness.ports import free_port
from epd_harness.procs import EncoderProcess
from prefill_client.consumer.client import EncoderCacheClient
from prefill_client.consumer.connection import MediaSpec
from tests.reliability.support import (
    MODEL,
    SERVING,
    freeze,
    health,
    process_state,
    scrape,
    start_encoder_soon,
    thaw,
    wait_until,
)
from tests.support.reference import Reference, matches
from tests.transport_params import TRANSPORTS

REPO_ROOT = Path(__file__).resolve().parents[2]
REF = Reference()
KILL_PULL_TIMEOUT_S = 5.0
STALL_PULL_TIMEOUT_S = 0.5
LEASE_TTL_MS = 1500
USABLE_BLOCKS = 5  # --cache-blocks 6; each 64x64 image is one block of 64 rows
SENTINEL = -7.0  # what the landing blocks hold before the stalled pull


def image(seed: int) -> bytes:
    return image_bytes(64, 64, seed=seed)


def frozen_after_the_rpc(client: EncoderCacheClient, enc: EncoderProcess) -> None:
    """Make the client's next Encode freeze the encoder as soon as its locations arrive: the READ then stalls."""
    conn = client.connection(client.targets[0])
    original = conn.encode

    def encode_then_freeze(items):  # type: ignore[no-untyped-def]
        conn.encode = original  # type: ignore[method-assign]
        locations = original(items)
        freeze(enc.proc.pid)
        return locations

    conn.encode = encode_then_freeze  # type: ignore[method-assign]


def encode_in_thread(client: EncoderCacheClient, data: bytes) -> tuple[threading.Thread, dict[str, object]]:
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["pulled"] = client.encode([MediaSpec.image(data)])
        except Exception as exc:
            out["error"] = exc
        out["at"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def start_lease_holder(transport: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.reliability.lease_holder", "--transport", transport,
         "--images", str(USABLE_BLOCKS)],
        cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=os.environ.copy())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_crash_stall_and_dead_lease_holder(tmp_path: Path, transport: str) -> None:
    port = free_port()
    env = {"UCX_TLS": "tcp,self"} if transport == "nixl" else {}
    args = ("--transport", transport, "--cache-blocks", str(USABLE_BLOCKS + 1), "--block-size", "64",
            "--port", str(port), "--lease-ttl-ms", str(LEASE_TTL_MS))
    first = start_encoder_soon(tmp_path, *args, env=env, name="first")
    holder = start_lease_holder(transport)  # imports in parallel with the encoder start-up
    encoders: list[EncoderProcess] = []
    client = EncoderCacheClient(f"127.0.0.1:{port}", MODEL, transport_kind=transport,
                                pull_timeout_s=KILL_PULL_TIMEOUT_S, rpc_timeout_s=10.0)
    try:
        enc = first.result()
        encoders.append(enc)
        assert matches(client.encode([MediaSpec.image(image(1))])[0].embeddings, REF.image(image(1)))

        # --- 1. kill -9 mid-pull ------------------------------------------------------------------
        frozen_after_the_rpc(client, enc)
        thread, out = encode_in_thread(client, image(2))
        wait_until(lambda: process_state(enc.proc.pid) in ("T", "t"), 10.0, "encoder frozen after Encode")
        time.sleep(0.2)  # the block READ is posted and stuck
        assert "at" not in out, "the pull finished against a frozen encoder"
        # A killed process stays readable (shared memory, CMA) for the milliseconds its exit
        # takes; the mock agent would complete a READ in that window. Hold the consumer's
        # agent lock until the kernel has reaped it, so the READ meets a dead peer.
        with client.transport._lock:
            killed_at = time.monotonic()
            enc.kill()
        second = start_encoder_soon(tmp_path, *args, env=env, name="second")
        thread.join(KILL_PULL_TIMEOUT_S + 5)
        assert not thread.is_alive(), "the pull hung on a dead encoder"
        error = out.get("error")
        assert isinstance(error, ECLoadFailure), out
        assert error.reason is LoadFailureReason.DISCONNECT
        assert float(out["at"]) - killed_at < KILL_PULL_TIMEOUT_S  # detected, not timed out
        assert client.metrics.load_failures.labels(reason="disconnect")._value.get() == 1

        enc = second.result()
        encoders.append(enc)
        got = client.encode([MediaSpec.image(image(3))])[0]
        assert matches(got.embeddings, REF.image(image(3)))
        assert client.connection(client.targets[0]).incarnation_id == enc.incarnation_id

        # --- 2. SIGSTOP mid-pull, then SIGCONT ---------------------------------------------------
        client.pull_timeout_s = STALL_PULL_TIMEOUT_S
        landing = client.transport.landing
        landing.tensor.fill_(SENTINEL)
        frozen_after_the_rpc(client, enc)
        started = time.monotonic()
        try:
            with pytest.raises(ECLoadFailure) as info:
                client.encode([MediaSpec.image(image(4))])
            elapsed = time.monotonic() - started
            assert info.value.reason is LoadFailureReason.TIMEOUT
            assert elapsed < STALL_PULL_TIMEOUT_S + 3.0, "the timeout was not ours"
            quarantined = landing.quarantined_ids().tolist()
            assert len(quarantined) == 1
            assert bool((landing.tensor == SENTINEL).all()), "data landed while the encoder was frozen"
        finally:
            thaw(enc.proc.pid)
        wait_until(lambda: client.transport.sweep_quarantine() >= 0 and landing.num_quarantined == 0,
                   10.0, "quarantine lifted after SIGCONT")
        late = landing.tensor[quarantined[0]]
        assert matches(late, REF.image(image(4))), "the late data did not land in the quarantined block"
        others = [b for b in range(landing.num_blocks) if b != quarantined[0]]
        assert bool((landing.tensor[others] == SENTINEL).all()), "late data landed outside the quarantine"
        client.pull_timeout_s = KILL_PULL_TIMEOUT_S
        for seed in (5, 6, 4):
            got = client.encode([MediaSpec.image(image(seed))])[0]
            assert matches(got.embeddings, REF.image(image(seed))), seed

        # --- 3. a prefill worker killed while its leases pin every block -------------------------
        assert holder.stdin is not None and holder.stdout is not None
        holder.stdin.write(f"go {enc.target}\n")
        holder.stdin.flush()
        held = holder.stdout.readline()
        assert held.startswith("EPD HELD "), held + (holder.stderr.read() if holder.poll() is not None else "")
        assert len(held.split()[2].split(",")) == USABLE_BLOCKS
        stub = pb2_grpc.EncoderCacheServiceStub(grpc.insecure_channel(enc.target))

        def encode_new() -> pb2.ItemLocation:
            resp = stub.Encode(pb2.EncodeRequest(model_id=MODEL, consumer_id="probe",
                                                 items=[pb2.MediaItem(image=image(77))]), timeout=10)
            return resp.results[0].location

        with pytest.raises(grpc.RpcError) as refused:
            encode_new()
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        expired_before = scrape(enc).get(metrics.EPD_LEASES_EXPIRED + "_total", 0.0)
        holder.kill()
        holder.wait(10)

        def admitted() -> bool:
            try:
                loc = encode_new()
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                return False
            stub.Release(pb2.ReleaseRequest(consumer_id="probe", lease_ids=[loc.lease_id]), timeout=10)
            return True

        wait_until(admitted, LEASE_TTL_MS / 1000 + 10.0, "blocks back after the holder died", 0.1)
        # Expired, not released: the metric counts them (it is refreshed by housekeeping).
        wait_until(lambda: scrape(enc)[metrics.EPD_LEASES_EXPIRED + "_total"] - expired_before >= USABLE_BLOCKS,
                   5.0, "the holder's leases counted as expired")
        assert health(enc.target) == SERVING
    finally:
        client.close()
        if holder.poll() is None:
            holder.kill()
            holder.wait(10)
        for stream in (holder.stdin, holder.stdout, holder.stderr):
            if stream is not None:
                stream.close()
        for e in encoders:
            if e.proc.poll() is None:
                thaw(e.proc.pid)
            e.kill()

