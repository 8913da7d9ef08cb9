"""Drive a gated `epd prefill` process from a test: one request per ``step()`` (test process)."""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from epd_harness.waits import wait_ready

# Bounds the whole start; a stalled one fails long before (see epd_harness.waits).
READY_LIMIT_S = 300.0
STEP_TIMEOUT_S = 60.0
_LINE = re.compile(
    r"^request (?P<index>\d+): first_token=(?P<first_token>\d+) .*? ttft_ms=(?P<ttft_ms>[\d.]+) "
    r"prompt_tokens=(?P<prompt_tokens>\d+) prefix_hit_tokens=(?P<prefix_hit_tokens>\d+) items=\[(?P<items>[^\]]*)\]$")


@dataclass(frozen=True, slots=True)
class StepResult:
    """One result line of `epd prefill`."""

    index: int
    first_token: int
    ttft_ms: float
    prompt_tokens: int
    prefix_hit_tokens: int
    layers: tuple[str, ...]  # per media item: prefix | local | encoder-hit | encoder-miss

    @classmethod
    def parse(cls, line: str) -> StepResult:
        m = _LINE.match(line)
        if m is None:
            raise AssertionError(f"not a result line of epd prefill: {line!r}")
        items = m["items"]
        layers = () if items == "-" else tuple(part.split(":", 1)[1] for part in items.split())
        return cls(int(m["index"]), int(m["first_token"]), float(m["ttft_ms"]), int(m["prompt_tokens"]),
                   int(m["prefix_hit_tokens"]), layers)


def _pump(stream: IO[bytes], lines: queue.Queue[str | None]) -> None:
    for raw in stream:
        lines.put(raw.decode(errors="replace").rstrip("\n"))
    lines.put(None)


class GatedPrefill:
    """`python -m tests.support.gated_prefill ...`: its stdout lines, its /metrics port, its gate."""

    def __init__(self, proc: subprocess.Popen[bytes], log_path: Path, metrics_port: int) -> None:
        self.proc = proc
        self.log_path = log_path
        self.metrics_port = metrics_port
        self._lines: queue.Queue[str | None] = queue.Queue()
        assert proc.stdout is not None
        threading.Thread(target=_pump, args=(proc.stdout, self._lines), daemon=True).start()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def read_line(self, timeout_s: float = STEP_TIMEOUT_S) -> str:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"no output from epd prefill within {timeout_s} s:\n{self.log()}") from None
        if line is None:
            raise AssertionError(f"epd prefill exited ({self.proc.wait(10)}):\n{self.log()}")
        return line

    def step(self) -> StepResult:
        """Let the next request run and return its result line."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"go\n")
        self.proc.stdin.flush()
        return StepResult.parse(self.read_line())

    def summary(self) -> dict[str, object]:
        """The ``--json`` summary printed after the last request."""
        return json.loads(self.read_line())  # type: ignore[no-any-return]

    def stop(self) -> int:
        """Close the gate and SIGTERM (`epd prefill` exits 0 when every request ran); the exit status."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def start_gated_prefill(tmp_path: Path, *args: str, env: dict[str, str] | None = None,
                        name: str = "prefill") -> GatedPrefill:
    """Start the gated worker (``--metrics-port 0``) and wait until its /metrics is up."""
    ready = tmp_path / f"{name}.ready.json"
    log_path = tmp_path / f"{name}.log"
    ready.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "tests.support.gated_prefill", "--metrics-port", "0",
           "--ready-file", str(ready), *args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                env={**os.environ, **(env or {})})

    def ready_info() -> dict[str, Any] | None:
        return json.loads(ready.read_text()) if ready.exists() else None

    info = wait_ready("epd prefill", proc, log_path, ready_info, limit_s=READY_LIMIT_S)
    return GatedPrefill(proc, log_path, info["metrics_port"])
