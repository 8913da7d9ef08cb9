"""Shared pytest configuration."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture
def venv_bin() -> Path:
    """Directory of the running interpreter's scripts (``epd``, ``buf``)."""
    return Path(sys.executable).parent
