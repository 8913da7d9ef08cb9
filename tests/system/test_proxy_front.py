"""``epd proxy`` as a front door, real processes: a real ``epd encoder`` (mock transport) and a fake
vLLM backend that can hold requests (tests/support/fake_vllm.py). API keys refuse a caller before any encoder is called, the
in-flight bound answers 429 at once, ``/ready`` waits for an encoder started after the proxy,
``mm_processor_kwargs`` with media is a 400, ``/metrics`` counts exactly the requests sent,
with ``--workers 2`` on one port (``--port 0``) too, and SIGTERM stops the listening at once,
lets a request in flight finish, and cuts one that outlasts ``--drain-grace-s``; ``--access-log``
writes a line per request, without the key. No vLLM."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from epd_harness.media import image_url
from epd_harness.ports import free_port
from epd_harness.procs import EncoderProcess, launch_encoder, start_encoder
from epd_harness.vllm import PROXY_LIMIT_S, Server, chat_body
from epd_harness.waits import wait_ready
from tests.support.fake_vllm import FakeVllm
from tests.support.scrape import parse, scrape

pytestmark = pytest.mark.timeout(300)

SERVED = "my-vlm"
KEY, FILE_KEY = "sk-flag", "sk-file"
CHAT = "/v1/chat/completions"
REQUEST_TIMEOUT_S = 60.0
READY_WAIT_S = 30.0  # an encoder that is ready shows in /ready within a refresh and a cached answer
DRAIN_WAIT_S = 30.0  # bound of each wait of the SIGTERM tests (each step takes well under a second)


@dataclass
class Front:
    """A started ``epd proxy`` on the port it printed."""

    server: Server
    out_path: Path

    @property
    def url(self) -> str:
        return self.server.url

    def port_lines(self) -> list[int]:
        lines = self.out_path.read_text().splitlines()
        return [json.loads(line)["proxy_port"] for line in lines if line.startswith('{"proxy_port"')]


def start_front(tmp: Path, name: str, encoders: list[str], backend: FakeVllm, *args: str) -> Front:
    """``epd proxy --port 0 ARGS`` (mock transport) in its own process group; waits for its port line."""
    out_path, log_path = tmp / f"{name}.out", tmp / f"{name}.log"
    cmd = [sys.executable, "-m", "common.cli", "proxy", "--encoder", ",".join(encoders), "--backend", backend.url,
           "--host", "127.0.0.1", "--port", "0", "--transport", "mock", *args]
    with open(out_path, "wb") as out, open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=out, stderr=log, start_new_session=True)
    front = Front(Server(proc, 0, log_path), out_path)

    def listening() -> int | None:
        ports = front.port_lines()
        return ports[0] if ports else None

    front.server.port = wait_ready("epd proxy", proc, log_path, listening, limit_s=PROXY_LIMIT_S, group=True,
                                   poll_s=0.2, give_up=front.server.stop)
    return front


def _post(front: Front, body: dict[str, Any], key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.post(front.url + CHAT, json=body, headers=headers, timeout=REQUEST_TIMEOUT_S)


def _encoder_calls(encoder: EncoderProcess) -> float:
    """Every EncoderCacheService call the encoder answered so far."""
    return sum(v for k, v in scrape(encoder.metrics_port).samples.items() if k.startswith("epd_encoder_requests_total"))


def _proxy_metrics(front: Front) -> dict[str, float]:
    """The proxy's /metrics, parsed (a scrape that does not parse fails here)."""
    resp = httpx.get(front.url + "/metrics", timeout=10.0)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    return parse(resp.text)


def _wait_ready(front: Front, status: int) -> dict[str, Any]:
    deadline = time.monotonic() + READY_WAIT_S
    while True:
        resp = httpx.get(front.url + "/ready", timeout=10.0)
        if resp.status_code == status:
            return dict(resp.json())
        assert time.monotonic() < deadline, f"/ready stayed {resp.status_code}: {resp.text}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("proxy-front")


@pytest.fixture(scope="module")
def encoder(tmp: Path) -> Iterator[EncoderProcess]:
    # A short drain: requests leave leases unpulled, which the encoder would wait for on SIGTERM.
    proc = start_encoder(tmp, "--transport", "mock", "--model-id", SERVED, "--cache-blocks", "32",
                         "--drain-grace-s", "1")
    try:
        yield proc
    finally:
        proc.terminate()


@pytest.fixture
def backend() -> Iterator[FakeVllm]:
    fake = FakeVllm(SERVED)
    try:
        yield fake
    finally:
        fake.close()


def test_without_a_valid_key_nothing_is_read_and_no_encoder_is_called(
        tmp: Path, encoder: EncoderProcess, backend: FakeVllm) -> None:
    keys = tmp / "keys"
    keys.write_text(f"\n{FILE_KEY}\n")
    front = start_front(tmp, "proxy-keys", [encoder.target], backend, "--api-key", KEY,
                        "--api-key-file", str(keys))
    try:
        before = _encoder_calls(encoder)
        for key in (None, "sk-wrong"):
            resp = _post(front, chat_body(SERVED, [image_url(1, 64, 64)], "x"), key)
            assert resp.status_code == 401, resp.text
            assert resp.json()["error"]["type"] == "authentication_error"
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            assert httpx.get(front.url + "/v1/models", headers=headers, timeout=10.0).status_code == 401
        # A caller with a key, but processor arguments the encoders would not apply: refused too.
        resp = _post(front, {**chat_body(SERVED, [image_url(1, 64, 64)], "x"),
                             "mm_processor_kwargs": {"max_pixels": 4096}})
        assert resp.status_code == 400 and "mm_processor_kwargs is not supported" in resp.json()["error"]["message"]
        assert _encoder_calls(encoder) == before and backend.chats == []
        for path in ("/health", "/metrics"):
            assert httpx.get(front.url + path, timeout=10.0).status_code == 200
        _wait_ready(front, 200)
        for key in (KEY, FILE_KEY):
            resp = _post(front, chat_body(SERVED, [image_url(2, 64, 64)], "y"), key)
            assert resp.status_code == 200, resp.text + front.server.log()[-3000:]
        assert _encoder_calls(encoder) > before
        assert backend.auth == [f"Bearer {KEY}", f"Bearer {FILE_KEY}"]  # forwarded: vLLM checks it too
        assert httpx.get(front.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"},
                         timeout=10.0).status_code == 200
    finally:
        front.server.stop()


def test_over_max_inflight_is_429_at_once(tmp: Path, encoder: EncoderProcess, backend: FakeVllm) -> None:
    front = start_front(tmp, "proxy-inflight", [encoder.target], backend, "--api-key", KEY, "--max-inflight", "1")
    try:
        backend.hold()
        held: list[httpx.Response] = []
        first = threading.Thread(target=lambda: held.append(_post(front, chat_body(SERVED, [], "held"))))
        first.start()
        assert backend.arrived.wait(REQUEST_TIMEOUT_S)
        started = time.monotonic()
        resp = _post(front, chat_body(SERVED, [image_url(3, 64, 64)], "over"))
        assert resp.status_code == 429 and resp.headers["retry-after"] == "1"
        assert time.monotonic() - started < 1.0, "429 must come at once, not after a wait"
        assert resp.json()["error"]["type"] == "rate_limit_error"
        metrics = _proxy_metrics(front)
        assert metrics["epd_proxy_requests_running"] == 1
        assert metrics['epd_proxy_rejections_total{reason="inflight"}'] == 1
        backend.release()
        first.join(REQUEST_TIMEOUT_S)
        assert [r.status_code for r in held] == [200]
        assert _post(front, chat_body(SERVED, [], "after")).status_code == 200
        assert _proxy_metrics(front)["epd_proxy_requests_running"] == 0
    finally:
        backend.release()
        front.server.stop()


def test_not_ready_until_an_encoder_is(tmp: Path, backend: FakeVllm) -> None:
    port = free_port()
    front = start_front(tmp, "proxy-ready", [f"127.0.0.1:{port}"], backend, "--membership-refresh-s", "0.5")
    late: EncoderProcess | None = None
    try:
        body = _wait_ready(front, 503)
        assert body["not_ready"] == ["encoders"] and body["encoders"]["not_ready"] == [f"127.0.0.1:{port}"]
        health = httpx.get(front.url + "/health", timeout=10.0)
        assert health.status_code == 200 and health.json()["ready"] is False  # alive, not ready
        launch = launch_encoder(tmp, "--transport", "mock", "--model-id", SERVED, "--port", str(port),
                                "--drain-grace-s", "1", name="late-encoder")
        assert httpx.get(front.url + "/ready", timeout=10.0).status_code == 503  # still starting
        late = launch.wait()
        assert _wait_ready(front, 200)["encoders"]["ready"] == [late.target]
        backend.health_status = 503  # vLLM's engine died: its /health says so
        assert _wait_ready(front, 503)["not_ready"] == ["backends"]
    finally:
        front.server.stop()
        if late is not None:
            late.terminate()


@pytest.mark.parametrize("workers", [1, 2])
def test_metrics_count_exactly_the_requests_sent(tmp: Path, encoder: EncoderProcess, backend: FakeVllm,
                                                 workers: int) -> None:
    front = start_front(tmp, f"proxy-metrics-{workers}", [encoder.target], backend, "--api-key", KEY,
                        "--workers", str(workers))
    try:
        before = _proxy_metrics(front)
        seed = 10 * workers  # images no other test sent: the first sight of each is a miss
        same, other = image_url(seed, 64, 64), image_url(seed + 1, 64, 80)
        # Each request on a new connection: with two workers the kernel spreads them over both.
        for body in (chat_body(SERVED, [same], "a"), chat_body(SERVED, [same], "b"),
                     chat_body(SERVED, [other], "c"), chat_body(SERVED, [], "text only")):
            resp = _post(front, body)
            assert resp.status_code == 200, resp.text + front.server.log()[-3000:]
        for _ in range(2):
            assert _post(front, chat_body(SERVED, [same], "no key"), None).status_code == 401
        resp = _post(front, {**chat_body(SERVED, [same], "kwargs"), "mm_processor_kwargs": {"fps": 2}})
        assert resp.status_code == 400
        expected = {
            f'epd_proxy_requests_total{{code="200",route="{CHAT}"}}': 4,
            f'epd_proxy_requests_total{{code="401",route="{CHAT}"}}': 2,
            f'epd_proxy_requests_total{{code="400",route="{CHAT}"}}': 1,
            'epd_proxy_rejections_total{reason="auth"}': 2,
            'epd_proxy_rejections_total{reason="bad_request"}': 1,
            'epd_proxy_media_items_total{outcome="miss"}': 2,
            'epd_proxy_media_items_total{outcome="hit"}': 1,
            'epd_proxy_media_items_total{outcome="refused"}': 1,
            "epd_proxy_encode_latency_seconds_count": 3,
            f'epd_proxy_e2e_request_latency_seconds_count{{route="{CHAT}"}}': 5,
            f'epd_proxy_backend_time_to_first_byte_seconds_count{{backend="{backend.url}"}}': 4,
        }
        # Every scrape, whichever worker answers it, has every worker's counts.
        for _ in range(4 * workers):
            after = _proxy_metrics(front)
            moved = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in expected}
            assert moved == expected
            assert after["epd_proxy_requests_running"] == 0
        assert front.port_lines() == [front.server.port]  # printed once, by the parent
    finally:
        code = _stop(front)
    assert code == 0, front.server.log()[-3000:]
    with pytest.raises(OSError):  # no worker listens any more
        socket.create_connection(("127.0.0.1", front.server.port), timeout=2.0).close()


def test_workers_stop_when_their_parent_is_killed(tmp: Path, encoder: EncoderProcess, backend: FakeVllm) -> None:
    front = start_front(tmp, "proxy-orphans", [encoder.target], backend, "--workers", "2")
    try:
        assert httpx.get(front.url + "/health", timeout=10.0).status_code == 200
        front.server.proc.kill()  # no SIGTERM to forward: the workers notice by themselves
        front.server.proc.wait(10.0)
        _wait_not_listening(front, "the workers outlived their parent")  # nobody listens: both are gone
    finally:
        front.server.stop()


@pytest.mark.parametrize("workers", [1, 2])
def test_sigterm_stops_listening_and_lets_the_requests_in_flight_finish(
        tmp: Path, encoder: EncoderProcess, backend: FakeVllm, workers: int) -> None:
    front = start_front(tmp, f"proxy-drain-{workers}", [encoder.target], backend, "--workers", str(workers))
    try:
        with _held_request(front, backend) as (answers, sender):
            front.server.proc.send_signal(signal.SIGTERM)
            _wait_not_listening(front, "the proxy still listens after SIGTERM")  # at once, the request in flight
            assert not answers and front.server.proc.poll() is None
            backend.release()
            sender.join(DRAIN_WAIT_S)
            assert len(answers) == 1 and isinstance(answers[0], httpx.Response), answers
            assert answers[0].status_code == 200, answers[0].text
            assert answers[0].json()["choices"][0]["message"]["content"] == "ok"
        assert front.server.proc.wait(DRAIN_WAIT_S) == 0, front.server.log()[-3000:]
        assert "requests in flight: 1, given up to 20 s" in front.server.log()
        assert '"POST /v1/chat/completions' not in front.server.log()  # no access log unless asked
    finally:
        front.server.stop()


def test_the_access_log_has_a_line_per_request_and_no_key(tmp: Path, encoder: EncoderProcess,
                                                         backend: FakeVllm) -> None:
    front = start_front(tmp, "proxy-access-log", [encoder.target], backend, "--api-key", KEY, "--access-log", "true")
    try:
        resp = httpx.post(front.url + CHAT, json=chat_body(SERVED, [], "hello"), timeout=REQUEST_TIMEOUT_S,
                          headers={"Authorization": f"Bearer {KEY}", "X-Request-Id": "req-42"})
        assert resp.status_code == 200
        assert _post(front, chat_body(SERVED, [], "no key"), None).status_code == 401
        lines = [line for line in front.server.log().splitlines() if '"POST /v1/chat/completions HTTP/1.1"' in line]
        assert [line.split('HTTP/1.1" ')[1].split()[0] for line in lines] == ["200", "401"], lines
        assert lines[0].endswith('"req-42"') and lines[1].endswith('"-"'), lines
        assert KEY not in front.server.log()
    finally:
        assert _stop(front) == 0


def test_sigterm_cuts_what_outlasts_the_drain_grace(tmp: Path, encoder: EncoderProcess, backend: FakeVllm) -> None:
    front = start_front(tmp, "proxy-drain-cut", [encoder.target], backend, "--workers", "2", "--drain-grace-s", "1")
    try:
        with _held_request(front, backend) as (answers, sender):  # held until the end: longer than the grace
            front.server.proc.send_signal(signal.SIGTERM)
            # Every worker exits (0) while the backend still holds the request: it was cut, not waited for.
            assert front.server.proc.wait(DRAIN_WAIT_S) == 0, front.server.log()[-3000:]
            sender.join(DRAIN_WAIT_S)
            assert len(answers) == 1 and isinstance(answers[0], httpx.TransportError), answers
            assert backend.holding  # still held: nothing but the grace ended it
    finally:
        front.server.stop()


@contextlib.contextmanager
def _held_request(front: Front, backend: FakeVllm) -> Iterator[tuple[list[httpx.Response | Exception],
                                                                    threading.Thread]]:
    """A chat sent (without a key: the proxy asks none) from a thread and held by ``backend``: yields
    the list its answer or error will go into, and the thread, once the backend has it; at exit the
    backend lets it go and the thread is joined."""
    answers: list[httpx.Response | Exception] = []

    def send() -> None:
        try:
            answers.append(_post(front, chat_body(SERVED, [], "held"), None))
        except Exception as exc:
            answers.append(exc)

    sender = threading.Thread(target=send)
    backend.hold()
    try:
        sender.start()
        assert backend.arrived.wait(DRAIN_WAIT_S), front.server.log()[-3000:]
        yield answers, sender
    finally:
        backend.release()
        sender.join(DRAIN_WAIT_S)


def _wait_not_listening(front: Front, why: str) -> None:
    """Until no connection to the proxy's port is taken, at most :data:`DRAIN_WAIT_S` (else ``why``)."""
    deadline = time.monotonic() + DRAIN_WAIT_S
    while True:
        try:
            socket.create_connection(("127.0.0.1", front.server.port), timeout=2.0).close()
        except OSError:
            return
        assert time.monotonic() < deadline, why
        time.sleep(0.1)


def _stop(front: Front) -> int:
    """SIGTERM to the proxy (the parent, with workers), its exit status."""
    proc = front.server.proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(60.0)
    except subprocess.TimeoutExpired:
        front.server.stop()
        raise
