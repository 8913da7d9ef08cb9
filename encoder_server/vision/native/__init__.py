"""The CPU frame-attention kernel (``frame_attention.cpp``): when it is used, building and loading it (encoder process).

:func:`encoder_server.vision.model.frame_attention` asks :func:`kernel_for`
for the kernel on every call and runs torch's SDPA where it gets ``None``:
a GPU, a dtype other than float32, a head size the kernel has no variant
for, a CPU without AVX2 and FMA, or the ``sdpa`` mode. Both compute the same
attention (``tests/unit/test_native_attention.py`` compares them). The same library
holds two element-wise steps of the eager tower: ``gelu_tanh`` (float32,
:func:`elementwise_kernel_for`) and ``rotary_bf16`` (q and k rotated in bfloat16,
:func:`bf16_kernel_for`).

One source, two builds: for AVX-512 CPUs (``-mavx512f``) and for AVX2 ones
(``-mavx2 -mfma``); a process loads the widest its CPU runs, as torch's own
dispatch detects it (:func:`cpu_isa`).

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

from common.config import AttentionKernel
from common.errors import ConfigError

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("frame_attention.cpp")
# -fopenmp: at::parallel_for is OpenMP pragmas inlined into the caller; without it the kernel runs on
# one thread. The library then needs libgomp.so.1, which resolves to the copy torch has loaded already.
CFLAGS = ("-O3", "-fopenmp")
LDFLAGS = ("-fopenmp",)
# Each build's instruction set, no -march: the library runs on any CPU with it, not only the builder's.
ISA_FLAGS: dict[str, tuple[str, ...]] = {"avx512": ("-mavx512f", "-mfma"), "avx2": ("-mavx2", "-mfma")}
# torch's CPU capability -> the builds that run on it, widest first.
_ISAS_FOR_CAPABILITY: dict[str, tuple[str, ...]] = {"AMX": ("avx512", "avx2"), "AVX512": ("avx512", "avx2"),
                                                    "AVX2": ("avx2",)}
# Each build's head sizes (attend_for in the source). The AVX2 build stops at 48: from 64 up torch's
# SDPA was as fast or faster on the development host (BENCHMARKS.md, "An AVX2 build").
HEAD_DIMS: dict[str, frozenset[int]] = {"avx512": frozenset({16, 32, 48, 64, 72, 80, 96, 128}),
                                        "avx2": frozenset({16, 32, 48})}


class _State:
    """The process's choice; set once at start-up (:func:`configure`), read on every attention call."""

    def __init__(self) -> None:
        self.mode = AttentionKernel.AUTO
        self.cache_dir: Path | None = None
        self.module: ModuleType | None = None
        self.head_dims: frozenset[int] = frozenset()  # the loaded build's (HEAD_DIMS)
        self.tried = False
        self.lock = threading.Lock()


_state = _State()


def configure(mode: AttentionKernel | str = AttentionKernel.AUTO, cache_dir: str | Path | None = None) -> None:
    """Choose the mode and where a build goes first (``--compile-cache-dir``'s ``native/``); forgets a loaded kernel."""
    with _state.lock:
        _state.mode = AttentionKernel(mode)
        _state.cache_dir = Path(cache_dir) / "native" if cache_dir is not None else None
        _state.module = None
        _state.head_dims = frozenset()
        _state.tried = False


def cpu_isas() -> tuple[str, ...]:
    """The builds this CPU runs, widest first (torch's capability: AVX2 means AVX2 and FMA); empty if none."""
    return _ISAS_FOR_CAPABILITY.get(torch.backends.cpu.get_cpu_capability(), ())


def cpu_isa() -> str | None:
    """The build this CPU loads: ``avx512``, ``avx2``, or None (no kernel for it)."""
    isas = cpu_isas()
    return isas[0] if isas else None


def cpu_supported() -> bool:
    """Whether this CPU runs the kernel at all."""
    return cpu_isa() is not None


def library_name(isa: str) -> str:
    """The built library's name: changes with the source, the build's flags and the torch version."""
    digest = hashlib.sha256()
    digest.update(SOURCE.read_bytes())
    digest.update(" ".join(CFLAGS + ISA_FLAGS[isa] + LDFLAGS).encode())
    digest.update(torch.__version__.encode())
    digest.update(f"py{sys.version_info.major}{sys.version_info.minor}".encode())
    return f"epd_frame_attention_{isa}_{digest.hexdigest()[:12]}"


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


def build(directory: Path | None = None, isa: str | None = None) -> ModuleType:
    """Load the kernel, building it first (into ``directory`` or the first search dir) if no built copy exists.

    ``isa``: the build (``avx512`` or ``avx2``), by default the widest this CPU runs. Raises
    :class:`ConfigError` saying why when the CPU cannot run it or the build fails.
    """
    capability = torch.backends.cpu.get_cpu_capability()
    if not cpu_supported():
        raise ConfigError(
            f"the native attention kernel needs an x86-64 CPU with AVX2 and FMA or AVX-512; torch reports "
            f"{capability!r} (use --attention-kernel sdpa or auto)")
    isa = isa if isa is not None else cpu_isa()
    if isa not in ISA_FLAGS:
        raise ConfigError(f"no build of the native attention kernel for {isa!r}; there are {sorted(ISA_FLAGS)}")
    if isa not in cpu_isas():
        raise ConfigError(f"this CPU cannot run the {isa} build of the native attention kernel "
                          f"(torch reports {capability!r}; it runs {list(cpu_isas())})")
    name = library_name(isa)
    for root in ([directory] if directory is not None else search_dirs()):
        built = root / name / f"{name}.so"
        if built.is_file():
            return _import(name, built)
    target = (directory if directory is not None else search_dirs()[0]) / name
    from torch.utils.cpp_extension import load

    started = time.monotonic()
    logger.info("building the native attention kernel (%s) into %s (once per torch version; about a minute)",
                isa, target)
    try:
        target.mkdir(parents=True, exist_ok=True)
        module: ModuleType = load(name=name, sources=[str(SOURCE)], extra_cflags=[*CFLAGS, *ISA_FLAGS[isa]],
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
            logger.info("attention: torch SDPA (this CPU has neither AVX2 with FMA nor AVX-512 for the native kernel)")
            return None
        failures: list[str] = []
        # Widest build first; an AVX-512 CPU falls back to the AVX2 build (e.g. the only one an
        # image built on an AVX2 builder holds) before it falls back to SDPA.
        for isa in cpu_isas() or (None,):
            try:
                _state.module = build(isa=isa)
            except ConfigError as exc:
                failures.append(str(exc))
                continue
            _state.head_dims = HEAD_DIMS[_state.module.isa()]
            if failures:
                logger.warning("attention: the %s build of the native kernel, as the wider one is unavailable: %s",
                               isa, failures[0])
            return _state.module
        if _state.mode is AttentionKernel.NATIVE:
            raise ConfigError("; ".join(failures))
        logger.warning("attention: torch SDPA, the native kernel is unavailable: %s", "; ".join(failures))
        return None


def kernel_for(q: torch.Tensor) -> ModuleType | None:
    """The kernel if it computes attention for ``q [rows, heads, head_dim]``, else ``None`` (use SDPA)."""
    if q.device.type != "cpu" or q.dtype != torch.float32:
        return None
    module = _loaded()
    if module is None or q.shape[-1] not in _state.head_dims:
        return None
    return module


def elementwise_kernel_for(x: torch.Tensor) -> ModuleType | None:
    """The kernel if its elementwise functions (``gelu_tanh``) take ``x``, else ``None`` (use torch's).

    Float32 on the CPU, outside autograd: the kernel computes values, no gradients.
    """
    if x.device.type != "cpu" or x.dtype != torch.float32 or (x.requires_grad and torch.is_grad_enabled()):
        return None
    return _loaded()


def bf16_kernel_for(x: torch.Tensor) -> ModuleType | None:
    """The kernel if its bfloat16 functions (``rotary_bf16``) take ``x``, else ``None`` (use torch's).

    Bfloat16 on the CPU, outside autograd and outside a graph being compiled (Inductor fuses the
    same element-wise math there).
    """
    if (x.device.type != "cpu" or x.dtype != torch.bfloat16 or (x.requires_grad and torch.is_grad_enabled())
            or torch.compiler.is_compiling()):
        return None
    return _loaded()


def _loaded() -> ModuleType | None:
    """The process's kernel, loaded (or built) on first use as the mode says."""
    if not _state.tried:
        prepare()
    return _state.module


def describe(head_dim: int, device: torch.device | str, dtype: torch.dtype) -> str:
    """Which attention a tower with these properties runs, for the start-up log."""
    probe = torch.empty(0, 1, head_dim, device=device, dtype=dtype)
    kernel = kernel_for(probe)
    if kernel is not None:
        return f"native CPU kernel ({kernel.isa()})"
    return "torch SDPA"


def main() -> int:
    """``python -m encoder_server.vision.native [DIR]``: build the kernel ahead of time, every build this CPU runs.

    Prints where each is; exit status 1 if any fails.
    """
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    directory = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    isas = cpu_isas() or (None,)  # None: build() says why this CPU has none
    failed = False
    for isa in isas:
        try:
            module = build(directory, isa)
        except ConfigError as exc:
            print(f"native attention kernel: {exc}", file=sys.stderr)
            failed = True
            continue
        print(module.__file__)
    return 1 if failed else 0
