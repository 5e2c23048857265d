"""The GPU suite's test runner (benchmarks/_suite_tests.py), on CPU: a segfaulting test costs one test.

Synthetic test folders (a custom `gpu` marker, no torch) hold passing, failing, skipped, segfaulting
and hanging tests. The runner must run them all in one pytest process, record every test in the
merged junit XML (a crash as an error with signal 11 and faulthandler's output, a hang as a
timeout), rerun the crashing test alone, run every test left (of every file) in one fresh process,
and name every failure in the summary's markdown. The processes it started are counted by the
log's `=====` section headers, one per process.
"""

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import xml.etree.ElementTree as ET

import pytest
from helpers import REPO_ROOT

ROOT = REPO_ROOT
RUNNER = os.path.join(ROOT, "benchmarks", "_suite_tests.py")

SYNTHETIC = """
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
"""


def run_runner(tmp_path, *extra, files=None, budget_s=120, backtrace=False):
    """Writes `files` (name -> source; default: test_mix.py) under tmp_path/t and runs the runner on them."""
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: synthetic\n")
    for name, src in (files or {"test_mix.py": SYNTHETIC}).items():
        (tmp_path / "t" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "t" / name).write_text(textwrap.dedent(src))
    xml, log, md = tmp_path / "gpu_tests.xml", tmp_path / "test_logs.txt", tmp_path / "section.md"
    env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")  # a few seconds faster; none is needed
    env.pop("SUITE_TESTS_RECORD", None)
    p = subprocess.run(
        [
            sys.executable,
            RUNNER,
            "run",
            "--root",
            str(tmp_path / "t"),
            "--work",
            str(tmp_path / "work"),
            "--xml",
            str(xml),
            "--log",
            str(log),
            "--summary",
            str(md),
            "--budget-s",
            str(budget_s),
            "--test-timeout-s",
            "0",
            *([] if backtrace else ["--no-backtrace"]),
            *extra,
            ".",
        ],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )
    return p, xml, log, md


def headers(log):
    """The log's section headers: one per process the runner started."""
    return [ln[len("===== ") :] for ln in log.read_text().splitlines() if ln.startswith("===== ")]


def xml_cases(xml):
    """name -> (outcome, its <error>/<failure>/<skipped> element or None) from the merged XML."""
    out = {}
    for tc in ET.parse(xml).getroot().iter("testcase"):
        el = next((tc.find(k) for k in ("error", "failure", "skipped") if tc.find(k) is not None), None)
        out[tc.get("name")] = (
            el.get("type", el.tag) if el is not None and el.tag == "error" else el.tag if el is not None else "passed",
            el,
        )
    return out


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

    # The process of every test, the crashing test alone, the tests after it: one section each (no
    # separate collection: the first process records what it collected).
    heads = headers(log)
    assert len(heads) == 3, heads
    assert "killed by SIGSEGV" in heads[0]
    assert heads[2].startswith("the 1 tests after test_mix.py::test_b_segfaults (exit 1")

    summary = md.read_text()
    assert "3 tests: 1 passed, 1 failed, 1 errors (1 crashed), 0 skipped" in summary
    for name in ("test_b_segfaults", "test_c_fails"):
        assert f"test_mix::{name}" in summary
    assert "**CRASHED** `test_mix::test_b_segfaults`: SIGSEGV (signal 11)" in summary
    assert "line one of the failure" in summary and "Segmentation fault" in summary


# Three files: with --first b/, b's tests run first; test_b2 kills the process after test_b1.
THREE_FILES = {
    "a/test_one.py": """
        import pytest

        @pytest.mark.gpu
        def test_a1():
            pass

        @pytest.mark.gpu
        def test_a2():
            pass
        """,
    "b/test_two.py": """
        import os
        import signal

        import pytest

        @pytest.mark.gpu
        def test_b1():
            pass

        @pytest.mark.gpu
        def test_b2_segfaults():
            os.kill(os.getpid(), signal.SIGSEGV)

        @pytest.mark.gpu
        @pytest.mark.parametrize("x", [1, 2])
        def test_b3(x):
            assert x == 1, "b3 fails for 2"
        """,
    "c/test_three.py": """
        import pytest

        @pytest.mark.gpu
        def test_c1():
            pass

        @pytest.mark.gpu
        def test_c2():
            pytest.skip("c2 skips")

        def test_not_gpu():
            pass
        """,
}
THREE_FILES_OUTCOMES = {
    "test_a1": "passed",
    "test_a2": "passed",
    "test_b1": "passed",
    "test_b2_segfaults": "crashed",
    "test_b3[1]": "passed",
    "test_b3[2]": "failure",
    "test_c1": "passed",
    "test_c2": "skipped",
}


@pytest.mark.parametrize(
    ("mode", "processes"),
    [
        ((), 3),  # every test, test_b2 alone, every test left (of b, a and c) in one fresh process
        (("--isolate",), 8),  # every test, test_b2 alone, then each of the 6 left alone
        (("--per-file",), 6),  # a collection, then b, test_b2 alone, the rest of b, a, c
    ],
    ids=["one-process", "isolate", "per-file"],
)
def test_one_process_for_every_file_and_one_for_the_rest_after_a_crash(tmp_path, mode, processes):
    p, xml, log, md = run_runner(tmp_path, "--first", "b/", *mode, files=THREE_FILES)
    assert p.returncode == 1, p.stdout + p.stderr
    cases = xml_cases(xml)
    assert {name: outcome for name, (outcome, _) in cases.items()} == THREE_FILES_OUTCOMES  # not_gpu: deselected
    crash = cases["test_b2_segfaults"][1]
    assert crash.get("signal") == "11" and "Fatal Python error: Segmentation fault" in crash.text
    assert "b3 fails for 2" in cases["test_b3[2]"][1].text
    heads = headers(log)
    assert len(heads) == processes, heads
    assert "8 tests: 5 passed, 1 failed, 1 errors (1 crashed), 1 skipped" in md.read_text()
    if mode:
        return
    assert "collection" not in " ".join(heads)  # the first process recorded what it collected
    assert heads[0].startswith(".: every `gpu` test, one process (killed by SIGSEGV")
    assert heads[1].startswith("b/test_two.py::test_b2_segfaults (alone, after the process died by SIGSEGV")
    assert heads[2].startswith("the 6 tests after b/test_two.py::test_b2_segfaults (exit 1")
    sections = log.read_text().split("\n===== ")[1:]
    # --first b/: test_b1 ran first, then the crash; a's and c's tests had not started.
    ran_first = [ln.split()[0] for ln in sections[0].splitlines() if ln.endswith("%]")]
    assert ran_first == ["b/test_two.py::test_b1"], sections[0]
    # The rest: b's two tests left by node id, a and c (none of theirs ran) as whole files, b first.
    cmd = next(ln for ln in sections[2].splitlines() if ln.startswith("$ "))
    assert " b/test_two.py::test_b3[1] b/test_two.py::test_b3[2] a/test_one.py c/test_three.py -m gpu " in cmd
    ran_rest = [ln.split()[0] for ln in sections[2].splitlines() if ln.endswith("%]")]
    assert ran_rest == [
        "b/test_two.py::test_b3[1]",
        "b/test_two.py::test_b3[2]",
        "a/test_one.py::test_a1",
        "a/test_one.py::test_a2",
        "c/test_three.py::test_c1",
        "c/test_three.py::test_c2",
    ]


HANG = {
    "test_a.py": """
        import time

        import pytest

        @pytest.mark.gpu
        def test_before():
            pass

        @pytest.mark.gpu
        def test_hangs():
            time.sleep(60)
        """,
    "test_z.py": """
        import pytest

        @pytest.mark.gpu
        def test_after():
            pass
        """,
}


def test_a_hanging_test_is_killed_and_the_rest_run(tmp_path):
    # The runner's own per-test limit (for a hang pytest-timeout cannot interrupt, or no pytest-timeout).
    p, xml, log, md = run_runner(tmp_path, "--hang-timeout-s", "2", files=HANG)
    assert p.returncode == 1, p.stdout + p.stderr
    cases = xml_cases(xml)
    assert {name: outcome for name, (outcome, _) in cases.items()} == {
        "test_before": "passed",
        "test_hangs": "timeout",
        "test_after": "passed",
    }
    hang = cases["test_hangs"][1]
    assert "ran past 2s" in hang.get("message")
    assert "Fatal Python error: Aborted" in hang.text and "in test_hangs" in hang.text  # faulthandler's stacks
    heads = headers(log)
    assert len(heads) == 2, heads  # not rerun alone: it would only hang again
    assert "TIMED OUT: test_hangs ran past 2s" in heads[0] and heads[1].startswith("the 1 tests after test_a.py::")
    assert "**TIMED OUT** `test_a::test_hangs`" in md.read_text()


def test_a_test_cut_off_by_the_budget_is_not_run_and_so_is_the_rest(tmp_path):
    # 8 s: time for test_before on a loaded machine; test_hangs then runs until the budget is spent.
    p, xml, log, md = run_runner(tmp_path, "--min-left-s", "1", files=HANG, budget_s=8)
    assert p.returncode == 1, p.stdout + p.stderr
    cases = xml_cases(xml)
    assert {name: outcome for name, (outcome, _) in cases.items()} == {
        "test_before": "passed",
        "test_hangs": "notrun",
        "test_after": "notrun",
    }
    assert "the step's time budget ran out while it ran" in cases["test_hangs"][1].get("message")
    assert "time budget" in cases["test_after"][1].get("message")
    heads = headers(log)
    assert len(heads) == 1 and "the step's budget" in heads[0], heads
    assert "3 tests: 1 passed, 0 failed, 2 errors (2 not run)" in md.read_text()


def test_a_stopped_runner_keeps_what_its_running_process_finished(tmp_path):
    # The suite's `timeout` sends SIGTERM: with every test in one process, its record is most of the results.
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: synthetic\n")
    for name, src in HANG.items():
        (tmp_path / "t" / name).write_text(textwrap.dedent(src))
    xml, record = tmp_path / "gpu_tests.xml", tmp_path / "work" / "p1.jsonl"
    env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    env.pop("SUITE_TESTS_RECORD", None)
    p = subprocess.Popen(
        [
            sys.executable,
            RUNNER,
            "run",
            "--root",
            str(tmp_path / "t"),
            "--work",
            str(tmp_path / "work"),
            "--xml",
            str(xml),
            "--log",
            str(tmp_path / "test_logs.txt"),
            "--budget-s",
            "120",
            "--test-timeout-s",
            "0",
            "--no-backtrace",
            ".",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    try:
        deadline = time.monotonic() + 60
        while not (record.exists() and '"start", "nodeid": "test_a.py::test_hangs"' in record.read_text()):
            assert time.monotonic() < deadline and p.poll() is None, "test_hangs never started"
            time.sleep(0.1)
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == 124
    finally:
        p.kill()
    cases = xml_cases(xml)
    assert {name: outcome for name, (outcome, _) in cases.items()} == {
        "test_before": "passed",
        "test_hangs": "notrun",
        "test_after": "notrun",
        "<runner>": "timeout",
    }
    assert "stopped by SIGTERM while it ran" in cases["test_hangs"][1].get("message")


@pytest.mark.skipif(not (shutil.which("cuda-gdb") or shutil.which("gdb")), reason="neither cuda-gdb nor gdb on PATH")
def test_a_crash_gets_a_native_backtrace_after_every_test(tmp_path):
    p, xml, log, _ = run_runner(tmp_path, backtrace=True)
    assert p.returncode == 1, p.stdout + p.stderr
    heads = headers(log)
    assert len(heads) == 4, heads  # every test, the crash alone, the test after it, then the debugger
    assert heads[3].startswith("test_mix.py::test_b_segfaults: native backtrace, "), heads
    debugger_out = log.read_text().split("\n===== ")[4]
    if "received signal" not in debugger_out and "ptrace" in debugger_out:
        pytest.skip("the debugger may not trace a process here (ptrace refused)")
    crash = xml_cases(xml)["test_b_segfaults"][1]
    assert "native backtrace" in crash.get("message") and crash.get("signal") == "11"
    assert "received signal SIGSEGV" in crash.text  # the debugger's stop, with the innermost frames


SUITE = os.path.join(ROOT, "benchmarks", "gpu_suite.sh")
STEPS = [
    "build",
    "build_info",
    "diagnose",
    "long_context",
    "gpu_tests",
    "cpu_tests",
    "store_dtype",
    "planner",
    "overlap",
    "disk_tier",
    "bandwidth",
    "hot_path",
    "demo",
]


def test_suite_steps_are_listed_and_an_unknown_step_is_a_usage_error(tmp_path):
    # Only the argument parsing runs: nothing is built, no OUT_DIR is made.
    h = subprocess.run(["bash", SUITE, "--help"], check=False, capture_output=True, text=True, timeout=30)
    assert h.returncode == 0
    listed = [ln.split()[0] for ln in h.stdout.splitlines() if ln.startswith("  ") and ln.split()[0] in STEPS]
    assert listed == STEPS  # every step, in the order they run
    for args in (["--only", "build,gpu_test"], ["--skip", "bandwith"], ["--only"]):
        p = subprocess.run(
            ["bash", SUITE, str(tmp_path / "out"), *args], check=False, capture_output=True, text=True, timeout=30
        )
        assert p.returncode == 2, args
        assert "valid steps: build, build_info, diagnose, long_context, gpu_tests" in p.stderr, p.stderr
        assert not (tmp_path / "out").exists()
    p = subprocess.run(
        ["bash", SUITE, str(tmp_path / "out"), "--only", "build,gpu_test"],
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert "unknown step 'gpu_test' in --only" in p.stderr


def suite_list(*args, env=None):
    p = subprocess.run(
        ["bash", SUITE, "--list", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "DIAGNOSE": "0", "STORE_DTYPE": "0", **(env or {})},
    )
    return p.returncode, p.stdout.split(), p.stderr


def test_a_lease_runs_the_headline_first_and_the_rest_second():
    # The default is what a GPU lease runs first: the build, the long-context headline, then every GPU test with the
    # time left; no CPU suite (CI runs it). The second command's preset is the other benchmarks, most wanted first.
    assert suite_list() == (0, ["build", "build_info", "long_context", "gpu_tests"], "")
    assert suite_list("--preset", "rest")[1] == [
        "build",
        "build_info",
        "store_dtype",
        "planner",
        "overlap",
        "disk_tier",
        "bandwidth",
        "hot_path",
        "demo",
    ]
    rc, every, _ = suite_list("--preset", "all")
    assert rc == 0 and every == [s for s in STEPS if s not in ("diagnose", "store_dtype")]
    assert suite_list("--preset", "all", env={"DIAGNOSE": "1", "STORE_DTYPE": "1"})[1] == STEPS
    # --only picks steps whatever the preset, in the suite's order; --skip leaves steps out of the preset.
    assert suite_list("--only", "gpu_tests,build")[1] == ["build", "gpu_tests"]
    assert suite_list("--skip", "gpu_tests")[1] == ["build", "build_info", "long_context"]
    rc, _, err = suite_list("--preset", "everything")
    assert rc == 2 and "unknown preset 'everything'; valid presets: headline, rest, all" in err
