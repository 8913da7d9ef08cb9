"""Reuse race: 10,000+ verified pulls while a producer re-allocates the blocks under them.

The producer (:mod:`tests.reliability.race_producer`, its own process) evicts
and re-allocates blocks as fast as it can, to other items and to the same
item again (ABA). Several consumers, each with its own agent, pull item
locations from its directory -- often already stale, as a consumer whose lease
expired would hold -- and run the client's protocol: block READ, then tag
READ, then :func:`prefill_client.consumer.client.verify_item`. With the mock agent a
hook adds delays between the two READs; with real NIXL nothing is injected.

Besides the client's verdict, every pull is judged independently: the landed
rows against the item's reference, and the tags against the location. The
test asserts that wrong rows really landed (the race happened), that both
mismatch kinds were seen, that every mismatch became an ``ECLoadFailure``
with its reason, and that no delivered embedding differs from its reference.
"""

from __future__ import annotations

import collections
import os
import queue
import random
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

from common.errors import ECLoadFailure, LoadFailureReason
from common.transport import ConsumerTransport, PostInfo, sweep_stale_segments
from common.wire import pb2
from prefill_client.consumer.verify import check_location, gather_rows, verify_item
from tests.reliability.race import H_ITERATIONS, Directory, RaceSpec
from tests.transport_params import TRANSPORTS

REPO_ROOT = Path(__file__).resolve().parents[2]
PULLS = 10_000
CONSUMERS = 3
TIME_LIMIT_S = 90.0
READ_TIMEOUT_S = 5.0
SPEC = RaceSpec()


class RaceProducer:
    """The racing producer process; every wait on it has a deadline, and it is killed by pid at the end."""

    def __init__(self, kind: str, directory: Path, log: Path, *, pause_us: float) -> None:
        cmd = [sys.executable, "-m", "tests.reliability.race_producer", "--kind", kind,
               "--directory", str(directory), "--pause-us", str(pause_us)]
        self._log = open(log, "w")
        self.log_path = log
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True, bufsize=1, env=os.environ.copy())
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("EPD "):
                self._lines.put(line[4:].strip())

    def reply(self, timeout_s: float) -> str:
        try:
            return self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"race producer silent for {timeout_s} s:\n{self.log_path.read_text()}") from None

    def handshake(self) -> pb2.HandshakeResponse:
        ready = self.reply(60.0)
        assert ready.startswith("READY "), ready
        return pb2.HandshakeResponse.FromString(bytes.fromhex(ready.split()[1]))

    def finish(self) -> tuple[int, int, int]:
        """Close stdin; the producer stops and reports (iterations, same-item re-allocations, evictions)."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        done = self.reply(30.0)
        assert done.startswith("DONE "), done
        self.proc.wait(30)
        iterations, same, evictions = (int(w) for w in done.split()[1:4])
        return iterations, same, evictions

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


@dataclass
class Tally:
    """What one consumer saw, judged by the client and independently."""

    pulls: int = 0
    delivered: int = 0
    wrong: int = 0  # delivered, yet the rows differ from the item's reference
    wrong_rows_landed: int = 0  # the landed rows differ from the reference (delivered or not)
    refused: collections.Counter[str] = field(default_factory=collections.Counter)
    observed: collections.Counter[str] = field(default_factory=collections.Counter)  # by the independent check
    verdict_disagreed: int = 0

    def add(self, other: Tally) -> None:
        for name in ("pulls", "delivered", "wrong", "wrong_rows_landed", "verdict_disagreed"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.refused.update(other.refused)
        self.observed.update(other.observed)


def independent_verdict(loc: pb2.ItemLocation, tags: np.ndarray, gens: np.ndarray) -> str | None:
    """The mismatch the tags show, computed without the client's code; ``None`` if they prove the location."""
    for tag, gen in zip(tags.tolist(), gens.tolist()):
        if tag != loc.fingerprint:
            return LoadFailureReason.TAG_MISMATCH.value
        if gen != loc.generation:
            return LoadFailureReason.GENERATION_MISMATCH.value
    return None


def consume(kind: str, hs: pb2.HandshakeResponse, directory: Directory, refs: list[torch.Tensor],
            budget: list[int], budget_lock: threading.Lock, deadline: float, seed: int,
            hook: bool) -> Tally:
    tally = Tally()
    rng = random.Random(seed)
    transport = ConsumerTransport(kind, num_landing_blocks=4, name_prefix=f"race-consumer-{seed}")
    try:
        peer = transport.connect(hs, endpoint="race")
        landing = transport.landing
        if hook:
            block_bytes = landing.shape.bytes_per_block

            def between_reads(info: PostInfo) -> None:
                if info.nbytes >= block_bytes:
                    return  # the block READ: post at once
                roll = rng.random()
                if roll < 0.25:
                    time.sleep(rng.uniform(0.0, 300e-6))
                elif roll < 0.45:  # until the producer has re-allocated twice (bounded)
                    start, limit = directory.header(H_ITERATIONS), time.monotonic() + 0.02
                    while directory.header(H_ITERATIONS) < start + 2 and time.monotonic() < limit:
                        time.sleep(0)

            transport.agent.faults.before_post = between_reads
        while time.monotonic() < deadline:
            with budget_lock:
                if budget[0] <= 0:
                    break
                budget[0] -= 1
            k = rng.randrange(SPEC.num_items)
            loc = directory.location(k)
            if loc is None:
                with budget_lock:
                    budget[0] += 1
                time.sleep(0.001)
                continue
            check_location(loc, SPEC.block_size)
            remote = np.asarray(loc.block_ids, dtype=np.int32)
            local = landing.acquire(remote.size)
            assert local is not None, "landing blocks leaked"
            try:
                peer.read_blocks(remote, local, time.monotonic() + READ_TIMEOUT_S)
                tags, gens = peer.read_tags(remote, time.monotonic() + READ_TIMEOUT_S)
                rows = gather_rows(landing.tensor, local, loc.tokens_per_block)
            finally:
                landing.release(local)
            tally.pulls += 1
            rows_ok = torch.equal(rows, refs[k])
            tally.wrong_rows_landed += not rows_ok
            seen = independent_verdict(loc, tags, gens)
            if seen is not None:
                tally.observed[seen] += 1
            try:
                verify_item(loc, tags, gens)
            except ECLoadFailure as exc:
                tally.refused[exc.reason.value] += 1
                tally.verdict_disagreed += exc.reason.value != seen
                continue
            tally.delivered += 1
            tally.wrong += not rows_ok
            tally.verdict_disagreed += seen is not None
    finally:
        transport.close()
    return tally


def run_race(kind: str, tmp_path: Path, *, hook: bool, pause_us: float) -> tuple[Tally, tuple[int, int, int]]:
    path = tmp_path / "directory.bin"
    directory = Directory(path, SPEC, create=True)
    refs = [SPEC.rows(k) for k in range(SPEC.num_items)]
    producer = RaceProducer(kind, path, tmp_path / "producer.log", pause_us=pause_us)
    try:
        hs = producer.handshake()
        budget, budget_lock = [PULLS], threading.Lock()
        deadline = time.monotonic() + TIME_LIMIT_S
        results: list[Tally] = []
        errors: list[BaseException] = []

        def worker(seed: int) -> None:
            try:
                results.append(consume(kind, hs, directory, refs, budget, budget_lock, deadline, seed, hook))
            except BaseException as exc:  # re-raised in the test thread
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(CONSUMERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIME_LIMIT_S + 30)
            assert not t.is_alive(), "a consumer hung"
        if errors:
            raise errors[0]
        stats = producer.finish()
    finally:
        producer.kill()
        directory.close()
        if kind == "mock":
            sweep_stale_segments()
    total = Tally()
    for r in results:
        total.add(r)
    return total, stats


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_reuse_race_delivers_no_wrong_embedding(kind: str, tmp_path: Path) -> None:
    # The mock agent adds delays between the READs through its hook; real NIXL runs as it is,
    # with a producer that pauses a little between re-allocations so some pulls still win.
    hook = kind == "mock"
    tally, (iterations, same_item, evictions) = run_race(kind, tmp_path, hook=hook, pause_us=0 if hook else 20)
    assert tally.pulls >= PULLS, f"only {tally.pulls} pulls in {TIME_LIMIT_S} s"
    # The dangerous situation really happened: the producer churned, rows of other
    # items or half-written rows landed, and both kinds of mismatch were read back.
    assert iterations > 1000 and same_item > 0 and evictions > 0
    assert tally.wrong_rows_landed > 0
    assert tally.observed[LoadFailureReason.TAG_MISMATCH.value] > 0
    assert tally.observed[LoadFailureReason.GENERATION_MISMATCH.value] > 0
    # Every mismatch became an ECLoadFailure with that reason, and nothing else did.
    assert tally.verdict_disagreed == 0
    assert tally.refused == tally.observed
    assert tally.delivered + sum(tally.refused.values()) == tally.pulls
    # And what was delivered is exactly its item.
    assert tally.delivered > 0
    assert tally.wrong == 0
