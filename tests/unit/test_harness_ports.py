"""The fixed ports of test and bench runs: outside the kernel's ephemeral range, each handed out once, free when handed out."""

from __future__ import annotations

import socket

import pytest

from epd_harness import ports
from epd_harness.ports import ephemeral_floor, free_port


def test_ports_are_below_the_ephemeral_range_distinct_and_bindable() -> None:
    floor = ephemeral_floor()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(1024 <= p < floor for p in ports), ports
    for port in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_another_process_listens_on_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as busy, socket.socket() as probe:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        probe.bind(("127.0.0.1", 0))
        spare = probe.getsockname()[1]
        probe.close()
        picks = iter([taken, spare])
        monkeypatch.setattr(ports.random, "randrange", lambda lo, hi: next(picks))
        assert ports.free_port() == spare
