"""Transport parametrization shared by every suite that runs against both agents.

``TRANSPORTS`` runs a test with the mock agent and with real NIXL; the NIXL
case is skipped only where NIXL cannot be imported, and the skip reason says
why (``-ra`` prints it in the summary).
"""

from __future__ import annotations

import pytest

from common.transport import nixl_available

NIXL_OK, NIXL_REASON = nixl_available()

TRANSPORTS = [
    "mock",
    pytest.param(
        "nixl",
        marks=[pytest.mark.nixl, pytest.mark.skipif(not NIXL_OK, reason=f"NIXL not importable: {NIXL_REASON}")],
    ),
]
