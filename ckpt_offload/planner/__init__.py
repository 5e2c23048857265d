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

import importlib as _importlib

from ckpt_offload._warn import deprecated_names as _deprecated_names
from ckpt_offload.planner.costs import Bandwidth, BlockCost, CostModel, Storage
from ckpt_offload.planner.measuring import measure_costs
from ckpt_offload.planner.planning import Plan, parse_bandwidth, parse_bytes, plan
from ckpt_offload.planner.saved_peak import SavedTimeline, saved_activation_peak
from ckpt_offload.planner.simulator import INNER_KINDS, KINDS, SEGMENT_KINDS, SimResult, Unit, choice_names, simulate
from ckpt_offload.planner.solver import InfeasibleBudget
from ckpt_offload.planner.timing import measure_bandwidth

__all__ = [
    "plan",
    "Plan",
    "parse_bytes",
    "parse_bandwidth",
    "Bandwidth",
    "BlockCost",
    "CostModel",
    "Storage",
    "measure_costs",
    "measure_bandwidth",
    "saved_activation_peak",
    "SavedTimeline",
    "KINDS",
    "SEGMENT_KINDS",
    "INNER_KINDS",
    "choice_names",
    "SimResult",
    "Unit",
    "simulate",
    "InfeasibleBudget",
]

# The solver's and the simulator's internals were exported here in 0.1.0; they stay reachable
# (with a DeprecationWarning) for one release, and from their modules for good.
__getattr__ = _deprecated_names(
    __name__,
    {
        name: (
            (
                f"ckpt_offload.planner.{name} is deprecated (an internal of the planner) and goes in 0.3.0: "
                f"import it from ckpt_offload.planner.{module}"
            ),
            lambda name=name, module=module: getattr(_importlib.import_module(f"ckpt_offload.planner.{module}"), name),
        )
        for name, module in {
            "chain_dp": "solver",
            "chain_exhaustive": "solver",
            "rotor": "solver",
            "baselines": "solver",
            "solve": "solver",
            "singles": "simulator",
        }.items()
    },
)
