"""Overload: more concurrent clients than one encoder can serve; every request ends, on time, with an answer.

Sixteen clients each send two Encode requests of two items (three blocks
each) drawn from sixteen images, against an encoder with one graph thread
and eight usable blocks: at most one request fits at a time. Each request
either returns rows equal to the local reference or raises a typed error
with a clear status (cache full, timeout, deadline), and does so within the
client's own bound on one call. None is lost, none hangs,
and afterwards the encoder is SERVING, every lease is gone and a new request
is served correctly.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from pathlib import Path

from common.transport import ConsumerTransport
from epd_harness.media import image_bytes
from epd_harness.procs import start_encoder
from prefill_client.consumer.client import EncoderCacheClient
from prefill_client.consumer.connection import MediaSpec
from tests.reliability.conftest import SHARED_TRANSPORT
from tests.reliability.support import MODEL, SERVING, health, occupancy, wait_until
from tests.support.outcomes import classify, untyped
from tests.support.reference import Reference, matches

CLIENTS = 16
REQUESTS_PER_CLIENT = 2
RPC_TIMEOUT_S = 1.5
PULL_TIMEOUT_S = 1.0
# One call may wait out cache-full hints for one RPC timeout, then make its RPC, then two READs.
CALL_BOUND_S = 2 * RPC_TIMEOUT_S + 2 * PULL_TIMEOUT_S
SLACK_S = 3.0  # scheduling on a loaded two-core machine
LEASE_TTL_MS = 3000
# 384x384: 144 tokens, three blocks each; one request of two needs six of the eight usable blocks.
IMAGES = [image_bytes(384, 384, seed=700 + i) for i in range(16)]


def test_more_clients_than_the_encoder_can_serve(tmp_path: Path) -> None:
    enc = start_encoder(tmp_path, "--transport", SHARED_TRANSPORT, "--cache-blocks", "9", "--block-size", "64",
                        "--lease-ttl-ms", str(LEASE_TTL_MS))
    ref = Reference()
    refs = [ref.image(img) for img in IMAGES]
    transport = ConsumerTransport(SHARED_TRANSPORT, num_landing_blocks=64)
    outcomes: Counter[str] = Counter()
    wrong, late, errors = [], [], []
    lock = threading.Lock()
    start = threading.Barrier(CLIENTS)

    def client_loop(seed: int) -> None:
        rng = random.Random(seed)
        try:
            with EncoderCacheClient(enc.target, MODEL, transport=transport, rpc_timeout_s=RPC_TIMEOUT_S,
                                    pull_timeout_s=PULL_TIMEOUT_S, local_cache_blocks=1) as client:
                client.media_params()  # handshake first: the bound below is for Encode + pull
                start.wait(30)
                for _ in range(REQUESTS_PER_CLIENT):
                    picks = rng.sample(range(len(IMAGES)), 2)
                    began = time.monotonic()
                    try:
                        pulled = client.encode([MediaSpec.image(IMAGES[i]) for i in picks])
                        outcome = "ok"
                        bad = [i for i, p in zip(picks, pulled) if not matches(p.embeddings, refs[i])]
                    except Exception as exc:
                        outcome, bad = classify(exc), []
                    took = time.monotonic() - began
                    with lock:
                        outcomes[outcome] += 1
                        wrong.extend(bad)
                        if took > CALL_BOUND_S + SLACK_S:
                            late.append((outcome, round(took, 2)))
        except BaseException as exc:
            with lock:
                errors.append(exc)

    try:
        threads = [threading.Thread(target=client_loop, args=(seed,), daemon=True) for seed in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(REQUESTS_PER_CLIENT * (CALL_BOUND_S + SLACK_S) + 60)
        assert not any(t.is_alive() for t in threads), "a client hung"
        assert not errors, errors
        assert sum(outcomes.values()) == CLIENTS * REQUESTS_PER_CLIENT, outcomes  # nothing dropped
        assert untyped(outcomes) == {}, f"untyped failures under load: {untyped(outcomes)}"
        assert wrong == [], "a delivered embedding differs from its reference"
        assert late == [], f"calls past their bound of {CALL_BOUND_S} s: {late}"
        assert outcomes["ok"] > 0, outcomes
        assert set(outcomes) - {"ok"}, f"the encoder was never overloaded: {outcomes}"
        # Afterwards: serving, no lease left behind, and a new request is served correctly.
        assert health(enc.target) == SERVING
        wait_until(lambda: occupancy(enc)[3] == 0, LEASE_TTL_MS / 1000 + 5.0, "every lease released or expired")
        active, free, held, _ = occupancy(enc)
        assert active + free + held == 8
        fresh = image_bytes(64, 64, seed=799)
        with EncoderCacheClient(enc.target, MODEL, transport=transport) as client:
            assert matches(client.encode([MediaSpec.image(fresh)])[0].embeddings, ref.image(fresh))
        assert "Traceback" not in enc.log(), enc.log()[-4000:]
    finally:
        transport.close()
        assert enc.terminate() == 0, enc.log()[-4000:]
