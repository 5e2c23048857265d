"""A device copy that several unpacks share keeps autograd's version rule (Note [One version per device copy],
csrc/torch/device_memory.h): every tensor made over it shares one version counter, checked at each shared unpack,
so that a backward writing its saved tensor in place makes the next unpack of those bytes raise autograd's error, as
it does without hooks; and a tensor selective checkpointing caches unpacks to a tensor of its own (it returns them as
the outputs of different ops; Note [Same view, same tensor]). Each case is compared with the same program run without
ckpt_offload."""

import functools

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_bit_identical, cpu_offload, device_bytes_saved, run_a_backward
from helpers import Scribble
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import ckpt_offload as co

INPLACE = "modified by an inplace operation"

# Every way an unpack can share a device copy with another: a held reload (compute or side stream, with or without
# prefetch), a batch member, a converted (bf16) reload.
ROUTES = {
    "compute": dict(stream="compute"),
    "side": dict(stream="side", prefetch_bytes=0),
    "side-prefetch": dict(stream="side"),
    "batched": dict(stream="side", batch_below="64KiB"),
    "bf16": dict(stream="compute", store_dtype=torch.bfloat16),
}


def scribble_step(offload, shared, dtype=torch.float32):
    """h = x * 1.5 (which saves nothing), saved by Scribble (which writes it in backward) and, with `shared`, by an
    earlier node too. Returns the gradients, or the error backward raised."""
    torch.manual_seed(0)
    x = torch.randn(64, 256, dtype=dtype, requires_grad=True)
    w1 = torch.randn(256, dtype=dtype, requires_grad=True)
    w2 = torch.randn(256, dtype=dtype, requires_grad=True)
    with offload:
        h = x * 1.5
        m = h * w2 if shared else w2.sum()  # mul saves h too; made first, its backward runs after Scribble's
        out = Scribble.apply(h, w1) + m
    try:
        out.sum().backward()
    except RuntimeError as e:
        run_a_backward()
        return str(e)
    return {"x": x.grad, "w1": w1.grad, "w2": w2.grad}


class NoOffload:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_a_backward_writing_a_shared_saved_tensor_raises_torchs_error(pool, route):
    # Without hooks: the earlier node's unpack of h raises. With the shared reload it used to get the zeroed bytes
    # (w2.grad all zeros, x.grad wrong) silently.
    expected = scribble_step(NoOffload(), shared=True)
    assert isinstance(expected, str) and INPLACE in expected
    got = scribble_step(cpu_offload(pool, min_bytes=0, **ROUTES[route]), shared=True)
    assert isinstance(got, str), f"no error: w2.grad sum {got['w2'].abs().sum()}"
    assert INPLACE in got
    co.synchronize()
    assert pool.stats()["bytes_in_use"] == 0 and device_bytes_saved() == 0


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_a_backward_writing_a_saved_tensor_nobody_else_needs_is_fine(pool, route):
    # Only Scribble saved h: torch runs it, and so must the shared reload (no false alarm).
    expected = scribble_step(NoOffload(), shared=False)
    assert not isinstance(expected, str), expected
    got = scribble_step(cpu_offload(pool, min_bytes=0, **ROUTES[route]), shared=False)
    assert not isinstance(got, str), got
    if route == "bf16":  # h stored in bf16: the gradients are close, not equal
        for k in expected:
            assert (got[k] - expected[k]).norm() <= 1e-2 * expected[k].norm(), k
    else:
        assert_bit_identical(expected, got)


class WritesQ(torch.autograd.Function):
    """Saves q and k, two chunks of one projection; backward writes q in place."""

    @staticmethod
    def forward(ctx, q, k):
        ctx.save_for_backward(q, k)
        return q * k

    @staticmethod
    def backward(ctx, g):
        q, k = ctx.saved_tensors
        gq, gk = g * k, g * q
        q.zero_()
        return gq, gk


def chunk_step(offload):
    torch.manual_seed(1)
    x = torch.randn(32, 3 * 128, requires_grad=True)
    with offload:
        q, k, v = x.tanh().chunk(3, dim=-1)
        out = WritesQ.apply(q, k) + k * v  # mul saves k (a view of the same base as q) and v
    try:
        out.sum().backward()
    except RuntimeError as e:
        run_a_backward()
        return str(e)
    return {"x": x.grad}


@pytest.mark.parametrize("route", ["compute", "side"])
def test_views_of_one_base_share_the_version_as_torchs_views_do(pool, route):
    # q and k are views of one base: without hooks they share a version counter, so writing q makes k's unpack
    # raise. Reloaded into one storage, they must too.
    expected = chunk_step(NoOffload())
    assert isinstance(expected, str) and INPLACE in expected
    got = chunk_step(cpu_offload(pool, min_bytes=0, **ROUTES[route]))
    assert isinstance(got, str) and INPLACE in got


def view_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.view.default else CheckpointPolicy.PREFER_RECOMPUTE


def gather_fn(x, idx):
    i = idx.view(-1)  # an int64 view whose layout is its input's: SAC caches it as a saved tensor
    return (x.view(-1) * 2)[i].sum() + x.sin().sum()


@pytest.mark.parametrize("route", ["compute", "side", "batched"])
def test_selective_checkpoint_of_a_same_layout_view_runs_as_torch(route):
    # torch's own test_sac_output_already_has_autograd_meta, through co.checkpoint with offload: the cached
    # x.view(-1) unpacked to the very tensor its input unpacked to, and the view op raised "the same as the input
    # base tensor" in the recompute.
    context_fn = functools.partial(create_selective_checkpoint_contexts, view_policy)

    def run(use_co):
        x = torch.randn(70000, generator=torch.Generator().manual_seed(0), requires_grad=True)
        idx = torch.arange(70000)
        if use_co:
            y = co.checkpoint(
                gather_fn, x, idx, context_fn=context_fn, offload={"devices": ["cpu"], "min_bytes": 0, **ROUTES[route]}
            )
        else:
            y = checkpoint(gather_fn, x, idx, use_reentrant=False, context_fn=context_fn)
        y.backward()
        return {"x": x.grad}

    assert_bit_identical(run(False), run(True))


def attention(x, wq, wk, wv):
    q, k, v = x @ wq, x @ wk, x @ wv  # 3-D matmuls: autograd saves their expand views
    a = torch.softmax(q @ k.transpose(-1, -2) / 8.0, dim=-1)
    return (a @ v).sum()


def size_policy(ctx, op, *args, **kwargs):
    # Everything large enough is offloaded (the cheap ops are kept): matmul's expand views included.
    out_bytes = sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))
    return CheckpointPolicy.MUST_CPU_OFFLOAD if out_bytes >= 4096 else CheckpointPolicy.PREFER_RECOMPUTE


def save_policy(ctx, op, *args, **kwargs):
    out = size_policy(ctx, op, *args, **kwargs)
    return CheckpointPolicy.MUST_SAVE if out == CheckpointPolicy.MUST_CPU_OFFLOAD else out


@pytest.mark.parametrize("route", ["compute", "side"])
def test_selective_offload_context_on_plain_attention_runs_as_torchs_selective_checkpoint(pool, route):
    # co.selective_offload_context with a size-based policy on 3-D attention raised "already had autograd metadata"
    # in the recompute; torch's own selective checkpoint with the same policy (offload read as save) runs.
    def run(use_co):
        g = torch.Generator().manual_seed(2)
        x = torch.randn(2, 64, 32, generator=g, requires_grad=True)
        ws = [torch.randn(32, 32, generator=g, requires_grad=True) for _ in range(3)]
        if use_co:
            context_fn = co.selective_offload_context(
                size_policy, offload=dict(pool=pool, devices=["cpu"], min_bytes=0, **ROUTES[route])
            )
        else:
            context_fn = functools.partial(create_selective_checkpoint_contexts, save_policy)
        checkpoint(attention, x, *ws, use_reentrant=False, context_fn=context_fn).backward()
        return {"x": x.grad, **{f"w{i}": w.grad for i, w in enumerate(ws)}}

    assert_bit_identical(run(False), run(True))
    co.synchronize()
    assert pool.stats()["bytes_in_use"] == 0


def test_a_second_backward_after_a_write_raises_as_torch_does(pool):
    # retain_graph: the first backward's Scribble wrote h; a second backward shares that reload while it is alive
    # (held by `keep`) and must raise as torch does, not hand the zeroed bytes on.
    def run(offload):
        torch.manual_seed(3)
        x = torch.randn(16, 64, requires_grad=True)
        w = torch.randn(64, requires_grad=True)
        with offload:
            out = Scribble.apply(x * 1.5, w)
        out.sum().backward(retain_graph=True)
        try:
            out.sum().backward()
        except RuntimeError as e:
            run_a_backward()
            return str(e)
        return "no error"

    assert INPLACE in run(NoOffload())
    keep = []
    orig = Scribble.backward

    def backward_keeping(ctx, g):  # the unpacked h stays alive, so the second backward shares its storage
        keep.append(ctx.saved_tensors[0])
        return orig(ctx, g)

    Scribble.backward = staticmethod(backward_keeping)
    try:
        got = run(cpu_offload(pool, stream="compute", min_bytes=0))
    finally:
        Scribble.backward = staticmethod(orig)
        keep.clear()
    assert INPLACE in got


def test_the_error_names_the_tensor_and_nothing_is_left_held(pool):
    msg = scribble_step(cpu_offload(pool, min_bytes=0, stream="compute"), shared=True)
    assert "[Float on cpu, shape [64, 256]]" in msg or "64, 256" in msg
    assert "expected version" in msg
    co.synchronize()
    assert pool.stats()["bytes_in_use"] == 0 and device_bytes_saved() == 0
    assert F.relu(torch.ones(1)).item() == 1.0  # autograd still works on this thread after the raise
