"""Encoder start-up: seconds until health answers and until ready, cold and warm (run by hand).

Starts ``epd encoder`` twice on 127.0.0.1, port 0, with the compile backend and
the default buckets (or ``--backend`` / ``--buckets``): first with a fresh
``--compile-cache-dir`` (cold: every bucket graph compiled from scratch), then
again with the same directory (warm: the compiled kernels come from the cache).
For each start, measured from the moment the process is spawned:

- ``listening_s``: the ``--listening-file`` appears (ports bound);
- ``health_s``: ``grpc.health.v1`` answers ``liveness`` SERVING;
- ``ready_s``: ``readiness`` answers SERVING (every bucket graph built);
- ``buckets_s``: each bucket's warm-up time, from the encoder's log.

Each start is bounded by ``--timeout-s``; the process is stopped (SIGTERM, then
SIGKILL by its pid) on every path.

Usage: ``python bench/startup.py [--transport auto|nixl|mock] [--backend compile] [--buckets 64,256]``.
The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from common.config import LIVENESS_SERVICE, READINESS_SERVICE  # noqa: E402

POLL_S = 0.05
CHECK_TIMEOUT_S = 1.0
STOP_TIMEOUT_S = 30.0
_BUCKET_LINE = re.compile(r"warm-up bucket \d+/\d+ \(shape .*\): ([0-9.]+) s")
_TRANSPORT = re.compile(r"serving model .* transport (\w+),")


def _serving(stub: Any, service: str) -> bool:
    try:
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=CHECK_TIMEOUT_S)
    except grpc.RpcError:
        return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)


def one_start(workdir: Path, name: str, cache_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Start one encoder, time it to listening, liveness and readiness, stop it."""
    listening, log_path = workdir / f"{name}.listening.json", workdir / f"{name}.log"
    cmd = [sys.executable, "-m", "common.cli", "encoder", "--host", "127.0.0.1", "--port", "0",
           "--metrics-port", "-1", "--transport", args.transport, "--encoder-backend", args.backend,
           "--compile-cache-dir", str(cache_dir), "--listening-file", str(listening), "--log-level", "INFO"]
    if args.buckets:
        cmd += ["--encoder-buckets", args.buckets]
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
    with open(log_path, "wb") as log:
        started = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=env)
    deadline = started + args.timeout_s
    result: dict[str, Any] = {}
    try:
        while not listening.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{name}: encoder did not listen:\n{log_path.read_text()}")
            time.sleep(POLL_S)
        result["listening_s"] = round(time.monotonic() - started, 2)
        port = json.loads(listening.read_text())["port"]
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub: Any = health_pb2_grpc.HealthStub(channel)  # its stubs declare no methods
            for key, service in (("health_s", LIVENESS_SERVICE), ("ready_s", READINESS_SERVICE)):
                while not _serving(stub, service):
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise SystemExit(f"{name}: {service} not SERVING:\n{log_path.read_text()}")
                    time.sleep(POLL_S)
                result[key] = round(time.monotonic() - started, 2)
    finally:
        _stop(proc)
    log_text = log_path.read_text()
    transport = _TRANSPORT.search(log_text)
    result["transport"] = transport.group(1) if transport else "?"
    result["buckets_s"] = [float(m.group(1)) for m in _BUCKET_LINE.finditer(log_text)]
    result["warmup_s"] = round(sum(result["buckets_s"]), 1)
    print(f"{name}: listening {result['listening_s']:.1f} s, health {result['health_s']:.1f} s, "
          f"ready {result['ready_s']:.1f} s; buckets {result['buckets_s']}", file=sys.stderr, flush=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--transport", default="auto", choices=("auto", "nixl", "mock"))
    parser.add_argument("--backend", default="compile", help="--encoder-backend of the encoder")
    parser.add_argument("--buckets", default="", help="--encoder-buckets of the encoder; default: its own")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="bound on each start")
    parser.add_argument("--keep-dir", action="store_true", help="keep the logs and the compile cache")
    args = parser.parse_args()
    import torch

    workdir = Path(tempfile.mkdtemp(prefix="epd-startup-"))
    cache_dir = workdir / "compile-cache"  # created by the encoder: the cold start sees nothing
    try:
        cold = one_start(workdir, "cold", cache_dir, args)
        warm = one_start(workdir, "warm", cache_dir, args)
    finally:
        if args.keep_dir:
            print(f"kept {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps({"backend": args.backend, "buckets": args.buckets or "default", "transport": args.transport,
                      "torch": torch.__version__, "cpus": os.cpu_count(), "machine": platform.machine(),
                      "cold": cold, "warm": warm}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
