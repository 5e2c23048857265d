#!/usr/bin/env bash
# Syntax-compiles every torch-facing C++ file (csrc/torch/*.cpp) against the headers of the
# oldest torch the README claims (2.11.0) and of the installed torch, with and without
# CKPT_OFFLOAD_WITH_CUDA: a c10 helper that one release lacks fails here, not on a GPU machine
# that runs another torch than CI.
#
#   bash scripts/check_torch_headers.sh            # PYTHON defaults to python3
#
# Environment: PYTHON (a Python with torch installed), JOBS (default 2), OLDEST_TORCH
# (default 2.11.0). torch 2.11.0's headers are downloaded once (the wheel, ~530 MB, of which
# only torch/include is kept) and cached in ${XDG_CACHE_HOME:-$HOME/.cache}/ckpt_offload/.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
JOBS="${JOBS:-2}"
OLDEST_TORCH="${OLDEST_TORCH:-2.11.0}"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/ckpt_offload/torch-${OLDEST_TORCH}-include"
start=$SECONDS

if [[ ! -f "$CACHE/torch/include/torch/extension.h" ]]; then
  echo "== fetching torch ${OLDEST_TORCH}'s headers into $CACHE"
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  "$PYTHON" -m pip download "torch==${OLDEST_TORCH}" --no-deps --only-binary=:all: --python-version 3.11 \
    --platform manylinux_2_28_x86_64 -d "$tmp" -q
  "$PYTHON" - "$tmp" "$CACHE" <<'PY'
import glob, os, shutil, sys, zipfile
tmp, cache = sys.argv[1:3]
(wheel,) = glob.glob(os.path.join(tmp, "torch-*.whl"))
out = os.path.join(tmp, "include")
with zipfile.ZipFile(wheel) as z:
    z.extractall(out, [n for n in z.namelist() if n.startswith("torch/include/")])
os.makedirs(os.path.dirname(cache), exist_ok=True)
shutil.rmtree(cache, ignore_errors=True)
shutil.move(out, cache)  # only a complete extraction lands in the cache
PY
  rm -rf "$tmp"
  trap - EXIT
fi

variants=(cpu)
if "$PYTHON" scripts/build_env.py --cuda > /dev/null 2>&1; then
  variants+=(cuda)
else
  echo "check_torch_headers: no CUDA toolkit found: checking the C++-only variant only"
fi

failed=0
for headers in installed "$OLDEST_TORCH"; do
  for variant in "${variants[@]}"; do
    args=()
    [[ $variant == cuda ]] && args+=(--cuda)
    [[ $headers != installed ]] && args+=(--torch-include "$CACHE/torch/include")
    mapfile -t flags < <("$PYTHON" scripts/build_env.py "${args[@]}")
    echo "== torch $headers headers, $variant variant"
    # One compiler per file, at most JOBS at once; -fsyntax-only: parsing is the check.
    if ! printf '%s\n' csrc/torch/*.cpp | xargs -P "$JOBS" -I{} \
        sh -c 'g++ -fsyntax-only "$@" {} || { echo "FAILED: {}" >&2; exit 1; }' _ "${flags[@]}"; then
      echo "check_torch_headers: csrc/torch does not compile against torch $headers's headers ($variant)" >&2
      failed=1
    fi
  done
done
echo "check_torch_headers: done in $((SECONDS - start)) s"
exit $failed
