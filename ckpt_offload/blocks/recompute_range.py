"""The profiler range a plan's recomputes run in: ``ckpt_offload::recompute``, opened around a
recompute in backward, which is how the planner's measurement (``planner/saved_peak.py``) tells
recomputed activations from temporaries."""

from __future__ import annotations

import functools

import torch
import torch.utils.checkpoint
from torch.profiler import record_function

__all__ = ["RECOMPUTE_RANGE", "in_backward", "ranged"]


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (a recompute runs there)."""
    return torch._C._current_graph_task_id() != -1


# record_function is a torch op: inside a selective checkpoint's recompute it would be dispatched
# to the policy's cache and fail. RecordFunctionFast opens the same profiler range without an op.
_StopRecomputation = getattr(torch.utils.checkpoint, "_StopRecomputationError", ())
_FastRange = getattr(torch._C._profiler, "_RecordFunctionFast", None)


#: The profiler range a plan's recomputes run in (the planner's measurement reads it).
RECOMPUTE_RANGE = "ckpt_offload::recompute"


def _range(name):
    return _FastRange(name) if _FastRange is not None else record_function(name)


def ranged(fn):
    """``fn`` that, when run by a recompute in backward, runs inside a named profiler range."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not in_backward():
            return fn(*args, **kwargs)
        with _range(RECOMPUTE_RANGE):
            try:
                return fn(*args, **kwargs)
            except _StopRecomputation as e:
                # torch's early stop ends a recompute by raising through the block; the traceback's
                # frames hold the last op's output. Dropped here, so that when the range ends only
                # what the recompute keeps for backward is left.
                e.__traceback__ = None
                raise

    return run
