"""The steps in order, each in a process of its own, within the run's budget (device check driver process).

The driver schedules the five steps, gives each its share of the run's budget (its own, less
what the later steps keep), starts each step process (``bench/device_check.py --role ROLE``)
and kills it with its children past its share, rewrites ``device_check.json`` after every
step, and on SIGTERM stops what runs and writes what was measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import torch
from google import protobuf

from bench.device.encoder_step import Encoder, run_encoder
from bench.device.merge import run_merge
from bench.device.pulls import run_pulls
from bench.device.report import describe_error, tail, write_json
from bench.device.shapes import ENTRY, ROOT, STEPS, Shapes
from bench.device.throughput import run_throughput
from bench.device.towers import run_towers
from common.wire import pb2

REPORT = "device_check.json"


class Run:
    def __init__(self, args: argparse.Namespace, shapes: Shapes) -> None:
        self.args, self.shapes = args, shapes
        self.out = Path(args.out).resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix="epd-device-check-"))
        self.checkpoint = self.work / "checkpoint"
        self.checkpoint.mkdir()
        self.started = time.monotonic()
        self.deadline = self.started + args.budget_s
        self.env = dict(os.environ)
        self.env["PYTHONUNBUFFERED"] = "1"
        self.env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
        self.extensions = self.work / "torch_extensions"
        if shapes.device != "cpu":
            # Empty: whatever lands here was built during this run (it must stay empty on a GPU).
            self.env["TORCH_EXTENSIONS_DIR"] = str(self.extensions)
        self.report: dict[str, Any] = {
            "check": "device", "mode": args.mode, "device": shapes.device, "ok": False,
            "budget_s": args.budget_s, "started_unix": round(time.time()),
            "host": {"python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine(),
                     "grpcio": grpc.__version__, "protobuf": protobuf.__version__,
                     "ld_library_path": os.environ.get("LD_LIBRARY_PATH", "")},
            "steps": {name: {"ok": False, "skipped": "not reached"} for name in STEPS},
        }
        self.transport = "nixl" if shapes.device != "cpu" else "auto"
        self.encoder: Encoder | None = None
        self.handshake: pb2.HandshakeResponse | None = None
        self.current: subprocess.Popen[bytes] | None = None  # the step process running now

    def save(self) -> None:
        self.report["seconds"] = round(time.monotonic() - self.started, 1)
        self.report["ok"] = all(step.get("ok") for step in self.report["steps"].values())
        write_json(self.out / REPORT, self.report)

    def budget(self, step: str) -> float:
        """Seconds for ``step``: its own budget, less what the steps after it keep for themselves."""
        after = STEPS[STEPS.index(step) + 1:]
        left = self.deadline - time.monotonic()
        own = self.shapes.budgets[step] * (len(self.shapes.tower_presets) if step == "towers" else 1)
        # Short of time, every step left gets an even share rather than the first nothing.
        share = max(left - sum(self.shapes.reserve[s] for s in after), left / (len(after) + 1))
        return float(max(0.0, min(own, share)))

    def child(self, role: str, timeout_s: float, *extra: str, env: dict[str, str] | None = None,
              log: str | None = None) -> dict[str, Any]:
        """Run ``--role ROLE`` in a process of its own, killed (with its children) at ``timeout_s``.

        Returns what it wrote, plus the error that ended it, if any.
        """
        result = self.work / f"{role}-{time.monotonic_ns()}.json"
        log_path = self.out / (log or f"{role}.log")
        cmd = [sys.executable, str(ENTRY), "--role", role, "--mode", self.args.mode,
               "--result", str(result), "--transport", self.transport, *extra]
        began = time.monotonic()
        timed_out = False
        with open(log_path, "ab") as out:
            proc = self.current = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                                   env=env or self.env, start_new_session=True)
            try:
                proc.wait(max(timeout_s, 1.0))
            except subprocess.TimeoutExpired:
                timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
            self.current = None
        data: dict[str, Any] = json.loads(result.read_text()) if result.is_file() else {"ok": False}
        data["seconds"] = round(time.monotonic() - began, 1)
        data["budget_s"] = round(timeout_s, 1)
        if timed_out:
            data["ok"] = False
            data.setdefault("error", {"type": "Timeout", "message": f"ran past its {timeout_s:.0f} s budget and "
                                      "was killed; what it measured until then is kept",
                                      "traceback": tail(log_path, 1500)})
        elif proc.returncode != 0:
            data["ok"] = False
            data.setdefault("error", {"type": "ChildExit", "message": f"exit status {proc.returncode}",
                                      "traceback": tail(log_path, 1500)})
        return data

    def step(self, name: str, fn: Callable[[float], dict[str, Any]]) -> dict[str, Any]:
        budget = self.budget(name)
        began = time.monotonic()
        print(f"device check: {name} (budget {budget:.0f} s)", flush=True)
        if budget < 5:
            data: dict[str, Any] = {"ok": False, "skipped": "no time left in the run's budget"}
        else:
            try:
                data = fn(budget)
            except Exception as exc:
                data = {"ok": False, "error": describe_error(exc)}
            except BaseException as exc:  # stopped (SIGTERM, Ctrl-C): say so, then stop
                self.report["steps"][name] = {"ok": False, "error": {
                    "type": "Interrupted", "message": f"the run was stopped during this step ({exc!r})"}}
                raise
        data.setdefault("seconds", round(time.monotonic() - began, 1))
        self.report["steps"][name] = data
        self.save()
        state = "ok" if data.get("ok") else f"FAILED: {data.get('error', {}).get('message', data.get('skipped', ''))}"
        print(f"device check: {name} {state} ({data['seconds']} s)", flush=True)
        return data

    def main(self) -> int:
        def stop(signum: int, frame: object) -> None:
            raise SystemExit(128 + signum)  # unwinds through the finally below: nothing is left running

        signal.signal(signal.SIGTERM, stop)
        try:
            self.save()
            self.step("encoder", partial(run_encoder, self))
            self.step("pulls", partial(run_pulls, self))
            if self.encoder is not None:  # its job is done: give the device to the other steps
                self.report["steps"]["encoder"]["exit_status"] = self.encoder.stop()
                self.encoder = None
            self.step("throughput", partial(run_throughput, self))
            self.step("towers", partial(run_towers, self))
            self.step("merge", partial(run_merge, self))
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            if self.current is not None and self.current.poll() is None:
                os.killpg(self.current.pid, signal.SIGKILL)
                self.current.wait(10)
            if self.encoder is not None:
                self.encoder.stop()
            if self.shapes.device != "cpu":
                built = [str(p.relative_to(self.extensions)) for p in self.extensions.rglob("*.so")] \
                    if self.extensions.is_dir() else []
                self.report["native_kernel_built"] = bool(built)
                if built:
                    self.report["native_kernel_files"] = built
            self.save()
            shutil.rmtree(self.work, ignore_errors=True)
        print(json.dumps(self.report, default=str))
        return 0 if self.report["ok"] else 1
