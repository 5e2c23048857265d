"""The GPU suite's test runner (benchmarks/_suite_tests.py), on CPU: a segfaulting test costs one test.

A synthetic test folder holds a passing test, a test that kills its process with SIGSEGV and a
failing test after it. The runner must record all three in the merged junit XML (the crash as an
error with signal 11 and faulthandler's output), run the test after the crash in a fresh process,
and name every failure in the summary's markdown.
"""

import os
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET

from helpers import REPO_ROOT

ROOT = REPO_ROOT
RUNNER = os.path.join(ROOT, "benchmarks", "_suite_tests.py")

SYNTHETIC = '''
import os
import signal

import pytest


@pytest.mark.gpu
def test_a_passes():
    assert 1 + 1 == 2


@pytest.mark.gpu
def test_b_segfaults():
    os.kill(os.getpid(), signal.SIGSEGV)


@pytest.mark.gpu
def test_c_fails():
    assert "after the crash" == "ran in a fresh process", "line one of the failure"


def test_not_gpu():
    pass
'''


def run_runner(tmp_path, *extra):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: synthetic\n")
    (tmp_path / "t" / "test_mix.py").write_text(textwrap.dedent(SYNTHETIC))
    xml, log, md = tmp_path / "gpu_tests.xml", tmp_path / "test_logs.txt", tmp_path / "section.md"
    env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")  # a few seconds faster; none is needed
    env.pop("SUITE_TESTS_RECORD", None)
    p = subprocess.run(
        [sys.executable, RUNNER, "run", "--root", str(tmp_path / "t"), "--work", str(tmp_path / "work"),
         "--xml", str(xml), "--log", str(log), "--summary", str(md), "--budget-s", "120",
         "--test-timeout-s", "0", "--no-backtrace", *extra, "."],
        capture_output=True, text=True, env=env, timeout=180)
    return p, xml, log, md


def test_crash_costs_one_test(tmp_path):
    p, xml, log, md = run_runner(tmp_path)
    assert p.returncode == 1, p.stdout + p.stderr  # a failure and a crash: not green

    suite = ET.parse(xml).getroot().find("testsuite")
    counts = tuple(suite.get(k) for k in ("tests", "failures", "errors", "crashed"))
    assert counts == ("3", "1", "1", "1")
    cases = {tc.get("name"): tc for tc in suite.iter("testcase")}
    assert set(cases) == {"test_a_passes", "test_b_segfaults", "test_c_fails"}  # not_gpu: deselected
    assert cases["test_a_passes"].find("failure") is None and cases["test_a_passes"].find("error") is None
    assert "line one of the failure" in cases["test_c_fails"].find("failure").text
    crash = cases["test_b_segfaults"].find("error")
    assert crash.get("type") == "crashed" and crash.get("signal") == "11"
    assert "SIGSEGV" in crash.get("message")
    assert "Fatal Python error: Segmentation fault" in crash.text  # faulthandler's output
    assert "test_b_segfaults" in crash.text  # ... with the crashing test's frame

    # The crashed file's process, the crashing test alone, the tests after it: one section each.
    text = log.read_text()
    assert text.count("\n===== ") == 4, text  # collection + those three
    assert "killed by SIGSEGV" in text and "the 1 tests after test_b_segfaults (exit 1" in text

    summary = md.read_text()
    assert "3 tests: 1 passed, 1 failed, 1 errors (1 crashed), 0 skipped" in summary
    for name in ("test_b_segfaults", "test_c_fails"):
        assert f"test_mix::{name}" in summary
    assert "**CRASHED** `test_mix::test_b_segfaults`: SIGSEGV (signal 11)" in summary
    assert "line one of the failure" in summary and "Segmentation fault" in summary


SUITE = os.path.join(ROOT, "benchmarks", "gpu_suite.sh")
STEPS = ["build", "build_info", "diagnose", "gpu_tests", "cpu_tests", "bandwidth", "disk_tier", "hot_path",
         "overlap", "long_context", "planner", "demo"]


def test_suite_steps_are_listed_and_an_unknown_step_is_a_usage_error(tmp_path):
    # Only the argument parsing runs: nothing is built, no OUT_DIR is made.
    h = subprocess.run(["bash", SUITE, "--help"], capture_output=True, text=True, timeout=30)
    assert h.returncode == 0
    listed = [ln.split()[0] for ln in h.stdout.splitlines() if ln.startswith("  ") and ln.split()[0] in STEPS]
    assert listed == STEPS  # every step, in the order they run
    for args in (["--only", "build,gpu_test"], ["--skip", "bandwith"], ["--only"]):
        p = subprocess.run(["bash", SUITE, str(tmp_path / "out"), *args], capture_output=True, text=True, timeout=30)
        assert p.returncode == 2, args
        assert "valid steps: build, build_info, diagnose, gpu_tests" in p.stderr, p.stderr
        assert not (tmp_path / "out").exists()
    p = subprocess.run(["bash", SUITE, str(tmp_path / "out"), "--only", "build,gpu_test"], capture_output=True,
                       text=True, timeout=30)
    assert "unknown step 'gpu_test' in --only" in p.stderr
