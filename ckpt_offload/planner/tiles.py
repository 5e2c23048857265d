"""The tile as a planner choice per block: ``co.plan(model, step, budget, tile=...)``.

Tiling a block's MLP and norms (``co.tile``, :mod:`ckpt_offload.tiling`) changes what the block
saves for backward (they keep their inputs only, no intermediate) and how long its backward takes
(each tile's forward runs again before its backward). Both are measured, not modelled: the step is
measured a second time with every block tiled, which gives each block a tiled :class:`BlockCost`
beside its untiled one. The solver then runs on a cost model in which some blocks are tiled.

Note [Fewest tiles]
Tiling costs time (a tile's forward again in backward, a fixed cost per tile) and buys memory, so a
plan tiles only where the budget needs it: first the plan without tiles; if no plan fits, the blocks
are tiled in the order of the bytes tiling saves them (most first; equal savings: the later block
first, which backward reaches while the most is still held), and the smallest number ``k`` of them
for which a plan fits is found by bisection (a block tiled never saves more than untiled, so more
tiles never make a budget infeasible). The plan is the fastest one for those ``k`` blocks. Its
summary says how many blocks it tiled and why: the smallest peak without tiles, with them, and the
time the tiles add.
"""

from __future__ import annotations

import dataclasses

from ckpt_offload.planner.costs import CostModel
from ckpt_offload.planner.measuring import measure_costs
from ckpt_offload.planner.solver import InfeasibleBudget, solve
from ckpt_offload.tile_model import TileOptions, tile_blocks

__all__ = ["measure_tiled_costs", "mixed_costs", "tile_order", "solve_with_tiles"]


def measure_tiled_costs(
    step, model, named_blocks, options: TileOptions, device: str, bandwidth, min_bytes: int
) -> CostModel:
    """The cost model of ``step`` with every block's MLP (and norms) tiled as ``options`` say (installed
    for the measurement only; the head is never fused here: ``step`` is the caller's).

    Example::

        tiled_costs = measure_tiled_costs(step, model, select_blocks(model, None), TileOptions(tile=16), "cpu",
                                          None, 0)
    """
    handle = tile_blocks(model, named_blocks, dataclasses.replace(options, head=False), "co.plan")
    try:
        return measure_costs(step, named_blocks, device=device, bandwidth=bandwidth, min_bytes=min_bytes)
    finally:
        handle.remove()


def mixed_costs(untiled: CostModel, tiled: CostModel, which) -> CostModel:
    """``untiled`` with the blocks in ``which`` (indices) measured tiled (their calls too).

    Example::

        cm = mixed_costs(untiled_costs, tiled_costs, [3])    # block 3 tiled, the others not
    """
    which = set(which)
    blocks = [t if i in which else u for i, (u, t) in enumerate(zip(untiled.blocks, tiled.blocks))]
    calls = untiled.call_blocks
    if calls and len(tiled.call_blocks) == len(calls):
        calls = [
            t if untiled.call_order[k] in which else u
            for k, (u, t) in enumerate(zip(untiled.call_blocks, tiled.call_blocks))
        ]
    return dataclasses.replace(untiled, blocks=blocks, call_blocks=calls)


def tile_order(untiled: CostModel, tiled: CostModel) -> list:
    """Block indices in the order Note [Fewest tiles] tiles them.

    Example::

        tile_order(untiled_costs, tiled_costs)    # [1, 2, 0]: block 1 saves most when tiled
    """
    saving = [u.saved_bytes - t.saved_bytes for u, t in zip(untiled.blocks, tiled.blocks)]
    return sorted(range(len(saving)), key=lambda i: (-saving[i], -i))


def solve_with_tiles(untiled: CostModel, tiled: CostModel, budget: int, **solve_kwargs):
    """``(best, tiled block indices, costs used, info)``: the plan of Note [Fewest tiles].

    ``info``: ``untiled_minimum`` (the smallest peak without tiles, None when a plan fit without),
    ``tiled_minimum`` (with the chosen tiles), ``extra_s`` (the measured time those blocks' tiles add
    to a step: their forward and backward, tiled minus untiled).

    Raises :class:`InfeasibleBudget` when even every block tiled does not fit (its ``minimum`` the
    smallest peak then).

    Example::

        best, tiled, cm, info = solve_with_tiles(untiled_costs, tiled_costs, 64 << 20, kinds=("keep", "recompute"))
    """
    try:
        best = solve(untiled, budget, **solve_kwargs)
        return best, [], untiled, {"untiled_minimum": None, "tiled_minimum": None, "extra_s": 0.0}
    except InfeasibleBudget as e:
        untiled_min = e.minimum
    order = tile_order(untiled, tiled)

    def attempt(k):
        cm = mixed_costs(untiled, tiled, order[:k])
        try:
            return solve(cm, budget, **solve_kwargs), cm
        except InfeasibleBudget as e:
            return e, cm

    n = len(order)
    found, cm = attempt(n)
    if isinstance(found, InfeasibleBudget):
        raise InfeasibleBudget(
            budget,
            found.minimum,
            f"budget is below the smallest peak of saved activations any plan reaches here even with every block "
            f"tiled, {found.minimum} bytes (without tiles: {untiled_min} bytes)",
        ) from None
    lo, hi, chosen = 1, n, (n, found, cm)
    while lo < hi:  # the smallest k that fits: fits(n) holds, fits(0) does not
        mid = (lo + hi) // 2
        got, cm = attempt(mid)
        if isinstance(got, InfeasibleBudget):
            lo = mid + 1
        else:
            hi, chosen = mid, (mid, got, cm)
    k, best, cm = chosen
    which = sorted(order[:k])
    extra = sum(
        (tiled.blocks[i].forward_s + tiled.blocks[i].backward_s)
        - (untiled.blocks[i].forward_s + untiled.blocks[i].backward_s)
        for i in which
    )
    return best, which, cm, {"untiled_minimum": untiled_min, "tiled_minimum": best.peak_bytes, "extra_s": extra}
