"""The vLLM connector's scheduler path with a fake client: "available" only with rows in hand,
failures fail the request (never the engine) and are counted once, rows kept while a request
needs them, shipped rows placed on the worker; the failure ladder; the connector's pairs; and
what ``prefill_client.handoff`` shares: the ``ec_transfer_params`` codec the proxy and the
connector read, and the side channel's typed messages."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from common.errors import ConfigError, ECLoadFailure, LoadFailureReason, TransportError
from common.metrics import PrefillMetrics
from common.wire import pb2
from prefill_client.consumer.client import PulledItem
from prefill_client.handoff import (
    Cancel,
    Hello,
    Op,
    Placement,
    PullDone,
    PullFailed,
    PullOrder,
    decode_message,
    encode_message,
    from_params,
    to_params,
)

WIDTH = 192


def _placement(mm_hash: str, rows: int = 4, lease_id: int = 11) -> Placement:
    loc = pb2.ItemLocation(mm_hash=mm_hash, block_ids=[3, 4], tokens_per_block=[rows, 0], num_tokens=rows,
                           fingerprint=7, generation=9, lease_id=lease_id, grid_thw=[1, 4, 4])
    return Placement(mm_hash, "127.0.0.1:50051", "inc-1", loc, "digest", "proxy-7")


def test_params_round_trip() -> None:
    placements = [_placement("a"), _placement("b")]
    params = to_params(placements)
    back = from_params({**params, "other": 1})
    assert list(back) == ["a", "b"]
    assert back["a"].location == placements[0].location and back["a"].incarnation_id == "inc-1"
    assert back["b"].weights_digest == "digest" and back["b"].grid_thw == (1, 4, 4) and back["b"].owner == "proxy-7"
    assert from_params(None) == {} and from_params({"other": 1}) == {}


@pytest.mark.parametrize("items, words", [
    ([], "must be an object"),
    ({"a": 3}, "item 'a' must be an object"),
    ({"a": {"encoder": "e", "incarnation": "i"}}, "lacks 'location'"),
    ({"a": {"encoder": "e", "incarnation": "i", "location": "@@"}}, "bad location"),
])
def test_malformed_params_name_the_entry(items: Any, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        from_params({"epd_cache": {"items": items}})


def test_params_refuse_a_location_of_another_item() -> None:
    params = to_params([_placement("b")])
    params["epd_cache"]["items"]["a"] = params["epd_cache"]["items"].pop("b")
    with pytest.raises(ConfigError, match="carries the location of 'b'"):
        from_params(params)


# --- the side channel's messages -------------------------------------------------------------


def _messages() -> list[Any]:
    return [Hello(3), Cancel("7"),
            PullOrder("7", (_placement("a"), _placement("b", rows=6)), {"a": 4, "b": 6}),
            PullDone("7", 1, ("a", "b"), 2, 4096, 0.25),
            PullFailed("7", 0, LoadFailureReason.TAG_MISMATCH, "EC load failure (tag_mismatch) for mm_hash a")]


def test_side_channel_messages_round_trip_and_are_slotted() -> None:
    for msg in _messages():
        back = decode_message(encode_message(msg))
        assert back == msg and type(back) is type(msg)
        assert not hasattr(msg, "__dict__"), f"{type(msg).__name__} is not slotted"
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(msg, dataclasses.fields(msg)[0].name, "other")
    assert [m.op for m in _messages()] == [Op.HELLO, Op.CANCEL, Op.PULL, Op.DONE, Op.FAILED]
    order = decode_message(encode_message(_messages()[2]))
    assert isinstance(order, PullOrder)
    assert [p.mm_hash for p in order.placements] == ["a", "b"]  # in order
    assert order.placements[1].location == _placement("b", rows=6).location
    assert order.placements[0].owner == "proxy-7" and dict(order.expect) == {"a": 4, "b": 6}


def test_a_pull_order_carries_the_entries_of_ec_transfer_params() -> None:
    # One codec for a placed item, wherever it travels: nobody reaches into the other's output.
    placements = (_placement("a"), _placement("b"))
    wire = json.loads(encode_message(PullOrder("1", placements, {"a": 4, "b": 4})))
    assert wire["items"] == to_params(placements)["epd_cache"]["items"]


@pytest.mark.parametrize("data, words", [
    (b"{not json", "not JSON"),
    (b"[1, 2]", "must be an object, got list"),
    (b'{"op": "launch"}', "unknown op 'launch'"),
    (b'{"rank": 1}', "unknown op None"),
    (b'{"op": "hello"}', "hello message: 'rank' must be int, got None"),
    (b'{"op": "hello", "rank": true}', "'rank' must be int, got True"),
    (b'{"op": "cancel", "job": 7}', "cancel message: 'job' must be str"),
    (b'{"op": "pull", "job": "1", "items": [], "expect": {}}', "pull message: 'items' must be dict"),
    (b'{"op": "pull", "job": "1", "items": {}, "expect": {"a": "4"}}', "expect['a'] must be int"),
    (b'{"op": "pull", "job": "1", "items": {"a": {"encoder": "e", "incarnation": "i"}}, "expect": {}}',
     "side-channel pull order item 'a' lacks 'location'"),
    (b'{"op": "done", "job": "1", "rank": 0, "ok": [1], "pulled": 0, "nbytes": 0, "seconds": 0}',
     "'ok' must be a list of identifiers"),
    (b'{"op": "done", "job": "1", "rank": 0, "ok": [], "pulled": 0, "nbytes": 0}', "'seconds' must be float"),
    (b'{"op": "failed", "job": "1", "rank": 0, "reason": "bad_luck", "why": "x"}', "unknown reason 'bad_luck'"),
])
def test_malformed_messages_name_what_is_wrong(data: bytes, words: str) -> None:
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("(", r"\(")):
        decode_message(data)


def test_a_whole_number_of_seconds_is_a_float() -> None:
    done = decode_message(b'{"op":"done","job":"1","rank":0,"ok":["a"],"pulled":1,"nbytes":8,"seconds":2}')
    assert isinstance(done, PullDone) and done.seconds == 2.0 and isinstance(done.seconds, float)


# --- the failure ladder ----------------------------------------------------------------------


def test_the_failure_ladder() -> None:
    pytest.importorskip("vllm", reason="the connector package imports vLLM")
    from prefill_client.vllm.items import ShapeProblem, failure_of

    evicted = failure_of(ECLoadFailure(LoadFailureReason.EVICTED, "a", detail="gone"), "pull")
    assert (evicted.reason, evicted.counted) == (LoadFailureReason.EVICTED, True)  # the client counted it
    assert evicted.why.startswith("EC load failure (evicted) for mm_hash a")
    shape = failure_of(ShapeProblem("item a was not delivered"), "pull")
    assert (shape.reason, shape.why, shape.counted) == (LoadFailureReason.TOKEN_COUNT, "item a was not delivered", False)
    typed = failure_of(TransportError("peer gone"), "pull")
    assert (typed.reason, typed.why, typed.counted) == (LoadFailureReason.HANDSHAKE, "TransportError: peer gone", False)
    config = failure_of(ConfigError("bad entry"), "pull")
    assert (config.reason, config.why) == (LoadFailureReason.HANDSHAKE, "ConfigError: bad entry")
    bug = failure_of(KeyError("x"), "pull")
    assert (bug.reason, bug.why, bug.counted) == (LoadFailureReason.HANDSHAKE, "KeyError: 'x'", False)


def test_the_connector_picks_a_pair_for_every_pull_side() -> None:
    pytest.importorskip("vllm", reason="the connector module imports vLLM")
    from common.config import PullSide
    from prefill_client.vllm.connector import PAIRS
    from prefill_client.vllm.scheduler import SchedulerPulls, WorkerPulls
    from prefill_client.vllm.worker import ShippedRows, WorkerLoader

    assert set(PAIRS) == set(PullSide)
    assert PAIRS[PullSide.SCHEDULER].scheduler == SchedulerPulls.start
    assert PAIRS[PullSide.SCHEDULER].worker == ShippedRows.start
    assert PAIRS[PullSide.WORKER].scheduler == WorkerPulls.start
    assert PAIRS[PullSide.WORKER].worker == WorkerLoader.start


# --- scheduler side --------------------------------------------------------------------------


@dataclass
class FakeClient:
    """Rows for the hashes it knows; ``gate`` holds pulls until set; ``fail`` raises instead."""

    rows: dict[str, int]
    gate: threading.Event = field(default_factory=threading.Event)
    fail: Exception | None = None
    width: int = WIDTH
    metrics: PrefillMetrics = field(default_factory=PrefillMetrics)
    calls: list[tuple[str, list[str]]] = field(default_factory=list)
    released: list[str] = field(default_factory=list)

    def _item(self, h: str) -> PulledItem:
        return PulledItem(h, torch.full((self.rows[h], self.width), float(len(h))), (1, 2, 2), "enc", "hit")

    def _wait(self) -> None:
        assert self.gate.wait(10)
        if self.fail is not None:
            raise self.fail

    def pull_placed(self, placements: Sequence[Placement]) -> list[PulledItem]:
        self.calls.append(("pull_placed", [p.mm_hash for p in placements]))
        self._wait()
        return [self._item(p.mm_hash) for p in placements]

    def lookup(self, hashes: Sequence[str], *, require: bool = False) -> list[PulledItem | None]:
        self.calls.append(("lookup", list(hashes)))
        self._wait()
        missing = [h for h in hashes if h not in self.rows]
        if missing and require:
            raise ECLoadFailure(LoadFailureReason.EVICTED, missing[0], detail="not on the encoder")
        return [self._item(h) if h in self.rows else None for h in hashes]

    def release_placed(self, placements: Sequence[Placement]) -> None:
        self.released += [p.mm_hash for p in placements]

    def close(self) -> None:
        pass


def _request(rid: str, items: Sequence[tuple[str, int]], params: dict[str, Any] | None = None) -> Any:
    features, offset = [], 5
    for ident, n in items:
        features.append(SimpleNamespace(identifier=ident, mm_position=SimpleNamespace(offset=offset, length=n + 2)))
        offset += n + 3
    return SimpleNamespace(request_id=rid, mm_features=features, ec_transfer_params=params,
                           get_num_encoder_embeds=lambda i: items[i][1])


def _side(client: FakeClient, idle_wait_s: float = 0.0) -> Any:
    pytest.importorskip("vllm", reason="the connector module imports vLLM")
    from prefill_client.vllm.scheduler import SchedulerPulls

    return SchedulerPulls(client, WIDTH, idle_wait_s)  # type: ignore[arg-type]


def _until(check: Any, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.005)
    return False


def test_available_only_once_the_rows_are_pulled() -> None:
    client = FakeClient({"a": 4, "b": 6})
    side = _side(client)
    req = _request("r1", [("a", 4), ("b", 6)], to_params([_placement("a")]))
    assert not side.ensure(req, 0)
    assert not side.has("a") and not side.ensure(req, 0)  # still in flight
    client.gate.set()
    assert _until(lambda: side.ensure(req, 0))
    assert side.has("a") and side.has("b")
    # One batched pull for the placed item, one lookup for the other (it has no placement).
    assert sorted(client.calls) == [("lookup", ["b"]), ("pull_placed", ["a"])]
    side.allocated("a")
    side.allocated("b")
    rows = side.take_step().rows
    assert set(rows) == {"a", "b"} and rows["b"].shape == (6, WIDTH)
    assert side.take_step().rows == {}
    side.finished(req)
    assert not side.has("a") and not side.has("b")
    side.close()


def test_the_scheduler_path_waits_for_its_pull_only_while_the_engine_is_idle() -> None:
    client = FakeClient({"a": 4, "b": 4})
    client.gate.set()
    side = _side(client, idle_wait_s=30.0)
    side.take_step(["text-1"])  # another request runs
    req = _request("r1", [("a", 4)], to_params([_placement("a")]))
    assert not side.ensure(req, 0)
    side.take_step([])  # a step that ran nothing
    assert side.ensure(req, 0) and side.has("a")
    side.take_step(["r1"])
    side.finished(req)  # the engine is idle again
    other = _request("r2", [("b", 4)], to_params([_placement("b", lease_id=12)]))
    assert side.ensure(other, 0), "an idle engine did not wait for the pull"
    side.close()


def test_the_scheduler_path_gives_back_placements_no_pull_took() -> None:
    client = FakeClient({"a": 4})
    client.gate.set()
    side = _side(client)
    r1 = _request("r1", [("a", 4)], to_params([_placement("a", lease_id=1)]))
    assert _until(lambda: side.ensure(r1, 0))
    r2 = _request("r2", [("a", 4)], to_params([_placement("a", lease_id=2)]))
    assert side.ensure(r2, 0)  # in hand already: no pull, its placement unused
    assert client.calls == [("pull_placed", ["a"])]
    side.finished(r1)  # its pull took its placement: nothing more goes back for it
    side.finished(r2)
    assert _until(lambda: client.released == ["a"]), client.released
    time.sleep(0.1)
    assert client.released == ["a"]
    side.close()


def test_rows_stay_while_another_request_needs_them() -> None:
    client = FakeClient({"a": 4})
    client.gate.set()
    side = _side(client)
    r1, r2 = _request("r1", [("a", 4)]), _request("r2", [("a", 4)])
    assert _until(lambda: side.ensure(r1, 0))
    assert side.ensure(r2, 0)  # already in hand: no second pull
    assert len(client.calls) == 1
    side.finished(r1)
    assert side.has("a")
    side.finished(r2)
    assert not side.has("a")
    side.close()


def test_an_item_twice_in_a_request_is_pulled_once() -> None:
    client = FakeClient({"a": 4})
    client.gate.set()
    side = _side(client)
    req = _request("r1", [("a", 4), ("a", 4)], to_params([_placement("a")]))
    assert _until(lambda: side.ensure(req, 0))
    assert client.calls == [("pull_placed", ["a"])]
    side.close()


def test_items_inside_the_prefix_hit_are_not_pulled() -> None:
    client = FakeClient({"a": 4, "b": 4})
    client.gate.set()
    side = _side(client)
    req = _request("r1", [("a", 4), ("b", 4)])  # a at 5..11, b at 12..18
    assert _until(lambda: side.ensure(req, 11))
    assert client.calls == [("lookup", ["b"])]
    side.close()


@pytest.mark.parametrize("reason", [LoadFailureReason.EVICTED, LoadFailureReason.TAG_MISMATCH,
                                    LoadFailureReason.DISCONNECT, LoadFailureReason.TIMEOUT])
def test_a_failed_pull_fails_that_request_once(reason: LoadFailureReason) -> None:
    client = FakeClient({"a": 4}, fail=ECLoadFailure(reason, "a", detail="gone"))
    client.gate.set()
    side = _side(client)
    bad, good = _request("bad", [("a", 4)], to_params([_placement("a")])), _request("good", [])
    assert not side.ensure(bad, 0)
    assert _until(lambda: (side.ensure(bad, 0), "bad" in side._unavailable)[1])
    assert reason.value in side._unavailable["bad"]
    # Reported once, never available afterwards, and the other requests are unaffected.
    assert side.take_unavailable() == {"bad"}
    assert side.take_unavailable() == set()
    assert not side.ensure(bad, 0) and not side.has("a")
    assert side.ensure(good, 0)
    side.finished(bad)
    side.close()


def test_unavailable_is_reported_with_the_request_id() -> None:
    client = FakeClient({}, fail=None)
    client.gate.set()
    side = _side(client)
    req = _request("r9", [("nope", 4)])
    assert not side.ensure(req, 0)
    assert _until(lambda: (side.ensure(req, 0), "r9" in side._unavailable)[1])
    assert side.take_unavailable() == {"r9"}
    side.close()


def test_rows_of_the_wrong_shape_fail_the_request() -> None:
    client = FakeClient({"a": 5, "w": 4}, width=WIDTH)
    client.gate.set()
    side = _side(client)
    short = _request("short", [("a", 4)])  # the prompt expects 4 rows, the encoder has 5
    assert not side.ensure(short, 0)
    assert _until(lambda: (side.ensure(short, 0), "short" in side._unavailable)[1])
    assert "the encoder has (5, 192) rows, the prompt expects 4" in side._unavailable["short"]
    wide = FakeClient({"w": 4}, width=WIDTH // 2)
    wide.gate.set()
    side2 = _side(wide)
    req = _request("wide", [("w", 4)])
    assert not side2.ensure(req, 0)
    assert _until(lambda: (side2.ensure(req, 0), "wide" in side2._unavailable)[1])
    assert "the model expects 192" in side2._unavailable["wide"]
    assert client.metrics.load_failures.labels(reason="token_count")._value.get() == 1
    assert wide.metrics.load_failures.labels(reason="token_count")._value.get() == 1
    side.close()
    side2.close()


def test_a_request_that_ends_before_its_pull_starts_gives_the_leases_back() -> None:
    client = FakeClient({"a": 4, "b": 4})
    side = _side(client)
    busy = [_request(f"busy{i}", [(f"x{i}", 4)]) for i in range(2)]  # both pull threads held on the gate
    client.rows.update({"x0": 4, "x1": 4})
    for r in busy:
        assert not side.ensure(r, 0)
    queued = _request("queued", [("a", 4)], to_params([_placement("a")]))
    assert not side.ensure(queued, 0)
    side.finished(queued)
    assert client.released == ["a"]
    client.gate.set()
    side.close()


def test_bad_params_fail_the_request_not_the_engine() -> None:
    side = _side(FakeClient({"a": 4}))
    req = _request("r1", [("a", 4)], {"epd_cache": {"items": {"a": {"encoder": "e"}}}})
    assert not side.ensure(req, 0)
    assert side.take_unavailable() == {"r1"}
    side.close()


def test_an_unexpected_error_fails_the_request_and_is_counted_as_handshake() -> None:
    client = FakeClient({"a": 4}, fail=RuntimeError("a bug"))
    client.gate.set()
    side = _side(client)
    req = _request("r1", [("a", 4)], to_params([_placement("a")]))
    assert not side.ensure(req, 0)
    assert _until(lambda: (side.ensure(req, 0), "r1" in side._unavailable)[1])
    assert side._unavailable["r1"] == "RuntimeError: a bug"
    assert client.metrics.load_failures.labels(reason="handshake")._value.get() == 1
    assert side.take_unavailable() == {"r1"}
    side.close()


def test_an_ec_load_failure_is_not_counted_twice() -> None:
    # The client counts its own ECLoadFailure when it raises it (this fake does not): the tracker adds nothing.
    client = FakeClient({"a": 4}, fail=ECLoadFailure(LoadFailureReason.EVICTED, "a", detail="gone"))
    client.gate.set()
    side = _side(client)
    req = _request("r1", [("a", 4)], to_params([_placement("a")]))
    assert not side.ensure(req, 0)
    assert _until(lambda: (side.ensure(req, 0), "r1" in side._unavailable)[1])
    assert client.metrics.load_failures.labels(reason="evicted")._value.get() == 0
    side.close()


def test_shipped_rows_are_placed_on_the_worker_in_the_model_dtype() -> None:
    pytest.importorskip("vllm", reason="the connector package imports vLLM")
    from prefill_client.vllm.items import StepOrders
    from prefill_client.vllm.worker import ShippedRows

    half = ShippedRows(torch.float16, torch.device("cpu"))
    kept = torch.zeros(2, WIDTH, dtype=torch.float16)
    cache: dict[str, torch.Tensor] = {"b": kept}
    rows = {"a": torch.full((4, WIDTH), 1.5), "b": torch.ones(2, WIDTH)}
    half.load(StepOrders(rows=rows), cache)
    assert cache["a"].dtype == torch.float16 and torch.equal(cache["a"], torch.full((4, WIDTH), 1.5, dtype=torch.float16))
    assert cache["b"] is kept  # already in the cache: left alone
    half.close()


def test_the_step_metadata_is_the_step_orders() -> None:
    pytest.importorskip("vllm", reason="the connector module imports vLLM")
    from prefill_client.vllm.connector import EpdCacheConnectorMetadata
    from prefill_client.vllm.items import StepOrders

    client = FakeClient({"a": 4})
    client.gate.set()
    side = _side(client)
    req = _request("r1", [("a", 4)], to_params([_placement("a")]))
    assert _until(lambda: side.ensure(req, 0))
    side.allocated("a")
    step = side.take_step()
    meta = EpdCacheConnectorMetadata(place=step.place, drop=step.drop, rows=step.rows)
    assert isinstance(meta, StepOrders) and meta.place == [] and meta.drop == []
    assert torch.equal(meta.rows["a"], torch.full((4, WIDTH), 1.0))
    side.close()
