"""``measure_error=True``: the tiled call's outputs and gradients against the untiled run's, per
class (``output``, ``input_grad``, ``param_grad``): relative error and whether bit-identical,
in ``Tiled.stats()["tile_error"]``."""

from __future__ import annotations

import contextlib

import torch

from ckpt_offload.tiling.call import _float
from ckpt_offload.tiling.replay import _autocast


class _ErrorClass:
    __slots__ = ("bit_identical", "max_rel", "sum_rel", "tensors")

    def __init__(self):
        self.tensors, self.sum_rel, self.max_rel, self.bit_identical = 0, 0.0, 0.0, True

    def add(self, tiled_value, untiled_value) -> None:
        if tiled_value is None or untiled_value is None:
            return
        a, b = tiled_value.detach().double(), untiled_value.detach().double()
        rel = float((a - b).norm() / b.norm().clamp_min(1e-300))
        self.tensors += 1
        self.sum_rel += rel
        self.max_rel = max(self.max_rel, rel)
        self.bit_identical = self.bit_identical and torch.equal(tiled_value, untiled_value)

    def as_dict(self) -> dict:
        return {
            "tensors": self.tensors,
            "mean_rel_error": self.sum_rel / max(self.tensors, 1),
            "max_rel_error": self.max_rel,
            "bit_identical": self.bit_identical,
        }


def _measure_forward(call, tensors, outs) -> None:
    owner = call.owner
    if owner is None or not owner.measure_error:
        return
    with contextlib.ExitStack() as stack:
        if call.rng is not None:
            stack.enter_context(call.rng.replay())
        stack.enter_context(torch.no_grad())
        ref = call.run(tensors)
    with owner._lock:
        for o, r in zip(outs, ref):
            owner._errors.setdefault("output", _ErrorClass()).add(o, r)


def _measure_backward(call, saved, params, grads, tiled_grads) -> None:
    owner = call.owner
    if owner is None or not owner.measure_error:
        return
    inputs = [t.detach().requires_grad_(t.requires_grad) if _float(t) else t for t in saved]
    with contextlib.ExitStack() as stack:
        if call.rng is not None:
            stack.enter_context(call.rng.replay())
        stack.enter_context(_autocast(call.autocast))
        with torch.enable_grad():
            outs = call.run(inputs)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        wanted = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad] + params
        if not pairs or not wanted:
            return
        ref = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
    it = iter(ref)
    with owner._lock:
        for x, got in zip(inputs, tiled_grads):
            if isinstance(x, torch.Tensor) and x.requires_grad:
                owner._errors.setdefault("input_grad", _ErrorClass()).add(got, next(it))
        for got in tiled_grads[len(inputs) :]:
            owner._errors.setdefault("param_grad", _ErrorClass()).add(got, next(it))
