"""Deadlines for tests: a wait must end by its own deadline, judged without timing the machine.

A shared two-core box can pause any process for hundreds of milliseconds, so a
bound of a tenth of a second after the deadline fails on load, not on a bug.
``ON_TIME_SLACK_S`` still tells a wait that honoured its deadline from one that
fell back to a default (5 s and up here) or hung.
"""

from __future__ import annotations

import time

ON_TIME_SLACK_S = 2.0


def soon(seconds: float = 5.0) -> float:
    """A monotonic deadline ``seconds`` from now."""
    return time.monotonic() + seconds


def assert_ended_by(deadline: float) -> None:
    """The wait that just returned or raised ended at its deadline, not at a later default."""
    late = time.monotonic() - deadline
    assert late < ON_TIME_SLACK_S, f"ended {late:.2f} s after its deadline"
