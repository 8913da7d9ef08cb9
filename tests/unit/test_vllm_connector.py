"""The vLLM connector's scheduler side with a fake client: "available" only with rows in hand,
failures fail the request (never the engine), rows kept while a request needs them; and the
``ec_transfer_params`` codec the proxy and the connector share."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from common.errors import ConfigError, ECLoadFailure, LoadFailureReason
from common.metrics import PrefillMetrics
from common.wire import pb2
from prefill_client.consumer.client import PulledItem
from prefill_client.handoff import Placement
from prefill_client.handoff import from_params, to_params

WIDTH = 192


def _placement(mm_hash: str, rows: int = 4) -> Placement:
    loc = pb2.ItemLocation(mm_hash=mm_hash, block_ids=[3, 4], tokens_per_block=[rows, 0], num_tokens=rows,
                           fingerprint=7, generation=9, lease_id=11, grid_thw=[1, 4, 4])
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


# --- scheduler side --------------------------------------------------------------------------


@dataclass
class FakeClient:
    """Rows for the hashes it knows; ``gate`` holds pulls until set; ``fail`` raises instead."""

    rows: dict[str, int]
    gate: threading.Event = field(default_factory=threading.Event)
    fail: ECLoadFailure | None = None
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


def _side(client: FakeClient) -> Any:
    pytest.importorskip("vllm", reason="the connector module imports vLLM")
    from prefill_client.vllm.connector import _SchedulerPulls

    return _SchedulerPulls(client, WIDTH)  # type: ignore[arg-type]


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
    rows = side.take_to_load()
    assert set(rows) == {"a", "b"} and rows["b"].shape == (6, WIDTH)
    assert side.take_to_load() == {}
    side.finished(req)
    assert not side.has("a") and not side.has("b")
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
