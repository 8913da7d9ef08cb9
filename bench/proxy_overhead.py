"""What ``epd proxy`` costs per text request beside a bare relay, with no vLLM to blur it (bench process).

Three processes on loopback: a streaming backend (this script run with ``--port``: an aiohttp
server that answers every chat request as vLLM streams one, ``--chunks`` chunks ``--gap-ms``
apart, then ``data: [DONE]``), ``bench/relay.py`` before it, and ``epd proxy`` before it (a
``--model-id``, an encoder address nobody listens on: a text request never reaches an encoder).
A client sends the same streamed text request (``--prompt-chars`` of prompt) through the proxy,
the relay and straight to the backend, the three sides' sets alternating, at each
``--concurrency``, and reads each answer to its end.

Per front and concurrency: the CPU time it spent (utime + stime from ``/proc`` over the set,
every thread) per request, the time to the first chunk (p50) and requests per second; the
backend straight is the anchor of the latencies. The proxy's figures over the relay's are what
its own work (the front door, the JSON parse, the routing, the metrics) costs beyond the hop any
front adds; the relay's over the backend's, the hop. The last line of stdout is one JSON object.
Usage: ``python bench/proxy_overhead.py [--requests 1000] [--concurrency 1,16] [--rounds 2]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.front_load import cpu_ms, tree_ticks  # noqa: E402
from bench.front_stack import start_relay, start_script  # noqa: E402
from bench.relay import CHAT_PATH  # noqa: E402
from epd_harness.ports import free_port  # noqa: E402
from epd_harness.vllm import Server, start_proxy  # noqa: E402

MODEL = "bench-model"
REQUEST_TIMEOUT_S = 30.0
WARM_UP_REQUESTS = 50


def backend_app(chunks: int, gap_s: float) -> web.Application:
    """Answers a chat request as vLLM streams one (OpenAI chunks as server-sent events)."""

    def event(content: str) -> bytes:
        chunk = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
                 "choices": [{"index": 0, "delta": {"content": content}, "logprobs": None, "finish_reason": None}]}
        return b"data: " + json.dumps(chunk).encode() + b"\n\n"

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for i in range(chunks):
            await out.write(event(f"t{i}"))
            await asyncio.sleep(gap_s)
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post(CHAT_PATH, chat)
    app.router.add_get("/health", health)
    return app


async def run_set(session: aiohttp.ClientSession, url: str, body: bytes, count: int,
                  concurrency: int) -> tuple[list[float], float]:
    """``count`` requests, ``concurrency`` in flight; each one's time to its first chunk (ms), and the wall time."""
    firsts: list[float] = []
    left = iter(range(count))

    async def worker() -> None:
        for _ in left:
            started = time.perf_counter()
            first = None
            async with session.post(url + CHAT_PATH, data=body, headers={"Content-Type": "application/json"}) as r:
                if r.status != 200:
                    raise SystemExit(f"{url} answered {r.status}: {(await r.text())[:300]}")
                async for _chunk in r.content.iter_any():
                    if first is None:
                        first = time.perf_counter()
            assert first is not None
            firsts.append((first - started) * 1e3)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return firsts, time.perf_counter() - started


async def measure(sides: dict[str, tuple[str, int]], args: argparse.Namespace) -> dict[str, Any]:
    prompt = ("A quiet harbour at dawn. " * (args.prompt_chars // 25 + 1))[:args.prompt_chars]
    body = json.dumps({"model": MODEL, "stream": True, "max_tokens": args.chunks,
                       "stream_options": {"include_usage": True},
                       "messages": [{"role": "user", "content": prompt}]}).encode()
    out: dict[str, Any] = {}
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        for conc in args.concurrency:
            for url, _pid in sides.values():  # connections for every slot, first requests' one-off costs
                await run_set(session, url, body, max(WARM_UP_REQUESTS, 2 * conc), conc)
            got: dict[str, dict[str, list[float]]] = {name: {"ttft": [], "wall": [], "ticks": []} for name in sides}
            per_set = args.requests // args.rounds
            for rnd in range(args.rounds):
                order = list(sides) if rnd % 2 == 0 else list(reversed(sides))
                for name in order:
                    url, pid = sides[name]
                    ticks = tree_ticks(pid)
                    firsts, wall = await run_set(session, url, body, per_set, conc)
                    got[name]["ticks"].append(tree_ticks(pid) - ticks)
                    got[name]["ttft"] += firsts
                    got[name]["wall"].append(wall)
            row: dict[str, Any] = {}
            for name, g in got.items():
                done = per_set * args.rounds
                row[name] = {"ttft_p50_ms": round(statistics.median(g["ttft"]), 3),
                             "requests_per_s": round(done / sum(g["wall"]), 1),
                             "cpu_ms_per_request": round(cpu_ms(sum(g["ticks"])) / done, 3)}
            proxy, relay, backend = row["proxy"], row["relay"], row["backend"]
            row["proxy_cpu_vs_relay"] = round(proxy["cpu_ms_per_request"] / relay["cpu_ms_per_request"], 3)
            row["proxy_added_ttft_p50_ms_over_relay"] = round(proxy["ttft_p50_ms"] - relay["ttft_p50_ms"], 3)
            row["relay_added_ttft_p50_ms"] = round(relay["ttft_p50_ms"] - backend["ttft_p50_ms"], 3)
            row["proxy_added_ttft_p50_ms"] = round(proxy["ttft_p50_ms"] - backend["ttft_p50_ms"], 3)
            out[f"c{conc}"] = row
            print(f"c={conc}: {json.dumps(row)}", file=sys.stderr)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000, help="requests per side and concurrency")
    parser.add_argument("--concurrency", default="1,16", help="comma separated")
    parser.add_argument("--rounds", type=int, default=2, help="sets per side, alternating with the other sides'")
    parser.add_argument("--chunks", type=int, default=10, help="chunks of each streamed answer (tokens)")
    parser.add_argument("--gap-ms", type=float, default=2.0, help="between two chunks of an answer")
    parser.add_argument("--prompt-chars", type=int, default=1500)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)  # given: be the streaming backend on it
    args = parser.parse_args()
    if args.port is not None:
        web.run_app(backend_app(args.chunks, args.gap_ms / 1e3), host="127.0.0.1", port=args.port, print=None,
                    access_log=None)
        return
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="epd-proxy-overhead-") as tmp:
        logs = Path(tmp)
        servers: list[Server] = []
        try:
            backend = start_script(logs / "backend.log", "proxy_overhead.py", "--chunks", str(args.chunks),
                                   "--gap-ms", str(args.gap_ms))
            servers.append(backend)
            relay = start_relay(logs / "relay.log", backend.url)
            servers.append(relay)
            proxy = start_proxy(logs / "proxy.log", [f"127.0.0.1:{free_port()}"], [backend.url],
                                "--model-id", MODEL, "--log-level", "WARNING")
            servers.append(proxy)
            sides = {"proxy": (proxy.url, proxy.proc.pid), "relay": (relay.url, relay.proc.pid),
                     "backend": (backend.url, backend.proc.pid)}
            result = asyncio.run(measure(sides, args))
        finally:
            for server in reversed(servers):
                server.stop()
    result["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    result["settings"] = {k: v for k, v in vars(args).items()}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
