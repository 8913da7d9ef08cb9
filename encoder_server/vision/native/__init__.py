"""The CPU frame-attention kernel (``frame_attention.cpp``): when it is used, building and loading it (encoder process).

:func:`encoder_server.vision.model.frame_attention` asks :func:`kernel_for`
for the kernel on every call and runs torch's SDPA where it gets ``None``:
a GPU, a dtype other than float32, a head size the kernel has no variant
for, a CPU without AVX-512, or the ``sdpa`` mode. Both compute the same
attention (``tests/unit/test_native_attention.py`` compares them).

The kernel is C++ built with ``torch.utils.cpp_extension`` (a C++ compiler
and ninja) the first time a process needs it, about 30-60 s, into a
directory keyed by a digest of the source, the flags and the torch version;
later processes load the built library in milliseconds, without a compiler
or write access. Build it ahead of time with ``python -m
encoder_server.vision.native`` (the set-up script and the container image
do). Where it was built is searched in this order: ``--compile-cache-dir``'s
``native/`` (when set), then torch's extension directory
(``TORCH_EXTENSIONS_DIR``, by default under ``~/.cache``); a build goes to the
first.

Modes (``--attention-kernel``): ``auto`` uses the kernel where it applies
and falls back to SDPA, with one warning, when it cannot be built or
loaded; ``native`` makes that failure an error at start-up; ``sdpa`` never
uses it.
"""

from __future__ import annotations

import enum
import hashlib
import importlib.machinery
import importlib.util
import logging
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

from common.errors import ConfigError

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("frame_attention.cpp")
# Only AVX-512F intrinsics: the library runs on any AVX-512 CPU, not only the one that built it.
# -fopenmp: at::parallel_for is OpenMP pragmas inlined into the caller; without it the kernel runs on
# one thread. The library then needs libgomp.so.1, which resolves to the copy torch has loaded already.
CFLAGS = ("-O3", "-mavx512f", "-mfma", "-fopenmp")
LDFLAGS = ("-fopenmp",)
HEAD_DIMS = frozenset({16, 32, 48, 64, 80, 96, 128})  # the kernel's variants (attend_for)


class AttentionKernel(enum.Enum):
    AUTO = "auto"
    NATIVE = "native"
    SDPA = "sdpa"


class _State:
    """The process's choice; set once at start-up (:func:`configure`), read on every attention call."""

    def __init__(self) -> None:
        self.mode = AttentionKernel.AUTO
        self.cache_dir: Path | None = None
        self.module: ModuleType | None = None
        self.tried = False
        self.lock = threading.Lock()


_state = _State()


def configure(mode: AttentionKernel | str = AttentionKernel.AUTO, cache_dir: str | Path | None = None) -> None:
    """Choose the mode and where a build goes first (``--compile-cache-dir``'s ``native/``); forgets a loaded kernel."""
    with _state.lock:
        _state.mode = AttentionKernel(mode)
        _state.cache_dir = Path(cache_dir) / "native" if cache_dir is not None else None
        _state.module = None
        _state.tried = False


def cpu_supported() -> bool:
    """Whether this CPU runs the kernel (AVX-512, as torch's own dispatch detects it)."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX512", "AMX")


def library_name() -> str:
    """The built library's name: changes with the source, the flags and the torch version."""
    digest = hashlib.sha256()
    digest.update(SOURCE.read_bytes())
    digest.update(" ".join(CFLAGS + LDFLAGS).encode())
    digest.update(torch.__version__.encode())
    digest.update(f"py{sys.version_info.major}{sys.version_info.minor}".encode())
    return f"epd_frame_attention_{digest.hexdigest()[:12]}"


def search_dirs() -> list[Path]:
    """Directories a built library is looked for in, in order; a build goes to the first."""
    from torch.utils.cpp_extension import get_default_build_root

    dirs = [_state.cache_dir] if _state.cache_dir is not None else []
    return [*dirs, Path(get_default_build_root()) / "epd"]


def _import(name: str, path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def build(directory: Path | None = None) -> ModuleType:
    """Load the kernel, building it first (into ``directory`` or the first search dir) if no built copy exists.

    Raises :class:`ConfigError` saying why when the CPU lacks AVX-512 or the build fails.
    """
    if not cpu_supported():
        raise ConfigError(
            f"the native attention kernel needs an AVX-512 CPU; torch reports "
            f"{torch.backends.cpu.get_cpu_capability()!r} (use --attention-kernel sdpa or auto)")
    name = library_name()
    for root in ([directory] if directory is not None else search_dirs()):
        built = root / name / f"{name}.so"
        if built.is_file():
            return _import(name, built)
    target = (directory if directory is not None else search_dirs()[0]) / name
    from torch.utils.cpp_extension import load

    started = time.monotonic()
    logger.info("building the native attention kernel into %s (once per torch version; about a minute)", target)
    try:
        target.mkdir(parents=True, exist_ok=True)
        module: ModuleType = load(name=name, sources=[str(SOURCE)], extra_cflags=list(CFLAGS),
                                  extra_ldflags=list(LDFLAGS), build_directory=str(target))
    except (OSError, RuntimeError, ImportError) as exc:
        raise ConfigError(f"cannot build the native attention kernel in {str(target)!r}: {exc}") from exc
    logger.info("native attention kernel built in %.1f s", time.monotonic() - started)
    return module


def prepare() -> ModuleType | None:
    """Load (or build) the kernel now if the mode wants it; at start-up, off the event loop.

    ``native``: a failure raises :class:`ConfigError`. ``auto``: it is logged once and SDPA is used.
    """
    with _state.lock:
        if _state.tried:
            return _state.module
        _state.tried = True
        if _state.mode is AttentionKernel.SDPA:
            return None
        if _state.mode is AttentionKernel.AUTO and not cpu_supported():
            logger.info("attention: torch SDPA (this CPU has no AVX-512 for the native kernel)")
            return None
        try:
            _state.module = build()
        except ConfigError as exc:
            if _state.mode is AttentionKernel.NATIVE:
                raise
            logger.warning("attention: torch SDPA, the native kernel is unavailable: %s", exc)
            return None
        return _state.module


def kernel_for(q: torch.Tensor) -> ModuleType | None:
    """The kernel if it computes attention for ``q [rows, heads, head_dim]``, else ``None`` (use SDPA)."""
    if q.device.type != "cpu" or q.dtype != torch.float32 or q.shape[-1] not in HEAD_DIMS:
        return None
    if not _state.tried:
        prepare()
    return _state.module


def describe(head_dim: int, device: torch.device | str, dtype: torch.dtype) -> str:
    """Which attention a tower with these properties runs, for the start-up log."""
    probe = torch.empty(0, 1, head_dim, device=device, dtype=dtype)
    if kernel_for(probe) is not None:
        return "native CPU kernel"
    return "torch SDPA"


def main() -> int:
    """``python -m encoder_server.vision.native [DIR]``: build the kernel ahead of time; prints where it is."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    directory = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    try:
        module = build(directory)
    except ConfigError as exc:
        print(f"native attention kernel: {exc}", file=sys.stderr)
        return 1
    print(module.__file__)
    return 0
