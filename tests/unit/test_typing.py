"""``mypy --strict`` over the packages configured in ``pyproject.toml`` ([tool.mypy] packages)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import mypy  # noqa: F401 - the test extra installs it; without it this test must fail, not skip

REPO_ROOT = Path(__file__).resolve().parents[2]
MYPY_TIMEOUT_S = 300


@pytest.mark.slow
def test_packages_pass_mypy_strict() -> None:
    # The cache lives in the checkout (git-ignored): a second run takes seconds.
    proc = subprocess.run([sys.executable, "-m", "mypy", "--no-error-summary"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=MYPY_TIMEOUT_S)
    assert proc.returncode == 0, f"mypy --strict found errors:\n{proc.stdout}{proc.stderr}"
