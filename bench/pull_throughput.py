"""Pull throughput: the verified pull against a bare NIXL READ and a memcpy of the same bytes (run by hand).

A producer process (this script with ``--serve``) registers a cache buffer
per block size through :class:`ProducerTransport`; this process pulls random
blocks from it three ways, round-robin in the same run so a noisy neighbour
slows all of them alike, and reports the median of the repeats:

- ``verified_gbps``: the project's pull through :class:`ConsumerTransport`
  as the client makes it (``ProducerPeer.read_blocks_and_tags``): the block
  READ into landing blocks, then the tag READ (a second READ), then the
  fingerprint and generation checks. As in the client, the lease
  release is not on the tag READ (the client queues it for a batched Release
  RPC off the pull path); ``--release-on-tag-read`` puts it back as the READ's
  NIXL notification, to show what that costs;
- ``bare_gbps``: one ``make_prepped_xfer("READ")`` of the same blocks on a
  separate agent with its own prepped dlists, busy-polled until done;
- ``memcpy_gbps``: ``memmove`` of the same number of blocks of the same size
  between local landing blocks, one call per block.

Rates count block bytes only (tags are overhead): ``*_gbps`` from the median
round, ``*_best_gbps`` from the fastest (least disturbed by other load);
``verified_us`` and ``bare_us`` are the median times of one pull.

Rows are ``--row-bytes`` wide (4096 by default: fat_dim 2048 in bf16). With
``--item-rows N`` each block size pulls one item of N rows instead of the
``--batches``: ``ceil(N / rows per block)`` blocks, padding included, as the
encoder lays an item out; ``item_gbps`` then counts the item's own rows only,
so block sizes compare by what a worker gets (``bench/layout.py`` measures
what they waste). Each block size then has its own producer process, and
every round pulls from all of them in turn: the sizes are compared within
the same rounds, as the three ways are.

Targets: verified >= 90 % of bare for batches of 8+ blocks of 1 MiB or more,
and >= 70 % for one block of 1 MiB. Memory: the producer buffer
holds ``max batch + 2`` blocks of the largest size, the consumer ``max batch
+ 1`` landing blocks shared by all three measurements: about 2.1 GiB of
buffers at 16 MiB x 64.

Usage: ``python bench/pull_throughput.py [--transport auto|nixl|mock] [--quick]
[--block-sizes 65536,1048576] [--batches 1,8,64] [--repeats 15] [--min-seconds 1]
[--row-bytes 4096] [--item-rows N]``. The last line of stdout is one JSON object: ``{"transport",
"results": [{"block_bytes", "rows_per_block", "batch", "verified_gbps", "bare_gbps",
"memcpy_gbps", "rounds", "verified_us", "bare_us"}], ...}`` (with ``--item-rows``, each
result also has ``item_rows`` and ``item_gbps``).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import select
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.errors import EpdError  # noqa: E402
from common.transport import (  # noqa: E402
    ConsumerTransport,
    ProducerPeer,
    ProducerTransport,
    TransferState,
    create_agent,
    encode_release_notification,
    resolve_transport_kind,
)
from common.transport.binding import LOCAL_AGENT, agent_name_of  # noqa: E402
from common.transport.regions import RegionDesc  # noqa: E402
from common.wire import pb2  # noqa: E402

DEFAULT_ROW_BYTES = 4096  # fat_dim 2048 in bf16
DEFAULT_SIZES = (64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)
DEFAULT_BATCHES = (1, 4, 8, 16, 64)
QUICK_SIZES = (64 << 10, 1 << 20, 4 << 20)
QUICK_BATCHES = (1, 8, 32)
PREFIX = "BENCH "
GENERATION = 1
# Timed rounds per point. With 5, one disturbed round on a shared host moved the median of an
# 8-block point by several percent from run to run (BENCHMARKS.md, "One call for both READs").
DEFAULT_REPEATS = 15
# ...and more until a point's timed rounds have taken this long (BENCHMARKS.md, "Both READs under one
# lock hold"): 1 MiB x 1 runs 2,000-3,000 rounds a second, so 15 took under 10 ms, and one noisy run
# moved its median from about 0.8 to 0.68 of bare.
DEFAULT_MIN_SECONDS = 1.0
MAX_ROUNDS = 5000


def fingerprint(block: int) -> int:
    return block * 7919 + 1


# --- producer process --------------------------------------------------------------------------


def serve(kind: str, progress_interval_s: float | Literal["auto"] | None) -> None:
    """Producer: on ``layout BLOCK_BYTES NUM_BLOCKS ROW_BYTES``, register a fresh buffer, print its handshake."""
    transport: ProducerTransport | None = None
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], 0.02)
        if transport is not None:
            transport.drain_notifications()  # lease releases: drained like the encoder does
        if not ready:
            continue
        line = sys.stdin.readline()
        if not line:
            break
        _, block_bytes, num_blocks, row_bytes = line.split()
        if transport is not None:
            transport.close()
        transport = ProducerTransport(kind, name_prefix="bench-producer", progress_interval_s=progress_interval_s)
        alloc = transport.allocator or (lambda shape, dtype: torch.zeros(shape, dtype=dtype))
        rows, n, fat_dim = int(block_bytes) // int(row_bytes), int(num_blocks), int(row_bytes) // 2
        buffer = alloc((n, rows, fat_dim), torch.bfloat16)
        buffer.view(torch.int16).view(n, -1)[:, :] = torch.arange(n, dtype=torch.int16)[:, None]  # block b: b
        stamps = alloc((n, 2), torch.int64)  # per block: tag, generation
        stamps[:, 0].copy_(torch.tensor([fingerprint(b) for b in range(n)], dtype=torch.int64))
        stamps[:, 1].fill_(GENERATION)
        transport.register(buffer, stamps)
        layout = pb2.CacheLayout(num_blocks=n, block_size=rows, fat_dim=fat_dim, dtype=pb2.D_TYPE_BFLOAT16,
                                 scratch_block_id=n - 1, bytes_per_block=int(block_bytes))
        hs = transport.fill_handshake(pb2.HandshakeResponse(incarnation_id=transport.incarnation_id,
                                                            layout=layout))
        sys.stdout.write(PREFIX + hs.SerializeToString().hex() + "\n")
        sys.stdout.flush()
    if transport is not None:
        transport.close()


class Producer:
    def __init__(self, kind: str, progress_us: int) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", "--transport", kind,
                                      "--producer-progress-us", str(progress_us)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)

    def layout(self, block_bytes: int, num_blocks: int, row_bytes: int,
               timeout_s: float = 120.0) -> pb2.HandshakeResponse:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"layout {block_bytes} {num_blocks} {row_bytes}\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 1.0)
            if not ready:
                continue
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("producer exited")
            if line.startswith(PREFIX):
                hs: pb2.HandshakeResponse = pb2.HandshakeResponse.FromString(
                    bytes.fromhex(line[len(PREFIX):].strip()))
                return hs
        raise TimeoutError(f"producer did not register {num_blocks} blocks of {block_bytes} bytes")

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


# --- consumer side ------------------------------------------------------------------------------


class BareReader:
    """The minimal NIXL client: its own agent, landing and prepped dlists; one READ, busy-polled."""

    def __init__(self, kind: str, hs: pb2.HandshakeResponse, landing: torch.Tensor) -> None:
        # Like the consumer's agent: no NIXL progress thread (it would spin a core); this loop polls.
        options = {"progress_thread": False} if kind == "nixl" else {}
        self.agent = create_agent(kind, f"bench-bare-{time.monotonic_ns()}", **options)
        self.agent.register_memory(landing)
        name = agent_name_of(self.agent.add_remote_agent(hs.agent_metadata))
        buffer = RegionDesc.from_proto(hs.buffer_region, "buffer_region")
        self.remote = self.agent.prep_xfer_dlist(name, buffer.descriptors(), "DRAM")
        self.local = self.agent.prep_xfer_dlist(LOCAL_AGENT, RegionDesc.of_tensor(landing).descriptors(), "DRAM")
        self.agent.make_connection(name)

    def read(self, remote: np.ndarray, local: np.ndarray) -> None:
        handle = self.agent.make_prepped_xfer("READ", self.local, local, self.remote, remote)
        state = TransferState.parse(self.agent.transfer(handle))
        deadline = time.monotonic() + 60
        while state is TransferState.PROCESSING and time.monotonic() < deadline:
            state = TransferState.parse(self.agent.check_xfer_state(handle))
        self.agent.release_xfer_handle(handle)
        if state is not TransferState.DONE:
            raise RuntimeError(f"bare READ ended {state}")


def verified_pull(peer: ProducerPeer, remote: np.ndarray, local: np.ndarray, expected: np.ndarray,
                  release: bool = False) -> None:
    """The project's pull: blocks, then tags and generations, then the checks (``release``: the
    lease release rides on the tag READ as its notification)."""
    tags: list[int]
    gens: list[int]
    if release:
        deadline = time.monotonic() + 60
        peer.read_blocks(remote, local, deadline)
        tag_array, gen_array = peer.read_tags(remote, deadline, notif=encode_release_notification([len(remote)]))
        tags, gens = tag_array.tolist(), gen_array.tolist()
    else:  # as the client pulls
        tags, gens = peer.read_blocks_and_tags(remote, local, 60.0)
    # The same comparisons as prefill_client.consumer.verify.verify_batch: two list compares.
    if not (tags == expected[remote].tolist() and gens == [GENERATION] * len(remote)):
        raise RuntimeError(f"verification failed: tags {tags} for blocks {remote}")


def memcpy(pairs: list[tuple[int, int]], nbytes: int) -> None:
    for dst, src in pairs:
        ctypes.memmove(dst, src, nbytes)


def timed(fn: Callable[..., object], *args: object) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def check_contents(landing: torch.Tensor, local: np.ndarray, remote: np.ndarray) -> None:
    """Block b of the producer holds int16 b everywhere (checked block by block: bounded memory)."""
    for lid, rid in zip(local.tolist(), remote.tolist(), strict=True):
        if not bool((landing[lid].view(torch.int16) == rid).all()):
            raise RuntimeError(f"block {rid} landed in landing block {lid} with the wrong contents")


def clear(landing: torch.Tensor, local: np.ndarray) -> None:
    for lid in local.tolist():
        landing[lid].zero_()


class Rig:
    """One block size: the producer's buffer, a consumer connected to it, and a bare reader on its landing."""

    def __init__(self, kind: str, producer: Producer, block_bytes: int, row_bytes: int, max_batch: int) -> None:
        self.block_bytes, self.row_bytes = block_bytes, row_bytes
        self.num_blocks = max_batch + 2  # random picks among max_batch + 1 usable blocks, plus scratch
        hs = producer.layout(block_bytes, self.num_blocks, row_bytes)
        # One spare landing block: the memcpy shifts the batch's blocks by one through it.
        self.consumer = ConsumerTransport(kind, num_landing_blocks=max_batch + 1, name_prefix="bench-consumer")
        self.peer = self.consumer.connect(hs)
        self.landing = self.consumer.landing
        self.bare = BareReader(kind, hs, self.landing.tensor)  # same landing memory, its own agent and dlists
        self.expected = np.array([fingerprint(b) for b in range(self.num_blocks)], dtype=np.int64)
        spare = self.landing.acquire(1)
        assert spare is not None
        self.spare_ids = spare
        self.spare = int(spare[0])

    def close(self) -> None:
        self.landing.release(self.spare_ids)
        self.consumer.close()


class Point:
    """``batch`` random blocks of one rig, pulled three ways once per round; the timed rounds' samples."""

    def __init__(self, rig: Rig, batch: int) -> None:
        self.rig, self.batch = rig, batch
        local = rig.landing.acquire(batch)
        assert local is not None
        self.local = local
        chain = [rig.landing.tensor[i].data_ptr() for i in [rig.spare, *local.tolist()]]
        self.pairs = list(zip(chain[:-1], chain[1:], strict=True))  # batch copies between distinct blocks
        self.samples: dict[str, list[float]] = {"verified": [], "bare": [], "memcpy": []}

    def round(self, i: int, rng: np.random.Generator, release: bool) -> None:
        """Round ``i``: the first two warm up and are not counted."""
        rig, local = self.rig, self.local
        remote = rng.choice(rig.num_blocks - 1, size=self.batch, replace=False).astype(np.int32)
        # Both READs take the same blocks, and the second finds them warm in the CPU caches:
        # alternate which goes second.
        reads = {"verified": lambda: verified_pull(rig.peer, remote, local, rig.expected, release),
                 "bare": lambda: rig.bare.read(remote, local)}
        order = ["verified", "bare"] if i % 2 == 0 else ["bare", "verified"]
        times = {name: timed(reads[name]) for name in order}
        times["memcpy"] = timed(memcpy, self.pairs, rig.block_bytes)
        if i >= 2:
            for key, seconds in times.items():
                self.samples[key].append(seconds)

    def finish(self, rng: np.random.Generator, item_rows: int | None) -> dict[str, float | int]:
        """Check what lands through both paths (untimed), give the landing blocks back, and report."""
        rig, local, batch, samples = self.rig, self.local, self.batch, self.samples
        remote = rng.choice(rig.num_blocks - 1, size=batch, replace=False).astype(np.int32)
        clear(rig.landing.tensor, local)
        verified_pull(rig.peer, remote, local, rig.expected)
        check_contents(rig.landing.tensor, local, remote)
        clear(rig.landing.tensor, local)
        rig.bare.read(remote, local)
        check_contents(rig.landing.tensor, local, remote)
        rig.landing.release(local)
        nbytes = batch * rig.block_bytes
        row: dict[str, float | int] = {"block_bytes": rig.block_bytes,
                                       "rows_per_block": rig.block_bytes // rig.row_bytes, "batch": batch}
        for key, values in samples.items():
            row[f"{key}_gbps"] = round(nbytes / statistics.median(values) / 1e9, 3)
        for key, values in samples.items():
            row[f"{key}_best_gbps"] = round(nbytes / min(values) / 1e9, 3)
        row["rounds"] = len(samples["verified"])
        row["verified_us"] = round(statistics.median(samples["verified"]) * 1e6, 1)
        row["bare_us"] = round(statistics.median(samples["bare"]) * 1e6, 1)
        item = ""
        if item_rows is not None:
            row["item_rows"] = item_rows
            row["item_gbps"] = round(item_rows * rig.row_bytes / statistics.median(samples["verified"]) / 1e9, 3)
            item = f"  item of {item_rows} rows: {row['verified_us']:.0f} us, {row['item_gbps']:.2f} GB/s"
        print(f"{rig.block_bytes / 1024:>7g} KiB x {batch:>2}: verified {row['verified_gbps']:7.2f} GB/s  "
              f"bare {row['bare_gbps']:7.2f}  memcpy {row['memcpy_gbps']:7.2f}  "
              f"ratio {row['verified_gbps'] / row['bare_gbps']:.2f}{item}", flush=True)
        return row


def measure(points: list[Point], repeats: int, min_seconds: float, rng: np.random.Generator, release: bool,
            item_rows: int | None) -> list[dict[str, float | int]]:
    """Round-robin over ``points``: each round pulls every point once, so load from other work hits all alike.

    Two warm-up rounds, then at least ``repeats`` timed rounds, and more until the timed rounds
    have taken ``min_seconds`` (at most MAX_ROUNDS timed rounds): a point of small pulls gets
    thousands of rounds for the price of a few large ones, and its median moves less with one
    disturbed round.
    """
    def round_of_all(i: int) -> None:
        for point in points:
            point.round(i, rng, release)

    round_of_all(0)
    round_of_all(1)
    started = time.monotonic()
    timed = 0
    while timed < repeats or (timed < MAX_ROUNDS and time.monotonic() - started < min_seconds):
        round_of_all(timed + 2)
        timed += 1
    return [point.finish(rng, item_rows) for point in points]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--transport", default="auto", help="auto, nixl or mock")
    parser.add_argument("--quick", action="store_true", help="three sizes up to 4 MiB, batches 1, 8, 32")
    parser.add_argument("--block-sizes", help="comma-separated bytes per block (multiples of --row-bytes)")
    parser.add_argument("--row-bytes", type=int, default=DEFAULT_ROW_BYTES,
                        help="bytes per cache row (fat_dim x 2, bf16); the tiny model's rows are 384")
    parser.add_argument("--item-rows", type=int, default=None,
                        help="pull one item of this many rows per block size (its whole blocks) instead of "
                             "--batches")
    parser.add_argument("--batches", help="comma-separated blocks per pull")
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS,
                        help=f"timed rounds per point, median reported (default {DEFAULT_REPEATS})")
    parser.add_argument("--min-seconds", type=float, default=DEFAULT_MIN_SECONDS,
                        help="time more rounds past --repeats until a point's timed rounds have taken this long "
                             f"(at most {MAX_ROUNDS} rounds; default {DEFAULT_MIN_SECONDS})")
    parser.add_argument("--producer-progress-us", type=int, default=-1,
                        help="producer progress: -1 auto (the default), 0 NIXL's own (spinning) thread, "
                             "N a poller every N microseconds")
    parser.add_argument("--release-on-tag-read", action="store_true",
                        help="send a lease release as the tag READ's NIXL notification (the old way; shows "
                             "what waiting for the producer's progress costs)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    kind = resolve_transport_kind(args.transport).value
    progress_s: float | Literal["auto"] | None = (
        "auto" if args.producer_progress_us < 0 else args.producer_progress_us / 1e6 or None)
    if args.serve:
        serve(kind, progress_s)
        return
    sizes = [int(s) for s in args.block_sizes.split(",")] if args.block_sizes else list(
        QUICK_SIZES if args.quick else DEFAULT_SIZES)
    batches = sorted({int(b) for b in args.batches.split(",")} if args.batches else set(
        QUICK_BATCHES if args.quick else DEFAULT_BATCHES))
    repeats = args.repeats
    if repeats <= 0:
        parser.error(f"--repeats must be > 0, got {repeats}")
    if args.min_seconds < 0:
        parser.error(f"--min-seconds must be >= 0, got {args.min_seconds}")
    row_bytes = args.row_bytes
    if row_bytes <= 0 or row_bytes % 2:
        parser.error(f"--row-bytes must be a positive even number (bf16 rows), got {row_bytes}")
    if any(s % row_bytes or s <= 0 for s in sizes) or any(b <= 0 for b in batches):
        parser.error(f"block sizes must be positive multiples of {row_bytes} and batches positive")
    if args.item_rows is not None and args.item_rows <= 0:
        parser.error(f"--item-rows must be > 0, got {args.item_rows}")
    rng = np.random.default_rng(0)
    started = time.monotonic()
    results: list[dict[str, float | int]] = []
    # With --item-rows every block size has its own producer and all of them take turns in each round;
    # otherwise one producer registers one size after the other, whose batches are measured in turn.
    producers = [Producer(kind, args.producer_progress_us) for _ in (sizes if args.item_rows else sizes[:1])]
    try:
        if args.item_rows:
            item_batches = [-(-args.item_rows // (size // row_bytes)) for size in sizes]  # whole blocks
            rigs = [Rig(kind, producer, size, row_bytes, batch)
                    for producer, size, batch in zip(producers, sizes, item_batches, strict=True)]
            points = [Point(rig, batch) for rig, batch in zip(rigs, item_batches, strict=True)]
            results = measure(points, repeats, args.min_seconds, rng, args.release_on_tag_read, args.item_rows)
            for rig in rigs:
                rig.close()
        else:
            for size in sizes:
                rig = Rig(kind, producers[0], size, row_bytes, max(batches))
                for batch in batches:
                    results += measure([Point(rig, batch)], repeats, args.min_seconds, rng, args.release_on_tag_read,
                                       None)
                rig.close()
    except EpdError as exc:
        print(f"transport error: {exc}", file=sys.stderr)
        raise
    finally:
        for producer in producers:
            producer.close()
    def ratios(keep: Callable[[dict[str, float | int]], bool]) -> list[float]:
        return [float(r["verified_gbps"]) / float(r["bare_gbps"]) for r in results if keep(r)]

    batched = ratios(lambda r: int(r["batch"]) >= 8 and int(r["block_bytes"]) >= 1 << 20)
    single = ratios(lambda r: int(r["batch"]) == 1 and int(r["block_bytes"]) == 1 << 20)
    print(json.dumps({
        "transport": kind,
        "release_notification": args.release_on_tag_read,
        "producer_progress": "auto" if args.producer_progress_us < 0 else (
            "nixl-thread" if args.producer_progress_us == 0 else f"poller-{args.producer_progress_us}us"),
        "row_bytes": row_bytes,
        "results": results,
        "repeats": repeats,
        "min_seconds": args.min_seconds,
        "seconds": round(time.monotonic() - started, 1),
        "target": {"rule": "verified_gbps >= 0.9 * bare_gbps for batch >= 8 and block_bytes >= 1 MiB",
                   "worst_ratio": round(min(batched), 3) if batched else None,
                   "met": bool(batched) and min(batched) >= 0.9},
        "target_single": {"rule": "verified_gbps >= 0.7 * bare_gbps for one block of 1 MiB",
                          "ratio": round(min(single), 3) if single else None,
                          "met": bool(single) and min(single) >= 0.7},
    }))


if __name__ == "__main__":
    main()
