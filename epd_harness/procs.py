"""Start, wait for and stop ``epd encoder`` processes for test and bench runs (that run's process)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from epd_harness.waits import wait_ready

REPO_ROOT = Path(__file__).resolve().parents[1]
# Bounds the whole start; a stalled one fails long before (see epd_harness.waits). With the
# compile backend each bucket graph takes 25-35 s on two busy cores, five buckets by default.
ENCODER_LIMIT_S = 600.0


@dataclass
class EncoderProcess:
    proc: subprocess.Popen[bytes]
    port: int
    metrics_port: int
    incarnation_id: str
    transport: str
    log_path: Path
    health_port: int = -1

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def terminate(self, timeout: float = 30.0) -> int:
        return terminate(self.proc, timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def terminate(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> int:
    """SIGTERM, then wait; SIGKILL only if it does not exit within ``timeout``. The exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return int(proc.returncode)


@dataclass
class EncoderLaunch:
    """An ``epd encoder`` process spawned by :func:`launch_encoder`, not yet ready."""

    proc: subprocess.Popen[bytes]
    ready_path: Path
    log_path: Path
    name: str
    port: int = 0  # given with --port: known before it is ready

    @property
    def target(self) -> str:
        """Its gRPC address before it is ready (only when launched with a ``--port`` of its own)."""
        if not self.port:
            raise ValueError(f"{self.name} was launched on port 0: its address is known once it is ready")
        return f"127.0.0.1:{self.port}"

    def terminate(self, timeout: float = 30.0) -> int:
        return terminate(self.proc, timeout)

    def wait(self) -> EncoderProcess:
        """Wait until it is ready, following its start-up (:func:`~epd_harness.waits.wait_ready`)."""
        what = "encoder" if self.name == "encoder" else f"encoder {self.name}"
        info = wait_ready(what, self.proc, self.log_path, self._ready_info, limit_s=ENCODER_LIMIT_S)
        return EncoderProcess(self.proc, info["port"], info["metrics_port"], info["incarnation_id"],
                              info["transport"], self.log_path, info.get("health_port", -1))

    def _ready_info(self) -> dict[str, Any] | None:
        if not self.ready_path.exists():
            return None
        info: dict[str, Any] = json.loads(self.ready_path.read_text())
        return info


def launch_encoder(tmp_path: Path, *args: str, env: dict[str, str] | None = None,
                   name: str = "encoder") -> EncoderLaunch:
    """Spawn ``epd encoder`` on 127.0.0.1; :meth:`EncoderLaunch.wait` waits for it.

    Unless ``args`` say otherwise: gRPC and /metrics on port 0 (the ready file says which),
    eager graphs, a 2 s drain. Its log is ``tmp_path/NAME.log``. The ready file is written once readiness is SERVING
    (every bucket graph built), not when the port starts answering health: the cache service
    refuses calls until then.
    """
    ready = tmp_path / f"{name}.ready.json"
    log_path = tmp_path / f"{name}.log"
    ready.unlink(missing_ok=True)
    # Eager graphs: compiling every bucket at start-up takes minutes on a small CPU box. A short
    # drain: a run that ends with leases out would otherwise wait the 20 s default at its end
    # (the tests of draining give their own).
    defaults: list[str] = []
    for flag, value in (("--port", "0"), ("--metrics-port", "0"), ("--encoder-backend", "eager"),
                        ("--drain-grace-s", "2")):
        if flag not in args:
            defaults += [flag, value]
    cmd = [sys.executable, "-m", "common.cli", "encoder", "--host", "127.0.0.1", "--ready-file", str(ready),
           *defaults, *args]
    full_env = {**os.environ, **(env or {})}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, cwd=REPO_ROOT)
    port = int(args[args.index("--port") + 1]) if "--port" in args else 0
    return EncoderLaunch(proc, ready, log_path, name, port)


def bench_encoder_args(transport: str, blocks: int, block_size: int = 64) -> list[str]:
    """Flags of a benchmark's encoder: ``transport``, ``blocks`` cache blocks of ``block_size`` rows,
    no /metrics port, only warnings in its log."""
    return ["--transport", transport, "--cache-blocks", str(blocks), "--block-size", str(block_size),
            "--metrics-port", "-1", "--log-level", "WARNING"]


def start_encoder(tmp_path: Path, *args: str, env: dict[str, str] | None = None,
                  name: str = "encoder") -> EncoderProcess:
    """:func:`launch_encoder`, then wait until it is ready."""
    return launch_encoder(tmp_path, *args, env=env, name=name).wait()


@dataclass
class SoakEncoder:
    """An encoder on a fixed port that a soak kills, freezes and starts again."""

    tmp: Path
    args: tuple[str, ...]
    name: str
    proc: EncoderProcess
    restarts: int = 0

    @classmethod
    def start(cls, tmp: Path, name: str, *args: str) -> SoakEncoder:
        return cls.launched(tmp, launch_encoder(tmp, *args, name=name), *args)

    @classmethod
    def launched(cls, tmp: Path, launch: EncoderLaunch, *args: str) -> SoakEncoder:
        """The encoder :func:`launch_encoder` started with ``args``, once ready (its restarts keep its port)."""
        proc = launch.wait()
        return cls(tmp, (*args, "--port", str(proc.port)), launch.name, proc)

    @property
    def target(self) -> str:
        return self.proc.target

    def kill_and_restart(self) -> None:
        self.proc.kill()
        self.restarts += 1
        self.proc = start_encoder(self.tmp, *self.args, name=f"{self.name}-{self.restarts}")

    def freeze(self, seconds: float) -> None:
        os.kill(self.proc.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            os.kill(self.proc.proc.pid, signal.SIGCONT)

    def terminate(self) -> None:
        self.proc.terminate()
