#!/usr/bin/env bash
# The GPU suite: one command that builds ckpt_offload on the GPU machine and runs, by preset, the
# long-context headline and every GPU test (the default), the other benchmarks (--preset rest), or
# everything (--preset all: the CPU suite, bandwidth, disk tier, hot path, overlap, store dtype,
# planner, demo), and writes the results into OUT_DIR.
#
#   bash benchmarks/gpu_suite.sh OUT_DIR [--preset headline|rest|all] [--only STEP,...] [--skip STEP,...]
#   bash benchmarks/gpu_suite.sh --help          # the presets and step names
#
# Made for the H200 GPU machine (python3 with torch 2.11 + CUDA 13.0, nvcc, ninja, pytest with
# pytest-timeout and pytest-xdist, cuda-gdb and compute-sanitizer preinstalled, no gdb, 16 cores,
# no network), run from the repository root. A lease of that machine is about 15 minutes, start-up
# included, so it takes two commands: `bash benchmarks/gpu_suite.sh "$OUT"` (the headline first:
# build, long_context, then every GPU test in the time left), then
# `bash benchmarks/gpu_suite.sh "$OUT2" --preset rest` with what is left.
#
# OUT_DIR receives at most 8 files, none in subfolders:
#   suite.log      everything printed by every step (also on stdout)
#   summary.md     one page: environment, step table, every failing or crashed test with ~8 lines
#                  of its message, bandwidth / disk / hot-path / overlap / planner headlines
#   test_logs.txt  the test logs as text, one section per process under a "=====" header: the GPU
#                  tests' `pytest -v` output (one process, one more after each crash), each crashed
#                  test's run alone and its native backtrace (cuda-gdb or gdb), the diagnose runs,
#                  the CPU suite's output
#   gpu_tests.xml  junit XML of every `gpu` test, merged from those processes; a crashed test is an
#                  <error type="crashed" signal="11"> holding faulthandler's output and the log's tail
#   cpu_tests.xml  junit XML of `pytest tests -m "not gpu" --maxfail=25`
#   bandwidth.md, overlap.md   the benchmarks' tables
#   extras.tar.gz  the rest, packed: extras/build.log, extras/bandwidth.json, extras/overlap.json,
#                  extras/overlap.png, extras/disk_tier.{json,md} (spill files on SPILL_DIR, default
#                  /tmp), extras/hot_path.{json,md}, extras/planner/planner_sweep.{json,md,png},
#                  extras/long_context/*, extras/store_dtype/*, extras/demo/*
#
# Steps, in this order: build, build_info, diagnose, long_context, gpu_tests, cpu_tests,
# store_dtype, planner, overlap, disk_tier, bandwidth, hot_path, demo (environment, gpu_present and
# the summary always run). A preset selects some: headline = build, build_info, long_context,
# gpu_tests; rest = build, build_info, store_dtype, planner, overlap, disk_tier, bandwidth,
# hot_path, demo; all = every one (diagnose only with DIAGNOSE=1, store_dtype only with
# STORE_DTYPE=1). `--only build,gpu_tests` runs just those (a rerun after a fix); `--skip
# overlap,planner` leaves those out of the preset; an unknown name is a usage error (exit 2).
# diagnose (off unless named in --only or DIAGNOSE=1) is the first minutes of a crash hunt: the
# tests in benchmarks/_suite_tests.py's DIAG_TARGETS alone in fresh processes, plainly, under
# cuda-gdb/gdb with every thread's backtrace, and under compute-sanitizer's memcheck.
#
# Every step runs under `timeout`, inside a total budget (SUITE_BUDGET_S, default 540 s, under the GPU machine's 600 s per command), and the
# suite keeps going after a failing step. On a GPU the overlap benchmark runs the 1b Llama preset at
# sequence lengths 512..4096, batch 1, and skips a length predicted to end after OVERLAP_BUDGET_S
# (default 45 s, less when the suite budget is short). Exit status: 0 when every step that ran
# passed, 1 when a step failed or timed out, 2 on bad usage.
#
# Without a GPU (here: a CPU-only dev machine) the suite still builds (nvcc compiles CUDA code
# without a device), the GPU tests skip, and bandwidth.py runs its CPU path, labelled as CPU
# numbers. That is not a failure: the exit status is 0 and summary.md says "NO GPU" at the top.
# Set REQUIRE_GPU=1 to make a missing GPU a failure (exit 1); the suite also requires the GPU
# by itself whenever `nvidia-smi -L` lists one (a GPU machine whose GPU torch cannot use, or
# an extension built without CUDA there, is a failure, not a skip).
#
# Environment: PYTHON (default python3; falls back to ./.venv/bin/python when python3 has no
# torch), MAX_JOBS (default 16), SUITE_BUDGET_S (default 540), REQUIRE_GPU (default 0),
# SKIP_BUILD=1 (use the extension already built in place, as --skip build does; the step table says
# so), DIAGNOSE=1 (add the diagnose step), STORE_DTYPE=1 (add the store_dtype step: benchmarks/store_dtype.py;
# STORE_DTYPE_TRAIN_STEPS, default 100, STORE_DTYPE_BUDGET_S, default 300), OVERLAP_BUDGET_S (45: the old overlap benchmark is now a small check), PLANNER_BUDGET_S (60: the
# planner sweep's rows stop there; skipped when less than that is left after a 100 s reserve for
# the demo), LONG_CONTEXT_BUDGET_S (140: long_context.py --budget-s; its step cap is 60 s more), GPU_TESTS_BUDGET_S (200; in
# the headline preset, what the headline leaves of the budget), GPU_TEST_TIMEOUT_S (120, per
# test, through pytest-timeout; a test still running 30 s later has its process killed),
# GPU_TESTS_ISOLATE=1 (after a crash, run every test left in a process of its own instead of all of
# them in one; each pays torch's start-up, 30-40 s on the H200), GPU_TESTS_PER_FILE=1 (one process
# per test file after a separate collection, the old way: 3 of 15 files ran in a 240 s step there), GPU_TEST_PATHS
# (default "tests": where the gpu_tests step collects `-m gpu` tests), CPU_TEST_PATHS (default
# "tests": what the cpu_tests step runs; both lists are for trying the suite), CPU_TESTS_BUDGET_S (200),
# CPU_MAXFAIL (25), CPU_TESTS_THREADS (torch's threads per CPU test worker; default: the cores over workers + 1,
# when there are workers), CPU_TESTS_BESIDE (default 1 on 8 cores or more: the CPU suite runs at the
# same time as the GPU tests; 0: after them), CPU_TESTS_WORKERS (default, with pytest-xdist and 8 cores
# or more: beside the GPU tests half the cores minus 2, at least 4, so the GPU tests' process is not
# starved (6 on 16 cores); after them 4; else 0 = one process), DIAG_RUN_TIMEOUT_S (150, each diagnose run),
# DIAG_TARGETS ("NODEID [pytest args];..." to diagnose instead of the built-in list),
# SPILL_DIR (/tmp).

set -u
set -o pipefail

STEP_NAMES="build build_info diagnose long_context gpu_tests cpu_tests store_dtype planner overlap disk_tier bandwidth hot_path demo"
# The presets: what a lease of the GPU machine runs, one command each (benchmarks/README.md).
#   headline (the default): the result people decide on first, then every GPU test with the time left.
#   rest: the other benchmarks, in the order their results are wanted.
#   all: every step (diagnose with DIAGNOSE=1, store_dtype with STORE_DTYPE=1), the CPU suite included.
PRESET_headline="build,build_info,long_context,gpu_tests"
PRESET_rest="build,build_info,store_dtype,planner,overlap,disk_tier,bandwidth,hot_path,demo"
PRESET_all="build,build_info,diagnose,long_context,gpu_tests,cpu_tests,store_dtype,planner,overlap,disk_tier,bandwidth,hot_path,demo"

usage() {
  cat <<'EOF'
usage: bash benchmarks/gpu_suite.sh OUT_DIR [--preset headline|rest|all] [--only STEP,...] [--skip STEP,...]
       bash benchmarks/gpu_suite.sh --list [--preset ...] [--only ...] [--skip ...]   # what would run

Presets (--only, when given, picks the steps instead; --skip leaves steps out of either):
  headline      the default: build, build_info, long_context, gpu_tests (the tests get the
                time the headline leaves). The first command of a lease.
  rest          build, build_info, store_dtype, planner, overlap, disk_tier, bandwidth, hot_path,
                demo. The second command, with what is left (SUITE_BUDGET_S to fit).
  all           every step (diagnose with DIAGNOSE=1, store_dtype with STORE_DTYPE=1), the CPU
                suite beside the GPU tests.

Steps, in the order they run (environment, gpu_present and the summary always run):
  build         python3 setup.py build_ext --inplace, CKPT_OFFLOAD_CUDA=1 where a GPU is
                (SKIP_BUILD=1 skips it too)
  build_info    co.build_info(): on a GPU machine CUDA compiled, GPU available, pinned pool
  diagnose      OFF by default (on with --only diagnose or DIAGNOSE=1): the crash hunt's runs,
                each test alone, plainly, under cuda-gdb/gdb (every thread's backtrace) and
                under compute-sanitizer memcheck; output in test_logs.txt
  long_context  benchmarks/long_context.py --out DIR (only when that file exists)
  gpu_tests     every `gpu` test (tests/gpu/ first) in one process; a crashed test rerun
                alone, the tests left in one fresh process -> gpu_tests.xml
  cpu_tests     pytest tests -m "not gpu" --maxfail=25 -> cpu_tests.xml
  store_dtype   benchmarks/store_dtype.py: bytes, step time and error of each storage dtype
  planner       benchmarks/planner_sweep.py
  overlap       benchmarks/overlap.py
  disk_tier     benchmarks/disk_tier.py
  bandwidth     benchmarks/bandwidth.py
  hot_path      benchmarks/hot_path.py, then benchmarks/call_overhead.py --quick
  demo          python3 -m ckpt_offload demo (only when it exists)

Examples:
  bash benchmarks/gpu_suite.sh OUT                          # the headline, then every GPU test
  bash benchmarks/gpu_suite.sh OUT --preset rest            # the other benchmarks
  bash benchmarks/gpu_suite.sh OUT --only build,gpu_tests   # a rerun after a fix
  bash benchmarks/gpu_suite.sh OUT --only build,diagnose    # the first minutes of a crash hunt
  bash benchmarks/gpu_suite.sh OUT --skip overlap,planner

The file's header lists the environment variables.
EOF
}

in_list() { # WORD COMMA,SEPARATED,LIST
  case ",$2," in *",$1,"*) return 0 ;; esac
  return 1
}

check_steps() { # OPTION LIST: every name in LIST must be a step
  local n
  if [ -z "$2" ]; then
    echo "gpu_suite.sh: $1 needs a comma-separated list of steps; valid steps: ${STEP_NAMES// /, }" >&2
    exit 2
  fi
  for n in ${2//,/ }; do
    if ! in_list "$n" "${STEP_NAMES// /,}"; then
      echo "gpu_suite.sh: unknown step '$n' in $1; valid steps: ${STEP_NAMES// /, }" >&2
      exit 2
    fi
  done
}

ONLY=""
SKIP=""
PRESET=headline
LIST=0
OUT_ARG=""
while [ $# -gt 0 ]; do
  case "$1" in
    -h | --help) usage; exit 0 ;;
    --list) LIST=1; shift ;;
    --only) ONLY=${2:-}; check_steps --only "$ONLY"; shift 2 ;;
    --only=*) ONLY=${1#*=}; check_steps --only "$ONLY"; shift ;;
    --skip) SKIP=${2:-}; check_steps --skip "$SKIP"; shift 2 ;;
    --skip=*) SKIP=${1#*=}; check_steps --skip "$SKIP"; shift ;;
    --preset | --preset=*)
      if [ "$1" = --preset ]; then PRESET=${2:-}; shift; [ $# -gt 0 ] && shift; else PRESET=${1#*=}; shift; fi
      case "$PRESET" in headline | rest | all) ;; *)
        echo "gpu_suite.sh: unknown preset '$PRESET'; valid presets: headline, rest, all" >&2
        exit 2 ;;
      esac
      ;;
    -*) echo "gpu_suite.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
    *)
      if [ -n "$OUT_ARG" ]; then
        echo "gpu_suite.sh: one OUT_DIR only (got '$OUT_ARG' and '$1')" >&2
        exit 2
      fi
      OUT_ARG=$1
      shift
      ;;
  esac
done


want() { # STEP: is it selected (--preset, --only, --skip, DIAGNOSE, STORE_DTYPE)?
  if [ -n "$ONLY" ]; then
    in_list "$1" "$ONLY" || return 1
  elif [ "$1" = diagnose ]; then
    [ "${DIAGNOSE:-0}" = "1" ] || return 1  # opt-in in every preset: --only diagnose, or DIAGNOSE=1
  elif [ "$1" = store_dtype ] && [ "$PRESET" = all ]; then
    [ "${STORE_DTYPE:-0}" = "1" ] || return 1  # opt-in in `all` (about 3 minutes on a GPU); first in `rest`
  else
    local steps="PRESET_$PRESET"
    in_list "$1" "${!steps}" || return 1
  fi
  if [ -n "$SKIP" ] && in_list "$1" "$SKIP"; then return 1; fi
  return 0
}

# --list: the steps this command line would run, in order, one a line; nothing runs.
if [ "$LIST" = 1 ]; then
  for n in $STEP_NAMES; do if want "$n"; then echo "$n"; fi; done
  exit 0
fi
if [ -z "$OUT_ARG" ]; then
  usage >&2
  exit 2
fi
mkdir -p "$OUT_ARG" || exit 2
OUT=$(cd "$OUT_ARG" && pwd)
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
BUDGET=${SUITE_BUDGET_S:-540}
REQUIRE_GPU=${REQUIRE_GPU:-0}
START=$(date +%s)
WORK=$(mktemp -d)              # scratch outside OUT_DIR: keeps OUT_DIR to its 8 files
STEPS="$WORK/steps.tsv"        # name <TAB> status <TAB> seconds <TAB> note
EXTRAS="$WORK/extras"          # packed into OUT_DIR/extras.tar.gz at the end
LOGS="$WORK/logs"              # concatenated into OUT_DIR/test_logs.txt at the end
mkdir -p "$EXTRAS" "$LOGS"
OVERLAP_BUDGET=${OVERLAP_BUDGET_S:-45}
LONG_CONTEXT_BUDGET=${LONG_CONTEXT_BUDGET_S:-140}
PLANNER_BUDGET=${PLANNER_BUDGET_S:-60}
DEMO_RESERVE=100               # what the planner sweep leaves of the budget for the demo and summary
SKIP_BUILD=${SKIP_BUILD:-0}
: >"$STEPS"
FAILED=0
# What this run writes into OUT_DIR (and nothing else there is counted): at most 8 files.
OUT_FILES="suite.log summary.md test_logs.txt gpu_tests.xml cpu_tests.xml bandwidth.md overlap.md extras.tar.gz"
for f in $OUT_FILES; do rm -f "$OUT/$f"; done

record() { # name status seconds note
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"$STEPS"
  case "$2" in FAIL* | TIMEOUT*) FAILED=1 ;; esac
  echo "=== [$1] $2 (${3}s) $4"
}

note_last() { # NAME NOTE: adds a note to step NAME's row (a step running beside it may have ended since)
  awk -F'\t' -v OFS='\t' -v s="$1" -v n="$2" '$1 == s { $4 = ($4 == "" ? n : $4 "; " n) } { print }' "$STEPS" \
    >"$STEPS.tmp" && mv "$STEPS.tmp" "$STEPS"
  echo "    ($2)"
}

not_selected() { record "$1" "SKIPPED" 0 "not selected ($([ -n "$ONLY" ] && echo "--only" || echo "preset $PRESET")${SKIP:+, --skip})"; }

# step NAME CAP_SECONDS LOGFILE|- COMMAND...: runs COMMAND under timeout (the smaller of CAP
# and what is left of the budget), its output to LOGFILE (or to the suite log with "-"). At the
# limit it gets STEP_SIGNAL (default TERM), then KILL 10 s later.
# The command sees its limit as SUITE_STEP_TIMEOUT_S (the test runner ends itself before it).
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
    SUITE_STEP_TIMEOUT_S=$t timeout -s "${STEP_SIGNAL:-TERM}" -k 10 "$t" "$@"
    rc=$?
  else
    SUITE_STEP_TIMEOUT_S=$t timeout -s "${STEP_SIGNAL:-TERM}" -k 10 "$t" "$@" >"$log" 2>&1
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

# ---- the steps (main calls them in order) ------------------------------------------------

run_build() {
  # ---- build --------------------------------------------------------------------------------
  if [ "$SKIP_BUILD" = "1" ]; then
    record build "SKIPPED" 0 "SKIP_BUILD=1: using the extension already built in place"
  elif ! want build; then
    record build "SKIPPED" 0 "not selected: using the extension already built in place"
  else
    # The CUDA engine on a GPU machine, whatever setup.py's default finds (it builds C++-only
    # where it sees no usable GPU); CKPT_OFFLOAD_CUDA set by the caller wins.
    if [ "$TORCH_GPU" = "1" ] || [ "$GPU_EXPECTED" = "1" ]; then
      export CKPT_OFFLOAD_CUDA=${CKPT_OFFLOAD_CUDA:-1}
    fi
    step build 300 "$EXTRAS/build.log" "$PY" setup.py build_ext --inplace
    grep -E "ninja|Falling back|warning: |error" "$EXTRAS/build.log" | grep -v "^\s*$" | head -n 20 || true
  fi
}

run_build_info() {
  # ---- what got built -----------------------------------------------------------------------
  if want build_info; then
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
  else
    not_selected build_info
  fi
}

run_diagnose() {
  # ---- diagnose: the first minutes of a crash hunt (off by default) --------------------------
  # Each named test alone in a fresh process: plainly (faulthandler), under cuda-gdb (gdb) with
  # every thread's backtrace, and the first under compute-sanitizer memcheck (which refuses the
  # device on some machines: that is logged, not a failure). Output: test_logs.txt, summary.md.
  if want diagnose; then
    DIAG_ARGS=()
    if [ -n "${DIAG_TARGETS:-}" ]; then  # "NODEID [pytest args];NODEID ..." instead of the built-in list
      IFS=';' read -r -a _targets <<<"$DIAG_TARGETS"
      for t in "${_targets[@]}"; do DIAG_ARGS+=(--target "$t"); done
    fi
    step diagnose "${DIAGNOSE_BUDGET_S:-420}" - "$PY" benchmarks/_suite_tests.py diagnose --root "$REPO" \
      --work "$WORK/diagnose" --log "$LOGS/1-diagnose.txt" --summary "$WORK/diagnose.md" \
      --backtrace-timeout-s "${DIAG_RUN_TIMEOUT_S:-150}" --test-timeout-s "${GPU_TEST_TIMEOUT_S:-120}" "${DIAG_ARGS[@]}"
  fi
}

run_tests() {
  # ---- tests --------------------------------------------------------------------------------
  CPU_PID=""
  # The GPU tests are deselected here: the gpu_tests step runs them. No -x: one failure must not hide the
  # rest (--maxfail bounds a broken build's flood instead).
  if want cpu_tests; then
    CPU_ARGS=(-q -rfE -m "not gpu" -p no:cacheprovider --maxfail="${CPU_MAXFAIL:-25}" --junitxml="$OUT/cpu_tests.xml")
    if "$PY" -c "import pytest_timeout" >/dev/null 2>&1; then CPU_ARGS+=(--timeout="${CPU_TEST_TIMEOUT_S:-120}"); fi
    # With cores to spare the CPU suite runs beside the GPU tests (one process at a time on the
    # GPU), which halves the tests' wall time; never beside the benchmarks, which time things.
    cores=$(nproc 2>/dev/null || echo 1)
    beside=${CPU_TESTS_BESIDE:-auto}
    if [ "$beside" = "auto" ]; then
      beside=0
      if [ "$cores" -ge 8 ] && want gpu_tests; then beside=1; fi
    fi
    workers=${CPU_TESTS_WORKERS:-auto}
    if [ "$workers" = "auto" ]; then
      workers=0
      if "$PY" -c "import xdist" >/dev/null 2>&1 && [ "$cores" -ge 8 ]; then
        workers=4
        # Beside the GPU tests: leave their one process (and the GPU's driver threads) cores of their own.
        if [ "$beside" = "1" ] && [ $((cores / 2 - 2)) -gt 4 ]; then workers=$((cores / 2 - 2)); fi
      fi
    fi
    # pytest-xdist starts fresh interpreters (no fork); a worker that crashes is replaced and its
    # test reported as failed. --dist loadfile keeps each file's tests, in order, in one worker.
    if [ "$workers" -gt 0 ]; then CPU_ARGS+=(-n "$workers" --dist loadfile); fi
    # Each worker (and every subprocess a test starts) would otherwise run torch's ops on one thread
    # per core: 6 workers x 16 threads on 16 cores. The CPU tests' tensors are tiny; a share of the
    # cores each (CPU_TESTS_THREADS) keeps them from fighting over the cores.
    threads=${CPU_TESTS_THREADS:-$(( workers > 0 ? (cores / (workers + 1) > 1 ? cores / (workers + 1) : 1) : 0 ))}
    THREAD_ENV=()
    if [ "$threads" -gt 0 ]; then THREAD_ENV=(env "OMP_NUM_THREADS=$threads" "MKL_NUM_THREADS=$threads"); fi
    # shellcheck disable=SC2086  # CPU_TEST_PATHS is a space-separated list of paths
    CPU_CMD=("${THREAD_ENV[@]}" "$PY" -X faulthandler -m pytest ${CPU_TEST_PATHS:-tests} "${CPU_ARGS[@]}")
    echo "cpu_tests: ${workers} xdist workers$([ "$threads" -gt 0 ] && echo ", OMP_NUM_THREADS=$threads")"
    # At its time limit it gets SIGINT (STEP_SIGNAL=INT below): pytest then stops like on Ctrl-C and
    # still writes cpu_tests.xml with every test that ran.
    if [ "$beside" = "1" ]; then
      echo
      echo "=== [cpu_tests] starts beside gpu_tests (CPU_TESTS_BESIDE=1); its lines follow when it ends"
      STEP_SIGNAL=INT step cpu_tests "${CPU_TESTS_BUDGET_S:-200}" "$LOGS/3-cpu_tests.log" "${CPU_CMD[@]}" \
        >"$WORK/cpu_step.out" 2>&1 &
      CPU_PID=$!
    else
      STEP_SIGNAL=INT step cpu_tests "${CPU_TESTS_BUDGET_S:-200}" "$LOGS/3-cpu_tests.log" "${CPU_CMD[@]}"
      tail -n 3 "$LOGS/3-cpu_tests.log"
    fi
  else
    not_selected cpu_tests
  fi

  # Every GPU test in one process (benchmarks/_suite_tests.py): torch's start-up is paid once, and
  # a crash still loses one test, not the rest.
  if want gpu_tests; then
    GPU_RUN_ARGS=()
    if [ "${GPU_TESTS_ISOLATE:-0}" = "1" ]; then GPU_RUN_ARGS+=(--isolate); fi
    if [ "${GPU_TESTS_PER_FILE:-0}" = "1" ]; then GPU_RUN_ARGS+=(--per-file); fi
    # shellcheck disable=SC2086  # GPU_TEST_PATHS is a space-separated list of paths
    # In the headline preset the tests get whatever the headline left (step caps at the budget's rest).
    local gpu_budget=200
    if [ -z "$ONLY" ] && [ "$PRESET" = headline ]; then gpu_budget=$BUDGET; fi
    step gpu_tests "${GPU_TESTS_BUDGET_S:-$gpu_budget}" - "$PY" benchmarks/_suite_tests.py run --root "$REPO" \
      --work "$WORK/gpu_tests" --xml "$OUT/gpu_tests.xml" --log "$LOGS/2-gpu_tests.txt" --marker gpu \
      --test-timeout-s "${GPU_TEST_TIMEOUT_S:-120}" "${GPU_RUN_ARGS[@]}" ${GPU_TEST_PATHS:-tests}
    if [ "$LAST_RC" -eq 5 ]; then note_last gpu_tests "no GPU tests were collected"; fi
    if [ "$LAST_RC" -eq 0 ] && [ "$TORCH_GPU" != "1" ]; then note_last gpu_tests "all skipped: no GPU"; fi
  else
    not_selected gpu_tests
  fi
  if [ -n "$CPU_PID" ]; then
    wait "$CPU_PID"
    cat "$WORK/cpu_step.out"
    tail -n 3 "$LOGS/3-cpu_tests.log"
  fi
}

run_bandwidth() {
  # ---- benchmarks ---------------------------------------------------------------------------
  if want bandwidth; then
    step bandwidth 180 - "$PY" benchmarks/bandwidth.py --out "$EXTRAS"
  else
    not_selected bandwidth
  fi
}

run_disk_tier() {
  # ---- disk tier: spill files on the local disk (SPILL_DIR), and what spilling costs a step ----
  if want disk_tier; then
    # 73 s on the H200 on 2026-11-30: the cap leaves room for a slower disk.
    step disk_tier 120 - "$PY" benchmarks/disk_tier.py --dir "${SPILL_DIR:-/tmp}" --out "$EXTRAS"
  else
    not_selected disk_tier
  fi
}

run_hot_path() {
  # ---- hot path: the fixed cost per saved tensor, then per checkpointed call (call_overhead.py,
  # --quick: seconds) -- their files travel in extras.tar.gz ---------------------------------
  if want hot_path; then
    if [ "$TORCH_GPU" = "1" ]; then HOT_ARGS=(); else HOT_ARGS=(--quick); fi
    step hot_path 120 - bash -c '"$1" benchmarks/hot_path.py "${@:3}" --out "$2" &&
      "$1" benchmarks/call_overhead.py --quick --out "$2"' hot_path "$PY" "$EXTRAS" "${HOT_ARGS[@]}"
  else
    not_selected hot_path
  fi
}

run_long_context() {
  # ---- long context: the headline (8B-class layers at 8K-32K, every recipe, A/A noise floor) ----
  # Runs before the overlap benchmark: it is the one a user shops by. Its files go into
  # extras/long_context/; summary.md shows the head of each .md there. Without a GPU: --quick.
  if ! want long_context; then
    not_selected long_context
  elif [ -f benchmarks/long_context.py ]; then
    mkdir -p "$EXTRAS/long_context"
    if [ "$TORCH_GPU" = "1" ]; then LC_ARGS=(--budget-s "$LONG_CONTEXT_BUDGET"); else LC_ARGS=(--quick); fi
    step long_context $((LONG_CONTEXT_BUDGET + 60)) - "$PY" benchmarks/long_context.py "${LC_ARGS[@]}" \
      --out "$EXTRAS/long_context"
  else
    record long_context "SKIPPED" 0 "benchmarks/long_context.py does not exist"
  fi
}

run_store_dtype() {
  # ---- store_dtype: bytes, step time and error of each storage dtype (opt-in) -------------------
  # Not in the default run (the suite's budget goes to the headline); select it with --only or
  # STORE_DTYPE=1. Its files go into extras/store_dtype/. Without a GPU: --quick.
  if ! want store_dtype; then
    not_selected store_dtype
  else
    mkdir -p "$EXTRAS/store_dtype"
    if [ "$TORCH_GPU" = "1" ]; then
      SD_ARGS=(--device cuda --train-steps "${STORE_DTYPE_TRAIN_STEPS:-100}")
    else
      SD_ARGS=(--quick)
    fi
    step store_dtype "${STORE_DTYPE_BUDGET_S:-300}" - "$PY" benchmarks/store_dtype.py "${SD_ARGS[@]}" \
      --out "$EXTRAS/store_dtype"
  fi
}

run_overlap() {
  # ---- overlap: every strategy side by side on the built-in Llama decoder ---------------------
  if want overlap; then
    if [ "$TORCH_GPU" = "1" ]; then
      # Leave a minute of the suite budget for the demo and the summary.
      left=$((BUDGET - ($(date +%s) - START) - 60))
      ob=$((left < OVERLAP_BUDGET ? left : OVERLAP_BUDGET))
      if [ "$ob" -lt 30 ]; then ob=30; fi
      OVERLAP_ARGS=(--model 1b --seq-lens 512,1024,2048,4096 --batch 1 --steps 8 --warmup 2 --budget-s "$ob")
    else
      OVERLAP_ARGS=(--quick)   # the CPU path: a tiny model, CPU numbers (the files say so)
    fi
    step overlap 200 - "$PY" benchmarks/overlap.py "${OVERLAP_ARGS[@]}" --no-progress --out "$EXTRAS"
  else
    not_selected overlap
  fi
}

run_planner() {
  # ---- planner sweep: co.plan vs Chen / HF / TE / recompute-only, budgets down to the minimum ----
  # Its files go into extras/planner/ (OUT_DIR keeps its 8 files); summary.md gets its headline.
  if want planner; then
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
  else
    not_selected planner
  fi
}

run_demo() {
  # ---- demo (only if someone has written it) ------------------------------------------------
  if ! want demo; then
    not_selected demo
  elif "$PY" -c "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('ckpt_offload.__main__') else 1)" \
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
}

main() {
  echo "ckpt_offload GPU suite: $(date -u +%Y-%m-%dT%H:%M:%SZ), repo $REPO, out $OUT, python $PY, budget ${BUDGET}s"
  echo "steps: $([ -n "$ONLY" ] && echo "only $ONLY" || echo "preset $PRESET")${SKIP:+ skip $SKIP}$([ "${DIAGNOSE:-0}" = 1 ] && echo ', DIAGNOSE=1')"

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
  # The compiler the build will use (torch's extension builder takes $CXX, else c++), and its version:
  # the extension mixes this compiler's libstdc++ with the copies torch's libraries export.
  echo "CXX=${CXX:-(unset: c++)}: $( (${CXX:-c++} --version 2>/dev/null || echo 'not found') | head -n 1)"
  if command -v ninja >/dev/null 2>&1; then
    echo "ninja: $(command -v ninja) $(ninja --version)"
  elif "$PY" -c "import ninja" >/dev/null 2>&1; then
    echo "ninja: python package only (torch finds it through the ninja package's bin dir when on PATH)"
  else
    echo "ninja: NOT FOUND - torch.utils.cpp_extension falls back to the serial distutils backend" \
      "(a warning, not an error; the build is slower and MAX_JOBS has no effect)"
  fi
  for tool in cuda-gdb gdb compute-sanitizer; do
    echo "$tool: $(command -v "$tool" || echo 'not on PATH')"
  done
  (git -C "$REPO" rev-parse HEAD 2>/dev/null && git -C "$REPO" status --short 2>/dev/null | head -n 20) ||
    echo "git: no repository here (copied working tree)"
  "$PY" - <<'EOF' || true
import importlib.util, platform, sys
print("python", platform.python_version(), sys.executable)
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.version.cuda, "cuda available", torch.cuda.is_available(),
          "devices", torch.cuda.device_count())
    if torch.cuda.is_available():
        print("device 0:", torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
    with open("/proc/self/maps") as f:  # which libstdc++ the process loaded (next to torch's own copies)
        print("libstdc++:", " ".join(sorted({l.split()[-1] for l in f if "libstdc++" in l})) or "not loaded")
except Exception as e:
    print("torch: import failed:", e)
try:
    import pytest
    print("pytest", pytest.__version__, "plugins:",
          ", ".join(m for m in ("pytest_timeout", "xdist") if importlib.util.find_spec(m)) or "none")
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

  # The steps, in this order; each runs where `want` selects it (--preset, --only, --skip) and
  # is recorded as not selected otherwise. The headline (long_context) comes before the tests.
  run_build
  run_build_info
  run_diagnose
  run_long_context
  run_tests
  run_store_dtype
  run_planner
  run_overlap
  run_disk_tier
  run_bandwidth
  run_hot_path
  run_demo

  # ---- the files that come back -------------------------------------------------------------
  # The test logs as one text file (diagnose, GPU tests, CPU tests, in that order), each part
  # already in sections under "=====" headers; 15 MiB at most (a returned file's limit is 16).
  {
    for f in "$LOGS"/*; do
      [ -f "$f" ] || continue
      case "$f" in
        *.log) h=${f##*/[0-9]-}
          printf '\n%s\n===== %s\n%s\n' "$(printf '=%.0s' {1..100})" "${h%.log} step: its pytest output" \
            "$(printf '=%.0s' {1..100})"
          cat "$f" ;;
        *) cat "$f" ;;
      esac
    done
  } | head -c 15728640 >"$OUT/test_logs.txt"
  for f in bandwidth.md overlap.md; do
    if [ -f "$EXTRAS/$f" ]; then cp "$EXTRAS/$f" "$OUT/$f"; fi
  done

  # ---- summary ------------------------------------------------------------------------------
  echo
  "$PY" benchmarks/_suite_summary.py "$OUT" "$WORK" "$(($(date +%s) - START))" ||
    record summary "FAIL" 0 "summary.md could not be written"

  # Everything else in one file: OUT_DIR stays within the 8 files a GPU-machine run returns.
  tar czf "$OUT/extras.tar.gz" -C "$WORK" extras || echo "WARNING: extras.tar.gz could not be written"
  echo
  echo "=== files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
  nfiles=0
  for f in $OUT_FILES; do if [ -f "$OUT/$f" ]; then nfiles=$((nfiles + 1)); fi; done
  if [ "$nfiles" -gt 8 ]; then echo "WARNING: this run wrote $nfiles files in $OUT; only 8 come back from the GPU machine"; fi
  # A step run in the background recorded its row in a subshell: the table is the truth.
  if awk -F'\t' '$2 ~ /^(FAIL|TIMEOUT)/ { bad = 1 } END { exit !bad }' "$STEPS"; then FAILED=1; fi
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
