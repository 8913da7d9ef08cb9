"""Regenerate the committed protobuf/gRPC modules from ``proto/`` (developer tool).

Run ``python -m common.wire.codegen`` after editing a ``.proto`` file. The drift
test calls :func:`generate` into a temporary directory and compares the result
with the committed files, so a stale checkout fails CI.

protoc emits ``from epd.v1 import encoder_cache_pb2`` in the gRPC module, a
bare top-level import; we rewrite it so the modules import as part of this
package.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO_ROOT / "proto"
PROTO_FILES = ("epd/v1/encoder_cache.proto",)
OUT_DIR = Path(__file__).resolve().parent
PACKAGE = "common.wire"

_BARE_IMPORT = re.compile(r"^from epd\.v1 import (\w+) as", re.MULTILINE)


def generated_names() -> list[str]:
    names = []
    for proto in PROTO_FILES:
        stem = Path(proto).stem
        names += [f"{stem}_pb2.py", f"{stem}_pb2.pyi", f"{stem}_pb2_grpc.py"]
    return names


def generate(out_dir: Path) -> list[Path]:
    """Run protoc for every schema and write the rewritten modules to out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as raw:
        cmd = [
            sys.executable, "-m", "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={raw}", f"--pyi_out={raw}", f"--grpc_python_out={raw}",
            *PROTO_FILES,
        ]
        subprocess.run(cmd, check=True, cwd=PROTO_ROOT)
        written = []
        for proto in PROTO_FILES:
            src_dir = Path(raw) / Path(proto).parent
            stem = Path(proto).stem
            for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
                text = (src_dir / f"{stem}{suffix}").read_text()
                text = _BARE_IMPORT.sub(rf"from {PACKAGE} import \1 as", text)
                dest = out_dir / f"{stem}{suffix}"
                dest.write_text(text)
                written.append(dest)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    args = parser.parse_args()
    for path in generate(args.out):
        print(path)


if __name__ == "__main__":
    main()
