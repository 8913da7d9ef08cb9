"""Start and stop `epd` processes for tests (real processes, real ports)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

READY_TIMEOUT_S = 60.0


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


def start_encoder(tmp_path: Path, *args: str, env: dict[str, str] | None = None,
                  name: str = "encoder") -> EncoderProcess:
    """Start ``epd encoder`` on 127.0.0.1, port 0, and wait until it is ready.

    The ready file is written once readiness is SERVING (every bucket graph built), not when
    the port starts answering health: the cache service refuses calls until then.
    """
    ready = tmp_path / f"{name}.ready.json"
    log_path = tmp_path / f"{name}.log"
    if ready.exists():
        ready.unlink()
    # Eager graphs: compiling every bucket at start-up takes minutes on a small CPU box. A short
    # drain: a test that ends with leases out would otherwise wait the 20 s default at teardown
    # (the tests of draining give their own).
    defaults = ([] if "--encoder-backend" in args else ["--encoder-backend", "eager"]) + (
        [] if "--drain-grace-s" in args else ["--drain-grace-s", "2"])
    cmd = [sys.executable, "-m", "common.cli", "encoder", "--host", "127.0.0.1", "--port", "0",
           "--metrics-port", "0", "--ready-file", str(ready), *defaults, *args]
    full_env = {**os.environ, **(env or {})}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not ready.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"encoder exited with {proc.returncode}:\n{log_path.read_text()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"encoder not ready in {READY_TIMEOUT_S} s:\n{log_path.read_text()}")
        time.sleep(0.05)
    info = json.loads(ready.read_text())
    return EncoderProcess(proc, info["port"], info["metrics_port"], info["incarnation_id"],
                          info["transport"], log_path, info.get("health_port", -1))
