"""0.1.0's module of a plan's handle, kept for its deprecated name only: a plan is installed by
:func:`ckpt_offload.blocks.install.install_units` (``Plan.apply``), the installer ``co.apply`` uses
too, and returns a :class:`~ckpt_offload.CheckpointHandle`.
"""

from __future__ import annotations

from ckpt_offload._warn import deprecated_names
from ckpt_offload.blocks.handle import CheckpointHandle

__all__ = []

# PlanHandle, 0.1.0's class of a plan's handle, is co.CheckpointHandle since 0.2.0 (co.apply's).
__getattr__ = deprecated_names(
    __name__,
    {
        "PlanHandle": (
            (
                "ckpt_offload.planner.apply.PlanHandle is deprecated and goes in 0.3.0: use co.CheckpointHandle "
                "(plan.apply() returns one)"
            ),
            lambda: CheckpointHandle,
        ),
    },
)
