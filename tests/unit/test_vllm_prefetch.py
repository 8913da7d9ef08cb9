"""Prefetch hints: what a worker pulls ahead is taken only by an order for the very same placement,
bounded, forgotten in time; a failed, late or queued prefetch leaves the order to pull by itself;
the API server's middleware passes the header's bytes to every rank and the request on unchanged."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from common.wire import pb2
from prefill_client.consumer.pull import PulledItem
from prefill_client.handoff import MAX_HINT_BYTES, PREFETCH_HEADER, Placement, from_hint, prefetch_hint
from prefill_client.proxy.backends import passed_headers, with_hint
from prefill_client.vllm.prefetch import EpdPrefetch, Prefetches

zmq = pytest.importorskip("zmq", reason="hints travel over ZeroMQ")


def _placement(mm_hash: str, lease_id: int = 11, blocks: int = 2, generation: int = 9) -> Placement:
    loc = pb2.ItemLocation(mm_hash=mm_hash, block_ids=list(range(3, 3 + blocks)),
                           tokens_per_block=[4] + [0] * (blocks - 1), num_tokens=4, fingerprint=7,
                           generation=generation, lease_id=lease_id, grid_thw=[1, 4, 4])
    return Placement(mm_hash, "127.0.0.1:50051", "inc-1", loc, "digest", "proxy-7")


class Puller:
    """A worker's verified pull: records what it was asked; ``gate`` holds it, ``fail`` raises."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.fail: Exception | None = None

    def __call__(self, placements: Sequence[Placement]) -> list[PulledItem]:
        self.calls.append([p.mm_hash for p in placements])
        assert self.gate.wait(10)
        if self.fail is not None:
            raise self.fail
        return [PulledItem(p.mm_hash, torch.full((4, 8), float(p.location.lease_id)), (1, 2, 2), "enc", "hit")
                for p in placements]


def _hint(*placements: Placement) -> bytes:
    value = prefetch_hint(placements)
    assert value is not None
    return value.encode()


def _settled(calls: int, pull: Puller) -> None:
    """Until ``pull`` was called ``calls`` times (a prefetch thread took the hint), bounded."""
    deadline = time.monotonic() + 5
    while len(pull.calls) < calls and time.monotonic() < deadline:
        time.sleep(0.002)


@pytest.fixture
def store() -> Iterator[tuple[Puller, Prefetches]]:
    """A worker's store of prefetches and its pull (whose gate the test may close), closed at the end."""
    pull = Puller()
    made = Prefetches(pull, max_blocks=64)
    yield pull, made
    pull.gate.set()
    made.close()


def test_an_order_takes_what_a_hint_pulled_for_the_same_placement(store: tuple[Puller, Prefetches]) -> None:
    pull, ahead = store
    a, b = _placement("a"), _placement("b", lease_id=12)
    ahead.hint(_hint(a, b))
    _settled(1, pull)
    got, rest = ahead.claim([a, b], wait_s=5)
    assert pull.calls == [["a", "b"]] and rest == []
    assert torch.equal(got["a"].embeddings, torch.full((4, 8), 11.0))
    assert torch.equal(got["b"].embeddings, torch.full((4, 8), 12.0))
    assert len(ahead) == 0 and ahead.blocks == 0  # taken once: forgotten
    assert ahead.claim([a], wait_s=5) == ({}, [a])


@pytest.mark.parametrize("other", [
    _placement("a", lease_id=99),  # another lease of the same item
    _placement("a", generation=10),  # the block reused since
    _placement("a", blocks=3),  # other blocks
    Placement("a", "127.0.0.1:50052", "inc-1", _placement("a").location),  # another encoder
])
def test_an_order_for_another_placement_of_the_item_pulls_by_itself(other: Placement,
                                                                    store: tuple[Puller, Prefetches]) -> None:
    pull, ahead = store
    ahead.hint(_hint(_placement("a")))
    _settled(1, pull)
    assert ahead.claim([other], wait_s=5) == ({}, [other])
    assert len(ahead) == 1  # the hint's own placement is still kept (for its own order, or until it expires)


def test_a_failed_prefetch_leaves_the_order_to_pull_and_a_running_one_is_waited_for(
        store: tuple[Puller, Prefetches]) -> None:
    pull, ahead = store
    pull.fail = RuntimeError("tag mismatch")
    a = _placement("a")
    ahead.hint(_hint(a))
    _settled(1, pull)
    assert ahead.claim([a], wait_s=5) == ({}, [a])
    pull.fail = None
    pull.gate.clear()  # the next prefetch is under way when its order comes
    b = _placement("b")
    ahead.hint(_hint(b))
    _settled(2, pull)
    threading.Timer(0.2, pull.gate.set).start()
    started = time.monotonic()
    got, rest = ahead.claim([b], wait_s=5)
    assert rest == [] and "b" in got and time.monotonic() - started >= 0.15


def test_a_late_prefetch_is_given_up_at_the_wait_bound(store: tuple[Puller, Prefetches]) -> None:
    pull, ahead = store
    pull.gate.clear()
    a = _placement("a")
    ahead.hint(_hint(a))
    _settled(1, pull)
    assert ahead.claim([a], wait_s=0.05) == ({}, [a])


def test_a_queued_prefetch_is_cancelled_by_its_order(store: tuple[Puller, Prefetches]) -> None:
    pull, ahead = store
    pull.gate.clear()
    for i in range(2):  # both prefetch threads held
        ahead.hint(_hint(_placement(f"busy{i}", lease_id=20 + i)))
    _settled(2, pull)
    queued = _placement("queued")
    ahead.hint(_hint(queued))
    started = time.monotonic()
    assert ahead.claim([queued], wait_s=5) == ({}, [queued])
    assert time.monotonic() - started < 1  # not waited for
    pull.gate.set()
    time.sleep(0.1)
    assert all("queued" not in call for call in pull.calls)  # and never pulled


def test_what_is_kept_ahead_is_bounded_oldest_first_and_forgotten_in_time() -> None:
    now = [100.0]
    pull = Puller()
    store = Prefetches(pull, max_blocks=4, keep_s=30, clock=lambda: now[0])
    try:
        first, second, third = (_placement(h, lease_id=i) for i, h in enumerate(["a", "b", "c"]))
        store.hint(_hint(first))
        store.hint(_hint(second))
        assert store.blocks == 4
        store.hint(_hint(third))  # 2 blocks more than the bound: the oldest goes
        assert store.blocks == 4 and len(store) == 2
        assert store.claim([first], wait_s=1) == ({}, [first])
        store.hint(_hint(_placement("big", blocks=5)))  # larger than the bound alone: refused
        assert store.refused == 1 and store.blocks == 4
        now[0] += 31  # nobody took them: the next hint forgets them first
        store.hint(_hint(_placement("d", lease_id=40)))
        assert len(store) == 1 and store.blocks == 2
    finally:
        store.close()


@pytest.mark.parametrize("data", [b"not json", b"[]", b'{"items": {"a": {"encoder": "x"}}}',
                                  b"{" + b" " * MAX_HINT_BYTES + b"}"])
def test_a_malformed_hint_is_dropped_without_a_pull(data: bytes, store: tuple[Puller, Prefetches]) -> None:
    pull, ahead = store
    ahead.hint(data)
    assert ahead.refused == 1 and len(ahead) == 0 and pull.calls == []


def test_the_hint_is_the_placements_and_a_callers_own_header_never_passes() -> None:
    placed = [_placement("a"), _placement("b", lease_id=12)]
    hint = prefetch_hint(placed)
    assert hint is not None and from_hint(hint.encode()) == {p.mm_hash: p for p in placed}
    assert prefetch_hint([]) is None
    assert prefetch_hint([_placement(f"{i:032x}", lease_id=i) for i in range(40)]) is None  # over 8 KiB: none
    forwarded = passed_headers({PREFETCH_HEADER: "forged", "Authorization": "Bearer k"})
    assert forwarded == {"Authorization": "Bearer k"}
    assert with_hint(forwarded, placed)[PREFETCH_HEADER] == hint


# --- the API server's middleware -------------------------------------------------------------


def _app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tp: int = 2, dp: int = 1,
         api_key: list[str] | None = None) -> tuple[EpdPrefetch, list[Any]]:
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    calls: list[Any] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        calls.append((scope, receive, send))

    config = SimpleNamespace(instance_id="7", parallel_config=SimpleNamespace(
        data_parallel_rank=0, data_parallel_size=dp, tensor_parallel_size=tp))
    app.state = SimpleNamespace(vllm_config=config, args=SimpleNamespace(api_key=api_key))  # type: ignore[attr-defined]
    return EpdPrefetch(app), calls


def _scope(app: Any, method: str = "POST", hint: bytes | None = None, key: str | None = None) -> dict[str, Any]:
    headers = [(b"content-type", b"application/json")]
    if key is not None:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    if hint is not None:
        headers.append((PREFETCH_HEADER.lower().encode(), hint))
    return {"type": "http", "method": method, "path": "/v1/chat/completions", "headers": headers, "app": app}


def _ranks(tp: int) -> tuple[Any, list[Any]]:
    from prefill_client.vllm.channel import prefetch_address

    ctx = zmq.Context()
    socks = []
    for rank in range(tp):
        sock = ctx.socket(zmq.PULL)
        sock.bind(prefetch_address(f"ipc://{__import__('tempfile').gettempdir()}/epd-ec-7-dp0", rank))
        socks.append(sock)
    return ctx, socks


def test_the_middleware_sends_the_header_to_every_rank_and_passes_the_request_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    middleware, calls = _app(tmp_path, monkeypatch)
    ctx, socks = _ranks(2)
    try:
        lifespan = {"type": "lifespan", "app": middleware.app}
        asyncio.run(middleware(lifespan, None, None))  # connects, and passes the lifespan on
        assert calls.pop() == (lifespan, None, None)
        hint = _hint(_placement("a"))
        scope = _scope(middleware.app, hint=hint)
        receive, send = object(), object()
        deadline = time.monotonic() + 10
        while middleware.sent < 2 and time.monotonic() < deadline:  # the connections are made in the background
            asyncio.run(middleware(scope, receive, send))
            time.sleep(0.01)
        assert calls and all(call == (scope, receive, send) for call in calls)  # the request itself, unchanged
        for sock in socks:
            assert sock.poll(5000), "a rank got no hint"
            assert sock.recv() == hint
        while any(sock.poll(50) for sock in socks):  # hints sent while the other rank was connecting
            for sock in socks:
                if sock.poll(0):
                    assert sock.recv() == hint
        before = len(calls)
        for other in (_scope(middleware.app), _scope(middleware.app, "GET", hint)):  # no header; not a POST
            asyncio.run(middleware(other, receive, send))
        assert len(calls) == before + 2 and not any(sock.poll(100) for sock in socks)
    finally:
        for sock in socks:
            sock.close(0)
        ctx.term()


def test_the_middleware_never_blocks_without_workers_nor_hints_several_engines(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    alone, calls = _app(tmp_path, monkeypatch)
    started = time.monotonic()
    for _ in range(200):  # nobody listening: nothing queues, nothing waits
        asyncio.run(alone(_scope(alone.app, hint=_hint(_placement("a"))), None, None))
    assert len(calls) == 200 and time.monotonic() - started < 5 and alone.sent == 0 and alone.dropped == 400
    several, calls = _app(tmp_path, monkeypatch, dp=2)
    asyncio.run(several(_scope(several.app, hint=_hint(_placement("a"))), None, None))
    assert len(calls) == 1 and several.sent == several.dropped == 0


def test_the_middleware_sends_no_hint_for_a_request_vllms_key_check_refuses(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    middleware, calls = _app(tmp_path, monkeypatch, tp=1, api_key=["k1", "k2"])
    ctx, (sock,) = _ranks(1)
    try:
        asyncio.run(middleware({"type": "lifespan", "app": middleware.app}, None, None))
        hint = _hint(_placement("a"))
        for key in (None, "wrong", "k1x"):  # refused by vLLM: no pull for them
            asyncio.run(middleware(_scope(middleware.app, hint=hint, key=key), None, None))
        assert middleware.sent == middleware.dropped == 0 and len(calls) == 4  # each passed on: vLLM answers 401
        deadline = time.monotonic() + 10
        while middleware.sent < 1 and time.monotonic() < deadline:
            asyncio.run(middleware(_scope(middleware.app, hint=hint, key="k2"), None, None))
            time.sleep(0.01)
        assert sock.poll(5000) and sock.recv() == hint
    finally:
        sock.close(0)
        ctx.term()
    monkeypatch.setenv("VLLM_API_KEY", "from-env")  # no --api-key: vLLM's variable, as vLLM reads it
    env_only, _ = _app(tmp_path, monkeypatch, tp=1)
    asyncio.run(env_only(_scope(env_only.app, hint=_hint(_placement("a")), key="nope"), None, None))
    assert env_only._keys and not env_only._authorized(b"Bearer nope") and env_only._authorized(b"Bearer from-env")
