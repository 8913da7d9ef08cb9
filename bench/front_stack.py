"""The processes of ``bench/front.py``: a Qwen3-VL checkpoint of the 2B tower's width, ``epd encoder --tower
vllm``, consumer vLLMs with the connector, ``epd proxy`` before them, a plain vLLM; pinned, warmed up,
stopped; the consumers' prefix cache counters (bench process)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.encoder import PRESETS
from bench.front_load import MODEL, Side, measure_set
from common.weights_digest import checkpoint_digest
from encoder_server.vision.config import VisionConfig
from epd_harness.families import noise_vision_copy
from epd_harness.media import image_url
from epd_harness.ports import free_port
from epd_harness.procs import EncoderProcess, launch_encoder
from epd_harness.qwen3vl import write_qwen3vl_checkpoint
from epd_harness.vllm import (
    Server,
    connector_config,
    consumer_args,
    launch_vllm,
    start_proxy,
    stop_started,
    stop_vllm,
    wait_vllm,
)
from epd_harness.waits import log_tail, wait_ready

PRESET = "qwen3-vl-2b"
ENCODER_CORE, PLAIN_CORE, CONSUMER_CORE = 0, 0, 1
METRICS_TIMEOUT_S = 5.0
METRICS_WAIT_S = 60.0  # vLLM counts a request in /metrics a moment after answering it
METRICS_POLL_S = 0.1
MEMORY_POLL_S = 5.0
SCRIPT_LIMIT_S = 60.0


def vision_config() -> VisionConfig:
    preset = dict(PRESETS[PRESET])
    preset["deepstack_visual_indexes"] = tuple(preset["deepstack_visual_indexes"])
    return VisionConfig(**preset)


def checkpoints(work: Path) -> tuple[Path, Path]:
    """The real checkpoint and its noise-vision copy under ``work``, written unless already there."""
    real, noise = work / "checkpoint", work / "checkpoint-noise"
    vision = vision_config()
    config = real / "config.json"
    wanted = {"depth": vision.depth, "hidden_size": vision.hidden_size, "out_hidden_size": vision.out_hidden_size}
    if not (config.exists() and (noise / "config.json").exists() and all(
            json.loads(config.read_text())["vision_config"].get(k) == v for k, v in wanted.items())):
        started = time.perf_counter()
        write_qwen3vl_checkpoint(real, seed=7, vision=vision)
        noise_vision_copy(real, noise)
        print(f"checkpoints written in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return real, noise


def wait_for_memory(gib: float, limit_s: float) -> None:
    """Wait, at most ``limit_s``, until the box has ``gib`` GiB available (MemAvailable): the stack holds
    about 13 GiB, and on a shared box an engine that finds too little fails its start."""
    deadline = time.monotonic() + limit_s
    while True:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:")) / 2**20
        if available >= gib:
            return
        if time.monotonic() > deadline:
            print(f"only {available:.1f} GiB available after {limit_s:.0f} s; starting anyway", file=sys.stderr)
            return
        print(f"{available:.1f} GiB available, waiting for {gib:.0f}", file=sys.stderr)
        time.sleep(MEMORY_POLL_S)


def wait_for_quiet(max_load: float, limit_s: float) -> float:
    """Wait, at most ``limit_s``, until the 1-minute load average is below ``max_load``; that load."""
    deadline = time.monotonic() + limit_s
    while (load := os.getloadavg()[0]) >= max_load and time.monotonic() < deadline:
        print(f"load {load:.1f}, waiting for it to fall below {max_load:.1f}", file=sys.stderr)
        time.sleep(MEMORY_POLL_S)
    return load


def pin(pid: int, cores: set[int]) -> None:
    """Bind every thread of ``pid`` to ``cores``; threads it starts later inherit their creator's."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(tid), cores)


def metric_totals(base_url: str, *names: str, http: httpx.Client | None = None) -> list[float]:
    """Each metric summed over its label sets (engines, finish reasons), from ``base_url``/metrics;
    ``http``: a client kept open by a caller that scrapes often (each ``httpx.get`` builds a client
    and a TLS context, and leaves garbage that Python's collector frees later, in the middle of
    whatever runs next)."""
    get = http.get if http is not None else httpx.get
    text = get(base_url + "/metrics", timeout=METRICS_TIMEOUT_S).text
    totals = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += float(sample.value)
    return [totals[n] for n in names]


@dataclass
class Stack:
    """The processes, and a :class:`Side` for each way in: ``proxy`` (also ``one_backend``), ``direct``
    (consumer A without the proxy), ``relay`` (``bench/relay.py`` before A, for phase a), ``plain``,
    ``unhinted`` (a proxy before A that sends no prefetch hints, for phase e), and for phase d
    ``affinity`` and ``round_robin``."""

    args: argparse.Namespace
    logs: Path
    real: Path
    noise: Path
    encoder: EncoderProcess
    consumers: list[Server]
    plain: Server | None = None
    proxies: dict[str, Server] = field(default_factory=dict)
    sides: dict[str, Side] = field(default_factory=dict)
    # Each consumer's connector /metrics (its scheduler side: pulls, their latency), by consumer.
    connector_metrics: list[str] = field(default_factory=list)

    def side(self, name: str) -> Side:
        return self.sides[name]

    def _open(self, name: str, server: Server, proxy: bool) -> None:
        self.sides[name] = Side(name, server.url, server.proc.pid if proxy else None)
        self.sides[name].open()

    @contextlib.asynccontextmanager
    async def clients(self) -> AsyncIterator[None]:
        """Open a client per side, warm every path up; close the clients at the end."""
        self._open("proxy", self.proxies["proxy"], True)
        self._open("one_backend", self.proxies["proxy"], True)
        self._open("direct", self.consumers[0], False)
        for name in ("relay", "unhinted"):
            if name in self.proxies:
                self._open(name, self.proxies[name], True)
        if self.plain is not None:
            self._open("plain", self.plain, False)
        try:
            await self._warm_up(["direct", "relay", "plain", "proxy", "unhinted"], 9_000)
            yield
        finally:
            for side in self.sides.values():
                if side.client is not None:
                    await side.client.close()

    async def _warm_up(self, names: list[str], seed: int) -> None:
        """First requests pay one-off costs (connections, NIXL peers, allocations): not measured. Each
        side gets text and an image, the proxies' image twice (a miss, then a hit)."""
        text = [{"role": "user", "content": "warm-up " + "x" * 100}]
        for name in names:
            if name not in self.sides:
                continue
            image = [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": image_url(seed, self.args.side, self.args.side)}},
                {"type": "text", "text": "warm-up"}]}]
            plan = [(text, 2)] + ([] if name in ("direct", "relay") else [(image, 1 if name == "plain" else 2)])
            for messages, count in plan:
                got = await measure_set(self.sides[name], [messages] * count, 1, 2)
                if got.failed:
                    raise SystemExit(f"warm-up through {name} failed")
            seed += 1
        print(f"warm-up of {names} done", file=sys.stderr)

    async def add_second_backend(self) -> None:
        """For phase d: stop plain vLLM (no later phase uses it; memory), start consumer B on A's core and
        the proxies before both, ``--routing affinity`` and ``round-robin``."""
        if self.plain is not None:
            stop_vllm(self.plain)
            self.plain = None
        config, metrics_url = consumer_config(self.encoder, self.real)
        server = launch_vllm(self.noise, self.logs / "vllm-consumer-b.log", *engine_args(self.args),
                             *consumer_args(config), cpu_core=CONSUMER_CORE, log_stats=True)
        self.consumers.append(server)
        self.connector_metrics.append(metrics_url)
        wait_vllm(server)
        urls = [c.url for c in self.consumers]
        for name, routing in (("affinity", "affinity"), ("round_robin", "round-robin")):
            self.proxies[name] = start_proxy(self.logs / f"proxy-{name}.log", [self.encoder.target], urls,
                                             *proxy_args(self.args), "--routing", routing)
            self._open(name, self.proxies[name], True)
        # Round robin sends the warm-up's two image requests to A and to B: B's first pull is not timed.
        await self._warm_up(["affinity", "round_robin"], 9_100)

    def prefix_cache(self, settled_requests: float | None = None) -> dict[str, list[float]]:
        """Per consumer: prefix cache hit and query tokens and finished requests, once the consumers
        count ``settled_requests`` finished requests in all (if given)."""
        names = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "vllm:request_success_total")
        deadline = time.monotonic() + METRICS_WAIT_S
        while True:
            rows = [metric_totals(c.url, *names) for c in self.consumers]
            if settled_requests is None or sum(r[2] for r in rows) >= settled_requests:
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"consumers' /metrics still count {sum(r[2] for r in rows)} requests, "
                                 f"not {settled_requests}, after {METRICS_WAIT_S:.0f} s")
            time.sleep(METRICS_POLL_S)
        return {"hits": [r[0] for r in rows], "queries": [r[1] for r in rows], "requests": [r[2] for r in rows]}

    def check(self) -> None:
        """Fail at once, naming it, when a process of the stack has exited (on a shared box: the OOM killer)."""
        servers: list[tuple[str, Server | EncoderProcess]] = [("encoder", self.encoder)]
        servers += [(f"consumer {'ab'[i]}", c) for i, c in enumerate(self.consumers)]
        servers += [(f"proxy {n}", p) for n, p in self.proxies.items()]
        servers += [("plain vLLM", self.plain)] if self.plain is not None else []
        for name, server in servers:
            if server.proc.poll() is not None:
                raise SystemExit(f"{name} exited with {server.proc.returncode}:\n{log_tail(server.log_path, 3000)}")
        # vLLM's engine runs in children of its server: a killed worker leaves the server up but dead.
        for name, server in servers:
            if isinstance(server, Server) and server.healthy() is None:
                raise SystemExit(f"{name} does not answer /health:\n{log_tail(server.log_path, 3000)}")

    def stop(self) -> None:
        for proxy in self.proxies.values():
            proxy.stop()
        for consumer in self.consumers:
            stop_vllm(consumer)
        if self.plain is not None:
            stop_vllm(self.plain)
        self.encoder.terminate()


def engine_args(args: argparse.Namespace) -> tuple[str, ...]:
    seqs = max([16, args.concurrency, args.conversations, *args.text_concurrency])
    # No dummy encoder run at start-up (a largest-image pass of the 2B-width tower: minutes on one core).
    return "--served-model-name", MODEL, "--max-num-seqs", str(seqs), "--skip-mm-profiling"


def consumer_config(encoder: EncoderProcess, real: Path) -> tuple[str, str]:
    """The connector's config, and the base URL of its /metrics."""
    port = free_port()
    config = connector_config([encoder.target], MODEL, metrics_port=port, metrics_host="127.0.0.1",
                              weights_digest=checkpoint_digest(real))
    return config, f"http://127.0.0.1:{port}"


def proxy_args(args: argparse.Namespace) -> tuple[str, ...]:
    workers = ("--workers", str(args.proxy_workers)) if args.proxy_workers > 1 else ()
    return "--model-id", MODEL, *workers


def start_script(log_path: Path, script: str, *args: str) -> Server:
    """``bench/SCRIPT --port PORT ARGS`` (an HTTP server of the bench's own) on a free port, once it
    answers ``/health``."""
    port = free_port()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name(script)), "--port", str(port), *args],
                                stdout=log, stderr=subprocess.STDOUT)
    server = Server(proc, port, log_path)
    return wait_ready(f"bench/{script}", proc, log_path, server.healthy, limit_s=SCRIPT_LIMIT_S, poll_s=0.2,
                      give_up=server.stop)


def start_relay(log_path: Path, backend: str) -> Server:
    """``bench/relay.py`` before ``backend``, once it answers health."""
    return start_script(log_path, "relay.py", "--backend", backend)


def start_stack(work: Path, logs: Path, args: argparse.Namespace) -> Stack:
    """Start the encoder, consumer A, the proxy before it and (for phases b and c) plain vLLM, and wait
    until each is up (checkpoints in ``work``, logs in ``logs``); on failure stop what started, then raise."""
    real, noise = checkpoints(work)
    wait_for_memory(args.min_free_gib, args.memory_wait_s)
    started: list[Server | EncoderProcess] = []
    try:
        plain = None
        if {"b", "c", "v"} & set(args.phases):
            plain = launch_vllm(real, logs / "vllm-plain.log", *engine_args(args), cpu_core=PLAIN_CORE)
            started.append(plain)
        # One torch thread: the tower gets one core, as the plain engine's does.
        encoder = launch_encoder(logs, "--tower", "vllm", "--weights", str(real), "--cache-dtype", "float32",
                                 "--model-id", MODEL, "--port", str(free_port()),
                                 env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}).wait()
        started.append(encoder)
        pin(encoder.proc.pid, {ENCODER_CORE})
        config, metrics_url = consumer_config(encoder, real)
        consumer = launch_vllm(noise, logs / "vllm-consumer-a.log", *engine_args(args), *consumer_args(config),
                               cpu_core=CONSUMER_CORE, log_stats=True)
        started.append(consumer)
        for server in (plain, consumer):
            if server is not None:
                wait_vllm(server)
        proxy = start_proxy(logs / "proxy.log", [encoder.target], [consumer.url], *proxy_args(args))
        proxies = {"proxy": proxy}
        try:
            if {"a", "v"} & set(args.phases):  # the bare hop beside the proxy, before the same vLLM
                proxies["relay"] = start_relay(logs / "relay.log", consumer.url)
            if "e" in args.phases:  # phase e's held images without prefetch hints, beside the proxy's
                proxies["unhinted"] = start_proxy(logs / "proxy-unhinted.log", [encoder.target], [consumer.url],
                                                  *proxy_args(args), "--prefetch-hints", "false")
        except BaseException:
            for started_proxy in proxies.values():
                started_proxy.stop()
            raise
    except BaseException:
        stop_started(started)
        raise
    print(f"stack up: encoder {encoder.target}, plain {plain.url if plain else None}, consumer {consumer.url}, "
          f"proxy {proxy.url}", file=sys.stderr)
    return Stack(args, logs, real, noise, encoder, [consumer], plain, proxies,
                 connector_metrics=[metrics_url])
