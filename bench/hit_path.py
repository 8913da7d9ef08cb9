"""Hit path: what a cache hit costs through the client, against its floor, in one run (run by hand).

Starts a real ``epd encoder`` (real NIXL where installed) and an echo gRPC
server (this script with ``--serve-echo``, its own process, the same
``grpc.aio`` server as the encoder), caches ``--items`` 512x512 PNGs, then
measures, median of ``--repeats`` rounds after two warm-ups, round-robin in
the same loop so a noisy neighbour slows all of them alike:

- ``lookup_ms``: :meth:`EncoderCacheClient.lookup` of every item's mm_hash,
  the client's local cache off: Lookup RPC(s), block READ, tag READ, checks,
  rows copied out;
- ``floor_ms`` = ``lookup_rpc_ms`` + ``bare_read_ms``: one raw ``Lookup`` RPC
  for the same hashes, plus one bare NIXL READ of the same blocks (its own
  agent and dlists, busy-polled; see ``bench/pull_throughput.py``);
- ``encode_cached_ms``: :meth:`EncoderCacheClient.encode` of the same (already
  cached) PNGs, new ``MediaSpec`` objects each round (nothing memoized);
- ``send_ms``: the same request bytes sent in one RPC to the echo server,
  which answers an empty message;
- ``place_sent_ms`` / ``place_derived_ms`` / ``place_known_ms``: what ``epd proxy``
  does for one held ``--place-size`` PNG (phase e's size by default), nothing
  pulled: :meth:`EncoderCacheClient.place` by a client that never placed it,
  with the derived Lookup off (an Encode carrying its bytes, a hit on the
  encoder: what an image under ``DERIVE_MIN_BYTES`` costs) and on (a Lookup of
  the mm_hash it derives; new clients each round, handshaken before the round),
  and by a client that placed it before (a Lookup of the mm_hash its encoder
  answered then); the leases given back outside the timing;
- ``lookup_miss_rpc_ms``: one raw ``Lookup`` of an mm_hash the encoder does not
  have; ``place_new_sent_ms`` / ``place_new_derived_ms``: the same two fresh
  clients each place a ``--place-size`` PNG no one sent before (the tower runs),
  without and with the derived Lookup: the difference is what that Lookup adds
  before the Encode of a new image.

Targets: ``lookup_ms <= 1.5 x floor_ms``, ``encode_cached_ms <= 2 x send_ms``.

Usage: ``python bench/hit_path.py [--transport auto|nixl|mock] [--items 30] [--repeats 21]``.
The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pull_throughput import BareReader, timed  # noqa: E402

from common.config.shared import DERIVE_MIN_BYTES  # noqa: E402
from common.malloc import keep_freed_memory  # noqa: E402
from common.wire import PROTOCOL_VERSION, pb2, pb2_grpc  # noqa: E402
from epd_harness.media import image_bytes  # noqa: E402
from epd_harness.procs import bench_encoder_args, start_encoder  # noqa: E402
from prefill_client.consumer.client import EncoderCacheClient  # noqa: E402
from prefill_client.consumer.messages import MediaSpec, encode_request_bytes  # noqa: E402

MODEL_ID = "tiny-qwen3-vl"
RPC_TIMEOUT_S = 30.0
MESSAGE_LIMIT = 64 << 20
ECHO_METHOD = "/epd.bench.Echo/Send"
OPTIONS = [("grpc.max_receive_message_length", MESSAGE_LIMIT), ("grpc.max_send_message_length", MESSAGE_LIMIT)]


def serve_echo() -> None:
    """Answer every ``Send`` with an empty message; print the port, stop when stdin closes."""

    async def main() -> None:
        async def send(request: bytes, context: grpc.aio.ServicerContext) -> bytes:  # type: ignore[type-arg]
            return b""

        server = grpc.aio.server(options=OPTIONS)
        handler = grpc.unary_unary_rpc_method_handler(send)  # no (de)serializers: raw bytes
        echo = grpc.method_handlers_generic_handler("epd.bench.Echo", {"Send": handler})
        server.add_generic_rpc_handlers((echo,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(port, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        await server.stop(None)

    asyncio.run(main())


def median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e3, 3)


def run(args: argparse.Namespace, workdir: Path) -> dict[str, object]:
    images = [image_bytes(args.size, args.size, seed=7000 + i) for i in range(args.items)]
    tokens = (args.size // 32) ** 2
    place_blocks = -(-(args.place_size // 32) ** 2 // args.block_size)
    # The held items, the held placed image, and each round's two new images (nothing evicted).
    blocks = args.items * -(-tokens // args.block_size) + place_blocks * (1 + 2 * (args.repeats + 2)) + 2
    encoder_args, echo_args = ((), ()) if args.keep_freed_memory else (
        ("--keep-freed-memory", "false"), ("--no-keep-freed-memory",))
    encoder = start_encoder(workdir, *bench_encoder_args(args.transport, blocks, args.block_size), *encoder_args)
    transport = encoder.transport
    echo = subprocess.Popen([sys.executable, __file__, "--serve-echo", *echo_args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    target = encoder.target
    try:
        echo_port = int(echo.stdout.readline()) if echo.stdout else 0
        client = EncoderCacheClient(target, MODEL_ID, transport_kind=transport, local_cache_blocks=0,
                                    landing_blocks=blocks, rpc_timeout_s=RPC_TIMEOUT_S)
        channel = grpc.insecure_channel(target, options=OPTIONS)
        echo_channel = grpc.insecure_channel(f"127.0.0.1:{echo_port}", options=OPTIONS)
        try:
            pulled = client.encode([MediaSpec.image(b) for b in images])  # cache them (misses)
            hashes = [p.mm_hash for p in pulled]
            stub = pb2_grpc.EncoderCacheServiceStub(channel)
            send = echo_channel.unary_unary(ECHO_METHOD)  # raw bytes both ways
            # What the client sends for these images (without an incarnation id).
            request_bytes = encode_request_bytes(MODEL_ID, "bench", "", [MediaSpec.image(b) for b in images])
            hs = stub.Handshake(pb2.HandshakeRequest(protocol_version=PROTOCOL_VERSION, model_id=MODEL_ID),
                                timeout=RPC_TIMEOUT_S)
            landing = torch.empty((blocks, hs.layout.bytes_per_block), dtype=torch.uint8)
            bare = BareReader(transport, hs, landing)
            lookup_request = pb2.LookupRequest(model_id=MODEL_ID, consumer_id="bench-floor", mm_hashes=hashes,
                                               incarnation_id=hs.incarnation_id)

            samples: dict[str, list[float]] = {k: [] for k in (
                "lookup", "lookup_rpc", "bare_read", "encode_cached", "send", "place_sent", "place_derived",
                "place_known", "lookup_miss_rpc", "place_new_sent", "place_new_derived")}
            held = image_bytes(args.place_size, args.place_size, seed=7999)
            client.release_placed(client.place([MediaSpec.image(held)]))  # cached, and this client knows it
            placers = [(new_placer(target, transport, derive=False), new_placer(target, transport))
                       for _ in range(args.repeats + 2)]
            miss_request = pb2.LookupRequest(model_id=MODEL_ID, consumer_id="bench-floor", mm_hashes=["0" * 32],
                                             incarnation_id=hs.incarnation_id)
            for i in range(args.repeats + 2):
                sender, deriver = placers[i]
                new = [image_bytes(args.place_size, args.place_size, seed=8000 + 2 * i + k) for k in range(2)]
                steps = ((sender, "place_sent", held), (deriver, "place_derived", held), (client, "place_known", held),
                         (sender, "place_new_sent", new[0]), (deriver, "place_new_derived", new[1]))
                for who, name, data in steps:
                    started = time.perf_counter()
                    placed = who.place([MediaSpec.image(data)])
                    times_place = time.perf_counter() - started
                    who.release_placed(placed)
                    if i >= 2:
                        samples[name].append(times_place)
                sender.close()
                deriver.close()
                times = {"lookup": timed(lambda: client.lookup(hashes, require=True)),
                         "lookup_miss_rpc": timed(lambda: stub.Lookup(miss_request, timeout=RPC_TIMEOUT_S))}
                started = time.perf_counter()
                resp = stub.Lookup(lookup_request, timeout=RPC_TIMEOUT_S)
                times["lookup_rpc"] = time.perf_counter() - started
                remote = np.fromiter((b for r in resp.results for b in r.location.block_ids), dtype=np.int32)
                local = np.arange(len(remote), dtype=np.int32)
                times["bare_read"] = timed(lambda: bare.read(remote, local))
                stub.Release(pb2.ReleaseRequest(consumer_id="bench-floor",
                                                lease_ids=[r.location.lease_id for r in resp.results]),
                             timeout=RPC_TIMEOUT_S)
                times["encode_cached"] = timed(lambda: client.encode([MediaSpec.image(b) for b in images]))
                times["send"] = timed(lambda: send(request_bytes, timeout=RPC_TIMEOUT_S))
                if i >= 2:
                    for key, seconds in times.items():
                        samples[key].append(seconds)
            sources = {p.source for p in client.encode([MediaSpec.image(b) for b in images])}
        finally:
            client.close()
            channel.close()
            echo_channel.close()
    finally:
        if echo.stdin:
            echo.stdin.close()
        echo.wait(30)
        encoder.terminate()
    ms = {key: median_ms(values) for key, values in samples.items()}
    floor = round(ms["lookup_rpc"] + ms["bare_read"], 3)
    return {
        "transport": transport, "items": args.items, "image_size": args.size,
        "request_mb": round(len(request_bytes) / 1e6, 2),
        "rows_mb": round(len(remote) * hs.layout.bytes_per_block / 1e6, 2),
        "encode_cached_sources": sorted(sources),
        "lookup_ms": ms["lookup"], "floor_ms": floor, "lookup_rpc_ms": ms["lookup_rpc"],
        "bare_read_ms": ms["bare_read"], "encode_cached_ms": ms["encode_cached"], "send_ms": ms["send"],
        "lookup_over_floor": round(ms["lookup"] / floor, 2),
        "encode_cached_over_send": round(ms["encode_cached"] / ms["send"], 2),
        "targets": {"lookup_ms <= 1.5 x floor_ms": ms["lookup"] <= 1.5 * floor,
                    "encode_cached_ms <= 2 x send_ms": ms["encode_cached"] <= 2 * ms["send"]},
        "place_size": args.place_size, "place_bytes": len(held), "derive_min_bytes": DERIVE_MIN_BYTES,
        "place_sent_ms": ms["place_sent"], "place_derived_ms": ms["place_derived"],
        "place_known_ms": ms["place_known"], "lookup_miss_rpc_ms": ms["lookup_miss_rpc"],
        "place_new_sent_ms": ms["place_new_sent"], "place_new_derived_ms": ms["place_new_derived"],
        "place_known_over_sent": round(ms["place_known"] / ms["place_sent"], 2),
        "place_derived_over_sent": round(ms["place_derived"] / ms["place_sent"], 2),
        "repeats": args.repeats,
    }


def new_placer(target: str, transport: str, *, derive: bool = True) -> EncoderCacheClient:
    """A client as ``epd proxy`` makes one (places, pulls nothing), handshaken; ``derive``: with the
    derived Lookup at its default size (else never)."""
    placer = EncoderCacheClient(target, MODEL_ID, transport_kind=transport, landing_blocks=1, local_cache_blocks=0,
                                rpc_timeout_s=RPC_TIMEOUT_S,
                                lookup_min_bytes=DERIVE_MIN_BYTES if derive else sys.maxsize)
    placer.media_params()
    return placer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--transport", default="auto", help="auto, nixl or mock")
    parser.add_argument("--items", type=int, default=30)
    parser.add_argument("--size", type=int, default=512, help="image side in pixels")
    parser.add_argument("--block-size", type=int, default=256, help="the encoder's rows per block")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--place-size", type=int, default=224, help="side in pixels of the image placed")
    parser.add_argument("--serve-echo", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-keep-freed-memory", dest="keep_freed_memory", action="store_false",
                        help="glibc's default malloc thresholds here, in the echo server and in the encoder")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    # As `epd encoder` and `epd prefill` do at start (--keep-freed-memory, on by default): the echo
    # server and this client process alike, so both sides of every comparison run with the same malloc.
    if args.keep_freed_memory:
        keep_freed_memory()
    if args.serve_echo:
        serve_echo()
        return
    with tempfile.TemporaryDirectory(prefix="epd-hit-path-") as tmp:
        out = run(args, Path(tmp))
    print(f"lookup {out['lookup_ms']} ms vs floor {out['floor_ms']} ms ({out['lookup_over_floor']}x); "
          f"encode of cached items {out['encode_cached_ms']} ms vs send {out['send_ms']} ms "
          f"({out['encode_cached_over_send']}x); place of a held {out['place_size']} px image "
          f"{out['place_known_ms']} ms known, {out['place_derived_ms']} ms derived vs {out['place_sent_ms']} ms sent; "
          f"a Lookup that misses {out['lookup_miss_rpc_ms']} ms", flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
