"""benchmarks/hot_path.py --quick on CPU: the files it writes and what they report (never times)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

from helpers import REPO_ROOT

ROOT = REPO_ROOT
if os.path.join(ROOT, "benchmarks") not in sys.path:
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def _load():
    spec = importlib.util.spec_from_file_location("hot_path_benchmark", os.path.join(ROOT, "benchmarks", "hot_path.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


VARIANTS = [
    "plain",
    "identity",
    "save_on_cpu",
    "clone_hook",
    "co_keep",
    "co_offload_compute",
    "co_offload_side",
    "co_prefetch",
    "co_batch",
]


def test_quick_run_writes_json_and_markdown(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "benchmarks", "hot_path.py"),
            "--quick",
            "--device",
            "cpu",
            "--blocks",
            "4",
            "--rounds",
            "3",
            "--reps",
            "2",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.load(open(tmp_path / "hot_path.json"))
    assert r["mode"] == "cpu" and r["args"]["clock"] == "process" and r["args"]["quick"]
    assert r["method"] == "shuffled-rounds/v2" and r["args"]["reps"] == 2
    # 4 blocks: each saves the Linear's input and tanh's output (the weight's view is a parameter)
    assert r["saved_tensors_per_step"] == 4 * 3
    assert [x["variant"] for x in r["results"]] == VARIANTS
    by = {x["variant"]: x for x in r["results"]}
    assert by["plain"]["per_tensor"] is None
    for name in VARIANTS[1:]:
        for phase in ("forward", "backward", "total"):
            p = by[name]["per_tensor"][phase]
            assert p["p25_us"] <= p["median_us"] <= p["p75_us"]
    # What each co variant did in its last step: the default min_bytes keeps the 4 KiB tensors;
    # min_bytes=0 offloads the input and the 4 tanh outputs, each tanh output but the last saved
    # again as the next Linear's input (deduplicated); the weights' views stay (parameters).
    assert by["co_keep"]["offloaded"] == 0
    assert by["co_keep"]["kept_by_reason"] == {"parameter": 4, "too_small": 8}
    for name in ("co_offload_compute", "co_offload_side", "co_prefetch", "co_batch"):
        assert by[name]["offloaded"] == 5 and by[name]["deduplicated"] == 3, by[name]
        assert by[name]["kept_by_reason"] == {"parameter": 4}
    assert set(r["ratios"]) == {"keep_vs_save_on_cpu", "offload_vs_clone_hook"}
    assert r["ratios"]["keep_vs_save_on_cpu"]["numerator"] == "co_keep"
    # Each ratio and A/A pair is a median of per-round ratios, with its spread (None only when no
    # round had a positive denominator).
    assert set(r["aa"]) == {"save_on_cpu", "clone_hook"}
    for v in list(r["ratios"].values()) + list(r["aa"].values()):
        if v["ratio"] is not None:
            assert v["min"] <= v["p25"] <= v["ratio"] <= v["p75"] <= v["max"], v
    assert r["aa"]["clone_hook"]["numerator"] == "clone_hook (again)"
    md = (tmp_path / "hot_path.md").read_text()
    assert "CPU numbers, not GPU numbers" in md
    for name in VARIANTS:
        assert f"| {name} |" in md
    assert "keep_vs_save_on_cpu" in md and "offload_vs_clone_hook" in md
    assert out.stdout.strip() == md.strip()


def test_rounds_shuffle_the_arms_so_no_arm_always_follows_the_same_one():
    hp = _load()
    names = ["plain", "a", "b", "c", "d", "e"]
    orders = hp.round_orders(names, 30, seed=0)
    assert len(orders) == 30 and all(sorted(o) == sorted(names) for o in orders)
    assert orders == hp.round_orders(names, 30, seed=0)  # seeded: a run can be repeated
    assert orders != hp.round_orders(names, 30, seed=1)
    # A rotation gives every arm one predecessor for good; shuffled rounds give each several,
    # and put each arm first in some round.
    for n in names:
        before = {o[o.index(n) - 1] for o in orders if o.index(n) > 0}
        assert len(before) >= 3, (n, before)
    assert {o[0] for o in orders} == set(names)


def test_spread_and_bad_reps():
    hp = _load()
    assert hp.spread([3.0, 1.0, None, 2.0]) == {"median": 2.0, "p25": 1.5, "p75": 2.5, "min": 1.0, "max": 3.0}
    assert hp.spread([None])["median"] is None
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "hot_path.py"), "--device", "cpu", "--reps", "0"],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "--reps must be at least 1, got 0" in out.stderr
