"""A checkpointed block that writes one of its inputs in place: its recompute would read the
written value, so the gradients would be wrong. However the input reaches the block -- by
position, by keyword, inside a list (by keyword or by position) or a dict, from a model that
calls its blocks by keyword -- and whether the checkpoint offloads or not, backward raises
torch's "modified by an inplace operation" error (torch's own checkpoint raises it only for a
top-level positional input, and silently returns wrong gradients for one passed by keyword or
inside a container). A block that does not write its input keeps its gradients bit-identical to
a run without checkpointing, however it is called."""

import copy

import pytest
import torch
import torch.nn as nn

import ckpt_offload as co
from conftest import assert_bit_identical, grads_of

CPU_ALL = {"devices": ["cpu"], "min_bytes": 0}
INPLACE_ERROR = "modified by an inplace operation"


class Writer(nn.Module):
    """Reads its hidden state from ``x``, ``xs[0]`` or ``d["x"]``; with ``write`` scales it in place
    first (valid without a checkpoint: nothing has saved that tensor yet)."""

    def __init__(self, dim=16, write=True):
        super().__init__()
        self.lin = nn.Linear(dim, dim, dtype=torch.float64)
        self.write = write

    def forward(self, x=None, xs=None, d=None):
        h = x if x is not None else xs[0] if xs is not None else d["x"]
        if self.write:
            h.mul_(0.75)
        return torch.tanh(self.lin(h)) * 2.0  # a fresh product no backward saves: the next block may write it


def _call(block, h, how):
    if how == "positional":
        return block(h)
    if how == "keyword":
        return block(x=h)
    if how == "list":
        return block(xs=[h])
    if how == "positional_list":
        return block(None, [h])
    return block(d={"x": h})


HOWS = ("positional", "keyword", "list", "positional_list", "dict")


class Model(nn.Module):
    def __init__(self, how, write, n=3):
        super().__init__()
        self.how = how
        self.blocks = nn.ModuleList(Writer(write=write) for _ in range(n))

    def forward(self, x, wrap=None):
        h = x * 1.0
        for b in self.blocks:
            h = _call(b, h, self.how) if wrap is None else wrap(b, h, self.how)
        return h.square().sum()


def _model(how, write):
    torch.manual_seed(0)
    return Model(how, write)


def _x():
    return torch.randn(8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)


def _grads(model, wrap=None):
    model.zero_grad(set_to_none=True)
    x = _x()
    model(x, wrap).backward()
    return {**grads_of(model), "x": x.grad}


def _co_checkpoint(offload):
    def wrap(block, h, how):
        if how == "positional":
            return co.checkpoint(block, h, offload=offload)
        if how == "keyword":
            return co.checkpoint(block, x=h, offload=offload)
        if how == "list":
            return co.checkpoint(block, xs=[h], offload=offload)
        if how == "positional_list":
            return co.checkpoint(block, None, [h], offload=offload)
        return co.checkpoint(block, d={"x": h}, offload=offload)

    return wrap


@pytest.mark.parametrize("offload", [False, CPU_ALL], ids=["recompute", "offload"])
@pytest.mark.parametrize("how", HOWS)
def test_co_checkpoint_of_a_block_writing_its_input_raises(how, offload):
    model = _model(how, write=True)
    _grads(copy.deepcopy(model))  # valid without a checkpoint
    with pytest.raises(RuntimeError, match=INPLACE_ERROR):
        _grads(model, _co_checkpoint(offload))


@pytest.mark.parametrize("offload", [False, CPU_ALL], ids=["recompute", "offload"])
@pytest.mark.parametrize("how", HOWS)
def test_co_apply_to_blocks_writing_their_input_raises(how, offload):
    model = _model(how, write=True)
    handle = co.apply(model, layers=Writer, offload=offload)
    try:
        with pytest.raises(RuntimeError, match=INPLACE_ERROR):
            _grads(model)
    finally:
        handle.remove()


@pytest.mark.parametrize("offload", [False, CPU_ALL], ids=["recompute", "offload"])
def test_co_apply_segments_over_keyword_blocks_writing_their_input_are_refused(offload):
    model = _model("keyword", write=True)
    handle = co.apply(model, layers=Writer, segments=1, offload=offload)
    try:
        with pytest.raises(RuntimeError, match=r"blocks\.0 in backward, but it writes its input in place"):
            _grads(model)
    finally:
        handle.remove()


@pytest.mark.parametrize("offload", [False, CPU_ALL], ids=["recompute", "offload"])
@pytest.mark.parametrize("how", HOWS)
def test_blocks_that_do_not_write_their_input_keep_exact_gradients(how, offload):
    model = _model(how, write=False)
    ref = _grads(model)
    assert_bit_identical(ref, _grads(model, _co_checkpoint(offload)))
    handle = co.apply(model, layers=Writer, offload=offload)
    try:
        assert_bit_identical(ref, _grads(model))
    finally:
        handle.remove()
