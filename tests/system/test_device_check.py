"""``scripts/device_check.sh --cpu``: the GPU check's every step, with host memory for the GPU's.

The GPU form of the same script runs only on a lent GPU host; this keeps the CPU form (the
same code: encoder process, verified pulls into landing blocks, pull throughput against a bare
NIXL READ and a copy, the towers against transformers, the merge) passing in CI, so the check
is ready whenever a GPU is.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STEPS = ("encoder", "pulls", "throughput", "towers", "merge")


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], dict, Path]:
    out = tmp_path_factory.mktemp("device_check")
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
    env["PYTHON"] = sys.executable
    result = subprocess.run(["bash", str(ROOT / "scripts" / "device_check.sh"), "--cpu", str(out)], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=280)
    report_path = out / "device_check.json"
    assert report_path.is_file(), result.stdout[-4000:] + result.stderr[-4000:]
    return result, json.loads(report_path.read_text()), out


@pytest.mark.slow
def test_every_step_passes_and_the_report_is_written(cpu_run) -> None:
    result, report, out = cpu_run
    failed = {name: step.get("error", step.get("skipped")) for name, step in report["steps"].items()
              if not step.get("ok")}
    assert result.returncode == 0 and not failed, (failed, result.stdout[-3000:])
    assert report["ok"] is True and report["mode"] == "cpu" and tuple(report["steps"]) == STEPS
    assert json.loads(result.stdout.strip().splitlines()[-1]) == report  # the last line is the report
    for log in ("device_check.log", "encoder.log", "pulls.log", "throughput.log"):
        assert (out / log).is_file(), log


@pytest.mark.slow
def test_encoder_registers_its_regions_in_host_memory(cpu_run) -> None:
    step = cpu_run[1]["steps"]["encoder"]
    assert step["buffer_region"]["memory"] == step["stamp_region"]["memory"] == "DRAM"
    assert step["buffer_region"]["count"] == step["layout"]["num_blocks"] == 32
    assert step["buffer_region"]["stride_bytes"] == step["layout"]["bytes_per_block"] > 0
    assert step["transport"] in ("nixl", "mock") and step["exit_status"] == 0
    probe = step["nixl_probe"]
    if step["transport"] == "nixl":
        assert probe["registered"] == "DRAM" and "UCX" in probe["backends"]


@pytest.mark.slow
def test_pulled_rows_equal_the_local_tower(cpu_run) -> None:
    step = cpu_run[1]["steps"]["pulls"]
    rows = step["items"] + step["batched"]["items"]
    assert len(step["items"]) == len(step["batched"]["items"]) == 3  # two images and a video
    assert [r["source"] for r in step["items"]] == ["miss"] * 3
    assert [r["source"] for r in step["batched"]["items"]] == ["hit"] * 3
    for row in rows:
        assert row["bitwise_equal"] and row["max_rel_diff"] == 0.0 and not row["all_zero"], row
        assert row["rows_device"] == "cpu" and row["tokens"] > 0
        assert row["max_rel_diff_vs_embed"] < 1e-2
    assert step["rows_equal"] == "6/6"


@pytest.mark.slow
def test_throughput_compares_the_pull_with_a_bare_read_and_a_copy(cpu_run) -> None:
    step = cpu_run[1]["steps"]["throughput"]
    assert [(r["block_bytes"], r["batch"]) for r in step["results"]] == [(65536, 1), (65536, 4)]
    for row in step["results"]:
        for key in ("verified_gbps", "bare_gbps", "copy_gbps", "verified_over_bare", "verified_over_copy"):
            assert row[key] > 0 and math.isfinite(row[key]), (key, row)
    assert step["memory"] == {"producer_blocks": "DRAM", "producer_stamps": "DRAM", "landing": "DRAM"}


@pytest.mark.slow
def test_towers_and_merge_report_rates_and_errors(cpu_run) -> None:
    steps = cpu_run[1]["steps"]
    tower = steps["towers"]["presets"]["tiny"]
    assert set(tower["tokens_per_s"]) == {"transformers", "serving_eager", "serving_compiled"}
    assert all(v > 0 for v in tower["tokens_per_s"].values())
    assert all(v > 0 for v in tower["ratio_vs_transformers"].values())
    assert all(0 <= d <= tower["limit"] for k, d in tower["max_rel_diff"].items() if k != "transformers")
    merge = steps["merge"]
    assert merge["device"] == "cpu" and merge["copy_ms"] > 0 and merge["compiled_over_copy"] > 0
