"""Scrape and lint the ``/metrics`` endpoint of a running `epd` process (test process)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from common import metrics as names

SCRAPE_TIMEOUT_S = 5.0
PROMTOOL_TIMEOUT_S = 30.0
OCCUPANCY = (names.DEVICE_EC_ACTIVE_BLOCKS, names.DEVICE_EC_FREE_BLOCKS, names.DEVICE_EC_HELD_BLOCKS)
# The reference names carry a colon (recording-rule style); promtool warns about each, and
# that one warning is the documented price of keeping the reference names.
COLON_NAMES = frozenset(
    getattr(names, attr) for attr in dir(names)
    if attr.isupper() and isinstance(getattr(names, attr), str) and ":" in getattr(names, attr))


@dataclass(frozen=True, slots=True)
class Scrape:
    """One scrape: the raw text and every sample, keyed ``name{label="v",...}`` (labels sorted)."""

    text: str
    samples: dict[str, float]

    def get(self, name: str, **labels: str) -> float:
        """A sample's value; 0 when the series does not exist yet (a counter never incremented)."""
        return self.samples.get(sample_key(name, labels), 0.0)

    def delta(self, before: Scrape, name: str, **labels: str) -> float:
        return self.get(name, **labels) - before.get(name, **labels)

    def occupancy_sum(self) -> float:
        return sum(self.get(n) for n in OCCUPANCY)


def sample_key(name: str, labels: dict[str, str]) -> str:
    if not labels:
        return name
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def parse(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[sample_key(s.name, dict(s.labels))] = float(s.value)
    return out


def scrape(port: int, host: str = "127.0.0.1") -> Scrape:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=SCRAPE_TIMEOUT_S) as resp:
        text = resp.read().decode()
    return Scrape(text, parse(text))


def promtool_path() -> str | None:
    """promtool on PATH, or the copy scripts/dev.sh unpacks into the venv."""
    return shutil.which("promtool") or shutil.which("promtool", path=str(Path(sys.executable).parent))


def promtool_problems(text: str, promtool: str) -> list[str]:
    """``promtool check metrics`` findings other than the colon-in-name warning of a reference name.

    promtool exits 0 when clean, 3 when it only has lint findings, 1 when the
    text does not parse; anything but the documented warning is returned.
    """
    proc = subprocess.run([promtool, "check", "metrics"], input=text.encode(), capture_output=True,
                          timeout=PROMTOOL_TIMEOUT_S)
    lines = [ln.strip() for ln in (proc.stdout + proc.stderr).decode(errors="replace").splitlines() if ln.strip()]
    problems: list[str] = []
    for line in lines:
        name, _, finding = line.partition(" ")
        base = name.removesuffix("_total")
        if finding == "metric names should not contain ':'" and base in COLON_NAMES:
            continue
        problems.append(line)
    if proc.returncode not in (0, 3) and not problems:
        problems.append(f"promtool exited {proc.returncode} without findings")
    return problems
