"""Installing a plan on a model: its units mapped onto the model's blocks.

Each unit says what its blocks do ("offload", "recompute", "recompute_offload", "selective", a
segment of blocks recomputed as one, flat or nested); :func:`ckpt_offload.blocks.install.install_units`,
the installer ``co.apply`` uses too, wraps the blocks accordingly. The handle it returns owns the
plan's offload contexts (``handle.stats()`` counts this plan's blocks only) and ``remove()`` puts
back each block's own forward.
"""

from __future__ import annotations

from ckpt_offload._warn import deprecated_names
from ckpt_offload.blocks.handle import CheckpointHandle
from ckpt_offload.blocks.install import install_units
from ckpt_offload.selective import create_selective_checkpoint_contexts, selective_policy  # noqa: F401  (as before)

__all__ = ["apply_units", "selective_policy"]

# PlanHandle, 0.1.0's class of a plan's handle, is co.CheckpointHandle since 0.2.0 (co.apply's).
__getattr__ = deprecated_names(__name__, {
    "PlanHandle": (("ckpt_offload.planner.apply.PlanHandle is deprecated and goes in 0.3.0: use co.CheckpointHandle "
                    "(plan.apply() returns one)"), lambda: CheckpointHandle),
})


def apply_units(model, named_blocks, units, offload_options, allow=frozenset(), store_dtype=None):
    """Wraps the blocks of ``named_blocks`` as ``units`` say; returns a :class:`CheckpointHandle`.

    ``offload_options`` (an :class:`~ckpt_offload.OffloadOptions` or a dict of its options) are the
    options of every offload and offloaded checkpoint input; ``allow``: the reasons of
    ``INEXACT_REASONS`` (planner/costs.py) a segment does not refuse; ``store_dtype``: what the
    units with ``store=True`` store in (their options get ``store_dtype=``, so they share a
    co.offload context of their own).
    """
    return install_units(model, named_blocks, units, offload_options, allow, route="a plan", store_dtype=store_dtype)
