"""``epd proxy`` before two real vLLM backends (each with the connector, one encoder): a multi-turn image
chat keeps its backend and that backend's prefix cache hits grow; with two of its requests in flight
on that backend, stalled (frozen), its next turn and a new conversation go to the other; once it is
killed, the requests it held and every later one are answered by the one left."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from common.metrics import EPD_LEASES_ACTIVE, PROXY_BACKEND_RUNNING
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
    stop_vllm,
    vllm_missing,
    wait_vllm,
)
from tests.support.scrape import scrape

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = "tiny-qwen3-vl"
# A byte-level tokenizer: this is about 400 tokens of shared prefix, several of vLLM's KV blocks.
SYSTEM = "You answer questions about images. " * 12
WAIT_S = 60.0  # deadline of waiting for a server's metrics to show a state
LEASES_BACK_S = 10.0  # a third of the encoder's lease ttl (30 s): given back, not expired
TURN_BUSY_S = 180.0  # a turn while one backend is frozen: sent there by mistake, it would hang


@dataclass
class Stack:
    encoder: EncoderProcess
    backends: list[Server]
    proxy: Server


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    reason = vllm_missing()
    if reason:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("proxy-routing")
    checkpoint = write_qwen3vl_checkpoint(tmp / "checkpoint", seed=7)
    # The encoder and both engines start at once (the encoder on a port chosen here, which the engines'
    # connectors are given), each engine on its own core; their statistics feed /metrics (prefix cache hits).
    launch = launch_encoder(tmp, "--weights", str(checkpoint), "--cache-dtype", "float32", "--model-id", MODEL,
                            "--port", str(free_port()))
    config = connector_config([launch.target], MODEL, metrics_port=-1)
    backends = [launch_vllm(checkpoint, tmp / f"vllm-{i}.log", "--served-model-name", MODEL,
                            *consumer_args(config), cpu_core=i, log_stats=True) for i in range(2)]
    proxy: Server | None = None
    try:
        encoder = launch.wait()
        for backend in backends:
            wait_vllm(backend)
            # Each engine's first request pays its one-time set-up; not inside a timed turn.
            httpx.post(backend.url + "/v1/chat/completions", timeout=300.0, json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).raise_for_status()
        proxy = start_proxy(tmp / "proxy.log", [encoder.target], [b.url for b in backends], "--model-id", MODEL,
                            "--backend-retry-s", "60", "--log-level", "DEBUG")  # each pick in its log
        yield Stack(encoder, backends, proxy)
    finally:
        if proxy is not None:
            proxy.stop()
        for backend in backends:
            if backend.alive():  # frozen by the test when it failed before killing it
                os.killpg(backend.proc.pid, signal.SIGCONT)
            stop_vllm(backend)
        launch.terminate()


def _total(server: Server, name: str) -> float:
    """A vLLM metric summed over its label sets (engines, finish reasons)."""
    samples = scrape(server.port).samples
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


def _served(stack: Stack, backends: list[Server] | None = None) -> list[float]:
    """Requests each backend (default: every one) finished."""
    return [_total(b, "vllm:request_success_total") for b in backends or stack.backends]


def _wait_until(what: str, done: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _served_after(stack: Stack, before: list[float], count: int, backends: list[Server] | None = None) -> list[float]:
    """How many requests each backend finished since ``before``, once ``count`` did in all (vLLM counts
    a request in its metrics a moment after answering it)."""
    _wait_until(f"{count} requests in the backends' metrics",
                lambda: sum(_served(stack, backends)) >= sum(before) + count)
    return [now - then for now, then in zip(_served(stack, backends), before, strict=True)]


class Conversation:
    """A chat about one image; every turn sends the whole history again, as chat clients do."""

    def __init__(self, seed: int) -> None:
        first = [{"type": "image_url", "image_url": {"url": image_url(seed, 224, 224)}},
                 {"type": "text", "text": f"what is in picture {seed}?"}]
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                               {"role": "user", "content": first}]

    def body(self, **extra: Any) -> dict[str, Any]:
        return {"model": MODEL, "messages": self.messages, "max_tokens": 6, "temperature": 0, **extra}

    def turn(self, proxy: Server, question: str, timeout: float = 120.0) -> None:
        resp = httpx.post(proxy.url + "/v1/chat/completions", json=self.body(), timeout=timeout)
        assert resp.status_code == 200, resp.text
        answer = resp.json()["choices"][0]["message"]["content"] or "?"
        self.messages = [*self.messages, {"role": "assistant", "content": answer},
                         {"role": "user", "content": question}]


def _post(proxy: Server, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=TURN_BUSY_S)


def test_conversations_keep_their_backend_and_a_busy_or_dead_one_is_avoided(stack: Stack) -> None:
    chat = Conversation(seed=1)
    before = _served(stack)
    chat.turn(stack.proxy, "and the colours?")
    home = _served_after(stack, before, 1).index(1)
    other = 1 - home
    a, b = stack.backends[home], stack.backends[other]

    # Every later turn re-sends the history: the same backend, whose prefix cache holds it.
    for question in ("anything else?", "thanks"):
        hits = _total(a, "vllm:prefix_cache_hits_total")
        before = _served(stack)
        chat.turn(stack.proxy, question)
        assert _served_after(stack, before, 1)[home] == 1
        _wait_until("a prefix cache hit of the turn",
                    lambda hits=hits: _total(a, "vllm:prefix_cache_hits_total") > hits)
    # The later turns' image is in the backend's prefix cache, so nothing pulls it: the lease the
    # proxy took for each turn goes back when the request finishes, not at the encoder's lease ttl.
    _wait_until("every lease of the turns given back", lambda: scrape(
        stack.encoder.metrics_port).samples.get(EPD_LEASES_ACTIVE) == 0, timeout_s=LEASES_BACK_S)

    # The conversation's backend stalls (frozen) with two of its requests in flight: within the
    # load bound both go there, and neither is answered. (Frozen first and then sent, so that
    # they are in flight for sure: requests sent first and the backend frozen once they ran could
    # finish in between, a tiny model answers thousands of tokens in seconds, and the backend was
    # then once frozen idle and got the next turn.)
    os.killpg(a.proc.pid, signal.SIGSTOP)
    outcomes: list[int] = []
    held = [threading.Thread(target=lambda: outcomes.append(_post(stack.proxy, chat.body()).status_code),
                             daemon=True) for _ in range(2)]
    for thread in held:
        thread.start()
    _wait_until("the proxy to count two requests in flight on the stalled backend",
                lambda: scrape(stack.proxy.port).get(PROXY_BACKEND_RUNNING, backend=a.url) == 2)
    # Over the bound now (ceil(1.25 x 3 / 2) = 2): the next turn and a new conversation go to the other.
    before = _served(stack, [b])
    chat.turn(stack.proxy, "still there?", timeout=TURN_BUSY_S)
    Conversation(seed=2).turn(stack.proxy, "-", timeout=TURN_BUSY_S)
    assert _served_after(stack, before, 2, [b]) == [2]

    # The conversation's backend dies. The two it held never got an answer started: the other
    # backend answers them. Its next turn, and new conversations, go to the one left.
    os.killpg(a.proc.pid, signal.SIGKILL)
    a.proc.wait(30)
    for thread in held:
        thread.join(TURN_BUSY_S)
    assert outcomes == [200, 200], outcomes
    before = _served(stack, [b])
    chat.turn(stack.proxy, "hello?")
    for seed in (3, 4):
        Conversation(seed).turn(stack.proxy, "-")
    assert _served_after(stack, before, 3, [b]) == [3]
