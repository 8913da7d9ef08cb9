"""vLLM serves from epd-cache: ``epd encoder`` + ``vllm serve`` with EpdCacheConnector + ``epd proxy``,
against a plain ``vllm serve`` of the same checkpoint, all real processes.

The consumer vLLM is given a copy of the checkpoint whose vision weights are noise: its outputs
can equal the baseline's only if every embedding came from the encoder.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.vllm_soak import run_soak
from common.weights_digest import checkpoint_digest
from epd_harness.families import noise_vision_copy
from epd_harness.media import image_url, video_url
from epd_harness.ports import free_port
from epd_harness.procs import EncoderProcess, SoakEncoder, launch_encoder, start_encoder
from epd_harness.qwen3vl import write_qwen3vl_checkpoint
from epd_harness.vllm import PIL_IMAGE_PROCESSOR, Server, VllmPair, chat_body, start_pair, start_proxy, vllm_missing
from prefill_client.consumer.client import EncoderCacheClient
from prefill_client.consumer.connection import MediaSpec
from tests.support.gate import Gate
from tests.support.scrape import scrape

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = "tiny-qwen3-vl"
LEASE_TTL_MS = 1500
CACHE_BLOCKS = 64
# Two ranks, an engine core, a plain vLLM and the encoders share two cores here: a rank's first
# READ has been seen past 2 s while the engine warms up.
PULL_TIMEOUT_S = 5.0
LOGPROB_ATOL = 1e-5  # float32 noise of two tower implementations (measured: about 1.5e-6)


@dataclass
class Stack:
    tmp: Path
    checkpoint: Path
    encoder: EncoderProcess
    encoder_args: tuple[str, ...]
    baseline: Server
    consumer: Server
    connector_metrics_port: int
    proxy: Server
    gate: Gate
    gated_proxy: Server
    second: SoakEncoder


# Tensor-parallel sizes of the consumer (the connector's worker path runs on every rank). The suite
# runs 1; EPD_TEST_VLLM_TP=1,2 adds 2 ranks, which on a 2-core machine starves the ranks' pull
# threads now and then (BENCHMARKS.md, "vLLM connector: worker-side pulls").
TENSOR_PARALLEL = [int(tp) for tp in os.environ.get("EPD_TEST_VLLM_TP", "1").split(",")]


@pytest.fixture(scope="module", params=TENSOR_PARALLEL, ids=lambda tp: f"tp{tp}")
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    reason = vllm_missing()
    if reason:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("vllm")
    checkpoint = write_qwen3vl_checkpoint(tmp / "checkpoint", seed=7)
    noise = noise_vision_copy(checkpoint, tmp / "noise-vision")
    assert checkpoint_digest(noise) != checkpoint_digest(checkpoint)
    encoder_args = ("--weights", str(checkpoint), "--cache-dtype", "float32", "--model-id", MODEL,
                    "--lease-ttl-ms", str(LEASE_TTL_MS), "--cache-blocks", str(CACHE_BLOCKS))
    # A second encoder the connector knows from the start, for the soak (the other tests use the first);
    # both start at once.
    launches = [launch_encoder(tmp, *encoder_args), launch_encoder(tmp, *encoder_args, name="encoder-b")]
    try:
        encoder = launches[0].wait()
        second = SoakEncoder.launched(tmp, launches[1], *encoder_args)
    except BaseException:
        for launch in launches:
            launch.terminate()
        raise
    metrics_port = free_port()
    pair: VllmPair | None = None
    servers: list[Server] = []
    gate: Gate | None = None
    built: Stack | None = None
    try:
        pair = start_pair(tmp, MODEL, checkpoint, noise, [encoder.target, second.target],
                          baseline_args=PIL_IMAGE_PROCESSOR, tensor_parallel=request.param,
                          metrics_port=metrics_port, pull_timeout_s=PULL_TIMEOUT_S, rpc_timeout_s=3.0)
        baseline, consumer = pair.baseline, pair.consumer
        proxy = start_proxy(tmp / "proxy.log", [encoder.target], [consumer.url], "--model-id", MODEL)
        servers.append(proxy)
        gate = Gate(consumer.url)
        gated = start_proxy(tmp / "proxy-gated.log", [encoder.target], [gate.url], "--model-id", MODEL,
                            "--rpc-timeout-s", "3", "--encode-timeout-s", "3")
        servers.append(gated)
        built = Stack(tmp, checkpoint, encoder, encoder_args, baseline, consumer, metrics_port, proxy, gate, gated,
                      second)
        yield built
    finally:
        if gate is not None:
            gate.close()
        for server in servers:
            server.stop()
        if pair is not None:
            pair.stop()
        encoder.terminate()
        second.terminate()
        if built is not None and built.encoder is not encoder:  # the successor the kill test started
            built.encoder.terminate()


def _post(url: str, body: dict[str, Any], timeout: float = 120.0) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=timeout)


def _outputs(resp: httpx.Response) -> tuple[list[int], list[float], list[float]]:
    assert resp.status_code == 200, resp.text
    data = resp.json()
    choice = data["choices"][0]
    token_ids = choice["token_ids"]
    logprobs = [t["logprob"] for t in choice["logprobs"]["content"]]
    prompt = [next(iter(p.values()))["logprob"] for p in data["prompt_logprobs"] if p]
    return token_ids, logprobs, prompt


def _assert_same(got: httpx.Response, want: httpx.Response, what: str) -> float:
    g_ids, g_lp, g_prompt = _outputs(got)
    w_ids, w_lp, w_prompt = _outputs(want)
    assert len(w_ids) >= 8, what
    assert g_ids == w_ids, f"{what}: greedy tokens differ"
    assert len(g_prompt) == len(w_prompt), f"{what}: prompts differ in length"
    worst = max(abs(a - b) for a, b in zip(g_lp + g_prompt, w_lp + w_prompt))
    assert worst <= LOGPROB_ATOL, f"{what}: logprobs differ by {worst}"
    return worst


def _pulls(stack: Stack) -> float:
    return scrape(stack.connector_metrics_port).get("epd_pulls_total")


def _prefetched(stack: Stack) -> float:
    return scrape(stack.connector_metrics_port).get("epd_pulls_prefetched_total")


def _load_failures(stack: Stack) -> float:
    return sum(v for k, v in scrape(stack.connector_metrics_port).samples.items()
               if k.startswith("epd_ec_load_failures_total"))


def test_outputs_through_proxy_equal_plain_vllm(stack: Stack) -> None:
    a, b, c = image_url(1, 96, 128), image_url(2, 300, 200), image_url(3, 512, 512)
    d, e, f = image_url(4, 224, 224), image_url(5, 160, 400), image_url(6, 480, 640)
    cases = [
        ("small image (upscaled)", [a], "what is this?"),
        ("portrait image", [b], "describe it"),
        ("square image", [c], "and this one?"),
        ("two images in one request", [d, e], "compare them"),
        ("the same image again", [a], "what is this?"),
        ("two known images, new text", [d, e], "which one is brighter?"),
        ("large image (downscaled)", [f], "what do you see"),
        ("the same image twice in one request", [b, b], "are these equal?"),
        # Frames at a size both preprocessors keep (no resize), so the two pipelines see the same pixels.
        ("a video of four frames", [video_url(20, 4, 128, 160)], "what happens?"),
        ("an image and a video of three frames", [d, video_url(21, 3, 128, 160)], "and now?"),
        ("no image", [], "hello there"),
    ]
    pulls_before = _pulls(stack)
    prefetched_before = _prefetched(stack)
    expired_before = scrape(stack.encoder.metrics_port).get("epd_encoder_leases_expired_total")
    worst = 0.0
    for what, urls, text in cases:
        body = chat_body(MODEL, urls, text, max_tokens=10)
        worst = max(worst, _assert_same(_post(stack.proxy.url, body), _post(stack.baseline.url, body), what))
    # Every new image was pulled over NIXL by the connector, verified (the repeats may be vLLM's own cache hits).
    pulled = _pulls(stack) - pulls_before
    assert pulled >= 6
    # The workers started those pulls on the proxy's prefetch hints (vLLM runs the prefetch middleware):
    # the same tokens as plain vLLM either way.
    prefetched = _prefetched(stack) - prefetched_before
    assert 1 <= prefetched <= pulled
    print(f"{prefetched:.0f} of {pulled:.0f} pulls prefetched")
    assert _load_failures(stack) == 0
    # Every lease the proxy took was given back once its rows were in: none runs to its ttl.
    time.sleep(LEASE_TTL_MS / 1000 + 0.5)
    assert scrape(stack.encoder.metrics_port).get("epd_encoder_leases_expired_total") == expired_before
    print(f"largest logprob difference: {worst:.2e}")


def test_streaming_through_proxy(stack: Stack) -> None:
    body = chat_body(MODEL, [image_url(7, 256, 320)], "stream it", max_tokens=8)
    want = _post(stack.baseline.url, body).json()["choices"][0]["logprobs"]["content"]
    tokens: list[str] = []
    with httpx.stream("POST", stack.proxy.url + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=120.0) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"]
            if choice and choice[0].get("logprobs"):
                tokens += [t["token"] for t in choice[0]["logprobs"]["content"]]
    assert tokens == [t["token"] for t in want]


def test_text_completions_through_proxy_equal_plain_vllm(stack: Stack) -> None:
    body = {"model": MODEL, "prompt": "The quick brown fox jumps over", "max_tokens": 8, "ignore_eos": True,
            "temperature": 0, "logprobs": 1, "return_token_ids": True}
    got, want = (httpx.post(url + "/v1/completions", json=body, timeout=120.0)
                 for url in (stack.proxy.url, stack.baseline.url))
    assert got.status_code == 200 and want.status_code == 200, got.text + want.text
    g, w = got.json()["choices"][0], want.json()["choices"][0]
    assert len(w["token_ids"]) == 8 and g["token_ids"] == w["token_ids"] and g["text"] == w["text"]
    worst = max(abs(a - b) for a, b in zip(g["logprobs"]["token_logprobs"], w["logprobs"]["token_logprobs"]))
    assert worst <= LOGPROB_ATOL, f"logprobs differ by {worst}"


def test_models_and_health(stack: Stack) -> None:
    models = httpx.get(stack.proxy.url + "/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert httpx.get(stack.proxy.url + "/health", timeout=10).json()["status"] == "ok"


def test_bad_media_is_400_naming_the_part(stack: Stack) -> None:
    good = image_url(8, 64, 64)
    bad = "data:image/png;base64,bm90IGFuIGltYWdl"  # "not an image"
    resp = _post(stack.proxy.url, chat_body(MODEL, [good, bad], "x"))
    assert resp.status_code == 400, resp.text
    assert "messages[0].content[1]" in resp.json()["error"]["message"]
    for url, words in (("http://198.51.100.1/cat.png", "remote media URLs are refused"),
                       ("file:///etc/passwd", "local files are refused"),
                       ("data:image/png;base64,@@@", "not valid base64")):
        resp = _post(stack.proxy.url, chat_body(MODEL, [url], "x"))
        assert resp.status_code == 400 and words in resp.json()["error"]["message"], resp.text
    assert _post(stack.proxy.url, chat_body(MODEL, [good], "still fine")).status_code == 200


def test_tenants_cache_salts_keep_their_items_apart(stack: Stack) -> None:
    """One image from two tenants: two encoder entries (each pulled by the connector under its own
    salted uuid), each tenant's repeat encodes nothing (the proxy finds it by Lookup), and every
    answer is plain vLLM's for the same body (``cache_salt`` included: vLLM salts its prefix cache
    with it)."""
    image = image_url(40, 128, 128)  # under DERIVE_MIN_BYTES: a first sight goes straight to an Encode
    before = scrape(stack.encoder.metrics_port)
    for salt in ("tenant-a", "tenant-b", "tenant-a", "tenant-b"):
        body = {**chat_body(MODEL, [image], "what is this?", max_tokens=10), "cache_salt": salt}
        _assert_same(_post(stack.proxy.url, body), _post(stack.baseline.url, body), f"image under {salt}")
    after = scrape(stack.encoder.metrics_port)
    assert after.delta(before, "vllm_neuron:device_encoder_cache_misses_total") == 2
    assert after.delta(before, "vllm_neuron:device_encoder_cache_queries_total") == 2
    # Each repeat was found by the proxy's Lookup of the mm_hash its tenant's first request got.
    assert after.delta(before, "epd_encoder_requests_total", method="Encode", code="OK") == 2
    assert after.delta(before, "epd_encoder_requests_total", method="Lookup", code="OK") == 2
    assert _load_failures(stack) == 0
    bad = {**chat_body(MODEL, [image], "x"), "cache_salt": ""}
    resp = _post(stack.proxy.url, bad)
    assert resp.status_code == 400 and "cache_salt" in resp.json()["error"]["message"], resp.text


def _held_request(stack: Stack, body: dict[str, Any]) -> tuple[threading.Thread, list[httpx.Response]]:
    """Send ``body`` through the gated proxy; return once the proxy encoded it and the gate holds it."""
    stack.gate.hold()
    out: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: out.append(_post(stack.gated_proxy.url, body)), daemon=True)
    thread.start()
    assert stack.gate.arrived.wait(60), "the proxy never forwarded the request"
    return thread, out


def _engine_still_serves(stack: Stack, seed: int) -> None:
    assert stack.consumer.alive(), stack.consumer.log()[-4000:]
    body = chat_body(MODEL, [image_url(seed, 128, 128)], "next request")
    _assert_same(_post(stack.proxy.url, body), _post(stack.baseline.url, body), "the request after a failure")


def _leases(stack: Stack) -> float:
    return scrape(stack.encoder.metrics_port).get("epd_encoder_leases_active")


def test_an_image_named_twice_stays_leased_until_the_connector_pulls_it(stack: Stack) -> None:
    """One image twice in a request: the encoder answers both with one lease, and it pins the item
    until the connector has pulled it (the proxy gave it back at once before: the item was
    unpinned while the request waited for vLLM)."""
    deadline = time.monotonic() + 10
    while _leases(stack) > 0 and time.monotonic() < deadline:  # earlier tests' leases end at their ttl
        time.sleep(0.05)
    assert _leases(stack) == 0
    image = image_url(41, 160, 160)
    body = chat_body(MODEL, [image, image], "are these equal?")
    thread, out = _held_request(stack, body)
    time.sleep(0.5)  # a release the proxy sent has landed by now; the lease's ttl (1.5 s) has not run out
    held = _leases(stack)
    stack.gate.open()
    thread.join(120)
    assert held == 1, "the item was not leased while its request waited for the backend"
    _assert_same(out[0], _post(stack.baseline.url, body), "one image twice")
    assert _load_failures(stack) == 0


def test_item_evicted_between_proxy_and_pull_fails_that_request_only(stack: Stack) -> None:
    thread, out = _held_request(stack, chat_body(MODEL, [image_url(9, 512, 512)], "doomed"))
    time.sleep(LEASE_TTL_MS / 1000 + 0.3)  # the proxy's lease has expired: the item may now be evicted
    fillers = [MediaSpec.image(_png_bytes(100 + i)) for i in range(CACHE_BLOCKS // 4 + 8)]
    with EncoderCacheClient(stack.encoder.target, MODEL, landing_blocks=16) as client:
        for i in range(0, len(fillers), 4):
            client.encode(fillers[i:i + 4])
    stack.gate.open()
    thread.join(120)
    resp = out[0]
    assert resp.status_code == 500, resp.text
    message = resp.json()["error"]["message"]
    assert "evicted" in message and "no longer on encoder" in message, message
    assert _load_failures(stack) >= 1
    _engine_still_serves(stack, 10)


def test_encoder_killed_between_proxy_and_pull_fails_that_request_only(stack: Stack) -> None:
    thread, out = _held_request(stack, chat_body(MODEL, [image_url(11, 200, 200)], "doomed"))
    port = stack.encoder.port
    stack.encoder.kill()
    stack.gate.open()
    thread.join(120)
    resp = out[0]
    assert resp.status_code == 500, resp.text
    message = resp.json()["error"]["message"]
    assert f"encoder 127.0.0.1:{port} is unreachable" in message, message
    assert stack.consumer.alive()
    # Text needs no encoder; then a successor on the same port serves images again.
    text_only = chat_body(MODEL, [], "no images")
    _assert_same(_post(stack.proxy.url, text_only), _post(stack.baseline.url, text_only), "text after the kill")
    stack.encoder = start_encoder(stack.tmp, *stack.encoder_args, "--port", str(port), name="encoder-2")
    _engine_still_serves(stack, 12)


def _png_bytes(seed: int) -> bytes:
    import base64

    return base64.b64decode(image_url(seed, 512, 512).split(",", 1)[1])


SOAK_S = float(os.environ.get("EPD_TEST_VLLM_SOAK_S", "10"))


def test_soak_through_the_whole_stack(stack: Stack) -> None:
    """Mixed image/video requests from three clients (tenants with and without a cache_salt, an API
    key, now and then a wrong one) through a proxy over two encoders, with encoder kills, SIGSTOPs,
    forced evictions and clients that hang up: every answer equals plain vLLM's, the engine never
    dies, every failure is one the README names, every wrong key gets 401 (``bench/vllm_soak.py``;
    EPD_TEST_VLLM_SOAK_S sets the length, 10 s here and
    longer until every kind of fault was injected once)."""
    port = stack.encoder.port
    first = SoakEncoder(stack.tmp, (*stack.encoder_args, "--port", str(port)), "encoder-soak", stack.encoder)
    proxy = start_proxy(stack.tmp / "proxy-soak.log", [stack.encoder.target, stack.second.target],
                        [stack.consumer.url], "--model-id", MODEL, "--rpc-timeout-s", "3",
                        "--encode-timeout-s", "3", "--api-key", "soak-key")
    try:
        report = run_soak(proxy_url=proxy.url, reference_url=stack.baseline.url, consumer=stack.consumer,
                          encoders=[first, stack.second], seconds=SOAK_S, clients=3,
                          fault_every_s=max(1.5, SOAK_S / 8), api_key="soak-key", others={"proxy": proxy})
    finally:
        proxy.stop()
        stack.encoder = first.proc  # terminated with the stack
    print(json.dumps(report))
    assert report["wrong_answers"] == 0, report
    assert report["engine_alive"] and report["engine_restarts"] == 0, report
    assert report["answered"] >= 5, report
    assert set(report["faults"]) == {"kill", "freeze", "evict", "disconnect"}, report
    assert not [k for k in report["failures"] if k.endswith(":other")], report
    # The front door held through the faults: every wrong key refused, and counted as refused.
    assert report["wrong_key_let_in"] == 0, report
    assert report["proxy_metrics_401"] == report["wrong_key_sent"], report
    assert report["proxy_metrics_200"] >= report["answered"], report
