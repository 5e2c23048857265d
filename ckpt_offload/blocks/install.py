"""The one block installer of co.apply and plans: :func:`install_units` wraps each block as its
unit says and returns the :class:`~ckpt_offload.blocks.handle.CheckpointHandle` that owns them.

Offloaded blocks and checkpoints with offloaded inputs of one handle share one offload context per
option set, so the engine's prefetcher sees their saved tensors in one pack order and brings back
the next block's while backward works on this one."""

from __future__ import annotations

import dataclasses

from ckpt_offload._stats import StatsCollector
from ckpt_offload._units import choice_names
from ckpt_offload.blocks.forward import BlockForward
from ckpt_offload.blocks.handle import HANDLE_ATTR, CheckpointHandle, check_not_applied
from ckpt_offload.blocks.runs import _Checkpoint, _Offload
from ckpt_offload.blocks.segment import _Segment, _SegmentFirst, _SegmentLater
from ckpt_offload.options import OffloadOptions, as_options

__all__ = ["install_units"]


def install_units(
    model,
    named_blocks,
    units,
    options: OffloadOptions | None,
    allow=frozenset(),
    *,
    every_n_layers: int = 1,
    use_reentrant: bool = False,
    torch_kwargs=None,
    ranged: bool = True,
    route: str = "a plan",
    store_dtype=None,
) -> CheckpointHandle:
    """Wraps the blocks of ``named_blocks`` as ``units`` (:class:`~ckpt_offload._units.Unit`) say;
    returns the :class:`CheckpointHandle`.

    ``options`` are the offload options of every offload and offloaded checkpoint input;
    ``allow``: the inexact reasons (``INEXACT_REASONS`` of the planner's cost model) a segment does
    not refuse; ``ranged``: recomputes run inside the ``ckpt_offload::recompute`` range (plans);
    ``store_dtype``: what the units with ``store=True`` (a plan's lossy ones) store in -- their
    options get ``store_dtype=``, so they share an offload context of their own.
    """
    options = as_options(options)
    lossy = None
    if any(getattr(u, "store", False) for u in units):
        if store_dtype is None or options is None:
            raise ValueError("units store lossy (Unit.store) but no store_dtype (or no offload options) was given")
        lossy = dataclasses.replace(options, store_dtype=store_dtype)
    check_not_applied(model, named_blocks, route)
    collector = StatsCollector()  # the handle's: its blocks' contexts and counts
    labels = choice_names(units)
    wrapped, names, kinds = [], [], []
    for u in units:
        if u.kind == "keep":
            continue
        offload = (lossy if u.store else options) if u.kind in ("offload", "recompute_offload") else None
        if u.kind == "selective_offload":
            offload = None  # the checkpoint's input stays; the policy's outputs go to the pool
        if u.end > u.start:
            members = named_blocks[u.start : u.end + 1]
            seg = _Segment(
                [b for _, b in members], [n for n, _ in members], offload, u, collector, allow=frozenset(allow)
            )
            runs = [_SegmentFirst(seg)] + [_SegmentLater(seg, j) for j in range(1, len(members))]
        else:
            members = [named_blocks[u.start]]
            if u.kind == "offload":
                runs = [_Offload(offload, collector)]
            else:
                runs = [
                    _Checkpoint(
                        offload,
                        use_reentrant,
                        torch_kwargs,
                        collector,
                        ranged=ranged,
                        selective=u.kind in ("selective", "selective_offload"),
                        selective_offload=options if u.kind == "selective_offload" else None,
                    )
                ]
        for j, ((name, block), run) in enumerate(zip(members, runs)):
            BlockForward(block, run).install()
            wrapped.append(block)
            names.append(name)
            kinds.append(labels[u.start + j])
    handle = CheckpointHandle(model, wrapped, names, kinds, every_n_layers, collector)
    model.__dict__[HANDLE_ATTR] = handle
    return handle
