"""Wrapping a model's blocks: which blocks, one forward installer, one handle.

:func:`apply` (``co.apply``, ``applying.py``) and plans (``Plan.apply``) both install a
:class:`BlockForward` (``forward.py``) in each block's ``__dict__``: the block's own forward, run
the way its :class:`~ckpt_offload._units.Unit` says (``install.py``) -- kept as is, inside an offload
context, checkpointed with its input kept or offloaded, selectively recomputed (``runs.py``), or as
part of a segment, one checkpoint around consecutive blocks (``segment.py``, ``chain.py``). A
:class:`CheckpointHandle` (``handle.py``) owns its blocks' offload contexts, so ``handle.stats()``
counts its blocks only, and ``remove()`` puts back exactly the forward each block had. Which
blocks: ``select.py``; the profiler range a plan's recomputes run in: ``recompute_range.py``.
"""

from ckpt_offload.blocks.applying import apply
from ckpt_offload.blocks.chain import running_stats
from ckpt_offload.blocks.forward import BlockForward
from ckpt_offload.blocks.handle import CheckpointHandle, active_handle, check_not_applied
from ckpt_offload.blocks.install import install_units
from ckpt_offload.blocks.runs import InContext
from ckpt_offload.blocks.select import select_blocks
from ckpt_offload.selective import SELECTIVE_SAVE_OPS, selective_policy

__all__ = [
    "SELECTIVE_SAVE_OPS",
    "BlockForward",
    "CheckpointHandle",
    "InContext",
    "active_handle",
    "apply",
    "check_not_applied",
    "install_units",
    "running_stats",
    "select_blocks",
    "selective_policy",
]
