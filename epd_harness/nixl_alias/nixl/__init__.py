"""``nixl`` as vLLM imports it, over the ``nixl_cu12`` wheel this project installs (vLLM processes only).

vLLM's NixlConnector loads ``nixl._api`` (``nixl_agent``, ``nixl_agent_config``) and
``nixl._bindings`` (``nixlXferTelemetry``). The ``nixl`` meta package that provides them pulls
the CUDA stack; ``nixl_cu12`` holds the same modules under another name. This directory goes
on ``PYTHONPATH`` of the vLLM processes that run NixlConnector (``epd_harness.disagg``), never
on the project's own path: ``common.transport`` finds ``nixl_cu12`` by itself.
"""

import importlib
import sys

import nixl_cu12
from nixl_cu12 import *  # noqa: F401,F403

# Submodules by their vLLM names: ``import nixl._api`` finds them here once this package is imported.
for _name in ("_api", "_bindings"):
    sys.modules[f"{__name__}.{_name}"] = importlib.import_module(f"nixl_cu12.{_name}")
__version__ = getattr(nixl_cu12, "__version__", "")
