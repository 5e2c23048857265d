"""The memory-budget planner (co.plan): its simulator against measured memory, its solver against
exhaustive search and the known strategies, and plans applied to real models.

Bytes are exact on CPU: every saved activation is a CPU tensor counted by torch's allocator
(co.planner.saved_activation_peak reads torch.profiler's memory events; see its docstring for what
is counted). Each step drains the forward's copies (co.synchronize()) before backward, so the
measured peak has no copy backlog and the simulator is given an instant D2H link to match; the
backlog model itself is tested on its own below.
"""

import math
import random
import warnings

import pytest
import torch

try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
except ImportError:  # a machine without hypothesis (the GPU machine): that one test skips
    given = None

import ckpt_offload as co
from ckpt_offload.planner import (
    Bandwidth,
    BlockCost,
    CostModel,
    InfeasibleBudget,
    Storage,
    Unit,
    saved_activation_peak,
    simulate,
)
from ckpt_offload.planner.solver import chain_dp, chain_exhaustive, rotor, solve
from ckpt_offload.planner.simulator import singles
from ckpt_offload.planner.solver import baselines, chain_cost, evaluate, first_k_units

from conftest import assert_bit_identical, grads_of
from planner_case import CPU_ALL, PlannerCase
from models_for_tests import Chain, TinyTransformer, lm_loss, make_batch, make_config

KINDS = ("keep", "offload", "recompute", "recompute_offload", "selective", "selective_offload")


# ---- models -------------------------------------------------------------------------------------


_Case = PlannerCase


@pytest.fixture(scope="module")
def tiny():
    cfg = make_config("tiny", layers=3, seq=32, batch=2)
    return _Case(TinyTransformer(**cfg.model_kwargs(), seed=0), make_batch(cfg, seed=0), lm_loss)


def _hf_loss(model, batch):
    return model(input_ids=batch, labels=batch).loss


@pytest.fixture(scope="module")
def gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=3, n_head=4, use_cache=False)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    model.train()
    batch = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(0))
    return _Case(model, batch, _hf_loss)


def _mixed(n):
    mixed = ("keep", "offload", "recompute", "recompute_offload", "selective")
    kinds = [mixed[i % len(mixed)] for i in range(n)]
    return singles(kinds)


UNIT_CASES = {
    **{kind: (lambda n, k=kind: singles([k] * n), 0) for kind in KINDS if kind != "selective_offload"},
    "offload_prefetch": (lambda n: singles(["offload"] * n), 200_000),
    "segments": (lambda n: [Unit(0, 1, "recompute"), Unit(2, n - 1, "recompute")], 0),
    "segments_offload": (lambda n: [Unit(0, n - 2, "recompute_offload"), Unit(n - 1, n - 1, "keep")], 0),
    "mixed": (_mixed, 150_000),
    "hf_mixed": (lambda n: singles(["offload", "recompute_offload", "selective"][:n]), 100_000),
    # selective recompute whose kept outputs wait in the pool, with a prefetch window
    "selective_offload": (lambda n: singles(["selective_offload"] * n), 0),
    "selective_offload_prefetch": (lambda n: singles(["selective_offload"] * n), 200_000),
    "selective_mixed": (lambda n: singles((["selective_offload", "selective", "offload"] * n)[:n]), 100_000),
}


def _check_prediction(case, name):
    make, prefetch = UNIT_CASES[name]
    units = make(len(case.named))
    predicted = simulate(case.costs, units, prefetch).peak_bytes
    measured = case.measured_peak(units, prefetch)
    assert measured == pytest.approx(predicted, rel=0.05), (name, predicted, measured)


@pytest.mark.parametrize("name", list(UNIT_CASES))
def test_simulated_peak_matches_measured_tiny_transformer(tiny, name):
    _check_prediction(tiny, name)


@pytest.mark.parametrize("name", ["hf_mixed", "recompute", "segments", "selective_offload"])
def test_simulated_peak_matches_measured_hf_gpt2(gpt2, name):
    # hf_mixed: offload, recompute_offload, selective (with a prefetch window); segments: one
    # checkpoint around blocks 0-1 and one around block 2. GPT-2's blocks
    # return tuples and take keyword arguments.
    _check_prediction(gpt2, name)


def test_no_plan_peak_is_every_saved_storage(tiny):
    # All kept: the peak is at the end of forward, every saved storage once.
    cm = tiny.costs
    total = cm.pre_bytes + cm.post_bytes + sum(b.saved_bytes for b in cm.blocks)
    assert simulate(cm, singles(["keep"] * len(cm.blocks))).peak_bytes == total
    assert tiny.measured_peak(singles(["keep"] * len(cm.blocks)), 0) == pytest.approx(total, rel=0.01)


def test_measure_counts_saved_not_temporaries():
    # Chain: each layer saves its input (Linear) and output (tanh): one storage per layer plus the
    # input... counted once each; the temporaries of backward are not counted.
    model = Chain(n=4, width=64)
    x = torch.randn(32, 64, requires_grad=True)

    def step():
        model(x).sum().backward()

    step()
    peak = saved_activation_peak(step).peak_bytes
    # 4 tanh outputs saved (32 x 64 floats each, also the next Linear's saved input: one storage);
    # the Linear outputs are temporaries, x was allocated before the step: not counted. The loss
    # (one float, alive when backward starts) is.
    assert 4 * 32 * 64 * 4 <= peak <= 4 * 32 * 64 * 4 + 16


def test_measure_reads_the_hosts_copy_ranges_only(tiny, monkeypatch):
    # On a GPU the trace holds each copy range twice: the host's, around the reload's allocation,
    # and a twin of the same name on the device's lane (kineto's "gpu_user_annotation" of a
    # USER_SCOPE range, csrc/torch/runtime.cpp's CopyRange), spanning the copy as the GPU runs it:
    # later than the host enqueued it, behind the compute stream. What backward allocates on the
    # host meanwhile (gradients, temporaries) is no reload. Here the CPU trace gets such twins,
    # each lagging from its host range's end to the end of the step: the timeline must not change.
    import ckpt_offload.planner.saved_peak as measure

    read, seen = measure._trace_events, {}

    def with_device_twins(prof):
        events = seen["host"] = read(prof)
        end = max(e["ts"] + e.get("dur", 0) for e in events if "ts" in e)
        twins = [
            dict(
                e, cat="gpu_user_annotation", pid=0, tid="stream 7", ts=e["ts"] + e["dur"], dur=end - e["ts"] - e["dur"]
            )
            for e in events
            if e.get("ph") == "X" and e.get("name") in measure._RELOAD_RANGES
        ]
        assert twins
        return events + twins

    monkeypatch.setattr(measure, "_trace_events", with_device_twins)
    twinned = tiny.timeline(singles(["offload"] * len(tiny.named)), dict(CPU_ALL, prefetch_bytes=200_000))
    host = measure._saved_timeline(seen["host"], "cpu")
    assert any(a[3] == "reload" for a in host.allocations)
    assert (twinned.peak_bytes, twinned.allocations) == (host.peak_bytes, host.allocations)


# ---- plans applied --------------------------------------------------------------------------------


def _grads(case, handle=None):
    case.model.zero_grad(set_to_none=True)
    case.step()
    g = grads_of(case.model)
    case.model.zero_grad(set_to_none=True)
    return g


@pytest.mark.parametrize("fraction", [0.2])
def test_applied_plan_fits_budget_and_gradients_bit_identical(tiny, fraction):
    cm = tiny.costs
    full = simulate(cm, singles(["keep"] * len(cm.blocks))).peak_bytes
    budget = int(full * fraction)
    plan = co.plan(tiny.model, tiny.step, budget=budget, offload=CPU_ALL, costs=cm)
    assert plan.predicted_peak_bytes <= budget
    assert any(k != "keep" for k in plan.choices.values())
    reference = _grads(tiny)
    handle = plan.apply()
    try:
        tiny.drained_step()
        measured = saved_activation_peak(tiny.drained_step).peak_bytes
        with_plan = _grads(tiny)
    finally:
        handle.remove()
    assert measured <= budget * 1.0
    assert_bit_identical(reference, with_plan)
    assert _grads(tiny).keys() == reference.keys()  # removed: the model runs unchanged


def test_selective_offload_is_offered_where_selective_does_not_fit(tiny):
    # Selective recompute keeps its matmul outputs on the device; below the least peak it reaches,
    # the same recompute with those outputs in the pool is what fits (the planner's
    # "selective_offload", co.selective_offload_context per block), exact as the others.
    cm = tiny.costs
    kinds = ("keep", "selective", "selective_offload")
    with pytest.raises(InfeasibleBudget) as keep_or_selective:
        co.plan(tiny.model, tiny.step, budget=1000, offload=CPU_ALL, costs=cm, kinds=("keep", "selective"))
    with pytest.raises(InfeasibleBudget) as with_offload:
        co.plan(tiny.model, tiny.step, budget=1000, offload=CPU_ALL, costs=cm, kinds=kinds)
    assert with_offload.value.minimum < keep_or_selective.value.minimum
    budget = keep_or_selective.value.minimum - 1
    plan = co.plan(tiny.model, tiny.step, budget=budget, offload=CPU_ALL, costs=cm, kinds=kinds)
    assert "selective_offload" in plan.choices.values()
    reference = _grads(tiny)
    handle = plan.apply()
    try:
        tiny.drained_step()
        measured = saved_activation_peak(tiny.drained_step).peak_bytes
        with_plan = _grads(tiny)
        stats = handle.stats()
    finally:
        handle.remove()
    assert_bit_identical(reference, with_plan)
    assert measured == pytest.approx(plan.predicted_peak_bytes, rel=0.05)
    assert stats["tensors_offloaded"] > 0 and stats["tensors_reloaded"] > 0
    assert co.default_pool().stats()["bytes_in_use"] == 0


def test_plan_api_summary_and_choices(tiny):
    cm = tiny.costs
    plan = co.plan(tiny.model, tiny.step, budget="1MiB", offload=CPU_ALL, costs=cm)
    assert set(plan.choices) == {n for n, _ in tiny.named}
    assert all(v in KINDS or v.endswith("_segment") for v in plan.choices.values())
    text = plan.summary()
    for name, _ in tiny.named:
        assert name in text
    assert "peak of saved activations" in text
    assert plan.baseline["peak_bytes"] > plan.predicted_peak_bytes
    assert plan.predicted_step_seconds >= plan.baseline["predicted_step_seconds"] - 1e-12


def test_impossible_budget_raises_with_smallest_feasible(tiny):
    cm = tiny.costs
    with pytest.raises(InfeasibleBudget, match=r"pass budget >= \d+") as info:
        co.plan(tiny.model, tiny.step, budget=1000, offload=CPU_ALL, costs=cm)
    smallest = info.value.minimum
    assert smallest > 1000
    plan = co.plan(tiny.model, tiny.step, budget=smallest, offload=CPU_ALL, costs=cm)
    assert plan.predicted_peak_bytes <= smallest


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(budget="lots"), ValueError, "budget: cannot read 'lots'"),
        (dict(budget=-1), ValueError, "budget must be a finite number"),
        (dict(kinds=("keep", "teleport")), ValueError, "kinds must be a non-empty subset"),
        (dict(bandwidth={"d2h": 1e9}), ValueError, "needs both 'd2h' and 'h2d'"),
        (dict(bandwidth={"d2h": 1, "h2d": 1, "lag": 2}), TypeError, "unknown key"),
        (dict(offload={"devices": ["cpu"], "min_bytes": -3}), ValueError, "min_bytes must be >= 0"),
    ],
)
def test_bad_arguments(tiny, kwargs, error, match):
    kwargs = {"budget": "1MiB", "offload": {"devices": ["cpu"]}, **kwargs}
    with pytest.raises(error, match=match):
        co.plan(tiny.model, tiny.step, costs=tiny.costs, **kwargs)


def test_a_plan_without_a_budget_warns_that_it_will_be_required(tiny):
    with pytest.warns(DeprecationWarning, match=r"co.plan without budget= is deprecated.*budget='2GiB'"):
        p = co.plan(tiny.model, tiny.step, offload={"devices": ["cpu"]}, costs=tiny.costs)
    assert p.budget == 2 << 30
    # The plan's settings went on a copy: the shared costs keep min_bytes=0 for the other tests.
    assert tiny.costs.min_bytes == 0 and p.costs is not tiny.costs and p.costs.min_bytes == co.DEFAULT_MIN_BYTES


def test_bad_model_and_step():
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        co.plan(object(), lambda: None)
    with pytest.raises(TypeError, match="step must be a function"):
        co.plan(torch.nn.Linear(2, 2), None)


def test_bandwidth_forms():
    from ckpt_offload.planner import parse_bandwidth

    assert parse_bandwidth("25GB/s").d2h == 25e9
    assert parse_bandwidth(math.inf).h2d == math.inf
    b = parse_bandwidth({"d2h": "1GiB", "h2d": 2e9, "latency": 1e-5})
    assert (b.d2h, b.h2d, b.latency) == (1 << 30, 2e9, 1e-5)


def test_bandwidth_issue_key():
    from ckpt_offload.planner import parse_bandwidth

    b = parse_bandwidth({"d2h": 1e9, "h2d": 1e9, "latency": 8e-5, "issue": 1.5e-5})
    assert (b.latency, b.issue, b.issue_seconds) == (8e-5, 1.5e-5, 1.5e-5)
    assert parse_bandwidth({"d2h": 1e9, "h2d": 1e9, "latency": 8e-5}).issue_seconds == 8e-5  # default: latency
    with pytest.raises(ValueError, match=r"bandwidth\['issue'\] must be seconds between 0 and"):
        parse_bandwidth({"d2h": 1e9, "h2d": 1e9, "latency": 1e-5, "issue": 2e-5})


def test_copy_latency_is_a_delay_not_queue_time():
    """Note [Copy latency is a delay]: n back-to-back copies end n * issue + bytes / bw +
    (latency - issue) after the first starts, and the queue is free after n * issue + bytes / bw;
    with issue=None (= latency) the model is the serial one it was."""
    b = Bandwidth(1e9, 1e9, latency=1e-4, issue=1e-5)
    assert b.queue_seconds(20_000, 20, "h2d") == pytest.approx(20 * 1e-5 + 20e-6)
    assert b.copy_seconds(20_000, 20, "h2d") == pytest.approx(20 * 1e-5 + 20e-6 + 9e-5)
    assert b.copy_seconds(1000, 0, "h2d") == pytest.approx(1e-6)  # bytes of a copy already counted
    serial = Bandwidth(1e9, 1e9, latency=1e-4)
    assert serial.copy_seconds(20_000, 20, "h2d") == pytest.approx(20 * 1e-4 + 20e-6)

    # One block offloads 20 small storages, all prefetched at its first unpack: the reloads queue
    # back to back, so backward waits about latency + 20 * issue for them, not 20 * latency.
    rng = random.Random(0)
    cm = _random_costs(rng, 2, bw=1e9, latency=1e-4)
    cm.min_bytes = 0
    cm.pre_bytes = cm.post_bytes = 0
    cm.pre_s = cm.mid_s = cm.post_s = 0.0
    for b_ in cm.blocks:
        b_.storages = [Storage(1000, i, i) for i in range(20)]
        b_.packs, b_.nodes, b_.input_sizes = (
            list(range(20)),
            list(range(19, -1, -1)),
            [1000],
        )  # last packed, first unpacked
        b_.forward_s, b_.backward_s = 1e-3, 2e-4  # 10 us a node: the reloads, not the compute, set the pace
    units = singles(["keep", "offload"])
    times = {}
    for issue in (None, 1e-4, 1e-5):
        cm.bandwidth = Bandwidth(1e9, 1e9, 1e-4, issue=issue)
        times[issue] = simulate(cm, units, prefetch_bytes=1 << 20).step_s
    assert times[None] == times[1e-4]
    assert times[None] - times[1e-5] > 1e-3, times  # 19 reloads no longer wait 90 us of each other's latency
    compute = sum(b_.forward_s + b_.backward_s for b_ in cm.blocks)
    # at most one latency, then each reload's issue cost and bytes (1 us), beyond the compute
    assert compute <= times[1e-5] <= compute + 1e-4 + 20 * (1e-5 + 1e-6) + 1e-5, times


def test_measured_bandwidth_has_an_issue_cost_within_latency():
    from ckpt_offload.planner.timing import measure_bandwidth

    b = measure_bandwidth("cpu", nbytes=1 << 20)
    assert b.issue is not None and 0 <= b.issue <= b.latency and b.d2h > 0 and b.h2d > 0


# ---- the solver -------------------------------------------------------------------------------------


def _random_costs(rng, n, bw=1e9, latency=1e-5):
    blocks = []
    for i in range(n):
        sizes = [rng.randint(1, 64) * 1000 for _ in range(rng.randint(1, 4))]
        storages = [Storage(s, j, j, is_input=(j == 0)) for j, s in enumerate(sizes)]
        sel = rng.randint(0, 32) * 1000
        blocks.append(
            BlockCost(
                name=f"b{i}",
                storages=storages,
                packs=list(range(len(sizes))),
                nodes=list(range(len(sizes), 0, -1)),
                input_sizes=[sizes[0]],
                selective=[sel] if sel else [],
                selective_saved=[-1] if sel else [],
                selective_last_use=[1] if sel else [],
                forward_s=rng.uniform(1e-4, 1e-2),
                backward_s=rng.uniform(2e-4, 2e-2),
                selective_recompute_s=rng.uniform(0, 5e-3),
            )
        )
    return CostModel(
        blocks=blocks,
        bandwidth=Bandwidth(bw, bw, latency),
        min_bytes=rng.choice([0, 20_000]),
        pre_bytes=rng.randint(0, 50) * 1000,
        post_bytes=rng.randint(0, 50) * 1000,
        pre_s=1e-3,
        mid_s=1e-3,
        post_s=1e-3,
    )


def _dp_equals_exhaustive_search(seed, n, fraction, prefetch, bw):
    rng = random.Random(seed)
    cm = _random_costs(rng, n, bw)
    kinds = KINDS if n <= 5 else ("keep", "offload", "recompute")
    full = chain_cost(cm, singles(["keep"] * n), prefetch)[0]
    budget = int(full * fraction)
    dp = chain_dp(cm, budget, prefetch, kinds=kinds)
    ex = chain_exhaustive(cm, budget, prefetch, kinds=kinds)
    assert (dp is None) == (ex is None)
    if dp is not None:
        assert chain_cost(cm, dp, prefetch) == pytest.approx(chain_cost(cm, ex, prefetch), rel=1e-12)


if given is not None:
    test_dp_equals_exhaustive_search = settings(
        max_examples=40, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
    )(
        given(
            seed=st.integers(0, 2**31),
            n=st.integers(1, 8),
            fraction=st.floats(0.05, 1.2),
            prefetch=st.sampled_from([0, 30_000, 10**9]),
            bw=st.sampled_from([1e7, 1e9, math.inf]),
        )(_dp_equals_exhaustive_search)
    )
else:

    @pytest.mark.skip(reason="needs hypothesis (pip install hypothesis)")
    def test_dp_equals_exhaustive_search():
        pass


def test_dp_time_never_increases_with_budget():
    rng = random.Random(3)
    for n in (3, 6, 10):
        cm = _random_costs(rng, n)
        full = chain_cost(cm, singles(["keep"] * n), 0)[0]
        times = []
        for b in range(0, 13):
            units = chain_dp(cm, int(full * b / 10), 50_000)
            times.append(math.inf if units is None else chain_cost(cm, units, 50_000)[1])
        assert times == sorted(times, reverse=True), times
        assert math.isfinite(times[-1])


def test_planned_time_never_increases_with_budget(tiny):
    cm = tiny.costs
    full = simulate(cm, singles(["keep"] * len(cm.blocks))).peak_bytes
    times = []
    for b in (0.06, 0.1, 0.2, 0.35, 0.6, 1.0):
        try:
            times.append(solve(cm, int(full * b)).step_s)
        except InfeasibleBudget:
            times.append(math.inf)
    assert times == sorted(times, reverse=True), times


def test_infinite_bandwidth_offloads_everything_for_free(tiny):
    cm = _with_bandwidth(tiny.costs, Bandwidth(math.inf, math.inf, 0.0))
    n = len(cm.blocks)
    with pytest.raises(InfeasibleBudget) as info:
        solve(cm, 1)
    best = solve(cm, info.value.minimum)  # the tightest budget
    assert [u.kind for u in best.units] == ["offload"] * n
    assert best.step_s == pytest.approx(cm.compute_s, rel=1e-12)


def test_zero_bandwidth_recompute_only_not_worse_than_rotor(tiny):
    cm = _with_bandwidth(tiny.costs, Bandwidth(0.0, 0.0, 0.0))
    full = simulate(cm, singles(["keep"] * len(cm.blocks))).peak_bytes
    with pytest.raises(InfeasibleBudget) as info:
        solve(cm, 1)
    low = info.value.minimum  # without a link only recompute lowers the peak
    for fraction in (0.0, 0.3, 0.7):
        budget = int(low + (full - low) * fraction)
        best = solve(cm, budget)
        assert all(u.kind in ("keep", "recompute", "selective") for u in best.units)
        r = rotor(cm, budget)
        if r is not None:
            rc = evaluate(cm, r, 0)
            if rc.peak_bytes <= budget:
                assert best.step_s <= rc.step_s + 1e-12


def test_plan_not_slower_than_baselines_at_any_budget(tiny):
    cm = _with_bandwidth(tiny.costs, Bandwidth(2e8, 2e8, 5e-5))  # a slow link: offload is not free
    n = len(cm.blocks)
    full = simulate(cm, singles(["keep"] * n)).peak_bytes
    for fraction in (0.08, 0.15, 0.3, 0.5, 0.8):
        budget = int(full * fraction)
        try:
            best = solve(cm, budget)
        except InfeasibleBudget:
            continue
        options = list(baselines(cm).values()) + [first_k_units(n, k) for k in range(n + 1)]
        for units in options:
            for prefetch in (0, max(b.saved_bytes for b in cm.blocks)):
                c = evaluate(cm, units, prefetch)
                if c.peak_bytes <= budget:
                    assert best.step_s <= c.step_s + 1e-12, (budget, units)


def test_copy_backlog_is_device_memory():
    # One block offloads 1 MB over a 1 MB/s link while the next computes for 0.1 s: the copy is
    # still running at the end of the forward, so its bytes are still on the device then.
    rng = random.Random(0)
    cm = _random_costs(rng, 2, bw=1e6, latency=0.0)
    cm.min_bytes = 0
    cm.pre_bytes = cm.post_bytes = 0
    for b in cm.blocks:
        b.storages = [Storage(1_000_000, 0, 0, is_input=True)]
        b.packs, b.nodes, b.input_sizes = [0], [0], [1_000_000]
        b.forward_s, b.backward_s = 0.1, 0.1
    slow = simulate(cm, singles(["offload", "keep"])).peak_bytes
    cm.bandwidth = Bandwidth(math.inf, math.inf, 0.0)
    fast = simulate(cm, singles(["offload", "keep"])).peak_bytes
    assert slow == 2_000_000 and fast == 1_000_000


def _with_bandwidth(cm, bw):
    import copy

    cm = copy.copy(cm)
    cm.bandwidth = bw
    return cm


# ---- Chen's rule without planning ------------------------------------------------------------------


def test_apply_segments_sqrt_bit_identical(tiny):
    reference = _grads(tiny)
    handle = co.apply(tiny.model, segments="sqrt")
    try:
        assert handle.kinds == ["recompute_segment", "recompute_segment", "recompute"]  # round(sqrt(3)) = 2
        got = _grads(tiny)
    finally:
        handle.remove()
    assert_bit_identical(reference, got)
    # two segments with their inputs in the pool
    handle = co.apply(tiny.model, segments=2, offload={"devices": ["cpu"], "min_bytes": 0})
    try:
        assert handle.kinds == ["recompute_offload_segment"] * 2 + ["recompute_offload"]
        got = _grads(tiny)
    finally:
        handle.remove()
    assert_bit_identical(reference, got)
    with pytest.raises(ValueError, match="segments must be 'sqrt'"):
        co.apply(tiny.model, segments="cube")
    with pytest.raises(ValueError, match="cannot be combined with every_n_layers"):
        co.apply(tiny.model, segments="sqrt", every_n_layers=2)
    with pytest.raises(ValueError, match=r"segments \(4\) cannot exceed the number of blocks \(3\)"):
        co.apply(tiny.model, segments=4)


def test_checkpoint_sequential_sqrt():
    torch.manual_seed(0)
    layers = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(9)])
    x = torch.randn(4, 16, requires_grad=True)
    layers(x).sum().backward()
    ref = grads_of(layers)
    layers.zero_grad()
    co.checkpoint_sequential(layers, "sqrt", x).sum().backward()
    assert_bit_identical(ref, grads_of(layers))
    with pytest.raises(ValueError, match="segments must be an int >= 1 or 'sqrt'"):
        co.checkpoint_sequential(layers, "log", x)


# ---- the command line ---------------------------------------------------------------------------------


def test_cli_plan_writes_summary_json_and_plot(tmp_path, capsys):
    import json

    from ckpt_offload.__main__ import main

    # 3 MiB of the tiny model's 4.1: feasible by recompute alone, whatever the measured link. The
    # step is not drained here (a user's step), so copies still running when backward starts count
    # in the measured peak: the exit status (0 within the budget, 1 over) is not asserted.
    status = main(
        ["plan", "--size", "tiny", "--device", "cpu", "--budget", "3MiB", "--steps", "1", "--out", str(tmp_path)]
    )
    out = capsys.readouterr().out
    assert status in (0, 1), out
    assert "peak of saved activations" in out and "measured with the plan" in out
    result = json.loads((tmp_path / "plan.json").read_text())
    assert result["predicted_peak_bytes"] <= result["budget_bytes"] == 3 << 20
    assert result["within_budget"] == (status == 0) == (result["measured_peak_bytes"] <= 3 << 20)
    assert set(result["choices"]) == {"blocks.0", "blocks.1"}
    pytest.importorskip("matplotlib")
    assert (tmp_path / "plan_memory.png").stat().st_size > 0


def test_warns_when_hf_cache_keeps_recomputed_tensors(gpt2):
    gpt2.model.config.use_cache = True
    try:
        full = simulate(gpt2.costs, singles(["keep"] * 3)).peak_bytes
        with pytest.warns(UserWarning, match="use_cache is True"):
            co.plan(
                gpt2.model, gpt2.step, budget=full // 2, offload=CPU_ALL, costs=gpt2.costs, kinds=("keep", "recompute")
            )
    finally:
        gpt2.model.config.use_cache = False


def test_cli_plan_script(tmp_path, capsys):
    from ckpt_offload.__main__ import main

    script = tmp_path / "mine.py"
    script.write_text(
        "import torch\n"
        "def build():\n"
        "    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh())\n"
        "                                  for _ in range(3)])\n"
        "    x = torch.randn(64, 32)\n"
        "    return model, lambda: model(x).sum().backward()\n"
        "def wrong():\n"
        "    return 3\n"
    )
    assert (
        main(["plan", "--script", f"{script}:build", "--budget", "1MiB", "--steps", "1", "--out", str(tmp_path / "o")])
        == 0
    )
    assert "measured with the plan" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        main(["plan", "--script", f"{script}:wrong", "--budget", "1MiB"])
    assert info.value.code == 2
    assert "must return (model, step)" in capsys.readouterr().err


def test_recompute_range_holds_only_recomputed_saved_tensors(tiny):
    # What a recompute leaves alive when its range ends is exactly the block's saved storages less
    # its input: torch's early stop raises through the block, and the frames of that exception
    # (holding the last op's output) are dropped before the range ends.
    timeline = tiny.timeline(singles(["recompute"] * len(tiny.named)), None)
    recomputed = sum(a[2] for a in timeline.allocations if a[3] == "recompute")
    expected = sum(s.nbytes for b in tiny.costs.blocks for s in b.storages if not s.is_input)
    assert recomputed == expected


def test_plan_applies_through_a_spilling_pool(tiny, tmp_path):
    """co.plan(pool=...): the plan's offloads use that pool; with a disk tier below a tiny cap the
    blocks spill to disk and come back with gradients bit-identical to no plan."""
    cm = tiny.costs
    full = simulate(cm, singles(["keep"] * len(cm.blocks))).peak_bytes
    pool = co.HostPool(pinned=False, max_bytes=64 * 1024, spill_dir=str(tmp_path))
    plan = co.plan(
        tiny.model,
        tiny.step,
        budget=int(full * 0.2),
        offload={**CPU_ALL, "pool": pool},
        costs=cm,
        kinds=("keep", "offload"),
    )
    assert "offload" in plan.choices.values()
    reference = _grads(tiny)
    handle = plan.apply()
    try:
        with_plan = _grads(tiny)
    finally:
        handle.remove()
    co.synchronize()
    assert pool.stats()["disk"]["bytes_spilled"] > 0
    assert pool.stats()["bytes_in_use"] == 0
    assert_bit_identical(reference, with_plan)
    with pytest.raises(TypeError, match="pool must be a ckpt_offload.HostPool"):
        co.plan(tiny.model, tiny.step, budget=full, offload={"devices": ["cpu"], "pool": "fast"}, costs=cm)


def test_plan_takes_the_option_set(tiny):
    """co.plan(offload=...): the one spelling of the options every route takes. It makes the same
    plan as the deprecated loose arguments (which warn, naming offload=), its other options reach
    the plan's offloads (on_full="raise" with a pool at its cap raises), and what the planner
    chooses itself is refused."""
    cm, full = tiny.costs, simulate(tiny.costs, singles(["keep"] * len(tiny.costs.blocks))).peak_bytes
    common = dict(budget=int(full * 0.4), costs=cm, kinds=("keep", "offload"))
    with pytest.warns(DeprecationWarning, match=r"co.plan\(devices=, min_bytes=\) is deprecated.*offload=\{'devices'"):
        loose = co.plan(tiny.model, tiny.step, devices=["cpu"], min_bytes=0, **common)
    as_one = co.plan(tiny.model, tiny.step, offload=co.OffloadOptions(devices=["cpu"], min_bytes=0), **common)
    with pytest.warns(DeprecationWarning, match=r"co.plan\(min_bytes=\) is deprecated"):
        as_dict = co.plan(tiny.model, tiny.step, offload={"devices": ["cpu"]}, min_bytes=0, **common)
    with pytest.warns(DeprecationWarning, match="offload="):  # twice with one value: allowed
        twice = co.plan(tiny.model, tiny.step, offload=CPU_ALL, min_bytes=0, **common)
    assert twice.offload_options == as_one.offload_options
    assert loose.choices == as_one.choices == as_dict.choices and "offload" in loose.choices.values()
    assert loose.offload_options == as_one.offload_options == as_dict.offload_options
    assert as_one.offload_options.devices == ("cpu",) and as_one.offload_options.min_bytes == 0

    small = co.HostPool(pinned=False, max_bytes=4096)
    for on_full, raises in (("keep", False), ("raise", True)):
        p = co.plan(tiny.model, tiny.step, offload={**CPU_ALL, "pool": small, "on_full": on_full}, **common)
        assert p.offload_options.on_full == on_full and p.offload_options.pool is small
        handle = p.apply()
        try:
            if raises:
                with pytest.raises(co.PoolFullError):
                    tiny.step()
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # "pool full: kept on the device"
                    tiny.step()
        finally:
            handle.remove()
            tiny.model.zero_grad(set_to_none=True)
    co.synchronize()
    assert small.stats()["bytes_in_use"] == 0


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (
            dict(offload={"min_bytes": 0}, min_bytes=1),
            TypeError,
            r"co.plan got min_bytes twice with different values: min_bytes=1 as an argument and 0 in offload=",
        ),
        # A value equal to the default is given too (it used to lose silently to the loose argument).
        (dict(offload={"min_bytes": co.DEFAULT_MIN_BYTES}, min_bytes=0), TypeError, "co.plan got min_bytes twice"),
        (dict(offload=co.OffloadOptions(), pool=co.HostPool(pinned=False)), TypeError, "co.plan got pool twice"),
        (dict(offload={"store_dtype": torch.bfloat16}), ValueError, r"pass lossy=torch.bfloat16 instead"),
        (dict(offload={"stream": "compute"}), ValueError, r"stream='compute'.*leave stream out"),
        (dict(offload=False), ValueError, r"kinds=\('keep', 'recompute', 'selective'\)"),
        (
            dict(offload={"min_byte": 0}),
            TypeError,
            r"co.plan offload: unknown co.offload option\(s\) 'min_byte' \(did you mean 'min_bytes'",
        ),
        (dict(offload="cpu"), TypeError, "co.plan offload must be False, True, or a dict"),
        (dict(pool="fast"), TypeError, "co.plan: pool must be a ckpt_offload.HostPool"),
    ],
)
def test_plan_option_set_errors(tiny, kwargs, error, match):
    with pytest.raises(error, match=match):
        co.plan(tiny.model, tiny.step, budget="1MiB", costs=tiny.costs, **kwargs)


@pytest.mark.parametrize(
    "kinds",
    [
        ("recompute",),
        ("offload",),
        ("recompute", "recompute_offload"),
        ("recompute", "selective"),
        ("offload", "recompute"),
    ],
)
@pytest.mark.parametrize("segments", [False, True])
def test_plan_gives_only_the_kinds_allowed(tiny, kinds, segments):
    """kinds= is a promise: no block gets another kind. Rotor's keep/recompute recipe and the
    first-k offload recipes (the rest kept) used to win with "keep" for kinds=("recompute",).
    The smallest budget an InfeasibleBudget names is met within those kinds too."""
    full = simulate(tiny.costs, singles(["keep"] * len(tiny.costs.blocks))).peak_bytes
    for fraction in (1.0, 0.6, 0.05):
        try:
            p = tiny.plan(budget=int(full * fraction), kinds=kinds, segments=segments)
        except InfeasibleBudget as e:
            p = tiny.plan(budget=e.minimum, kinds=kinds, segments=segments)
            assert p.predicted_peak_bytes <= e.minimum
        assert {u.kind for u in p.units} <= set(kinds), (fraction, p.choices, p.source)
        if not segments:
            assert all(u.start == u.end for u in p.units)
