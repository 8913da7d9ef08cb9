"""EncoderPool with fake connections: membership follows the target list, readiness steers new items."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from common.errors import ConfigError, HandshakeError, WeightsMismatchError
from common.metrics import PrefillMetrics
from prefill_client.consumer import pool as pool_module
from prefill_client.consumer.pool import MISSED_PROBES, EncoderPool, after_probe
from prefill_client.consumer.routing import rendezvous_order

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


class _Unreachable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE


class _Late(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED


LATE = -1  # a status that means: no answer by the probe's deadline


class _Answer:
    """What ``Check.future`` returns: a result, or the error an unreachable or late encoder gives."""

    def __init__(self, status: int | None) -> None:
        self._status = status

    def result(self) -> health_pb2.HealthCheckResponse:
        if self._status is None:
            raise _Unreachable()
        if self._status == LATE:
            raise _Late()
        return health_pb2.HealthCheckResponse(status=self._status)  # type: ignore[arg-type]


class FakeConnection:
    """What the pool uses of EncoderConnection, with the status and announced names a test sets."""

    status: dict[str, int | None] = {}
    names: dict[str, str] = {}  # target -> the encoder_id its handshake announces (absent: refused)

    def __init__(self, target: str) -> None:
        self.target = target
        self.closed = False
        self.encoder_id = ""
        self.incarnation_id = ""
        self.handshakes = 0
        self.given_up: list[str] = []  # the reasons give_up_calls was called with

    wrong_weights: set[str] = set()
    other_model: set[str] = set()  # targets that refuse the handshake's model id

    def peer(self) -> None:
        self.handshakes += 1
        if self.target in self.wrong_weights:
            raise WeightsMismatchError(self.target, "b3:expected", "b3:other")
        if self.target in self.other_model:
            raise HandshakeError(f"model_id mismatch: {self.target} serves 'other'")
        if self.target not in self.names:
            raise ConfigError(f"{self.target} refuses the handshake")
        self.encoder_id, self.incarnation_id = self.names[self.target], "inc"

    def recheck(self) -> bool:
        """A handshake again: the encoder comes back as another incarnation."""
        before = self.incarnation_id
        self.peer()
        self.incarnation_id = f"inc-{self.handshakes}"
        return self.incarnation_id != before

    def readiness(self, timeout_s: float) -> _Answer:
        return _Answer(self.status.get(self.target, SERVING))

    def give_up_calls(self, why: str) -> int:
        self.given_up.append(why)
        return 1

    def close(self) -> None:
        self.closed = True


@pytest.fixture(autouse=True)
def _fresh_fakes() -> None:
    """Every test starts from encoders that are ready and answer every handshake."""
    FakeConnection.status, FakeConnection.names, FakeConnection.wrong_weights = {}, {}, set()
    FakeConnection.other_model = set()


@pytest.fixture
def listing(tmp_path: Path) -> Iterator[Path]:
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


def test_one_late_probe_keeps_a_ready_encoder_its_items_two_in_a_row_do_not(listing: Path) -> None:
    key = _key_preferring("h2:2", ["h1:1", "h2:2", "h3:3"])
    pool = _pool(listing)
    FakeConnection.status = {"h2:2": LATE}  # a busy node: the answer comes after the deadline
    pool.refresh()
    assert pool.ready("h2:2") and pool.order(lambda: key)[0] == "h2:2"
    pool.refresh()  # the second in a row
    assert not pool.ready("h2:2") and pool.order(lambda: key)[-1] == "h2:2"
    pool.refresh()
    assert not pool.ready("h2:2")  # not ready stays so until it answers SERVING
    FakeConnection.status = {}
    pool.refresh()
    assert pool.ready("h2:2")
    FakeConnection.status = {"h2:2": LATE}
    pool.refresh()
    FakeConnection.status = {}
    pool.refresh()  # an answer in time starts the count again
    FakeConnection.status = {"h2:2": LATE}
    pool.refresh()
    assert pool.ready("h2:2")
    FakeConnection.status = {"h2:2": None}  # refused: not ready at once
    pool.refresh()
    assert not pool.ready("h2:2")
    pool.report_down("h1:1")  # a failed call's verdict is not undone by a late probe
    FakeConnection.status = {"h1:1": LATE}
    pool.refresh()
    assert not pool.ready("h1:1")


def test_an_encoder_that_stops_answering_loses_its_encodes_in_flight_while_another_is_ready(listing: Path) -> None:
    metrics = PrefillMetrics()
    pool = _pool(listing, metrics)
    h1, h2, h3 = (pool.conn(t) for t in ("h1:1", "h2:2", "h3:3"))
    FakeConnection.status = {"h2:2": LATE}
    pool.refresh()
    assert h2.given_up == []  # type: ignore[union-attr]  # one late answer: a busy node keeps its calls
    pool.refresh()
    assert h2.given_up == [  # type: ignore[union-attr]
        f"encoder h2:2 missed {MISSED_PROBES} readiness checks in a row (0.5 s each); its calls were given up"]
    pool.refresh()
    assert len(h2.given_up) == 1  # type: ignore[union-attr]  # once, when it stops; calls sent since stay
    assert metrics.calls_given_up._value.get() == 1  # what the fake cancelled
    # Draining (NOT_SERVING) finishes what it has; refused, its calls fail by themselves.
    FakeConnection.status = {"h1:1": NOT_SERVING, "h3:3": None}
    pool.refresh()
    assert h1.given_up == [] and h3.given_up == []  # type: ignore[union-attr]
    # With no other encoder ready, a late answer is the only one: nothing is given up.
    FakeConnection.status = {"h1:1": NOT_SERVING, "h2:2": NOT_SERVING}
    pool.refresh()
    FakeConnection.status = {"h1:1": NOT_SERVING, "h2:2": NOT_SERVING, "h3:3": LATE}
    pool.refresh()
    pool.refresh()
    assert not pool.ready("h3:3") and h3.given_up == []  # type: ignore[union-attr]


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


def test_encoders_are_ranked_by_the_name_they_announce(tmp_path: Path) -> None:
    """A restarted encoder on another address (a pod behind a headless Service) keeps its items."""
    FakeConnection.status = {}
    FakeConnection.names = {"10.0.0.1:1": "enc-0", "10.0.0.2:1": "enc-1", "10.0.0.3:1": "enc-2",
                            "10.0.0.9:1": "enc-1"}
    before, after = tmp_path / "before", tmp_path / "after"
    before.write_text("10.0.0.1:1\n10.0.0.2:1\n10.0.0.3:1\n")
    after.write_text("10.0.0.1:1\n10.0.0.9:1\n10.0.0.3:1\n")  # enc-1 came back on another IP
    old, new = (EncoderPool([f"file:{p}"], FakeConnection,  # type: ignore[arg-type]
                            PrefillMetrics(), refresh_interval_s=0) for p in (before, after))
    def moved(first_before: Callable[[str], str], first_after: Callable[[str], str]) -> int:
        renamed = {"10.0.0.2:1": "10.0.0.9:1"}
        keys = [f"item-{i}" for i in range(200)]
        return sum(renamed.get(first_before(k), first_before(k)) != first_after(k) for k in keys)

    assert moved(lambda k: old.order(lambda: k)[0], lambda k: new.order(lambda: k)[0]) == 0
    # Ranked by address instead, about a third of the items would have moved.
    assert moved(lambda k: rendezvous_order(k, list(old.targets))[0],
                 lambda k: rendezvous_order(k, list(new.targets))[0]) > 20


def test_an_encoder_that_refuses_the_handshake_is_ranked_by_address(listing: Path) -> None:
    FakeConnection.names = {"h1:1": "a", "h3:3": "c"}  # h2 refuses
    pool = _pool(listing)
    conns = {t: pool.conn(t) for t in pool.targets}
    assert [c.encoder_id for c in conns.values()] == ["a", "", "c"]  # type: ignore[union-attr]
    key = "x"
    names = {"h1:1": "a", "h3:3": "c"}
    assert pool.order(lambda: key) == rendezvous_order(key, list(pool.targets), names)
    pool.refresh()  # tried again, still refused; the identified ones are not asked again
    assert [c.handshakes for c in conns.values()] == [1, 2, 1]  # type: ignore[union-attr]


def test_a_lone_encoder_is_handshaken_once_it_is_ready() -> None:
    """First contact (handshake, transport connection) happens as the encoder becomes ready, not
    inside the first request, also when it is the only encoder; a pool that only watches
    readiness never handshakes."""
    FakeConnection.names = {"h1:1": "a"}
    FakeConnection.status = {"h1:1": NOT_SERVING}  # warming up
    pool = EncoderPool(["h1:1"], FakeConnection, PrefillMetrics(), refresh_interval_s=0)  # type: ignore[arg-type]
    conn = pool.conn("h1:1")
    assert conn is not None and conn.handshakes == 0  # type: ignore[attr-defined]
    FakeConnection.status = {}
    pool.refresh()
    assert conn.handshakes == 1 and conn.encoder_id == "a"  # type: ignore[attr-defined]
    pool.refresh()  # once per incarnation
    assert conn.handshakes == 1  # type: ignore[attr-defined]
    watch = EncoderPool(["h1:1"], FakeConnection, PrefillMetrics(), refresh_interval_s=0,  # type: ignore[arg-type]
                        identify=False)
    watch.refresh()
    assert watch.conn("h1:1").handshakes == 0  # type: ignore[union-attr]


def test_an_encoder_that_was_lost_is_asked_again_once_ready() -> None:
    """Not ready (restarting, or unreachable) and then ready again: handshaken again at once, so a
    new incarnation is connected before a request finds it; while ready, never again."""
    FakeConnection.names = {"h1:1": "a"}
    pool = EncoderPool(["h1:1"], FakeConnection, PrefillMetrics(), refresh_interval_s=0)  # type: ignore[arg-type]
    conn = pool.conn("h1:1")
    assert conn is not None and conn.handshakes == 1  # type: ignore[attr-defined]
    first = conn.incarnation_id
    FakeConnection.status = {"h1:1": None}  # killed: refuses the connection
    pool.refresh()
    FakeConnection.status = {"h1:1": NOT_SERVING}  # back, warming up
    pool.refresh()
    assert conn.handshakes == 1 and not pool.ready("h1:1")  # type: ignore[attr-defined]
    FakeConnection.status = {}
    pool.refresh()
    assert conn.handshakes == 2 and conn.incarnation_id != first  # type: ignore[attr-defined]
    pool.refresh()
    assert conn.handshakes == 2  # type: ignore[attr-defined]
    # One late answer keeps it ready: not lost, not asked again.
    FakeConnection.status = {"h1:1": LATE}
    pool.refresh()
    FakeConnection.status = {}
    pool.refresh()
    assert conn.handshakes == 2  # type: ignore[attr-defined]


def test_an_encoder_of_another_model_is_not_asked_on_every_refresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refused handshake (model id, layout) waits for a redeploy: the early handshake is tried
    again only after REFUSED_RETRY_S (a call still handshakes itself and reports the error)."""
    FakeConnection.names, FakeConnection.other_model = {"h1:1": "a"}, {"h1:1"}
    pool = EncoderPool(["h1:1"], FakeConnection, PrefillMetrics(), refresh_interval_s=0)  # type: ignore[arg-type]
    conn = pool.conn("h1:1")
    assert conn is not None and conn.handshakes == 1  # type: ignore[attr-defined]
    pool.refresh()
    pool.refresh()
    assert conn.handshakes == 1  # type: ignore[attr-defined]
    assert pool.order(lambda: "x") == ["h1:1"]  # calls still go there, and fail naming both models
    FakeConnection.other_model = set()  # redeployed with the expected model id
    monkeypatch.setattr(pool_module, "REFUSED_RETRY_S", 0.0)
    pool._members["h1:1"].identify_after = 0.0  # noqa: SLF001 - the pause, over
    pool.refresh()
    assert conn.handshakes == 2 and conn.encoder_id == "a"  # type: ignore[attr-defined]


def test_an_encoder_of_other_weights_gets_no_items(listing: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    FakeConnection.names = {"h1:1": "a", "h2:2": "b", "h3:3": "c"}
    FakeConnection.wrong_weights = {"h2:2"}
    metrics = PrefillMetrics()
    pool = _pool(listing, metrics)
    key = next(k for k in (f"item-{i}" for i in range(1000))
               if rendezvous_order(k, list(pool.targets), {"h1:1": "a", "h2:2": "h2:2", "h3:3": "c"})[0] == "h2:2")
    assert pool.order(lambda: key)[-1] == "h2:2"
    assert metrics.encoders_ready._value.get() == 2
    pool.refresh()  # not asked again so soon
    h2 = pool.conn("h2:2")
    assert h2 is not None and h2.handshakes == 1  # type: ignore[attr-defined]
    # Rolled to the expected weights: asked again once the pause is over, then it takes items.
    monkeypatch.setattr(pool_module, "REFUSED_RETRY_S", 0.0)
    FakeConnection.wrong_weights = set()
    pool._members["h2:2"].refused_until = pool._members["h2:2"].identify_after = 0.0  # noqa: SLF001 - the pause, over
    pool.refresh()
    assert h2.encoder_id == "b" and metrics.encoders_ready._value.get() == 3  # type: ignore[attr-defined]


def test_after_probe_an_answer_decides_and_only_a_ready_member_outlasts_late_ones() -> None:
    state = (True, 0)
    state = after_probe(*state, None)
    assert state == (True, 1)  # one late answer: still ready
    assert after_probe(*state, None) == (False, MISSED_PROBES)  # the second in a row: not ready
    assert after_probe(*state, True) == (True, 0)  # an answer in time clears the count
    assert after_probe(*state, False) == (False, 0)  # NOT_SERVING or refused: not ready at once
    assert after_probe(False, 0, None) == (False, 1)  # a late answer never makes a member ready
    assert after_probe(False, 5, True) == (True, 0)
