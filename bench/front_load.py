"""Load for ``bench/front.py``: streamed chat requests through the ``openai`` client, sets of them at a
concurrency, two sides compared in alternating rounds, and a process tree's CPU time (bench process)."""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import openai
from openai import AsyncOpenAI

MODEL = "qwen3-vl-2b-tower"
REQUEST_TIMEOUT_S = 600.0
# Sets with several requests in flight have at least this many requests per slot: with 5 per slot (80 at
# 16) one slow moment of the box moved a set by 15 %, its ramp-up and drain a large part of it.
SET_REQUESTS_PER_SLOT = 10


def ratio(a: float, b: float) -> float:
    """``a`` over its anchor ``b``, rounded (nan without an anchor)."""
    return round(a / b, 3) if b else float("nan")


def cpu_ms(ticks: int) -> float:
    """Milliseconds of CPU time in ``ticks`` clock ticks (``/proc``'s utime and stime)."""
    return ticks * 1e3 / os.sysconf("SC_CLK_TCK")


def tree_ticks(pid: int) -> int:
    """utime + stime (clock ticks) of ``pid`` and every live process under it (``--workers``)."""
    stats = _stats()
    ticks = {process: int(fields[11]) + int(fields[12]) for process, fields in stats}
    return sum(ticks.get(process, 0) for process in _tree(pid, stats))


def tree_cpu_ns(pid: int) -> int:
    """CPU time in nanoseconds of ``pid`` and every live process under it, summed over their live
    threads (``/proc/PID/task/TID/schedstat``): precise enough for one request, where
    :func:`tree_ticks` counts in steps of 10 ms."""
    total = 0
    for process in _tree(pid, _stats()):
        try:
            threads = os.listdir(f"/proc/{process}/task")
        except OSError:
            continue
        for thread in threads:
            try:
                with open(f"/proc/{process}/task/{thread}/schedstat") as f:
                    total += int(f.read().split()[0])
            except (OSError, IndexError, ValueError):
                continue
    return total


def _stats() -> list[tuple[int, list[str]]]:
    """(pid, the fields of ``/proc/PID/stat`` after the command) of every process."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                out.append((int(entry), f.read().rsplit(")", 1)[1].split()))
        except (OSError, IndexError):
            continue
    return out


def _tree(pid: int, stats: list[tuple[int, list[str]]]) -> list[int]:
    """``pid`` and every live process under it, by the parents in ``stats`` (:func:`_stats`)."""
    parents = {process: int(fields[1]) for process, fields in stats}
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo += [child for child, parent in parents.items() if parent == current]
    return found


@dataclass
class Side:
    """Where one kind of request goes: a server's base URL, and the proxy process whose CPU it costs."""

    name: str
    url: str
    proxy_pid: int | None = None
    client: AsyncOpenAI | None = None

    def open(self) -> None:
        self.client = AsyncOpenAI(base_url=self.url + "/v1", api_key="unused", timeout=REQUEST_TIMEOUT_S,
                                  max_retries=0)

    def proxy_ticks(self) -> int:
        return tree_ticks(self.proxy_pid) if self.proxy_pid is not None else 0

    def proxy_cpu_ns(self) -> int:
        return tree_cpu_ns(self.proxy_pid) if self.proxy_pid is not None else 0


@dataclass
class Sample:
    ttft_ms: float
    prompt_tokens: int
    text: str


@dataclass
class SetResult:
    samples: list[Sample] = field(default_factory=list)
    failed: int = 0
    wall_s: float = 0.0
    proxy_ticks: int = 0


async def chat(side: Side, messages: list[dict[str, Any]], max_tokens: int) -> Sample:
    """One streamed chat request; TTFT is the first chunk that carries a token (its logprobs or text)."""
    assert side.client is not None
    started = time.perf_counter()
    stream = await side.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, stream=True, logprobs=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    first: float | None = None
    prompt_tokens = -1
    text: list[str] = []
    async for chunk in stream:  # read to the end: the request completes as in real use
        if chunk.choices:
            choice = chunk.choices[0]
            if first is None and (choice.logprobs is not None or choice.delta.content):
                first = time.perf_counter()
            if choice.delta.content:
                text.append(choice.delta.content)
        if chunk.usage is not None:
            prompt_tokens = chunk.usage.prompt_tokens
    if first is None:
        raise RuntimeError(f"{side.name}: no token streamed")
    return Sample((first - started) * 1e3, prompt_tokens, "".join(text))


async def measure_set(side: Side, requests: Sequence[list[dict[str, Any]]], concurrency: int,
                      max_tokens: int) -> SetResult:
    """``requests`` with at most ``concurrency`` in flight; a failed request is counted and left out."""
    result = SetResult()
    pending = iter(requests)

    async def worker() -> None:
        for messages in pending:  # one iterator shared by the workers: each request is sent once
            try:
                result.samples.append(await chat(side, messages, max_tokens))
            except (openai.APIError, RuntimeError) as exc:
                result.failed += 1
                print(f"{side.name}: request failed: {exc}", file=sys.stderr)

    ticks = side.proxy_ticks()
    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))
    result.wall_s = time.perf_counter() - started
    result.proxy_ticks = side.proxy_ticks() - ticks
    return result


def summary(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p99": float("nan"), "n": 0}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"p50": round(statistics.median(ordered), 2), "p99": round(p99, 2), "n": len(ordered)}


def side_summary(side: Side, sets: Sequence[SetResult]) -> dict[str, Any]:
    ttft = [s.ttft_ms for r in sets for s in r.samples]
    done = len(ttft)
    wall = sum(r.wall_s for r in sets)
    stats = summary(ttft)
    out: dict[str, Any] = {"ttft_p50_ms": stats["p50"], "ttft_p99_ms": stats["p99"],
                           "requests_per_s": round(done / wall, 3) if wall else 0.0, "requests": done,
                           "failed": sum(r.failed for r in sets), "wall_s": round(wall, 2)}
    if side.proxy_pid is not None:
        out["proxy_cpu_ms_per_request"] = round(cpu_ms(sum(r.proxy_ticks for r in sets)) / max(1, done), 2)
    return out


async def compare(sides: Sequence[Side], requests: Callable[[str, int, int], list[Any]], n: int, rounds: int,
                  concurrency: int, max_tokens: int) -> dict[str, dict[str, Any]]:
    """``n`` requests per side in ``rounds`` sets each, the sides' sets alternating (A B, B A, ...);
    ``requests(side, round, count)`` makes a set's requests."""
    sets: dict[str, list[SetResult]] = {side.name: [] for side in sides}
    for rnd in range(rounds):
        count = n // rounds + (1 if rnd < n % rounds else 0)
        for side in (sides if rnd % 2 == 0 else list(reversed(sides))):
            got = await measure_set(side, requests(side.name, rnd, count), concurrency, max_tokens)
            sets[side.name].append(got)
            stats = summary([s.ttft_ms for s in got.samples])
            print(f"  {side.name} round {rnd}: {len(got.samples)} done in {got.wall_s:.2f} s, "
                  f"TTFT p50 {stats['p50']} ms", file=sys.stderr)
    return {side.name: side_summary(side, sets[side.name]) for side in sides}
