"""E + P + D with real processes: ``epd encoder``, a prefill vLLM (EpdCacheConnector + NixlConnector as
KV producer), two decode vLLMs (NixlConnector as KV consumer) behind ``epd proxy --prefill --decode``,
against a plain ``vllm serve`` of the same checkpoint.

Both split vLLMs get a copy of the checkpoint whose vision weights are noise: the answers can equal
the plain vLLM's only if the prefill's image rows came from the encoder and the decode's KV from
the prefill (the decode never sees an image, only its placeholder metadata).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from common.metrics import PROXY_BACKEND_RUNNING
from epd_harness.disagg import launch_decode, launch_prefill, split_args
from epd_harness.families import noise_vision_copy
from epd_harness.media import image_url
from epd_harness.procs import EncoderProcess, launch_encoder
from epd_harness.qwen3vl import write_qwen3vl_checkpoint
from epd_harness.vllm import (
    PIL_IMAGE_PROCESSOR,
    Server,
    chat_body,
    launch_vllm,
    start_proxy,
    stop_vllm,
    vllm_missing,
    wait_vllm,
)
from tests.support.scrape import scrape

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = "tiny-qwen3-vl"
LOGPROB_ATOL = 1e-3
# vLLM compiles its logprob gather with inductor on the first request that asks for logprobs: minutes
# per engine on a busy 2-core box, four engines here. Every engine runs it eagerly instead (an
# integer count: the same answers, the baseline's included).
NO_COMPILE = {"TORCH_COMPILE_DISABLE": "1"}
REQUEST_TIMEOUT_S = 300.0  # a first request on a busy box
READY_WAIT_S = 30.0
KNOWN_IMAGE = image_url(1, 96, 128)  # sent by two tests: the second finds it in the encoder's cache


@dataclass
class Split:
    tmp: Path
    encoder: EncoderProcess
    baseline: Server
    prefill: Server
    decode: list[Server]
    proxy: Server


HANDSHAKE_TRIES = 5


def _first_handshake(prefill: Server, decode: Server) -> None:
    """One text request prefilled on ``prefill`` and decoded on ``decode``, before any test: the
    decode's first request from a prefill engine makes NIXL's handshake with it, whose reply vLLM
    waits for 5 s at most (a fixed deadline in its NixlConnector). With four engines on two cores
    that can run out, and the request then fails (a 500); the next one makes the handshake again.
    The tests' requests then find it made."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
    failures: list[str] = []
    for _ in range(HANDSHAKE_TRIES):
        first = httpx.post(prefill.url + "/v1/chat/completions", timeout=REQUEST_TIMEOUT_S, json={
            **body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
        assert first.status_code == 200, first.text
        resp = httpx.post(decode.url + "/v1/chat/completions", timeout=REQUEST_TIMEOUT_S,
                          json={**body, "kv_transfer_params": first.json()["kv_transfer_params"]})
        if resp.status_code == 200:
            return
        failures.append(f"{resp.status_code}: {resp.text[:200]}")
    raise AssertionError(f"decode {decode.url} never took the prefill's KV: {failures}")


@pytest.fixture(scope="module")
def split(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Split]:
    reason = vllm_missing()
    if reason:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("disagg")
    checkpoint = write_qwen3vl_checkpoint(tmp / "checkpoint", seed=7)
    noise = noise_vision_copy(checkpoint, tmp / "noise-vision")
    # Everything starts at once (most of each start-up is imports and process spawns); the
    # prefill needs the encoder's address, so it starts once the encoder is up. The decodes share
    # core 0, the prefill and the baseline core 1. A decode never shares a core with the prefill
    # it waits on: a vLLM worker spins on its core for a second after each message, and this
    # box's scheduler then starved the other engine bound there for minutes (seen: a prefill
    # frozen while its decode spun on its core, waiting for that prefill's KV). Nor do both
    # decodes' NIXL progress threads, which spin for good, share the baseline's core.
    started = [launch_vllm(checkpoint, tmp / "vllm-baseline.log", "--served-model-name", MODEL, *PIL_IMAGE_PROCESSOR,
                           cpu_core=1, extra_env=NO_COMPILE)]
    encoder: EncoderProcess | None = None
    proxy: Server | None = None
    try:
        launch = launch_encoder(tmp, "--weights", str(checkpoint), "--cache-dtype", "float32", "--model-id", MODEL)
        started += [launch_decode(noise, tmp / f"vllm-decode-{i}.log", MODEL, cpu_core=0, extra_env=NO_COMPILE)
                    for i in range(2)]
        encoder = launch.wait()
        started.append(launch_prefill(noise, tmp / "vllm-prefill.log", MODEL, [encoder.target], cpu_core=1,
                                      extra_env=NO_COMPILE))
        for server in started:
            wait_vllm(server)
        baseline, decode, prefill = started[0], started[1:3], started[3]
        for server in decode:  # one at a time: the two share core 0
            _first_handshake(prefill, server)
        proxy = start_proxy(tmp / "proxy.log", [encoder.target], [], "--model-id", MODEL,
                            *split_args([prefill], decode))
        yield Split(tmp, encoder, baseline, prefill, decode, proxy)
    finally:
        if proxy is not None:
            proxy.stop()
        for server in started:
            stop_vllm(server)
        if encoder is not None:
            encoder.terminate()


def _post(url: str, body: dict[str, Any], timeout: float = REQUEST_TIMEOUT_S) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=timeout)


def _notable(server: Server, lines: int = 30) -> str:
    """The last warnings and errors in ``server``'s log: why a request through it failed."""
    marks = ("WARNING", "ERROR", "Traceback", "Error:")
    found = [line for line in server.log().splitlines() if any(m in line for m in marks)]
    return "\n".join(found[-lines:])


def _outputs(resp: httpx.Response, split: Split | None = None) -> tuple[list[int], list[float]]:
    """Tokens and logprobs of an answer; ``split``: the answer came through it (a failure shows the
    prefill's and the proxy's last warnings)."""
    if resp.status_code != 200:
        logs = f"\nprefill log:\n{_notable(split.prefill)}\nproxy log:\n{_notable(split.proxy)}" if split else ""
        raise AssertionError(f"{resp.status_code}: {resp.text}{logs}")
    choice = resp.json()["choices"][0]
    return choice["token_ids"], [t["logprob"] for t in choice["logprobs"]["content"]]


def _has_token(event: dict[str, Any]) -> bool:
    """Whether a stream event carries a token (the role chunk before the first one carries none)."""
    choices = event.get("choices") or [{}]
    return bool(choices[0].get("logprobs"))


def _streamed(url: str, body: dict[str, Any]) -> tuple[list[str], list[float]]:
    tokens: list[str] = []
    logprobs: list[float] = []
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=REQUEST_TIMEOUT_S) as resp:
        assert resp.status_code == 200, resp.read()
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            if _has_token(event):
                content = event["choices"][0]["logprobs"]["content"]
                tokens += [t["token"] for t in content]
                logprobs += [t["logprob"] for t in content]
    return tokens, logprobs


def _close(got: list[float], want: list[float], what: str) -> float:
    worst = max(abs(a - b) for a, b in zip(got, want))
    assert worst <= LOGPROB_ATOL, f"{what}: logprobs differ by {worst}"
    return worst


def _body(urls: list[str], text: str, max_tokens: int = 10) -> dict[str, Any]:
    body = chat_body(MODEL, urls, text, max_tokens=max_tokens)
    del body["prompt_logprobs"]  # the decode computes no prompt: its KV came from the prefill
    return body


def test_answers_equal_plain_vllm(split: Split) -> None:
    """Each request here is a prefill, a KV transfer and a decode (seconds on this box), so each
    case covers several things: two images and one named twice; a known image (the streaming
    test's first image is this test's)."""
    a, b, c = KNOWN_IMAGE, image_url(2, 300, 200), image_url(3, 224, 224)
    cases = [
        ("one image", [a], "what is this?"),
        ("two images, the first named twice", [b, c, b], "compare them"),
        ("no image", [], "hello there"),
    ]
    worst = 0.0
    for what, urls, text in cases:
        body = _body(urls, text)
        got, want = _outputs(_post(split.proxy.url, body), split), _outputs(_post(split.baseline.url, body))
        assert len(want[0]) >= 8, what
        assert got[0] == want[0], f"{what}: greedy tokens differ"
        worst = max(worst, _close(got[1], want[1], what))
    print(f"largest logprob difference: {worst:.2e}")


def test_streaming_equals_plain_vllm(split: Split) -> None:
    body = _body([KNOWN_IMAGE, image_url(4, 256, 320)], "stream it")
    tokens, logprobs = _streamed(split.proxy.url, body)
    want = _post(split.baseline.url, body).json()["choices"][0]["logprobs"]["content"]
    assert tokens == [t["token"] for t in want]
    _close(logprobs, [t["logprob"] for t in want], "streamed")


def test_bad_image_is_400(split: Split) -> None:
    resp = _post(split.proxy.url, _body([image_url(6, 64, 64), "data:image/png;base64,bm90IGFuIGltYWdl"], "x"))
    assert resp.status_code == 400, resp.text
    assert "messages[0].content[1]" in resp.json()["error"]["message"]


def _ready_when(split: Split, check: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """The proxy's /ready answer once ``check`` holds of it, else the last one. A probe the proxy
    makes can miss its deadline on this busy box (four engines on two cores), so the state is
    awaited, not read once (each answer is kept 1 s)."""
    ready: dict[str, Any] = {}
    deadline = time.monotonic() + READY_WAIT_S
    while time.monotonic() < deadline:
        ready = httpx.get(split.proxy.url + "/ready", timeout=10).json()
        if check(ready):
            break
        time.sleep(0.5)
    return ready


def test_ready_names_both_pools(split: Split) -> None:
    body = _ready_when(split, lambda r: bool(r["ready"]))
    assert body["ready"], body
    assert body["prefill"]["ready"] == [split.prefill.url]
    assert sorted(body["decode"]["ready"]) == sorted(s.url for s in split.decode)


def test_killed_decode_fails_its_request_alone(split: Split) -> None:
    """A decode killed while it streams an answer ends that stream with one error event naming it;
    the request after it goes to the other decode. Runs last: it leaves one decode.

    The victim is the decode the proxy relays from once the first token is through (its in-flight
    gauge): the request has thousands of tokens to go then, so the kill lands mid-answer."""
    long = {**_body([image_url(7, 128, 128)], "go on", max_tokens=3000), "ignore_eos": True, "stream": True}
    with httpx.stream("POST", split.proxy.url + "/v1/chat/completions", json=long,
                      timeout=REQUEST_TIMEOUT_S) as resp:
        assert resp.status_code == 200, resp.read()
        lines = resp.iter_lines()
        for line in lines:
            if line.startswith("data: {") and _has_token(json.loads(line[6:])):
                break
        running = scrape(split.proxy.port)
        victims = [s for s in split.decode if running.get(PROXY_BACKEND_RUNNING, backend=s.url) > 0]
        assert len(victims) == 1, running.text
        victim = victims[0]
        os.killpg(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait(30)
        errors = [json.loads(line[6:])["error"] for line in lines if line.startswith('data: {"error"')]
    assert len(errors) == 1, errors
    assert f"decode {victim.url} failed the request" in errors[0]["message"], errors
    assert errors[0]["code"] == 502, errors
    body = _body([image_url(8, 128, 128)], "after the kill")  # one request: each is seconds here
    got, want = _outputs(_post(split.proxy.url, body), split), _outputs(_post(split.baseline.url, body))
    assert got[0] == want[0], "greedy tokens differ after the kill"
    _close(got[1], want[1], "after the kill")
    ready = _ready_when(split, lambda r: bool(r["ready"]) and r["decode"]["not_ready"] == [victim.url])
    assert ready["ready"] and ready["decode"]["not_ready"] == [victim.url], ready
