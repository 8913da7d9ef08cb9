"""EncoderPool with fake connections: membership follows the target list, readiness steers new items."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from common.errors import ConfigError
from common.metrics import PrefillMetrics
from prefill_client import pool as pool_module
from prefill_client.pool import EncoderPool
from prefill_client.routing import rendezvous_order

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


class _Unreachable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE


class _Answer:
    """What ``Check.future`` returns: a result, or the error an unreachable encoder gives."""

    def __init__(self, status: int | None) -> None:
        self._status = status

    def result(self) -> health_pb2.HealthCheckResponse:
        if self._status is None:
            raise _Unreachable()
        return health_pb2.HealthCheckResponse(status=self._status)  # type: ignore[arg-type]


class FakeConnection:
    """The two methods of EncoderConnection the pool uses, with the status a test sets."""

    status: dict[str, int | None] = {}

    def __init__(self, target: str) -> None:
        self.target = target
        self.closed = False

    def readiness(self, timeout_s: float) -> _Answer:
        return _Answer(self.status.get(self.target, SERVING))

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def listing(tmp_path: Path) -> Iterator[Path]:
    FakeConnection.status = {}
    path = tmp_path / "encoders"
    path.write_text("# three encoders\nh1:1\nh2:2  # second\n\nh3:3\n")
    yield path


def _pool(listing: Path, metrics: PrefillMetrics | None = None) -> EncoderPool:
    return EncoderPool([f"file:{listing}"], FakeConnection, metrics or PrefillMetrics(),  # type: ignore[arg-type]
                       refresh_interval_s=0)


def _key_preferring(target: str, targets: list[str]) -> str:
    return next(k for k in (f"item-{i}" for i in range(1000)) if rendezvous_order(k, targets)[0] == target)


def test_a_file_lists_the_encoders_and_comments_are_ignored(listing: Path) -> None:
    pool = _pool(listing)
    assert pool.targets == ("h1:1", "h2:2", "h3:3")
    assert all(pool.ready(t) for t in pool.targets)


def test_new_items_skip_encoders_that_are_not_ready(listing: Path) -> None:
    metrics = PrefillMetrics()
    key = _key_preferring("h2:2", ["h1:1", "h2:2", "h3:3"])
    FakeConnection.status = {"h2:2": NOT_SERVING}  # warming up or draining
    pool = _pool(listing, metrics)
    order = pool.order(lambda: key)
    assert order[-1] == "h2:2" and order[:2] == [t for t in rendezvous_order(key, list(pool.targets)) if t != "h2:2"]
    assert metrics.routed_away._value.get() == 1
    assert metrics.encoders_known._value.get() == 3 and metrics.encoders_ready._value.get() == 2
    # Unreachable counts as not ready; back to SERVING, the item goes home again.
    FakeConnection.status = {"h2:2": None}
    pool.refresh()
    assert pool.order(lambda: key)[-1] == "h2:2"
    FakeConnection.status = {}
    pool.refresh()
    assert pool.order(lambda: key)[0] == "h2:2"


def test_a_failed_call_routes_around_until_the_next_probe(listing: Path) -> None:
    pool = _pool(listing)
    key = _key_preferring("h1:1", list(pool.targets))
    pool.report_down("h1:1")
    assert pool.order(lambda: key)[-1] == "h1:1"
    pool.refresh()  # it answers SERVING again
    assert pool.order(lambda: key)[0] == "h1:1"


def test_encoders_join_and_leave_without_a_restart(listing: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pool_module, "RETIRE_GRACE_S", 0.0)
    metrics = PrefillMetrics()
    pool = _pool(listing, metrics)
    h2 = pool.conn("h2:2")
    listing.write_text("h1:1\nh3:3\nh4:4\n")
    pool.refresh()
    assert pool.targets == ("h1:1", "h3:3", "h4:4") and pool.conn("h2:2") is None
    assert h2 is not None and h2.closed  # type: ignore[attr-defined]
    assert pool.ready("h4:4")
    assert metrics.membership_refreshes.labels(result="changed")._value.get() == 1
    pool.refresh()
    assert metrics.membership_refreshes.labels(result="unchanged")._value.get() == 1


def test_a_failed_resolution_keeps_the_last_set(listing: Path) -> None:
    metrics = PrefillMetrics()
    pool = _pool(listing, metrics)
    listing.unlink()
    pool.refresh()
    assert pool.targets == ("h1:1", "h2:2", "h3:3")
    assert metrics.membership_refreshes.labels(result="failed")._value.get() == 1


def test_bad_lists_are_refused_at_start(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n")
    with pytest.raises(ConfigError, match="no encoder targets"):
        EncoderPool([f"file:{empty}"], FakeConnection, PrefillMetrics())  # type: ignore[arg-type]
    nested = tmp_path / "nested"
    nested.write_text(f"file:{empty}\n")
    with pytest.raises(ConfigError, match="names another file"):
        EncoderPool([f"file:{nested}"], FakeConnection, PrefillMetrics())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="cannot read"):
        EncoderPool([f"file:{tmp_path / 'missing'}"], FakeConnection, PrefillMetrics())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="refresh interval"):
        EncoderPool(["h:1"], FakeConnection, PrefillMetrics(), refresh_interval_s=-1)  # type: ignore[arg-type]


def test_the_background_refresh_follows_the_file(listing: Path) -> None:
    pool = EncoderPool([f"file:{listing}"], FakeConnection, PrefillMetrics(),  # type: ignore[arg-type]
                       refresh_interval_s=0.05)
    try:
        listing.write_text("h9:9\n")
        deadline = time.monotonic() + 5
        while pool.targets != ("h9:9",) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pool.targets == ("h9:9",)
        last = pool.conn("h9:9")
    finally:
        pool.close()
    assert last is not None and last.closed  # type: ignore[attr-defined]
    assert pool.targets == ()
