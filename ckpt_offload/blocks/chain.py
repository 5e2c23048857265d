"""How a segment hands one block's output on to the next block: the hidden state (the output, or
its first element) as the next block's first argument -- positional, or by the keyword its forward
names first -- and the other arguments unchanged. A segment (``segment.py``) runs blocks so, and
the planner's measurement asks of each pair of blocks whether the model calls them so."""

from __future__ import annotations

import inspect

import torch
from torch.utils._pytree import tree_flatten

__all__ = ["hidden", "hidden_key", "next_args", "rest", "running_stats", "same_rest", "unchained_reason"]


def hidden(out):
    """A block's hidden state: its output, or the output's first element."""
    return out[0] if isinstance(out, (tuple, list)) else out


def hidden_key(module) -> str:
    """The keyword a block's hidden state comes by when the model calls it by keyword: the first
    parameter of its forward (``x`` of ``forward(self, x, mask)``; ``hidden_states`` for Hugging
    Face layers and for a forward that takes ``*args``)."""
    try:
        first = next(iter(inspect.signature(module.forward).parameters.values()), None)
    except (TypeError, ValueError):
        first = None
    if first is None or first.kind not in (first.POSITIONAL_ONLY, first.POSITIONAL_OR_KEYWORD):
        return "hidden_states"
    return first.name


def unchained_reason(out) -> str | None:
    """Why a segment cannot hand ``out``, a block's output, on to the next block (None: it can)."""
    from collections.abc import Mapping

    if isinstance(out, Mapping):
        keys = ", ".join(repr(k) for k in list(out)[:4])
        return (
            f"returns a dict ({keys}) that the model unpacks before the next block, while a segment hands "
            "a block's output (or its first element) to the next block as its first argument"
        )
    return None


def next_args(out, args, kwargs, key="hidden_states"):
    """The arguments of the next block of a segment: the previous block's hidden state as its first
    argument (positional, or ``key=`` (:func:`hidden_key`) when the blocks are called by keyword),
    the others unchanged."""
    h = hidden(out)
    if args:
        return (h, *args[1:]), kwargs
    kwargs = dict(kwargs)
    kwargs[key] = h
    return (), kwargs


def rest(args, kwargs, key="hidden_states"):
    """What a segment's block gets besides its hidden state (the first argument, or ``key=``)."""
    if args:
        return args[1:], kwargs
    return (), {k: v for k, v in kwargs.items() if k != key}


def _same_leaf(a, b) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) or type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError):  # == raises or is not a bool: only itself is the same
        return False


def same_rest(got, expected) -> bool:
    """Whether a later block of a segment got the arguments (besides its hidden state) the segment
    ran it with: the first block's, the same tensors (by identity) and equal other values."""
    (ga, gk), (ea, ek) = got, expected
    if len(ga) != len(ea) or set(gk) != set(ek):
        return False
    g_leaves, g_spec = tree_flatten((ga, gk))
    e_leaves, e_spec = tree_flatten((ea, {k: ek[k] for k in gk}))
    return g_spec == e_spec and all(_same_leaf(a, b) for a, b in zip(g_leaves, e_leaves))


def running_stats(module):
    """Prefixes (``"bn."``) of the submodules of ``module`` that update running statistics in
    forward (BatchNorm and the like in training mode, tracking them)."""
    from torch.nn.modules.batchnorm import _NormBase

    return [
        f"{n}." if n else ""
        for n, m in module.named_modules()
        if isinstance(m, _NormBase) and m.training and m.track_running_stats
    ]
