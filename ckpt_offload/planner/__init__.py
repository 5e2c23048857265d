"""The memory-budget planner: per block keep / offload / recompute / recompute with the input
offloaded / selective recompute (and segments of blocks, flat or nested), chosen from measured costs by a simulator
so that saved activations fit a budget with the least predicted step time.

Example::

    import ckpt_offload as co
    plan = co.plan(model, step, budget="2GiB")
    print(plan.summary())
    handle = plan.apply()

See docs/planner.md.
"""

from ckpt_offload.planner.costs import Bandwidth, BlockCost, CostModel, Storage, measure_bandwidth, measure_costs
from ckpt_offload.planner.measure import SavedTimeline, saved_activation_peak
from ckpt_offload.planner.planning import Plan, parse_bandwidth, parse_bytes, plan
from ckpt_offload.planner.simulator import (
    INNER_KINDS, KINDS, SEGMENT_KINDS, SimResult, Unit, choice_names, simulate, singles,
)
from ckpt_offload.planner.solver import InfeasibleBudget, baselines, chain_dp, chain_exhaustive, rotor, solve

__all__ = [
    "plan", "Plan", "parse_bytes", "parse_bandwidth", "Bandwidth", "BlockCost", "CostModel", "Storage",
    "measure_costs", "measure_bandwidth", "saved_activation_peak", "SavedTimeline", "KINDS", "SEGMENT_KINDS",
    "INNER_KINDS", "choice_names",
    "SimResult", "Unit", "simulate", "singles", "InfeasibleBudget", "baselines", "chain_dp", "chain_exhaustive",
    "rotor", "solve",
]
