"""Shared pytest configuration."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture
def venv_bin() -> Path:
    """Directory of the running interpreter's scripts (``epd``, ``buf``)."""
    return Path(sys.executable).parent


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start ``mypy --strict`` now when its test is among those collected: it runs beside the
    tests that come first, and its test only waits for it (see tests/unit/test_typing.py)."""
    for item in session.items:
        if item.nodeid.endswith("test_typing.py::test_packages_pass_mypy_strict") and isinstance(item, pytest.Function):
            item.module.early = session.config.stash[_MYPY_RUN] = item.module.start_mypy()


def pytest_sessionfinish(session: pytest.Session) -> None:
    run = session.config.stash.get(_MYPY_RUN, None)
    if run is not None:
        run.stop()  # the test stopped it already, unless the suite ended first


_MYPY_RUN = pytest.StashKey[Any]()
