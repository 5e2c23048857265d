#!/usr/bin/env bash
# One entry point for a fresh machine (Python 3.11, the version CI runs; a C++ compiler; nvcc optional):
#   bash scripts/dev.sh test   # install everything, build, native tests (ASan+UBSan), Python tests
#   bash scripts/dev.sh ci     # `test`, the hot path's ratios beside the committed ones (printed,
#                              # never asserted), then the release checks: lint, native tests under TSan,
#                              # the torch 2.11 header check, the sdist check (CI runs this: .ci/run)
#   bash scripts/dev.sh demo   # install everything, build, run the demo
#   bash scripts/dev.sh setup  # install everything and build only
# Environment: VENV (default .venv), TORCH_SPEC (default torch==2.14.1; a pip requirement, e.g. a
# CPU-only torch, which installs faster and takes far less disk), MAX_JOBS (default 2),
# CKPT_OFFLOAD_CUDA=0|1 to force the C++-only or the CUDA build (default: CUDA when nvcc, a CUDA
# torch and a usable GPU are there, C++-only otherwise), PYTEST_ARGS (extra pytest arguments,
# e.g. "-x" or "-k hf"), HEARTBEAT_S (default 15: seconds between the progress lines of a build).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-$PWD/.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.14.1}
export MAX_JOBS=${MAX_JOBS:-2}

# Runs "$@" with its output in LOG, and every HEARTBEAT_S seconds (default 15) prints one line of
# where it is: the elapsed time, the compiler steps done out of all (ninja's [n/m]) and the file
# being compiled, or else the log's last line. On failure, the log's tail.
with_progress() {
  local log=$1 tail_lines=$2
  shift 2
  local start=$SECONDS beat=${HEARTBEAT_S:-15} pid rc=0 n=0
  "$@" > "$log" 2>&1 &
  pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    sleep 1
    n=$((n + 1))
    if [ $((n % beat)) -eq 0 ] && kill -0 "$pid" 2>/dev/null; then
      local el=$((SECONDS - start)) where step src
      step=$(grep -o '^\[[0-9]*/[0-9]*\]' "$log" 2>/dev/null | tail -n 1 || true)
      if [ -n "$step" ]; then
        src=$(grep '^\[[0-9]*/[0-9]*\]' "$log" | tail -n 1 | grep -oE '[^ ]+\.(cpp|cu)( |$)' | head -n 1 | tr -d ' ' || true)
        where="compiler step ${step//[\[\]]/}: ${src#"$PWD/"}"
      else
        where=$(grep -v '^\s*$' "$log" 2>/dev/null | tail -n 1 | cut -c 1-100 || true)
      fi
      printf '   %dm%02ds  %s\n' $((el / 60)) $((el % 60)) "$where"
    fi
  done
  wait "$pid" || rc=$?
  if [ "$rc" -ne 0 ]; then
    tail -n "$tail_lines" "$log"
  fi
  echo "   ($((SECONDS - start)) s)"
  return "$rc"
}

setup() {
  if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
  fi
  echo "== installing $TORCH_SPEC and the test dependencies into $VENV (log in pip.log)"
  # deepspeed (an sdist) and trl serve tests/integrations/test_deepspeed.py and the SFTTrainer test, which skip
  # without them; DS_BUILD_OPS=0 builds none of DeepSpeed's C++ ops at install (the tests need none).
  # Together with their dependencies (pandas, pyarrow, datasets) they add about a minute here.
  if ! DS_BUILD_OPS=0 with_progress pip.log 40 "$VENV/bin/python" -m pip install --upgrade pip "setuptools>=77" build \
      "$TORCH_SPEC" numpy ninja pytest pytest-xdist hypothesis matplotlib tqdm transformers accelerate peft \
      deepspeed trl "ruff==0.17.6" "clang-format==19.1.7"; then
    echo "ckpt_offload: installing the dependencies failed; the full log is in pip.log" >&2
    exit 1
  fi
  echo "== building ckpt_offload (MAX_JOBS=$MAX_JOBS; log in build.log)"
  if ! with_progress build.log 60 "$VENV/bin/python" -m pip install --no-build-isolation -v .; then
    echo "ckpt_offload: build failed; the full log is in build.log" >&2
    exit 1
  fi
  # setup.py's choice (CUDA or C++-only, and why), out of the log.
  grep -m 1 '^ckpt_offload: ' build.log || true
  # Import from outside the source tree: the installed package, not ./ckpt_offload.
  (cd / && "$VENV/bin/python" -c "import ckpt_offload as co, json; print(json.dumps(co.build_info(), indent=1))")
}

# What a user runs: the native tests under one sanitizer and the Python tests.
run_tests() {
  local start=$SECONDS
  echo "== native tests (C++ core under AddressSanitizer + UndefinedBehaviorSanitizer)"
  bash scripts/native_tests.sh
  echo "== Python tests"
  # Two worker processes when pytest-xdist is there (each test builds its own pools and contexts;
  # the once-per-site warning state and the session fixtures are per process).
  local workers=()
  if "$VENV/bin/python" -c "import xdist" 2>/dev/null; then
    workers=(-n "${PYTEST_WORKERS:-2}")
  fi
  read -r -a extra <<< "${PYTEST_ARGS:-}"
  # The pytest script (not python -m pytest) keeps ./ off sys.path, so the tests import the
  # installed package.
  "$VENV/bin/pytest" tests -q -ra "${workers[@]}" "${extra[@]}"
  echo "== tests passed in $((SECONDS - start)) s (after set-up)"
}

# The fixed cost per saved tensor, in every CI log: benchmarks/hot_path.py --quick prints its two
# headline ratios (with their A/A pairs) beside those of the last committed run
# (benchmarks/results/hot_path_cpu.json). Printed, never asserted: a CI machine's timings vary, so
# a regression is for a person to read here, not a failure. A crash of the script fails CI.
run_hot_path() {
  local start=$SECONDS
  echo "== hot path (benchmarks/hot_path.py --quick, CPU; printed, not asserted)"
  "$VENV/bin/python" benchmarks/hot_path.py --quick --device cpu
  echo "== the fixed cost per checkpointed call (benchmarks/call_overhead.py --quick, CPU; printed, not asserted)"
  "$VENV/bin/python" benchmarks/call_overhead.py --quick --device cpu
  echo "== hot path measured in $((SECONDS - start)) s"
}

# The release checks CI adds: slower, and about the build and the package more than the code.
run_release_checks() {
  local start=$SECONDS
  echo "== lint: ruff (lint and format) and clang-format, the repository's settings (scripts/lint.sh)"
  PYTHON="$VENV/bin/python" bash scripts/lint.sh
  echo "== native tests (C++ core under ThreadSanitizer; cannot share a build with ASan)"
  BUILD_DIR=build-native-tsan CMAKE_ARGS="-DCKPT_OFFLOAD_SANITIZE=OFF -DCKPT_OFFLOAD_TSAN=ON" \
    bash scripts/native_tests.sh
  echo "== torch-layer sources against torch 2.11.0's and the installed torch's headers (syntax only)"
  PYTHON="$VENV/bin/python" JOBS="$MAX_JOBS" bash scripts/check_torch_headers.sh
  echo "== packaging: sdist -> wheel -> install outside the tree -> offload (one C++-only build)"
  PYTHON="$VENV/bin/python" bash scripts/check_sdist.sh
  echo "== release checks passed in $((SECONDS - start)) s"
}

case "${1:-}" in
  setup)
    setup
    ;;
  test)
    setup
    run_tests
    ;;
  ci)
    setup
    run_tests
    run_hot_path
    run_release_checks
    ;;
  demo)
    setup
    (cd / && "$VENV/bin/python" -m ckpt_offload demo "${@:2}")
    ;;
  *)
    echo "usage: bash scripts/dev.sh test|ci|demo|setup" >&2
    exit 2
    ;;
esac
