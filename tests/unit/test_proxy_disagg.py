"""``epd proxy --prefill --decode`` against a fake encoder client and fake prefill and decode vLLMs (real
HTTP on 127.0.0.1): what each step is sent, the relay of the decode's answer, the failures, the config."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from common.config import ProxyConfig, build
from common.errors import ConfigError
from prefill_client.handoff import PREFETCH_HEADER, from_hint, from_params
from prefill_client.proxy.app import Proxy
from prefill_client.proxy.disagg import decode_body, kv_params, prefill_body
from prefill_client.proxy.readiness import Readiness, Side
from tests.unit.test_proxy import FakeClient, _chat, _data_url, _image, sse_backend

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
KV = {"do_remote_prefill": True, "remote_engine_id": "e1", "remote_block_ids": [[1, 2]], "remote_host": "127.0.0.1",
      "remote_port": 5601, "remote_request_id": "r1"}
UNREACHABLE = "http://127.0.0.1:9"  # nothing listens on the discard port


async def _prefilled(request: web.Request) -> web.StreamResponse:
    return web.json_response({"choices": [{"message": {"content": "x"}}], "kv_transfer_params": KV})


async def _decoded(request: web.Request) -> web.StreamResponse:
    return web.json_response({"choices": [{"message": {"role": "assistant", "content": "decoded"}}]})


async def _run(client: FakeClient, prefill: Sequence[Handler | None], decode: Sequence[Handler | None], body: Any, *,
               stream: bool = False, path: str = "/v1/chat/completions", **settings: Any
               ) -> tuple[int, Any, list[list[Any]], list[list[Any]]]:
    """POST ``body`` to ``path`` of a proxy over the fake pools (None: a member nobody listens for);
    (status, answer, bodies each prefill got, bodies each decode got: on ``path`` only)."""
    servers: list[TestServer] = []

    async def pool(handlers: Sequence[Handler | None]) -> tuple[list[str], list[list[Any]]]:
        urls, seen = [], []
        for handler in handlers:
            got: list[Any] = []
            seen.append(got)
            if handler is None:
                urls.append(UNREACHABLE)
                continue

            async def record(request: web.Request, handler: Handler = handler, got: list[Any] = got
                             ) -> web.StreamResponse:
                got.append(await request.json())
                return await handler(request)

            app = web.Application()
            app.router.add_post(path, record)
            server = TestServer(app, host="127.0.0.1")
            await server.start_server()
            servers.append(server)
            urls.append(str(server.make_url("")).rstrip("/"))
        return urls, seen

    prefill_urls, prefill_seen = await pool(prefill)
    decode_urls, decode_seen = await pool(decode)
    cfg = ProxyConfig(prefill=tuple(prefill_urls), decode=tuple(decode_urls), routing="round-robin", **settings)
    proxy = Proxy(cfg, client)  # type: ignore[arg-type]
    async with TestClient(TestServer(proxy.app(), host="127.0.0.1")) as http:
        resp = await http.post(path, json=body)
        if stream:
            answer: Any = b"".join([chunk async for chunk in resp.content.iter_any()])
        else:
            answer = json.loads(await resp.text())
        status = resp.status
    for server in servers:
        await server.close()
    return status, answer, prefill_seen, decode_seen


def test_prefill_then_decode_with_the_prefills_kv_params() -> None:
    client = FakeClient()
    body = {**_chat(_image(_data_url())), "max_tokens": 7, "max_completion_tokens": 7, "stream_options": {},
            "min_tokens": 2}
    status, answer, (prefilled,), (decoded,) = asyncio.run(_run(client, [_prefilled], [_decoded], body))
    assert status == 200 and answer["choices"][0]["message"]["content"] == "decoded"
    (pre,), (dec,) = prefilled, decoded
    # The prefill: one token, not streamed, its KV kept for a remote decode, with the items' locations.
    assert pre["max_tokens"] == 1 and pre["max_completion_tokens"] == 1 and pre["stream"] is False
    assert pre["kv_transfer_params"] == {"do_remote_decode": True}
    assert "stream_options" not in pre and "min_tokens" not in pre
    assert "ec_transfer_params" in pre
    # The decode: the request as sent, its media as the prefill had them, the prefill's KV params, no items.
    assert dec["max_tokens"] == 7 and dec["min_tokens"] == 2 and "ec_transfer_params" not in dec
    assert dec["kv_transfer_params"] == KV
    assert dec["messages"] == pre["messages"]
    part = dec["messages"][1]["content"][0]
    assert part["type"] == "image_embeds" and part["uuid"]
    assert client.released == []  # the prefill's connector releases the leases it pulled


def test_only_the_prefill_gets_the_prefetch_hint() -> None:
    hints: dict[str, str | None] = {}

    def noting(step: str, handler: Handler) -> Handler:
        async def note(request: web.Request) -> web.StreamResponse:
            hints[step] = request.headers.get(PREFETCH_HEADER)
            return await handler(request)
        return note

    status, _, (prefilled,), _ = asyncio.run(_run(FakeClient(), [noting("prefill", _prefilled)],
                                                  [noting("decode", _decoded)], _chat(_image(_data_url()))))
    assert status == 200 and hints["decode"] is None and hints["prefill"] is not None
    assert from_hint(hints["prefill"].encode()) == from_params(prefilled[0]["ec_transfer_params"])


def test_text_only_requests_are_split_too() -> None:
    status, _, (prefilled,), (decoded,) = asyncio.run(_run(FakeClient(), [_prefilled], [_decoded], _chat()))
    assert status == 200 and prefilled[0]["kv_transfer_params"] == {"do_remote_decode": True}
    assert decoded[0]["kv_transfer_params"] == KV


def test_text_completions_are_split_on_their_own_route() -> None:
    body = {"model": "m", "prompt": "Once upon a time", "max_tokens": 5}
    status, answer, (prefilled,), (decoded,) = asyncio.run(
        _run(FakeClient(), [_prefilled], [_decoded], body, path="/v1/completions"))
    assert status == 200 and answer["choices"][0]["message"]["content"] == "decoded"
    (pre,), (dec,) = prefilled, decoded
    assert pre == {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    assert dec == {**body, "kv_transfer_params": KV}


def test_streams_from_the_decode_are_relayed() -> None:
    stream = sse_backend(*({"choices": [{"delta": {"content": word}}]} for word in ("a", "b")))
    status, answer, (prefilled,), _ = asyncio.run(
        _run(FakeClient(), [_prefilled], [stream], {**_chat(), "stream": True}, stream=True))
    assert status == 200 and answer.count(b"data: ") == 3 and answer.endswith(b"data: [DONE]\n\n")
    assert prefilled[0]["stream"] is False


def test_unreachable_members_are_skipped() -> None:
    status, _, (_, prefilled), (_, decoded) = asyncio.run(
        _run(FakeClient(), [None, _prefilled], [None, _decoded], _chat(_image(_data_url()))))
    assert status == 200 and len(prefilled) == 1 and len(decoded) == 1


def test_no_prefill_reachable_is_502_and_the_leases_go_back() -> None:
    client = FakeClient()
    status, answer, _, (decoded,) = asyncio.run(_run(client, [None], [_decoded], _chat(_image(_data_url()))))
    assert status == 502 and "no prefill reachable" in answer["error"]["message"]
    assert len(client.released) == 1 and decoded == []


def test_a_prefill_without_kv_params_is_named() -> None:
    client = FakeClient()
    status, answer, _, (decoded,) = asyncio.run(_run(client, [_decoded], [_decoded], _chat(_image(_data_url()))))
    assert status == 502 and "without kv_transfer_params" in answer["error"]["message"], answer
    assert decoded == []


@pytest.mark.parametrize("code", [400, 500])
def test_a_prefill_error_is_one_answer_and_the_leases_go_back(code: int) -> None:
    async def refuse(request: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"message": "nope", "code": code}}, status=code)

    client = FakeClient()
    status, answer, _, (decoded,) = asyncio.run(_run(client, [refuse], [_decoded], _chat(_image(_data_url()))))
    assert status == code and "nope" in answer["error"]["message"] and decoded == []
    assert len(client.released) == 1  # given back once
    if code == 500:  # explained: what became of the items
        assert "still on their encoders" in answer["error"]["message"]


def test_a_decode_failure_is_one_answer_and_no_other_decode_gets_the_kv() -> None:
    async def fail(request: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"message": "decode broke"}}, status=500)

    status, answer, _, (first, second) = asyncio.run(
        _run(FakeClient(), [_prefilled], [fail, _decoded], _chat(_image(_data_url()))))
    assert status == 500 and "decode broke" in answer["error"]["message"]
    assert len(first) + len(second) == 1  # the decode that took it; the KV goes to no second one


def test_a_decode_that_hangs_up_is_a_502() -> None:
    async def hang_up(request: web.Request) -> web.StreamResponse:
        assert request.transport is not None
        request.transport.close()
        await asyncio.sleep(0.1)
        return web.Response()

    status, answer, _, _ = asyncio.run(_run(FakeClient(), [_prefilled], [hang_up], _chat()))
    assert status == 502 and "failed the request without an answer" in answer["error"]["message"], answer


@pytest.mark.parametrize("step", ["prefill", "decode"])
def test_a_member_that_outlives_the_deadline_is_a_504_and_no_other_gets_the_request(step: str) -> None:
    async def stall(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(2.0)
        return web.Response()

    pools = {"prefill": [_prefilled, _prefilled], "decode": [_decoded, _decoded]}
    pools[step] = [stall, stall]
    status, answer, prefilled, decoded = asyncio.run(
        _run(FakeClient(), pools["prefill"], pools["decode"], _chat(), backend_timeout_s=0.3))
    assert status == 504, answer
    assert "did not answer within --backend-timeout-s (0.3 s)" in answer["error"]["message"]
    assert answer["error"]["message"].startswith(step)
    assert sum(map(len, prefilled if step == "prefill" else decoded)) == 1


def test_prompt_logprobs_are_refused_and_the_leases_go_back() -> None:
    client = FakeClient()
    body = {**_chat(_image(_data_url())), "prompt_logprobs": 0}
    status, answer, (prefilled,), (decoded,) = asyncio.run(_run(client, [_prefilled], [_decoded], body))
    assert status == 400 and "prompt_logprobs" in answer["error"]["message"]
    assert prefilled == [] and decoded == [] and len(client.released) == 1


def test_bodies() -> None:
    body = {"messages": [], "ec_transfer_params": {"x": 1}, "max_tokens": 9, "stream": True}
    assert prefill_body(body)["ec_transfer_params"] == {"x": 1}
    assert "max_completion_tokens" not in prefill_body(body)
    dec = decode_body(body, KV)
    assert dec == {"messages": [], "max_tokens": 9, "stream": True, "kv_transfer_params": KV}
    assert kv_params(json.dumps({"kv_transfer_params": KV})) == KV
    for text in ("not json", "[]", "{}", json.dumps({"kv_transfer_params": {}})):
        assert kv_params(text) is None


def test_config_pools() -> None:
    assert ProxyConfig().backends == ("http://127.0.0.1:8100",) and not ProxyConfig().disaggregated
    cfg = build(ProxyConfig, None, {"EPD_PROXY_PREFILL": "http://p:1", "EPD_PROXY_DECODE": "http://d:1,http://d:2"})
    assert cfg.disaggregated and cfg.backends == () and cfg.decode == ("http://d:1", "http://d:2")
    with pytest.raises(ConfigError, match=r"go together.*prefill \['http://p:1'\], decode \[\]"):
        ProxyConfig(prefill=("http://p:1",))
    with pytest.raises(ConfigError, match=r"--backend excludes.*backend \['http://b:1'\]"):
        ProxyConfig(backends=("http://b:1",), prefill=("http://p:1",), decode=("http://d:1",))
    with pytest.raises(ConfigError, match="decode must be an http"):
        ProxyConfig(prefill=("http://p:1",), decode=("d:1",))


def test_ready_needs_both_pools() -> None:
    async def go() -> tuple[int, dict[str, Any]]:
        app = web.Application()
        app.router.add_get("/health", _decoded)  # any 200
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        url = str(server.make_url("")).rstrip("/")
        cfg = ProxyConfig(prefill=(url,), decode=(UNREACHABLE,))
        readiness = Readiness(cfg, {"prefill": lambda: (url,), "decode": lambda: (UNREACHABLE,)},
                              encoders=lambda: Side(("127.0.0.1:1",)))
        proxy = Proxy(cfg, FakeClient(), readiness=readiness)  # type: ignore[arg-type]
        async with TestClient(TestServer(proxy.app(), host="127.0.0.1")) as http:
            resp = await http.get("/ready")
            out = resp.status, await resp.json()
        await server.close()
        return out

    status, body = asyncio.run(go())
    assert status == 503 and body["not_ready"] == ["decode"], body
    assert body["prefill"]["ready"] and body["decode"]["not_ready"] == [UNREACHABLE]

