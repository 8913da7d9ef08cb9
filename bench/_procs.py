"""Shared by the bench scripts: start/stop an `epd encoder` process and make test images."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]


def start_encoder(workdir: Path, transport: str, blocks: int, *, ready_timeout_s: float, block_size: int = 64,
                  extra_args: Sequence[str] = ()) -> tuple[subprocess.Popen[bytes], int, str]:
    """`epd encoder` on 127.0.0.1, port 0, eager graphs, 64-row blocks by default; (process, port, transport)."""
    ready = workdir / "encoder.ready.json"
    cmd = [sys.executable, "-m", "common.cli", "encoder", "--host", "127.0.0.1", "--port", "0",
           "--metrics-port", "-1", "--transport", transport, "--encoder-backend", "eager",
           "--cache-blocks", str(blocks), "--block-size", str(block_size), "--ready-file", str(ready),
           "--log-level", "WARNING", *extra_args]
    with open(workdir / "encoder.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    deadline = time.monotonic() + ready_timeout_s
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"encoder did not start:\n{(workdir / 'encoder.log').read_text()}")
        time.sleep(0.05)
    info = json.loads(ready.read_text())
    return proc, int(info["port"]), str(info["transport"])


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL if it has not exited within 30 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def png(seed: int, size: int = 64) -> bytes:
    """A square PNG of random pixels, distinct per seed."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, size=(size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="PNG")
    return buf.getvalue()
