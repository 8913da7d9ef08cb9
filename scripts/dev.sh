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
    "$VENV/bin/python" -m pip install --quiet -e ".[nixl,test]"
    install_promtool
    build_native
    echo "$want" > "$STAMP"
}

# The encoder's native attention kernel is built on first use (about a minute); building it here
# keeps that minute out of the tests. It needs an AVX-512 CPU and a C++ compiler: without them the
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
