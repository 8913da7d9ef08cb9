"""``epd_harness.waits.wait_ready``: follows the log and the CPU time; fails on a stall, an exit or its limit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from epd_harness.waits import wait_ready

pytestmark = pytest.mark.slow  # seconds each: the children run through stall bounds

STALL_S = 2.0  # short here: the children below make progress, or none, on purpose
# Written whole (a rename): the wait must never read a ready file half written.
WRITE_READY = "import os\nopen(READY + '.tmp', 'w').write('up')\nos.replace(READY + '.tmp', READY)\n"


def _spawn(tmp_path: Path, script: str) -> tuple[subprocess.Popen[bytes], Path, Path]:
    """Run ``script`` (``READY``: the path it writes to be ready) with its output in a log."""
    ready, log_path = tmp_path / "ready", tmp_path / "child.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-c", f"READY = {str(ready)!r}\n{script}"], stdout=log,
                                stderr=subprocess.STDOUT)
    return proc, ready, log_path


def _wait(proc: subprocess.Popen[bytes], ready: Path, log_path: Path, *, limit_s: float = 60.0) -> str:
    return wait_ready("child", proc, log_path, lambda: ready.read_text() if ready.exists() else None,
                      limit_s=limit_s, stall_s=STALL_S)


def test_a_silent_start_that_uses_cpu_is_not_a_stall(tmp_path: Path) -> None:
    proc, ready, log_path = _spawn(tmp_path, (
        "import time\n"
        f"end = time.monotonic() + {2 * STALL_S}\n"  # two stall bounds of computing, printing nothing
        "while time.monotonic() < end:\n"
        "    pass\n" + WRITE_READY))
    try:
        assert _wait(proc, ready, log_path) == "up"
        assert log_path.read_text() == ""
    finally:
        proc.kill()
        proc.wait(10)


def test_a_start_that_keeps_logging_is_not_a_stall(tmp_path: Path) -> None:
    proc, ready, log_path = _spawn(tmp_path, (
        "import time\n"
        f"for i in range({round(2 * STALL_S / 0.3)}):\n"  # two stall bounds, sleeping (no CPU) between lines
        "    print('step', i, flush=True)\n"
        "    time.sleep(0.3)\n" + WRITE_READY))
    try:
        assert _wait(proc, ready, log_path) == "up"
    finally:
        proc.kill()
        proc.wait(10)


def test_a_blocked_start_fails_as_a_stall_with_the_log_tail_and_is_killed(tmp_path: Path) -> None:
    proc, ready, log_path = _spawn(tmp_path, "import time\nprint('loading', flush=True)\ntime.sleep(600)\n")
    try:
        with pytest.raises(RuntimeError) as failed:
            _wait(proc, ready, log_path)
        message = str(failed.value)
        assert message.startswith("child not ready, stalled: no log output and no CPU time for 2 s"), message
        assert message.endswith("loading\n"), message
        assert proc.poll() is not None
    finally:
        proc.kill()
        proc.wait(10)


def test_an_exit_before_ready_fails_with_its_status_and_log_tail(tmp_path: Path) -> None:
    proc, ready, log_path = _spawn(tmp_path, "import sys\nprint('boom', flush=True)\nsys.exit(3)\n")
    with pytest.raises(RuntimeError, match=r"(?s)^child exited with 3 before it was ready:\nboom\n$"):
        _wait(proc, ready, log_path)


def test_a_start_that_progresses_forever_fails_at_the_limit(tmp_path: Path) -> None:
    proc, ready, log_path = _spawn(tmp_path, (
        "import time\n"
        "while True:\n"
        "    print('still going', flush=True)\n"
        "    time.sleep(0.2)\n"))
    try:
        with pytest.raises(RuntimeError, match=r"^child not ready, still starting after 3 s"):
            _wait(proc, ready, log_path, limit_s=3.0)
        assert proc.poll() is not None
    finally:
        proc.kill()
        proc.wait(10)
