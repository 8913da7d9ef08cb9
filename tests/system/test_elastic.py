"""Scale and roll encoders under steady load from several clients, none of them restarted.

Real processes (mock transport): the clients follow a ``file:`` target list the
test edits, as they would follow a re-resolved headless Service. Every
delivered embedding is compared with a local reference encode of the weights
it must come from; every failure must be a typed ``ECLoadFailure``.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from common.errors import ECLoadFailure, LoadFailureReason
from common.weights_digest import checkpoint_digest
from epd_harness.media import image_bytes
from epd_harness.procs import EncoderProcess, start_encoder
from prefill_client.consumer.client import EncoderCacheClient
from prefill_client.consumer.connection import MediaSpec
from tests.support.checkpoints import write_vision_checkpoint
from tests.reliability.support import wait_until
from tests.support.reference import Reference, matches

MODEL = "tiny-qwen3-vl"
REFRESH_S = 0.2
SETTLE_S = 15.0
MAX_CALLS = 5000  # per client: the load is bounded in count as well as in time
PHASE_S = 1.5

def _write(listing: Path, text: str) -> None:
    """Replace the target list in one step, as a ConfigMap update does: a reader never sees half of it."""
    tmp = listing.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(listing)



@dataclass
class Record:
    at: float
    image: int
    encoder: str = ""
    source: str = ""
    error: BaseException | None = None


@dataclass
class Load:
    """One client requesting the images one per call, in a loop, from its own thread."""

    client: EncoderCacheClient
    images: list[bytes]
    refs: list[torch.Tensor]
    offset: int
    records: list[Record] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        n = len(self.images)
        for call in range(MAX_CALLS):
            if self.stop.is_set():
                return
            i = (self.offset + call) % n
            record = Record(time.monotonic(), i)
            try:
                [item] = self.client.encode([MediaSpec.image(self.images[i])])
            except Exception as exc:  # noqa: BLE001 - every outcome is recorded and judged after
                record.error = exc
                time.sleep(0.01)
            else:
                record.encoder, record.source = item.encoder, item.source
                if not matches(item.embeddings, self.refs[i]):
                    self.wrong.append(f"image {i} from {item.encoder}")
            self.records.append(record)


@dataclass
class Clients:
    loads: list[Load]
    threads: list[threading.Thread] = field(default_factory=list)

    def __enter__(self) -> Clients:
        self.threads = [threading.Thread(target=load.run, daemon=True) for load in self.loads]
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for load in self.loads:
            load.stop.set()
        for thread in self.threads:
            thread.join(timeout=60)
        for load in self.loads:
            load.client.close()
        assert not any(thread.is_alive() for thread in self.threads), "a client did not stop"


def _start_many(tmp_path: Path, *args_list: tuple[str, ...]) -> list[EncoderProcess]:
    with ThreadPoolExecutor(len(args_list)) as pool:
        futures = [pool.submit(start_encoder, tmp_path, "--transport", "mock", "--drain-grace-s", "30", *args,
                               name=f"enc-{time.monotonic_ns()}-{i}") for i, args in enumerate(args_list)]
        return [f.result() for f in futures]


@pytest.fixture
def procs() -> Iterator[list[EncoderProcess]]:
    started: list[EncoderProcess] = []
    try:
        yield started
    finally:
        for enc in started:
            enc.kill()


def _client(listing: Path, **kwargs: object) -> EncoderCacheClient:
    return EncoderCacheClient(f"file:{listing}", MODEL, transport_kind="mock", failure_policy="retry",
                              local_cache_blocks=0, membership_refresh_s=REFRESH_S, **kwargs)  # type: ignore[arg-type]


def _knows(client: EncoderCacheClient, target: str) -> bool:
    conn = client.connection(target)
    return conn is not None and bool(conn.encoder_id) and client._pool.ready(target)  # noqa: SLF001


def test_scale_up_then_drain_and_kill_under_steady_load(tmp_path: Path, procs: list[EncoderProcess]) -> None:
    images = [image_bytes(48 + 16 * (i % 3), 64, seed=500 + i) for i in range(60)]
    ref = Reference()
    refs = [ref.image(data) for data in images]
    procs += _start_many(tmp_path, (), (), ())
    e0, e1, e2 = procs
    listing = tmp_path / "encoders.txt"
    _write(listing, f"{e0.target}\n{e1.target}\n{e2.target}\n")
    loads = [Load(_client(listing), images, refs, offset=20 * k) for k in range(3)]
    with Clients(loads):
        time.sleep(PHASE_S)  # steady: every image encoded once, then hits

        # Scale up: a fourth encoder, listed; no client restarted.
        [e3] = _start_many(tmp_path, ())
        procs.append(e3)
        _write(listing, f"{e0.target}\n{e1.target}\n{e2.target}\n{e3.target}\n")
        wait_until(lambda: all(_knows(load.client, e3.target) for load in loads), SETTLE_S,
                   "every client ranks the new encoder")
        known_at = time.monotonic()
        wait_until(lambda: all(len({r.image for r in load.records if r.at > known_at}) == len(images)
                               for load in loads), SETTLE_S, "every client asked for every image again")

        # Scale down: e1 drains on SIGTERM, e2 is killed outright; both leave the list.
        e1.proc.send_signal(signal.SIGTERM)
        e2.kill()
        killed_at = time.monotonic()
        _write(listing, f"{e0.target}\n{e3.target}\n")
        wait_until(lambda: all(set(load.client.targets) == {e0.target, e3.target} for load in loads), SETTLE_S,
                   "every client dropped the removed encoders")
        assert e1.proc.wait(30) == 0, e1.log()
        settled = time.monotonic()
        time.sleep(PHASE_S)

    for load in loads:
        assert not load.wrong, load.wrong
        # Every failure is typed; with the retry policy the killed encoder's items went elsewhere.
        untyped = [r.error for r in load.records if r.error is not None and not isinstance(r.error, ECLoadFailure)]
        assert not untyped, untyped
        failed = [r for r in load.records if r.error is not None]
        assert all(killed_at <= r.at for r in failed), [(r.at - killed_at, r.error) for r in failed]
        late = [r for r in load.records if r.at > settled]
        assert late and all(r.error is None and r.encoder in (e0.target, e3.target) for r in late)
    # After the scale-up, each client's first request of each image: still a hit for at least 70 %
    # (rendezvous moves about a quarter of the items, and only the first client to ask misses).
    firsts = []
    for load in loads:
        seen: set[int] = set()
        for r in load.records:
            if known_at < r.at < killed_at and r.image not in seen and r.error is None:
                seen.add(r.image)
                firsts.append(r.source)
    assert len(firsts) == 3 * len(images)
    assert sum(s == "hit" for s in firsts) / len(firsts) >= 0.7, firsts
    assert any(r.encoder == e3.target for load in loads for r in load.records)


def test_rolling_new_weights_never_mixes_them(tmp_path: Path, procs: list[EncoderProcess]) -> None:
    """Old pods serve weights A, new pods B; the clients expecting A and B each take rows from their
    own weights only, and are told (naming both digests) when none of theirs is left."""
    paths = {name: write_vision_checkpoint(tmp_path / f"ckpt-{name}", seed=seed)
             for name, seed in (("A", 21), ("B", 22))}
    digests = {name: checkpoint_digest(path) for name, path in paths.items()}
    refs = {name: Reference(str(path)) for name, path in paths.items()}
    images = [image_bytes(48, 48 + 16 * (i % 3), seed=900 + i) for i in range(24)]
    expected = {name: [refs[name].image(data) for data in images] for name in paths}
    procs += _start_many(tmp_path, ("--weights", str(paths["A"])), ("--weights", str(paths["A"])))
    a1, a2 = procs
    listing = tmp_path / "encoders.txt"
    _write(listing, f"{a1.target}\n{a2.target}\n")
    loads = {name: Load(_client(listing, weights_digest=digests[name]), images, expected[name], offset=0)
             for name in paths}
    with Clients(list(loads.values())):
        time.sleep(PHASE_S)  # A serves; the client expecting B has no encoder of its weights yet
        procs += _start_many(tmp_path, ("--weights", str(paths["B"])), ("--weights", str(paths["B"])))
        b1, b2 = procs[2:]
        _write(listing, f"{a1.target}\n{a2.target}\n{b1.target}\n{b2.target}\n")
        b_known = time.monotonic()
        wait_until(lambda: any(r.error is None and r.at > b_known for r in loads["B"].records), SETTLE_S,
                   "the client expecting B is served")
        # The old pods drain and leave.
        for old in (a1, a2):
            old.proc.send_signal(signal.SIGTERM)
        _write(listing, f"{b1.target}\n{b2.target}\n")
        for old in (a1, a2):
            assert old.proc.wait(30) == 0, old.log()
        a_gone = time.monotonic()
        wait_until(lambda: any(r.error is not None and r.at > a_gone for r in loads["A"].records), SETTLE_S,
                   "the client expecting A is refused")
        time.sleep(PHASE_S)  # refused while only the new pods are listed

    for name, load in loads.items():
        assert not load.wrong, load.wrong  # rows always of its own weights
        own = {"A": {a1.target, a2.target}, "B": {b1.target, b2.target}}[name]
        served = [r for r in load.records if r.error is None]
        assert served and all(r.encoder in own for r in served)
        for r in load.records:  # every failure typed: no encoder this client may use
            if r.error is not None:
                assert isinstance(r.error, ECLoadFailure), r.error
                assert r.error.reason is LoadFailureReason.HANDSHAKE, r.error
    # When no encoder of its weights is left (B before its pods, A after its pods left), the refusal
    # names both digests.
    b_refused = [r for r in loads["B"].records if r.at < b_known and r.error is not None]
    a_refused = [r for r in loads["A"].records if r.error is not None][-1:]  # at the end: only B pods listed
    assert b_refused and a_refused
    for r in b_refused + a_refused:
        assert digests["A"] in str(r.error) and digests["B"] in str(r.error), str(r.error)
