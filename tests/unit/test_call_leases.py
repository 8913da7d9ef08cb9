"""CallLeases: what an answered call handed out, given back when its caller gave the call up."""

from __future__ import annotations

import pytest

from encoder_server.call_leases import CallLeases


def test_giving_up_an_answered_call_returns_its_leases_once() -> None:
    calls = CallLeases(30.0)
    assert calls.answered("a", "c1", [1, 2], now=0.0)
    assert calls.answered("a", "c2", [3], now=0.0)
    assert calls.abandon("a", "c1", now=1.0) == [1, 2]
    assert calls.abandon("a", "c1", now=1.0) == []  # now only a mark: nothing is handed out twice
    assert len(calls) == 1


def test_a_consumer_can_give_up_only_its_own_calls() -> None:
    calls = CallLeases(30.0)
    calls.answered("a", "c1", [1], now=0.0)
    assert calls.abandon("b", "c1", now=0.0) == []
    assert calls.abandon("a", "c1", now=0.0) == [1]


def test_an_answer_its_caller_gave_up_on_first_is_refused() -> None:
    calls = CallLeases(30.0)
    assert calls.abandon("a", "late", now=0.0) == []
    assert not calls.answered("a", "late", [7], now=0.5)
    assert len(calls) == 0 and calls.num_abandoned == 0  # the mark is spent
    assert calls.answered("a", "late", [8], now=0.6)  # a later call of that id is answered


def test_leases_released_by_id_leave_their_call() -> None:
    calls = CallLeases(30.0)
    calls.answered("a", "c1", [1, 2], now=0.0)
    calls.released("a", [1, 99])
    calls.released("b", [2])  # not b's to give back: the lease table refuses it, and so does this
    assert calls.abandon("a", "c1", now=0.0) == [2]
    calls.answered("a", "c2", [3], now=0.0)
    calls.released("a", [3])
    assert len(calls) == 0


def test_entries_end_with_their_lease_ttl_and_marks_with_theirs() -> None:
    calls = CallLeases(30.0, abandoned_ttl_s=5.0)
    calls.answered("a", "c1", [1], now=0.0)
    calls.answered("a", "c2", [2], now=20.0)
    calls.abandon("a", "gone", now=0.0)
    assert calls.abandon("a", "c1", now=30.0) == []  # its lease has expired: nothing to give back
    assert calls.abandon("a", "c2", now=30.0) == [2]
    assert calls.answered("a", "gone", [5], now=6.0)  # the mark lapsed


def test_an_id_answered_again_keeps_its_newest_answer_past_the_first_expiry() -> None:
    calls = CallLeases(30.0)
    calls.answered("a", "c", [1], now=0.0)
    calls.answered("a", "c", [2], now=10.0)
    assert calls.abandon("a", "c", now=35.0) == [2]


def test_caps_drop_the_oldest_first() -> None:
    calls = CallLeases(30.0, max_calls=2, max_abandoned=2)
    for i in range(3):
        calls.answered("a", f"c{i}", [i], now=float(i))
    assert len(calls) == 2
    assert calls.abandon("a", "c0", now=3.0) == []  # past the cap: falls back to its lease ttl
    assert calls.abandon("a", "c2", now=3.0) == [2]
    for i in range(3):
        calls.abandon("a", f"m{i}", now=3.0)
    assert calls.num_abandoned == 2
    assert calls.answered("a", "m0", [9], now=3.0)  # its mark was the oldest, dropped


def test_bad_ttl_is_refused() -> None:
    with pytest.raises(ValueError, match="lease ttl"):
        CallLeases(0.0)
