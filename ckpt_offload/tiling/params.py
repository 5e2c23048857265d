"""The parameters a tiled function reads: the first call finds those a function closes over (they
get gradients) and refuses activations it closes over (their gradient would be lost); and the
``params=`` a caller gives, checked."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from ckpt_offload.tiling.call import _Call


class _ReadsWatch(TorchFunctionMode):
    """Records, while a tile runs, the tensors requiring grad that the function reads besides its
    inputs: leaves (parameters it closes over) and non-leaves (activations it closes over)."""

    def __init__(self, known_ids: set):
        super().__init__()
        self.known = known_ids
        self.leaves: dict = {}
        self.others: list = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor) and id(t) not in self.known and t.requires_grad:
                if t.grad_fn is None:
                    self.leaves.setdefault(id(t), t)
                elif not self.others:
                    self.others.append(t)
        return func(*args, **kwargs)


def find_params(name: str, function, call, tensors, known: set) -> list:
    """Note [Parameters a tiled function reads]
    Backward differentiates each tile with respect to its inputs and a list of parameters, and
    returns those gradients from the tiled call's node: a tensor requiring grad that the function
    reads without it being in that list would silently get no gradient. So the first call runs its
    first tile once more, eagerly, under no_grad and a TorchFunctionMode that records every tensor
    requiring grad that reaches an op and is not an argument: leaves (parameters the function
    closes over: a lambda over a head's weight) join the list, an activation it closes over (a
    non-leaf, which could not be saved with the arguments) is refused. The RNG is forked around
    it, so it draws nothing from the caller's generators. Later calls use the list found then."""
    watch = _ReadsWatch(known)
    probe = _Call()
    for slot in _Call.__slots__:
        setattr(probe, slot, getattr(call, slot, None))
    probe.fn = function  # eager: the mode is not for Dynamo to trace
    devices = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices), torch.no_grad(), watch:
        probe.run(tensors, *call.tiles[0])
    if watch.others:
        t = watch.others[0]
        raise RuntimeError(
            f"{name}: the function reads a tensor that requires grad and is neither one of its arguments "
            f"nor a parameter (shape {list(t.shape)}, made by {type(t.grad_fn).__name__}): tiled, its "
            "gradient would be lost, since backward recomputes each tile from the saved arguments only. Pass it "
            "to the function as an argument (e.g. co.tiled(f)(x, that_tensor))."
        )
    return list(watch.leaves.values())


def _check_params(params) -> list:
    try:
        out = list(params)
    except TypeError:
        raise TypeError(
            f"params must be an iterable of tensors (e.g. module.parameters()), got {type(params).__name__}"
        ) from None
    for i, p in enumerate(out):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"params[{i}] must be a tensor (a parameter), got {type(p).__name__}")
    return out
