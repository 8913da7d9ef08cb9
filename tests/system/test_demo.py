"""``epd demo`` end to end: three processes, a verified report, and cleanup on Ctrl-C."""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

# A reduced workload: one user per worker plays the whole six-turn script; ten
# cache blocks are fewer than its items need, so the encoder must evict.
SMALL = ["--users", "1", "--requests-per-user", "6", "--cache-blocks", "10"]


def test_demo_json_report_is_clean_and_consistent(venv_bin) -> None:
    result = subprocess.run([str(venv_bin / "epd"), "demo", "--json", *SMALL],
                            capture_output=True, text=True, timeout=240)
    out = result.stdout.strip().splitlines()
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.match(r"epd demo: transport (nixl|mock) \(", out[0])
    report = json.loads(out[-1])
    assert report["transport"] in ("nixl", "mock") and report["transport"] in out[0]
    assert report["mismatches"] == 0 and report["load_failures"] == {}
    assert report["requests"] == 12 and report["requests_per_worker"] == [6, 6]
    items = report["items"]
    assert items["total"] == sum(items[k] for k in ("prefix", "local", "encoder-hit", "encoder-miss")) > 0
    # every item was either merged and matched its reference, or came from a verified prefix
    assert report["verified_items"] + report["verified_prefix_items"] == items["total"]
    assert report["verified_prefix_items"] == items["prefix"] > 0
    layers = report["layers"]
    device = layers["device_cache"]
    assert device["queries"] >= device["misses"] > 0 and device["hits"] == device["queries"] - device["misses"]
    assert device["misses"] == items["encoder-miss"]
    assert layers["prefix"]["hits"] > 0 and layers["prefix"]["queries"] >= layers["prefix"]["hits"]
    assert layers["input_processor"]["workers"]["queries"] == items["total"]
    assert layers["input_processor"]["workers"]["hits"] > 0
    assert layers["logical_encoder_cache"]["queries"] == items["total"] - items["prefix"]
    assert report["evictions"] > 0
    assert report["pulls"]["items"] > 0 and report["pulls"]["bytes"] > 0 and report["pulls"]["gb_per_s"] > 0
    assert report["handshakes"].get("ok") == 2
    pad = report["padding"]
    assert 0 <= pad["waste_tokens"] < pad["active_blocks"] * pad["block_size"]
    assert report["ttft"]["miss"]["requests"] > 0 and report["ttft"]["miss"]["p50_ms"] > 0
    assert "[" in result.stderr and "12/12 requests" in result.stderr  # the progress bar


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_ctrl_c_stops_every_process_the_demo_started(venv_bin) -> None:
    proc = subprocess.Popen([str(venv_bin / "epd"), "demo", "--keep-dir", *SMALL],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr], daemon=True)
    reader.start()
    work_dir: Path | None = None
    try:
        deadline = time.monotonic() + 150
        while True:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if m := re.search(r"workload: .* in (\S+);", line):
                work_dir = Path(m.group(1))
            if "prefill workers started" in line:
                break
        assert work_dir is not None
        pids = [json.loads(p.read_text())["pid"] for p in sorted(work_dir.glob("*.ready.json"))]
        assert len(pids) == 3 and all(_alive(p) for p in pids)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 130
        reader.join(10)
        rest = ""
        while not lines.empty():
            rest += lines.get_nowait()
        assert "interrupted; stopping 3 processes" in rest
        assert not any(_alive(p) for p in pids)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if work_dir is not None:
            shutil.rmtree(work_dir, ignore_errors=True)


@pytest.mark.parametrize("flag, value", [("--users", "0"), ("--cache-blocks", "-1")])
def test_bad_flags_are_usage_errors(venv_bin, flag, value) -> None:
    result = subprocess.run([str(venv_bin / "epd"), "demo", flag, value], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and flag in result.stderr
