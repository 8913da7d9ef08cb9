"""Step 5, merge: ``bench/merge.py`` on the device, started and read by the device check driver process.

The in-graph merge, eager and compiled, against a plain copy of the same bytes: the bench runs
as its own process within the step's budget, and its last JSON line is the step's result.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

from bench.device.report import tail
from bench.device.shapes import ROOT

if TYPE_CHECKING:
    from bench.device.driver import Run


def run_merge(run: Run, budget: float) -> dict[str, Any]:
    """The step: ``bench/merge.py --device DEVICE``, killed past ``budget``; ok when its rates are positive."""
    cmd = [sys.executable, str(ROOT / "bench" / "merge.py"), "--device", run.shapes.device, *run.shapes.merge_args]
    log_path = run.out / "merge.log"
    began = time.monotonic()
    with open(log_path, "ab") as log:
        proc = run.current = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=log,
                                              env=run.env, start_new_session=True)
        try:
            stdout, _ = proc.communicate(timeout=max(budget, 1.0))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, _ = proc.communicate()
            return {"ok": False, "error": {"type": "Timeout", "message": f"ran past its {budget:.0f} s budget",
                                           "traceback": tail(log_path, 1500)}}
        finally:
            run.current = None
        log.write(stdout)
    lines = [line for line in stdout.decode(errors="replace").splitlines() if line.startswith("{")]
    data: dict[str, Any] = json.loads(lines[-1]) if lines else {}
    data["command"] = "python bench/merge.py --device " + " ".join([run.shapes.device, *run.shapes.merge_args])
    data["seconds"] = round(time.monotonic() - began, 1)
    if proc.returncode != 0 or not lines:
        data["ok"] = False
        data["error"] = {"type": "ChildExit", "message": f"bench/merge.py exit status {proc.returncode}",
                         "traceback": tail(log_path, 1500)}
        return data
    data["ok"] = data.get("compiled_over_copy", 0) > 0 and data.get("copy_ms", 0) > 0
    return data
