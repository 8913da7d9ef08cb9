"""Start, watch and stop the demo's encoder and prefill workers (demo orchestrator).

Every role runs as its own ``python -m common.cli ...`` process on loopback,
in its own session, so a Ctrl-C at the terminal reaches only the orchestrator,
which then stops each child it started in order: SIGTERM, then SIGKILL after
a deadline. Children get the orchestrator's environment without ``EPD_*``
variables: the demo checks against the default encoder, so a deployment's
settings must not leak into it.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 15.0
POLL_S = 0.05


class DemoFailure(RuntimeError):
    """A demo process failed, or did not get ready in time; the message says which and why."""


@dataclass
class Child:
    """A process the demo started, with its log file."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    reader: threading.Thread | None = field(default=None)
    terminated: bool = False  # SIGTERM sent

    @property
    def pid(self) -> int:
        return self.proc.pid

    def running(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 25) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def terminate(self) -> None:
        """Send SIGTERM once, if it still runs (no wait)."""
        # Once only: a second SIGTERM would hit the child's default handler while it
        # cleans up after the first, and kill it mid-way.
        if self.proc.poll() is None and not self.terminated:
            self.terminated = True
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM, wait up to ``timeout_s``, then SIGKILL; the exit status (None if it never went)."""
        if self.proc.poll() is None:
            try:
                self.terminate()
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("%s (pid %d) ignored SIGTERM for %.0f s: killing it", self.name, self.pid, timeout_s)
                self.proc.kill()
                try:
                    self.proc.wait(5.0)
                except subprocess.TimeoutExpired:
                    return None
        if self.reader is not None:
            self.reader.join(5.0)
        return self.proc.returncode


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def spawn(
    name: str, args: list[str], log_path: Path, into: list[Child], *, capture_stdout: bool = False
) -> Child:
    """Start ``python -m common.cli ARGS`` and append it to ``into`` at once (so cleanup sees it);
    stderr (and stdout unless captured) go to ``log_path``."""
    cmd = [sys.executable, "-m", "common.cli", *args]
    # Append mode for every writer of the log (the child's stderr and our copy of its
    # stdout): with O_APPEND each write lands at the end instead of over another's.
    with open(log_path, "ab") as log:
        child = Child(name, subprocess.Popen(
            cmd, stdout=subprocess.PIPE if capture_stdout else log, stderr=log, stdin=subprocess.DEVNULL,
            env=child_env(), start_new_session=True), log_path)
        into.append(child)
    logger.debug("started %s (pid %d): %s", name, child.pid, " ".join(cmd))
    return child


def follow_lines(child: Child, events: queue.Queue[tuple[str, str]]) -> None:
    """Read the child's stdout line by line on a thread: each line goes to ``events`` and its log."""
    stdout = child.proc.stdout
    if stdout is None:
        raise ValueError(f"{child.name} was started without a stdout pipe")

    def pump(stream: IO[bytes]) -> None:
        with open(child.log_path, "ab") as log:
            for raw in iter(stream.readline, b""):
                log.write(raw)
                log.flush()
                events.put((child.name, raw.decode("utf-8", "replace").rstrip("\n")))
        stream.close()

    child.reader = threading.Thread(target=pump, args=(stdout,), name=f"read-{child.name}", daemon=True)
    child.reader.start()


def wait_ready_file(child: Child, path: Path, timeout_s: float) -> dict[str, Any]:
    """The JSON the child writes once it is up; fails if it exits or the deadline passes first."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if not child.running():
            raise DemoFailure(f"{child.name} exited with status {child.proc.returncode} before it was ready:\n"
                              f"{child.log_tail()}")
        if time.monotonic() > deadline:
            raise DemoFailure(f"{child.name} not ready within {timeout_s:.0f} s:\n{child.log_tail()}")
        time.sleep(POLL_S)
    info: dict[str, Any] = json.loads(path.read_text())
    return info


def wait_serving(target: str, timeout_s: float) -> None:
    """Poll ``grpc.health.v1`` (overall status) until SERVING or the deadline."""
    deadline = time.monotonic() + timeout_s
    status = "no answer"
    with grpc.insecure_channel(target) as channel:
        stub: Any = health_pb2_grpc.HealthStub(channel)  # its stubs declare no methods
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DemoFailure(f"encoder at {target} not SERVING within {timeout_s:.0f} s (last: {status})")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=min(2.0, left))
                status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError as exc:
                status = exc.code().name
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))


def scrape(port: int, timeout_s: float = 5.0) -> str:
    """The text of ``http://127.0.0.1:PORT/metrics``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout_s) as resp:
        body: bytes = resp.read()
    return body.decode("utf-8")


def stop_all(children: list[Child], timeout_s: float = STOP_TIMEOUT_S) -> dict[str, int | None]:
    """Stop every child: the later ones together first, then the first (the encoder the
    workers hold leases on, so its drain has nothing to wait for)."""
    codes: dict[str, int | None] = {}
    clients = children[1:]
    for child in clients:
        child.terminate()
    for child in clients:
        codes[child.name] = child.stop(timeout_s)
    if children:
        codes[children[0].name] = children[0].stop(timeout_s)
    return codes
