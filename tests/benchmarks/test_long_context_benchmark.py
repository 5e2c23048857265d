"""benchmarks/long_context.py --quick on CPU: the outputs exist, every arm ran or says why not,
the ratios use the stated baselines, and every arm's gradients equal the no-checkpoint arm's.

The benchmark measures; these tests check what it reports, never how fast anything ran.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest
import torch
from helpers import REPO_ROOT

ROOT = REPO_ROOT
if os.path.join(ROOT, "benchmarks") not in sys.path:
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def _load():
    spec = importlib.util.spec_from_file_location(
        "long_context_benchmark", os.path.join(ROOT, "benchmarks", "long_context.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def lc():
    return _load()


@pytest.fixture(scope="module")
def quick_run(lc, tmp_path_factory):
    out = tmp_path_factory.mktemp("long_context")
    rc = lc.main(["--quick", "--out", str(out)])
    with open(out / "long_context.json") as f:
        report = json.load(f)
    return rc, out, report


def test_quick_run_writes_outputs_labelled_cpu(quick_run):
    rc, out, report = quick_run
    assert rc == 0
    for name in ("long_context.json", "long_context.md"):
        assert (out / name).stat().st_size > 0
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "long_context.png").stat().st_size > 0
    assert report["mode"] == "cpu" and "NOT GPU" in report["warning"]
    md = (out / "long_context.md").read_text()
    assert "(CPU)" in md.splitlines()[0] and "CPU NUMBERS, NOT GPU NUMBERS" in md
    assert report["max_seq"]["status"].startswith("skipped: CPU run")
    assert report["skipped"] == []


def test_every_arm_has_a_time_or_a_stated_reason(lc, quick_run):
    _, _, report = quick_run
    args = report["args"]
    assert len(report["results"]) == len(args["seq_lens"]) >= 2
    for res in report["results"]:
        assert set(res["arms"]) == set(lc.ARMS)
        assert res["rounds_done"] == args["rounds"] >= 3
        for name, r in res["arms"].items():
            if name == "torchtune":
                # CUDA-only: skipped with the reason, after loading the module when the wheel is here.
                assert r["status"].startswith("skipped: "), r["status"]
                wheel = lc.find_torchtune_wheel()
                assert ("no torchtune-" in r["status"]) == (wheel is None)
                continue
            assert r["status"] == "ok", (name, r["status"])
            assert r["n"] == len(r["step_times_s"]) == args["rounds"] * args["steps"]
            assert 0 < r["min_s"] <= r["median_s"] <= r["max_s"]
            assert len(r["per_round_median_s"]) == args["rounds"]


def test_ratios_use_the_stated_baselines_and_the_aa_pair(lc, quick_run):
    _, _, report = quick_run
    assert report["baselines"]["checkpoint_aa"] == "checkpoint"
    assert report["baselines"]["co_checkpoint_offload"] == "co_checkpoint"
    for res in report["results"]:
        rows = res["arms"]
        t = {n: r["median_s"] for n, r in rows.items() if r["status"] == "ok"}
        aa = t["checkpoint_aa"] / t["checkpoint"]
        for name, t_arm in t.items():
            r = rows[name]
            assert r["ratio_to_checkpoint"] == pytest.approx(t_arm / t["checkpoint"])
            base = lc.BASELINE[name]
            if base is None:
                assert r["ratio_to_baseline"] is None
            else:
                assert r["baseline"] == base
                assert r["ratio_to_baseline"] == pytest.approx(t_arm / t[base])
            assert r["aa_ratio"] == pytest.approx(aa)
            assert r["noise_floor"] == pytest.approx(abs(aa - 1))


def test_every_arm_gradients_equal_the_none_arm(lc, quick_run):
    _, _, report = quick_run
    for res in report["results"]:
        for name, r in res["arms"].items():
            if r["status"] != "ok":
                continue
            g = r["grads"]
            assert g["reference"] == "none"
            if name == "none":
                continue
            if name in lc.LOSSY_ARMS:
                # float8 storage is lossy by design: within its stated bound, and not bit-identical
                assert g["ok"] and not g["bit_identical"] and 0 < g["max_rel_err"] <= lc.LOSSY_RTOL, (name, g)
                continue
            if name in lc.TILED_ARMS:
                # parameter gradients summed over tiles: within the tiling tolerance (docs/api.md)
                assert g["ok"] and g["max_rel_err"] <= lc.TILED_RTOL["cpu"], (name, g)
                continue
            # float32 on CPU: recompute and offload change no bit
            assert g["ok"] and g["bit_identical"], (name, g)


def test_low_precision_arms_store_fewer_bytes(quick_run):
    _, _, report = quick_run
    for res in report["results"]:
        arms = res["arms"]
        for lossy, exact in (("co_offload_fp8", "co_offload"), ("co_checkpoint_offload_fp8", "co_checkpoint_offload")):
            if arms[lossy]["status"] == "ok" and arms[exact]["status"] == "ok":
                # float8 codes (plus a 4-byte scale per tensor, rounded to pool blocks) for float32 values
                assert 0 < arms[lossy]["bytes_moved_d2h"] < arms[exact]["bytes_moved_d2h"], (lossy, res["seq_len"])


def test_bytes_moved_match_what_each_recipe_saves(quick_run):
    _, _, report = quick_run
    dim = 64
    for res in report["results"]:
        rows = res["arms"]
        layer_inputs = res["layers"] * res["seq_len"] * dim * 4
        assert res["theory_resident_bytes"] == layer_inputs
        # save_on_cpu around each checkpoint sees exactly each layer's positional input
        assert rows["hf_offload"]["bytes_moved_d2h"] == layer_inputs
        # co.checkpoint(offload) also stores the keyword rotary tables, once for every layer
        head_dim = dim // 4
        assert rows["co_checkpoint_offload"]["bytes_moved_d2h"] == layer_inputs + 2 * res["seq_len"] * head_dim * 4
        # offloading every saved tensor moves several times more
        assert rows["co_offload"]["bytes_moved_d2h"] > 4 * layer_inputs
        # tiled inside the checkpoints: what the checkpoints offload is unchanged (the tiled MLP's
        # saved input is the block's recompute's, never the pool's)
        for name in ("co_checkpoint_offload_tile", "co_checkpoint_offload_tile_norms"):
            assert rows[name]["bytes_moved_d2h"] == rows["co_checkpoint_offload"]["bytes_moved_d2h"], name
        plan = rows["co_plan"]
        assert (
            plan["checkpoint_offload_predicted_peak_bytes"]
            <= plan["budget_bytes"]
            <= plan["checkpoint_predicted_peak_bytes"]
        )
        assert plan["predicted_peak_bytes"] <= plan["budget_bytes"]


def test_memory_per_token_table(lc, quick_run):
    """The CPU per-token table: peaks linear in the sequence, the offloaded arms free exactly the
    layer inputs checkpointing keeps, tiling frees more, and the 8B-class prediction per cap."""
    _, out, report = quick_run
    pt = report["per_token"]
    st = pt["settings"]
    arms = pt["arms"]
    assert set(arms) == set(lc.PER_TOKEN_ARMS) and all(r["status"] == "ok" for r in arms.values()), arms
    w = {n: r["widths_per_token"] for n, r in arms.items()}
    # checkpoint keeps one input (one width) per layer on the device; offloaded, they are in the pool
    assert w["checkpoint"] - w["co_checkpoint_offload"] == pytest.approx(st["layers"], abs=0.05)
    head_dim = st["dim"] // pt["shape"]["heads"]
    for name in ("co_checkpoint_offload", "co_checkpoint_offload_tile", "co_checkpoint_offload_tile_norms"):
        # the pool gets each layer's input and the rotary tables once, 2 bytes (bf16) an element
        assert arms[name]["host_bytes_per_token"] == pytest.approx(2 * (st["layers"] * st["dim"] + 2 * head_dim))
    # tiling frees the MLP's intermediates (several widths), the norms' float32 copies a little more
    assert w["co_checkpoint_offload_tile"] < w["co_checkpoint_offload"] - 5
    assert w["co_checkpoint_tile"] < w["checkpoint"] - 5
    assert w["co_checkpoint_offload_tile_norms"] < w["co_checkpoint_offload_tile"]
    pred = pt["prediction"]
    assert pred["caps_gb"] == [40.0, 80.0, 141.0] and pred["layers"] == 32
    for name, row in pred["arms"].items():
        for cap in ("40.0", "80.0", "141.0"):
            cell = row["caps"][cap]
            assert cell["max_seq"] > 0 and cell["max_seq"] % 1024 == 0
            if name == "checkpoint":
                assert cell["ratio_to_checkpoint"] == 1.0
    best = pred["arms"]["co_checkpoint_offload_tile_norms"]["caps"]["80.0"]
    assert best["ratio_to_checkpoint"] > pred["arms"]["co_checkpoint_offload"]["caps"]["80.0"]["ratio_to_checkpoint"]
    assert "Memory per token" in (out / "long_context.md").read_text()


def test_wrong_gradients_fail_the_run(lc, tmp_path, monkeypatch):
    """An arm that computes something else must be caught: the exit status is 1 and the row says WRONG."""
    real = lc.build_arm

    def build(name, *a, **k):
        if name == "co_checkpoint":
            return lc.Arm(name, checkpoint_fn=lambda layer, x, **kw: layer(x * 1.01, **kw))
        return real(name, *a, **k)

    monkeypatch.setattr(lc, "build_arm", build)
    rc = lc.main(
        [
            "--quick",
            "--seq-lens",
            "32",
            "--rounds",
            "1",
            "--steps",
            "1",
            "--arms",
            "none,checkpoint,co_checkpoint",
            "--out",
            str(tmp_path),
        ]
    )
    report = json.loads((tmp_path / "long_context.json").read_text())
    g = report["results"][0]["arms"]["co_checkpoint"]["grads"]
    assert rc == 1 and g["ok"] is False and g["max_rel_err"] > 1e-3
    assert report["results"][0]["arms"]["checkpoint"]["grads"]["ok"]
    assert "WRONG" in (tmp_path / "long_context.md").read_text()


def test_compare_with_reference_names_the_worst_parameter(lc):
    model = torch.nn.Linear(4, 3)
    model(torch.randn(2, 4)).sum().backward()
    ref = lc.grads_to_cpu(model)
    assert lc.compare_with_reference(model, ref, 1e-5)["bit_identical"]
    model.bias.grad[0] += 1.0
    g = lc.compare_with_reference(model, ref, 1e-5)
    assert not g["ok"] and g["worst_param"] == "bias"


def test_max_seq_fit_predicts_the_cap_length(lc):
    # peak = 2 GB + 300 KB per token, measured at three lengths
    points = [(s, 2_000_000_000 + 300_000 * s) for s in (2048, 4096, 8192)]
    a, b = lc.fit_linear(points)
    assert a == pytest.approx(2e9) and b == pytest.approx(3e5)
    assert (
        lc.predict_max_seq((a, b), 40_000_000_000) == 123 * 1024
    )  # 38e9 / 3e5 = 126666 tokens, rounded down to a multiple of 1024
    assert lc.fit_linear(points[:1]) is None


def test_layer_count_follows_the_budget(lc):
    args = _ns(lc.parse_args(["--quick"]), seq_lens=[8192, 16384, 32768], rounds=4, steps=5)
    cal = {"scale": {8192: 0.8, 32768: 0.7}, "offload_factor": 2.5}
    small, why_small = lc.choose_layers(_ns(args, budget_s=60.0), lc.GPU_SHAPE, 9, cal)
    big, why_big = lc.choose_layers(_ns(args, budget_s=600.0), lc.GPU_SHAPE, 9, cal)
    assert big[8192] > small[8192] and big[32768] > lc.MIN_LAYERS
    for layers, why, budget in ((small, why_small, 60.0), (big, why_big, 600.0)):
        # within the budget's timed share, unless every length is at the minimum already
        assert why["predicted_timed_s"] <= 0.75 * budget or set(layers.values()) == {lc.MIN_LAYERS}
        assert layers[8192] >= layers[16384] >= layers[32768] >= lc.MIN_LAYERS
        assert why["arm_weight"] == pytest.approx(8 + 2.5)
    # the calibration scales the FLOP model: a slower GPU gets fewer layers
    slow, _ = lc.choose_layers(
        _ns(args, budget_s=600.0), lc.GPU_SHAPE, 9, {"scale": {8192: 1.6, 32768: 1.4}, "offload_factor": 2.5}
    )
    assert slow[8192] < big[8192]


def test_calibration_measures_a_one_layer_model(lc):
    args = _ns(lc.parse_args(["--quick"]), seq_lens=[16])
    cal = lc.calibrate(args, torch.device("cpu"), torch.float32, lc.CPU_SHAPE)
    assert set(cal["scale"]) == {16} and cal["scale"][16] > 0 and cal["offload_factor"] >= 1.0
    assert set(cal["measured_s"]) == {"checkpoint@16", "none@16", "co_offload@16"}
    # between two calibrated lengths the scale is interpolated in log(seq)
    two = {"scale": {1024: 1.0, 4096: 2.0}}
    assert lc._scale_at(two, 2048) == pytest.approx(1.5)
    assert lc._scale_at(two, 512) == 1.0 and lc._scale_at(two, 8192) == 2.0


def _ns(args, **changes):
    import argparse

    return argparse.Namespace(**dict(vars(args), **changes))


def test_torchtune_module_loads_from_the_wheel_alone(lc):
    wheel = lc.find_torchtune_wheel()
    if wheel is None:
        pytest.skip("no torchtune wheel in .whl/ (pip download torchtune --no-deps -d .whl)")
    before = set(sys.modules)
    module = lc.load_torchtune_offloading(wheel)
    assert hasattr(module, "OffloadActivations") and hasattr(module, "NoOpManager")
    assert not {m for m in set(sys.modules) - before if m.startswith(("torchtune", "torchao"))}
