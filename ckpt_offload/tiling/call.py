"""One tiled call: the function, its arguments with the tensors taken out, which tensors are cut
along which dimension, the tiles, and what backward needs to replay them; run on one tile or on
the whole call."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_unflatten


class _Call:
    """One tiled call: the function, its arguments with the tensors taken out, which tensors are
    split along which dimension, the tiles, and what backward needs to replay them."""

    __slots__ = (
        "autocast",
        "dims",
        "fn",
        "n",
        "n_tensors",
        "out_dim",
        "owner",
        "param_versions",
        "positions",
        "reduce",
        "rng",
        "single",
        "skeleton",
        "spec",
        "tiles",
    )

    def fill(self, tensors, start=None, length=None):
        """The arguments of one tile (``start``/``length`` along the tiled dimension), or of the
        whole call (``start`` None)."""
        filled = list(self.skeleton)
        for i, t, d in zip(self.positions, tensors, self.dims):
            # A tile along the sequence of a batch of sequences is strided; given contiguous (as the
            # untiled input is), so that code that views its input (x.view(-1, h)) works. With one
            # sequence it is contiguous already: no copy.
            filled[i] = t if (d is None or start is None) else t.narrow(d, start, length).contiguous()
        return tree_unflatten(filled, self.spec)

    def run(self, tensors, start=None, length=None) -> tuple:
        """The function on one tile (or the whole call); its outputs as a tuple."""
        a, kw = self.fill(tensors, start, length)
        out = self.fn(*a, **kw)
        if isinstance(out, torch.Tensor):
            self.single = True
            return (out,)
        if isinstance(out, (tuple, list)) and out and all(isinstance(o, torch.Tensor) for o in out):
            self.single = False
            return tuple(out)
        raise TypeError(f"co.tiled: the function must return a tensor or a tuple of tensors, got {_describe(out)}")


def _describe(out) -> str:
    if isinstance(out, (tuple, list)):
        return f"a {type(out).__name__} of " + ", ".join(type(o).__name__ for o in out)
    return type(out).__name__


def _float(t) -> bool:
    return t.is_floating_point() or t.is_complex()
