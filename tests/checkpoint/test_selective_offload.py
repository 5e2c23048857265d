"""co.selective_offload_context: a context_fn for selective checkpointing that keeps the outputs a
policy marks MUST_CPU_OFFLOAD / PREFER_CPU_OFFLOAD in the host pool between forward and backward,
the ones marked save on the device, and recomputes the rest (in eager, where torch recomputes the
offload ones). Gradients are compared bit for bit with torch's own selective checkpoint under the
same policy read with offload as save; pool bytes are counted during and after the step; the
memory claim is measured independently, from torch.profiler's memory events."""

import copy
import functools
import warnings

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as tc

import ckpt_offload as co
from conftest import assert_bit_identical, grads_of, step_peak_bytes
from helpers import gpt2, llama, loss_of

pytestmark = pytest.mark.skipif(
    not hasattr(getattr(tc, "CheckpointPolicy", None), "MUST_CPU_OFFLOAD"),
    reason="torch without CheckpointPolicy.MUST_CPU_OFFLOAD",
)

P = getattr(tc, "CheckpointPolicy", None)
MM = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)


def cpu(pool, **kw):
    return dict(devices=["cpu"], min_bytes=0, pool=pool, **kw)


def offload_matmuls(ctx, op, *args, **kwargs):
    return P.MUST_CPU_OFFLOAD if op in MM else P.PREFER_RECOMPUTE


def prefer_offload_matmuls(ctx, op, *args, **kwargs):
    return P.PREFER_CPU_OFFLOAD if op in MM else P.PREFER_RECOMPUTE


def as_saved(policy):
    """The same policy with offload read as save: what torch's own selective checkpoint is given."""

    def saved(ctx, op, *args, **kwargs):
        p = policy(ctx, op, *args, **kwargs)
        return P.MUST_SAVE if p in (P.MUST_CPU_OFFLOAD, P.PREFER_CPU_OFFLOAD) else p

    return saved


def torch_sac(policy):
    return functools.partial(tc.create_selective_checkpoint_contexts, as_saved(policy))


class Blocks(nn.Module):
    def __init__(self, n=4, dim=32, hidden=64):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Dropout(0.1), nn.Linear(hidden, dim)) for _ in range(n)
        )

    def forward(self, x, context_fn=None, route="torch"):
        for b in self.blocks:
            if context_fn is None:
                x = b(x)
            elif route == "torch":
                x = tc.checkpoint(b, x, use_reentrant=False, context_fn=context_fn)
            else:
                x = co.checkpoint(b, x, context_fn=context_fn)
        return x.square().mean()


def grads_after(model, x, **kw):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)  # dropout: the recompute replays the forward's RNG state
    model(x, **kw).backward()
    return grads_of(model)


@pytest.mark.parametrize("route", ["torch", "co"])
@pytest.mark.parametrize("policy", [offload_matmuls, prefer_offload_matmuls])
def test_gradients_are_those_of_torch_with_offload_read_as_save(route, policy, stream, pool):
    torch.manual_seed(0)
    model, x = Blocks(), torch.randn(8, 32)
    expected = grads_after(model, x, context_fn=torch_sac(policy))
    ctx_fn = co.selective_offload_context(policy, cpu(pool, stream=stream))
    got = grads_after(model, x, context_fn=ctx_fn, route=route)
    assert_bit_identical(expected, got)
    s = ctx_fn.stats()
    assert s["tensors_offloaded"] == 2 * len(model.blocks)  # both addmm outputs of every block
    # The recompute stops once it has what backward needs (torch's early stop): the block's last
    # Linear output is never read back, only dropped with the graph.
    assert s["tensors_reloaded"] == len(model.blocks)
    assert pool.stats()["bytes_in_use"] == 0


def test_gradients_on_each_device(device, stream, pool):
    # CPU here; marked gpu, the same on CUDA (the pool's pinned copies, the CUDA copy streams).
    torch.manual_seed(0)
    model, x = Blocks().to(device), torch.randn(8, 32, device=device)
    expected = grads_after(model, x, context_fn=torch_sac(offload_matmuls))
    ctx_fn = co.selective_offload_context(
        offload_matmuls, dict(devices=[device.type], min_bytes=0, pool=pool, stream=stream)
    )
    got = grads_after(model, x, context_fn=ctx_fn)
    assert_bit_identical(expected, got)
    assert ctx_fn.stats()["tensors_offloaded"] == 2 * len(model.blocks)
    co.synchronize()
    assert pool.stats()["bytes_in_use"] == 0


def test_offloaded_outputs_are_in_the_pool_between_forward_and_backward(stream, pool):
    torch.manual_seed(0)
    model, x = Blocks(n=3), torch.randn(8, 32)
    ctx_fn = co.selective_offload_context(offload_matmuls, cpu(pool, stream=stream))
    loss = model(x, context_fn=ctx_fn)
    # Both Linear outputs of every block (8x64 and 8x32 float32), and nothing else: torch's
    # checkpoint keeps its inputs on the device, and the rest is recomputed.
    assert pool.stats()["bytes_requested"] == 3 * (8 * 64 + 8 * 32) * 4
    loss.backward()
    assert pool.stats()["bytes_in_use"] == 0


def test_save_stays_on_the_device_offload_goes_to_the_pool(pool):
    def policy(ctx, op, *args, **kwargs):
        if op is torch.ops.aten.mm.default:
            return P.MUST_SAVE
        if op is torch.ops.aten.tanh.default:
            return P.MUST_CPU_OFFLOAD
        return P.MUST_RECOMPUTE

    calls = []

    def block(x, w):
        calls.append(1)
        return torch.mm(x, w).tanh().exp().sum()

    x, w = torch.randn(16, 8, requires_grad=True), torch.randn(8, 4, requires_grad=True)
    ctx_fn = co.selective_offload_context(policy, cpu(pool))
    out = tc.checkpoint(block, x, w, use_reentrant=False, context_fn=ctx_fn)
    assert pool.stats()["bytes_requested"] == 16 * 4 * 4  # tanh's output only; mm's stays on the device
    out.backward()
    assert len(calls) == 2
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    block(xr, wr).backward()
    assert torch.equal(x.grad, xr.grad) and torch.equal(w.grad, wr.grad)
    assert ctx_fn.stats()["tensors_offloaded"] == 1
    assert pool.stats()["bytes_in_use"] == 0


def test_offload_lowers_the_step_peak_below_save(pool):
    # Independent measurement: torch.profiler's memory events count torch's CPU allocator (what
    # stands for the device here); the host pool allocates its own memory and is not counted.
    torch.manual_seed(0)
    model = Blocks(n=8, dim=256, hidden=1024)
    x = torch.randn(128, 256)

    def step(context_fn):
        def run():
            model.zero_grad(set_to_none=False)  # the gradients exist (warm-up): the peak is activations
            model(x, context_fn=context_fn).backward()

        return run

    def save_matmuls(ctx, op, *args, **kwargs):
        return P.MUST_SAVE if op in MM else P.PREFER_RECOMPUTE

    saved_peak = step_peak_bytes(step(functools.partial(tc.create_selective_checkpoint_contexts, save_matmuls)))
    ctx_fn = co.selective_offload_context(offload_matmuls, cpu(pool, stream="compute"))
    offload_peak = step_peak_bytes(step(ctx_fn))
    per_block = 128 * (1024 + 256) * 4  # the two Linear outputs a block keeps
    # MUST_SAVE keeps every block's matmul outputs until backward; offloaded they wait in the pool.
    assert offload_peak < saved_peak - 4 * per_block, (saved_peak, offload_peak)
    assert pool.stats()["bytes_in_use"] == 0


@pytest.mark.parametrize("make", [gpt2, llama], ids=["gpt2", "llama"])
def test_hugging_face_gradient_checkpointing_enable(make, pool):
    torch.manual_seed(0)
    reference = make()
    model = copy.deepcopy(reference)
    reference.train()
    model.train()
    reference.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"context_fn": torch_sac(offload_matmuls), "use_reentrant": False}
    )
    loss_of(reference).backward()

    ctx_fn = co.selective_offload_context(offload_matmuls, cpu(pool))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"context_fn": ctx_fn, "use_reentrant": False})
    held = []
    hook = model.get_output_embeddings().register_forward_hook(lambda *a: held.append(pool.stats()["bytes_in_use"]))
    loss_of(model).backward()
    hook.remove()
    assert_bit_identical(grads_of(reference), grads_of(model))
    assert held and held[0] > 0, "nothing was in the pool at the end of the layers' forward"
    assert ctx_fn.stats()["tensors_offloaded"] > 0
    assert pool.stats()["bytes_in_use"] == 0


def test_a_region_is_differentiated_once(pool):
    ctx_fn = co.selective_offload_context(offload_matmuls, cpu(pool))
    x, w = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    out = tc.checkpoint(lambda a, b: torch.mm(a, b).sin().sum(), x, w, use_reentrant=False, context_fn=ctx_fn)
    out.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward an extra time"):
        out.backward()
    del out
    assert pool.stats()["bytes_in_use"] == 0


def test_a_saved_output_modified_in_place_raises(pool):
    def policy(ctx, op, *args, **kwargs):
        return P.MUST_SAVE if op is torch.ops.aten.sin.default else P.PREFER_RECOMPUTE

    x = torch.randn(4, requires_grad=True)
    out = tc.checkpoint(
        lambda a: a.sin().mul_(2).cos().sum(),
        x,
        use_reentrant=False,
        context_fn=co.selective_offload_context(policy, cpu(pool)),
    )
    with pytest.raises(RuntimeError, match="modified in place"):
        out.backward()


def test_allow_cache_entry_mutation_covers_saved_outputs_not_offloaded_ones(pool):
    def block(a):
        return a.sin().mul_(2).cos().sum()

    def sin_as(policy):
        return lambda ctx, op, *args, **kwargs: policy if op is torch.ops.aten.sin.default else P.PREFER_RECOMPUTE

    x = torch.randn(4, requires_grad=True)
    torch_fn = functools.partial(
        tc.create_selective_checkpoint_contexts, sin_as(P.MUST_SAVE), allow_cache_entry_mutation=True
    )
    tc.checkpoint(block, x, use_reentrant=False, context_fn=torch_fn).backward()
    expected, x.grad = x.grad, None
    saved = co.selective_offload_context(sin_as(P.MUST_SAVE), cpu(pool), allow_cache_entry_mutation=True)
    tc.checkpoint(block, x, use_reentrant=False, context_fn=saved).backward()
    assert torch.equal(x.grad, expected)  # backward saw the changed values, as torch's does
    offloaded = co.selective_offload_context(sin_as(P.MUST_CPU_OFFLOAD), cpu(pool), allow_cache_entry_mutation=True)
    out = tc.checkpoint(block, x, use_reentrant=False, context_fn=offloaded)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward()


def test_a_copy_of_the_context_fn_serves_on_its_own(pool):
    ctx_fn = co.selective_offload_context(offload_matmuls, cpu(pool))
    clone = copy.deepcopy(ctx_fn)
    assert clone.options == ctx_fn.options and clone.policy_fn is offload_matmuls
    x, w = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    tc.checkpoint(lambda a, b: torch.mm(a, b).sin().sum(), x, w, use_reentrant=False, context_fn=clone).backward()
    assert clone.stats()["tensors_offloaded"] == 1 and ctx_fn.stats()["tensors_offloaded"] == 0


# --- bad input ---------------------------------------------------------------------------------


def test_policy_fn_must_be_callable():
    with pytest.raises(TypeError, match="policy_fn must be callable"):
        co.selective_offload_context([torch.ops.aten.mm.default])


def test_a_policy_value_that_is_not_a_checkpoint_policy_is_refused(pool):
    ctx_fn = co.selective_offload_context(lambda ctx, op, *a, **k: "offload", cpu(pool))
    refused = r"policy_fn returned 'offload' for aten\.\w+.*CheckpointPolicy\.MUST_CPU_OFFLOAD"
    with pytest.raises(TypeError, match=refused):
        tc.checkpoint(lambda a: a.sin(), torch.randn(3, requires_grad=True), use_reentrant=False, context_fn=ctx_fn)
    assert pool.stats()["bytes_in_use"] == 0


def test_offload_options_are_checked():
    with pytest.raises(TypeError, match="min_bytes"):
        co.selective_offload_context(offload_matmuls, {"min_byte": 0})
    with pytest.raises(ValueError, match="offload must say where"):
        co.selective_offload_context(offload_matmuls, False)
    with pytest.raises(TypeError, match="allow_cache_entry_mutation must be True or False"):
        co.selective_offload_context(offload_matmuls, {"devices": ["cpu"]}, allow_cache_entry_mutation="yes")


# --- torch's own selective checkpoint contexts through co.checkpoint and co.apply ---------------

RESPECTS_HOOKS = pytest.mark.skipif(
    "respect_saved_tensors_hooks" not in co.checkpointing.TORCH_KEYWORDS,
    reason="torch without respect_saved_tensors_hooks (its selective checkpoint's cache bypasses saved-tensor hooks)",
)


def save_matmuls(ctx, op, *args, **kwargs):
    return P.MUST_SAVE if op in MM else P.PREFER_RECOMPUTE


def run_blocks(model, x, **checkpoint_kwargs):
    """``model``'s blocks each through ``co.checkpoint(..., **checkpoint_kwargs)``, and its loss."""
    for b in model.blocks:
        x = co.checkpoint(b, x, **checkpoint_kwargs)
    return x.square().mean()


@RESPECTS_HOOKS
@pytest.mark.parametrize("route", ["apply", "checkpoint"])
def test_torch_sac_inside_co_offload_sends_what_the_policy_saves_to_the_pool(route, stream, pool):
    # co.apply / co.checkpoint with torch's selective checkpoint and no offload of their own,
    # inside the user's co.offload: torch 2.14 warns at every checkpoint unless
    # respect_saved_tensors_hooks is passed, and without True the outputs the policy saves
    # bypass the user's offload context (they stay on the device).
    torch.manual_seed(0)
    model, x = Blocks(), torch.randn(8, 32)
    expected = grads_after(model, x)  # no checkpoint, no ckpt_offload
    context_fn = functools.partial(tc.create_selective_checkpoint_contexts, save_matmuls)
    wrapped = copy.deepcopy(model)
    if route == "apply":
        co.apply(wrapped, context_fn=context_fn)
        forward = wrapped
    else:
        forward = functools.partial(run_blocks, wrapped, context_fn=context_fn)
    wrapped.zero_grad(set_to_none=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(3)
        with co.offload(**cpu(pool, stream=stream)):
            loss = forward(x)
        held = pool.stats()["bytes_requested"]
        loss.backward()
    assert [f"{w.category.__name__}: {w.message}" for w in caught] == []
    assert_bit_identical(expected, grads_of(wrapped))
    # x and both Linear outputs of every block (8x64 and 8x32 float32), each storage once: a
    # block's last output is also the next block's input (the loss's, for the last one).
    assert held == x.nbytes + len(model.blocks) * (8 * 64 + 8 * 32) * 4
    assert pool.stats()["bytes_in_use"] == 0


@RESPECTS_HOOKS
@pytest.mark.parametrize("route", ["apply", "checkpoint"])
@pytest.mark.parametrize("policy", [offload_matmuls, prefer_offload_matmuls])
def test_co_checkpoint_with_offload_honours_torch_sacs_offload_policy(route, policy, stream, pool):
    # torch's own contexts read MUST_CPU_OFFLOAD / PREFER_CPU_OFFLOAD as recompute in eager mode;
    # asked to offload, co.checkpoint keeps those outputs in the pool, as
    # co.selective_offload_context does.
    torch.manual_seed(0)
    model, x = Blocks(), torch.randn(8, 32)
    expected = grads_after(model, x, context_fn=torch_sac(policy))
    context_fn = functools.partial(tc.create_selective_checkpoint_contexts, policy)
    wrapped = copy.deepcopy(model)
    if route == "apply":
        co.apply(wrapped, offload=cpu(pool, stream=stream), context_fn=context_fn)
        forward = wrapped
    else:
        forward = functools.partial(run_blocks, wrapped, offload=cpu(pool, stream=stream), context_fn=context_fn)
    wrapped.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.manual_seed(3)
        loss = forward(x)
        held = pool.stats()["bytes_requested"]
        loss.backward()
    assert_bit_identical(expected, grads_of(wrapped))
    # Every block's input and both of its Linear outputs (8x64 and 8x32 float32), each storage
    # once: a block's last output is the next block's input.
    assert held == x.nbytes + len(model.blocks) * (8 * 64 + 8 * 32) * 4
    assert pool.stats()["bytes_in_use"] == 0


@RESPECTS_HOOKS
def test_torch_sacs_offload_policy_without_hooks_warns_once_that_it_recomputes(pool):
    # respect_saved_tensors_hooks=False keeps torch's cache away from the pool: the offload
    # outputs are recomputed (torch's eager meaning), and the user hears it once.
    torch.manual_seed(0)
    model, x = Blocks(), torch.randn(8, 32)
    expected = grads_after(model, x, context_fn=torch_sac(offload_matmuls))
    context_fn = functools.partial(tc.create_selective_checkpoint_contexts, offload_matmuls)
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(3)
        loss = run_blocks(model, x, offload=cpu(pool), context_fn=context_fn, respect_saved_tensors_hooks=False)
        held = pool.stats()["bytes_requested"]
        loss.backward()
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "CheckpointPolicy.MUST_CPU_OFFLOAD" in messages[0], messages
    assert "respect_saved_tensors_hooks=False" in messages[0] and "co.selective_offload_context" in messages[0]
    assert caught[0].filename == __file__
    assert_bit_identical(expected, grads_of(model))
    assert held == x.nbytes + (len(model.blocks) - 1) * 8 * 32 * 4  # the blocks' inputs only
    assert pool.stats()["bytes_in_use"] == 0
