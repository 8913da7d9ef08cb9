"""Routing across ``epd proxy``'s backends: the policies as plain functions (bounded load, affinity,
least outstanding, round robin), the affinity key of a conversation, backends marked down and back,
the backend list resolved again; then a proxy before two fake backends (real HTTP on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import math
import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from common.config import ProxyConfig, RoutingPolicy
from common.errors import ConfigError
from prefill_client.proxy.app import Proxy
from prefill_client.proxy.backends import Backends, resolve_backends
from prefill_client.proxy.routing import (
    PROMPT_KEY_CHARS,
    PROMPT_KEY_TOKENS,
    BoundedAffinity,
    LeastOutstanding,
    RoundRobin,
    affinity_key,
    load_bound,
    make_policy,
)

URLS = [f"http://10.0.0.{i}:8000" for i in range(1, 5)]


def _key(value: str) -> Callable[[], str]:
    return lambda: value


def _no_key() -> str:
    raise AssertionError("the key is computed only by a policy that uses it")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# --- policies ------------------------------------------------------------------------------------


def test_round_robin_takes_every_backend_in_turn() -> None:
    policy = RoundRobin()
    orders = [policy.order(URLS[:3], {}, _no_key) for _ in range(4)]
    assert orders == [URLS[:3], [URLS[1], URLS[2], URLS[0]], [URLS[2], URLS[0], URLS[1]], URLS[:3]]
    assert policy.order([], {}, _no_key) == []


def test_backends_default_to_round_robin() -> None:
    backends = Backends(URLS[:2])
    assert [backends.order()[0] for _ in range(4)] == [URLS[0], URLS[1], URLS[0], URLS[1]]


def test_least_outstanding_picks_the_least_loaded_and_shares_ties() -> None:
    policy = LeastOutstanding()
    assert policy.order(URLS[:3], {URLS[0]: 3, URLS[1]: 1, URLS[2]: 2}, _no_key) == [URLS[1], URLS[2], URLS[0]]
    idle = Counter(policy.order(URLS[:3], {}, _no_key)[0] for _ in range(30))
    assert idle == {URLS[0]: 10, URLS[1]: 10, URLS[2]: 10}


@pytest.mark.parametrize("load_factor", [1.0, 1.25, 2.0])
@pytest.mark.parametrize("count", [2, 3, 5])
def test_no_backend_gets_more_than_the_bound(load_factor: float, count: int) -> None:
    """Arrivals (a few hot keys, some keyless) and completions at random: every placement leaves its
    backend within ceil(c x average), the average taken over all requests in flight."""
    rng = random.Random(f"{load_factor}-{count}")
    urls = URLS[:count] + [f"http://10.0.1.{i}:8000" for i in range(count - len(URLS[:count]))]
    policy = BoundedAffinity(load_factor)
    load = dict.fromkeys(urls, 0)
    for _ in range(2000):
        if rng.random() < 0.6 or not sum(load.values()):
            key = rng.choice(["conv-a", "conv-a", "conv-a", "conv-b", ""])
            chosen = policy.order(urls, load, _key(key))[0]
            load[chosen] += 1
            assert load[chosen] <= math.ceil(load_factor * sum(load.values()) / count), (load, chosen)
        else:
            busy = [u for u, n in load.items() if n]
            load[rng.choice(busy)] -= 1


def test_one_hot_key_spreads_only_as_far_as_the_bound_needs() -> None:
    """Requests of one key that all stay in flight: the key's backend takes them up to the bound, the
    rest go on down the key's own order."""
    policy = BoundedAffinity(1.25)
    load = dict.fromkeys(URLS, 0)
    for _ in range(40):
        load[policy.order(URLS, load, _key("hot"))[0]] += 1
    assert max(load.values()) <= load_bound(1.25, 39, 4)
    assert min(load.values()) >= 40 - 3 * load_bound(1.25, 39, 4)


def test_a_key_keeps_its_backend_while_it_is_not_overloaded() -> None:
    policy = BoundedAffinity(1.25)
    home = policy.order(URLS, {}, _key("conversation-1"))[0]
    others = [u for u in URLS if u != home]
    # Sequential turns, other traffic everywhere: the same backend each time.
    for busy in ({}, {others[0]: 3, others[1]: 2}, {home: 1, others[0]: 1, others[2]: 1}):
        assert policy.order(URLS, busy, _key("conversation-1"))[0] == home
    # Its backend far above the average: the next one in the key's order, which stays put.
    spilled = policy.order(URLS, {home: 6}, _key("conversation-1"))
    assert spilled[0] != home and spilled[1:] == [u for u in policy.order(URLS, {}, _key("conversation-1"))
                                                   if u != spilled[0]]
    assert policy.order(URLS, {home: 6}, _key("conversation-1"))[0] == spilled[0]
    # Back within the bound (2 of 4 in flight once placed, c = 1.25): home again.
    assert policy.order(URLS, {home: 1, others[0]: 1, others[1]: 1}, _key("conversation-1"))[0] == home
    # The bound counts every request in flight: one more on an otherwise idle set is already over it.
    assert policy.order(URLS, {home: 1}, _key("conversation-1"))[0] != home


def test_keys_spread_over_backends_and_a_leaving_backend_moves_only_its_keys() -> None:
    policy = BoundedAffinity(1.25)
    keys = [f"conversation-{i}" for i in range(400)]
    before = {k: policy.order(URLS, {}, _key(k))[0] for k in keys}
    assert min(Counter(before.values()).values()) > 60
    after = {k: policy.order(URLS[1:], {}, _key(k))[0] for k in keys}
    assert all(after[k] == before[k] for k in keys if before[k] != URLS[0])


def test_without_a_key_affinity_is_least_outstanding() -> None:
    policy = BoundedAffinity(1.25)
    assert policy.order(URLS[:3], {URLS[0]: 2, URLS[1]: 0, URLS[2]: 1}, _key(""))[0] == URLS[1]
    assert policy.order(URLS[:1], {}, _no_key) == URLS[:1]


def test_load_factors_below_one_are_refused() -> None:
    with pytest.raises(ConfigError, match=">= 1"):
        BoundedAffinity(0.9)
    with pytest.raises(ConfigError, match="affinity_load_factor must be >= 1"):
        ProxyConfig(affinity_load_factor=0.5)


def test_the_settings_choose_the_policy() -> None:
    assert isinstance(make_policy(RoutingPolicy.ROUND_ROBIN, 1.25), RoundRobin)
    assert isinstance(make_policy(RoutingPolicy.LEAST_OUTSTANDING, 1.25), LeastOutstanding)
    policy = make_policy(ProxyConfig().routing, ProxyConfig(affinity_load_factor=1.5).affinity_load_factor)
    assert isinstance(policy, BoundedAffinity) and policy.load_factor == 1.5
    assert ProxyConfig(routing="least-outstanding").routing is RoutingPolicy.LEAST_OUTSTANDING  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="routing must be"):
        ProxyConfig(routing="random")  # type: ignore[arg-type]


# --- the affinity key ------------------------------------------------------------------------------


def _turns(system: str, first: list[Any], answers: list[str]) -> list[dict[str, Any]]:
    """Every request of a chat: each one sends the whole history again."""
    history: list[dict[str, Any]] = [{"role": "system", "content": system}, {"role": "user", "content": first}]
    bodies = [{"model": "m", "messages": list(history)}]
    for i, answer in enumerate(answers):
        history += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"and then {i}?"}]
        bodies.append({"model": "m", "messages": list(history)})
    return bodies


def _image_part(mm_hash: str) -> dict[str, Any]:  # a part as the proxy rewrote it
    return {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 4, 4]}, "uuid": mm_hash}


def test_every_turn_of_a_conversation_has_the_same_key() -> None:
    first = [_image_part("aa11"), {"type": "text", "text": "what is this?"}]
    keys = {affinity_key(body) for body in _turns("be brief", first, ["a cat", "grey", "yes"])}
    assert len(keys) == 1 and "" not in keys


def test_the_key_is_the_leading_content() -> None:
    base = affinity_key(_turns("be brief", [_image_part("aa11"), {"type": "text", "text": "hi"}], [])[0])
    others = [
        _turns("be brief", [_image_part("bb22"), {"type": "text", "text": "hi"}], [])[0],  # another image
        _turns("be brief", [_image_part("aa11"), {"type": "text", "text": "ho"}], [])[0],  # another question
        _turns("be long", [_image_part("aa11"), {"type": "text", "text": "hi"}], [])[0],  # another system prompt
        {**_turns("be brief", [_image_part("aa11"), {"type": "text", "text": "hi"}], [])[0], "cache_salt": "s"},
        {**_turns("be brief", [_image_part("aa11"), {"type": "text", "text": "hi"}], [])[0], "model": "n"},
    ]
    assert len({base, *(affinity_key(body) for body in others)}) == 6
    # A media part counts by its identity, not by its bytes (the data-URL form carries them too).
    inline = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}, "uuid": "aa11"}
    assert affinity_key(_turns("be brief", [inline, {"type": "text", "text": "hi"}], [])[0]) == base
    # A text-only chat: its text.
    assert affinity_key({"messages": [{"role": "user", "content": "hello"}]}) != affinity_key(
        {"messages": [{"role": "user", "content": "hello!"}]})


@pytest.mark.parametrize("body", [None, {}, {"messages": []}, {"messages": "x"}, {"prompt": ""}, {"prompt": []},
                                  {"prompt": None}])
def test_requests_without_messages_or_prompt_have_no_key(body: Any) -> None:
    assert affinity_key(body) == ""


def test_a_completion_is_keyed_by_the_start_of_its_prompt() -> None:
    preamble = "You are a careful assistant. " * 40  # over PROMPT_KEY_CHARS
    assert len(preamble) > PROMPT_KEY_CHARS
    base = affinity_key({"model": "m", "prompt": preamble + "First question?"})
    # What follows the start does not move it: a longer prompt, the next turn, a batch led by it.
    assert affinity_key({"model": "m", "prompt": preamble + "Second question? And a third."}) == base
    assert affinity_key({"model": "m", "prompt": [preamble + "x", "another prompt"]}) == base
    others = [{"model": "m", "prompt": "Another start. " + preamble}, {"model": "n", "prompt": preamble},
              {"model": "m", "prompt": preamble, "cache_salt": "s"}]
    assert len({base, *(affinity_key(body) for body in others)}) == 4
    ids = list(range(PROMPT_KEY_TOKENS + 10))
    assert affinity_key({"prompt": ids}) == affinity_key({"prompt": ids[:PROMPT_KEY_TOKENS] + [7, 7]})
    assert affinity_key({"prompt": ids}) == affinity_key({"prompt": [ids]}) != affinity_key({"prompt": [1] + ids})


# --- backends marked down ------------------------------------------------------------------------


def test_a_down_backend_is_skipped_and_comes_back_after_the_back_off() -> None:
    clock = Clock()
    backends = Backends(URLS[:3], LeastOutstanding(), retry_s=5.0, clock=clock)
    backends.failed(URLS[0], "connection refused")
    for _ in range(6):
        order = backends.order()
        assert order[-1] == URLS[0] and set(order) == set(URLS[:3])  # only as the last resort
    clock.now += 5.0
    assert [backends.order()[0] for _ in range(3)].count(URLS[0]) == 1
    # One request probes it; until it is answered no other goes there.
    with backends.sending(URLS[0]):
        assert all(backends.order()[-1] == URLS[0] for _ in range(4))
        backends.answered(URLS[0])
    assert [backends.order()[0] for _ in range(3)].count(URLS[0]) == 1


def test_a_failed_probe_starts_the_back_off_again() -> None:
    clock = Clock()
    backends = Backends(URLS[:2], RoundRobin(), retry_s=5.0, clock=clock)
    backends.failed(URLS[1], "timed out")
    clock.now += 5.0
    with backends.sending(URLS[1]):
        backends.failed(URLS[1], "connection refused")
    clock.now += 4.0
    assert all(backends.order() == URLS[:2] for _ in range(3))
    clock.now += 1.0
    assert {backends.order()[0] for _ in range(2)} == set(URLS[:2])


def test_when_every_backend_is_down_each_is_still_tried_soonest_due_first() -> None:
    clock = Clock()
    backends = Backends(URLS[:3], RoundRobin(), retry_s=5.0, clock=clock)
    for url in (URLS[2], URLS[0], URLS[1]):
        backends.failed(url, "connection refused")
        clock.now += 1.0
    assert backends.order() == [URLS[2], URLS[0], URLS[1]]


def test_outstanding_requests_steer_the_policy() -> None:
    backends = Backends(URLS[:2], LeastOutstanding())
    with backends.sending(URLS[0]), backends.sending(URLS[0]), backends.sending(URLS[1]):
        assert backends.order()[0] == URLS[1]
    assert {backends.order()[0] for _ in range(2)} == set(URLS[:2])


# --- the backend list ------------------------------------------------------------------------------


def test_backend_lists_resolve_to_base_urls(tmp_path: Path) -> None:
    listing = tmp_path / "backends"
    listing.write_text("# the vLLM pods\nhttp://10.1.0.1:8000/\nhttps://vllm.example:8443\n10.1.0.2:8100\n"
                       "dns:///localhost:8200\n")
    urls = resolve_backends(["http://10.0.0.1:8000", f"file:{listing}", "http://10.0.0.1:8000/"])
    assert urls[:4] == ["http://10.0.0.1:8000", "http://10.1.0.1:8000", "https://vllm.example:8443",
                        "http://10.1.0.2:8100"]
    assert "http://127.0.0.1:8200" in urls[4:]
    with pytest.raises(ConfigError, match="backend target 'nonsense' is not HOST:PORT"):
        resolve_backends(["dns:///nonsense"])
    with pytest.raises(ConfigError, match="cannot read the backend list"):
        resolve_backends([f"file:{tmp_path / 'missing'}"])
    with pytest.raises(ConfigError, match="must be an http"):
        ProxyConfig(backends=("10.0.0.1:8000",))
    assert ProxyConfig(backends=("dns:///vllm:8000", f"file:{listing}")).backends[0] == "dns:///vllm:8000"


def test_the_list_is_resolved_again_and_a_backend_that_leaves_keeps_its_requests(tmp_path: Path) -> None:
    listing = tmp_path / "backends"
    listing.write_text("http://10.1.0.1:8000\nhttp://10.1.0.2:8000\n")

    async def run() -> None:
        clock = Clock()
        backends = Backends([f"file:{listing}"], LeastOutstanding(), refresh_s=2.0, clock=clock)
        assert set(backends.order()) == {"http://10.1.0.1:8000", "http://10.1.0.2:8000"}
        with backends.sending("http://10.1.0.1:8000"):
            listing.write_text("http://10.1.0.2:8000\nhttp://10.1.0.3:8000\n")
            backends.order()  # not due yet
            await asyncio.sleep(0)
            assert set(backends.urls) == {"http://10.1.0.1:8000", "http://10.1.0.2:8000"}
            clock.now += 2.0
            backends.order()  # due: resolved in the background
            await _until(lambda: "http://10.1.0.3:8000" in backends.urls)
            assert backends.urls == ("http://10.1.0.2:8000", "http://10.1.0.3:8000")
        # A list that fails to resolve keeps the last set.
        listing.unlink()
        await backends.refresh()
        assert backends.urls == ("http://10.1.0.2:8000", "http://10.1.0.3:8000")

    asyncio.run(run())


def test_a_list_that_never_resolved_answers_why(tmp_path: Path) -> None:
    backends = Backends([f"file:{tmp_path / 'not-yet'}"], refresh_s=0)
    assert backends.order() == []
    assert backends.none_known().startswith("no backend known: cannot read the backend list")


async def _until(done: Callable[[], bool], limit_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + limit_s
    while not done():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


# --- a proxy before two fake backends ----------------------------------------------------------------


async def _backend(name: str, seen: list[str], hold: asyncio.Event | None = None) -> TestServer:
    async def chat(request: web.Request) -> web.Response:
        seen.append(name)
        if hold is not None:
            await asyncio.wait_for(hold.wait(), 10.0)
        return web.json_response({"choices": [{"message": {"content": name}}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server


def _url(server: TestServer) -> str:
    return str(server.make_url("")).rstrip("/")


def _conversation(n: int, turn: int) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "be brief"},
                                      {"role": "user", "content": f"tell me about topic {n}"}]
    for t in range(turn):
        messages += [{"role": "assistant", "content": f"answer {t}"}, {"role": "user", "content": f"more {t}"}]
    return {"model": "m", "messages": messages}


def _proxy(urls: list[str], **cfg: Any) -> Proxy:
    def no_client(model: str) -> Any:
        raise AssertionError("text-only requests need no encoder client")

    return Proxy(ProxyConfig(backends=tuple(urls), **cfg), make_client=no_client)


def test_a_conversation_stays_on_its_backend_and_a_busy_one_is_avoided() -> None:
    async def run() -> None:
        seen: list[str] = []
        hold = asyncio.Event()
        a, b = await _backend("a", seen, hold), await _backend("b", seen)
        proxy = _proxy([_url(a), _url(b)])
        async with TestClient(TestServer(proxy.app(), host="127.0.0.1")) as http:
            # Find a conversation whose backend is "a", then let "a" answer it at once.
            hold.set()
            for n in range(20):
                resp = await http.post("/v1/chat/completions", json=_conversation(n, 0))
                assert resp.status == 200
                if seen[-1] == "a":
                    break
            seen.clear()
            for turn in range(1, 4):
                assert (await http.post("/v1/chat/completions", json=_conversation(n, turn))).status == 200
            assert seen == ["a", "a", "a"]
            # "a" busy with two of the conversation's requests: its next turn and new ones go to "b".
            hold.clear()
            seen.clear()
            held = [asyncio.create_task(http.post("/v1/chat/completions", json=_conversation(n, 4 + i)))
                    for i in range(2)]
            await _until(lambda: seen.count("a") == 2)
            for body in (_conversation(n, 6), _conversation(100, 0), _conversation(101, 0)):
                assert (await http.post("/v1/chat/completions", json=body)).status == 200
            assert seen == ["a", "a", "b", "b", "b"]
            hold.set()
            assert [(await t).status for t in held] == [200, 200]
        await a.close()
        await b.close()

    asyncio.run(run())


def test_a_backend_that_refuses_connections_is_skipped_until_its_back_off_ends() -> None:
    async def run() -> None:
        seen: list[str] = []
        a, b = await _backend("a", seen), await _backend("b", seen)
        dead = _url(a)
        await a.close()
        proxy = _proxy([dead, _url(b)], routing="round-robin", backend_retry_s=60.0)
        async with TestClient(TestServer(proxy.app(), host="127.0.0.1")) as http:
            for _ in range(4):
                resp = await http.post("/v1/chat/completions", json=_conversation(0, 0))
                assert resp.status == 200 and (await resp.json())["choices"][0]["message"]["content"] == "b"
            assert proxy._backends.order()[-1] == dead  # marked down: tried last
        await b.close()
        # Nothing reachable: 502 naming each backend.
        proxy = _proxy([dead])
        async with TestClient(TestServer(proxy.app(), host="127.0.0.1")) as http:
            resp = await http.post("/v1/chat/completions", json=_conversation(0, 0))
            assert resp.status == 502 and dead in (await resp.json())["error"]["message"]

    asyncio.run(run())


def test_a_backend_that_outlives_the_deadline_is_504_and_the_request_is_not_sent_again() -> None:
    async def run() -> None:
        seen: list[str] = []
        hold = asyncio.Event()
        a, b = await _backend("a", seen, hold), await _backend("b", seen, hold)
        proxy = _proxy([_url(a), _url(b)], backend_timeout_s=0.3, backend_retry_s=60.0)
        async with TestClient(TestServer(proxy.app(), host="127.0.0.1")) as http:
            resp = await http.post("/v1/chat/completions", json=_conversation(0, 0))
            message = (await resp.json())["error"]["message"]
            assert resp.status == 504 and len(seen) == 1, (resp.status, seen)
            slow = _url(a) if seen == ["a"] else _url(b)
            assert message == f"backend {slow} did not answer within --backend-timeout-s (0.3 s)"
            # The slow one is skipped for its back-off: the next request goes to the other.
            hold.set()
            resp = await http.post("/v1/chat/completions", json=_conversation(0, 0))
            assert resp.status == 200 and seen[1] != seen[0]
        await a.close()
        await b.close()

    asyncio.run(run())
