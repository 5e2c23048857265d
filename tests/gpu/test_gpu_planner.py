"""GPU tests for the planner (co.plan) on CUDA: the simulator's predicted peak of saved activations
against the measured one, and an applied plan within its budget with bit-identical gradients.

Marked ``gpu``; skipped cleanly without a usable CUDA device.
"""

import math

import pytest
import torch

import ckpt_offload as co
from ckpt_offload.planner import Bandwidth, Unit, measure_costs, saved_activation_peak, simulate
from ckpt_offload.planner.simulator import singles
from ckpt_offload.blocks import install_units

from conftest import assert_bit_identical, grads_of
from helpers import GPU_REASON, HAS_GPU
from models_for_tests import TinyTransformer, lm_loss, make_batch, make_config


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAS_GPU, reason=GPU_REASON),
]


@pytest.fixture(scope="module")
def case():
    from ckpt_offload.blocks import select_blocks as _select_blocks

    cfg = make_config("small", layers=4)
    model = TinyTransformer(**cfg.model_kwargs(), seed=0).cuda().train()
    tokens = make_batch(cfg, seed=0, device="cuda")

    def step():
        torch.manual_seed(0)
        lm_loss(model, tokens).backward()

    return model, step, tokens, _select_blocks(model, None)


KINDS = ("keep", "offload", "recompute", "recompute_offload", "selective")


# A nested segment: blocks 0-3 as one checkpoint whose recompute checkpoints 0-1 and 2 again. On a
# GPU the checkpoints' random states live in host memory: the cost model counts none.
NESTED = [Unit(0, 3, "recompute", inner=(Unit(0, 1, "recompute"), Unit(2, 2, "recompute"), Unit(3, 3, "keep")))]


def _why(timeline, stats):
    """For a failure: what the measured peak holds (the counted allocations alive at it, by why:
    count and bytes) and the plan's prefetch counters."""
    at = max(timeline.timeline, key=lambda p: p[1])[0]
    held = {}
    for alloc_s, free_s, nbytes, why in timeline.allocations:
        if alloc_s <= at < free_s:
            n, b = held.get(why, (0, 0))
            held[why] = (n + 1, b + nbytes)
    keys = (
        "prefetches",
        "prefetch_hits",
        "prefetches_unused",
        "peak_prefetch_bytes",
        "tensors_reloaded",
        "device_saved_peak_bytes",
    )
    return (
        f"peak at {at * 1e3:.3f} ms (backward from {(timeline.backward_start_s or 0) * 1e3:.3f} ms) holds "
        f"{held}; { ({k: stats.get(k) for k in keys}) }"
    )


@pytest.mark.parametrize("kind", KINDS + ("nested",))
def test_gpu_simulated_peak_matches_measured(case, kind):
    model, step, tokens, named = case
    # An instant D2H link in the simulator and a drained forward in the step: no copy backlog.
    cm = measure_costs(step, named, "cuda", bandwidth=Bandwidth(math.inf, 10e9, 0.0), min_bytes=0)
    model.zero_grad(set_to_none=True)
    prefetch = max(b.saved_bytes for b in cm.blocks)
    units = NESTED if kind == "nested" else singles([kind] * len(named))
    assert cm.checkpoint_bytes == 0
    predicted = simulate(cm, units, prefetch).peak_bytes

    def drained():
        torch.manual_seed(0)
        loss = lm_loss(model, tokens)
        torch.cuda.synchronize()
        co.synchronize()
        loss.backward()

    handle = install_units(model, named, units, {"devices": ["cuda"], "min_bytes": 0, "prefetch_bytes": prefetch})
    try:
        drained()
        timeline = saved_activation_peak(drained, "cuda")
        measured = timeline.peak_bytes
        stats = handle.stats()
    finally:
        handle.remove()
        model.zero_grad(set_to_none=True)
    # The CUDA caching allocator rounds blocks up to 512 bytes: compare with 5% tolerance.
    assert measured == pytest.approx(predicted, rel=0.05), _why(timeline, stats)


def test_gpu_plan_within_budget_bit_identical(case):
    model, step, tokens, named = case
    model.zero_grad(set_to_none=True)
    step()
    reference = grads_of(model)
    model.zero_grad(set_to_none=True)
    full = simulate(
        measure_costs(step, named, "cuda", bandwidth=Bandwidth(10e9, 10e9, 1e-5)), singles(["keep"] * len(named))
    ).peak_bytes
    model.zero_grad(set_to_none=True)
    plan = co.plan(model, step, budget=full // 3)
    model.zero_grad(set_to_none=True)
    handle = plan.apply()
    try:
        step()
        torch.cuda.synchronize()
        with_plan = grads_of(model)
        model.zero_grad(set_to_none=True)
        timeline = saved_activation_peak(step, "cuda")
        measured = timeline.peak_bytes
        stats = handle.stats()
    finally:
        handle.remove()
        model.zero_grad(set_to_none=True)
    assert_bit_identical(reference, with_plan)
    # copy backlog timing on a real link: a little slack
    assert measured <= plan.budget * 1.05, _why(timeline, stats)
