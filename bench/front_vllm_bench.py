"""Phase v of ``bench/front.py``: vLLM's own benchmark client, ``vllm bench serve``, through each side (bench process).

``vllm bench serve --backend openai-chat`` (run as ``epd vllm bench serve``, which works on the
CPU build too) sends its own requests at a fixed concurrency and writes one JSON result per set:
request throughput and time to first token at vLLM's own percentiles. Text sets (``random``
prompts of 330 tokens, 8 out, ``--ignore-eos``) go through the proxy, the bare relay and straight
to the consumer, as chats and again as text completions (``--backend openai``, the client's
default, on ``/v1/completions``); image sets (``random-mm``: one new random image of ``--side``
pixels a request) through the proxy and to plain vLLM. Each set has a seed of its own, so no prompt or image is in
the cache of the vLLM it reaches. The sides' sets alternate as in the other phases. Not measured:
vLLM's own warm-up requests at the start of every text set (``--num-warmups``: one prompt, as
many times as there are slots), and a whole text set through each side before the first.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from bench.front_load import MODEL, SET_REQUESTS_PER_SLOT, cpu_ms, ratio, tree_ticks
from bench.front_stack import Stack

BENCH_TIMEOUT_S = 900.0
TEXT_TOKENS = 330  # about phase a's prompts
TEXT_OUTPUT_TOKENS = 8
IMAGE_PROMPT_TOKENS = 16
IMAGE_OUTPUT_TOKENS = 4
CHAT_API = ("--backend", "openai-chat", "--endpoint", "/v1/chat/completions")
COMPLETIONS_API = ("--backend", "openai", "--endpoint", "/v1/completions")  # the client's default
RESULT_KEYS = ("completed", "failed", "duration", "request_throughput", "median_ttft_ms", "p99_ttft_ms",
               "mean_ttft_ms", "median_e2el_ms")


def bench_serve(stack: Stack, url: str, tag: str, seed: int, *options: str) -> dict[str, Any]:
    """One ``vllm bench serve`` set against ``url``; the figures of its JSON result that phase v reports.
    ``options`` name the client's backend and endpoint (:func:`text_options`, :func:`image_options`)."""
    result_dir = stack.logs / "vllm-bench"
    result_dir.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "common.cli", "vllm", "bench", "serve", "--base-url", url, "--model", MODEL,
           "--tokenizer", str(stack.real), "--seed", str(seed), "--disable-tqdm",
           "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,99",
           "--save-result", "--result-dir", str(result_dir), "--result-filename", f"{tag}.json", *options]
    log = stack.logs / f"vllm-bench-{tag}.log"
    with open(log, "wb") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=BENCH_TIMEOUT_S, check=False)
    if done.returncode != 0:
        raise SystemExit(f"vllm bench serve ({tag}) exited with {done.returncode}:\n"
                         f"{log.read_text(errors='replace')[-3000:]}")
    result = json.loads((result_dir / f"{tag}.json").read_text())
    return {key: result.get(key) for key in RESULT_KEYS}


def text_options(prompts: int, concurrency: int, *, completions: bool = False) -> tuple[str, ...]:
    """Random text prompts, as chats (``openai-chat``) or, ``completions``, as text completions (the
    client's default backend, ``openai``)."""
    return (*(COMPLETIONS_API if completions else CHAT_API), "--dataset-name", "random",
            "--random-input-len", str(TEXT_TOKENS), "--random-output-len", str(TEXT_OUTPUT_TOKENS),
            "--ignore-eos", "--num-prompts", str(prompts), "--max-concurrency", str(concurrency),
            "--num-warmups", str(2 * concurrency))


def image_options(args: argparse.Namespace) -> tuple[str, ...]:
    return (*CHAT_API, "--dataset-name", "random-mm",
            "--random-input-len", str(IMAGE_PROMPT_TOKENS), "--random-output-len",
            str(IMAGE_OUTPUT_TOKENS), "--ignore-eos", "--random-mm-base-items-per-request", "1",
            "--random-mm-num-mm-items-range-ratio", "0", "--random-mm-limit-mm-per-prompt",
            '{"image": 1, "video": 0}', "--random-mm-bucket-config", f"{{({args.side}, {args.side}, 1): 1.0}}",
            "--num-prompts", str(args.requests), "--max-concurrency", str(args.concurrency))


def alternate(stack: Stack, sides: Sequence[tuple[str, str, int | None]], name: str, rounds: int,
              options: tuple[str, ...], seed: int, warm_up: bool = False) -> dict[str, Any]:
    """``rounds`` sets per side (name, url, proxy pid), the order reversed every other round, each set
    with a seed of its own (its prompts and images new to the vLLM it reaches); per side the sets'
    figures, their completed requests over their summed durations, the mean of the sets' TTFT
    medians, and the proxy's CPU time a request where there is one. ``warm_up``: a whole set through
    each side first, not measured (random prompts of many lengths: vLLM's CPU kernels meet new
    shapes, and whichever side came first paid for them)."""
    for index, (side, url, _pid) in enumerate(sides if warm_up else ()):
        bench_serve(stack, url, f"{name}-{side}-warm-up", seed + 1000 + index, *options)
    sets: dict[str, list[dict[str, Any]]] = {side: [] for side, _, _ in sides}
    ticks: dict[str, int] = {side: 0 for side, _, _ in sides}
    for rnd in range(rounds):
        order = list(enumerate(sides))
        for index, (side, url, pid) in (order if rnd % 2 == 0 else order[::-1]):
            # The proxy's CPU is read around the whole run, vLLM's imports and warm-up included: an upper bound.
            before = tree_ticks(pid) if pid is not None else 0
            got = bench_serve(stack, url, f"{name}-{side}-{rnd}", seed + 10 * rnd + index, *options)
            ticks[side] += (tree_ticks(pid) - before) if pid is not None else 0
            sets[side].append(got)
            print(f"  vllm bench serve {name} {side} round {rnd}: {got['completed']} done in "
                  f"{got['duration']:.2f} s, TTFT p50 {got['median_ttft_ms']:.1f} ms", file=sys.stderr)
    out: dict[str, Any] = {}
    for side, _, pid in sides:
        runs = sets[side]
        completed = sum(r["completed"] or 0 for r in runs)
        duration = sum(r["duration"] or 0.0 for r in runs)
        medians = [r["median_ttft_ms"] for r in runs]
        out[side] = {"requests_per_s": round(completed / duration, 3) if duration else 0.0,
                     "ttft_p50_ms_mean_of_sets": round(sum(medians) / len(medians), 2),
                     "failed": sum(r["failed"] or 0 for r in runs), "sets": runs}
        if pid is not None:
            out[side]["proxy_cpu_ms_per_request_upper"] = round(cpu_ms(ticks[side]) / max(1, completed), 2)
    return out


def phase_vllm_bench(stack: Stack, args: argparse.Namespace, out: dict[str, Any]) -> None:
    """Text at 16 in flight through proxy, relay and direct; new images through proxy and plain vLLM."""
    proxy = stack.proxies["proxy"]
    text_sides = [("proxy", proxy.url, proxy.proc.pid), ("relay", stack.proxies["relay"].url, None),
                  ("direct", stack.consumers[0].url, None)]
    conc = max(args.text_concurrency)
    prompts = max(args.text_requests, 2 * SET_REQUESTS_PER_SLOT * conc)  # sets of about 4 s
    for name, completions, seed in (("text", False, 60_000), ("completions", True, 80_000)):
        text = alternate(stack, text_sides, name, args.rounds, text_options(prompts, conc, completions=completions),
                         seed, warm_up=True)
        out[f"vllm_bench_{name}"] = {"concurrency": conc, "prompts_per_set": prompts, **text}
        for side, anchor in (("proxy", "direct"), ("relay", "direct"), ("proxy", "relay")):
            out[f"vllm_bench_{name}_{side}_throughput_vs_{anchor}"] = ratio(
                text[side]["requests_per_s"], text[anchor]["requests_per_s"])
            out[f"vllm_bench_{name}_{side}_added_ttft_p50_ms_over_{anchor}"] = round(
                text[side]["ttft_p50_ms_mean_of_sets"] - text[anchor]["ttft_p50_ms_mean_of_sets"], 2)
    if stack.plain is None:
        return
    image_sides = [("proxy", proxy.url, proxy.proc.pid), ("plain", stack.plain.url, None)]
    images = alternate(stack, image_sides, "images", args.rounds, image_options(args), 70_000)
    out["vllm_bench_new_images"] = {"concurrency": args.concurrency, "prompts_per_set": args.requests, **images}
    out["vllm_bench_new_images_throughput_vs_plain"] = ratio(
        images["proxy"]["requests_per_s"], images["plain"]["requests_per_s"])
    out["vllm_bench_new_images_ttft_p50_vs_plain"] = ratio(
        images["proxy"]["ttft_p50_ms_mean_of_sets"], images["plain"]["ttft_p50_ms_mean_of_sets"])
