"""Control-plane latency: the encoder's Lookup RPC against a bare gRPC echo, same client, same way (run by hand).

Starts ``epd encoder`` in its own process (small cache, eager encoder),
encodes a few images, then times ``Lookup`` of one cached item per call
with synchronous gRPC stubs, one channel per client thread, at each
concurrency. A Lookup takes a lease; the leases of a round are released in
batches between rounds, outside the timed region. The same client loop
then times a bare echo server (this script with ``--serve-echo``: a
``grpc.aio`` server with one generic handler that returns the request
bytes, in its own process), sending the serialized Lookup request.

Per concurrency: ``p50_ms`` / ``p99_ms`` of the per-call latencies and
``calls_per_s`` (calls over the summed wall time of the timed rounds). The
ratios are lookup / echo for the latencies and echo / lookup for the rate
(above 1: Lookup is slower). Target: every ratio at most 1.5.

``--gap-ms G`` pauses each client G ms after each call (outside the timing), as calls come
in a request stream at one in flight (``bench/front.py``'s phase e sends a request every
40 ms or so): each call then meets processes that went idle, and pays their wake-ups. With
a gap, ``calls_per_s`` counts the pauses too; compare the latencies.

Usage: ``python bench/control_plane.py [--seconds 3] [--concurrency 1,8] [--gap-ms 0]
[--transport auto|nixl|mock]``. The last line of stdout is one JSON object:
``{"lookup": {"c1": {"p50_ms", "p99_ms", "calls_per_s"}, "c8": {...}},
"echo": {...}, "ratio": {"c1": {"p50", "p99", "calls_per_s"}, ...}}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.wire import PROTOCOL_VERSION, pb2, pb2_grpc  # noqa: E402
from epd_harness.media import image_bytes  # noqa: E402
from epd_harness.procs import bench_encoder_args, start_encoder, terminate  # noqa: E402

MODEL_ID = "tiny-qwen3-vl"
READY_TIMEOUT_S = 120.0
RPC_TIMEOUT_S = 10.0
ECHO_METHOD = "/epd.bench.Echo/Echo"
MAX_RELEASE = 4096
# One call per client thread: returns lease ids to release after the round (none for echo).
Call = Callable[[], Sequence[int]]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="timed seconds per target and concurrency")
    parser.add_argument("--round-s", type=float, default=0.5, help="timed round length (leases released between)")
    parser.add_argument("--warmup-calls", type=int, default=200, help="untimed calls per client first")
    parser.add_argument("--concurrency", default="1,8", help="comma-separated client thread counts")
    parser.add_argument("--items", type=int, default=4, help="images encoded and then looked up")
    parser.add_argument("--gap-ms", type=float, default=0.0,
                        help="pause of each client after each call, untimed (0: back to back)")
    parser.add_argument("--transport", default="auto",
                        help="encoder transport: auto, nixl or mock (a Lookup does not touch it, but the "
                             "encoder's notification polling runs beside it)")
    parser.add_argument("--serve-echo", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# --- the echo server (its own process) ---------------------------------------------------------

async def _echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return request


async def serve_echo() -> None:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "epd.bench.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(_echo)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(0)


# --- processes ---------------------------------------------------------------------------------

def start_echo() -> tuple[subprocess.Popen[bytes], int]:
    proc = subprocess.Popen([sys.executable, __file__, "--serve-echo"], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    import select

    ready, _, _ = select.select([proc.stdout], [], [], READY_TIMEOUT_S)
    line = proc.stdout.readline() if ready else b""
    if not line.strip():
        proc.kill()
        raise SystemExit("echo server did not start")
    return proc, int(line)


# --- measurement -------------------------------------------------------------------------------

class Target:
    """One server's clients (a call per client thread) and the latencies of their timed calls."""

    def __init__(self, calls: Sequence[Call], release: Callable[[int, list[int]], None], gap_s: float = 0.0) -> None:
        self.calls = calls
        self.gap_s = gap_s
        self.release = release
        self.latencies: list[list[float]] = [[] for _ in calls]
        self.leases: list[list[int]] = [[] for _ in calls]
        self.timed_s = 0.0

    def _loop(self, i: int, deadline: float, count: int | None) -> None:
        call, lat, held = self.calls[i], self.latencies[i], self.leases[i]
        done = 0
        while (time.perf_counter() < deadline) if count is None else (done < count):
            t0 = time.perf_counter()
            ids = call()
            lat.append(time.perf_counter() - t0)
            held.extend(ids)
            done += 1
            if self.gap_s:
                time.sleep(self.gap_s)

    def _drain(self) -> None:
        for i, held in enumerate(self.leases):  # a lease is released by the client it was granted to
            for k in range(0, len(held), MAX_RELEASE):
                self.release(i, held[k:k + MAX_RELEASE])
            held.clear()

    def warm_up(self, pool: ThreadPoolExecutor, calls: int) -> None:
        list(pool.map(lambda i: self._loop(i, 0.0, calls), range(len(self.calls))))
        self._drain()
        for lat in self.latencies:
            lat.clear()

    def timed_round(self, pool: ThreadPoolExecutor, round_s: float) -> None:
        started = time.perf_counter()
        deadline = started + round_s
        list(pool.map(lambda i: self._loop(i, deadline, None), range(len(self.calls))))
        self.timed_s += time.perf_counter() - started
        self._drain()  # outside the timed region

    def summary(self) -> dict[str, float]:
        flat = sorted(x for lat in self.latencies for x in lat)
        return {
            "p50_ms": round(statistics.median(flat) * 1e3, 4),
            "p99_ms": round(flat[min(len(flat) - 1, int(0.99 * len(flat)))] * 1e3, 4),
            "calls_per_s": round(len(flat) / self.timed_s, 1),
            "calls": len(flat),
        }


def measure(targets: Sequence[Target], concurrency: int, seconds: float, round_s: float,
            warmup_calls: int) -> list[dict[str, float]]:
    """Timed rounds of every target in turn (so a noisy neighbour slows them alike); one summary each."""
    with ThreadPoolExecutor(concurrency) as pool:
        for t in targets:
            t.warm_up(pool, warmup_calls)
        for _ in range(max(1, round(seconds / round_s))):
            for t in targets:
                t.timed_round(pool, round_s)
    return [t.summary() for t in targets]


def lookup_target(port: int, items: int, concurrency: int) -> tuple[
        list[Call], Callable[[int, list[int]], None], list[grpc.Channel], bytes]:
    """Encode ``items`` images, then one Lookup-of-a-cached-item call per client."""
    target = f"127.0.0.1:{port}"
    admin = grpc.insecure_channel(target)
    stub = pb2_grpc.EncoderCacheServiceStub(admin)
    hello = stub.Handshake(pb2.HandshakeRequest(
        protocol_version=PROTOCOL_VERSION, model_id=MODEL_ID, consumer_id="bench"), timeout=RPC_TIMEOUT_S)
    inc = hello.incarnation_id
    resp = stub.Encode(pb2.EncodeRequest(
        model_id=MODEL_ID, consumer_id="bench", incarnation_id=inc,
        items=[pb2.MediaItem(image=image_bytes(64, 64, seed=seed), uuid=f"img{seed}") for seed in range(items)]),
        timeout=60.0)
    hashes = [r.location.mm_hash for r in resp.results]
    stub.Release(pb2.ReleaseRequest(consumer_id="bench", lease_ids=[r.location.lease_id for r in resp.results]),
                 timeout=RPC_TIMEOUT_S)

    channels = [grpc.insecure_channel(target) for _ in range(concurrency)]
    calls: list[Call] = []
    lock = threading.Lock()
    for i, ch in enumerate(channels):
        s = pb2_grpc.EncoderCacheServiceStub(ch)
        requests = [pb2.LookupRequest(model_id=MODEL_ID, consumer_id=f"bench-{i}", mm_hashes=[h],
                                      incarnation_id=inc) for h in hashes]
        counter = [i]

        def call(s: pb2_grpc.EncoderCacheServiceStub = s, requests: list[pb2.LookupRequest] = requests,
                 counter: list[int] = counter) -> Sequence[int]:
            counter[0] += 1
            out = s.Lookup(requests[counter[0] % len(requests)], timeout=RPC_TIMEOUT_S)
            result = out.results[0]
            if result.WhichOneof("outcome") != "location":
                raise SystemExit(f"Lookup of a cached item missed: {result.error.message}")
            return (result.location.lease_id,)

        calls.append(call)

    def release(i: int, ids: list[int]) -> None:
        with lock:
            out = stub.Release(pb2.ReleaseRequest(consumer_id=f"bench-{i}", lease_ids=ids), timeout=RPC_TIMEOUT_S)
        if out.released != len(ids):
            raise SystemExit(f"released {out.released} of {len(ids)} leases")

    payload = pb2.LookupRequest(model_id=MODEL_ID, consumer_id="bench-0", mm_hashes=[hashes[0]],
                                incarnation_id=inc).SerializeToString()
    return calls, release, [admin, *channels], payload


def echo_target(port: int, concurrency: int, payload: bytes) -> tuple[list[Call], list[grpc.Channel]]:
    channels = [grpc.insecure_channel(f"127.0.0.1:{port}") for _ in range(concurrency)]
    calls: list[Call] = []
    for ch in channels:
        method = ch.unary_unary(ECHO_METHOD)

        def call(method: grpc.UnaryUnaryMultiCallable = method) -> Sequence[int]:
            if method(payload, timeout=RPC_TIMEOUT_S) != payload:
                raise SystemExit("echo returned different bytes")
            return ()

        calls.append(call)
    return calls, channels


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.serve_echo:
        asyncio.run(serve_echo())
        return
    levels = [int(c) for c in args.concurrency.split(",")]
    results: dict[str, dict[str, dict[str, float]]] = {"lookup": {}, "echo": {}, "ratio": {}}
    with tempfile.TemporaryDirectory(prefix="epd-bench-") as tmp:
        encoder = start_encoder(Path(tmp), *bench_encoder_args(args.transport, args.items + 4))
        enc_port, transport = encoder.port, encoder.transport
        echo, echo_port = start_echo()
        print(f"encoder transport {transport}, {args.items} cached items, {args.seconds} s per target and "
              f"concurrency, rounds of {args.round_s} s, a pause of {args.gap_ms} ms after each call", flush=True)
        try:
            for c in levels:
                calls, release, chans, payload = lookup_target(enc_port, args.items, c)
                ecalls, echans = echo_target(echo_port, c, payload)
                gap_s = args.gap_ms / 1e3
                lookup, echo_r = measure([Target(calls, release, gap_s), Target(ecalls, lambda i, ids: None, gap_s)],
                                         c, args.seconds, args.round_s, args.warmup_calls)
                for ch in chans + echans:
                    ch.close()
                key = f"c{c}"
                results["lookup"][key] = lookup
                results["echo"][key] = echo_r
                results["ratio"][key] = {
                    "p50": round(lookup["p50_ms"] / echo_r["p50_ms"], 3),
                    "p99": round(lookup["p99_ms"] / echo_r["p99_ms"], 3),
                    "calls_per_s": round(echo_r["calls_per_s"] / lookup["calls_per_s"], 3),
                }
                print(f"c{c}: lookup p50 {lookup['p50_ms']:.3f} ms p99 {lookup['p99_ms']:.3f} ms "
                      f"{lookup['calls_per_s']:.0f} calls/s | echo p50 {echo_r['p50_ms']:.3f} ms "
                      f"p99 {echo_r['p99_ms']:.3f} ms {echo_r['calls_per_s']:.0f} calls/s | "
                      f"ratio {results['ratio'][key]}", flush=True)
        finally:
            terminate(echo)
            encoder.terminate()
    print(json.dumps({**results, "gap_ms": args.gap_ms}))


if __name__ == "__main__":
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    main()
