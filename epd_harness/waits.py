"""Waiting for a process a test or bench run started to get ready, by following its progress (that run's process).

A fixed limit on a start-up fails whenever the box is busy: encoders loading a vLLM tower,
about 15 s on an idle 2-core box, missed a 60 s limit at load 7-16. So a wait here ends
when the process is ready, and fails when it exits or stalls: nothing progressed for
``stall_s``. Progress is what the process shows from outside:

- its log grew: the encoder logs each warm-up step and bucket graph, vLLM each start-up phase;
- it used CPU time: importing vLLM or torch, loading weights and compiling a bucket graph
  print nothing for tens of seconds (minutes on a loaded box), but a process that works
  uses CPU, and a blocked one (a deadlock, a wait for something that never comes, SIGSTOP)
  uses none.

``limit_s`` still bounds the whole wait, generously, for a process that works forever.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

# Long enough for any blocked-looking moment of a healthy start (a short disk read, a
# child process spawning); a stalled start fails this long after its last sign of work.
STALL_S = 60.0
LOG_TAIL_CHARS = 8000


def log_tail(path: Path, chars: int = LOG_TAIL_CHARS) -> str:
    """The last ``chars`` characters of the log at ``path`` (what a failure message shows)."""
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError as exc:
        return f"(no log: {exc})"


def _stat_fields(pid: str) -> list[str] | None:
    """``/proc/PID/stat`` after the command name (which may hold spaces), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _ticks(fields: list[str]) -> int:
    # utime, stime, cutime, cstime: every thread's time and that of the children it waited for.
    return sum(int(v) for v in fields[11:15])


def cpu_ticks(pid: int, *, group: bool = False) -> int:
    """CPU time used so far (clock ticks) by ``pid``, or by its whole process group (``group``:
    ``pid`` leads one, e.g. a vLLM server with its engine core and workers); 0 where /proc
    cannot tell (the wait then follows the log alone)."""
    if not group:
        fields = _stat_fields(str(pid))
        return 0 if fields is None else _ticks(fields)
    total = 0
    try:
        entries = os.listdir("/proc")
    except OSError:
        return 0
    for entry in entries:
        if entry.isdigit():
            fields = _stat_fields(entry)
            if fields is not None and fields[2] == str(pid):
                total += _ticks(fields)
    return total


def wait_ready(what: str, proc: subprocess.Popen[bytes], log_path: Path, ready: Callable[[], T | None], *,
               limit_s: float, stall_s: float = STALL_S, group: bool = False, poll_s: float = 0.05,
               give_up: Callable[[], object] | None = None) -> T:
    """Poll ``ready`` until it returns a value, and return that.

    Raises ``RuntimeError`` naming ``what``, with the tail of its log, when ``proc`` exits,
    when neither its log nor its CPU time (its process group's with ``group``) moved for
    ``stall_s``, or after ``limit_s`` in all. ``give_up`` (default: kill ``proc``) runs
    before a stall or the limit is reported.
    """
    started = last_progress = time.monotonic()
    seen = (-1, -1)
    while True:
        value = ready()
        if value is not None:
            return value
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before it was ready:\n{log_tail(log_path)}")
        now = time.monotonic()
        try:
            size = log_path.stat().st_size
        except OSError:
            size = 0
        sample = (size, cpu_ticks(proc.pid, group=group))
        if sample != seen:
            seen, last_progress = sample, now
        stalled = now - last_progress > stall_s
        if stalled or now - started > limit_s:
            if give_up is None:
                proc.kill()
                proc.wait(10)
            else:
                give_up()
            reason = (f"stalled: no log output and no CPU time for {stall_s:.0f} s" if stalled
                      else f"still starting after {limit_s:.0f} s")
            raise RuntimeError(f"{what} not ready, {reason} ({now - started:.0f} s after the wait began):\n"
                               f"{log_tail(log_path)}")
        time.sleep(poll_s)
