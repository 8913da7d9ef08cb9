"""Where compiled encoder graphs live on disk, so a restart reuses them (``--compile-cache-dir``).

``torch.compile`` spends most of a cold start generating and compiling kernels.
TorchInductor keeps the results in its FX-graph cache and AOTAutograd cache
(and Triton kernels, on CUDA) under ``TORCHINDUCTOR_CACHE_DIR``, by default a
directory under the temp directory that dies with the container. Pointing it
at a volume makes a restart load the kernels instead of building them again
(``BENCHMARKS.md``, "Encoder start-up"). Dynamo still traces every bucket on
each start; only the kernels come from the cache.

Everything is set through torch's environment variables, without importing
torch (the encoder binds its health port first): the cache directories are
read whenever torch looks for its cache, the switches when torch's config is
imported, and compile worker processes inherit all of them. In a process that
imported torch's compile config already, the switches keep their values (on,
unless someone turned them off).
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

from common.errors import ConfigError

logger = logging.getLogger(__name__)


def use_compile_cache(directory: str) -> Path:
    """Create ``directory`` if needed, check it is writable, and make torch's compile caches use it.

    Raises :class:`ConfigError` naming the path when it cannot be created or written: a
    cache that silently fails would turn every restart back into a cold start.
    """
    path = Path(directory).expanduser().absolute()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise ConfigError(f"--compile-cache-dir {str(path)!r} cannot be created or written: {exc}") from exc
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    os.environ["TRITON_CACHE_DIR"] = str(path / "triton")  # Triton (CUDA) kernels; its default is under $HOME
    # The FX-graph and AOTAutograd caches: on by default in torch 2.13, forced on here because
    # the directory is useless without them.
    os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "1"
    os.environ["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "1"
    logger.info("compiled graphs are cached in %s", path)
    return path
