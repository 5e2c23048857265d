#!/usr/bin/env bash
# Builds ckpt_offload's C++ core and its native tests with ASan+UBSan (no Python, no torch)
# and runs them with ctest. Exits non-zero when configuring, building or any test fails.
#
#   scripts/native_tests.sh                      # sanitized build in build-native/
#   BUILD_DIR=build-tsan CMAKE_ARGS="-DCKPT_OFFLOAD_SANITIZE=OFF -DCKPT_OFFLOAD_TSAN=ON" scripts/native_tests.sh
#
# Environment: BUILD_DIR (default build-native), JOBS (default 2), CMAKE_ARGS (extra
# configure arguments, appended after the defaults so they can override them).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

BUILD_DIR="${BUILD_DIR:-build-native}"
JOBS="${JOBS:-2}"
read -r -a EXTRA_ARGS <<< "${CMAKE_ARGS:-}"

GENERATOR=()
if command -v ninja >/dev/null 2>&1; then
  GENERATOR=(-G Ninja)
fi
# A build directory configured with another generator cannot be reused with this one.
if [[ -f "$BUILD_DIR/CMakeCache.txt" ]] && ! grep -q "CMAKE_GENERATOR:INTERNAL=${GENERATOR[1]:-Unix Makefiles}\$" "$BUILD_DIR/CMakeCache.txt"; then
  echo "native_tests: $BUILD_DIR was configured with another generator; starting it afresh"
  rm -rf "$BUILD_DIR"
fi

start=$SECONDS
echo "== configure ($BUILD_DIR)"
cmake -S . -B "$BUILD_DIR" "${GENERATOR[@]}" -DCKPT_OFFLOAD_SANITIZE=ON "${EXTRA_ARGS[@]}"
echo "== build"
cmake --build "$BUILD_DIR" -j "$JOBS"
echo "== test"
(cd "$BUILD_DIR" && ctest --output-on-failure)  # not --test-dir: that needs CMake >= 3.20
echo "native_tests: all passed in $((SECONDS - start)) s"
