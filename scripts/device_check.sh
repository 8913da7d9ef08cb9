#!/usr/bin/env bash
# The GPU path in one short run: cache in device memory, NIXL reads into device landing
# blocks, the tower on the GPU (bench/device_check.py says what each step does and proves).
#
#   bash scripts/device_check.sh [OUT_DIR]         on a GPU host: installs the wheels in .whl/
#                                                  (scripts/device_wheels.sh) into a temporary
#                                                  target, then runs every step on cuda
#   bash scripts/device_check.sh --cpu [OUT_DIR]   anywhere: host memory for the GPU's, tiny
#                                                  shapes, the project's .venv (what CI runs)
#
# OUT_DIR: the first argument, else $OUT, else ./device_check_out. It gets device_check.json
# (rewritten after every step), device_check.log and one log per process. Exit status 0 when
# every step is ok, 1 when one failed.
#
# GPU mode stays within EPD_DEVICE_CHECK_LIMIT_S seconds (470: under the 8 minutes a device run
# may take), installs included; every step has its own share and a step past it is killed, its
# partial results kept. PYTHON chooses the interpreter (GPU: python3; CPU: .venv/bin/python).
# Builds nothing: the encoder's native CPU attention kernel is never built on a GPU.
set -uo pipefail
cd "$(dirname "$0")/.."

mode=gpu
if [[ "${1:-}" == "--cpu" ]]; then
    mode=cpu
    shift
fi
out="${1:-${OUT:-./device_check_out}}"
mkdir -p "$out"
log="$out/device_check.log"
: >"$log"
say() { echo "device_check.sh: $*" | tee -a "$log"; }

if [[ $mode == cpu ]]; then
    py="${PYTHON:-}"
    if [[ -z $py ]]; then
        if [[ -x .venv/bin/python ]]; then py=.venv/bin/python; else py=python3; fi
    fi
    "$py" bench/device_check.py --mode cpu --out "$out" --budget-s "${EPD_DEVICE_CHECK_BUDGET_S:-300}" 2>&1 \
        | tee -a "$log"
    exit "${PIPESTATUS[0]}"
fi

limit=${EPD_DEVICE_CHECK_LIMIT_S:-470}
py="${PYTHON:-python3}"
site=$(mktemp -d -t epd-device-site-XXXXXX)
trap 'rm -rf "$site"' EXIT

# The packages the GPU image lacks, from the carried wheels, without network: --no-deps (their
# dependencies are in the image or among the wheels), into a target that goes first on PYTHONPATH.
if compgen -G ".whl/*.whl" >/dev/null; then
    if "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
        --target "$site" .whl/*.whl >>"$log" 2>&1; then
        say "installed $(ls .whl/*.whl | wc -l) wheels from .whl"
    else
        say "installing the wheels from .whl failed (see above): the steps that need them will say so"
    fi
else
    say "no wheels in .whl: run scripts/device_wheels.sh where PyPI is reachable, and carry .whl"
fi
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"

# UCX's CUDA transports need libcudart.so.13 (and the driver's libcuda.so.1): make the CUDA
# runtime that torch's wheels (or the toolkit) bring loadable by the name UCX asks for.
cudart=$("$py" - <<'EOF'
import glob, os, site
roots = site.getsitepackages() + [site.getusersitepackages()]
found = []
for pattern in [os.path.join(r, "nvidia", "*", "lib", "libcudart.so*") for r in roots] + [
        "/usr/local/cuda/lib64/libcudart.so*", "/usr/local/cuda/targets/x86_64-linux/lib/libcudart.so*"]:
    for lib in sorted(glob.glob(pattern)):
        if os.path.dirname(lib) not in found:
            found.append(os.path.dirname(lib))
print(":".join(found))
EOF
)
if [[ -n $cudart ]]; then
    export LD_LIBRARY_PATH="$cudart${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
say "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
"$py" - >>"$log" 2>&1 <<'EOF'
import importlib.metadata as md
for name in ("torch", "grpcio", "grpcio-health-checking", "grpcio-reflection", "protobuf", "blake3", "nixl-cu13",
             "transformers", "numpy"):
    try:
        print(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name} not installed")
EOF

budget=$((limit - SECONDS - 25))
say "running bench/device_check.py on cuda, budget ${budget} s"
timeout --kill-after=10 $((budget + 15)) "$py" bench/device_check.py --mode gpu --out "$out" --budget-s "$budget" 2>&1 \
    | tee -a "$log"
status=${PIPESTATUS[0]}
if [[ $status -ge 124 ]]; then
    say "bench/device_check.py was stopped at the run's limit (status $status); device_check.json holds what it measured"
fi
exit "$status"
