"""benchmarks/hot_path.py --quick on CPU: the files it writes and what they report (never times)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers import REPO_ROOT

ROOT = REPO_ROOT
VARIANTS = ["plain", "identity", "save_on_cpu", "clone_hook", "co_keep", "co_offload_compute", "co_offload_side",
            "co_prefetch", "co_batch"]


def test_quick_run_writes_json_and_markdown(tmp_path):
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "hot_path.py"), "--quick", "--device", "cpu",
         "--blocks", "4", "--rounds", "3", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.load(open(tmp_path / "hot_path.json"))
    assert r["mode"] == "cpu" and r["args"]["clock"] == "process" and r["args"]["quick"]
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
    md = (tmp_path / "hot_path.md").read_text()
    assert "CPU numbers, not GPU numbers" in md
    for name in VARIANTS:
        assert f"| {name} |" in md
    assert "keep_vs_save_on_cpu" in md and "offload_vs_clone_hook" in md
    assert out.stdout.strip() == md.strip()
