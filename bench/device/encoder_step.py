"""Step 1, encoder: checkpoint and NIXL probe (device check step process), ``epd encoder`` (driver process).

The step process writes a checkpoint of random weights at the encoder's dimensions and says
what this host's torch and NIXL are; the driver then starts ``epd encoder`` on it as its own
process, which stays up for the pulls, and reports where its handshake says the cache buffer
and the stamps are registered.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import torch

from bench import encoder as tower_bench
from bench.device.report import Partial, describe_error, log_lines, tail
from bench.device.shapes import MODEL_ID, ROOT, Shapes
from common.transport import RegionDesc, create_agent, load_nixl, resolve_transport_kind
from common.wire import PROTOCOL_VERSION, pb2, pb2_grpc

if TYPE_CHECKING:
    from bench.device.driver import Run


# --- the step process: the checkpoint, the NIXL probe ----------------------------------------------


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


# --- the driver process: the encoder process, its handshake ----------------------------------------


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


def run_encoder(run: Run, budget: float) -> dict[str, Any]:
    """The step: the prepare process, then the encoder up, its handshake, where its regions are."""
    began = time.monotonic()
    prep = run.child("prepare", budget * 0.6, "--checkpoint", str(run.checkpoint))
    run.report["host"].update(prep.get("host", {}))
    data: dict[str, Any] = {"ok": False, "checkpoint": prep.get("checkpoint"), "nixl_probe": prep.get("nixl_probe")}
    if not prep.get("ok"):
        data["error"] = prep.get("error", {"type": "PrepareFailed", "message": "see prepare.log"})
        return data
    run.encoder = Encoder(run.shapes, run.work, run.out, run.checkpoint, run.transport, run.env)
    data["command"] = " ".join(run.encoder.cmd[1:]).replace(str(run.work), "$WORK")
    ready = run.encoder.wait_ready(max(5.0, budget - (time.monotonic() - began)))
    data["ready_s"] = round(time.monotonic() - run.encoder.started, 1)
    target = f"127.0.0.1:{ready['port']}"
    hs = handshake(target)
    layout = hs.layout
    data.update(
        target=target, transport=hs.transport, tower=hs.tower, agent=hs.agent_name,
        buffer_region=region_report(hs.buffer_region), stamp_region=region_report(hs.stamp_region),
        layout={"num_blocks": layout.num_blocks, "block_size": layout.block_size, "fat_dim": layout.fat_dim,
                "bytes_per_block": layout.bytes_per_block, "dtype": pb2.DType.Name(layout.dtype)},
        log=log_lines(run.encoder.log_path, re.compile(
            r"agent|NIXL|nixl|UCX|ucx|cache regions|attention|tower dtype|serving model|VRAM|cuda", re.I), 25))
    run.handshake = hs
    want = "VRAM" if run.shapes.device != "cpu" else "DRAM"
    problems = [f"{what} is in {region['memory']}, not {want}" for what, region in
                (("the cache buffer", data["buffer_region"]), ("the stamp region", data["stamp_region"]))
                if region["memory"] != want]
    if run.shapes.device != "cpu" and hs.transport != "nixl":
        problems.append(f"transport {hs.transport!r}, not nixl")
    if problems:
        data["error"] = {"type": "WrongPlacement", "message": "; ".join(problems)}
    data["ok"] = not problems
    return data
