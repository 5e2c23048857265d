"""Segments over blocks that return a dict the model unpacks, or that the model calls by keyword:
co.plan offers only segments it can run (the others go to ``plan.excluded`` with the reason),
co.apply(segments=...) refuses a dict-returning chain with that reason, and keyword-called blocks
are segmented exactly (bit-identical gradients)."""

import pytest
import torch
import torch.nn as nn

import ckpt_offload as co
from conftest import assert_bit_identical
from helpers import grads_of

CPU_ALL = {"devices": ["cpu"], "min_bytes": 0}


class DictBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x, mask=None):
        h = torch.tanh(self.lin2(torch.tanh(self.lin1(x)) ** 2))
        return {"h": h if mask is None else h * mask, "aux": h.sum()}


class DictModel(nn.Module):
    """o = b(x); x = o["h"]: each block's dict is unpacked by the model."""

    def __init__(self, n=4, d=16):
        super().__init__()
        self.blocks = nn.ModuleList(DictBlock(d) for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)["h"]
        return x


class KwBlock(nn.Module):
    # Several saved tensors per block, so that recomputing it (keeping only its input) pays.
    def __init__(self, d):
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x, mask):
        h = torch.tanh(self.lin1(x))
        return torch.tanh(self.lin2(h * h)) * mask


class KwModel(nn.Module):
    """b(x=h, mask=m): every block called by keyword."""

    def __init__(self, n=4, d=16):
        super().__init__()
        self.blocks = nn.ModuleList(KwBlock(d) for _ in range(n))

    def forward(self, h, mask):
        for b in self.blocks:
            h = b(mask=mask, x=h)
        return h


def _data(d=16):
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, d, generator=g, requires_grad=True), (torch.rand(8, d, generator=g) > 0.2).float()


def _step(model):
    x, mask = _data()
    if isinstance(model, KwModel):
        return lambda: model(x, mask).square().sum().backward()
    return lambda: model(x).square().sum().backward()


def _reference(model):
    model.zero_grad(set_to_none=True)
    _step(model)()
    g = grads_of(model)
    model.zero_grad(set_to_none=True)
    return g


def test_plan_offers_no_segment_over_dict_blocks_and_says_why():
    torch.manual_seed(0)
    model = DictModel(n=6)
    ref = _reference(model)
    plan = _least_plan(model, kinds=("keep", "recompute"))  # where segments would pay, were they possible
    assert all(u.end == u.start for u in plan.units), plan.choices
    assert set(plan.excluded) == {f"blocks.{i}" for i in range(5)}, plan.excluded  # the last one hands on nothing
    assert all("returns a dict ('h', 'aux')" in ex["segment"] for ex in plan.excluded.values()), plan.excluded
    assert "returns a dict" in plan.summary()
    handle = plan.apply()
    try:
        assert_bit_identical(ref, _reference(model))
    finally:
        handle.remove()


def _least_plan(model, **kwargs):
    """The plan at the least budget any plan reaches (where segments pay most)."""
    try:
        return co.plan(model, _step(model), budget=1, **CPU_ALL, **kwargs)
    except co.planner.InfeasibleBudget as e:
        return co.plan(model, _step(model), budget=e.minimum, **CPU_ALL, **kwargs)


def test_apply_segments_over_dict_blocks_is_refused_with_the_reason():
    model = DictModel()
    handle = co.apply(model, segments=2)
    try:
        with pytest.raises(RuntimeError, match=r"blocks\.1 follows blocks\.0, which returns a dict \('h', 'aux'\)"):
            _step(model)()
    finally:
        handle.remove()
    # After the refusal the model runs as before (nothing half-installed).
    _step(model)()


def test_keyword_called_blocks_are_segmented_exactly():
    torch.manual_seed(0)
    model = KwModel(n=6)
    ref = _reference(model)
    # A pageable pool on every machine (the default pool is pinned where a GPU is usable).
    handle = co.apply(model, segments=2, offload={**CPU_ALL, "pool": co.HostPool(pinned=False)})
    try:
        assert_bit_identical(ref, _reference(model))
    finally:
        handle.remove()
    plan = _least_plan(model, kinds=("keep", "recompute"))
    assert not plan.excluded, plan.excluded
    assert any(u.end > u.start for u in plan.units), plan.choices  # segments are offered and chosen
    handle = plan.apply()
    try:
        assert_bit_identical(ref, _reference(model))
    finally:
        handle.remove()
