#!/usr/bin/env bash
# The GPU suite: one command that builds ckpt_offload on the GPU machine, runs the GPU tests,
# the CPU test suite, the bandwidth benchmark, the overlap benchmark, the planner sweep and (when present) the demo,
# and writes the results into OUT_DIR.
#
#   bash benchmarks/gpu_suite.sh OUT_DIR
#
# Made for the H200 device machine (python3 with torch 2.11 + CUDA 13.0, nvcc, ninja and pytest
# preinstalled, 16 cores, no network), run from the repository root, e.g. through the device
# tool:  run(command="bash benchmarks/gpu_suite.sh $OUT", timeout_s=540)
#
# OUT_DIR receives at most 8 files, none in subfolders (what the device tool brings back):
#   suite.log      everything printed by every step (also on stdout)
#   summary.md     one page: environment, step table, test counts, bandwidth and overlap headlines
#   bandwidth.json / bandwidth.md   benchmarks/bandwidth.py --out OUT_DIR
#   overlap.json / overlap.md / overlap.png   benchmarks/overlap.py --out OUT_DIR
#   extras.tar.gz  the rest, packed: extras/build.log (setup.py build_ext --inplace),
#                  extras/planner/planner_sweep.{json,md,png} (benchmarks/planner_sweep.py),
#                  extras/gpu_tests.xml (junit XML of `pytest -m gpu -v tests/`),
#                  extras/cpu_tests.xml (junit XML of `pytest tests -x -q -m "not gpu"`),
#                  extras/disk_tier.json / .md (benchmarks/disk_tier.py: spill-file bandwidth on
#                  SPILL_DIR, default /tmp, and a step's cost of spilling) and
#                  extras/hot_path.json / hot_path.md (benchmarks/hot_path.py --out; --quick without a GPU) and
#                  extras/demo/* (the output of `python3 -m ckpt_offload demo`, if it exists)
#   (suite.log has the last 40 lines of any failing step's log, build.log included.)
#
# Every step runs under `timeout`, inside a total budget (SUITE_BUDGET_S, default 450 s), and
# the suite keeps going after a failing step. On a GPU the overlap benchmark runs the 1b Llama
# preset at sequence lengths 512..4096, batch 1, and skips a length predicted to end after
# OVERLAP_BUDGET_S (default 130 s, less when the suite budget is short). Exit status: 0 when every step that ran passed,
# 1 when a step failed or timed out, 2 on bad usage.
#
# Without a GPU (here: a CPU-only dev machine) the suite still builds (nvcc compiles CUDA code
# without a device), the GPU tests skip, and bandwidth.py runs its CPU path, labelled as CPU
# numbers. That is not a failure: the exit status is 0 and summary.md says "NO GPU" at the top.
# Set REQUIRE_GPU=1 to make a missing GPU a failure (exit 1); the suite also requires the GPU
# by itself whenever `nvidia-smi -L` lists one (a GPU machine whose GPU torch cannot use, or
# an extension built without CUDA there, is a failure, not a skip).
#
# Environment: PYTHON (default python3; falls back to ./.venv/bin/python when python3 has no
# torch), MAX_JOBS (default 16), SUITE_BUDGET_S (default 450), REQUIRE_GPU (default 0),
# OVERLAP_BUDGET_S (default 130), PLANNER_BUDGET_S (default 60: the planner sweep's rows stop
# there; skipped when less than that is left after a 100 s reserve for the demo), SKIP_BUILD=1 (use the extension already built in place: for
# trying the suite on a dev machine; the step table says the build was skipped).

set -u
set -o pipefail

if [ $# -ne 1 ] || [ -z "${1:-}" ]; then
  echo "usage: bash benchmarks/gpu_suite.sh OUT_DIR" >&2
  exit 2
fi
mkdir -p "$1" || exit 2
OUT=$(cd "$1" && pwd)
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 2

PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1 && [ -x "$REPO/.venv/bin/python" ]; then
  PY="$REPO/.venv/bin/python"
fi
export PYTHONUNBUFFERED=1
export MAX_JOBS=${MAX_JOBS:-16}
# The suite builds the extension in place: tests and benchmarks import this checkout, never an
# older ckpt_offload installed in the environment.
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
BUDGET=${SUITE_BUDGET_S:-450}
REQUIRE_GPU=${REQUIRE_GPU:-0}
START=$(date +%s)
WORK=$(mktemp -d)              # scratch outside OUT_DIR: keeps OUT_DIR to its 8 files
STEPS="$WORK/steps.tsv"        # name <TAB> status <TAB> seconds <TAB> note
EXTRAS="$WORK/extras"          # packed into OUT_DIR/extras.tar.gz at the end
mkdir -p "$EXTRAS"
OVERLAP_BUDGET=${OVERLAP_BUDGET_S:-130}
PLANNER_BUDGET=${PLANNER_BUDGET_S:-60}
DEMO_RESERVE=100               # what the planner sweep leaves of the budget for the demo and summary
SKIP_BUILD=${SKIP_BUILD:-0}
: >"$STEPS"
FAILED=0

record() { # name status seconds note
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"$STEPS"
  case "$2" in FAIL* | TIMEOUT*) FAILED=1 ;; esac
  echo "=== [$1] $2 (${3}s) $4"
}

note_last() { # adds a note to the last recorded step
  awk -F'\t' -v OFS='\t' -v n="$1" 'NR > 1 { print prev } { prev = $0 } END { split(prev, f, "\t");
    print f[1], f[2], f[3], (f[4] == "" ? n : f[4] "; " n) }' "$STEPS" >"$STEPS.tmp" && mv "$STEPS.tmp" "$STEPS"
  echo "    ($1)"
}

# step NAME CAP_SECONDS LOGFILE|- COMMAND...: runs COMMAND under timeout (the smaller of CAP
# and what is left of the budget), its output to LOGFILE (or to the suite log with "-").
LAST_RC=0
step() {
  local name=$1 cap=$2 log=$3
  shift 3
  local left=$((BUDGET - ($(date +%s) - START) - 20))
  local t=$((cap < left ? cap : left))
  if [ "$t" -lt 15 ]; then
    record "$name" "FAIL (not run: time budget of ${BUDGET}s used up)" 0 ""
    LAST_RC=124
    return 124
  fi
  echo
  echo "=== [$name] timeout ${t}s: $*"
  local s=$(date +%s) rc
  if [ "$log" = "-" ]; then
    timeout -k 10 "$t" "$@"
    rc=$?
  else
    timeout -k 10 "$t" "$@" >"$log" 2>&1
    rc=$?
    if [ $rc -ne 0 ]; then
      echo "--- last 40 lines of $log:"
      tail -n 40 "$log"
    fi
  fi
  local d=$(($(date +%s) - s))
  LAST_RC=$rc
  if [ $rc -eq 0 ]; then
    record "$name" PASS "$d" ""
  elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    record "$name" "TIMEOUT" "$d" "killed after ${t}s"
  else
    record "$name" "FAIL (exit $rc)" "$d" ""
  fi
  return $rc
}

main() {
  echo "ckpt_offload GPU suite: $(date -u +%Y-%m-%dT%H:%M:%SZ), repo $REPO, out $OUT, python $PY, budget ${BUDGET}s"

  # ---- environment --------------------------------------------------------------------------
  echo
  echo "=== environment"
  GPU_LISTED=0
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi || true
    if nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then GPU_LISTED=1; fi
  else
    echo "nvidia-smi: not found"
  fi
  uname -a
  echo "cores: $(nproc 2>/dev/null || echo '?')"
  (command -v nvcc >/dev/null && nvcc --version | tail -n 2) || echo "nvcc: not found"
  (command -v gcc >/dev/null && gcc --version | head -n 1) || echo "gcc: not found"
  if command -v ninja >/dev/null 2>&1; then
    echo "ninja: $(command -v ninja) $(ninja --version)"
  elif "$PY" -c "import ninja" >/dev/null 2>&1; then
    echo "ninja: python package only (torch finds it through the ninja package's bin dir when on PATH)"
  else
    echo "ninja: NOT FOUND - torch.utils.cpp_extension falls back to the serial distutils backend" \
      "(a warning, not an error; the build is slower and MAX_JOBS has no effect)"
  fi
  (git -C "$REPO" rev-parse HEAD 2>/dev/null && git -C "$REPO" status --short 2>/dev/null | head -n 20) ||
    echo "git: no repository here (copied working tree)"
  "$PY" - <<'EOF' || true
import platform, sys
print("python", platform.python_version(), sys.executable)
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.version.cuda, "cuda available", torch.cuda.is_available(),
          "devices", torch.cuda.device_count())
    if torch.cuda.is_available():
        print("device 0:", torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
except Exception as e:
    print("torch: import failed:", e)
try:
    import pytest
    print("pytest", pytest.__version__)
except Exception:
    print("pytest: NOT INSTALLED (carry it as a wheel: see benchmarks/README.md)")
EOF
  TORCH_GPU=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
  GPU_EXPECTED=0
  if [ "$REQUIRE_GPU" = "1" ] || [ "$GPU_LISTED" = "1" ]; then GPU_EXPECTED=1; fi
  if [ "$TORCH_GPU" != "1" ]; then
    echo
    echo "################################################################################"
    echo "# NO GPU FOUND (torch.cuda.is_available() is False): the GPU tests will skip and"
    echo "# bandwidth.py runs its CPU path - CPU numbers, NOT GPU numbers."
    echo "################################################################################"
    if [ "$GPU_EXPECTED" = "1" ]; then
      record gpu_present "FAIL" 0 "a GPU was expected (REQUIRE_GPU=1 or nvidia-smi lists one) but torch cannot use it"
    else
      record gpu_present "NO GPU" 0 "CPU-only machine: GPU tests skip, bandwidth is CPU numbers"
    fi
  else
    record gpu_present PASS 0 "$("$PY" -c 'import torch; print(torch.cuda.get_device_name(0))' 2>/dev/null)"
  fi

  # ---- build --------------------------------------------------------------------------------
  if [ "$SKIP_BUILD" = "1" ]; then
    record build "SKIPPED" 0 "SKIP_BUILD=1: using the extension already built in place"
  else
    step build 300 "$EXTRAS/build.log" "$PY" setup.py build_ext --inplace
    grep -E "ninja|Falling back|warning: |error" "$EXTRAS/build.log" | grep -v "^\s*$" | head -n 20 || true
  fi

  # ---- what got built -----------------------------------------------------------------------
  step build_info 60 - "$PY" - "$TORCH_GPU" "$WORK/build_info.json" <<'EOF'
import json, sys
import ckpt_offload as co
info = co.build_info()
info["extension_file"] = co._C.__file__
print(json.dumps(info, indent=1))
json.dump(info, open(sys.argv[2], "w"))
if sys.argv[1] == "1":
    if not info["cuda_compiled"]:
        sys.exit("the extension was built WITHOUT CUDA on a GPU machine (see build.log): GPU tests would only skip")
    if not info["gpu_available"]:
        sys.exit("torch sees a GPU but ckpt_offload does not (co.build_info()['gpu_available'] is False)")
    if info["pool_backend"] != "pinned":
        sys.exit(f"default pool backend is {info['pool_backend']!r}, expected 'pinned' on a GPU machine")
EOF

  # ---- tests --------------------------------------------------------------------------------
  step gpu_tests 180 - "$PY" -m pytest -m gpu -v -rs -p no:cacheprovider tests/ --junitxml="$EXTRAS/gpu_tests.xml"
  if [ "$LAST_RC" -eq 5 ]; then note_last "pytest exit 5: no GPU tests were collected"; fi
  if [ "$LAST_RC" -eq 0 ] && [ "$TORCH_GPU" != "1" ]; then note_last "all skipped: no GPU"; fi
  # The GPU tests are deselected here: they just ran above.
  step cpu_tests 240 - "$PY" -m pytest tests -x -q -m "not gpu" -p no:cacheprovider --junitxml="$EXTRAS/cpu_tests.xml"

  # ---- benchmarks ---------------------------------------------------------------------------
  step bandwidth 180 - "$PY" benchmarks/bandwidth.py --out "$OUT"

  # ---- disk tier: spill files on the local disk (SPILL_DIR), and what spilling costs a step ----
  step disk_tier 75 - "$PY" benchmarks/disk_tier.py --dir "${SPILL_DIR:-/tmp}" --out "$EXTRAS"
  # ---- hot path: the fixed cost per saved tensor (its files travel in extras.tar.gz) ---------
  if [ "$TORCH_GPU" = "1" ]; then HOT_ARGS=(); else HOT_ARGS=(--quick); fi
  step hot_path 90 - "$PY" benchmarks/hot_path.py "${HOT_ARGS[@]}" --out "$EXTRAS"

  # ---- overlap: every strategy side by side on the built-in Llama decoder ---------------------
  if [ "$TORCH_GPU" = "1" ]; then
    # Leave a minute of the suite budget for the demo and the summary.
    left=$((BUDGET - ($(date +%s) - START) - 60))
    ob=$((left < OVERLAP_BUDGET ? left : OVERLAP_BUDGET))
    if [ "$ob" -lt 30 ]; then ob=30; fi
    OVERLAP_ARGS=(--model 1b --seq-lens 512,1024,2048,4096 --batch 1 --steps 8 --warmup 2 --budget-s "$ob")
  else
    OVERLAP_ARGS=(--quick)   # the CPU path: a tiny model, CPU numbers (the files say so)
  fi
  step overlap 200 - "$PY" benchmarks/overlap.py "${OVERLAP_ARGS[@]}" --no-progress --out "$OUT"

  # ---- planner sweep: co.plan vs Chen / HF / TE / recompute-only, budgets down to the minimum ----
  # Its files go into extras/planner/ (OUT_DIR keeps its 8 files); summary.md gets its headline.
  mkdir -p "$EXTRAS/planner"
  left=$((BUDGET - ($(date +%s) - START) - DEMO_RESERVE))
  pb=$((left < PLANNER_BUDGET ? left : PLANNER_BUDGET))
  if [ "$pb" -lt 20 ]; then
    record planner "SKIPPED" 0 "not enough of the suite budget left (${left}s after the demo's reserve)"
  else
    if [ "$TORCH_GPU" = "1" ]; then
      PLANNER_ARGS=(--size medium --points 5 --steps 3)
    else
      PLANNER_ARGS=(--quick)   # CPU: the tiny model, CPU numbers (the files say so)
    fi
    step planner $((pb + 30)) - "$PY" benchmarks/planner_sweep.py "${PLANNER_ARGS[@]}" --budget-s "$pb" \
      --out "$EXTRAS/planner"
  fi

  # ---- demo (only if someone has written it) ------------------------------------------------
  if "$PY" -c "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('ckpt_offload.__main__') else 1)" \
    >/dev/null 2>&1 && timeout 60 "$PY" -m ckpt_offload demo --help >/dev/null 2>&1; then
    mkdir -p "$WORK/demo"
    DEMO_ARGS=()
    # On a GPU the demo's "medium" preset is the meaningful one (if this demo has presets).
    if [ "$TORCH_GPU" = "1" ] && "$PY" -m ckpt_offload demo --help 2>/dev/null | grep -q "medium"; then
      DEMO_ARGS=(--size medium)
    fi
    step demo 150 - "$PY" -m ckpt_offload demo "${DEMO_ARGS[@]}" --out "$WORK/demo"
    # Its files travel in extras.tar.gz (extras/demo/).
    if [ -n "$(ls -A "$WORK/demo" 2>/dev/null)" ]; then cp -r "$WORK/demo" "$EXTRAS/demo"; fi
  else
    record demo "SKIPPED" 0 "python3 -m ckpt_offload demo does not exist (yet)"
  fi

  # ---- summary ------------------------------------------------------------------------------
  echo
  "$PY" - "$OUT" "$STEPS" "$WORK/build_info.json" "$(($(date +%s) - START))" "$EXTRAS" <<'EOF' || record summary "FAIL" 0 "summary.md could not be written"
import json, os, sys
import xml.etree.ElementTree as ET

out, steps_path, info_path, elapsed = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
extras = sys.argv[5]
steps = [line.rstrip("\n").split("\t") for line in open(steps_path) if line.strip()]
lines = []
gpu = next((s for s in steps if s[0] == "gpu_present"), None)
failed = [s[0] for s in steps if s[1].startswith(("FAIL", "TIMEOUT"))]
title = "ckpt_offload GPU suite"
lines.append(f"# {title}: {'FAILED (' + ', '.join(failed) + ')' if failed else 'all steps passed'}")
lines.append("")
if gpu and gpu[1] != "PASS":
    lines.append("> **NO GPU: the GPU tests skipped and the bandwidth numbers are CPU numbers, not GPU numbers.**")
    lines.append("")
try:
    info = json.load(open(info_path))
    lines.append(f"ckpt_offload {info.get('version')} · torch {info.get('torch_version')} · CUDA {info.get('cuda_version')} "
                 f"(runtime {info.get('cuda_runtime_version')}) · cuda_compiled={info.get('cuda_compiled')} · "
                 f"gpu_available={info.get('gpu_available')} · pool backend {info.get('pool_backend')}")
except Exception:
    lines.append("build_info: unavailable (the build or the import failed)")
if gpu:
    lines.append(f"GPU: {gpu[3] or 'none'} · total {elapsed} s")
lines.append("")
lines.append("| step | status | seconds | note |")
lines.append("|---|---|---:|---|")
for name, status, secs, note in steps:
    lines.append(f"| {name} | {status} | {secs} | {note} |")

for label, fname in (("GPU tests", "gpu_tests.xml"), ("CPU tests", "cpu_tests.xml")):
    path = os.path.join(extras, fname)
    lines.append("")
    lines.append(f"## {label} (extras/{fname})")
    lines.append("")
    if not os.path.exists(path):
        lines.append("no junit XML (the step did not run or pytest did not start)")
        continue
    try:
        root = ET.parse(path).getroot()
        suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
        tot = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
        secs = sum(float(s.get("time", 0)) for s in suites)
        passed = tot["tests"] - tot["failures"] - tot["errors"] - tot["skipped"]
        lines.append(f"{tot['tests']} tests: {passed} passed, {tot['failures']} failed, {tot['errors']} errors, "
                     f"{tot['skipped']} skipped, {secs:.1f} s")
        bad = []
        skipped = {}
        for case in root.iter("testcase"):
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            for kind in ("failure", "error"):
                el = case.find(kind)
                if el is not None:
                    msg = (el.get("message") or "").strip().splitlines()
                    bad.append(f"- {kind.upper()} `{name}`: {msg[0][:300] if msg else ''}")
            el = case.find("skipped")
            if el is not None:
                reason = (el.get("message") or "").strip()[:200]
                skipped[reason] = skipped.get(reason, 0) + 1
        lines += bad[:40]
        if len(bad) > 40:
            lines.append(f"- ... {len(bad) - 40} more")
        for reason, n in sorted(skipped.items(), key=lambda kv: -kv[1])[:10]:
            lines.append(f"- skipped x{n}: {reason}")
    except Exception as e:
        lines.append(f"could not read {fname}: {e}")

bw = os.path.join(out, "bandwidth.json")
lines.append("")
lines.append("## Bandwidth (bandwidth.md has the full tables)")
lines.append("")
if os.path.exists(bw):
    try:
        r = json.load(open(bw))
        if r["mode"] == "cpu":
            lines.append("**CPU numbers, not GPU numbers.**")
            lines.append("")
        lines.append(f"{r.get('gpu_name') or 'CPU path'} · largest size {r['sizes'][-1] // (1 << 20)} MiB")
        lines.append("")
        lines.append("| direction | method | peak GB/s | GB/s at largest size | ratio to raw there | knee (80% of peak) |")
        lines.append("|---|---|---:|---:|---:|---:|")
        big = r["sizes"][-1]
        at = {(x["direction"], x["method"]): x for x in r["results"] if x["bytes"] >= big}
        for key, k in r["knees"].items():
            if not k:
                continue
            d, m = key.split("/")
            row, raw = at.get((d, m)), at.get((d, "raw"))
            ratio = f"{row['gbps'] / raw['gbps']:.2f}" if row and raw else "-"
            there = f"{row['gbps']:.2f}" if row else "-"
            lines.append(f"| {d} | {m} | {k['peak_gbps']:.2f} | {there} | {ratio} | {k['knee_bytes'] // 1024} KiB |")
        lines.append("")
        s = r.get("suggested_min_bytes")
        lines.append(f"Suggested min_bytes (larger side-stream knee): {s // 1024 if s else '-'} KiB; "
                     f"default {r['build_info']['default_min_bytes'] // 1024} KiB. Round trips verified: {r['verified']}.")
        ov = r["overhead"]["pack_unpack_overhead_us"]
        lines.append(f"Pack+unpack overhead per saved tensor: offloaded {ov['offloaded']:.1f} µs, kept {ov['kept']:.1f} µs.")
    except Exception as e:
        lines.append(f"could not read bandwidth.json: {e}")
else:
    lines.append("no bandwidth.json (the step failed or did not run)")

dt = os.path.join(extras, "disk_tier.json")
lines.append("")
lines.append("## Disk tier (extras/disk_tier.md)")
lines.append("")
if os.path.exists(dt):
    try:
        r = json.load(open(dt))
        if r["mode"] == "cpu":
            lines.append("**CPU numbers, not GPU numbers.**")
            lines.append("")
        best = max(r["bandwidth"], key=lambda b: b["write_gbps"] + b["read_gbps"])
        s = r["step"]
        lines.append(f"Spill files on {r['dir']} ({r['fs_type']}, O_DIRECT={best['direct_io']}): "
                     f"{best['write_gbps']:.2f} GB/s write, {best['read_gbps']:.2f} GB/s read "
                     f"({best['io_threads']} I/O threads). Step ({s['model']}, seq {s['seq']}): host-only "
                     f"{s['step_s_host_only'] * 1e3:.1f} ms, spilling {s['bytes_spilled_per_step'] / 2**20:.0f} MiB/step "
                     f"{s['step_s_spill'] * 1e3:.1f} ms ({s['spill_vs_host'] * 100:+.1f}%); gradients equal: "
                     f"{s['gradients_equal_host_only']}.")
    except Exception as e:
        lines.append(f"could not read disk_tier.json: {e}")
else:
    lines.append("no disk_tier.json (the step failed or did not run)")
hp = os.path.join(extras, "hot_path.json")
lines.append("")
lines.append("## Hot path: fixed cost per saved tensor (extras/hot_path.md has every variant)")
lines.append("")
if os.path.exists(hp):
    try:
        r = json.load(open(hp))
        if r["mode"] == "cpu":
            lines.append("**CPU numbers, not GPU numbers.**")
            lines.append("")
        for key, v in r["ratios"].items():
            ratio = "n/a" if v["ratio"] is None else f"{v['ratio']:.2f}"
            lines.append(f"- {key}: {v['numerator']} {v['numerator_us']:.2f} µs / {v['denominator']} "
                         f"{v['denominator_us']:.2f} µs per saved tensor = **{ratio}** (target <= 1.0)")
        behind = [x["variant"] for x in r["results"] if x.get("host_behind_gpu")]
        if r["mode"] == "gpu":
            lines.append(f"- host behind the GPU (host forward time > GPU step time): {', '.join(behind) or 'none'}")
    except Exception as e:
        lines.append(f"could not read hot_path.json: {e}")
else:
    lines.append("no hot_path.json (the step failed or did not run)")

ov = os.path.join(out, "overlap.json")
lines.append("")
lines.append("## Overlap (overlap.md has every strategy and column, overlap.png the plot)")
lines.append("")
if os.path.exists(ov):
    try:
        r = json.load(open(ov))
        if r["mode"] == "cpu":
            lines.append("**CPU numbers, not GPU numbers.**")
            lines.append("")
        m = r["model"]
        lines.append(f"{r.get('gpu_name') or 'CPU path'} · model {m['name']} ({m['num_parameters'] / 1e6:.1f} M) · "
                     f"batch {r['args']['batch']} · {r['args']['dtype']} · {r.get('elapsed_s', 0):.0f} s")
        lines.append("")
        lines.append("| seq len | co_checkpoint_side_prefetch vs checkpoint | hf_offload vs checkpoint | ours < half of HF |")
        lines.append("|---:|---:|---:|---|")
        for p in r["headline"]["per_seq"]:
            o = "-" if p["ours_overhead"] is None else f"{p['ours_overhead'] * 100:+.1f}%"
            if p["ours_overhead"] is None and p.get("ours_status") not in (None, "ok"):
                o = p["ours_status"][:80]
            h = "-" if p["hf_overhead"] is None else f"{p['hf_overhead'] * 100:+.1f}%"
            half = {None: "n/a", True: "yes", False: "NO"}[p["less_than_half_of_hf"]]
            lines.append(f"| {p['seq_len']} | {o} | {h} | {half} |")
        t = r["headline"].get("targets") or {}
        if t:
            lines.append("")
            lines.append(f"Targets at seq {t['at_seq_len']}: " + "; ".join(
                f"{k}: {({None: 'n/a', True: 'yes', False: 'NO'})[v]}" for k, v in t.items() if k != "at_seq_len"))
        bad = [f"{x['strategy']}@{x['seq_len']}: {x['status'][:120]}" for x in r["results"]
               if x["status"].startswith("failed")]
        if bad:
            lines.append("")
            lines += [f"- FAILED {b}" for b in bad]
    except Exception as e:
        lines.append(f"could not read overlap.json: {e}")
else:
    lines.append("no overlap.json (the step failed or did not run)")

pl = os.path.join(extras, "planner", "planner_sweep.json")
lines.append("")
lines.append("## Planner sweep (extras/planner/: planner_sweep.md has every row, planner_sweep.png the plot)")
lines.append("")
if os.path.exists(pl):
    try:
        r = json.load(open(pl))
        if r["mode"] == "cpu":
            lines.append("**CPU numbers, not GPU numbers.**")
            lines.append("")
        m = r["model"]
        lines.append(f"TinyTransformer {m['name']} ({m['layers']} layers) · smallest budget "
                     f"{r['smallest_budget_bytes'] / 2**20:.1f} MiB · no plan {r['no_plan']['measured_peak_bytes'] / 2**20:.1f} MiB "
                     f"· {r.get('elapsed_s', 0):.0f} s" + (f" · {r['skipped_rows']} rows skipped (budget)" if r.get("skipped_rows") else ""))
        lines.append("")
        lines.append("| budget MiB | plan fits (measured) | plan peak vs predicted | best fitting baseline | plan time / its time |")
        lines.append("|---:|---|---:|---|---:|")
        for h in r["headline"]:
            err = "-" if h["plan_peak_error"] is None else f"{h['plan_peak_error'] * 100:+.1f}%"
            ratio = "-" if h["plan_vs_best_baseline_time"] is None else f"{h['plan_vs_best_baseline_time']:.2f}"
            lines.append(f"| {h['budget_bytes'] / 2**20:.1f} | {h['plan_fits']} | {err} | {h['best_baseline'] or '-'} | {ratio} |")
    except Exception as e:
        lines.append(f"could not read planner_sweep.json: {e}")
else:
    lines.append("no planner_sweep.json (the step failed, was skipped or did not run)")

lines.append("")
lines.append("Files: " + ", ".join(sorted(set(os.listdir(out)) | {"summary.md", "extras.tar.gz"})) + " (extras.tar.gz: "
             + ", ".join(sorted(os.listdir(extras))) + ")")
open(os.path.join(out, "summary.md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
EOF

  # Everything else in one file: OUT_DIR stays within the 8 files the device tool brings back.
  tar czf "$OUT/extras.tar.gz" -C "$WORK" extras || echo "WARNING: extras.tar.gz could not be written"
  echo
  echo "=== files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
  nfiles=$(find "$OUT" -type f | wc -l)
  if [ "$nfiles" -gt 8 ]; then echo "WARNING: $nfiles files in $OUT; the device tool brings back only 8"; fi
  if [ "$FAILED" -ne 0 ]; then
    echo "GPU SUITE: FAILED ($(awk -F'\t' '$2 ~ /^(FAIL|TIMEOUT)/ {printf "%s ", $1}' "$STEPS" 2>/dev/null)) - see summary.md"
    rm -rf "$WORK"
    return 1
  fi
  rm -rf "$WORK"
  if [ "$TORCH_GPU" != "1" ]; then
    echo "GPU SUITE: passed, but NO GPU was found (GPU tests skipped, CPU bandwidth numbers)"
  else
    echo "GPU SUITE: all steps passed"
  fi
  return 0
}

main 2>&1 | tee "$OUT/suite.log"
exit "${PIPESTATUS[0]}"
