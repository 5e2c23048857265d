"""benchmarks/store_dtype.py --quick on CPU: every arm ran, the bytes each storage dtype reports are
the ones its format implies, exact storage is bit-exact, and the lossy arms' errors are within the
formats' bounds.

The benchmark measures; these tests check what it reports, never how fast anything ran.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from helpers import REPO_ROOT

ROOT = REPO_ROOT
SCRIPT = os.path.join(ROOT, "benchmarks", "store_dtype.py")

# The largest relative rounding error of one value (round to nearest, p significant bits: 2^-p),
# for values in the format's normal range; a norm-relative error of a tensor is below it.
UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11, "fp8_e4m3": 2.0**-4, "fp8_e5m2": 2.0**-3}
# Stated bounds on the gradient error per step (||g - g_exact|| / ||g_exact||) of the tiny model.
GRAD_BOUND = {"bf16": 1e-2, "fp16": 1e-2, "fp8_e4m3": 0.3, "fp8_e5m2": 0.3}
# ... and on the loss difference after the quick run's 20 Adam steps (the loss is about 4.6).
LOSS_BOUND = {"bf16": 0.02, "fp16": 0.02, "fp8_e4m3": 0.1, "fp8_e5m2": 0.1}
SCALED = ("fp8_e4m3", "fp8_e5m2")


def _load():
    spec = importlib.util.spec_from_file_location("store_dtype_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def sd():
    return _load()


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """The script as a user runs it: its own process, its own import of the package."""
    out = tmp_path_factory.mktemp("store_dtype")
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out / "store_dtype.json") as f:
        report = json.load(f)
    return proc, out, report


def test_quick_run_writes_outputs_labelled_cpu(quick_run, sd):
    proc, out, report = quick_run
    md = (out / "store_dtype.md").read_text()
    assert report["device"] == "cpu" and "(CPU)" in md.splitlines()[0] and "CPU numbers, not GPU numbers" in md
    assert md.strip() in proc.stdout  # the table printed is the one written
    for arm in sd.ARMS:
        assert f"| {arm} |" in md
    cfg = report["config"]
    assert cfg["name"] == "tiny" and cfg["dropout"] == 0.0
    assert report["clock"] == "process" and report["cpu_threads"] == 1


def test_every_arm_timed_over_interleaved_rounds(quick_run, sd):
    _, _, report = quick_run
    args, arms = report["args"], report["arms"]
    assert list(arms) == list(sd.ARMS) and args["rounds"] >= 3
    for r in arms.values():
        assert len(r["step_times_s"]) == args["rounds"] * args["steps"]
        assert len(r["per_round_median_s"]) == args["rounds"]
        assert 0 < r["min_step_s"] <= r["median_step_s"] <= r["max_step_s"]
        assert r["time_ratio_to_exact"] == pytest.approx(r["median_step_s"] / arms["exact"]["median_step_s"])
        assert r["aa_ratio"] == pytest.approx(arms["exact_aa"]["median_step_s"] / arms["exact"]["median_step_s"])


def test_exact_storage_stores_every_byte_and_is_bit_identical(quick_run):
    _, _, report = quick_run
    for name in ("exact", "exact_aa"):
        r = report["arms"][name]
        assert r["store_dtype"] is None and r["tensors_converted"] == 0
        assert r["bytes_stored"] == r["bytes_offloaded"] > 0 and r["stored_ratio"] == 1.0
        assert r["grad_bit_identical"] and r["grad_rel_error_max"] == 0.0
        assert r["stats_constant_over_steps"]
    assert report["arms"]["exact_aa"]["bytes_offloaded"] == report["arms"]["exact"]["bytes_offloaded"]


def _token_bytes(cfg) -> int:
    """The only saved tensors no storage dtype converts: the int64 token ids. The model's input
    ``tokens[:, :-1]`` (a view of the (batch, seq + 1) batch: its span ends at the last row's
    seq-th element) for the embedding, and the targets ``tokens[:, 1:].reshape(-1)`` (a copy)
    for the cross-entropy. The position table and the causal mask are a parameter and a buffer:
    kept, not offloaded."""
    b, s = cfg["batch"], cfg["seq"]
    return ((b - 1) * (s + 1) + s) * 8 + b * s * 8


def test_lossy_arms_store_the_bytes_their_format_implies(quick_run, sd):
    _, _, report = quick_run
    arms = report["arms"]
    first = arms[sd.LOSSY_ARMS[0]]
    exact_part = _token_bytes(report["config"])
    converted = first["tensors_converted"]
    float_bytes = first["bytes_offloaded"] - exact_part  # the fp32 bytes converted
    assert converted > 0 and float_bytes > 0 and float_bytes % 4 == 0
    for name in sd.LOSSY_ARMS:
        r = arms[name]
        assert r["stats_constant_over_steps"]
        # every storage dtype converts the same tensors: every fp32 one; the two token tensors stay exact
        assert (r["tensors_offloaded"], r["bytes_offloaded"], r["tensors_converted"]) == (
            first["tensors_offloaded"],
            first["bytes_offloaded"],
            converted,
        )
        assert r["tensors_offloaded"] - r["tensors_converted"] == 2
        if name in SCALED:
            # one byte per element, each tensor padded to 4 bytes, then its 4-byte fp32 scale
            low = exact_part + float_bytes // 4 + 4 * converted
            assert low <= r["bytes_stored"] <= low + 3 * converted, name
            assert r["stored_ratio"] == pytest.approx(0.25, abs=0.01)
        else:
            assert r["bytes_stored"] == exact_part + float_bytes // 2, name
            assert r["stored_ratio"] == pytest.approx(0.5, abs=0.01)
        assert r["stored_ratio"] == r["bytes_stored"] / r["bytes_offloaded"]
        assert r["stored_vs_exact_arm"] == r["bytes_stored"] / arms["exact"]["bytes_stored"] < 1


def test_lossy_arms_errors_are_nonzero_and_within_bounds(quick_run, sd):
    _, _, report = quick_run
    arms = report["arms"]
    for name in sd.LOSSY_ARMS:
        r = arms[name]
        assert not r["grad_bit_identical"]
        assert 0 < r["grad_rel_error_mean"] <= r["grad_rel_error_max"] < GRAD_BOUND[name], name
        assert len(r["grad_rel_error_per_batch"]) == report["args"]["batches"]
        (cls,) = r["store_error"]
        assert cls == "float32->" + r["store_dtype"]
        assert r["store_error"][cls]["tensors"] == r["tensors_converted"]
        assert 0 < r["activation_rel_error_mean"] <= r["activation_rel_error_max"] <= UNIT_ROUNDOFF[name], name
    # more significant bits, smaller error: fp16 (11) < bf16 (8), e4m3 (4) < e5m2 (3)
    assert arms["fp16"]["grad_rel_error_max"] < arms["bf16"]["grad_rel_error_mean"]
    assert arms["fp8_e4m3"]["grad_rel_error_max"] < arms["fp8_e5m2"]["grad_rel_error_mean"]
    assert arms["bf16"]["grad_rel_error_max"] < arms["fp8_e4m3"]["grad_rel_error_mean"]


def test_training_losses_against_exact_storage(quick_run, sd):
    _, _, report = quick_run
    train = report["train"]
    steps = report["args"]["train_steps"]
    assert list(train) == sd.TRAIN_ARMS and steps == 20
    exact = train["exact"]
    assert exact["final_loss_diff"] == 0.0 and exact["max_abs_loss_diff"] == 0.0
    for name, r in train.items():
        assert len(r["losses"]) == steps and all(math.isfinite(x) for x in r["losses"])
        # the same weights and batch: the first forward is the same in every arm (the rounding is
        # only seen by backward), and the model learns
        assert r["first_loss"] == exact["first_loss"]
        assert r["final_loss"] < r["first_loss"] - 0.1
        assert r["final_loss_diff"] == pytest.approx(r["final_loss"] - exact["final_loss"])
        if name != "exact":
            assert 0 < r["max_abs_loss_diff"] < LOSS_BOUND[name], name


def test_gradient_helpers(sd):
    a = [torch.tensor([3.0, 0.0]), torch.tensor([4.0])]
    b = [torch.tensor([3.0, 0.0]), torch.tensor([4.5])]
    assert sd.relative_error(a, a) == 0.0 and sd.bit_identical(a, a)
    assert sd.relative_error(b, a) == pytest.approx(0.5 / 5.0) and not sd.bit_identical(b, a)


def test_exact_storage_that_is_not_exact_fails_the_run(sd, tmp_path, monkeypatch):
    """If 'exact' storage rounded, the run must say so: exit status 1 and the reason on stderr."""
    monkeypatch.setitem(sd.ARMS, "exact", torch.bfloat16)
    threads = torch.get_num_threads()
    rc = sd.main(
        [
            "--quick",
            "--rounds",
            "1",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--batches",
            "1",
            "--train-steps",
            "0",
            "--out",
            str(tmp_path),
        ]
    )
    report = json.loads((tmp_path / "store_dtype.json").read_text())
    assert rc == 1 and report["train"] is None
    assert torch.get_num_threads() == threads  # --threads 1 held only while measuring
    assert not report["arms"]["exact"]["grad_bit_identical"] and report["arms"]["exact_aa"]["grad_bit_identical"]
