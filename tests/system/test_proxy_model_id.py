"""``epd proxy`` without ``--model-id`` in front of a real ``epd encoder`` started with another model
id than the default, and a fake vLLM backend: the handshake takes the request's ``model``, else
the one model the backend's ``/v1/models`` lists, and a model the encoder does not serve is an
error naming both ids. Real processes (mock transport), no vLLM."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from epd_harness.media import image_url
from epd_harness.procs import EncoderProcess, start_encoder
from epd_harness.vllm import Server, chat_body, start_proxy
from prefill_client.consumer.client import EncoderCacheClient
from prefill_client.handoff import from_params
from tests.support.fake_vllm import FakeVllm

pytestmark = pytest.mark.timeout(240)

SERVED = "my-vlm"  # what the encoder was started with, and the name the fake vLLM serves


@dataclass
class Stack:
    encoder: EncoderProcess
    backend: FakeVllm
    proxy: Server


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp: Path = tmp_path_factory.mktemp("proxy-model-id")
    # A short drain: the last test leaves a lease unpulled, which the encoder would wait for on SIGTERM.
    encoder = start_encoder(tmp, "--transport", "mock", "--model-id", SERVED, "--cache-blocks", "32",
                            "--drain-grace-s", "1")
    backend = FakeVllm(SERVED)
    proxy: Server | None = None
    try:
        proxy = start_proxy(tmp / "proxy.log", [encoder.target], [backend.url], "--transport", "mock")
        yield Stack(encoder, backend, proxy)
    finally:
        if proxy is not None:
            proxy.stop()
        backend.close()
        encoder.terminate()


def _post(stack: Stack, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(stack.proxy.url + "/v1/chat/completions", json=body, timeout=60.0)


def _pull(stack: Stack, sent: dict[str, Any]) -> int:
    """Pull what the proxy placed for a request, as the connector would; the items pulled."""
    placed = list(from_params(sent["ec_transfer_params"]).values())
    with EncoderCacheClient(stack.encoder.target, SERVED, transport_kind="mock", consumer_id="connector") as puller:
        return len(puller.pull_placed(placed))


def test_the_requests_model_is_the_handshakes(stack: Stack) -> None:
    resp = _post(stack, chat_body(SERVED, [image_url(1, 64, 96)], "what is it?"))
    assert resp.status_code == 200, resp.text + stack.proxy.log()[-3000:]
    sent = stack.backend.chats[-1]
    assert sent["messages"][0]["content"][0]["type"] == "image_embeds"
    assert _pull(stack, sent) == 1


def test_without_a_model_the_backends_one_model_is_used(stack: Stack) -> None:
    body = chat_body(SERVED, [image_url(2, 80, 80)], "and this?")
    del body["model"]
    for _ in range(2):
        resp = _post(stack, body)
        assert resp.status_code == 200, resp.text
    assert stack.backend.model_asks == 1
    assert "model" not in stack.backend.chats[-1] and _pull(stack, stack.backend.chats[-1]) == 1


def test_a_model_the_encoder_does_not_serve_names_both_ids(stack: Stack) -> None:
    chats = len(stack.backend.chats)
    resp = _post(stack, chat_body("tiny-qwen3-vl", [image_url(3, 64, 64)], "x"))
    assert resp.status_code == 502, resp.text
    message = resp.json()["error"]["message"]
    assert f"this encoder serves {SERVED!r}, request names 'tiny-qwen3-vl'" in message, message
    assert len(stack.backend.chats) == chats
    bad = _post(stack, chat_body("", [image_url(3, 64, 64)], "x"))
    assert bad.status_code == 400 and "model must be a non-empty string" in bad.json()["error"]["message"]
    # The served model still works after the refusal.
    assert _post(stack, chat_body(SERVED, [image_url(4, 64, 64)], "y")).status_code == 200
    health = httpx.get(stack.proxy.url + "/health", timeout=10).json()
    assert health["models"] == [SERVED] and health["encoders"] == [stack.encoder.target]
