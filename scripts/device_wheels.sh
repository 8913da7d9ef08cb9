#!/usr/bin/env bash
# Download the wheels scripts/device_check.sh installs on a GPU host that has no network:
# what the project imports there and the GPU image lacks, for its CPython 3.12 (manylinux
# x86-64), into .whl/ (ignored by git), then check that they and the source tree fit in what
# a device run carries (64 MiB).
#
#   bash scripts/device_wheels.sh
#
# The GPU image has torch (CUDA 13), numpy, pillow, safetensors, transformers, aiohttp,
# prometheus-client, ninja and an unknown grpcio / protobuf. Carried:
#   nixl-cu13                    NIXL + UCX for CUDA 13 (the image has no NIXL). Its wheel also
#                                holds nixl_ep_cu13, an expert-parallel add-on built for other torch
#                                releases that nothing here imports: it is removed from the wheel
#                                (28 MB of 59), so that grpcio fits beside it.
#   blake3                       content digests (mm_hash)
#   grpcio, grpcio-health-checking, grpcio-reflection
#                                at one version: the generated stubs need grpcio >= 1.85.1, and the
#                                image's grpcio may be older, so ours goes first on PYTHONPATH
#   protobuf                     the generated stubs need protobuf >= 7.35.1
# Each is installed with --no-deps: their own dependencies are among these or in the image
# (torch and numpy for nixl-cu13, typing-extensions for grpcio).
# Versions: the development venv's (override with EPD_DEVICE_WHEELS="name==version ...").
set -euo pipefail
cd "$(dirname "$0")/.."

limit=$((64 << 20))
dest=.whl
wheels=(${EPD_DEVICE_WHEELS:-nixl-cu13==1.5.1 blake3==1.0.11 grpcio==1.85.4 grpcio-health-checking==1.85.1
    grpcio-reflection==1.85.1 protobuf==7.36.2})
py="${PYTHON:-}"
if [[ -z $py ]]; then
    if [[ -x .venv/bin/python ]]; then py=.venv/bin/python; else py=python3; fi
fi

rm -rf "$dest"
mkdir -p "$dest"
"$py" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: -d "$dest" \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any \
    "${wheels[@]}"

# nixl-cu13 without nixl_ep_cu13/ (and its command-line tools), its RECORD rewritten to match.
"$py" - "$dest" <<'EOF'
import glob, os, sys, zipfile
for wheel in glob.glob(os.path.join(sys.argv[1], "nixl_cu13-*.whl")):
    drop = ("nixl_ep_cu13/", "nixl_cu13.scripts/")
    trimmed = wheel + ".trimmed"
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(trimmed, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if info.filename.startswith(drop):
                continue
            data = src.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(line for line in lines if not line.startswith(drop)).encode()
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    before, after = os.path.getsize(wheel), os.path.getsize(trimmed)
    os.replace(trimmed, wheel)
    print(f"{os.path.basename(wheel)}: removed {', '.join(drop)} ({before / 2**20:.1f} -> {after / 2**20:.1f} MiB)")
EOF

echo "wheels in $dest:"
wheel_bytes=0
for f in "$dest"/*.whl; do
    size=$(stat -c %s "$f")
    wheel_bytes=$((wheel_bytes + size))
    awk -v s="$size" -v n="$(basename "$f")" 'BEGIN {printf "  %8.2f MiB  %s\n", s / 1048576, n}'
done
# What a device run carries besides the wheels: tracked files and untracked ones git does not ignore.
tree_bytes=$(git ls-files -z --cached --others --exclude-standard | "$py" -c '
import os, sys
paths = {p for p in sys.stdin.buffer.read().decode().split("\0") if p}
print(sum(os.path.getsize(p) for p in paths if os.path.isfile(p) and not os.path.islink(p)))')
total=$((wheel_bytes + tree_bytes))
mib() { echo "$1" | awk '{printf "%.2f MiB", $1 / 1048576}'; }
echo "wheels: $(mib $wheel_bytes); source tree: $(mib $tree_bytes); together: $(mib $total) of $(mib $limit)"
if ((total > limit)); then
    echo "device_wheels.sh: the source tree and the wheels are over the $(mib $limit) a device run carries" >&2
    exit 1
fi
