#!/usr/bin/env bash
# The repository's style, checked (CI runs this: scripts/dev.sh ci). Changes nothing unless FIX=1.
#   bash scripts/lint.sh          # ruff (lint and format) on the Python, clang-format on the C++
#   FIX=1 bash scripts/lint.sh    # rewrite what the formatters would change, apply ruff's safe fixes
# The settings are the repository's: pyproject.toml's [tool.ruff] and .clang-format. Environment:
# PYTHON (default .venv/bin/python, else python3), whose ruff and clang-format packages are used.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=python3
BIN=$(dirname "$PY")
RUFF=$BIN/ruff
CLANG_FORMAT=$BIN/clang-format
for tool in "$RUFF" "$CLANG_FORMAT"; do
  if [ ! -x "$tool" ]; then
    echo "lint: $tool not found; install the pinned linters: $PY -m pip install ruff==0.17.6 clang-format==19.1.7" >&2
    exit 2
  fi
done
mapfile -t CXX < <(git ls-files 'csrc/*.cpp' 'csrc/*.h' 'csrc/*.cu' 'csrc/*.cuh' 'tests/native/*.cpp' 'tests/native/*.h')
rc=0
if [ "${FIX:-0}" = "1" ]; then
  "$RUFF" check --fix . || rc=1
  "$RUFF" format . || rc=1
  "$CLANG_FORMAT" --style=file -i "${CXX[@]}" || rc=1
else
  echo "== ruff check"
  "$RUFF" check . || rc=1
  echo "== ruff format --check"
  "$RUFF" format --check . || rc=1
  echo "== clang-format (${#CXX[@]} C++ files)"
  "$CLANG_FORMAT" --style=file --dry-run -Werror "${CXX[@]}" || rc=1
fi
if [ "$rc" -ne 0 ]; then
  echo "lint: the style above is off; FIX=1 bash scripts/lint.sh rewrites what the formatters would change" >&2
fi
exit "$rc"
