"""Every model family through ``epd encoder --tower vllm``: TTFT against plain vLLM, in one run per family.

For each family (tiny random checkpoints made on the spot, as the tests make them): ``epd encoder
--tower vllm`` (the checkpoint's own encoder, loaded through vLLM), a consumer ``vllm serve`` with
EpdCacheConnector behind ``epd proxy``, and a plain ``vllm serve`` of the same checkpoint, each
engine on its own core. Requests are one chat message with one ``--side`` x ``--side`` PNG of
noise, streamed; TTFT is measured at the client, interleaved so a slow moment of the box hits
every path alike:

- ``proxy_new``: an image nobody has seen: the encoder runs the model's tower, the connector pulls
  the rows (a miss: the vLLM tower's encode against plain vLLM's own);
- ``proxy_cached``: an image the encoder already holds: a hit, pull only;
- ``vllm_plain``: the plain server runs its own tower on a new image.

The last line of stdout is one JSON object: per family, p50/p99 in milliseconds and the ratios to
plain vLLM. Usage: ``python bench/vllm_families.py [--families qwen2_5_vl,gemma3] [--requests 12]``.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.vllm_e2e import summary, ttft_ms  # noqa: E402
from epd_harness.families import FAMILIES  # noqa: E402
from epd_harness.media import image_url  # noqa: E402
from epd_harness.vllm import start_tower_stack, vllm_missing  # noqa: E402
from prefill_client.consumer.client import EncoderCacheClient  # noqa: E402
from prefill_client.consumer.connection import MediaSpec  # noqa: E402


def measure(family: str, requests: int, side: int, max_tokens: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        checkpoint = FAMILIES[family](tmp / "checkpoint", 3)
        stack = start_tower_stack(tmp, family, checkpoint, checkpoint)
        try:
            def ttft(base_url: str, url: str) -> float:
                return ttft_ms(base_url, url, max_tokens, model=family)

            for i in range(3):  # one-off costs (connections, allocations, first calls): not measured
                ttft(stack.proxy.url, image_url(10_000 + i, side, side))
                ttft(stack.baseline.url, image_url(10_000 + i, side, side))
            cached = [image_url(20_000 + i, side, side) for i in range(requests)]
            with EncoderCacheClient(stack.encoder.target, family) as client:
                for url in cached:
                    client.encode([MediaSpec.image(base64.b64decode(url.split(",", 1)[1]))])
            results: dict[str, list[float]] = {"proxy_new": [], "proxy_cached": [], "vllm_plain": []}
            for i in range(requests):
                results["proxy_new"].append(ttft(stack.proxy.url, image_url(30_000 + i, side, side)))
                results["proxy_cached"].append(ttft(stack.proxy.url, cached[i]))
                results["vllm_plain"].append(ttft(stack.baseline.url, image_url(40_000 + i, side, side)))
        finally:
            stack.stop()
    out: dict[str, Any] = {name: summary(values) for name, values in results.items()}
    plain = out["vllm_plain"]["p50"]
    out["new_vs_plain_p50"] = round(out["proxy_new"]["p50"] / plain, 3)
    out["cached_vs_plain_p50"] = round(out["proxy_cached"]["p50"] / plain, 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--families", default=",".join(sorted(FAMILIES)),
                        help=f"comma-separated, of {', '.join(sorted(FAMILIES))}")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--side", type=int, default=384)
    parser.add_argument("--max-tokens", type=int, default=2)
    args = parser.parse_args()
    reason = vllm_missing()
    if reason:
        raise SystemExit(reason)
    names = [n.strip() for n in args.families.split(",") if n.strip()]
    unknown = sorted(set(names) - set(FAMILIES))
    if unknown:
        raise SystemExit(f"unknown families {unknown}; known: {sorted(FAMILIES)}")
    out: dict[str, Any] = {}
    for family in names:
        out[family] = measure(family, args.requests, args.side, args.max_tokens)
        print(f"{family}: {json.dumps(out[family])}", file=sys.stderr)
    out["settings"] = {"requests": args.requests, "side": args.side, "max_tokens": args.max_tokens}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
