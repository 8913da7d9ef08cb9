"""The front door: ``epd proxy`` against plain vLLM and against no proxy, in one run, with the ``openai`` client.

The stack (every process real, started here): ``epd encoder --tower vllm`` of a Qwen3-VL checkpoint
written on the spot, whose vision tower has Qwen3-VL-2B's width (``bench/encoder.py``'s
``qwen3-vl-2b`` preset: depth 24, hidden 1024, 16 heads, intermediate 4096, patch 16, out_hidden
2048; random weights) beside a tiny language model (2 layers); a consumer ``vllm serve`` (``A``)
with EpdCacheConnector given a copy of that checkpoint whose vision weights are noise; ``epd
proxy`` before ``A``; and, for phases b and c, a plain ``vllm serve`` of the real checkpoint. Phase
d runs last: plain vLLM is stopped (memory), a second consumer ``B`` started, and two more proxies
before ``A`` and ``B``. Pinning on a 2-core box: the plain engine and the encoder (one torch
thread) on core 0, the consumer engines on core 1; the API servers, the proxies and this client
unpinned. The tower gets one core on either path; the sets run one at a time, so the two on core 0
never compute together. Engines: ``--enforce-eager --dtype float32``, 1 GiB of KV cache, blocks of
128 tokens (the CPU build's), prefix caching on, ``--skip-mm-profiling``.

Requests go through ``openai.AsyncOpenAI`` (streamed, ``ignore_eos``): TTFT is the time from
sending a request to its first streamed token, throughput the requests a set finished over its
wall time with ``concurrency`` requests in flight. Every prompt and image is new to the vLLM it
reaches (no prefix or encoder cache of vLLM helps) unless the phase says otherwise. Sets of the
two sides alternate in ``--rounds`` (A B, then B A, ...), so a slow moment of the box hits both.

- ``a`` text only, through the proxy vs straight to the same vLLM (``direct``), at each
  ``--text-concurrency``: added TTFT p50 and the throughput ratio (at concurrency 1 the sides
  alternate request by request; above it, sets of at least 10 requests per slot in flight); a
  third side, ``relay`` (``bench/relay.py``: a bare aiohttp relay, no parsing, before the same
  vLLM), splits what the proxy costs into the hop any front adds (``text_cN_relay_*``, against
  direct) and the proxy's own work (``text_cN_proxy_*``, against the relay);
- ``b`` images the encoder already holds (placed beforehand) through the proxy vs plain vLLM
  given the same images (its tower runs on each);
- ``c`` every image new to both: the encoder encodes, vs plain vLLM's own tower;
- ``d`` multi-turn image chats (each opens with a text of its own; every turn sends the whole
  conversation, image included, and adds about 200 tokens of question and 16 of answer) through
  a proxy before ``A`` alone, one before ``A`` and ``B`` with ``--routing affinity``, and one with
  ``--routing round-robin``: vLLM's prefix cache hit rate (``vllm:prefix_cache_hits`` over
  ``vllm:prefix_cache_queries``, tokens, summed over the backends, deltas over the phase);
- ``e`` one request at a time through the proxy: an image the encoder holds against a text-only
  request of the same prompt length in tokens (the text padded): the TTFT p50 an image adds, and
  where each kind's time goes (``breakdown_mean_ms``, from the proxy's, vLLM's and the
  connector's own /metrics read around each request: :class:`Breakdown`). After each pair, the
  same image again with other text (``image_in_vllm``): the connector's worker holds its rows
  then, so nothing is transferred (the prompt, under one 128-token block, hits no prefix cache):
  what the image adds with the transfer out of the way. Then another held image through a second
  proxy before ``A`` that sends no prefetch hints (``image_cached_unhinted``): the pull starts
  only when vLLM's scheduler orders it, as without :mod:`prefill_client.vllm.prefetch`;
- ``v`` vLLM's own benchmark client, ``vllm bench serve --backend openai-chat``, instead of the
  ``openai`` one (``bench/front_vllm_bench.py``): random text prompts at the highest
  ``--text-concurrency`` through the proxy, the relay and straight to ``A``, as chats and as text
  completions (the client's default, ``/v1/completions``), and random new images
  (``random-mm``, one of ``--side`` pixels a request) at ``--concurrency`` through the proxy and
  to plain vLLM.

Before starting, the script waits (bounded) for free memory (``--min-free-gib``) and, before the
first phase, for the load average to fall below ``--max-load``; the loads are in the JSON.
The proxies' CPU time (utime + stime of each proxy process and its workers, from ``/proc``) is
read before and after each of their sets (in phase e, around each request alone, the /metrics
reads left out: ``e_<kind>``): ``proxy_cpu_ms_per_request``. The last line of stdout
is one JSON object: ``*_ms`` milliseconds, ``*_vs_plain`` / ``*_vs_direct`` / ``*_vs_one_backend``
ratios (proxy path over the anchor), ``targets`` whether each target was met. Usage:
``python bench/front.py [--requests 12] [--concurrency 4] [--text-requests 160] [--phases a,b,c,d,e,v]
[--profile-proxy PATH]``; about 8 minutes on an idle 2-core box, checkpoints written included, and
about 4 more for phase v (each of its sets starts a ``vllm bench serve`` process).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.front_load import (  # noqa: E402
    MODEL,
    SET_REQUESTS_PER_SLOT,
    Side,
    compare,
    cpu_ms,
    measure_set,
    ratio,
    summary,
)
from bench.front_stack import METRICS_POLL_S, METRICS_WAIT_S, Stack, metric_totals, start_stack, wait_for_quiet  # noqa: E402
from bench.front_vllm_bench import phase_vllm_bench  # noqa: E402
from epd_harness.media import image_url  # noqa: E402
from prefill_client.consumer.client import EncoderCacheClient  # noqa: E402
from prefill_client.consumer.connection import MediaSpec  # noqa: E402

FILLER = "Tell me a short story about a quiet harbour town at dawn, with boats and gulls. "
IMAGE_TEXT = "describe the picture"
IMAGE_TEXT_AGAIN = "explain the picture."  # phase e: the repeat of an image, other text of as many tokens
QUESTIONS = ("what colours dominate?", "is there any text in it?", "describe the top left corner.",
             "what would you title it?", "anything unusual?", "thanks, one last detail?")
# Each later turn adds about this many tokens (the question padded, byte-level tokenizer): more than one
# of the CPU build's 128-token KV blocks, so the hit rate is not decided by where a prompt ends in a block.
QUESTION_CHARS = 200
PROFILE_STOP_S = 60.0
WARM_UP_SLOTS = 2  # phase a's unmeasured set through each side before the measured ones, requests per slot
TARGETS = {  # name: (figure, bound, at most?)
    "text_c1_added_ttft_p50_ms": ("text_c1_added_ttft_p50_ms", 2.0, True),
    "text_c16_added_ttft_p50_ms": ("text_c16_added_ttft_p50_ms", 10.0, True),
    "text_c1_throughput_vs_direct": ("text_c1_throughput_vs_direct", 0.97, False),
    "text_c16_throughput_vs_direct": ("text_c16_throughput_vs_direct", 0.97, False),
    "cached_throughput_vs_plain": ("cached_throughput_vs_plain", 3.0, False),
    "new_throughput_vs_plain": ("new_throughput_vs_plain", 0.95, False),
    "new_ttft_p50_vs_plain": ("new_ttft_p50_vs_plain", 1.0, True),
    "cached_image_added_ttft_p50_ms": ("cached_image_added_ttft_p50_ms", 10.0, True),
    "vllm_bench_text_throughput_vs_direct": ("vllm_bench_text_proxy_throughput_vs_direct", 0.97, False),
    "vllm_bench_completions_throughput_vs_direct": ("vllm_bench_completions_proxy_throughput_vs_direct", 0.97, False),
    "vllm_bench_new_images_throughput_vs_plain": ("vllm_bench_new_images_throughput_vs_plain", 0.95, False),
    "vllm_bench_new_images_ttft_p50_vs_plain": ("vllm_bench_new_images_ttft_p50_vs_plain", 1.0, True),
}


def image_message(url: str, text: str = IMAGE_TEXT) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


def text_message(tag: str, chars: int | None = None) -> list[dict[str, Any]]:
    """A prompt no other request shares (its tag first), ``chars`` characters long if given."""
    text = f"{tag} " + FILLER * 4
    if chars is not None:
        text = (f"{tag} " + FILLER * (chars // len(FILLER) + 2))[:chars]
    return [{"role": "user", "content": text}]


# An Encode of four images through the 2B-wide tower on the encoder's one core: past the client's
# default deadline (10 s) on a 2-core AVX2 host, where the phase failed on it twice.
PLACE_TIMEOUT_S = 300.0


def place(stack: Stack, urls: list[str]) -> None:
    """Put the images on the encoder (encoded there, nothing pulled), leases given back."""
    with EncoderCacheClient(stack.encoder.target, MODEL, encode_timeout_s=PLACE_TIMEOUT_S) as client:
        for start in range(0, len(urls), 4):
            specs = [MediaSpec.image(base64.b64decode(u.split(",", 1)[1])) for u in urls[start:start + 4]]
            client.release_placed(client.place(specs))


async def phase_text(stack: Stack, args: argparse.Namespace, out: dict[str, Any]) -> None:
    sides = [stack.side("proxy"), stack.side("relay"), stack.side("direct")]
    for conc in args.text_concurrency:
        name = f"text_c{conc}"

        def requests(side: str, rnd: int, n: int, name: str = name) -> list[Any]:
            return [text_message(f"{name}-{side}-{rnd}-{i}") for i in range(n)]

        # One at a time, the sides alternate request by request (a round each), at once as whole sets
        # of at least SET_REQUESTS_PER_SLOT requests per slot: a set's ramp-up and drain (its slowest
        # requests finishing alone) are then a small part of its wall time.
        if conc == 1:
            rounds = count = args.text_requests
        else:
            rounds = args.rounds
            count = max(args.text_requests, SET_REQUESTS_PER_SLOT * conc * rounds)
        # Not measured: a set at this concurrency through each side first. The first set at a new
        # concurrency pays one-off costs (the fronts' pools open a connection a slot to vLLM, vLLM
        # its first batches of that size): the side that came first, always the proxy, took them.
        for side in sides:
            await measure_set(side, requests(side.name, -1, WARM_UP_SLOTS * conc), conc, args.text_max_tokens)
        got = await compare(sides, requests, count, rounds, conc, args.text_max_tokens)
        out[name] = got
        # The proxy against no front (the targets), the bare relay against no front, the proxy against the relay.
        for prefix, side, anchor in ((name, "proxy", "direct"), (f"{name}_relay", "relay", "direct"),
                                     (f"{name}_proxy", "proxy", "relay")):
            out[f"{prefix}_added_ttft_p50_ms" + ("" if anchor == "direct" else f"_over_{anchor}")] = round(
                got[side]["ttft_p50_ms"] - got[anchor]["ttft_p50_ms"], 2)
            out[f"{prefix}_throughput_vs_{anchor}"] = ratio(got[side]["requests_per_s"], got[anchor]["requests_per_s"])
        out["proxy_cpu_ms_per_request"][name] = got["proxy"]["proxy_cpu_ms_per_request"]
        out["proxy_cpu_ms_per_request"][f"{name}_relay"] = got["relay"]["proxy_cpu_ms_per_request"]


async def phase_images(stack: Stack, args: argparse.Namespace, out: dict[str, Any], kind: str, seed: int) -> None:
    """``cached`` (b) or ``new`` (c): the proxy's side and plain vLLM's get the same images."""
    per_round = -(-args.requests // args.rounds)
    urls = [image_url(seed + i, args.side, args.side) for i in range(per_round * args.rounds)]
    if kind == "cached":
        started = time.perf_counter()
        place(stack, urls)
        print(f"placed {len(urls)} images on the encoder in {time.perf_counter() - started:.1f} s", file=sys.stderr)

    def requests(side: str, rnd: int, n: int) -> list[Any]:
        return [image_message(u) for u in urls[rnd * per_round:rnd * per_round + n]]

    got = await compare([stack.side("proxy"), stack.side("plain")], requests, args.requests, args.rounds,
                        args.concurrency, args.max_tokens)
    name = f"{kind}_images"
    out[name] = got
    out[f"{kind}_throughput_vs_plain"] = ratio(got["proxy"]["requests_per_s"], got["plain"]["requests_per_s"])
    out[f"{kind}_ttft_p50_vs_plain"] = ratio(got["proxy"]["ttft_p50_ms"], got["plain"]["ttft_p50_ms"])
    out["proxy_cpu_ms_per_request"][name] = got["proxy"]["proxy_cpu_ms_per_request"]


async def phase_multiturn(stack: Stack, args: argparse.Namespace, out: dict[str, Any]) -> None:
    async def conversation(side: Side, seed: int) -> None:
        """One chat about one image, opened by a text of its own; every turn sends the whole history
        again, as chat clients do (the image included: the proxy places it again, a hit)."""
        messages = image_message(image_url(seed, args.side, args.side))
        messages[0]["content"][1]["text"] = text_message(f"chat {seed}: {IMAGE_TEXT}.", QUESTION_CHARS)[0]["content"]
        for turn in range(args.turns):
            got = await measure_set(side, [messages], 1, args.chat_max_tokens)
            answer = got.samples[0].text if got.samples else ""
            question = text_message(QUESTIONS[turn % len(QUESTIONS)], QUESTION_CHARS)[0]["content"]
            messages = [*messages, {"role": "assistant", "content": answer or "?"},
                        {"role": "user", "content": question}]

    result: dict[str, Any] = {}
    for k, routing in enumerate(("one_backend", "affinity", "round_robin")):
        side = stack.side(routing)
        before = stack.prefix_cache()
        ticks = side.proxy_ticks()
        started = time.perf_counter()
        await asyncio.gather(*(conversation(side, 60_000 + 1000 * k + c) for c in range(args.conversations)))
        wall = time.perf_counter() - started
        cpu = cpu_ms(side.proxy_ticks() - ticks)
        requests = args.conversations * args.turns
        after = stack.prefix_cache(settled_requests=sum(before["requests"]) + requests)
        hits = sum(after["hits"]) - sum(before["hits"])
        queries = sum(after["queries"]) - sum(before["queries"])
        result[routing] = {
            "prefix_cache_hit_rate": round(hits / queries, 4) if queries else None,
            "prefix_cache_hit_tokens": hits, "prefix_cache_query_tokens": queries,
            "requests_per_backend": [a - b for a, b in zip(after["requests"], before["requests"], strict=True)],
            "requests": requests, "wall_s": round(wall, 2), "proxy_cpu_ms_per_request": round(cpu / requests, 2)}
        out["proxy_cpu_ms_per_request"][f"multiturn_{routing}"] = result[routing]["proxy_cpu_ms_per_request"]
        print(f"multiturn {routing}: {json.dumps(result[routing])}", file=sys.stderr)
    out["multiturn"] = result
    one = result["one_backend"]["prefix_cache_hit_rate"] or 0.0
    for routing in ("affinity", "round_robin"):
        out[f"multiturn_{routing}_hit_rate_vs_one_backend"] = ratio(result[routing]["prefix_cache_hit_rate"] or 0.0,
                                                                    one)


class Breakdown:
    """Where a request's time to first token goes, from the stack's own /metrics read before and after
    each request (one in flight; each read waits until vLLM has counted the request), over one HTTP
    client kept open, Python's garbage collected before each request is sent: the proxy's
    encode phase and its wait for the backend's first byte, vLLM's queue and prefill time and its own
    TTFT (from the moment its API server starts rendering the chat), the connector's pulls, the
    items its orders found prefetched, the proxy's CPU time, and the client's TTFT. Means per kind of request, in
    milliseconds (``prefetched``: items)."""

    FIGURES = {  # figure: (whose /metrics, the metric whose sum it is)
        "proxy_encode": ("proxy", "epd_proxy_encode_latency_seconds_sum"),
        "proxy_backend_first_byte": ("proxy", "epd_proxy_backend_time_to_first_byte_seconds_sum"),
        "vllm_ttft": ("vllm", "vllm:time_to_first_token_seconds_sum"),
        "vllm_queue": ("vllm", "vllm:request_queue_time_seconds_sum"),
        "vllm_prefill": ("vllm", "vllm:request_prefill_time_seconds_sum"),
        "pull": ("connector", "epd_pull_latency_seconds_sum"),
        "prefetched": ("connector", "epd_pulls_prefetched_total"),  # items a request's order found prefetched
    }
    COUNTS = {"prefetched"}  # figures that are counts, not seconds: their means are per request
    COUNTED = "vllm:time_to_first_token_seconds_count"  # vLLM has counted a request's first token

    def __init__(self, stack: Stack) -> None:
        self.urls = {"vllm": stack.consumers[0].url, "connector": stack.connector_metrics[0]}
        self.proxies = {name: server.url for name, server in stack.proxies.items()}
        self._stack = stack
        self.sums: dict[str, dict[str, float]] = {}
        self.counts: dict[str, int] = {}
        self.http = httpx.Client(trust_env=False)

    def close(self) -> None:
        self.http.close()

    def _scrape(self, server: str, *extra: str, url: str | None = None) -> dict[str, float]:
        names = [metric for whose, metric in self.FIGURES.values() if whose == server] + list(extra)
        return dict(zip(names, metric_totals(url or self.urls[server], *names, http=self.http), strict=True))

    def read(self, proxy: str, counted: float = 0.0) -> tuple[float, dict[str, float]]:
        """vLLM's count of first tokens and every figure's metric (the proxy's: of ``proxy``), once vLLM
        counts ``counted`` (bounded)."""
        deadline = time.monotonic() + METRICS_WAIT_S
        while True:
            vllm = self._scrape("vllm", self.COUNTED)
            if vllm[self.COUNTED] >= counted or time.monotonic() > deadline:
                break
            time.sleep(METRICS_POLL_S)
        values = {**vllm, **self._scrape("proxy", url=self.proxies[proxy]), **self._scrape("connector")}
        return values[self.COUNTED], {figure: values[metric] for figure, (_, metric) in self.FIGURES.items()}

    async def measure(self, kind: str, run: Any, proxy: str = "proxy") -> Any:
        """``run`` (one request through ``proxy``), its figures added to ``kind``'s. ``proxy_cpu``: the
        proxy's CPU time while the request ran, the /metrics reads around it left out."""
        side = self._stack.side(proxy)
        counted, before = await asyncio.to_thread(self.read, proxy)
        gc.collect()  # the client's own garbage (the reads', the last request's), not in the request's time
        cpu_ns = side.proxy_cpu_ns()
        got = await run
        cpu_ns = side.proxy_cpu_ns() - cpu_ns
        if got.samples:
            _, after = await asyncio.to_thread(self.read, proxy, counted + 1)
            sums = self.sums.setdefault(kind, dict.fromkeys([*self.FIGURES, "proxy_cpu", "client_ttft"], 0.0))
            for figure in self.FIGURES:
                sums[figure] += after[figure] - before[figure]
            sums["proxy_cpu"] += cpu_ns / 1e9
            sums["client_ttft"] += got.samples[0].ttft_ms / 1e3
            self.counts[kind] = self.counts.get(kind, 0) + 1
        return got

    def means(self) -> dict[str, dict[str, float]]:
        return {kind: {figure: round(total * (1 if figure in self.COUNTS else 1e3) / self.counts[kind], 2)
                       for figure, total in sums.items()}
                for kind, sums in self.sums.items()}


async def phase_cached_vs_text(stack: Stack, args: argparse.Namespace, out: dict[str, Any]) -> None:
    side, unhinted = stack.side("proxy"), stack.side("unhinted")
    urls = [image_url(80_000 + i, args.side, args.side) for i in range(args.requests)]
    # As many other held images for the proxy that sends no prefetch hints (each new to vLLM).
    urls_unhinted = [image_url(85_000 + i, args.side, args.side) for i in range(args.requests)]
    place(stack, urls + urls_unhinted)
    # The template's tokens around a text prompt, to pad the text to the image request's length.
    probe = text_message("probe-e", 200)
    calibration = await measure_set(side, [probe], 1, 1)
    if not calibration.samples:
        raise SystemExit("phase e: the calibration request failed")
    overhead = calibration.samples[0].prompt_tokens - 200
    images: list[Any] = []
    texts: list[Any] = []
    repeats: list[Any] = []
    images_unhinted: list[Any] = []
    mismatches = 0  # text or repeat requests whose prompt is not as long as the image request's
    parts = Breakdown(stack)
    try:
        for i, url in enumerate(urls):  # one at a time, alternating, so both see the same moments of the box
            image = await parts.measure("image_cached", measure_set(
                side, [image_message(url)], 1, args.max_tokens))
            if not image.samples:
                continue
            tokens = image.samples[0].prompt_tokens
            text = await parts.measure("text_same_length", measure_set(
                side, [text_message(f"e-{i}", tokens - overhead)], 1, args.max_tokens))
            # The same image again: vLLM asks for its rows, but the worker's client holds them: no transfer.
            again = await parts.measure("image_in_vllm", measure_set(
                side, [image_message(url, IMAGE_TEXT_AGAIN)], 1, args.max_tokens))
            # Another held image through the proxy that sends no prefetch hint: its pull starts when
            # vLLM's scheduler orders it.
            plain_pull = await parts.measure("image_cached_unhinted", measure_set(
                unhinted, [image_message(urls_unhinted[i])], 1, args.max_tokens), "unhinted")
            if not text.samples or not again.samples or not plain_pull.samples:
                continue
            mismatches += sum(got.samples[0].prompt_tokens != tokens for got in (text, again, plain_pull))
            images += image.samples
            texts += text.samples
            repeats += again.samples
            images_unhinted += plain_pull.samples
    finally:
        parts.close()
    means = parts.means()
    got = {"image_cached": summary([s.ttft_ms for s in images]),
           "text_same_length": summary([s.ttft_ms for s in texts]),
           "image_in_vllm": summary([s.ttft_ms for s in repeats]),
           "image_cached_unhinted": summary([s.ttft_ms for s in images_unhinted]),
           "prompt_tokens": images[0].prompt_tokens if images else None, "prompt_token_mismatches": mismatches,
           "breakdown_mean_ms": means}
    out["cached_image_vs_text"] = got
    out["cached_image_added_ttft_p50_ms"] = round(got["image_cached"]["p50"] - got["text_same_length"]["p50"], 2)
    # What the image would add if its rows were on vLLM's worker before its scheduler asked (no pull).
    out["image_in_vllm_added_ttft_p50_ms"] = round(got["image_in_vllm"]["p50"] - got["text_same_length"]["p50"], 2)
    # The same as the first figure, through a proxy that sends no prefetch hints (the pull starts later).
    out["cached_image_unhinted_added_ttft_p50_ms"] = round(
        got["image_cached_unhinted"]["p50"] - got["text_same_length"]["p50"], 2)
    # The proxy's CPU per request of each kind, while the request ran (the breakdown's proxy_cpu).
    for kind in ("image_cached", "text_same_length", "image_cached_unhinted"):
        if kind in means:
            out["proxy_cpu_ms_per_request"][f"e_{kind}"] = means[kind]["proxy_cpu"]


def start_profile(stack: Stack, path: str) -> subprocess.Popen[bytes]:
    """``py-spy record`` of the proxy before consumer A (and its workers), native frames included (the
    event loop's C parts), collapsed stacks into ``path``: where its CPU goes. Sampling stops the
    process for each sample and takes CPU of its own: a profiled run's figures are not the bench's."""
    pid = stack.proxies["proxy"].proc.pid
    cmd = [str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(pid), "--format", "raw",
           "--output", path, "--rate", "100", "--subprocesses", "--native"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def stop_profile(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
    try:
        _, err = proc.communicate(timeout=PROFILE_STOP_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate(timeout=PROFILE_STOP_S)
    print(f"py-spy: {err.decode(errors='replace').strip()[-500:]}", file=sys.stderr)


async def run(stack: Stack, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"proxy_cpu_ms_per_request": {}}
    async with stack.clients():
        steps: dict[str, Callable[[], Any]] = {
            "a": lambda: phase_text(stack, args, out),
            "b": lambda: phase_images(stack, args, out, "cached", 20_000),
            "c": lambda: phase_images(stack, args, out, "new", 40_000),
            "d": lambda: phase_multiturn(stack, args, out),
            "e": lambda: phase_cached_vs_text(stack, args, out),
            "v": lambda: asyncio.to_thread(phase_vllm_bench, stack, args, out)}
        profile = start_profile(stack, args.profile_proxy) if args.profile_proxy else None
        try:
            out["load_avg_1m_at_start"] = round(wait_for_quiet(args.max_load, args.load_wait_s), 2)
            out["load_avg_1m_at_phase"] = {}
            for phase in sorted(args.phases, key="abcevd".index):  # d last: it swaps plain vLLM for a second backend
                started = time.perf_counter()
                if phase == "d":
                    await stack.add_second_backend()
                out["load_avg_1m_at_phase"][phase] = round(os.getloadavg()[0], 2)
                stack.check()
                await steps[phase]()
                stack.check()
                print(f"phase {phase}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
        finally:
            if profile is not None:
                stop_profile(profile)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--phases", default="a,b,c,d,e,v", help="comma separated, of a, b, c, d, e, v")
    parser.add_argument("--requests", type=int, default=12, help="image requests per side (b, c; e: pairs; v: per set)")
    parser.add_argument("--concurrency", type=int, default=4, help="image requests in flight (b, c, v)")
    parser.add_argument("--text-requests", type=int, default=160,
                        help="text requests per side and concurrency (a; above 1 in flight at least "
                             f"{SET_REQUESTS_PER_SLOT} per slot and round)")
    parser.add_argument("--text-concurrency", default="1,16", help="comma separated (a; v: the highest)")
    parser.add_argument("--rounds", type=int, default=2, help="sets per side, alternating with the other side's")
    parser.add_argument("--conversations", type=int, default=4, help="chats at once per routing (d)")
    parser.add_argument("--turns", type=int, default=4, help="turns per chat (d)")
    parser.add_argument("--chat-max-tokens", type=int, default=16, help="tokens generated per chat turn (d)")
    parser.add_argument("--side", type=int, default=224, help="image width and height in pixels (224-336)")
    parser.add_argument("--max-tokens", type=int, default=4, help="tokens generated per image request")
    parser.add_argument("--text-max-tokens", type=int, default=8, help="tokens generated per text request")
    parser.add_argument("--proxy-workers", type=int, default=1, help="epd proxy --workers")
    parser.add_argument("--min-free-gib", type=float, default=12.0,
                        help="wait for this much available memory before starting the stack")
    parser.add_argument("--memory-wait-s", type=float, default=600.0, help="at most this long")
    parser.add_argument("--max-load", type=float, default=3.0,
                        help="before the first phase, wait for the 1-minute load average to fall below this")
    parser.add_argument("--load-wait-s", type=float, default=180.0, help="at most this long")
    parser.add_argument("--profile-proxy", metavar="PATH",
                        help="py-spy record the proxy before consumer A over the phases, collapsed stacks into PATH "
                             "(the profiler's own CPU use skews that run's figures)")
    parser.add_argument("--workdir", help="keep the checkpoints (reused when there) and the processes' logs here "
                                          "(default: a temporary folder)")
    args = parser.parse_args()
    args.phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    if set(args.phases) - set("abcdev"):
        raise SystemExit(f"unknown phases {sorted(set(args.phases) - set('abcdev'))}; known: a, b, c, d, e, v")
    args.text_concurrency = [int(c) for c in args.text_concurrency.split(",") if c.strip()]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp_name:
        work = Path(args.workdir) if args.workdir else Path(tmp_name)
        logs = work / "logs" if args.workdir else work
        logs.mkdir(parents=True, exist_ok=True)
        stack = start_stack(work, logs, args)
        try:
            out = asyncio.run(run(stack, args))
        finally:
            stack.stop()
    targets = {name: (out[field] <= bound if at_most else out[field] >= bound)
               for name, (field, bound, at_most) in TARGETS.items() if field in out}
    out.update(targets=targets, wall_s=round(time.perf_counter() - started),
               settings={k: v for k, v in vars(args).items() if k != "workdir"})
    print(json.dumps(out))


if __name__ == "__main__":
    main()

