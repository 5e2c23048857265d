"""Selective activation checkpointing (torch's SAC, a ``context_fn`` policy) under co.offload: the
tensors the policy's cache holds live exactly as long as they do without ckpt_offload.

torch's own rules (its selective-checkpoint tests): a cache entry is dropped as soon as the
recompute consumes it, even under ``retain_graph=True``; a graph dropped without a backward takes
its cache with it, with no reference cycle (so without the garbage collector); a second backward
over the region raises; a cached tensor modified in place makes backward raise. Here the cache's
entries are in the pool, and each rule is checked on the pool's bytes, on the device storage the
cache was given, and on the memory timeline, in both stream modes and through both routes
(torch's checkpoint inside co.offload, and co.checkpoint with offload=...)."""

import contextlib
import functools
import gc
import weakref

import pytest
import torch
import torch.utils.checkpoint as tc

import ckpt_offload as co
from ckpt_offload.checkpointing import TORCH_KEYWORDS

pytestmark = [
    pytest.mark.skipif(
        not hasattr(tc, "create_selective_checkpoint_contexts"), reason="torch without selective checkpointing"
    ),
    pytest.mark.skipif(
        "respect_saved_tensors_hooks" not in TORCH_KEYWORDS,
        reason="torch without respect_saved_tensors_hooks (its cache bypasses saved-tensor hooks)",
    ),
]

ROUTES = ["torch-checkpoint-in-offload", "co.checkpoint"]


@contextlib.contextmanager
def gc_off():
    """What is freed here is freed by reference counts alone: a cycle would keep it."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def save_everything(ctx, op, *args, **kwargs):
    return tc.CheckpointPolicy.MUST_SAVE


class Recorder:
    """The block x.cos().exp().sin() under a save-everything policy; remembers a weak reference
    to the storage of exp's output as the policy's cache got it in forward."""

    def __init__(self):
        self.ref = None
        self.calls = 0

    def __call__(self, x):
        self.calls += 1
        out = x.cos().exp()
        if self.calls == 1:  # the forward (the recompute is the second call)
            self.ref = weakref.ref(out.untyped_storage())
        return out.sin()  # sin saves exp's output: the recompute stops once it has it


def run(route, block, x, pool, stream, policy=save_everything, **kw):
    context_fn = functools.partial(tc.create_selective_checkpoint_contexts, policy, **kw)
    options = dict(devices=["cpu"], min_bytes=0, pool=pool, stream=stream)
    if route == "co.checkpoint":
        return co.checkpoint(block, x, offload=options, context_fn=context_fn)
    with co.offload(**options):
        return tc.checkpoint(block, x, use_reentrant=False, context_fn=context_fn, respect_saved_tensors_hooks=True)


def requested(pool) -> int:
    return pool.stats()["bytes_requested"]


@pytest.mark.parametrize("route", ROUTES)
def test_a_graph_dropped_without_backward_takes_the_cache_with_it(route, stream, pool):
    block = Recorder()
    x = torch.randn(3, requires_grad=True)
    timeline = co._C.device_bytes_saved()
    with gc_off():
        out = run(route, block, x, pool, stream)
        # The checkpoint's input and the three cached outputs are in the pool.
        assert requested(pool) == 4 * x.nbytes
        co._C.testing.drain_cpu_streams()  # the copies have read their sources; nothing released yet
        del out
        assert block.ref() is None, "the device storage the cache was given outlives its graph"
        assert pool.stats()["bytes_in_use"] == 0
        assert co._C.device_bytes_saved() == timeline


@pytest.mark.parametrize("route", ROUTES)
def test_retain_graph_keeps_only_what_the_recompute_did_not_consume(route, stream, pool):
    block = Recorder()
    x = torch.randn(3, requires_grad=True)
    with gc_off():
        out = run(route, block, x, pool, stream)
        out.sum().backward(retain_graph=True)
        assert block.calls == 2
        assert block.ref() is None
        # The recompute consumed cos's and exp's entries (gone from the pool); what the retained
        # graph still holds is its input and sin's entry, which the early-stopped recompute
        # never reached.
        assert requested(pool) == 2 * x.nbytes
        expected_grad = x.grad.clone()
        with pytest.raises(RuntimeError, match="backward an extra time"):
            out.sum().backward()
        del out
        assert pool.stats()["bytes_in_use"] == 0
    ref = torch.randn(3).copy_(x.detach()).requires_grad_()
    ref.cos().exp().sin().sum().backward()
    assert torch.equal(expected_grad, ref.grad)


@pytest.mark.parametrize("route", ROUTES)
def test_backward_empties_the_pool_while_the_output_lives(route, stream, pool):
    block = Recorder()
    x = torch.randn(3, requires_grad=True)
    with gc_off():
        out = run(route, block, x, pool, stream)
        out.sum().backward()
        assert block.ref() is None
        assert pool.stats()["bytes_in_use"] == 0  # `out` is alive; its graph holds nothing any more
        del out


@pytest.mark.parametrize("route", ROUTES)
def test_a_cached_tensor_modified_in_place_raises_and_leaves_nothing(route, stream, pool):
    def sin_only(ctx, op, *args, **kwargs):
        return (
            tc.CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.sin.default else tc.CheckpointPolicy.PREFER_RECOMPUTE
        )

    def block(x):
        return x.sin().mul_(2).cos().exp()

    x = torch.randn(3, requires_grad=True)
    with gc_off():
        out = run(route, block, x, pool, stream, policy=sin_only)
        with pytest.raises(RuntimeError, match="modified by an inplace operation|has been mutated"):
            out.sum().backward()
        del out
    gc.collect()  # the raising backward's traceback
    assert pool.stats()["bytes_in_use"] == 0


@pytest.mark.parametrize("route", ROUTES)
def test_an_op_with_two_outputs_is_cached_whole(route, stream, pool):
    calls = []

    def var_mean_only(ctx, op, *args, **kwargs):
        if op is torch.ops.aten.var_mean.correction:
            calls.append(op)
            return tc.CheckpointPolicy.MUST_SAVE
        return tc.CheckpointPolicy.PREFER_RECOMPUTE

    def block(x):
        a, b = torch.var_mean(x)
        return a * b

    x = torch.randn(3, requires_grad=True)
    with gc_off():
        out = run(route, block, x, pool, stream, policy=var_mean_only)
        assert requested(pool) == x.nbytes + 2 * 4  # the input, var and mean (one float each)
        (got,) = torch.autograd.grad(out.sum(), (x,))
        assert pool.stats()["bytes_in_use"] == 0
        del out
    (expected,) = torch.autograd.grad(block(x).sum(), (x,))
    assert torch.equal(got, expected)
    assert len(calls) == 1  # the policy is asked in forward only; the recompute reads the cache
