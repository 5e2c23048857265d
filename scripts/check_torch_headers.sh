#!/usr/bin/env bash
# Syntax-compiles every torch-facing C++ file (csrc/torch/*.cpp and the device side of each build:
# csrc/torch/cuda/*.cpp with CKPT_OFFLOAD_WITH_CUDA, csrc/torch/cpu/*.cpp without) against the
# headers of the oldest torch the README claims (2.11.0) and of the installed torch: a c10 helper
# that one release lacks fails here, not on a GPU machine that runs another torch than CI.
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
fi

variants=(cpu)
if "$PYTHON" scripts/build_env.py --cuda > /dev/null 2>&1; then
  variants+=(cuda)
else
  echo "check_torch_headers: no CUDA toolkit found: checking the C++-only variant only"
fi

# One translation unit per variant that #includes every source of that build's torch layer
# (scripts/build_env.py --sources: the same list setup.py compiles): a syntax-only parse of
# torch's headers costs ~15 s of CPU per file, and the check is about torch's API (which every
# file sees the same way), so the headers are parsed once per combination instead of once per
# file: ~10x less CI time. Diagnostics still name the real file and line. (The build proper
# compiles each file on its own against the installed torch.)
unity_dir="$(mktemp -d)"
trap 'rm -rf "$unity_dir"' EXIT
for variant in "${variants[@]}"; do
  source_args=(--sources)
  [[ $variant == cuda ]] && source_args+=(--cuda)
  "$PYTHON" scripts/build_env.py "${source_args[@]}" | while read -r f; do echo "#include \"$ROOT/$f\""; done \
    > "$unity_dir/$variant.cpp"
done

check() {  # check HEADERS VARIANT
  local headers=$1 variant=$2 args=()
  [[ $variant == cuda ]] && args+=(--cuda)
  [[ $headers != installed ]] && args+=(--torch-include "$CACHE/torch/include")
  local flags unity="$unity_dir/$variant.cpp"
  mapfile -t flags < <("$PYTHON" scripts/build_env.py "${args[@]}" 2>/dev/null)
  # -Wno-attributes: pybind11's class-visibility note, which the real build does not show.
  if g++ -fsyntax-only -Wno-attributes "${flags[@]}" "$unity"; then
    echo "   ok: torch $headers headers, $variant variant"
  else
    echo "check_torch_headers: csrc/torch does not compile against torch $headers's headers ($variant variant)" >&2
    return 1
  fi
}

failed=0
pids=()
for headers in installed "$OLDEST_TORCH"; do
  for variant in "${variants[@]}"; do
    echo "== torch $headers headers, $variant variant"
    check "$headers" "$variant" &
    pids+=($!)
    if (( ${#pids[@]} >= JOBS )); then
      wait "${pids[0]}" || failed=1
      pids=("${pids[@]:1}")
    fi
  done
done
for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
echo "check_torch_headers: done in $((SECONDS - start)) s"
exit $failed
