"""What co.offload offloads, keeps, deduplicates and refuses: no leaks, parameters and odd layouts kept, a bounded
pool, clear errors."""

import gc
import re
import warnings

import pytest
import torch
import torch.nn as nn

import ckpt_offload as co
from conftest import cpu_offload, global_module_hook_counts, nonzero
from helpers import Probe


def saved_bytes_in_pool(pool):
    return pool.stats()["bytes_requested"]


def test_linear_weight_view_is_not_offloaded(pool):
    lin = nn.Linear(64, 64)
    x = torch.randn(8, 64, requires_grad=True)
    with cpu_offload(pool) as ctx:
        y = lin(x)
    s = ctx.stats()
    # Linear saves x and weight.t(); the latter is a plain-Tensor view of the Parameter
    assert nonzero(s["kept_by_reason"]) == {"parameter": 1}
    assert s["tensors_offloaded"] == 1 and s["bytes_offloaded"] == x.numel() * 4
    assert saved_bytes_in_pool(pool) == x.numel() * 4
    y.sum().backward()


def test_frozen_parameter_and_buffer_are_not_offloaded(pool):
    class Frozen(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(32, 32)
            self.lin.weight.requires_grad_(False)
            self.register_buffer("scale", torch.randn(16, 32))

        def forward(self, x):
            return self.lin(x) * self.scale  # saves weight.t() (frozen) and the buffer

    m = Frozen()
    x = torch.randn(16, 32, requires_grad=True)
    with cpu_offload(pool) as ctx:
        y = m(x)
    kept = ctx.stats()["kept_by_reason"]
    assert kept.get("parameter", 0) == 1 and kept.get("buffer", 0) == 1
    y.sum().backward()


def test_no_global_module_hook_while_active(pool):
    """Parameters and buffers are recognised from the tensor itself: co.offload registers no
    global nn.Module hook (which would put every module call of the process on torch's slow
    path and make torch.compile warn about global hooks)."""
    m = nn.Linear(8, 8)
    with cpu_offload(pool) as ctx:
        assert global_module_hook_counts() == {k: 0 for k in global_module_hook_counts()}
        y = m(torch.randn(2, 8, requires_grad=True))
    assert nonzero(ctx.stats()["kept_by_reason"]) == {"parameter": 1}
    y.sum().backward()


def test_compiled_module_under_offload_gives_no_global_hooks_warning(pool):
    """torch.compile(module) warns on the user's line when global module hooks exist; co.offload
    registers none, and gradients equal the uncompiled run's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(4, 16, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with cpu_offload(pool) as ctx:
            y = compiled(x).sum()
        y.backward()
    assert not [str(w.message) for w in caught if "global hooks" in str(w.message)]
    assert ctx.stats()["tensors_offloaded"] > 0
    x2 = x.detach().clone().requires_grad_()
    model(x2).sum().backward()
    assert torch.equal(x.grad, x2.grad)


class Scaled(nn.Module):
    """Saves a view of its buffer (``scale[:n]``), and a frozen weight's view (``weight.t()``)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)
        self.lin.weight.requires_grad_(False)
        self.register_buffer("scale", torch.randn(64, 32))

    def forward(self, x):
        return self.lin(x) * self.scale[: x.shape[0]]


def test_buffer_view_inside_nested_module_is_kept(pool):
    """A buffer is found among the modules whose forward is running (an ancestor's frame counts
    as well as its own module's); a leaf tensor that is no module's (the input, a mask built
    without grad) is offloaded."""
    model = nn.Sequential(Scaled(), nn.Tanh())
    x = torch.randn(16, 32, requires_grad=True)
    mask = (torch.rand(16, 32) > 0.5).float()  # a leaf that is no module's state
    with cpu_offload(pool) as ctx:
        y = model(x) * mask
    s = ctx.stats()
    assert nonzero(s["kept_by_reason"]) == {"parameter": 1, "buffer": 1}
    # tanh's output and the mask (the frozen Linear saves only its weight's view, the product
    # with the buffer only the buffer's view)
    assert s["tensors_offloaded"] == 2
    (y.sum()).backward()
    ref = Scaled()
    ref.load_state_dict(model[0].state_dict())
    x2 = x.detach().clone().requires_grad_()
    (torch.tanh(ref(x2)) * mask).sum().backward()
    assert torch.equal(x.grad, x2.grad)


def test_buffer_used_outside_its_modules_forward_is_offloaded(pool):
    """The documented boundary: a buffer read outside the forward of the module that owns it
    (and of its ancestors) is copied like an activation; gradients are unaffected."""
    owner = Scaled()
    x = torch.randn(16, 32, requires_grad=True)
    with cpu_offload(pool) as ctx:
        y = (x * owner.scale[:16]).sum()
    assert ctx.stats()["kept_by_reason"].get("buffer", 0) == 0
    y.backward()
    assert torch.equal(x.grad, owner.scale[:16])


def test_buffer_of_an_ancestor_many_modules_up_is_kept(pool):
    """The running modules are read from the whole stack (Note [Reading the Python stack]): a
    buffer of the outermost of 24 nested modules, saved by the innermost one, is kept."""

    class Wrap(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x, scale):
            return self.inner(x, scale)

    class Leafmost(nn.Module):
        def forward(self, x, scale):
            return x * scale

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            inner = Leafmost()
            for _ in range(22):
                inner = Wrap(inner)
            self.body = inner
            self.register_buffer("scale", torch.randn(16, 32))

        def forward(self, x):
            return self.body(x, self.scale)

    model = Outer()
    x = torch.randn(16, 32, requires_grad=True)
    with cpu_offload(pool) as ctx:
        y = model(x).sum()
    assert nonzero(ctx.stats()["kept_by_reason"]) == {"buffer": 1}
    y.backward()
    assert torch.equal(x.grad, model.scale)


def test_buffer_found_once_does_not_vouch_for_its_modules_other_buffers(pool):
    """Only the storage found is remembered for the activation: another buffer of the same
    module, saved after that module's forward returned, is outside its forward (the documented
    boundary) and is offloaded, whatever was saved before it."""

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("a", torch.randn(16, 32))
            self.register_buffer("b", torch.randn(16, 32))

        def forward(self, x):
            return x * self.a

    owner = Two()
    x = torch.randn(16, 32, requires_grad=True)
    with cpu_offload(pool) as ctx:
        y = owner(x)  # saves `a`, inside its owner's forward: kept
        z = y * owner.b  # saves `b`, outside it: offloaded
        w = z * owner.a  # saves `a` again, outside it too, but found before: kept
    s = ctx.stats()
    assert s["kept_by_reason"]["buffer"] == 2
    assert s["tensors_offloaded"] == 1  # `b`
    w.sum().backward()
    assert torch.equal(x.grad, owner.a * owner.b * owner.a)


def test_functional_call_swapped_parameters_are_kept(pool):
    """torch.func.functional_call puts plain tensors in the module's ``_parameters``: they are
    still recognised as the module's parameters."""
    lin = nn.Linear(32, 32)
    params = {k: v.detach().clone().requires_grad_() for k, v in lin.named_parameters()}
    x = torch.randn(8, 32, requires_grad=True)
    with cpu_offload(pool) as ctx:
        y = torch.func.functional_call(lin, params, (x,))
    assert nonzero(ctx.stats()["kept_by_reason"]) == {"parameter": 1}
    y.sum().backward()
    assert params["weight"].grad is not None


def test_functional_parameter_use_is_not_offloaded(pool):
    w = nn.Parameter(torch.randn(32, 32))
    x = torch.randn(4, 32, requires_grad=True)
    with cpu_offload(pool) as ctx:
        y = (x @ w).sum() + (x * w[0]).sum()
    assert ctx.stats()["kept_by_reason"].get("parameter", 0) == 2  # w itself, and w[0]
    y.backward()


def test_cpu_tensors_not_offloaded_unless_asked(pool):
    x = torch.randn(64, 64, requires_grad=True)
    with (
        pytest.warns(UserWarning, match="devices=\\['cpu'\\]")
        if not torch.cuda.is_available()
        else warnings.catch_warnings()
    ):
        ctx = co.offload(pool=pool, min_bytes=0)
    with ctx:
        y = x.sin()
    s = ctx.stats()
    assert s["tensors_offloaded"] == 0 and nonzero(s["kept_by_reason"]) == {"device": 1}
    assert pool.stats()["bytes_in_use"] == 0
    y.sum().backward()


def test_deduplication_of_views_of_one_storage(pool):
    base = torch.randn(100, 10)
    x = torch.randn(3, requires_grad=True)
    with cpu_offload(pool) as ctx:
        y = Probe.apply(x, base, base[10:20], base.t(), base[50:])
    s = ctx.stats()
    assert s["tensors_offloaded"] == 2  # x and base
    assert s["tensors_deduplicated"] == 3
    assert s["bytes_deduplicated"] == (10 * 10 + 1000 + 50 * 10) * 4
    assert saved_bytes_in_pool(pool) == 3 * 4 + 1000 * 4
    y.sum().backward()  # Probe checks values and layouts


def test_view_reaching_past_offloaded_span_joins_its_copy(pool):
    """base[5:60] reaches past base[:10]'s span but shares its 512-byte cell: it joins that copy (widened to the
    cell, here the whole 400-byte storage) instead of copying its bytes again (Note [One copy per storage])."""
    base = torch.randn(100)
    x = torch.randn(3, requires_grad=True)
    with cpu_offload(pool) as ctx:
        y = Probe.apply(x, base[:10], base[5:60])
    s = ctx.stats()
    assert s["tensors_offloaded"] == 2 and s["tensors_deduplicated"] == 1
    assert saved_bytes_in_pool(pool) == 3 * 4 + 100 * 4
    y.sum().backward()


def test_same_storage_modified_between_saves_is_not_deduplicated(pool):
    a = torch.randn(50)
    x = torch.randn(3, requires_grad=True)
    with cpu_offload(pool) as ctx:
        y1 = Probe.apply(x, a)
        a.mul_(2)  # a was saved by Probe: using y1 later must fail, but a new save is distinct
        y2 = Probe.apply(x, a)
    s = ctx.stats()
    assert s["tensors_offloaded"] == 3  # x, a before and a after the write
    assert s["tensors_deduplicated"] == 1  # only x, saved twice unchanged
    y2.sum().backward()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y1.sum().backward()


def test_min_bytes_threshold(pool):
    x = torch.randn(3, requires_grad=True)
    small = torch.randn(255)  # 1020 bytes
    exact = torch.randn(256)  # 1024 bytes
    with cpu_offload(pool, min_bytes=1024) as ctx:
        y = Probe.apply(x, small, exact)
    s = ctx.stats()
    assert s["tensors_offloaded"] == 1
    assert nonzero(s["kept_by_reason"]) == {"too_small": 2}  # x (12 bytes) and small
    assert s["kept_bytes_by_reason"]["too_small"] == 12 + 1020
    y.sum().backward()


def test_default_min_bytes_is_used():
    ctx = co.offload(devices=["cpu"])
    assert ctx.min_bytes == co.DEFAULT_MIN_BYTES > 0


def test_sparse_and_subclass_tensors_are_kept(pool):
    class Tagged(torch.Tensor):
        pass

    x = torch.randn(3, requires_grad=True)
    sparse = torch.randn(20, 20).relu().to_sparse()
    tagged = torch.randn(100).as_subclass(Tagged)
    conj = torch.randn(10, dtype=torch.complex64).conj()
    with cpu_offload(pool) as ctx:
        y = Probe.apply(x, sparse.to_dense(), tagged, conj)
        z = torch.sparse.mm(sparse, torch.randn(20, 4, requires_grad=True)).sum()
    kept = ctx.stats()["kept_by_reason"]
    assert kept.get("subclass", 0) >= 1
    assert kept.get("layout", 0) >= 2  # the conjugate view and the sparse matrix
    y.sum().backward()
    z.backward()


def test_pool_full_keep_policy(stream):
    pool = co.HostPool(max_bytes=64 * 1024, pinned=False, segment_bytes=64 * 1024)
    x = torch.randn(3, requires_grad=True)
    big = [torch.randn(6000) for _ in range(4)]  # 24 KB each: two fit under the cap
    with cpu_offload(pool, stream=stream, on_full="keep") as ctx:
        y = Probe.apply(x, *big)
    s = ctx.stats()
    assert s["kept_by_reason"].get("pool_full", 0) >= 1
    assert s["tensors_offloaded"] >= 2
    st = pool.stats()
    assert st["bytes_reserved"] <= 64 * 1024 and st["num_cap_hits"] >= 1
    y.sum().backward()  # kept tensors still give the right values (Probe checks)
    assert pool.stats()["bytes_in_use"] == 0


def test_pool_full_raise_policy():
    pool = co.HostPool(max_bytes=16 * 1024, pinned=False)
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(co.PoolFullError) as info:
        with cpu_offload(pool, on_full="raise"):
            Probe.apply(x, torch.randn(10000))
    msg = str(info.value)
    assert isinstance(info.value, MemoryError)
    assert "Asked for 39.1 KiB (40000 bytes)" in msg and "in use" in msg and "cap 16.0 KiB" in msg
    assert "max_bytes" in msg and 'on_full="keep"' in msg
    gc.collect()
    assert pool.stats()["bytes_in_use"] == 0


def test_inplace_after_save_raises_like_autograd(pool, stream):
    a = torch.randn(64, 64, requires_grad=True) * 2
    b = a.sin()  # saves a
    a.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        b.sum().backward()  # what autograd does without hooks; ours must match
    with cpu_offload(pool, stream=stream):
        a = torch.randn(64, 64, requires_grad=True) * 2
        b = a.sin()
    a.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation.*expected version 0"):
        b.sum().backward()


def test_inplace_after_save_of_kept_tensor_raises(pool):
    with cpu_offload(pool, min_bytes=1 << 30) as ctx:  # everything too small: kept
        a = torch.randn(8, requires_grad=True) * 2
        b = a.exp()  # saves its output
    assert ctx.stats()["tensors_offloaded"] == 0 and ctx.stats()["tensors_kept"] == 1
    with torch.no_grad():
        b.mul_(3)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        b.sum().backward()


def test_graph_dropped_without_backward_frees_pool(pool):
    start = pool.stats()["bytes_in_use"]
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    with cpu_offload(pool):
        loss = model(torch.randn(32, 64)).sum()
    assert pool.stats()["bytes_in_use"] > start
    del loss
    assert pool.stats()["bytes_in_use"] == start
    pool.synchronize()
    assert pool.stats()["bytes_pending"] == 0


class Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("boom in backward")


def test_backward_that_raises_frees_pool(pool):
    start = pool.stats()["bytes_in_use"]
    x = torch.randn(128, 128, requires_grad=True)
    with cpu_offload(pool):
        loss = Boom.apply(x.sin()).sum()
    with pytest.raises(ValueError, match="boom"):
        loss.backward()
    del loss
    gc.collect()
    assert pool.stats()["bytes_in_use"] == start


class SavesOutput(torch.autograd.Function):
    """Saves its own output, as exp/tanh/sigmoid do: the case where pack receives a tensor
    whose grad_fn is the node that holds it."""

    @staticmethod
    def forward(ctx, x):
        out = x.exp()
        ctx.save_for_backward(out)
        ctx.marker = Marker()
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return grad * out


class Marker:
    pass


@pytest.mark.parametrize("min_bytes", [0, 1 << 30], ids=["offloaded", "kept"])
def test_no_reference_cycle_through_saved_outputs(pool, min_bytes):
    """pack must not keep a tensor that references its own grad_fn: the graph would leak."""
    import weakref

    x = torch.randn(64, 64, requires_grad=True)
    with cpu_offload(pool, min_bytes=min_bytes):
        y = SavesOutput.apply(x)
    ref = weakref.ref(y.grad_fn.marker)
    del y
    gc.collect()
    assert ref() is None, "the graph outlived its last reference"
    assert pool.stats()["bytes_in_use"] == 0


class SavesViewOfWeight(torch.autograd.Function):
    """Returns a view of its (parameter) input as its own output and saves that output: the
    saved tensor is kept as a parameter's view, yet its grad_fn is the saving node."""

    @staticmethod
    def forward(ctx, w):
        out = w.view(-1)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return (grad * out).view(16, 16)


def test_parameter_view_saved_as_its_own_output_forms_no_cycle(pool):
    """Note [Kept as it is]: parameters and their views are held as they are, except one whose
    grad_fn is the node saving it, which gets a detached alias: no cycle, the graph goes."""
    import weakref

    w = nn.Parameter(torch.randn(16, 16))
    with cpu_offload(pool) as ctx:
        y = SavesViewOfWeight.apply(w)
    assert nonzero(ctx.stats()["kept_by_reason"]) == {"parameter": 1}
    node = y.grad_fn
    node.marker = Marker()
    ref = weakref.ref(node.marker)
    del y, node
    gc.collect()
    assert ref() is None, "the graph outlived its last reference"


def test_kept_parameter_view_gradients_and_inplace_check(pool):
    """A parameter's view held as it is gives the gradients it gives without ckpt_offload, and a
    write to the parameter after the save still makes backward raise."""
    lin = nn.Linear(16, 16)
    ref_lin = nn.Linear(16, 16)
    ref_lin.load_state_dict(lin.state_dict())
    x = torch.randn(4, 16, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    with cpu_offload(pool) as ctx:
        y = torch.tanh(lin(x)).sum()
    assert ctx.stats()["kept_by_reason"]["parameter"] == 1  # weight.t()
    y.backward()
    torch.tanh(ref_lin(x2)).sum().backward()
    assert torch.equal(x.grad, x2.grad)
    assert torch.equal(lin.weight.grad, ref_lin.weight.grad)
    with cpu_offload(pool):
        z = torch.tanh(lin(x)).sum()
    with torch.no_grad():
        lin.weight.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.backward()


def test_context_cannot_be_entered_twice_at_once(pool):
    ctx = cpu_offload(pool)
    with ctx:
        with pytest.raises(RuntimeError, match="already active"):
            ctx.__enter__()
    with ctx:  # re-entering after exit is fine; stats accumulate
        pass


def test_nested_contexts_inner_wins(pool):
    other = co.HostPool(pinned=False)
    x = torch.randn(100, requires_grad=True)
    with cpu_offload(pool) as outer:
        with cpu_offload(other) as inner:
            y = x.sin()
        z = x.cos()
    assert inner.stats()["tensors_offloaded"] == 1 and outer.stats()["tensors_offloaded"] == 1
    (y + z).sum().backward()


def test_stats_keys(pool):
    with cpu_offload(pool) as ctx:
        pass
    s = ctx.stats()
    for key in [
        "tensors_offloaded",
        "bytes_offloaded",
        "tensors_kept",
        "bytes_kept",
        "kept_by_reason",
        "tensors_deduplicated",
        "bytes_deduplicated",
        "tensors_reloaded",
        "bytes_reloaded",
    ]:
        assert key in s
    assert re.match(r"co\.offload\(min_bytes=0, stream='side', devices=\['cpu'\]", repr(ctx))


@pytest.mark.parametrize("first_offset", [1, 3, 37])
def test_dedup_view_of_misaligned_first_save(pool, stream, first_offset):
    """The first view of a storage to be offloaded starts `first_offset` elements in, so its
    host copy is reloaded behind a pad of first_offset * 4 bytes (alignment is kept modulo
    512). A later view deduplicated onto that copy must count the pad in its offset, or it
    reads the wrong elements. (Found by mutation testing: other dedup tests start at offset 0.)"""
    base = torch.randn(1000)
    x = torch.randn(3, requires_grad=True)
    first = base[first_offset:]
    with cpu_offload(pool, stream=stream) as ctx:
        y = Probe.apply(x, first, base[50:60], base[first_offset + 2 : 900 : 7], base[100:].view(9, 100)[:, 3:])
    s = ctx.stats()
    assert s["tensors_offloaded"] == 2  # x and `first`
    assert s["tensors_deduplicated"] == 3  # all within first's span
    Probe.seen.clear()
    y.sum().backward()  # Probe checks values, sizes, strides and storage offsets
    assert Probe.seen == [torch.float32] * 4
    assert torch.equal(x.grad, torch.full_like(x, 2.0))
