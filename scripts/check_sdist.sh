#!/usr/bin/env bash
# Packaging check (CI runs it from scripts/dev.sh test): builds the sdist, installs it the way the
# README says (pip, --no-build-isolation) into a fresh folder outside the source tree, runs a small
# offload from a folder without the repository, and checks what the sdist and the wheel hold
# (scripts/check_dist.py).
#
#   bash scripts/check_sdist.sh            # with python3 from PATH
#   PYTHON=.venv/bin/python bash scripts/check_sdist.sh
#
# One compile, C++-only (CKPT_OFFLOAD_CUDA=0) for time: `pip wheel` builds from the sdist the wheel
# that `pip install --no-build-isolation ckpt_offload-X.tar.gz` builds and installs; that wheel is
# both installed and inspected. The Python that runs it needs torch, setuptools, build and pip.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON=${PYTHON:-python3}
# Absolute (a relative .venv/bin/python would break in the folders below) but not resolved: a
# venv's python is a link whose target is not the venv.
PYTHON=$(realpath -s "$(command -v "$PYTHON")")
WORK=$(mktemp -d "${TMPDIR:-/tmp}/ckpt_offload_sdist.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
start=$SECONDS

echo "== sdist (python -m build --sdist --no-isolation)"
# setuptools adds the files of an existing ckpt_offload.egg-info/SOURCES.txt to the sdist, which
# would hide a file MANIFEST.in misses; the folder is a build output, rewritten by every build.
rm -rf "$ROOT/ckpt_offload.egg-info"
(cd "$ROOT" && "$PYTHON" -m build --sdist --no-isolation --outdir "$WORK/dist" > "$WORK/sdist.log" 2>&1) ||
  { tail -n 40 "$WORK/sdist.log"; echo "check_sdist: building the sdist failed" >&2; exit 1; }
SDIST=$(ls "$WORK"/dist/ckpt_offload-*.tar.gz)
"$PYTHON" "$ROOT/scripts/check_dist.py" sdist "$SDIST"

echo "== wheel from the sdist (pip wheel --no-build-isolation, C++-only; log in $WORK/wheel.log while it runs)"
# From $WORK: nothing of the source tree is on the path or in the build folder.
(cd "$WORK" && CKPT_OFFLOAD_CUDA=0 "$PYTHON" -m pip wheel --no-build-isolation --no-deps --no-cache-dir \
    --wheel-dir "$WORK/dist" "$SDIST" > "$WORK/wheel.log" 2>&1) ||
  { tail -n 60 "$WORK/wheel.log"; echo "check_sdist: building the wheel from the sdist failed" >&2; exit 1; }
WHEEL=$(ls "$WORK"/dist/ckpt_offload-*.whl)
"$PYTHON" "$ROOT/scripts/check_dist.py" wheel "$WHEEL"

echo "== install into $WORK/site and run an offload from $WORK/run"
"$PYTHON" -m pip install --no-deps --no-cache-dir --target "$WORK/site" "$WHEEL" > "$WORK/install.log" 2>&1 ||
  { tail -n 40 "$WORK/install.log"; echo "check_sdist: installing the wheel failed" >&2; exit 1; }
mkdir "$WORK/run"
(cd "$WORK/run" && PYTHONPATH="$WORK/site" CKPT_OFFLOAD_EXPECT="$WORK/site" "$PYTHON" - <<'PY'
import os

import torch

import ckpt_offload as co

# The installed copy, not a source tree that happens to be on the path.
assert co.__file__.startswith(os.environ["CKPT_OFFLOAD_EXPECT"]), co.__file__
info = co.build_info()
assert info["built_with_torch"] == torch.__version__, info

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8))
x = torch.randn(32, 64)
model(x).square().sum().backward()
expected = [p.grad.clone() for p in model.parameters()]
model.zero_grad()
with co.offload(devices=["cpu"], min_bytes=0) as ctx:
    loss = model(x).square().sum()
loss.backward()
stats = ctx.stats()
assert stats["tensors_offloaded"] > 0, stats
assert all(torch.equal(p.grad, e) for p, e in zip(model.parameters(), expected)), "gradients differ"
print(f"check_sdist: offload from the installed sdist: {stats['tensors_offloaded']} tensors, "
      f"gradients bit-identical; built with torch {info['built_with_torch']}")
PY
)
echo "check_sdist: passed in $((SECONDS - start)) s"
