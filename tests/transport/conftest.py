"""Fixtures of the transport suite: which agent every test runs against."""

from __future__ import annotations

import pytest

from tests.transport_params import NIXL_OK, NIXL_REASON, TRANSPORTS


def pytest_report_header(config: pytest.Config) -> str:
    status = f"available ({NIXL_REASON})" if NIXL_OK else f"unavailable, its tests are skipped: {NIXL_REASON}"
    return f"transport: nixl {status}"


@pytest.fixture(scope="module", params=TRANSPORTS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)
