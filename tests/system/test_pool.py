"""Encoders join, leave, warm up, drain and freeze under a running client, through real processes.

The client follows a ``file:`` target list the test edits (as a mounted list or
a re-resolved name would change), with a short refresh. Every delivered
embedding is checked against a local reference encode, and each encoder's own
``/metrics`` says how many ``Encode`` calls reached it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.metrics import EPD_ENCODE_REQUESTS, EPD_LEASES_ACTIVE
from epd_harness.media import image_bytes
from epd_harness.procs import EncoderProcess, start_encoder
from epd_harness.waits import wait_ready
from prefill_client.consumer.client import EncoderCacheClient
from prefill_client.consumer.connection import MediaSpec
from prefill_client.consumer.routing import rendezvous_order
from tests.reliability.support import freeze, thaw, wait_until
from tests.support.reference import Reference, matches
from tests.support.scrape import scrape

MODEL = "tiny-qwen3-vl"
REF = Reference()
REFRESH_S = 0.2
SETTLE_S = 10.0  # bound on waiting for the client to see a change
LISTEN_LIMIT_S = 120.0  # bounds the start until listening; a stalled one fails long before (epd_harness.waits)

def _write(listing: Path, text: str) -> None:
    """Replace the target list in one step, as a ConfigMap update does: a reader never sees half of it."""
    tmp = listing.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(listing)



def _encodes(metrics_port: int) -> float:
    """Encode calls that reached an encoder, whatever their answer (refusals included)."""
    samples = scrape(metrics_port).samples
    return sum(v for k, v in samples.items() if k.startswith(f'{EPD_ENCODE_REQUESTS}_total{{') and
               'method="Encode"' in k)


class Images:
    """Fresh images, picked so that some prefer a given encoder, ranked as ``client`` ranks encoders
    (by the names they announced, by address where it has none yet)."""

    def __init__(self, client: EncoderCacheClient) -> None:
        self.client = client
        self.seed = 1000

    def preferring(self, target: str, targets: list[str], count: int, others: int) -> list[bytes]:
        """``count`` images whose first encoder is ``target`` and ``others`` whose first is not."""
        conns = [self.client.connection(t) for t in targets]
        names = {c.target: c.encoder_id for c in conns if c is not None and c.encoder_id}
        mine: list[bytes] = []
        rest: list[bytes] = []
        while len(mine) < count or len(rest) < others:
            self.seed += 1
            data = image_bytes(48 + self.seed % 5 * 16, 64, seed=self.seed)
            first = rendezvous_order(MediaSpec.image(data).key(), targets, names)[0]
            if first == target and len(mine) < count:
                mine.append(data)
            elif first != target and len(rest) < others:
                rest.append(data)
        return mine + rest


def _encode_verified(client: EncoderCacheClient, images: list[bytes]) -> list[str]:
    """Encode each image on its own; every one must come back right. Returns the encoder of each."""
    where = []
    for data in images:
        [item] = client.encode([MediaSpec.image(data)])
        assert matches(item.embeddings, REF.image(data)), f"wrong rows from {item.encoder}"
        where.append(item.encoder)
    return where


def _started(tmp_path: Path, count: int) -> Iterator[list[EncoderProcess]]:
    started: list[EncoderProcess] = []
    try:
        for i in range(count):
            started.append(start_encoder(tmp_path, "--transport", "mock", "--drain-grace-s", "30",
                                         name=f"enc{i}"))
        yield started
    finally:
        for enc in started:
            enc.kill()


@pytest.fixture
def encoders(tmp_path: Path) -> Iterator[list[EncoderProcess]]:
    yield from _started(tmp_path, 3)


@pytest.fixture
def two_encoders(tmp_path: Path) -> Iterator[list[EncoderProcess]]:
    yield from _started(tmp_path, 2)


def _spawn_warming(tmp_path: Path) -> tuple[subprocess.Popen[bytes], str, int]:
    """An encoder that compiles one bucket graph from an empty cache: tens of seconds of warm-up,
    health and /metrics up within a second or two."""
    listening = tmp_path / "warming.json"
    cmd = [sys.executable, "-m", "common.cli", "encoder", "--host", "127.0.0.1", "--port", "0",
           "--metrics-port", "0", "--transport", "mock", "--encoder-backend", "compile",
           "--encoder-buckets", "16", "--compile-cache-dir", str(tmp_path / "compile-cache"),
           "--listening-file", str(listening)]
    log_path = tmp_path / "warming.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    ports = wait_ready("the warming encoder (listening)", proc, log_path,
                       lambda: json.loads(listening.read_text()) if listening.exists() else None,
                       limit_s=LISTEN_LIMIT_S)
    return proc, f"127.0.0.1:{ports['port']}", int(ports["metrics_port"])


def test_encoders_join_leave_warm_and_drain_under_a_running_client(
        tmp_path: Path, encoders: list[EncoderProcess]) -> None:
    e0, e1, e2 = encoders
    listing = tmp_path / "encoders.txt"
    _write(listing, f"{e0.target}\n{e1.target}\n")
    with EncoderCacheClient(f"file:{listing}", MODEL, transport_kind="mock",
                            membership_refresh_s=REFRESH_S) as client:
        images = Images(client)
        assert client.targets == (e0.target, e1.target)
        # Identified at once (more than one encoder), by the default name: host name and port.
        conn = client.connection(e0.target)
        assert conn is not None and conn.encoder_id == f"{socket.gethostname()}:{e0.port}"
        two = [e0.target, e1.target]
        assert set(_encode_verified(client, images.preferring(e1.target, two, 3, 3))) == set(two)

        # Join: listed, it takes the items that prefer it, with no client restart.
        _write(listing, f"{e0.target}\n{e1.target}\n{e2.target}\n")
        wait_until(lambda: e2.target in client.targets and bool(getattr(client.connection(e2.target), "encoder_id", "")),
                   SETTLE_S, "the new encoder is known by its name")
        three = [e0.target, e1.target, e2.target]
        joined = images.preferring(e2.target, three, 4, 2)
        assert _encode_verified(client, joined)[:4] == [e2.target] * 4

        # Warming up: it answers health but gets no Encode at all, even for the items that prefer it.
        proc, warming, warming_metrics = _spawn_warming(tmp_path)
        try:
            _write(listing, "\n".join([*three, warming]) + "\n")
            wait_until(lambda: warming in client.targets, SETTLE_S, "the warming encoder is known")
            four = [*three, warming]
            where = _encode_verified(client, images.preferring(warming, four, 4, 2))
            assert warming not in where
            assert _encodes(warming_metrics) == 0
            assert not client._pool.ready(warming), "warmed up already: the check above proved nothing"
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(30)
        _write(listing, "\n".join(three) + "\n")
        wait_until(lambda: warming not in client.targets, SETTLE_S, "the warming encoder is gone")

        # Draining: a lease held elsewhere keeps e1 draining; it gets no new Encode.
        holder = EncoderCacheClient(e1.target, MODEL, transport_kind="mock", membership_refresh_s=0)
        try:
            conn = holder.connection(e1.target)
            assert conn is not None
            [held] = conn.encode([MediaSpec.image(image_bytes(40, 40, seed=5))])
            e1.proc.send_signal(signal.SIGTERM)
            wait_until(lambda: not client._pool.ready(e1.target), SETTLE_S, "the draining encoder is not ready")
            before = _encodes(e1.metrics_port)
            where = _encode_verified(client, images.preferring(e1.target, three, 4, 2))
            assert e1.target not in where
            assert _encodes(e1.metrics_port) == before
            conn.release([held.lease_id])
        finally:
            holder.close()
        assert e1.proc.wait(30) == 0, e1.log()

        # Leave: unlisted, it gets nothing new.
        _write(listing, f"{e0.target}\n")
        wait_until(lambda: e2.target not in client.targets, SETTLE_S, "e2 left")
        before = _encodes(e2.metrics_port)
        where = _encode_verified(client, images.preferring(e2.target, three, 3, 1))
        assert e2.target not in where
        assert _encodes(e2.metrics_port) == before
        assert client.metrics.routed_away._value.get() >= 8


ENCODE_DEADLINE_S = 60.0  # the proxy's default: what a frozen encoder's Encode would wait out


def test_a_frozen_encoders_calls_in_flight_go_to_the_next_encoder(two_encoders: list[EncoderProcess]) -> None:
    e0, e1 = two_encoders
    with EncoderCacheClient([e0.target, e1.target], MODEL, transport_kind="mock", membership_refresh_s=REFRESH_S,
                            encode_timeout_s=ENCODE_DEADLINE_S) as client:
        [first, later] = Images(client).preferring(e0.target, [e0.target, e1.target], 2, 0)
        assert _encode_verified(client, [first]) == [e0.target]
        # Frozen while ready, so that the next Encode goes to it and waits there.
        freeze(e0.proc.pid)
        try:
            start = time.monotonic()
            assert _encode_verified(client, [later]) == [e1.target]
            took = time.monotonic() - start
        finally:
            thaw(e0.proc.pid)
        # Given up once e0 missed two readiness checks, seconds, not the Encode's deadline.
        assert took < ENCODE_DEADLINE_S / 2, took
        assert client.metrics.calls_given_up._value.get() == 1  # it went to e0 first, and waited there
        # Thawed, e0 holds no lease of the call given up (its answer refused by call id, or never made).
        wait_until(lambda: scrape(e0.metrics_port).get(EPD_LEASES_ACTIVE) == 0, SETTLE_S, "e0 holds no lease")
        wait_until(lambda: client._pool.ready(e0.target), SETTLE_S, "e0 is ready again")
        assert _encode_verified(client, [first]) == [e0.target]

        # A placed item is looked up where it was placed: frozen there, the Lookup is given up too,
        # and the item is encoded on the next encoder.
        spec = MediaSpec.image(first)
        [placed] = client.place([spec])
        assert placed.encoder == e0.target
        client.release_placed([placed])
        freeze(e0.proc.pid)
        try:
            [placed] = client.place([spec])
            assert placed.encoder == e1.target
            [item] = client.pull_placed([placed])
            assert matches(item.embeddings, REF.image(first))
        finally:
            thaw(e0.proc.pid)
        assert client.metrics.calls_given_up._value.get() == 2
