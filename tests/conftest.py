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
    tests that come first, and its test only waits for it (see tests/unit/test_typing.py). Not
    under xdist: every worker collects every test, and the test runs on one of them."""
    if hasattr(session.config, "workerinput"):
        return
    for item in session.items:
        if item.nodeid.endswith("test_typing.py::test_packages_pass_mypy_strict") and isinstance(item, pytest.Function):
            item.module.early = session.config.stash[_MYPY_RUN] = item.module.start_mypy()


def pytest_sessionfinish(session: pytest.Session) -> None:
    run = session.config.stash.get(_MYPY_RUN, None)
    if run is not None:
        run.stop()  # the test stopped it already, unless the suite ended first


_MYPY_RUN = pytest.StashKey[Any]()


# Under pytest-xdist (``scripts/dev.sh test`` runs ``-n 2``) each module runs whole on one worker, so its
# module fixtures start once. The modules that start several vLLM engines run one after another, first,
# on one worker, while the other worker takes the rest of the suite, much of which waits on processes (a
# core stays idle beside it). Those that race clients against deadlines (a tiny cache, leases of a
# millisecond) run one after another, last. (xdist's own ``loadgroup`` cannot group here: it renames
# the tests, which this pytest no longer allows. A scheduler of ours groups instead.)
ENGINE_MODULES = frozenset({"tests/system/test_epd_disagg.py", "tests/system/test_proxy_routing.py",
                            "tests/system/test_vllm.py", "tests/system/test_vllm_families.py"})
RACE_DIR = "tests/reliability/"
GROUP_ORDER = {"engines": 0, "races": 2}  # every other module: 1


def worker_group(nodeid: str) -> str:
    """Which tests run together, in order, on one worker: ``nodeid``'s module, or its module's group."""
    module = nodeid.split("::", 1)[0]
    if module in ENGINE_MODULES:
        return "engines"
    if module.startswith(RACE_DIR):
        return "races"
    return module


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under xdist, the engines' modules first and the races' last (a stable sort: every module
    keeps its place among its own); each worker collects, and the scheduler deals in this order."""
    if hasattr(config, "workerinput"):
        items.sort(key=lambda item: GROUP_ORDER.get(worker_group(item.nodeid), 1))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Each group (:func:`worker_group`) goes whole to one worker, in collection order."""
    from xdist.scheduler import LoadScopeScheduling  # type: ignore[import-untyped]

    class ByGroup(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid)

    config.option.loadscopereorder = False  # the order above, not the largest group first
    return ByGroup(config, log)
