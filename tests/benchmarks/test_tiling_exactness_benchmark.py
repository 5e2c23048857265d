"""benchmarks/tiling_exactness.py --quick on CPU: what it reports about tiling's error against the
untiled run (float32), never how fast anything ran."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

from helpers import REPO_ROOT

if os.path.join(REPO_ROOT, "benchmarks") not in sys.path:
    sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))


def _load():
    spec = importlib.util.spec_from_file_location(
        "tiling_exactness_benchmark", os.path.join(REPO_ROOT, "benchmarks", "tiling_exactness.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_run_reports_the_error_against_the_untiled_run(tmp_path):
    te = _load()
    assert te.main(["--quick", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "tiling_exactness_cpu.json").read_text())
    g, t = report["gradients"], report["training"]
    # float32: parameter gradients differ by their summation order only; the loss of a step too
    assert 0 < g["max_rel_error"] <= 1e-5 and g["loss_rel_error"] <= 1e-6
    assert g["bit_identical_params"] < g["params"] and g["tiles_per_mlp_call"] > 1
    assert t["aa_max_deviation"] == 0  # the untiled run repeats itself exactly
    steps = report["args"]["steps"]
    assert len(t["curves"]["tiled_seed0"]) == len(t["seed_spread_std"]) == steps
    assert t["max_tiled_deviation"] < t["min_seed_spread"]  # far inside the seed-to-seed spread
    md = (tmp_path / "tiling_exactness_cpu.md").read_text()
    assert "max relative gradient error" in md and "seed-to-seed spread" in md
