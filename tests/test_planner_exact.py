"""A plan (and ``co.apply(segments=...)``) is exact or refused: segments hand every block its own
outputs, the planner never offers a block a choice it cannot run exactly (in-place writes to its
input, mutation of what selective recompute saves, running statistics), ``InfeasibleBudget``
names the true minimum, and ``co.plan`` refuses a step it cannot plan. Each test compares loss,
gradients and module state with a run without any plan.
"""

import math

import pytest
import torch
import torch.nn as nn

import ckpt_offload as co
from ckpt_offload.checkpoint import _select_blocks
from ckpt_offload.planner import Unit
from ckpt_offload.planner.apply import apply_units

R = "recompute"


def _state(model):
    """Loss-independent module state: parameters' gradients and every buffer (running statistics)."""
    out = {f"grad:{n}": p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    out.update({f"buffer:{n}": b.detach().clone() for n, b in model.named_buffers()})
    return out


def _run(model, step):
    """One step from the model's current state: (loss, gradients and buffers after it)."""
    model.zero_grad(set_to_none=True)
    loss = step()
    return loss, _state(model)


def assert_same_step(ref, got):
    (l1, s1), (l2, s2) = ref, got
    assert torch.equal(l1, l2), f"loss differs: {l1.item()} vs {l2.item()}"
    assert s1.keys() == s2.keys()
    differing = [k for k in s1 if not torch.equal(s1[k], s2[k])]
    assert not differing, f"differ: {differing}"


# ---- segments pass every block's own outputs through (issue 23, item 1) ----------------------------


class AuxBlock(nn.Module):
    """Returns (hidden, aux): the model's loss uses every block's aux."""

    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        return h, (h * h).mean()


class AuxChain(nn.Module):
    def __init__(self, n=12, d=8):
        super().__init__()
        self.blocks = nn.ModuleList(AuxBlock(d) for _ in range(n))

    def forward(self, x):
        aux = []
        for b in self.blocks:
            x, a = b(x)
            aux.append(a)
        return x.sum() - sum((i + 1) * a for i, a in enumerate(aux))


def _aux_case():
    torch.manual_seed(0)
    model = AuxChain()
    x = torch.randn(4, 8)

    def step():
        loss = model(x)
        loss.backward()
        return loss.detach()

    return model, step


SEGMENT_UNITS = {
    "flat": [Unit(0, 3, R), Unit(4, 4, "keep"), Unit(5, 11, "recompute_offload")],
    "nested": [Unit(0, 11, R, inner=(Unit(0, 5, R, inner=(Unit(0, 2, R), Unit(3, 5, R))), Unit(6, 11, R)))],
    "nested_offloaded": [Unit(0, 7, "recompute_offload", inner=(Unit(0, 3, R), Unit(4, 4, "keep"), Unit(5, 7, R))),
                         Unit(8, 11, R, inner=(Unit(8, 9, R), Unit(10, 11, R)))],
}


@pytest.mark.parametrize("name", list(SEGMENT_UNITS))
def test_segments_hand_each_block_its_own_outputs(name):
    model, step = _aux_case()
    ref = _run(model, step)
    handle = apply_units(model, _select_blocks(model, None), SEGMENT_UNITS[name], {"devices": ["cpu"], "min_bytes": 0})
    try:
        got = _run(model, step)
    finally:
        handle.remove()
    assert_same_step(ref, got)


@pytest.mark.parametrize("segments", [3, "sqrt", 12])
def test_apply_segments_hand_each_block_its_own_outputs(segments):
    model, step = _aux_case()
    ref = _run(model, step)
    handle = co.apply(model, segments=segments)
    try:
        got = _run(model, step)
    finally:
        handle.remove()
    assert_same_step(ref, got)
    handle = co.apply(model, segments=2, offload={"devices": ["cpu"], "min_bytes": 0})
    try:
        got = _run(model, step)
    finally:
        handle.remove()
    assert_same_step(ref, got)


def test_segments_keep_hf_gpt2_hidden_states():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=4, n_head=2, use_cache=False,
                                     output_hidden_states=True, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    model.train()
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))

    def step():
        torch.manual_seed(1)  # the same dropout masks in every run
        out = model(input_ids=ids, labels=ids)
        assert len(out.hidden_states) == 5
        loss = out.loss + sum((i + 1) * h.pow(2).mean() for i, h in enumerate(out.hidden_states))
        loss.backward()
        return loss.detach()

    ref = _run(model, step)
    for how in ("apply", "nested"):
        if how == "apply":
            handle = co.apply(model, segments=2)
        else:
            handle = apply_units(model, _select_blocks(model, None),
                                 [Unit(0, 3, R, inner=(Unit(0, 1, R), Unit(2, 3, R)))], {})
        try:
            got = _run(model, step)
        finally:
            handle.remove()
        assert_same_step(ref, got)


class KwBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x, scale=1.0):
        return torch.tanh(self.lin(x)) * scale


class PerBlockArgs(nn.Module):
    def __init__(self, n=4, d=8):
        super().__init__()
        self.blocks = nn.ModuleList(KwBlock(d) for _ in range(n))

    def forward(self, x):
        for i, b in enumerate(self.blocks):
            x = b(x, scale=float(i + 1))
        return x.sum()


def test_segments_refuse_blocks_called_with_other_arguments():
    torch.manual_seed(0)
    model = PerBlockArgs()
    x = torch.randn(2, 8)
    handle = co.apply(model, segments=2)
    try:
        with pytest.raises(RuntimeError, match=r"blocks.1 got other arguments than the first block.*segments=False"):
            model(x)
        # refused, not stuck: the next call outside training runs the blocks as they are
        model.eval()
        got = model(x)
    finally:
        handle.remove()
        model.train()
    assert torch.equal(got, model(x))
