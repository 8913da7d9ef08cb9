"""The client's bounded memory of items: least recently used out first, a read counts as a use."""

from __future__ import annotations

import pytest

from prefill_client.consumer.recent import RecentMap


def test_the_least_recently_used_entry_goes_first_and_a_read_is_a_use() -> None:
    m: RecentMap[str, int] = RecentMap(3)
    m.update([("a", 1), ("b", 2), ("c", 3)])
    assert m.get("a") == 1  # a is now the newest
    m["d"] = 4
    assert "b" not in m and len(m) == 3
    m["c"] = 30  # set again: newest, value replaced
    m["e"] = 5
    assert "a" not in m and m.get("c") == 30 and m.get("d") == 4 and m.get("e") == 5
    assert m.pop("d") == 4 and m.pop("d") is None and len(m) == 2
    assert m.get("missing") is None


def test_it_never_holds_more_than_its_capacity() -> None:
    m: RecentMap[int, int] = RecentMap(100)
    for i in range(10_000):
        m[i] = i
    assert len(m) == 100 and all(i in m for i in range(9_900, 10_000))


def test_a_capacity_below_one_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="capacity must be at least 1, got 0"):
        RecentMap(0)
