"""co.plan(..., tile=...): the tile as a choice per block (Note [Fewest tiles] in planner/tiles.py).

The plan tiles no block when the budget fits without tiles, the fewest that fit otherwise (one
fewer does not fit), says why in its summary, predicts the peak the profiler-free measurement of the
applied plan shows, and gives gradients within the tiling tolerance of the untiled step."""

from __future__ import annotations

import pytest
import torch

import torch.nn as nn

import ckpt_offload as co
from helpers import grads_of

from ckpt_offload.planner import saved_activation_peak
from ckpt_offload.planner.solver import solve
from ckpt_offload.planner.tiles import mixed_costs, tile_order

KINDS = ("keep", "recompute")  # no copies: peaks are bytes only, the same from run to run


class Block(nn.Module):
    """A pre-norm residual MLP block; the blocks differ in MLP width, so tiling the widest one saves most."""

    def __init__(self, dim, ffn):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, ffn), nn.GELU(), nn.Linear(ffn, dim))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Block(32, 64), Block(32, 512), Block(32, 64)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


@pytest.fixture(scope="module")
def case():
    model = Model().train()
    x = torch.randn(2, 256, 32, generator=torch.Generator().manual_seed(1))

    def step():
        model(x).square().mean().backward()

    roomy = co.plan(model, step, budget="1GiB", kinds=KINDS, tile=16)  # measures both cost models
    model.zero_grad(set_to_none=True)
    return model, step, roomy


def _minimum(costs) -> int:
    with pytest.raises(co.planner.InfeasibleBudget) as e:
        solve(costs, 1, kinds=KINDS)
    return e.value.minimum


def test_a_budget_that_fits_untiled_tiles_nothing(case):
    model, step, roomy = case
    assert roomy.tiles == [] and "fits without tiling" in roomy.summary()


def test_the_fewest_tiles_that_fit_and_the_measured_peak(case):
    model, step, _ = case
    untiled_costs = co.plan(model, step, budget="1GiB", kinds=KINDS).costs
    model.zero_grad(set_to_none=True)
    # A budget between the smallest peak with every block tiled and the smallest without tiles.
    try:
        co.plan(model, step, budget=1, kinds=KINDS, tile=16)
    except co.planner.InfeasibleBudget as e:
        assert "with every block tiled" in str(e)
        tiled_min = e.minimum
    untiled_min = _minimum(untiled_costs)
    assert tiled_min < untiled_min
    budget = (tiled_min + untiled_min) // 2
    plan = co.plan(model, step, budget=budget, kinds=KINDS, tile=16)
    model.zero_grad(set_to_none=True)
    k = len(plan.tiles)
    assert k == 1 and plan.tiles == ["blocks.1"]  # the widest MLP: tiling it alone fits
    assert plan.predicted_peak_bytes <= budget
    assert "1 of 3 blocks tiled (MLP and norms), the fewest that fit" in plan.summary()
    assert plan.tile_info["untiled_minimum"] > budget - 256
    # One block fewer, in the planner's order, does not fit.
    tiled_costs = plan.costs
    order = tile_order(untiled_costs, tiled_costs)
    fewer = mixed_costs(untiled_costs, tiled_costs, order[: k - 1])
    assert _minimum(fewer) > budget - 256
    # Applied: the measured peak of saved activations is the predicted one, gradients within tolerance.
    step()
    ref = grads_of(model)
    model.zero_grad(set_to_none=True)
    handle = plan.apply()
    assert handle.tiles is not None and handle.tiles.names == ["blocks.1.mlp", "blocks.1.norm"]
    step()
    model.zero_grad(set_to_none=True)
    measured = saved_activation_peak(step)
    assert abs(measured.peak_bytes - plan.predicted_peak_bytes) <= 0.02 * plan.predicted_peak_bytes + 256
    got = grads_of(model)
    for n, g in ref.items():
        assert float((got[n] - g).norm() / g.norm()) <= 1e-5, n
    handle.remove()
    model.zero_grad(set_to_none=True)
    assert all("forward" not in b.mlp.__dict__ for b in model.blocks)


def test_bad_tile_option_names_the_argument(case):
    model, step, _ = case
    with pytest.raises(TypeError, match="tile must be True/False/None"):
        co.plan(model, step, budget="1GiB", tile=[16])
