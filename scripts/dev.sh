#!/usr/bin/env bash
# One entry point for a fresh machine (Python 3.9+, a C++ compiler; nvcc optional):
#   bash scripts/dev.sh test   # install everything, build, run the native and Python tests
#   bash scripts/dev.sh demo   # install everything, build, run the demo
#   bash scripts/dev.sh setup  # install everything and build only
# Environment: VENV (default .venv), TORCH_SPEC (default torch==2.14.1), MAX_JOBS (default 2),
# CKPT_OFFLOAD_CUDA=0|1 to force the C++-only or the CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-$PWD/.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.14.1}
export MAX_JOBS=${MAX_JOBS:-2}

setup() {
  if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
  fi
  echo "== installing $TORCH_SPEC and the test dependencies into $VENV (log in pip.log)"
  if ! "$VENV/bin/python" -m pip install --upgrade pip "setuptools>=64" "$TORCH_SPEC" numpy ninja pytest matplotlib tqdm \
      transformers accelerate > pip.log 2>&1; then
    tail -n 40 pip.log
    echo "ckpt_offload: installing the dependencies failed; the full log is in pip.log" >&2
    exit 1
  fi
  echo "== building ckpt_offload (MAX_JOBS=$MAX_JOBS; log in build.log)"
  if ! "$VENV/bin/python" -m pip install --no-build-isolation -v . > build.log 2>&1; then
    tail -n 60 build.log
    echo "ckpt_offload: build failed; the full log is in build.log" >&2
    exit 1
  fi
  # Import from outside the source tree: the installed package, not ./ckpt_offload.
  (cd / && "$VENV/bin/python" -c "import ckpt_offload as co, json; print(json.dumps(co.build_info(), indent=1))")
}

case "${1:-}" in
  setup)
    setup
    ;;
  test)
    setup
    echo "== native tests (C++ core under AddressSanitizer + UndefinedBehaviorSanitizer)"
    bash scripts/native_tests.sh
    echo "== torch-layer sources against torch 2.11.0's and the installed torch's headers (syntax only)"
    PYTHON="$VENV/bin/python" JOBS="$MAX_JOBS" bash scripts/check_torch_headers.sh
    echo "== Python tests"
    # The pytest script (not python -m pytest) keeps ./ off sys.path, so the tests import the
    # installed package.
    "$VENV/bin/pytest" tests -q -ra
    ;;
  demo)
    setup
    (cd / && "$VENV/bin/python" -m ckpt_offload demo "${@:2}")
    ;;
  *)
    echo "usage: bash scripts/dev.sh test|demo|setup" >&2
    exit 2
    ;;
esac
