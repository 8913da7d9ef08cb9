"""Helpers of the reliability suite: ports, process freezing, metrics scrapes, health, occupancy."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common import metrics
from epd_harness.procs import EncoderProcess, start_encoder
from tests.support.scrape import scrape as shared_scrape

MODEL = "tiny-qwen3-vl"
SERVING = health_pb2.HealthCheckResponse.SERVING
_BACKGROUND = ThreadPoolExecutor(4, thread_name_prefix="start-encoder")


def start_encoder_soon(tmp_path: Path, *args: str, env: dict[str, str] | None = None,
                       name: str = "encoder") -> Future[EncoderProcess]:
    """Start an encoder in the background (start-up takes seconds); ``.result()`` waits for SERVING."""
    return _BACKGROUND.submit(start_encoder, tmp_path, *args, env=env, name=name)


def process_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def freeze(pid: int, timeout_s: float = 5.0) -> None:
    """SIGSTOP ``pid`` and wait until the kernel shows it stopped."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while process_state(pid) not in ("T", "t"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} did not stop")
        time.sleep(0.002)


def thaw(pid: int) -> None:
    os.kill(pid, signal.SIGCONT)


def scrape(enc: EncoderProcess) -> dict[str, float]:
    """Samples of the encoder's /metrics (labelled ones keyed ``name{k="v"}``)."""
    return shared_scrape(enc.metrics_port).samples


def occupancy(enc: EncoderProcess) -> tuple[int, int, int, int]:
    """``(active, free, held, leases)`` from the encoder's gauges."""
    v = scrape(enc)
    return (int(v[metrics.DEVICE_EC_ACTIVE_BLOCKS]), int(v[metrics.DEVICE_EC_FREE_BLOCKS]),
            int(v[metrics.DEVICE_EC_HELD_BLOCKS]), int(v[metrics.EPD_LEASES_ACTIVE]))


def health(target: str, service: str = "") -> int:
    with grpc.insecure_channel(target) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5).status


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.02) -> float:
    """Poll ``predicate`` until true; returns the seconds it took, fails the test after ``timeout_s``."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(interval_s)
    return time.monotonic() - started
