"""Every family vLLM serves: ``epd encoder --tower vllm`` feeds a vLLM consumer, against plain vLLM.

Per family, real processes: a tiny random checkpoint made here, ``epd encoder`` loading it
through vLLM (encoder only), a plain ``vllm serve`` of it (the baseline), a ``vllm serve`` of a
copy whose vision weights are noise with ``EpdCacheConnector`` (its outputs equal the baseline's
only if every row came from the encoder), and ``epd proxy`` in front, without ``--model-id``.
The families differ in how the prompt's placeholders are sized: Qwen-VL from the grid the
encoder answers (metadata only), LLaVA and Gemma 3 from the media itself (sent with
``uuid = mm_hash``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from common.weights_digest import checkpoint_digest
from epd_harness.families import FAMILIES, noise_vision_copy
from epd_harness.media import image_url, video_url
from epd_harness.vllm import TowerStack, chat_body, start_tower_stack, vllm_missing
from tests.support.scrape import scrape

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

LOGPROB_ATOL = 1e-3
# About a minute each (two vLLM engines and an encoder start): three in the suite, one of each way
# placeholders are sized (the Qwen grid with deepstack rows and without; the media itself, with anyres
# tiling and video), every family with EPD_TEST_FAMILIES=all (or a comma-separated choice). Gemma 3 sizes
# them as LLaVA-OneVision's images do; it runs with `all`.
DEFAULT_FAMILIES = ("llava_onevision", "qwen2_5_vl", "qwen3_vl")
VIDEO_FAMILIES = {"llava_onevision", "qwen2_5_vl", "qwen3_vl"}  # of the tested ones, those whose vLLM model takes video
_CHOSEN = os.environ.get("EPD_TEST_FAMILIES", "")
CHOSEN = sorted(FAMILIES) if _CHOSEN == "all" else [f for f in _CHOSEN.split(",") if f] or list(DEFAULT_FAMILIES)


@pytest.fixture(scope="module", params=CHOSEN)
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TowerStack]:
    reason = vllm_missing()
    if reason:
        pytest.skip(reason)
    family: str = request.param
    if family not in FAMILIES:
        pytest.fail(f"EPD_TEST_FAMILIES names {family!r}; known: {sorted(FAMILIES)}")
    tmp = tmp_path_factory.mktemp(family)
    checkpoint = FAMILIES[family](tmp / "checkpoint", 3)
    noise = noise_vision_copy(checkpoint, tmp / "noise-vision")
    assert checkpoint_digest(noise) != checkpoint_digest(checkpoint)
    built = start_tower_stack(tmp, family, checkpoint, noise, "--cache-blocks", "64")
    try:
        yield built
    finally:
        built.stop()


def _post(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120.0)


def _outputs(resp: httpx.Response) -> tuple[list[int], list[float]]:
    assert resp.status_code == 200, resp.text
    data = resp.json()
    choice = data["choices"][0]
    logprobs = [t["logprob"] for t in choice["logprobs"]["content"]]
    prompt = [next(iter(p.values()))["logprob"] for p in data["prompt_logprobs"] if p]
    return choice["token_ids"], logprobs + prompt


def _encoder_counts(stack: TowerStack) -> tuple[float, float]:
    metrics = scrape(stack.encoder.metrics_port)
    return (metrics.get("vllm_neuron:device_encoder_cache_queries_total"),
            metrics.get("vllm_neuron:device_encoder_cache_misses_total"))


def _same(stack: TowerStack, urls: list[str], text: str, what: str) -> float:
    body = chat_body(stack.model, urls, text, max_tokens=8)
    got_ids, got = _outputs(_post(stack.proxy.url, body))
    want_ids, want = _outputs(_post(stack.baseline.url, body))
    assert got_ids == want_ids, f"{stack.model}, {what}: greedy tokens differ"
    assert len(got) == len(want), f"{stack.model}, {what}: prompts differ in length"
    worst = max(abs(a - b) for a, b in zip(got, want, strict=True))
    assert worst <= LOGPROB_ATOL, f"{stack.model}, {what}: logprobs differ by {worst}"
    return worst


def test_every_row_comes_from_the_encoder_and_equals_plain_vllm(stack: TowerStack) -> None:
    a, b, c = image_url(1, 96, 128), image_url(2, 300, 200), image_url(3, 160, 400)
    queries, misses = _encoder_counts(stack)
    worst = max(
        _same(stack, [a], "what is this?", "one image"),
        _same(stack, [b, c], "compare them", "two images of different sizes"),
        _same(stack, [a], "and again?", "the same image again"),
    )
    if stack.model in VIDEO_FAMILIES:
        worst = max(worst, _same(stack, [video_url(20, 4, 112, 140)], "what happens?", "a video of four frames"))
    queries_after, misses_after = _encoder_counts(stack)
    videos = int(stack.model in VIDEO_FAMILIES)
    # a again: found by the proxy's Lookup of the mm_hash its first request got (no Encode, no L3 query)
    assert (queries_after - queries, misses_after - misses) == (3 + videos, 3 + videos)
    connector = scrape(stack.connector_metrics_port)
    assert connector.get("epd_pulls_total") >= 2
    assert sum(v for k, v in connector.samples.items() if k.startswith("epd_ec_load_failures_total")) == 0
    print(f"{stack.model}: largest logprob difference {worst:.2e}")


def test_a_bad_image_is_400_and_the_engine_keeps_serving(stack: TowerStack) -> None:
    bad = "data:image/png;base64,bm90IGFuIGltYWdl"  # "not an image"
    resp = _post(stack.proxy.url, chat_body(stack.model, [image_url(4, 64, 64), bad], "x"))
    assert resp.status_code == 400, resp.text
    assert "messages[0].content[1]" in resp.json()["error"]["message"]
    assert stack.consumer.alive()
    _same(stack, [image_url(5, 128, 128)], "still there?", "the request after a bad one")
