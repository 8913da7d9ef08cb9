"""Device check entry, run as its driver process and as every step process: the GPU path in one short run.

Cache in device memory, NIXL reads into device landing blocks, the tower on the GPU.
``scripts/device_check.sh`` runs this on a GPU host (``--mode gpu``, the default) or, with
``--cpu``, on any machine with CPU memory in place of the GPU's and tiny shapes, so the same
code is exercised in CI. Five steps, each in its own process with its own time budget, so a
failing or hanging step (a missing UCX CUDA transport, a compile that runs long) leaves the
later ones to run; each step's result says what failed and why (exception type, message,
traceback tail). One JSON object, ``device_check.json`` in the output folder, is rewritten
after every step (and every measurement inside the long ones), so a run killed at its limit
still leaves what it measured; its last line on stdout is the same object.

1. ``encoder`` (``bench/device/encoder_step.py``): a checkpoint of random weights at a real
   Qwen3-VL tower's dimensions (``bench/encoder.py``'s ``build_checkpoint``; the tiny test
   tower in CPU mode), then ``epd encoder --device cuda --weights CHECKPOINT`` as its own
   process; its handshake answers where the cache buffer and the stamps are registered
   (``VRAM`` / ``DRAM``). A probe agent of the same NIXL build says which plugins and
   backends it has, which memory types UCX takes, and whether a device tensor registers.
2. ``pulls`` (``bench/device/pulls.py``): a second process as consumer:
   ``EncoderCacheClient(landing_device=cuda)`` encodes images and a video one request at a
   time (each a verified pull: blocks, then the stamps, then the checks), then a fresh client
   pulls all of them in one batch by ``Lookup``. Every item's rows, on the GPU, are compared
   with the same tower run locally on the GPU through the same serving path
   (``EncoderRunner``, one item a launch, as the encoder ran it): ``bitwise_equal``,
   ``max_rel_diff``; and with the tower's plain forward (``embed``) as an independent
   reference. ``UCX_PROTO_INFO`` makes UCX print the protocols it chose: ``ucx_protocols`` has
   one line per remote-memory operation (``remote memory read by ucp_get* into cuda memory
   from cuda``) with the transport it takes (``cuda_ipc/cuda``).
3. ``throughput`` (``bench/device/throughput.py``): ``bench/pull_throughput.py``'s measurement
   with the producer's blocks and the landing blocks in device memory: the verified pull
   against a bare NIXL READ of the same blocks and against a device-to-device copy of the same
   bytes (``copy_gbps``, the physical ceiling), 64 KiB - 4 MiB blocks, batches of 1 - 32.
4. ``towers`` (``bench/device/towers.py``): the Qwen3-VL-2B and -8B vision towers (random
   weights, real dimensions) in bfloat16 on the GPU: the serving path, eager and compiled,
   against transformers' tower on the same weights; tokens/s, and each path's largest
   difference from the float32 tower on the same (rounded) weights relative to its largest
   value (``bench/encoder.py``'s rule: ours within twice transformers' own bfloat16 error).
5. ``merge`` (``bench/device/merge.py``): ``bench/merge.py`` on the device: the in-graph
   merge, eager and compiled, against a plain copy of the same bytes.

The encoder's native attention kernel is a CPU kernel: on a GPU the encoder is started with
``--attention-kernel sdpa`` and every process gets an empty ``TORCH_EXTENSIONS_DIR``;
``native_kernel_built`` in the report says whether anything was built there (it must not).

This file parses the arguments, then runs the driver (``bench/device/driver.py``: the steps in
order, budgets, the report) or, with the hidden ``--role ROLE`` the driver passes, one step
process's part.

Usage: ``python bench/device_check.py [--mode gpu|cpu] [--out DIR] [--budget-s 440]``; exit
status 0 when every step is ok, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.device.driver import Run  # noqa: E402
from bench.device.encoder_step import role_prepare  # noqa: E402
from bench.device.pulls import role_pulls  # noqa: E402
from bench.device.report import Partial, describe_error  # noqa: E402
from bench.device.shapes import CPU, GPU, Shapes  # noqa: E402
from bench.device.throughput import role_producer, role_throughput  # noqa: E402
from bench.device.towers import role_tower  # noqa: E402

ROLES: dict[str, Callable[[Partial, Shapes, argparse.Namespace], None]] = {
    "prepare": role_prepare, "pulls": role_pulls, "throughput": role_throughput, "tower": role_tower,
}


def run_role(args: argparse.Namespace, shapes: Shapes) -> int:
    """One step process: its role's part, its result written to ``--result`` whatever ends it."""
    if args.role == "producer":
        role_producer(args)
        return 0
    partial = Partial(Path(args.result))
    try:
        ROLES[args.role](partial, shapes, args)
    except BaseException as exc:
        partial.data["ok"] = False
        partial.data["error"] = describe_error(exc)
        partial.save()
        raise
    partial.save()
    return 0 if partial.data.get("ok") else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The GPU path in one short run: cache in device memory, NIXL reads "
                                                 "into device landing blocks, the tower on the GPU.")
    parser.add_argument("--mode", choices=("gpu", "cpu"), default="gpu",
                        help="gpu: real shapes on cuda; cpu: tiny shapes in host memory (what CI runs)")
    parser.add_argument("--out", default="device_check_out", help="folder for device_check.json and the logs")
    parser.add_argument("--budget-s", type=float, default=440.0, help="the whole run's time, steps included")
    parser.add_argument("--role", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--transport", default="auto", help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    parser.add_argument("--block-size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--preset", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    shapes = GPU if args.mode == "gpu" else CPU
    if args.role is not None:
        return run_role(args, shapes)
    if shapes.device == "cuda" and not torch.cuda.is_available():
        print("device check: no CUDA device here; `--mode cpu` (scripts/device_check.sh --cpu) runs the CPU form",
              file=sys.stderr)
    return Run(args, shapes).main()


if __name__ == "__main__":
    sys.exit(main())
