"""Step 3, throughput: verified pull, bare READ, copy in device memory (device check step process; driver launches).

``bench/pull_throughput.py``'s measurement with the producer's blocks and the landing blocks
on the device. The step process runs the consumer side; its producer is a process of its own
(``--role producer``, a grandchild of the driver) that serves the bench's producer with its
regions allocated on the device.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from bench import pull_throughput as pull_bench
from bench.device.report import Partial, ucx_protocols
from bench.device.shapes import ENTRY, Shapes, sync
from common.transport import (ConsumerTransport, ProducerTransport, RegionDesc, create_agent,
                              resolve_transport_kind)
from common.transport.binding import LOCAL_AGENT, agent_name_of
from common.wire import pb2

if TYPE_CHECKING:
    from bench.device.driver import Run


class DeviceProducerTransport(ProducerTransport):
    """bench/pull_throughput.py's producer with its two regions in ``DEVICE`` memory."""

    DEVICE = "cpu"

    @property
    def allocator(self) -> Any:
        device = torch.device(self.DEVICE)
        return lambda shape, dtype: torch.zeros(shape, dtype=dtype, device=device)


def role_producer(args: argparse.Namespace) -> None:
    """The producer process of the throughput step: ``pull_throughput.serve`` with device regions."""
    if args.device != "cpu":  # on the CPU the bench's own allocation (shared memory for the mock) stands
        DeviceProducerTransport.DEVICE = args.device
        setattr(pull_bench, "ProducerTransport", DeviceProducerTransport)  # what serve() allocates through
    pull_bench.serve(args.transport, "auto")


class DeviceProducer(pull_bench.Producer):
    def __init__(self, kind: str, device: str) -> None:  # noqa: D107 - the bench's producer, our process
        self.proc = subprocess.Popen([sys.executable, str(ENTRY), "--role", "producer", "--transport", kind,
                                      "--device", device], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1)


class DeviceBareReader(pull_bench.BareReader):
    """The bench's bare READ, with each side's dlist of its region's own memory type (VRAM or DRAM)."""

    def __init__(self, kind: str, hs: pb2.HandshakeResponse, landing: torch.Tensor) -> None:  # noqa: D107
        options = {"progress_thread": False} if kind == "nixl" else {}
        self.agent = create_agent(kind, f"device-check-bare-{time.monotonic_ns()}", **options)
        self.agent.register_memory(landing)
        name = agent_name_of(self.agent.add_remote_agent(hs.agent_metadata))
        remote, local = RegionDesc.from_proto(hs.buffer_region, "buffer_region"), RegionDesc.of_tensor(landing)
        self.remote = self.agent.prep_xfer_dlist(name, remote.descriptors(), remote.memory.value)
        self.local = self.agent.prep_xfer_dlist(LOCAL_AGENT, local.descriptors(), local.memory.value)
        self.agent.make_connection(name)


class DeviceRig(pull_bench.Rig):
    """The bench's rig (one block size) with the consumer's landing blocks on ``device``."""

    def __init__(self, kind: str, producer: pull_bench.Producer, block_bytes: int, row_bytes: int, max_batch: int,
                 device: torch.device) -> None:  # noqa: D107
        self.block_bytes, self.row_bytes = block_bytes, row_bytes
        self.num_blocks = max_batch + 2
        hs = producer.layout(block_bytes, self.num_blocks, row_bytes)
        self.memory = (RegionDesc.from_proto(hs.buffer_region, "buffer_region").memory.value,
                       RegionDesc.from_proto(hs.stamp_region, "stamp_region").memory.value)
        self.consumer = ConsumerTransport(kind, num_landing_blocks=max_batch + 1, device=device,
                                          name_prefix="device-check-consumer")
        self.peer = self.consumer.connect(hs)
        self.landing = self.consumer.landing
        self.bare = DeviceBareReader(kind, hs, self.landing.tensor)
        self.expected = np.array([pull_bench.fingerprint(b) for b in range(self.num_blocks)], dtype=np.int64)
        spare = self.landing.acquire(1)
        assert spare is not None
        self.spare_ids = spare
        self.spare = int(spare[0])


class DevicePoint(pull_bench.Point):
    """The bench's point; its copy is ``Tensor.copy_`` between the landing blocks, waited for."""

    def __init__(self, rig: DeviceRig, batch: int) -> None:  # noqa: D107
        super().__init__(rig, batch)
        blocks = [rig.landing.tensor[i] for i in [rig.spare, *self.local.tolist()]]
        self.blocks = list(zip(blocks[:-1], blocks[1:], strict=True))  # (dst, src), as the bench's memmove
        self.device = rig.landing.tensor.device

    def copy(self) -> None:
        for dst, src in self.blocks:
            dst.copy_(src)
        sync(self.device)

    def round(self, i: int, rng: np.random.Generator, release: bool) -> None:
        rig, local = self.rig, self.local
        remote = rng.choice(rig.num_blocks - 1, size=self.batch, replace=False).astype(np.int32)
        reads = {"verified": lambda: pull_bench.verified_pull(rig.peer, remote, local, rig.expected, release),
                 "bare": lambda: rig.bare.read(remote, local)}
        order = ["verified", "bare"] if i % 2 == 0 else ["bare", "verified"]
        times = {name: pull_bench.timed(reads[name]) for name in order}
        times["memcpy"] = pull_bench.timed(self.copy)
        if i >= 2:
            for key, seconds in times.items():
                self.samples[key].append(seconds)


def role_throughput(p: Partial, shapes: Shapes, args: argparse.Namespace) -> None:
    device = torch.device(shapes.device)
    kind = resolve_transport_kind(args.transport).value
    rng = np.random.default_rng(0)
    p.data.update(transport=kind, device=str(device), row_bytes=shapes.row_bytes, repeats=shapes.repeats,
                  min_seconds=shapes.min_seconds, results=[],
                  copy="Tensor.copy_ of the same blocks between landing blocks"
                       + (" (device to device)" if device.type == "cuda" else " (host memory)"))
    producer = DeviceProducer(kind, shapes.device)
    try:
        for size in shapes.block_sizes:
            rig = DeviceRig(kind, producer, size, shapes.row_bytes, max(shapes.batches), device)
            p.data["memory"] = {"producer_blocks": rig.memory[0], "producer_stamps": rig.memory[1],
                                "landing": RegionDesc.of_tensor(rig.landing.tensor).memory.value}
            for batch in shapes.batches:
                (row,) = pull_bench.measure([DevicePoint(rig, batch)], shapes.repeats, shapes.min_seconds, rng,
                                            False, None)
                row = {("copy" + k.removeprefix("memcpy") if k.startswith("memcpy") else k): v for k, v in row.items()}
                row["verified_over_bare"] = round(float(row["verified_gbps"]) / float(row["bare_gbps"]), 3)
                row["verified_over_copy"] = round(float(row["verified_gbps"]) / float(row["copy_gbps"]), 3)
                p.data["results"].append(row)
                p.save()
            rig.close()
    finally:
        producer.close()
    results = p.data["results"]
    ratios = [r["verified_over_bare"] for r in results]
    p.data["worst_verified_over_bare"] = min(ratios)
    big = [r["verified_over_bare"] for r in results if r["batch"] >= 8 and r["block_bytes"] >= 1 << 20]
    p.data["worst_verified_over_bare_8x1MiB_up"] = min(big) if big else None
    p.data["ok"] = len(results) == len(shapes.block_sizes) * len(shapes.batches) and all(
        r[k] > 0 for r in results for k in ("verified_gbps", "bare_gbps", "copy_gbps"))


def run_throughput(run: Run, budget: float) -> dict[str, Any]:
    """The step: its process (and its producer's) with ``UCX_PROTO_INFO=y``, then UCX's protocols from its log."""
    env = {**run.env, "UCX_PROTO_INFO": "y"}
    data = run.child("throughput", budget, env=env)
    data["ucx_protocols"] = ucx_protocols(run.out / "throughput.log")
    return data
