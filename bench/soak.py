"""Bounded soak: mixed load with periodic faults against a real ``epd encoder`` (prefill-side script).

Starts an encoder process with a small cache (so items are evicted and blocks
reused all the time), then runs worker threads, each an
:class:`~prefill_client.consumer.client.EncoderCacheClient` with its own NIXL agent,
doing a mix of Encode requests (one to three images or videos, sometimes with
a bad item among them) and Lookups of items seen before. Every delivered
embedding is compared with a local reference encode of its content. Every
``--fault-every-s`` one fault is injected, in turn:

- ``freeze``: SIGSTOP the encoder for 1.5 s (pull timeouts, RPC deadlines);
- ``kill``: kill -9 the encoder and restart it on the same port (disconnects,
  re-handshake with the new incarnation);
- ``leak``: Encode without ever releasing (the leases must expire);
- ``garbage``: malformed request bytes (must be INVALID_ARGUMENT);
- ``reuse`` (mock transport only): one worker stalls between its block READ
  and its tag READ past the lease TTL, so the block can be reused under it.

Reports requests, failures by reason, wrong embeddings (must be 0), faults,
and this process's memory (RSS) after warm-up and at the end. Exit status 1
if any embedding was wrong or any request ended in an untyped exception.

    python bench/soak.py                   # 5 minutes
    python bench/soak.py --minutes 30 --json
    python bench/soak.py --seconds 25      # what the test suite runs

The last line is one JSON object: ``requests``, ``failures`` (reason -> count),
``wrong_embeddings``, ``rss_start_mb``, ``rss_end_mb``, and more.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.errors import CacheFullError, ECLoadFailure, EncoderCallError, EpdError, InvalidMediaError, TransportError  # noqa: E402
from common.transport import PostInfo, resolve_transport_kind  # noqa: E402
from common.wire import SERVICE_NAME, pb2, pb2_grpc  # noqa: E402
from encoder_server.preprocess import PreprocessConfig, Preprocessor  # noqa: E402
from encoder_server.vision import load_encoder  # noqa: E402
from epd_harness.ports import free_port  # noqa: E402
from epd_harness.procs import EncoderLaunch, bench_encoder_args, launch_encoder  # noqa: E402
from prefill_client.consumer.client import EncoderCacheClient  # noqa: E402
from prefill_client.consumer.connection import MediaSpec, content_key  # noqa: E402

logger = logging.getLogger("soak")

MODEL = "tiny-qwen3-vl"
LEASE_TTL_MS = 2000
FREEZE_S = 1.5
# The restart is the slowest fault: first, so even a short run sees the encoder come back.
FAULTS = ("kill", "freeze", "garbage", "leak", "reuse")


def rss_mb(pid: int | str = "self") -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class Encoder:
    """The encoder process: started on a fixed port so a restart is the same target."""

    def __init__(self, transport: str, workdir: Path) -> None:
        self.port = free_port()  # below the ephemeral range: no client connection takes it while it is down
        self.transport, self.workdir = transport, workdir
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self._launch: EncoderLaunch | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        self.starts += 1
        self._launch = launch_encoder(self.workdir, *bench_encoder_args(self.transport, 12), "--port", str(self.port),
                                      "--lease-ttl-ms", str(LEASE_TTL_MS), name=f"encoder-{self.starts}")
        self.proc = self._launch.proc

    def wait_ready(self) -> None:
        assert self._launch is not None
        self._launch.wait()

    def signal(self, sig: signal.Signals) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc is not None else 0
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.kill()
            return -9


class Items:
    """The media pool, bad items, and a reference encode of each good item (computed here, once)."""

    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng(seed)

        def png(w: int, h: int) -> bytes:
            import io

            from PIL import Image

            out = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(out, format="PNG")
            return out.getvalue()

        sizes = [(64, 64), (96, 64), (200, 120), (128, 256), (300, 300)] * 3
        self.good = [MediaSpec.image(png(w, h)) for w, h in sizes[:12]]
        self.good += [MediaSpec.video([png(64, 96) for _ in range(4)], fps=2.0) for _ in range(2)]
        self.bad = [MediaSpec.image(b""), MediaSpec.image(b"not an image"), MediaSpec.image(png(64, 64)[:120]),
                    MediaSpec.video([png(64, 64), png(32, 32)])]
        encoder = load_encoder()
        pre = Preprocessor(PreprocessConfig.for_encoder(encoder))
        self.refs: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for item in self.good:
                p = pre.image(item.frames[0]) if item.kind == "image" else pre.video(item.frames, fps=item.fps)
                self.refs[content_key(item)] = encoder.embed(p.pixel_values, torch.tensor([p.grid_thw]))

    def matches(self, item: MediaSpec, rows: torch.Tensor) -> bool:
        ref = self.refs[content_key(item)]
        return rows.shape == ref.shape and bool(torch.allclose(rows.float(), ref.float(), rtol=2e-2, atol=2e-2))


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests = 0
        self.delivered = 0
        self.wrong = 0
        self.failures: collections.Counter[str] = collections.Counter()
        self.rejected_bad_input = 0
        self.faults: collections.Counter[str] = collections.Counter()
        self.crashes: list[str] = []
        self.delivered_at_restart = 0

    def failure(self, reason: str) -> None:
        with self.lock:
            self.failures[reason] += 1


def classify(exc: BaseException) -> str:
    if isinstance(exc, ECLoadFailure):
        return f"ec_load_failure:{exc.reason.value}"
    if isinstance(exc, CacheFullError):
        return "cache_full"
    if isinstance(exc, EncoderCallError):
        return f"status:{exc.code.name}"
    if isinstance(exc, EpdError):
        return f"error:{type(exc).__name__}"
    return f"crash:{type(exc).__name__}"


def worker(index: int, encoder: Encoder, items: Items, tally: Tally, stop: threading.Event,
           clients: list[EncoderCacheClient]) -> None:
    rng = random.Random(index)
    seen: list[tuple[str, MediaSpec]] = []
    client = EncoderCacheClient(encoder.target, MODEL, transport_kind=encoder.transport, rpc_timeout_s=3.0,
                                pull_timeout_s=1.0, failure_policy="retry" if index % 2 else "fail",
                                landing_blocks=16, local_cache_blocks=1)
    clients.append(client)
    try:
        while not stop.is_set():
            bad = None
            try:
                if seen and rng.random() < 0.2:
                    h, item = rng.choice(seen)
                    got = client.lookup([h])[0]
                    pulled = [] if got is None else [(item, got)]
                else:
                    batch = [rng.choice(items.good) for _ in range(rng.randint(1, 3))]
                    if rng.random() < 0.1:
                        bad = rng.choice(items.bad)
                        batch.insert(rng.randrange(len(batch) + 1), bad)
                    pulled = list(zip(batch, client.encode(batch)))
                    if bad is not None:
                        raise AssertionError("a request with a bad item was served")
                wrong = sum(not items.matches(item, p.embeddings) for item, p in pulled)
                with tally.lock:
                    tally.requests += 1
                    tally.delivered += len(pulled)
                    tally.wrong += wrong
                seen += [(p.mm_hash, item) for item, p in pulled if len(seen) < 64]
            except InvalidMediaError as exc:
                with tally.lock:
                    tally.requests += 1
                    if bad is not None:
                        tally.rejected_bad_input += 1
                    else:
                        tally.failures[f"error:{type(exc).__name__}"] += 1
            except Exception as exc:  # every outcome is counted; untyped ones are crashes
                reason = classify(exc)
                with tally.lock:
                    tally.requests += 1
                    tally.failures[reason] += 1
                    if reason.startswith("crash:"):
                        tally.crashes.append(repr(exc))
                stop.wait(0.1)  # back off: the encoder may be down for seconds
    finally:
        client.close()


def inject(fault: str, encoder: Encoder, items: Items, tally: Tally, clients: list[EncoderCacheClient]) -> None:
    if fault == "freeze":
        encoder.signal(signal.SIGSTOP)
        time.sleep(FREEZE_S)
        encoder.signal(signal.SIGCONT)
    elif fault == "kill":
        encoder.kill()
        encoder.start()
        with tally.lock:
            tally.delivered_at_restart = tally.delivered
    elif fault in ("leak", "garbage"):
        with grpc.insecure_channel(encoder.target) as channel:
            if fault == "leak":
                stub = pb2_grpc.EncoderCacheServiceStub(channel)
                leaked = [pb2.MediaItem(image=spec.frames[0])
                          for spec in random.sample([i for i in items.good if i.kind == "image"], 2)]
                try:
                    stub.Encode(pb2.EncodeRequest(model_id=MODEL, consumer_id="leaker", items=leaked), timeout=5)
                except grpc.RpcError as exc:
                    tally.failure(f"leak:{exc.code().name}")
            else:
                for method in ("Encode", "Lookup", "Release", "Handshake"):
                    call = channel.unary_unary(f"/{SERVICE_NAME}/{method}", request_serializer=lambda b: b,
                                               response_deserializer=lambda b: b)
                    try:
                        call(b"\x1a\xff\xff\xff\xff\x0f", timeout=5)
                        tally.failure("garbage:accepted")
                    except grpc.RpcError as exc:
                        if exc.code() not in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAVAILABLE):
                            tally.failure(f"garbage:{exc.code().name}")
    elif fault == "reuse":
        if encoder.transport != "mock" or not clients:
            return
        agent = clients[0].transport.agent
        try:
            block_bytes = clients[0].transport.landing.shape.bytes_per_block
        except TransportError:
            return  # that worker has not handshaken yet

        def stall_between_reads(info: PostInfo) -> None:
            if info.nbytes < block_bytes:  # the tag READ: wait until the lease has expired
                agent.faults.before_post = None
                time.sleep(LEASE_TTL_MS / 1000 + 0.3)

        agent.faults.before_post = stall_between_reads
    tally.faults[fault] += 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--minutes", type=float, default=5.0, help="how long to run (default 5)")
    length.add_argument("--seconds", type=float, default=None, help="how long to run, in seconds")
    parser.add_argument("--transport", default="auto", help="nixl, mock or auto (default)")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--fault-every-s", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    seconds = args.seconds if args.seconds is not None else args.minutes * 60.0
    if seconds <= 0 or args.workers <= 0 or args.fault_every_s <= 0:
        parser.error("--minutes/--seconds, --workers and --fault-every-s must be > 0")
    transport = resolve_transport_kind(args.transport).value
    tally, stop = Tally(), threading.Event()
    clients: list[EncoderCacheClient] = []
    with tempfile.TemporaryDirectory(prefix="epd-soak-") as workdir:
        encoder = Encoder(transport, Path(workdir))
        try:
            encoder.launch()
            items = Items(args.seed)  # the references are computed while the encoder starts
            encoder.wait_ready()
            threads = [threading.Thread(target=worker, args=(i, encoder, items, tally, stop, clients), daemon=True)
                       for i in range(args.workers)]
            started = time.monotonic()
            for t in threads:
                t.start()
            warmup = min(3.0, seconds / 5)
            time.sleep(warmup)  # lazy initialization is not a leak: measure after it
            rss_start = rss_mb()
            end = started + seconds
            faults = list(FAULTS if transport == "mock" else [f for f in FAULTS if f != "reuse"])
            next_fault = 0
            while time.monotonic() + args.fault_every_s < end:
                time.sleep(args.fault_every_s)
                inject(faults[next_fault % len(faults)], encoder, items, tally, clients)
                next_fault += 1
            # Every fault is followed by load: a restart that ran late still gets a recovery window.
            end = max(end, time.monotonic() + max(3.0, args.fault_every_s))
            time.sleep(max(0.0, end - time.monotonic()))
            stop.set()
            for t in threads:
                t.join(30)
            hung = sum(t.is_alive() for t in threads)
            rss_end = rss_mb()
            encoder_rss = rss_mb(encoder.proc.pid) if encoder.proc and encoder.proc.poll() is None else 0.0
            exit_code = encoder.stop()
        finally:
            stop.set()
            encoder.kill()
    elapsed = time.monotonic() - started
    summary = {
        "seconds": round(elapsed, 1), "transport": transport, "workers": args.workers,
        "requests": tally.requests, "delivered_items": tally.delivered,
        "failures": dict(sorted(tally.failures.items())), "rejected_bad_input": tally.rejected_bad_input,
        "wrong_embeddings": tally.wrong, "faults": dict(tally.faults), "encoder_starts": encoder.starts,
        "delivered_since_restart": tally.delivered - tally.delivered_at_restart,
        "hung_workers": hung, "encoder_exit": exit_code,
        "rss_start_mb": round(rss_start, 1), "rss_end_mb": round(rss_end, 1),
        "encoder_rss_end_mb": round(encoder_rss, 1), "crashes": tally.crashes[:5],
    }
    if not args.json:
        print(f"soak: {summary['seconds']} s on {transport}, {args.workers} workers: {tally.requests} requests, "
              f"{tally.delivered} items delivered, {tally.wrong} wrong")
        print(f"faults: {summary['faults']}; encoder starts: {encoder.starts}")
        print(f"failures: {summary['failures']}; bad inputs rejected: {tally.rejected_bad_input}")
        print(f"rss: {summary['rss_start_mb']} MB after warm-up, {summary['rss_end_mb']} MB at the end")
    print(json.dumps(summary))
    return 1 if tally.wrong or tally.crashes or hung else 0


if __name__ == "__main__":
    sys.exit(main())
