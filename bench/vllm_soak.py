"""Bounded soak through the whole vLLM stack: ``epd proxy`` + vLLM with EpdCacheConnector + encoders.

Starts two ``epd encoder`` processes with a small cache and short leases (so items are evicted
and blocks reused all the time), a consumer ``vllm serve`` whose connector knows both (noise
vision weights: its answers can be right only with the encoders' rows), ``epd proxy`` over both,
and a plain ``vllm serve`` of the real checkpoint as the reference. ``--clients`` threads send
mixed requests (one or two images from a pool that repeats, or a video of three frames, with
one of a few texts) for ``--seconds``, and longer if needed until every fault below has been
injected at least once (then one more ``--fault-every-s`` of traffic after the last; at most
``--seconds`` + 120 s in all); every answered request's greedy tokens are compared with
the plain server's answer to the same request. Every ``--fault-every-s`` one fault, in turn:

- ``kill``: kill -9 an encoder and start it again on the same port;
- ``freeze``: SIGSTOP an encoder for 1.5 s (deadlines), then SIGCONT;
- ``evict``: fill an encoder's cache with new images (the items the proxy placed are evicted);
- ``disconnect``: clients that hang up 50 ms into their request.

Traffic goes through the proxy's front door as a deployment's would: with ``--api-key`` (every
request carries the key; one in ``WRONG_KEY_EVERY`` carries a wrong one and must get 401), over
``--workers 2`` proxy processes on one port, and from tenants of their own ``cache_salt`` (or
none) sending the same images, so salted and unsalted items of one image live side by side.

Reports requests, answers, failures by kind (the README's failure table: what the proxy said),
faults of each kind, wrong answers (must be 0), wrong-key requests and what they got (401 every
one), the proxy's ``/metrics`` for both (its 401s equal the wrong keys sent; its 200s cover the
answers), engine restarts (must be 0: the consumer's engine process is the one it started with,
and it still answers) and each process's RSS (with its children: vLLM's engine, the proxy's
workers) after warm-up and at the end. Exit status 1 on a wrong answer, a dead engine or a
wrong key let in.

    python bench/vllm_soak.py                  # 3 minutes
    python bench/vllm_soak.py --seconds 600    # the 10-minute run of BENCHMARKS.md
    EPD_TEST_VLLM_SOAK_S=... pytest tests/system/test_vllm.py -k soak   # the bounded run in the suite

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import base64
import collections
import json
import os
import random
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from epd_harness.families import noise_vision_copy  # noqa: E402
from epd_harness.media import image_url, video_url  # noqa: E402
from epd_harness.procs import SoakEncoder  # noqa: E402
from epd_harness.qwen3vl import write_qwen3vl_checkpoint  # noqa: E402
from epd_harness.vllm import (  # noqa: E402
    PIL_IMAGE_PROCESSOR,
    Server,
    VllmPair,
    chat_body,
    start_pair,
    start_proxy,
    vllm_missing,
)
from prefill_client.consumer.client import EncoderCacheClient  # noqa: E402
from prefill_client.consumer.connection import MediaSpec  # noqa: E402

MODEL = "tiny-qwen3-vl"
API_KEY = "soak-key"
FAULTS = ("disconnect", "evict", "freeze", "kill")  # the slow one (a restart) last
TEXTS = ("what is this?", "describe it", "and now?")
TENANTS = ("", "tenant-a", "tenant-b")  # cache_salt of each tenant ("": none)
WRONG_KEY_EVERY = 10  # one request of this many carries a wrong API key (when the proxy has one)
# What the proxy says for each failure of the README's table (first match names the kind).
FAILURE_KINDS = (
    ("evicted", "no longer on encoder"), ("encoder_unreachable", "unreachable"),
    ("encoder_unreachable", "cannot reach the encoders"), ("encode_failed", "encoding failed"),
    ("encode_timed_out", "encoding timed out"), ("backend_timed_out", "did not answer within"),
    ("encoder_error", "encoder error"), ("overloaded", "overloaded"),
    ("pull_failed", "still on their encoders"), ("backend_failed", "failed the request"),
    ("no_backend", "no backend reachable"),
)


@dataclass
class Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    requests: int = 0
    answered: int = 0
    wrong: int = 0
    wrong_key: int = 0  # requests sent with a wrong API key
    wrong_key_let_in: int = 0  # ... that got anything but 401
    failures: collections.Counter[str] = field(default_factory=collections.Counter)
    faults: collections.Counter[str] = field(default_factory=collections.Counter)
    examples: dict[str, str] = field(default_factory=dict)
    wrong_examples: list[str] = field(default_factory=list)


def _tokens(resp: httpx.Response) -> list[int]:
    choice = resp.json()["choices"][0]
    return [int(t) for t in choice.get("token_ids") or []] or [
        hash(t["token"]) for t in choice["logprobs"]["content"]]


def _kind(resp: httpx.Response) -> str:
    try:
        message = str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        message = resp.text
    for kind, words in FAILURE_KINDS:
        if words in message:
            return f"{resp.status_code}:{kind}"
    return f"{resp.status_code}:other"


class Reference:
    """The plain server's greedy tokens per request, asked once per distinct request."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._answers: dict[str, list[int]] = {}
        self._lock = threading.Lock()

    def tokens(self, key: str, body: dict[str, Any]) -> list[int]:
        with self._lock:
            if key in self._answers:
                return self._answers[key]
        resp = httpx.post(self.url + "/v1/chat/completions", json=body, timeout=120.0)
        resp.raise_for_status()
        got = _tokens(resp)
        with self._lock:
            self._answers[key] = got
        return got


def _parents() -> dict[int, int]:
    """Every process's parent pid."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    out[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    return out


def rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` and its descendants (vLLM's API server, engine core and workers;
    the proxy's workers), in MiB."""
    parents = _parents()
    tree, grew = {pid}, True
    while grew:
        more = {child for child, parent in parents.items() if parent in tree} - tree
        tree |= more
        grew = bool(more)
    total = 0
    for member in tree:
        try:
            with open(f"/proc/{member}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            continue
    return round(total / 2**20, 1)


def metric_total(text: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples in a Prometheus exposition whose labels include ``labels``."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()))


def engine_pids(pid: int) -> set[int]:
    """The processes of ``pid``'s group: a restarted engine core would show up as a new one."""
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getpgid(int(entry)) == pid:
                    out.add(int(entry))
            except ProcessLookupError:
                continue
    return out


def run_soak(*, proxy_url: str, reference_url: str, consumer: Server, encoders: Sequence[SoakEncoder],
             seconds: float, clients: int = 3, fault_every_s: float = 5.0, seed: int = 0,
             api_key: str | None = None, others: Mapping[str, Server] | None = None,
             log: Callable[[str], None] = lambda line: print(line, file=sys.stderr)) -> dict[str, Any]:
    """The soak against a running stack; returns the report (see the module's docstring).

    ``api_key``: the proxy's key (None: it has none, and no wrong key is tried); ``others``: more
    processes whose RSS the report gives, by name (the proxy, the reference server)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    rng = random.Random(seed)
    images = [image_url(50_000 + i, rng.choice((64, 128, 192)), rng.choice((96, 160, 256))) for i in range(10)]
    videos = [video_url(60_000 + i, 3, 128, 160) for i in range(2)]
    reference = Reference(reference_url)
    tally = Tally()
    stop = threading.Event()  # set by the fault thread: time is up and every fault was injected

    def pick(r: random.Random) -> tuple[str, dict[str, Any]]:
        if r.random() < 0.2:
            media = [r.choice(videos)]
        else:
            media = r.sample(images, r.choice((1, 1, 2)))
        text = r.choice(TEXTS)
        key = json.dumps([[images.index(u) if u in images else -1 - videos.index(u) for u in media], text])
        return key, chat_body(MODEL, media, text, max_tokens=4)

    def send_wrong_key(http: httpx.Client, body: dict[str, Any]) -> None:
        resp = http.post(proxy_url + "/v1/chat/completions", json=body,
                         headers={"Authorization": f"Bearer not-{api_key}"})
        with tally.lock:
            tally.wrong_key += 1
            tally.wrong_key_let_in += resp.status_code != 401

    def client(index: int) -> None:
        r = random.Random(seed * 1000 + index)
        with httpx.Client(timeout=120.0, headers=headers) as http:
            sent = 0
            while not stop.is_set():
                key, body = pick(r)
                want = reference.tokens(key, body)  # the reference knows no tenants: same answer
                sent += 1
                if api_key and sent % WRONG_KEY_EVERY == 0:
                    send_wrong_key(http, body)
                    continue
                salt = r.choice(TENANTS)
                if salt:
                    body = {**body, "cache_salt": salt}
                resp = http.post(proxy_url + "/v1/chat/completions", json=body)
                with tally.lock:
                    tally.requests += 1
                    if resp.status_code == 200:
                        tally.answered += 1
                        if _tokens(resp) != want:
                            tally.wrong += 1
                            tally.wrong_examples.append(key)
                    else:
                        kind = _kind(resp)
                        tally.failures[kind] += 1
                        tally.examples.setdefault(kind, resp.text[:300])

    def hang_up(n: int) -> None:
        for i in range(n):
            body = chat_body(MODEL, [image_url(70_000 + rng.randrange(10**6), 128, 128)], "bye", max_tokens=4)
            try:
                httpx.post(proxy_url + "/v1/chat/completions", json=body, headers=headers, timeout=0.05)
            except httpx.TimeoutException:
                pass

    def inject() -> None:
        # Runs for ``seconds`` and at least one full turn of FAULTS (a slow box must not skip the
        # kill), never past the hard cap; then one more interval of traffic after the last fault.
        start = time.monotonic()
        stop_at, cap = start + seconds, start + seconds + 120.0
        n = 0
        while (time.monotonic() + fault_every_s < stop_at or n < len(FAULTS)) \
                and time.monotonic() + fault_every_s < cap:
            if stop.wait(fault_every_s):
                return
            fault = FAULTS[n % len(FAULTS)]
            # Each turn of FAULTS moves to the next encoder, so that every fault hits every encoder.
            target = encoders[(n + n // len(FAULTS)) % len(encoders)]
            n += 1
            log(f"fault {n}: {fault} ({target.name}) at {time.monotonic() - start:.1f} s")
            if fault == "kill":
                target.kill_and_restart()
            elif fault == "freeze":
                target.freeze(1.5)
            elif fault == "evict":
                with EncoderCacheClient(target.target, MODEL, landing_blocks=16, rpc_timeout_s=5.0) as filler:
                    for i in range(0, 24, 4):
                        filler.encode([MediaSpec.image(base64.b64decode(
                            image_url(80_000 + 100 * n + i + j, 256, 256).split(",", 1)[1])) for j in range(4)])
            else:
                hang_up(3)
            with tally.lock:
                tally.faults[fault] += 1
        time.sleep(max(fault_every_s, stop_at - time.monotonic()))

    def faults() -> None:
        try:
            inject()
        except Exception as exc:  # noqa: BLE001 - reported; the report then lacks that fault
            log(f"fault injection failed: {exc!r}")
        finally:
            stop.set()

    # Warm-up (untimed, unchecked against faults): the reference's answers for every image alone.
    for i, url in enumerate(images[:3]):
        body = chat_body(MODEL, [url], TEXTS[0], max_tokens=4)
        reference.tokens(json.dumps([[i], TEXTS[0]]), body)
        httpx.post(proxy_url + "/v1/chat/completions", json=body, headers=headers, timeout=120.0)

    def processes() -> dict[str, int]:
        named = {"consumer": consumer.proc.pid, **{e.name: e.proc.proc.pid for e in encoders}}
        return {**named, **{name: server.proc.pid for name, server in (others or {}).items()}}

    pids_start = engine_pids(consumer.proc.pid)
    rss_start = {name: rss_mb(pid) for name, pid in processes().items()}
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    threads.append(threading.Thread(target=faults, daemon=True))
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 300)
    stop.set()  # a thread past its join deadline still stops at its next request
    elapsed = time.monotonic() - started
    alive = consumer.alive() and httpx.get(consumer.url + "/health", timeout=10).status_code == 200
    pids_end = engine_pids(consumer.proc.pid)
    rss_end = {name: rss_mb(pid) for name, pid in processes().items()}
    exposition = httpx.get(proxy_url + "/metrics", timeout=10.0).text
    chats = {"route": "/v1/chat/completions"}
    return {
        "seconds": round(elapsed, 1), "clients": clients, "requests": tally.requests, "answered": tally.answered,
        "failures": dict(tally.failures), "faults": dict(tally.faults), "wrong_answers": tally.wrong,
        "wrong_examples": tally.wrong_examples[:5], "failure_examples": tally.examples,
        "engine_alive": alive, "engine_restarts": len(pids_end - pids_start) if alive else 1,
        "wrong_key_sent": tally.wrong_key, "wrong_key_let_in": tally.wrong_key_let_in,
        "proxy_metrics_401": metric_total(exposition, "epd_proxy_requests_total", code="401", **chats),
        "proxy_metrics_200": metric_total(exposition, "epd_proxy_requests_total", code="200", **chats),
        # The consumer's figures by their old names, and every process's (an encoder started
        # again by a kill is a new process: its start figure is its predecessor's).
        "rss_start_mb": rss_start["consumer"], "rss_end_mb": rss_end["consumer"],
        "rss_mb": {name: {"start": rss_start.get(name), "end": rss_end[name]} for name in rss_end},
        "encoder_restarts": sum(e.restarts for e in encoders),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--seconds", type=float, default=180.0)
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--fault-every-s", type=float, default=5.0)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of the consumer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--proxy-workers", type=int, default=2, help="epd proxy --workers")
    args = parser.parse_args()
    reason = vllm_missing()
    if reason:
        raise SystemExit(reason)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        checkpoint = write_qwen3vl_checkpoint(tmp / "checkpoint", seed=7)
        noise = noise_vision_copy(checkpoint, tmp / "noise-vision")
        enc_args = ("--weights", str(checkpoint), "--cache-dtype", "float32", "--model-id", MODEL,
                    "--lease-ttl-ms", "1500", "--cache-blocks", "64")
        encoders = [SoakEncoder.start(tmp, f"encoder-{i}", *enc_args) for i in range(2)]
        targets = [e.target for e in encoders]
        pair: VllmPair | None = None
        proxy = None
        try:
            pair = start_pair(tmp, MODEL, checkpoint, noise, targets, baseline_args=PIL_IMAGE_PROCESSOR,
                              tensor_parallel=args.tp, metrics_port=-1, pull_timeout_s=2.0, rpc_timeout_s=3.0)
            proxy = start_proxy(tmp / "proxy.log", targets, [pair.consumer.url], "--model-id", MODEL,
                                "--rpc-timeout-s", "3", "--encode-timeout-s", "3", "--api-key", API_KEY,
                                "--workers", str(args.proxy_workers))
            report = run_soak(proxy_url=proxy.url, reference_url=pair.baseline.url, consumer=pair.consumer,
                              encoders=encoders, seconds=args.seconds, clients=args.clients,
                              fault_every_s=args.fault_every_s, seed=args.seed, api_key=API_KEY,
                              others={"proxy": proxy, "baseline": pair.baseline})
        finally:
            if proxy is not None:
                proxy.stop()
            if pair is not None:
                pair.stop()
            for e in encoders:
                e.terminate()
    report["tensor_parallel"] = args.tp
    report["proxy_workers"] = args.proxy_workers
    print(json.dumps(report))
    sys.exit(1 if report["wrong_answers"] or not report["engine_alive"] or report["wrong_key_let_in"] else 0)


if __name__ == "__main__":
    main()
