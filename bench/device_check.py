"""The GPU path in one short run: cache in device memory, NIXL reads into device landing blocks, the tower on the GPU.

``scripts/device_check.sh`` runs this on a GPU host (``--mode gpu``, the default) or, with
``--cpu``, on any machine with CPU memory in place of the GPU's and tiny shapes, so the same
code is exercised in CI. Five steps, each in its own process with its own time budget, so a
failing or hanging step (a missing UCX CUDA transport, a compile that runs long) leaves the
later ones to run; each step's result says what failed and why (exception type, message,
traceback tail). One JSON object, ``device_check.json`` in the output folder, is rewritten
after every step (and every measurement inside the long ones), so a run killed at its limit
still leaves what it measured; its last line on stdout is the same object.

1. ``encoder``: a checkpoint of random weights at a real Qwen3-VL tower's dimensions
   (``bench/encoder.py``'s ``build_checkpoint``; the tiny test tower in CPU mode), then
   ``epd encoder --device cuda --weights CHECKPOINT`` as its own process; its handshake
   answers where the cache buffer and the stamps are registered (``VRAM`` / ``DRAM``). A
   probe agent of the same NIXL build says which plugins and backends it has, which memory
   types UCX takes, and whether a device tensor registers.
2. ``pulls``: a second process as consumer: ``EncoderCacheClient(landing_device=cuda)``
   encodes images and a video one request at a time (each a verified pull: blocks, then the
   stamps, then the checks), then a fresh client pulls all of them in one batch by
   ``Lookup``. Every item's rows, on the GPU, are compared with the same tower run locally on
   the GPU through the same serving path (``EncoderRunner``, one item a launch, as the encoder
   ran it): ``bitwise_equal``, ``max_rel_diff``; and with the tower's plain forward
   (``embed``) as an independent reference. ``UCX_PROTO_INFO`` makes UCX print the protocols
   it chose: ``ucx_protocols`` has one line per remote-memory operation (``remote memory read
   by ucp_get* into cuda memory from cuda``) with the transport it takes (``cuda_ipc/cuda``).
3. ``throughput``: ``bench/pull_throughput.py``'s measurement with the producer's blocks and
   the landing blocks in device memory: the verified pull against a bare NIXL READ of the
   same blocks and against a device-to-device copy of the same bytes (``copy_gbps``, the
   physical ceiling), 64 KiB - 4 MiB blocks, batches of 1 - 32.
4. ``towers``: the Qwen3-VL-2B and -8B vision towers (random weights, real dimensions) in
   bfloat16 on the GPU: the serving path, eager and compiled, against transformers' tower on
   the same weights; tokens/s, and each path's largest difference from the float32 tower on
   the same (rounded) weights relative to its largest value (``bench/encoder.py``'s rule:
   ours within twice transformers' own bfloat16 error).
5. ``merge``: ``bench/merge.py`` on the device: the in-graph merge, eager and compiled,
   against a plain copy of the same bytes.

The encoder's native attention kernel is a CPU kernel: on a GPU the encoder is started with
``--attention-kernel sdpa`` and every process gets an empty ``TORCH_EXTENSIONS_DIR``;
``native_kernel_built`` in the report says whether anything was built there (it must not).

Usage: ``python bench/device_check.py [--mode gpu|cpu] [--out DIR] [--budget-s 440]``; exit
status 0 when every step is ok, 1 otherwise.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib.metadata
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch
from google import protobuf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Project code: every import of it is on these lines.
from bench import encoder as tower_bench, pull_throughput as pull_bench  # noqa: E402
from common.transport import (ConsumerTransport, ProducerTransport, RegionDesc, create_agent, load_nixl,  # noqa: E402
                              resolve_transport_kind)
from common.transport.binding import LOCAL_AGENT, agent_name_of  # noqa: E402
from common.wire import PROTOCOL_VERSION, pb2, pb2_grpc  # noqa: E402
from encoder_server.preprocess import PreprocessConfig, Preprocessor  # noqa: E402
from encoder_server.vision import EncoderRunner, default_tokens_per_block, load_encoder  # noqa: E402
from prefill_client.consumer import EncoderCacheClient, MediaSpec  # noqa: E402
from epd_harness.media import image_bytes, video_frames  # noqa: E402

MODEL_ID = "device-check"
STEPS = ("encoder", "pulls", "throughput", "towers", "merge")
REPORT = "device_check.json"
TOWER_DTYPE = torch.bfloat16
# Rows that are not bit-equal to the local run but within this (relative to the largest value) differ
# by the cache dtype's rounding only (reported as ``within_rounding``; the step still fails).
ROWS_TOLERANCE = 1e-2
# UCX_PROTO_INFO lines: "[time] [host:pid:thread]   | cells |".
_UCX_PREFIX = re.compile(r"^\[[\d.]+\]\s+\[[^\]]*\]\s*")


@dataclasses.dataclass(frozen=True)
class Shapes:
    """What one mode runs: the GPU's real shapes, or tiny ones for the CPU."""

    device: str
    encoder_preset: str  # tower the encoder serves (bench/encoder.py PRESETS), random weights
    images: tuple[tuple[int, int], ...]  # pulled items: images (w, h) ...
    video: tuple[int, int, int]  # ... and one video (w, h, frames)
    cache_blocks: int
    landing_blocks: int
    block_sizes: tuple[int, ...]  # throughput: bytes per block
    batches: tuple[int, ...]  # throughput: blocks per pull
    row_bytes: int
    repeats: int
    min_seconds: float
    tower_presets: tuple[str, ...]
    tower_images: tuple[tuple[int, int], ...] | None  # None: bench/encoder.py's batch for the preset
    tower_rounds: int
    merge_args: tuple[str, ...]  # bench/merge.py arguments besides --device
    budgets: dict[str, float]  # seconds per step at most (towers: per preset)
    reserve: dict[str, float]  # seconds kept for each step while earlier ones run


GPU = Shapes(
    # The video (8 temporal patches of 196 merged tokens) keeps the GPU busy for milliseconds after
    # the encoder's write is launched: long enough for a pull that does not wait for it to see it.
    device="cuda", encoder_preset="qwen3-vl-2b",
    images=(*tower_bench.REAL_IMAGE_SIZES, (448, 448)), video=(448, 448, 16),
    cache_blocks=96, landing_blocks=64,
    block_sizes=(64 << 10, 256 << 10, 1 << 20, 4 << 20), batches=(1, 4, 8, 16, 32), row_bytes=4096,
    repeats=10, min_seconds=0.25,
    tower_presets=("qwen3-vl-2b", "qwen3-vl-8b"), tower_images=None, tower_rounds=10,
    merge_args=("--repeats", "20"),
    budgets={"encoder": 90, "pulls": 60, "throughput": 75, "towers": 130, "merge": 45},
    reserve={"encoder": 30, "pulls": 20, "throughput": 20, "towers": 60, "merge": 20},
)
CPU = Shapes(
    device="cpu", encoder_preset="tiny",
    images=((64, 64), (200, 120)), video=(64, 96, 2),
    cache_blocks=32, landing_blocks=16,
    block_sizes=(64 << 10,), batches=(1, 4), row_bytes=4096,
    repeats=3, min_seconds=0.0,
    tower_presets=("tiny",), tower_images=((224, 224), (320, 240)), tower_rounds=2,
    merge_args=("--items", "2", "--tokens-per-item", "16", "--dim", "64", "--text-tokens", "16",
                "--buffer-blocks", "4", "--repeats", "3", "--warmup", "1"),
    budgets={"encoder": 90, "pulls": 60, "throughput": 60, "towers": 120, "merge": 90},
    reserve={"encoder": 10, "pulls": 10, "throughput": 10, "towers": 20, "merge": 10},
)


# --- reporting -------------------------------------------------------------------------------------


def describe_error(exc: BaseException) -> dict[str, str]:
    """What failed and why: type, message, the traceback's last lines."""
    lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
    return {"type": type(exc).__name__, "message": str(exc)[:2000], "traceback": "".join(lines)[-3000:]}


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Replace ``path`` atomically: a run killed mid-write leaves the previous version."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


class Partial:
    """A step's result, written to its file after every measurement."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {"ok": False}

    def save(self) -> None:
        write_json(self.path, self.data)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def log_lines(path: Path, pattern: re.Pattern[str], limit: int) -> list[str]:
    """Distinct lines of a log that match ``pattern``, in order, at most ``limit``."""
    if not path.is_file():
        return []
    out: list[str] = []
    for line in path.read_text(errors="replace").splitlines():
        if pattern.search(line):
            text = line.strip()[:300]
            if text and text not in out:
                out.append(text)
                if len(out) >= limit:
                    break
    return out


def ucx_protocols(path: Path, limit: int = 24) -> list[str]:
    """What UCX chose for each remote-memory operation, from the ``UCX_PROTO_INFO=y`` tables in a log.

    One line per operation and scope: ``remote memory read by ucp_get* from cuda/GPU0 to cuda
    (intra-node): 0..inf zero-copy cuda_ipc/cuda`` (scope: ``self`` within one process,
    ``intra-node`` between processes of one host).
    """
    if not path.is_file():
        return []
    found: dict[str, list[str]] = {}
    scope = operation = ""
    for line in path.read_text(errors="replace").splitlines():
        text = _UCX_PREFIX.sub("", line).strip()
        if not (text.startswith("|") and text.endswith("|")):
            continue
        cells = [cell.strip() for cell in text.strip("|").split("|")]
        if len(cells) == 1:
            if " cfg#" in cells[0]:
                scope = "intra-node" if "intra-node" in cells[0] else "inter-node" if "inter-node" in cells[0] \
                    else "self"
            else:
                operation = cells[0]
        elif len(cells) == 3 and cells[0] != "Range" and operation.startswith("remote memory"):
            rows = found.setdefault(f"{operation} ({scope})", [])
            row = " ".join(cells)
            if row not in rows:
                rows.append(row)
    return [f"{key}: {'; '.join(rows)}" for key, rows in list(found.items())[:limit]]


def tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.is_file() else ""


# --- step 1: the checkpoint, the NIXL probe (child) ------------------------------------------------


def role_prepare(p: Partial, shapes: Shapes, args: argparse.Namespace) -> None:
    """A checkpoint of random weights for the encoder, what this host's torch and NIXL are."""
    device = torch.device(shapes.device)
    host: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(),
                            "cpu_count": os.cpu_count()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        host.update(device_name=props.name, capability=f"{props.major}.{props.minor}",
                    memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda,
                    multiprocessors=props.multi_processor_count)
    p.data["host"] = host
    p.save()
    started = time.monotonic()
    tower_bench.build_checkpoint(Path(args.checkpoint), tower_bench.PRESETS[shapes.encoder_preset], seed=0)
    p.data["checkpoint"] = {"preset": shapes.encoder_preset, "seconds": round(time.monotonic() - started, 1)}
    p.save()
    p.data["nixl_probe"] = nixl_probe(device, args.transport)
    p.data["ok"] = True


def nixl_probe(device: torch.device, transport: str) -> dict[str, Any]:
    """Plugins, backends and memory types of an agent of this host's NIXL; a device tensor registered once."""
    kind = resolve_transport_kind(transport).value
    info: dict[str, Any] = {"transport": kind,
                            "ucx_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("UCX_")}}
    if kind != "nixl":
        info["note"] = "no NIXL here: the shared-memory mock agent stands in (host memory only)"
        return info
    module = load_nixl()
    info["module"] = module.__name__
    dist = module.__name__.split(".")[0].replace("_", "-")
    try:
        info["version"] = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        pass
    agent: Any = create_agent("nixl", f"device-check-probe-{os.getpid()}", progress_thread=False)
    for key, call in (("plugins", lambda: agent.get_plugin_list()), ("backends", lambda: list(agent.backends)),
                      ("ucx_mem_types", lambda: list(agent.get_backend_mem_types("UCX")))):
        try:
            info[key] = call()
        except Exception as exc:  # an older binding without the call: say so, go on
            info[f"{key}_error"] = describe_error(exc)["message"]
    tensor = torch.zeros(4, 4096, dtype=torch.uint8, device=device)
    try:  # NIXL's own word for the tensor's memory (nixl_mem_t), then a registration with UCX
        info["nixl_mem_type"] = str(agent.get_reg_descs(tensor).getType()).rsplit(".", 1)[-1]
    except Exception as exc:
        info["nixl_mem_type_error"] = describe_error(exc)["message"]
    try:
        registration = agent.register_memory(tensor)
        info["registered"] = RegionDesc.of_tensor(tensor).memory.value
        agent.deregister_memory(registration)
    except Exception as exc:
        info["register_error"] = describe_error(exc)
    return info


# --- step 1: the encoder process (parent) ----------------------------------------------------------


class Encoder:
    """``epd encoder`` as its own process, on 127.0.0.1 and a free port."""

    def __init__(self, shapes: Shapes, work: Path, out: Path, checkpoint: Path, transport: str,
                 env: dict[str, str]) -> None:
        self.ready_file = work / "encoder.ready.json"
        self.log_path = out / "encoder.log"
        cmd = [sys.executable, "-m", "common.cli", "encoder", "--host", "127.0.0.1", "--port", "0",
               "--metrics-port", "-1", "--ready-file", str(self.ready_file), "--model-id", MODEL_ID,
               "--weights", str(checkpoint), "--tower", "qwen3vl", "--tower-dtype", "bfloat16",
               "--device", shapes.device, "--encoder-backend", "eager", "--transport", transport,
               "--cache-blocks", str(shapes.cache_blocks), "--drain-grace-s", "2"]
        if shapes.device != "cpu":
            # The native attention kernel is a CPU kernel: nothing to build or load on a GPU.
            cmd += ["--attention-kernel", "sdpa"]
        self.cmd = cmd
        self.started = time.monotonic()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)

    def wait_ready(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while not self.ready_file.is_file():
            if self.proc.poll() is not None:
                raise RuntimeError(f"epd encoder exited with status {self.proc.returncode}: {tail(self.log_path)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"epd encoder not ready within {timeout_s:.0f} s: {tail(self.log_path)}")
            time.sleep(0.1)
        info: dict[str, Any] = json.loads(self.ready_file.read_text())
        return info

    def stop(self) -> int | None:
        """SIGTERM (the encoder drains), SIGKILL to its process group past 20 s; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        return self.proc.returncode


def handshake(target: str) -> pb2.HandshakeResponse:
    with grpc.insecure_channel(target) as channel:
        response: pb2.HandshakeResponse = pb2_grpc.EncoderCacheServiceStub(channel).Handshake(
            pb2.HandshakeRequest(protocol_version=PROTOCOL_VERSION, model_id=MODEL_ID, consumer_id="device-check"),
            timeout=30)
    return response


def region_report(region: pb2.MemoryRegion) -> dict[str, Any]:
    return {"memory": pb2.MemoryType.Name(region.memory_type).removeprefix("MEMORY_TYPE_"),
            "device_id": region.device_id, "count": region.count, "stride_bytes": region.stride_bytes,
            "bytes": region.count * region.stride_bytes}


# --- step 2: verified pulls into device landing blocks (child) -------------------------------------


class LocalTower:
    """The encoder's tower run in this process on the same device: the rows each item must have."""

    def __init__(self, checkpoint: str, device: torch.device, block_size: int) -> None:
        self.encoder = load_encoder(checkpoint, device=device, dtype=TOWER_DTYPE)
        self.preprocessor = Preprocessor(PreprocessConfig.for_encoder(self.encoder, weights_dir=checkpoint))
        self.runner = EncoderRunner(self.encoder, block_size=block_size, backend="eager")
        self.block_size = block_size
        self.device = device

    def item(self, spec: MediaSpec) -> Any:
        if spec.kind == "image":
            return self.preprocessor.image(spec.frames[0])
        return self.preprocessor.video(spec.frames, fps=spec.fps or None)

    def serving_rows(self, item: Any) -> torch.Tensor:
        """The serving path, one item alone (as the encoder ran it), into a cache buffer of the cache dtype."""
        counts = default_tokens_per_block(item.num_tokens, self.block_size)
        blocks = list(range(len(counts)))
        buffer = torch.zeros(len(counts) + 1, self.block_size, self.encoder.fat_dim, dtype=torch.bfloat16,
                             device=self.device)
        self.runner.write([item], [blocks], [counts], buffer, len(counts))
        return torch.cat([buffer[b, :n] for b, n in zip(blocks, counts)])

    @torch.no_grad()
    def embed_rows(self, item: Any) -> torch.Tensor:
        return self.encoder.embed(item.pixel_values.to(self.device), [item.grid_thw])


def compare(pulled: torch.Tensor, reference: torch.Tensor) -> dict[str, Any]:
    if tuple(pulled.shape) != tuple(reference.shape):
        return {"bitwise_equal": False, "shape": list(pulled.shape), "reference_shape": list(reference.shape)}
    ref = reference.to(pulled.device)
    scale = float(ref.float().abs().max().clamp_min(1e-12))
    return {"bitwise_equal": bool(torch.equal(pulled, ref.to(pulled.dtype))),
            "max_rel_diff": float((pulled.float() - ref.float()).abs().max()) / scale,
            "all_zero": not bool(pulled.any())}


def role_pulls(p: Partial, shapes: Shapes, args: argparse.Namespace) -> None:
    device = torch.device(shapes.device)
    specs = [(f"image {w}x{h}", MediaSpec.image(image_bytes(w, h, seed=i))) for i, (w, h) in enumerate(shapes.images)]
    w, h, n = shapes.video
    specs.append((f"video {w}x{h}x{n}", MediaSpec.video(video_frames(w, h, n, seed=7))))
    local = LocalTower(args.checkpoint, device, args.block_size)
    items = [local.item(spec) for _, spec in specs]
    serving = [local.serving_rows(item) for item in items]
    plain = [local.embed_rows(item) for item in items]
    sync(device)
    p.data.update(landing_device=str(device), transport=args.transport, block_size=args.block_size, items=[])
    p.save()

    def check(name: str, pulled: Any, i: int, seconds: float | None) -> dict[str, Any]:
        row: dict[str, Any] = {"item": name, "tokens": pulled.num_tokens, "source": pulled.source,
                               "rows_device": str(pulled.embeddings.device), **compare(pulled.embeddings, serving[i])}
        embed = compare(pulled.embeddings, plain[i])
        row["max_rel_diff_vs_embed"] = embed.get("max_rel_diff")
        if seconds is not None:
            row["ms"] = round(seconds * 1e3, 2)
        return row

    client_args: dict[str, Any] = dict(transport_kind=args.transport, landing_device=device,
                                       landing_blocks=shapes.landing_blocks, pull_timeout_s=10.0, rpc_timeout_s=60.0)
    hashes: list[str] = []
    # One request an item: the encoder runs each alone, as the local serving path did.
    with EncoderCacheClient(args.target, MODEL_ID, **client_args) as client:
        for i, (name, spec) in enumerate(specs):
            started = time.perf_counter()
            pulled = client.encode([spec])[0]
            sync(device)
            p.data["items"].append(check(name, pulled, i, time.perf_counter() - started))
            hashes.append(pulled.mm_hash)
            p.save()
    # A fresh client (empty local cache): one Lookup, one block READ and one stamp READ for all items.
    with EncoderCacheClient(args.target, MODEL_ID, **client_args) as fresh:
        started = time.perf_counter()
        found = fresh.lookup(hashes, require=True)
        sync(device)
        seconds = time.perf_counter() - started
        p.data["batched"] = {"ms": round(seconds * 1e3, 2), "items": [
            check(name, pulled, i, None) for i, ((name, _), pulled) in enumerate(zip(specs, found))
            if pulled is not None]}
    rows = p.data["items"] + p.data["batched"]["items"]
    equal = sum(1 for r in rows if r.get("bitwise_equal"))
    p.data["rows_equal"] = f"{equal}/{len(rows)}"
    worst = max((r.get("max_rel_diff", 1.0) for r in rows), default=1.0)
    p.data["worst_max_rel_diff"] = worst
    if any(not r.get("bitwise_equal") for r in p.data["items"]) and all(
            r.get("bitwise_equal") for r in p.data["batched"]["items"]):
        p.data["diagnosis"] = ("rows pulled right after Encode answered differ from the reference, the same blocks "
                               "pulled later equal it: the encoder answered before its device write had finished")
    on_device = all(r["rows_device"].split(":")[0] == device.type for r in rows)
    sources = [r["source"] for r in p.data["items"]] == ["miss"] * len(specs) and \
        [r["source"] for r in p.data["batched"]["items"]] == ["hit"] * len(specs)
    # Equal means bit for bit: the reference ran the same kernels on the same device in the same dtype.
    p.data["within_rounding"] = worst <= ROWS_TOLERANCE
    p.data["ok"] = bool(len(rows) == 2 * len(specs) and equal == len(rows) and on_device and sources)


# --- step 3: pull throughput from device blocks (child; the producer is a grandchild) ---------------


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
        self.proc = subprocess.Popen([sys.executable, __file__, "--role", "producer", "--transport", kind,
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


# --- step 4: the towers on the device (child per preset) -------------------------------------------


class DeviceServingPath(tower_bench.ServingPath):
    """bench/encoder.py's serving path with its cache buffer on the encoder's device."""

    def __init__(self, encoder: Any, items: list[Any], backend: str) -> None:  # noqa: D107
        super().__init__(encoder, items, backend)
        self.buffer = self.buffer.to(encoder.device)


def hf_rows(output: Any) -> torch.Tensor:
    """Transformers' tower output as cache rows: merged tokens, then the deepstack levels."""
    if isinstance(output, tuple):
        merged, deepstack = output[0], output[1]
    else:
        merged, deepstack = output.pooler_output, output.deepstack_features
    return torch.cat([merged, *deepstack], dim=-1)


def role_tower(p: Partial, shapes: Shapes, args: argparse.Namespace) -> None:
    device = torch.device(shapes.device)
    name = args.preset
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference in float32, convolution included
    torch.backends.cudnn.allow_tf32 = False
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="epd-device-check-tower-") as tmp:
        hf = tower_bench.build_checkpoint(Path(tmp), tower_bench.PRESETS[name], seed=0)
        encoder = load_encoder(tmp, device=device, dtype=TOWER_DTYPE)
    with torch.no_grad():  # both sides hold the weights rounded to bfloat16 (as bench/encoder.py)
        for param in hf.parameters():
            param.copy_(param.to(TOWER_DTYPE))
    exact = hf.to(device)
    hf16 = copy.deepcopy(exact).to(TOWER_DTYPE)
    sizes = shapes.tower_images or (tower_bench.REAL_IMAGE_SIZES if name in tower_bench.REAL_PRESETS
                                    else tower_bench.IMAGE_SIZES)
    items = tower_bench.make_batch(encoder, sizes)
    tokens = sum(item.num_tokens for item in items)
    pixels = torch.cat([item.hf_pixel_values() for item in items]).to(device)
    grid = torch.tensor([list(item.grid_thw) for item in items], device=device)
    cfg = encoder.config
    p.data.update(preset=name, dtype="bfloat16", device=str(device), images=[list(s) for s in sizes],
                  merged_tokens=tokens, setup_s=round(time.monotonic() - started, 1),
                  config={"depth": cfg.depth, "hidden_size": cfg.hidden_size, "num_heads": cfg.num_heads,
                          "out_hidden_size": cfg.out_hidden_size, "fat_dim": encoder.fat_dim},
                  first_call_s={}, max_rel_diff={})
    p.save()

    def transformers(model: Any = hf16, dtype: torch.dtype = TOWER_DTYPE) -> torch.Tensor:
        with torch.inference_mode():
            return hf_rows(model(pixels.to(dtype), grid_thw=grid))

    serving = {"serving_eager": DeviceServingPath(encoder, items, "eager"),
               "serving_compiled": DeviceServingPath(encoder, items, "compile")}
    calls: dict[str, Callable[[], Any]] = {"transformers": transformers, **serving}
    rows_of: dict[str, Callable[[], torch.Tensor]] = {"transformers": transformers,
                                                      **{k: v.rows for k, v in serving.items()}}
    reference = transformers(exact, torch.float32).float()
    scale = float(reference.abs().max())
    del exact
    diffs = p.data["max_rel_diff"]
    limit = max(tower_bench.TOLERANCE, 2 * diffs.setdefault("transformers", float(
        (transformers().float() - reference).abs().max()) / scale))
    p.data["limit"] = limit

    def measure(paths: list[str]) -> None:
        """First call of each new path (the compiled one compiles here), then interleaved timed rounds."""
        for path in paths:
            if path in p.data["first_call_s"]:
                continue
            began = time.perf_counter()
            calls[path]()
            sync(device)
            p.data["first_call_s"][path] = round(time.perf_counter() - began, 2)
            diffs[path] = float((rows_of[path]().float() - reference).abs().max()) / scale
            p.save()
        times: dict[str, list[float]] = {path: [] for path in paths}
        for _ in range(shapes.tower_rounds):
            for path in paths:
                sync(device)
                began = time.perf_counter()
                calls[path]()
                sync(device)
                times[path].append(time.perf_counter() - began)
        median_ms = {path: statistics.median(samples) * 1e3 for path, samples in times.items()}
        base = median_ms["transformers"]
        p.data.update(
            rounds=shapes.tower_rounds, median_ms={k: round(v, 3) for k, v in median_ms.items()},
            tokens_per_s={k: round(tokens / v * 1e3) for k, v in median_ms.items()},
            ratio_vs_transformers={k: round(base / v, 3) for k, v in median_ms.items() if k != "transformers"},
            padding={k: round(serving[k].runner.computed_tokens / serving[k].runner.real_tokens - 1, 4)
                     for k in paths if k in serving})
        p.save()

    # Eager first: a compile that runs past the budget still leaves the eager numbers.
    measure(["transformers", "serving_eager"])
    measure(["transformers", "serving_eager", "serving_compiled"])
    p.data["ok"] = all(diffs[k] <= limit for k in serving) and all(v > 0 for v in p.data["median_ms"].values())


# --- the parent: steps in order, each in a process of its own ---------------------------------------


class Run:
    def __init__(self, args: argparse.Namespace, shapes: Shapes) -> None:
        self.args, self.shapes = args, shapes
        self.out = Path(args.out).resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix="epd-device-check-"))
        self.checkpoint = self.work / "checkpoint"
        self.checkpoint.mkdir()
        self.started = time.monotonic()
        self.deadline = self.started + args.budget_s
        self.env = dict(os.environ)
        self.env["PYTHONUNBUFFERED"] = "1"
        self.env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
        self.extensions = self.work / "torch_extensions"
        if shapes.device != "cpu":
            # Empty: whatever lands here was built during this run (it must stay empty on a GPU).
            self.env["TORCH_EXTENSIONS_DIR"] = str(self.extensions)
        self.report: dict[str, Any] = {
            "check": "device", "mode": args.mode, "device": shapes.device, "ok": False,
            "budget_s": args.budget_s, "started_unix": round(time.time()),
            "host": {"python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine(),
                     "grpcio": grpc.__version__, "protobuf": protobuf.__version__,
                     "ld_library_path": os.environ.get("LD_LIBRARY_PATH", "")},
            "steps": {name: {"ok": False, "skipped": "not reached"} for name in STEPS},
        }
        self.transport = "nixl" if shapes.device != "cpu" else "auto"
        self.encoder: Encoder | None = None
        self.handshake: pb2.HandshakeResponse | None = None
        self.current: subprocess.Popen[bytes] | None = None  # the step process running now

    def save(self) -> None:
        self.report["seconds"] = round(time.monotonic() - self.started, 1)
        self.report["ok"] = all(step.get("ok") for step in self.report["steps"].values())
        write_json(self.out / REPORT, self.report)

    def budget(self, step: str) -> float:
        """Seconds for ``step``: its own budget, less what the steps after it keep for themselves."""
        after = STEPS[STEPS.index(step) + 1:]
        left = self.deadline - time.monotonic()
        own = self.shapes.budgets[step] * (len(self.shapes.tower_presets) if step == "towers" else 1)
        # Short of time, every step left gets an even share rather than the first nothing.
        share = max(left - sum(self.shapes.reserve[s] for s in after), left / (len(after) + 1))
        return float(max(0.0, min(own, share)))

    def child(self, role: str, timeout_s: float, *extra: str, env: dict[str, str] | None = None,
              log: str | None = None) -> dict[str, Any]:
        """Run ``--role ROLE`` in a process of its own, killed (with its children) at ``timeout_s``.

        Returns what it wrote, plus the error that ended it, if any.
        """
        result = self.work / f"{role}-{time.monotonic_ns()}.json"
        log_path = self.out / (log or f"{role}.log")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--role", role, "--mode", self.args.mode,
               "--result", str(result), "--transport", self.transport, *extra]
        began = time.monotonic()
        timed_out = False
        with open(log_path, "ab") as out:
            proc = self.current = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                                   env=env or self.env, start_new_session=True)
            try:
                proc.wait(max(timeout_s, 1.0))
            except subprocess.TimeoutExpired:
                timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
            self.current = None
        data: dict[str, Any] = json.loads(result.read_text()) if result.is_file() else {"ok": False}
        data["seconds"] = round(time.monotonic() - began, 1)
        data["budget_s"] = round(timeout_s, 1)
        if timed_out:
            data["ok"] = False
            data.setdefault("error", {"type": "Timeout", "message": f"ran past its {timeout_s:.0f} s budget and "
                                      "was killed; what it measured until then is kept",
                                      "traceback": tail(log_path, 1500)})
        elif proc.returncode != 0:
            data["ok"] = False
            data.setdefault("error", {"type": "ChildExit", "message": f"exit status {proc.returncode}",
                                      "traceback": tail(log_path, 1500)})
        return data

    def step(self, name: str, fn: Callable[[float], dict[str, Any]]) -> dict[str, Any]:
        budget = self.budget(name)
        began = time.monotonic()
        print(f"device check: {name} (budget {budget:.0f} s)", flush=True)
        if budget < 5:
            data: dict[str, Any] = {"ok": False, "skipped": "no time left in the run's budget"}
        else:
            try:
                data = fn(budget)
            except Exception as exc:
                data = {"ok": False, "error": describe_error(exc)}
            except BaseException as exc:  # stopped (SIGTERM, Ctrl-C): say so, then stop
                self.report["steps"][name] = {"ok": False, "error": {
                    "type": "Interrupted", "message": f"the run was stopped during this step ({exc!r})"}}
                raise
        data.setdefault("seconds", round(time.monotonic() - began, 1))
        self.report["steps"][name] = data
        self.save()
        state = "ok" if data.get("ok") else f"FAILED: {data.get('error', {}).get('message', data.get('skipped', ''))}"
        print(f"device check: {name} {state} ({data['seconds']} s)", flush=True)
        return data

    # --- the steps ---

    def run_encoder(self, budget: float) -> dict[str, Any]:
        began = time.monotonic()
        prep = self.child("prepare", budget * 0.6, "--checkpoint", str(self.checkpoint))
        self.report["host"].update(prep.get("host", {}))
        data: dict[str, Any] = {"ok": False, "checkpoint": prep.get("checkpoint"), "nixl_probe": prep.get("nixl_probe")}
        if not prep.get("ok"):
            data["error"] = prep.get("error", {"type": "PrepareFailed", "message": "see prepare.log"})
            return data
        self.encoder = Encoder(self.shapes, self.work, self.out, self.checkpoint, self.transport, self.env)
        data["command"] = " ".join(self.encoder.cmd[1:]).replace(str(self.work), "$WORK")
        ready = self.encoder.wait_ready(max(5.0, budget - (time.monotonic() - began)))
        data["ready_s"] = round(time.monotonic() - self.encoder.started, 1)
        target = f"127.0.0.1:{ready['port']}"
        hs = handshake(target)
        layout = hs.layout
        data.update(
            target=target, transport=hs.transport, tower=hs.tower, agent=hs.agent_name,
            buffer_region=region_report(hs.buffer_region), stamp_region=region_report(hs.stamp_region),
            layout={"num_blocks": layout.num_blocks, "block_size": layout.block_size, "fat_dim": layout.fat_dim,
                    "bytes_per_block": layout.bytes_per_block, "dtype": pb2.DType.Name(layout.dtype)},
            log=log_lines(self.encoder.log_path, re.compile(
                r"agent|NIXL|nixl|UCX|ucx|cache regions|attention|tower dtype|serving model|VRAM|cuda", re.I), 25))
        self.handshake = hs
        want = "VRAM" if self.shapes.device != "cpu" else "DRAM"
        problems = [f"{what} is in {region['memory']}, not {want}" for what, region in
                    (("the cache buffer", data["buffer_region"]), ("the stamp region", data["stamp_region"]))
                    if region["memory"] != want]
        if self.shapes.device != "cpu" and hs.transport != "nixl":
            problems.append(f"transport {hs.transport!r}, not nixl")
        if problems:
            data["error"] = {"type": "WrongPlacement", "message": "; ".join(problems)}
        data["ok"] = not problems
        return data

    def run_pulls(self, budget: float) -> dict[str, Any]:
        if self.encoder is None or self.encoder.proc.poll() is not None or self.handshake is None:
            return {"ok": False, "skipped": "no encoder to pull from (step encoder failed)"}
        env = {**self.env, "UCX_PROTO_INFO": "y"}
        target = self.report["steps"]["encoder"]["target"]
        data = self.child("pulls", budget, "--target", target, "--checkpoint", str(self.checkpoint),
                          "--block-size", str(self.handshake.layout.block_size), "--transport", self.handshake.transport,
                          env=env)
        data["ucx_protocols"] = ucx_protocols(self.out / "pulls.log")
        return data

    def run_throughput(self, budget: float) -> dict[str, Any]:
        env = {**self.env, "UCX_PROTO_INFO": "y"}
        data = self.child("throughput", budget, env=env)
        data["ucx_protocols"] = ucx_protocols(self.out / "throughput.log")
        return data

    def run_towers(self, budget: float) -> dict[str, Any]:
        presets: dict[str, Any] = {}
        data: dict[str, Any] = {"ok": False, "presets": presets}
        total_end = time.monotonic() + budget
        names = self.shapes.tower_presets
        for i, name in enumerate(names):
            left = total_end - time.monotonic()
            later = self.shapes.reserve["towers"] / len(names) * (len(names) - i - 1)
            share = min(self.shapes.budgets["towers"], left - later) if i < len(names) - 1 else left
            if share < 5:
                presets[name] = {"ok": False, "skipped": "no time left in the run's budget"}
                continue
            presets[name] = self.child("tower", share, "--preset", name, log=f"tower-{name}.log")
            self.report["steps"]["towers"] = data
            self.save()
        data["ok"] = all(r.get("ok") for r in presets.values())
        failed = [(name, r) for name, r in presets.items() if not r.get("ok")]
        if failed:
            name, r = failed[0]
            error = r.get("error") or {"type": "Failed", "message": r.get("skipped") or "rows outside the limit"}
            data["error"] = {**error, "message": f"{name}: {error.get('message', '')}"}
        return data

    def run_merge(self, budget: float) -> dict[str, Any]:
        cmd = [sys.executable, str(ROOT / "bench" / "merge.py"), "--device", self.shapes.device,
               *self.shapes.merge_args]
        log_path = self.out / "merge.log"
        began = time.monotonic()
        with open(log_path, "ab") as log:
            proc = self.current = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=log,
                                                   env=self.env, start_new_session=True)
            try:
                stdout, _ = proc.communicate(timeout=max(budget, 1.0))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                stdout, _ = proc.communicate()
                return {"ok": False, "error": {"type": "Timeout", "message": f"ran past its {budget:.0f} s budget",
                                               "traceback": tail(log_path, 1500)}}
            finally:
                self.current = None
            log.write(stdout)
        lines = [line for line in stdout.decode(errors="replace").splitlines() if line.startswith("{")]
        data: dict[str, Any] = json.loads(lines[-1]) if lines else {}
        data["command"] = "python bench/merge.py --device " + " ".join([self.shapes.device, *self.shapes.merge_args])
        data["seconds"] = round(time.monotonic() - began, 1)
        if proc.returncode != 0 or not lines:
            data["ok"] = False
            data["error"] = {"type": "ChildExit", "message": f"bench/merge.py exit status {proc.returncode}",
                             "traceback": tail(log_path, 1500)}
            return data
        data["ok"] = data.get("compiled_over_copy", 0) > 0 and data.get("copy_ms", 0) > 0
        return data

    def main(self) -> int:
        def stop(signum: int, frame: object) -> None:
            raise SystemExit(128 + signum)  # unwinds through the finally below: nothing is left running

        signal.signal(signal.SIGTERM, stop)
        try:
            self.save()
            self.step("encoder", self.run_encoder)
            self.step("pulls", self.run_pulls)
            if self.encoder is not None:  # its job is done: give the device to the other steps
                self.report["steps"]["encoder"]["exit_status"] = self.encoder.stop()
                self.encoder = None
            self.step("throughput", self.run_throughput)
            self.step("towers", self.run_towers)
            self.step("merge", self.run_merge)
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            if self.current is not None and self.current.poll() is None:
                os.killpg(self.current.pid, signal.SIGKILL)
                self.current.wait(10)
            if self.encoder is not None:
                self.encoder.stop()
            if self.shapes.device != "cpu":
                built = [str(p.relative_to(self.extensions)) for p in self.extensions.rglob("*.so")] \
                    if self.extensions.is_dir() else []
                self.report["native_kernel_built"] = bool(built)
                if built:
                    self.report["native_kernel_files"] = built
            self.save()
            shutil.rmtree(self.work, ignore_errors=True)
        print(json.dumps(self.report, default=str))
        return 0 if self.report["ok"] else 1


ROLES: dict[str, Callable[[Partial, Shapes, argparse.Namespace], None]] = {
    "prepare": role_prepare, "pulls": role_pulls, "throughput": role_throughput, "tower": role_tower,
}


def run_role(args: argparse.Namespace, shapes: Shapes) -> int:
    if args.role == "producer":
        role_producer(args)
        return 0
    partial = Partial(Path(args.result))
    try:
        ROLES[args.role](partial, shapes, args)
    except BaseException as exc:
        partial.data["ok"] = False
        partial.data["error"] = describe_error(exc)
        partial.save()
        raise
    partial.save()
    return 0 if partial.data.get("ok") else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--mode", choices=("gpu", "cpu"), default="gpu",
                        help="gpu: real shapes on cuda; cpu: tiny shapes in host memory (what CI runs)")
    parser.add_argument("--out", default="device_check_out", help="folder for device_check.json and the logs")
    parser.add_argument("--budget-s", type=float, default=440.0, help="the whole run's time, steps included")
    parser.add_argument("--role", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--transport", default="auto", help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    parser.add_argument("--block-size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--preset", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    shapes = GPU if args.mode == "gpu" else CPU
    if args.role is not None:
        return run_role(args, shapes)
    if shapes.device == "cuda" and not torch.cuda.is_available():
        print("device check: no CUDA device here; `--mode cpu` (scripts/device_check.sh --cpu) runs the CPU form",
              file=sys.stderr)
    return Run(args, shapes).main()


if __name__ == "__main__":
    sys.exit(main())
