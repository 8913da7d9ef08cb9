"""``epd prefill``: run chat requests through the reference prefill worker (prefill process).

Reads one JSON request per line (see :mod:`prefill_client.reference.chat`), handshakes
with the encoders, and prints one line per request: its index, first token,
time to first token and, for each media item, the cache layer that served
it (``prefix``, ``local``, ``encoder-hit``, ``encoder-miss``). ``--json``
adds a summary object as the last line. The worker's ``/metrics`` is served
while the requests run (and ``--linger-s`` longer; SIGTERM ends the wait and
the worker exits 0 when every request ran). ``--dump-dir`` keeps the rows the
worker merged for each request and item (see :mod:`prefill_client.reference.dump`), so
another process can check them against its own encode.

Exit status: 0 when every request ran, 1 on ``ECLoadFailure`` (the worker
could not prove an embedding), 2 on any other error (bad flags, bad
requests, unreachable or incompatible encoder).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, TextIO

from common.config import PrefillConfig, add_arguments, build
from common.errors import ConfigError, ECLoadFailure, EncoderCallError, EpdError
from common.malloc import keep_freed_memory
from common.metrics import PrefillMetrics
from prefill_client.reference.chat import ChatRequest, load_requests
from prefill_client.reference.dump import MergeRecorder, write_request
from prefill_client.reference.tokenizer import token_name
from prefill_client.reference.worker import PrefillResult, PrefillWorker, WorkerLimits

logger = logging.getLogger(__name__)

EXIT_LOAD_FAILURE = 1
EXIT_ERROR = 2
EXIT_TERMINATED = 128 + signal.SIGTERM
MAX_LINGER_S = 3600.0

_METRICS = (
    "vllm:mm_cache_queries_total", "vllm:mm_cache_hits_total",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
    "vllm_neuron:scheduler_encoder_cache_queries_total", "vllm_neuron:scheduler_encoder_cache_hits_total",
    "epd_pulls_total", "epd_pull_bytes_total",
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="epd prefill",
        description="Run chat requests (text + images/videos) through the reference prefill worker: "
                    "layer-1 input cache, prefix cache, encoder cache pulls, merge, static-shape prefill.",
        epilog="Each flag can also be set by the environment variable named in its help; "
               "a flag wins over the variable.")
    add_arguments(parser, PrefillConfig)
    parser.add_argument("--requests", required=True, metavar="FILE.jsonl",
                        help="one chat request per line; relative media paths are read from the file's directory")
    parser.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    parser.add_argument("--ready-file", default=None, metavar="PATH",
                        help="write {'metrics_port', 'pid'} as JSON here once /metrics is up")
    parser.add_argument("--linger-s", type=float, default=0.0, metavar="S",
                        help=f"keep /metrics up this long after the last request (at most {MAX_LINGER_S:.0f})")
    parser.add_argument("--dump-dir", default=None, metavar="DIR",
                        help="write the rows merged for each request and item, and one JSON line per "
                             "request, into DIR (created if missing)")
    parser.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    return parser


def result_line(index: int, result: PrefillResult) -> str:
    items = " ".join(f"{item.kind}:{item.layer}" for item in result.items) or "-"
    return (f"request {index}: first_token={result.first_token} {token_name(result.first_token)} "
            f"ttft_ms={result.ttft_s * 1e3:.1f} prompt_tokens={result.prompt_tokens} "
            f"prefix_hit_tokens={result.prefix_hit_tokens} items=[{items}]")


def result_json(index: int, result: PrefillResult) -> dict[str, Any]:
    return {
        "index": index, "first_token": result.first_token, "ttft_ms": round(result.ttft_s * 1e3, 3),
        "prompt_tokens": result.prompt_tokens, "prefix_hit_tokens": result.prefix_hit_tokens,
        "items": [{"kind": i.kind, "mm_hash": i.mm_hash, "num_tokens": i.num_tokens, "offset": i.offset,
                   "mm_cache_hit": i.mm_cache_hit, "layer": i.layer} for i in result.items],
    }


def run_requests(
    worker: PrefillWorker, requests: Sequence[ChatRequest], out: TextIO, results: list[PrefillResult],
    on_result: Callable[[int, PrefillResult], None] | None = None,
) -> None:
    """Prefill each request in order, printing its line and appending to ``results``; errors propagate.

    ``on_result`` runs before the request's line is printed, so whoever reads
    the lines finds what it wrote already there.
    """
    for request in requests:
        result = worker.prefill(request)
        if on_result is not None:
            on_result(len(results), result)
        print(result_line(len(results), result), file=out, flush=True)
        results.append(result)


def summary(worker: PrefillWorker, results: Sequence[PrefillResult]) -> dict[str, Any]:
    sample = worker.metrics.registry.get_sample_value
    return {
        "mode": worker.mode.value,
        "graph": "compiled" if worker.graph.compiled else "eager",
        "graph_shapes": sorted(list(s) for s in worker.graph.shapes_seen),
        "requests": [result_json(i, r) for i, r in enumerate(results)],
        "metrics": {name: sample(name) or 0.0 for name in _METRICS},
    }


class Closeable(Protocol):
    def close(self) -> None: ...


WorkerFactory = Callable[[PrefillConfig, PrefillMetrics], tuple[Closeable, PrefillWorker]]


def build_worker(cfg: PrefillConfig, metrics: PrefillMetrics) -> tuple[Closeable, PrefillWorker]:
    """The EPD client and a worker on top of it (heavy imports only once the flags parsed)."""
    from prefill_client.consumer.client import EncoderCacheClient
    from prefill_client.reference.lm import LMConfig, build_lm

    client = EncoderCacheClient.from_config(cfg, metrics)
    try:
        lm = build_lm(LMConfig(hidden_size=cfg.out_hidden_size, num_deepstack_levels=cfg.deepstack_levels),
                      seed=cfg.lm_seed, weights_dir=cfg.lm_weights)
        if lm.config.hidden_size != cfg.out_hidden_size:
            raise ConfigError(
                f"--lm-weights hidden_size {lm.config.hidden_size} differs from --out-hidden-size "
                f"{cfg.out_hidden_size} (the encoder's out_hidden_size)")
        limits = WorkerLimits(
            max_model_len=cfg.max_model_len, prefix_block_size=cfg.prefix_block_size,
            prefix_cache_blocks=cfg.prefix_cache_blocks, mm_cache_items=cfg.mm_cache_items)
        worker = PrefillWorker(client, lm, model_id=cfg.model_id, metrics=metrics, limits=limits,
                               compile=cfg.compile_graph, device=cfg.device)
    except BaseException:
        client.close()
        raise
    return client, worker


class Terminated(BaseException):
    """SIGTERM arrived: unwind (closing the client) instead of dying mid-way."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated(signum)


def _dumper(dump_dir: str, worker: PrefillWorker) -> Callable[[int, PrefillResult], None]:
    """Wrap the worker's row store in a recorder; the hook writes each request's dump."""
    path = Path(dump_dir)
    path.mkdir(parents=True, exist_ok=True)
    recorder = MergeRecorder(worker.rows)
    worker.rows = recorder

    def write(index: int, result: PrefillResult) -> None:
        write_request(path, index, result_json(index, result), recorder.take())

    return write


def _write_ready(path: str, metrics_port: int) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"metrics_port": metrics_port, "pid": os.getpid()}, f)
    os.replace(tmp, path)


def main(argv: list[str], make_worker: WorkerFactory = build_worker) -> int:
    """Entry point of ``epd prefill``; ``make_worker`` builds the embedding source and the worker."""
    parser = _parser()
    args = parser.parse_args(argv)
    logging.getLogger().setLevel(args.log_level.upper())
    try:
        cfg: PrefillConfig = build(PrefillConfig, args, os.environ)
    except ConfigError as exc:
        parser.error(str(exc))
    if cfg.keep_freed_memory:
        keep_freed_memory()
    if not 0 <= args.linger_s <= MAX_LINGER_S:
        parser.error(f"--linger-s must be in [0, {MAX_LINGER_S:.0f}], got {args.linger_s}")
    try:
        requests = load_requests(args.requests)
    except EpdError as exc:
        print(f"epd prefill: {exc}", file=sys.stderr)
        return EXIT_ERROR

    from prometheus_client import start_http_server

    metrics = PrefillMetrics()
    httpd = None
    metrics_port = -1
    if cfg.metrics_port >= 0:
        httpd, _ = start_http_server(cfg.metrics_port, addr=cfg.metrics_host, registry=metrics.registry)
        metrics_port = httpd.server_port
    if args.ready_file:
        _write_ready(args.ready_file, metrics_port)
    client: Closeable | None = None
    results: list[PrefillResult] = []
    where = "start-up"
    # Signal handlers can only be set from the main thread (tests call main from others).
    old_handler = None
    if threading.current_thread() is threading.main_thread():
        old_handler = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        client, worker = make_worker(cfg, metrics)
        on_result = _dumper(args.dump_dir, worker) if args.dump_dir else None
        where = "request"
        run_requests(worker, requests, sys.stdout, results, on_result)
        where = "linger"
        if args.json:
            print(json.dumps(summary(worker, results)), flush=True)
        if args.linger_s and httpd is not None:
            time.sleep(args.linger_s)
        return 0
    except Terminated:
        # Terminated while lingering: every request ran, that is a clean exit.
        if where == "linger":
            return 0
        print(f"epd prefill: terminated during {where} after {len(results)} requests", file=sys.stderr)
        return EXIT_TERMINATED
    except EpdError as exc:
        at = f"request {len(results)}" if where == "request" else where
        failed = "encoder call failed: " if isinstance(exc, EncoderCallError) else ""
        print(f"epd prefill: {at}: {failed}{exc}", file=sys.stderr)
        return EXIT_LOAD_FAILURE if isinstance(exc, ECLoadFailure) else EXIT_ERROR
    finally:
        if old_handler is not None:
            signal.signal(signal.SIGTERM, old_handler)
        if client is not None:
            client.close()
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
