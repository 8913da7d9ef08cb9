"""The ``epd`` command: one entry point, one subcommand per process role.

Subcommands are dispatched by module path so that this module imports neither
``encoder_server`` nor ``prefill_client`` (they never import each other, and
``common`` imports neither).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import subprocess
import sys
from pathlib import Path

# subcommand -> (module, function, summary). A function takes argv and returns an exit code.
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "encoder": ("encoder_server.cli", "main", "run the encoder service (gRPC + NIXL cache + /metrics)"),
    "prefill": ("prefill_client.reference.cli", "main", "run the reference prefill worker against encoders"),
    "demo": ("encoder_server.demo.cli", "main", "start an encoder and two prefill workers and run a workload"),
    "proxy": ("prefill_client.proxy.cli", "main",
              "run the OpenAI-compatible front: encode media on encoders, forward to vLLM"),
    "vllm": ("prefill_client.vllm.launch", "main", "run vLLM's command line (vllm serve ...), CPU build included"),
    "weights-digest": ("common.weights_digest", "main",
                       "print a checkpoint's vision weights digest (for --weights-digest)"),
    "bench": ("common.cli", "bench_main", "run a script of bench/ (source checkout): epd bench NAME [ARGS]"),
}

BENCH_DIR = Path(__file__).resolve().parents[1] / "bench"


def bench_main(argv: list[str]) -> int:
    """Run ``bench/NAME.py ARGS`` with this interpreter; its last line is its JSON result."""
    scripts = sorted(p.stem for p in BENCH_DIR.glob("[!_]*.py")) if BENCH_DIR.is_dir() else []
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: epd bench NAME [ARGS]\n\nbenchmarks: " + (", ".join(scripts) or
              "none found (they ship with the source checkout, not the wheel)"))
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in scripts:
        print(f"epd bench: unknown benchmark {name!r}; choose from {', '.join(scripts) or 'none'}",
              file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, str(BENCH_DIR / f"{name}.py"), *rest])

EXIT_NOT_AVAILABLE = 3


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="epd", description="Disaggregated encode/prefill encoder cache for vision-language serving.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, _, summary) in SUBCOMMANDS.items():
        sub.add_parser(name, help=summary, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in SUBCOMMANDS:
        parser.error(f"unknown command {command!r}; choose from {', '.join(SUBCOMMANDS)}")
    module_name, func_name, _ = SUBCOMMANDS[command]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        print(f"epd {command}: not available yet in this version", file=sys.stderr)
        return EXIT_NOT_AVAILABLE
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(getattr(module, func_name)(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
