"""``epd proxy``'s front door against a fake encoder client and a fake vLLM backend (real HTTP on
127.0.0.1): API keys checked before anything is read, the in-flight bound, ``mm_processor_kwargs``
refused with media, ``/ready`` from the encoders' and the backends' sides, ``/metrics``; and the
pure pieces (keys, their settings, the workers' metrics adding up, the port the workers share)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from common.config import READINESS_SERVICE, ProxyConfig, add_arguments, build
from common.errors import ConfigError
from common.metrics import ProxyMetrics
from common.wire import pb2
from epd_harness.ports import free_port
from prefill_client.consumer.connection import MediaSpec
from prefill_client.handoff import Placement
from prefill_client.proxy.app import Proxy
from prefill_client.proxy.errors import SERVER_ERROR, HttpError
from prefill_client.proxy.front import ApiKeys, count_media_parts, load_api_keys, rejection_reason
from prefill_client.proxy.readiness import EncoderWatch, Readiness, Side
from prefill_client.proxy.workers import reserve_port

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
KEY = "sk-right"


def _image(seed: int = 0) -> dict[str, Any]:
    url = "data:image/png;base64," + base64.b64encode(b"\x89PNG " + bytes([seed])).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def _chat(*parts: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "hi"}]}],
            **extra}


def _auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@dataclass
class FakeClient:
    """The encoders: the first sight of an image is a miss, a second one a hit."""

    placed: list[list[MediaSpec]] = field(default_factory=list)
    seen: set[bytes] = field(default_factory=set)
    model_id: str = "m"
    targets: tuple[str, ...] = ("127.0.0.1:1",)

    def place(self, specs: Sequence[MediaSpec]) -> list[Placement]:
        self.placed.append(list(specs))
        out = []
        for i, spec in enumerate(specs):
            hit = spec.frames[0] in self.seen
            self.seen.add(spec.frames[0])
            loc = pb2.ItemLocation(mm_hash=f"h{i}", block_ids=[1], tokens_per_block=[4], num_tokens=4,
                                   lease_id=100 + i, grid_thw=[1, 4, 4],
                                   result=pb2.CACHE_RESULT_HIT if hit else pb2.CACHE_RESULT_MISS)
            out.append(Placement(f"h{i}", "127.0.0.1:1", "inc", loc))
        return out

    def release_placed(self, placements: Sequence[Placement]) -> None:
        pass

    def connection(self, target: str) -> SimpleNamespace:
        return SimpleNamespace(processor_is_ours=True)  # epd-cache's own tower

    def close(self) -> None:
        pass


@dataclass
class Backend:
    """A vLLM server: records chats (and their Authorization), holds them while ``gate`` is clear,
    answers ``chat_status``, lists one model, answers ``/health`` with ``health_status``."""

    chats: list[Any] = field(default_factory=list)
    auth: list[str | None] = field(default_factory=list)
    chat_status: int = 200
    health_status: int = 200
    health_asks: int = 0
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    arrived: int = 0

    def __post_init__(self) -> None:
        self.gate.set()

    def app(self) -> web.Application:
        app = web.Application()

        async def chat(request: web.Request) -> web.Response:
            self.arrived += 1
            self.chats.append(await request.json())
            self.auth.append(request.headers.get("Authorization"))
            await asyncio.wait_for(self.gate.wait(), 30.0)
            return web.json_response({"choices": [{"message": {"content": "ok"}}]}, status=self.chat_status)

        async def models(request: web.Request) -> web.Response:
            return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

        async def health_(request: web.Request) -> web.Response:
            self.health_asks += 1
            return web.Response(status=self.health_status)

        app.router.add_post(CHAT, chat)
        app.router.add_post(COMPLETIONS, chat)
        app.router.add_get("/v1/models", models)
        app.router.add_get("/health", health_)
        return app


@dataclass
class Clock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Front:
    http: TestClient[web.Request, web.Application]
    backend: Backend
    client: FakeClient
    proxy: Proxy
    encoders: list[str]  # the encoders the fake readiness reports ready
    clock: Clock
    backend_url: str

    def metrics(self) -> dict[str, float]:
        families = text_string_to_metric_families(self.proxy.metrics.exposition().decode())
        return {_key(s.name, s.labels): s.value for f in families for s in f.samples}


def _key(name: str, labels: dict[str, str]) -> str:
    return name + "".join(f",{k}={v}" for k, v in sorted(labels.items()))


@contextlib.asynccontextmanager
async def _front(backend: Backend | None = None, *, up: bool = True, **cfg: Any) -> AsyncIterator[Front]:
    """A proxy with ``cfg`` (the key ``KEY`` unless given) before ``backend`` (``up`` False: no
    backend listens at its URL)."""
    backend = backend or Backend()
    server = TestServer(backend.app(), host="127.0.0.1")
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")
    if not up:
        await server.close()
    client, clock, encoders = FakeClient(), Clock(), ["127.0.0.1:1"]
    config = ProxyConfig(backends=(url,), **{"api_keys": (KEY,), **cfg})
    readiness = Readiness(config, lambda: (url,), encoders=lambda: Side(tuple(encoders), ("127.0.0.1:2",)),
                          clock=clock)
    proxy = Proxy(config, client, readiness=readiness)  # type: ignore[arg-type]
    try:
        async with TestClient(TestServer(proxy.app(), host="127.0.0.1")) as http:
            yield Front(http, backend, client, proxy, encoders, clock, url)
    finally:
        await server.close()


def _run(test: Any) -> None:
    asyncio.run(test())


# --- API keys -------------------------------------------------------------------------------


def test_keys_come_from_repeated_flags_commas_and_the_environment(tmp_path: Path) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser, ProxyConfig)
    cfg = build(ProxyConfig, parser.parse_args(["--api-key", "sk-a", "--api-key", "sk-b,sk-c"]),
                {"EPD_PROXY_API_KEY": "sk-x"})
    assert cfg.api_keys == ("sk-a", "sk-b", "sk-c")  # the flag wins over the variable
    assert build(ProxyConfig, parser.parse_args([]), {"EPD_PROXY_API_KEY": "sk-x,sk-y"}).api_keys == ("sk-x", "sk-y")
    assert "sk-" not in repr(cfg) and "api_keys" not in repr(cfg)  # never in a log line
    assert build(ProxyConfig, parser.parse_args(["--encoder", "a:1", "--encoder", "b:2"]), {}).encoders == ("b:2",)
    with pytest.raises(ConfigError, match="max_inflight"):
        ProxyConfig(max_inflight=-1)
    with pytest.raises(ConfigError, match="workers"):
        ProxyConfig(workers=0)


def test_a_key_file_adds_its_keys_and_a_useless_one_stops_the_start(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("\n  k2  \n\nk3\n")
    keys = load_api_keys(ProxyConfig(api_keys=("k1",), api_key_file=str(path)))
    assert len(keys) == 3 and all(keys.allows(f"Bearer {k}") for k in ("k1", "k2", "k3"))
    for text, words in (("\n \n", "holds no key"), ("good\nbad key\n", "line 2 has a space")):
        path.write_text(text)
        with pytest.raises(ConfigError, match=words):
            load_api_keys(ProxyConfig(api_key_file=str(path)))
    with pytest.raises(ConfigError, match="cannot read"):
        load_api_keys(ProxyConfig(api_key_file=str(tmp_path / "missing")))


def test_only_a_bearer_of_a_key_is_let_in() -> None:
    keys = ApiKeys(["k1", "k2"])
    assert keys.allows("Bearer k1") and keys.allows("bearer k2") and keys.allows("Bearer  k2 ")
    for header in (None, "", "Bearer", "Bearer ", "Bearer k3", "Basic k1", "k1", "Bearer k1k2", "Bearer k"):
        assert not keys.allows(header), header
    assert not ApiKeys([]) and len(keys) == 2


def test_a_request_without_a_valid_key_is_401_before_its_body_is_read() -> None:
    async def test() -> None:
        async with _front() as front:
            for headers in ({}, _auth("sk-wrong"), {"Authorization": KEY}):
                resp = await front.http.post(CHAT, data=b"{not json", headers=headers)
                assert resp.status == 401, await resp.text()
                error = (await resp.json())["error"]
                assert error["type"] == "authentication_error" and error["code"] == 401
                resp = await front.http.post(CHAT, json=_chat(_image()), headers=headers)
                assert resp.status == 401
                assert (await front.http.get("/v1/models", headers=headers)).status == 401
                assert (await front.http.post(COMPLETIONS, json={"prompt": "x"}, headers=headers)).status == 401
            assert front.client.placed == [] and front.backend.chats == []
            for path in ("/health", "/ready", "/metrics"):  # probes and scrapes need no key
                assert (await front.http.get(path)).status == 200, path
            resp = await front.http.post(CHAT, json=_chat(_image()), headers=_auth())
            assert resp.status == 200 and len(front.client.placed) == 1
            assert front.backend.auth == [f"Bearer {KEY}"]  # the caller's header goes on: vLLM checks it too
            assert (await front.http.get("/v1/models", headers=_auth())).status == 200
            assert (await front.http.post(COMPLETIONS, json={"prompt": "x"}, headers=_auth())).status == 200
            assert front.backend.chats[-1] == {"prompt": "x"} and front.backend.auth[-1] == f"Bearer {KEY}"
            metrics = front.metrics()
            assert metrics[_key("epd_proxy_rejections_total", {"reason": "auth"})] == 12
            assert metrics[_key("epd_proxy_requests_total", {"route": CHAT, "code": "401"})] == 6
            assert metrics[_key("epd_proxy_requests_total", {"route": "/v1/models", "code": "401"})] == 3
            assert metrics[_key("epd_proxy_requests_total", {"route": COMPLETIONS, "code": "401"})] == 3
            assert metrics[_key("epd_proxy_requests_total", {"route": COMPLETIONS, "code": "200"})] == 1
    _run(test)


def test_expect_100_continue_hears_the_refusal_instead_of_continue() -> None:
    async def ask(port: int, headers: str) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         f"Content-Length: 2\r\nExpect: 100-continue\r\n{headers}\r\n".encode())
            await writer.drain()
            return await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10.0)
        finally:
            writer.close()

    async def test() -> None:
        async with _front() as front:
            port = front.http.server.port
            assert port is not None
            for headers in ("", "Authorization: Bearer sk-wrong\r\n"):
                head = await ask(port, headers)
                assert head.startswith(b"HTTP/1.1 401"), head  # no "100 Continue": the body is never sent
            assert (await ask(port, f"Authorization: Bearer {KEY}\r\n")).startswith(b"HTTP/1.1 100 Continue")
            assert front.client.placed == [] and front.backend.chats == []
            assert front.metrics()[_key("epd_proxy_requests_total", {"route": CHAT, "code": "401"})] == 2
    _run(test)


def test_without_keys_every_caller_is_let_in() -> None:
    async def test() -> None:
        async with _front(api_keys=()) as front:
            assert (await front.http.post(CHAT, json=_chat())).status == 200
    _run(test)


# --- the in-flight bound ----------------------------------------------------------------------


def test_over_max_inflight_is_429_at_once_and_the_count_goes_back() -> None:
    async def test() -> None:
        async with _front(max_inflight=2) as front:
            front.backend.gate.clear()
            held = [asyncio.ensure_future(front.http.post(CHAT, json=_chat(), headers=_auth())) for _ in range(2)]
            for _ in range(1000):  # 10 s at most
                if front.backend.arrived == 2:
                    break
                await asyncio.sleep(0.01)
            assert front.metrics()["epd_proxy_requests_running"] == 2
            assert front.metrics()[_key("epd_proxy_backend_requests_running", {"backend": front.backend_url})] == 2
            loop = asyncio.get_running_loop()
            started = loop.time()
            resp = await front.http.post(CHAT, json=_chat(_image()), headers=_auth())
            assert resp.status == 429 and resp.headers["Retry-After"] == "1"
            assert loop.time() - started < 1.0 and front.client.placed == []
            assert (await resp.json())["error"]["type"] == "rate_limit_error"
            front.backend.gate.set()
            assert [r.status for r in await asyncio.gather(*held)] == [200, 200]
            assert (await front.http.post(CHAT, json=_chat(), headers=_auth())).status == 200
            metrics = front.metrics()
            assert metrics["epd_proxy_requests_running"] == 0
            assert metrics[_key("epd_proxy_backend_requests_running", {"backend": front.backend_url})] == 0
            assert metrics[_key("epd_proxy_rejections_total", {"reason": "inflight"})] == 1
            assert metrics[_key("epd_proxy_requests_total", {"route": CHAT, "code": "429"})] == 1
            assert metrics[_key("epd_proxy_requests_total", {"route": CHAT, "code": "200"})] == 3
    _run(test)


# --- mm_processor_kwargs ----------------------------------------------------------------------


def test_mm_processor_kwargs_with_media_is_400_naming_the_field() -> None:
    async def test() -> None:
        async with _front() as front:
            resp = await front.http.post(CHAT, json=_chat(_image(), mm_processor_kwargs={"max_pixels": 1024}),
                                         headers=_auth())
            assert resp.status == 400
            message = (await resp.json())["error"]["message"]
            assert message.startswith("mm_processor_kwargs is not supported by epd proxy: the encoders preprocess")
            assert front.client.placed == [] and front.backend.chats == []
            assert front.metrics()[_key("epd_proxy_media_items_total", {"outcome": "refused"})] == 1
            # Without media there is nothing the encoders preprocess: passed on unchanged.
            body = _chat(mm_processor_kwargs={"max_pixels": 1024})
            assert (await front.http.post(CHAT, json=body, headers=_auth())).status == 200
            assert front.backend.chats[-1] == body
            for empty in ({}, None):
                body = _chat(_image(), mm_processor_kwargs=empty)
                assert (await front.http.post(CHAT, json=body, headers=_auth())).status == 200
    _run(test)


def test_media_parts_are_counted_unread() -> None:
    messages = [{"role": "system", "content": "x"}, {"content": [_image(), {"type": "text"}, "odd"]},
                {"content": [{"type": "video_url"}, {"type": "input_audio"}]}, "odd"]
    assert count_media_parts(messages) == 2


# --- metrics ----------------------------------------------------------------------------------


def test_metrics_count_requests_media_and_backend_failures() -> None:
    async def test() -> None:
        async with _front() as front:
            for _ in range(2):  # a miss, then a hit, of the same image; a second image is a miss
                body = _chat(_image(1), _image(2)) if front.client.placed else _chat(_image(1))
                assert (await front.http.post(CHAT, json=body, headers=_auth())).status == 200
            resp = await front.http.post(CHAT, json={"messages": "no"}, headers=_auth())
            assert resp.status == 400
            front.backend.chat_status = 500
            assert (await front.http.post(CHAT, json=_chat(_image(3)), headers=_auth())).status == 500
            assert (await front.http.get("/nowhere", headers=_auth())).status == 404
            metrics = front.metrics()
            requests = {k: v for k, v in metrics.items() if k.startswith("epd_proxy_requests_total")}
            assert requests == {_key("epd_proxy_requests_total", {"route": CHAT, "code": "200"}): 2,
                                _key("epd_proxy_requests_total", {"route": CHAT, "code": "400"}): 1,
                                _key("epd_proxy_requests_total", {"route": CHAT, "code": "500"}): 1,
                                _key("epd_proxy_requests_total", {"route": "other", "code": "404"}): 1}
            media = {outcome: metrics[_key("epd_proxy_media_items_total", {"outcome": outcome})]
                     for outcome in ("hit", "miss", "refused")}
            assert media == {"hit": 1, "miss": 3, "refused": 0}
            assert metrics["epd_proxy_encode_latency_seconds_count"] == 3
            backend = {"backend": front.backend_url}
            assert metrics[_key("epd_proxy_backend_errors_total", {**backend, "kind": "server_error"})] == 1
            assert metrics[_key("epd_proxy_backend_time_to_first_byte_seconds_count", backend)] == 3
            assert metrics[_key("epd_proxy_e2e_request_latency_seconds_count", {"route": CHAT})] == 4
            assert metrics[_key("epd_proxy_rejections_total", {"reason": "bad_request"})] == 1
            # The backend's own failure is a backend error, not the proxy refusing the request.
            assert metrics[_key("epd_proxy_rejections_total", {"reason": "unavailable"})] == 0
            text = (await (await front.http.get("/metrics")).text())
            assert "epd_proxy_requests_total" in text and "epd_handshakes" not in text
    _run(test)


def test_an_unreachable_backend_is_a_connect_error_and_the_request_502() -> None:
    async def test() -> None:
        async with _front(up=False) as front:
            assert (await front.http.post(CHAT, json=_chat(), headers=_auth())).status == 502
            metrics = front.metrics()
            backend = {"backend": front.backend_url}
            assert metrics[_key("epd_proxy_backend_errors_total", {**backend, "kind": "connect"})] == 1
            assert metrics[_key("epd_proxy_backend_requests_running", backend)] == 0
            assert metrics[_key("epd_proxy_rejections_total", {"reason": "unavailable"})] == 1
    _run(test)


@pytest.mark.parametrize(("status", "kind", "reason"), [
    (401, "authentication_error", "auth"), (429, "rate_limit_error", "cache_full"), (413, "x", "bad_request"),
    (400, "x", "bad_request"), (503, "x", "unavailable"), (502, "x", "unavailable"), (500, SERVER_ERROR, None)])
def test_rejection_reasons(status: int, kind: str, reason: str | None) -> None:
    assert rejection_reason(HttpError(status, "m", kind=kind)) == reason


def test_workers_metrics_add_up_and_only_the_proxys_are_served(tmp_path: Path) -> None:
    code = """
import os, sys
from common.metrics import PrefillMetrics, ProxyMetrics
m = ProxyMetrics()
m.requests.labels(route="/v1/chat/completions", code="200").inc(int(sys.argv[1]))
m.requests_running.inc()
PrefillMetrics().pulls.inc()  # an encoder client's series, in the same files
"""
    for count in (2, 5):
        subprocess.run([sys.executable, "-c", code, str(count)], check=True, timeout=60,
                       env={"PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PATH": ""})
    text = ProxyMetrics(multiprocess_dir=str(tmp_path)).exposition().decode()
    samples = {_key(s.name, s.labels): s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[_key("epd_proxy_requests_total", {"route": CHAT, "code": "200"})] == 7
    assert all(name.startswith("epd_proxy_") for name in samples), sorted(samples)


def test_a_reserved_port_takes_workers_that_bind_it_and_no_connection_itself() -> None:
    reserved = reserve_port("127.0.0.1", 0)
    port = reserved.getsockname()[1]
    listeners = []
    try:
        for _ in range(2):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind(("127.0.0.1", port))
            sock.listen(8)
            listeners.append(sock)
        for _ in range(8):
            with socket.create_connection(("127.0.0.1", port), timeout=2):
                pass
        # Every connection reached a listener (the reserved socket does not listen).
        for sock in listeners:
            sock.settimeout(0.2)
        accepted = 0
        for sock in listeners:
            with contextlib.suppress(TimeoutError):
                while True:
                    sock.accept()[0].close()
                    accepted += 1
        assert accepted == 8
    finally:
        for sock in [reserved, *listeners]:
            sock.close()


# --- readiness --------------------------------------------------------------------------------


def test_ready_needs_a_ready_encoder_and_a_healthy_backend() -> None:
    async def test() -> None:
        async with _front() as front:
            resp = await front.http.get("/ready")
            assert resp.status == 200 and (await resp.json())["not_ready"] == []
            front.encoders.clear()
            front.backend.health_status = 503
            resp = await front.http.get("/ready")  # the answer of a second ago still holds
            assert resp.status == 200 and front.backend.health_asks == 1
            front.clock.now += 1.5
            resp = await front.http.get("/ready")
            body = await resp.json()
            assert resp.status == 503 and body["not_ready"] == ["encoders", "backends"]
            assert body["encoders"]["not_ready"] == ["127.0.0.1:2"]
            assert body["backends"]["not_ready"] == [front.backend_url]
            health = await front.http.get("/health")  # liveness: still 200, not ready
            assert health.status == 200 and (await health.json())["ready"] is False
            front.encoders.append("127.0.0.1:1")
            front.clock.now += 1.5
            body = await (await front.http.get("/ready")).json()
            assert body["not_ready"] == ["backends"] and body["encoders"]["ready"] == ["127.0.0.1:1"]
            front.backend.health_status = 200
            front.clock.now += 1.5
            assert (await front.http.get("/ready")).status == 200
            assert (await (await front.http.get("/health")).json())["ready"] is True
    _run(test)


def test_probes_that_arrive_together_share_one_check() -> None:
    async def test() -> None:
        async with _front() as front:
            answers = await asyncio.gather(*(front.http.get("/ready") for _ in range(10)))
            assert {r.status for r in answers} == {200} and front.backend.health_asks == 1
    _run(test)


def test_a_backend_that_answered_stays_ready_through_one_late_probe() -> None:
    """A busy API server is not a dead one: one /health past the deadline keeps a ready backend
    ready, the second in a row does not; a refused connection or another status counts at once."""
    readiness = Readiness(ProxyConfig(encoders=("127.0.0.1:1",)), lambda: ["http://b"],
                          encoders=lambda: Side(("e",)))
    verdicts = [readiness._verdict("http://b", answer)
                for answer in (None, True, None, None, None, True, None, True, None, False, None)]
    assert verdicts == [False, True, True, False, False, True, True, True, True, False, False]


@contextlib.contextmanager
def _health_server(status: health_pb2.HealthCheckResponse.ServingStatus.ValueType) -> Any:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set(READINESS_SERVICE, status)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield port, servicer
    finally:
        server.stop(0)


def test_the_encoder_watch_asks_readiness_and_never_handshakes() -> None:
    nothing = free_port()
    with _health_server(health_pb2.HealthCheckResponse.NOT_SERVING) as (port, servicer):
        cfg = ProxyConfig(encoders=(f"127.0.0.1:{port}", f"127.0.0.1:{nothing}"), membership_refresh_s=0)
        watch = EncoderWatch(cfg)
        try:
            assert watch.side() == Side((), (f"127.0.0.1:{port}", f"127.0.0.1:{nothing}"))
            servicer.set(READINESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
            assert watch.side().ready == (f"127.0.0.1:{port}",)  # a health server: no cache service to handshake
        finally:
            watch.close()
    assert "do not resolve" in EncoderWatch(ProxyConfig(encoders=("file:/nonexistent/list",))).side().unknown


def test_a_route_the_proxy_does_not_serve_is_an_openai_error_naming_the_ones_it_does() -> None:
    async def test() -> None:
        async with _front() as front:
            assert (await front.http.get("/v1/responses")).status == 401  # the key first: no route is named
            resp = await front.http.post("/v1/responses", json={"input": "x"}, headers=_auth())
            error = (await resp.json())["error"]
            assert resp.status == 404 and error["code"] == 404 and error["type"] == "invalid_request_error"
            assert "does not serve POST /v1/responses" in error["message"]
            for served in (f"POST {CHAT}", f"POST {COMPLETIONS}", "GET /v1/models", "GET /metrics"):
                assert served in error["message"], error["message"]
            resp = await front.http.get(CHAT, headers=_auth())
            assert resp.status == 405 and resp.headers["Allow"] == "POST"
            assert "does not serve GET /v1/chat/completions" in (await resp.json())["error"]["message"]
            metrics = front.metrics()
            assert metrics[_key("epd_proxy_requests_total", {"route": "other", "code": "404"})] == 1
            assert front.backend.chats == []
    _run(test)
