"""A short run of ``bench/soak.py``: mixed load and faults, no wrong embedding, recovery, bounded memory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.support.json_lines import last_json_object

REPO_ROOT = Path(__file__).resolve().parents[2]
SOAK_SECONDS = 20
MAX_RSS_GROWTH_MB = 150.0


def test_short_soak(tmp_path: Path) -> None:
    cmd = [sys.executable, "bench/soak.py", "--seconds", str(SOAK_SECONDS), "--fault-every-s", "3", "--json"]
    # Its own session: if it ever hangs, its encoder goes down with it (killed by our child's group id).
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        out, err = proc.communicate(timeout=SOAK_SECONDS + 200)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
        raise AssertionError("the soak hung") from None
    assert proc.returncode == 0, f"{out[-2000:]}\n{err[-4000:]}"
    summary = last_json_object(out)
    assert {"requests", "failures", "wrong_embeddings", "rss_start_mb", "rss_end_mb"} <= summary.keys()
    assert summary["wrong_embeddings"] == 0
    assert summary["requests"] > 0 and summary["delivered_items"] > 0
    assert summary["faults"].get("kill") == 1 and summary["encoder_starts"] == 2
    assert summary["delivered_since_restart"] > 0, summary  # the workers came back to the new encoder
    assert summary["hung_workers"] == 0 and summary["crashes"] == []
    assert not [reason for reason in summary["failures"] if reason.startswith(("crash", "garbage"))], summary
    assert summary["rss_end_mb"] - summary["rss_start_mb"] < MAX_RSS_GROWTH_MB, summary
