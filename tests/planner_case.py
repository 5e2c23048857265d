"""The planner tests' case: a model, its step, its blocks and their costs measured once on CPU."""

import math

import torch

import ckpt_offload as co
from helpers import grads_of
from models_for_tests import lm_loss

from ckpt_offload.blocks import select_blocks
from ckpt_offload.planner import Bandwidth, measure_costs, saved_activation_peak
from ckpt_offload.blocks import install_units

#: The link the cases are measured with: an instant D2H (the tests drain the forward's copies
#: before backward, so the copy backlog, whose timing a CPU cannot reproduce, stays out of the
#: measured peaks) and a 2 GB/s H2D.
DRAINED_LINK = Bandwidth(math.inf, 2e9, 0.0)
CPU_ALL = {"devices": ["cpu"], "min_bytes": 0}


class PlannerCase:
    """``model`` trained on ``batch`` with ``loss_fn(model, batch)``; ``named`` its blocks,
    ``costs`` their measured CostModel."""

    def __init__(self, model, batch, loss_fn=lm_loss, bandwidth=DRAINED_LINK):
        self.model, self.batch, self.loss_fn = model, batch, loss_fn
        self.named = select_blocks(model, None)
        self.costs = measure_costs(self.step, self.named, "cpu", bandwidth=bandwidth, min_bytes=0)

    def step(self):
        torch.manual_seed(0)
        self.loss_fn(self.model, self.batch).backward()

    def drained_step(self):
        # The forward's copies finish before backward: the measured peak then has no copy backlog.
        torch.manual_seed(0)
        loss = self.loss_fn(self.model, self.batch)
        co.synchronize()
        loss.backward()

    def plan(self, **kwargs):
        """``co.plan`` of this case on CPU, from its measured costs."""
        offload = {**CPU_ALL, **kwargs.pop("offload", {})}
        return co.plan(self.model, self.step, **{"costs": self.costs, "offload": offload, **kwargs})

    def grads(self, drained: bool = False) -> dict:
        """The gradients of one step (from zero), as the model is wrapped now."""
        self.model.zero_grad(set_to_none=True)
        (self.drained_step if drained else self.step)()
        g = grads_of(self.model)
        self.model.zero_grad(set_to_none=True)
        return g

    def timeline(self, units, options):
        """The SavedTimeline of a drained step (after a warm-up one) with ``units`` applied with
        ``options`` (install_units' offload options, or None)."""
        handle = install_units(self.model, self.named, units, options)
        try:
            self.drained_step()
            return saved_activation_peak(self.drained_step)
        finally:
            handle.remove()
            self.model.zero_grad(set_to_none=True)

    def measured(self, units, prefetch, grads: bool = True):
        """The measured peak of saved activations of a drained step with ``units`` applied, and
        with ``grads`` the gradients of a step under them: ``(peak, gradients)``."""
        handle = install_units(self.model, self.named, units, dict(CPU_ALL, prefetch_bytes=prefetch))
        try:
            self.drained_step()  # warm-up with the plan
            peak = saved_activation_peak(self.drained_step).peak_bytes
            return (peak, self.grads()) if grads else peak
        finally:
            handle.remove()
            self.model.zero_grad(set_to_none=True)

    def measured_peak(self, units, prefetch) -> int:
        return self.measured(units, prefetch, grads=False)
