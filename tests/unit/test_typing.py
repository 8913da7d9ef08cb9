"""``mypy --strict`` over the packages configured in ``pyproject.toml`` ([tool.mypy] packages).

mypy takes most of a minute from a fresh checkout and uses one core, while pytest runs its
tests on one. When the whole suite is collected with this test in it, ``tests/conftest.py``
starts mypy at the end of collection (:func:`start_mypy`, at the lowest CPU priority: it takes
the cycles the tests leave), and this test only waits for its answer. Run alone, it starts
mypy itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import mypy  # noqa: F401 - the test extra installs it; without it this test must fail, not skip
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
MYPY_TIMEOUT_S = 300


@dataclass
class MypyRun:
    proc: subprocess.Popen[bytes]
    out: IO[bytes]  # its stdout and stderr, in a file: no pipe to fill while nobody reads

    def stop(self) -> None:
        """End mypy if it still runs (the suite ended before this test did)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.out.close()


# The run the suite started early (set by tests/conftest.py); None when this test starts its own.
early: MypyRun | None = None


def start_mypy() -> MypyRun:
    """mypy over the configured packages, at nice 19."""
    # The cache lives in the checkout (git-ignored): a second run takes seconds.
    out = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-m", "mypy", "--no-error-summary"], cwd=REPO_ROOT, stdout=out,
                            stderr=subprocess.STDOUT, preexec_fn=lambda: os.nice(19))
    return MypyRun(proc, out)


@pytest.mark.slow
def test_packages_pass_mypy_strict() -> None:
    global early
    run, early = early or start_mypy(), None  # a run answers once
    try:
        returncode = run.proc.wait(timeout=MYPY_TIMEOUT_S)
        run.out.seek(0)
        output = run.out.read().decode(errors="replace")
    finally:
        run.stop()
    assert returncode == 0, f"mypy --strict found errors:\n{output}"
