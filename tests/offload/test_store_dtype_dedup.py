"""With ``store_dtype``, a saved tensor that is exactly the span of an earlier converted one (same storage, first
byte, extent, dtype and version: the same tensor saved twice, or a view of it with another layout such as the
reshaped softmax output a matmul saves) shares its narrow host copy and its up-converted reload (Note
[Low-precision storage], csrc/torch/store_dtype.h). The shared copy is the conversion the second tensor would have
made on its own, so gradients are bit-identical to saving two distinct storages with equal values; spans that
only overlap are converted on their own."""

import pytest
import torch
from conftest import assert_bit_identical, grads_of

import ckpt_offload as co
from ckpt_offload.demo.model import TinyTransformer, lm_loss, make_batch, make_config

FORMATS = [torch.bfloat16, torch.float8_e4m3fn]


def narrow_bytes(numel, fmt):
    """The host bytes of one converted fp32 tensor of ``numel`` elements: 2 per element for bf16; 1 per element
    padded to 4, then the 4-byte fp32 scale, for fp8."""
    if fmt == torch.bfloat16:
        return 2 * numel
    return (numel + 3) // 4 * 4 + 4


def offloading(fmt, **kw):
    return co.offload(devices=["cpu"], min_bytes=0, store_dtype=fmt, **kw)


def square_of_exp(x, ctx, distinct):
    """y = exp(x) saved by exp, then twice by y * y; ``distinct``: the second factor is a clone (another storage,
    the same values), which nothing deduplicates."""
    with ctx:
        y = x.exp()
        loss = (y * (y.clone() if distinct else y)).sum()
    loss.backward()
    return x.grad.clone()


@pytest.mark.parametrize("fmt", FORMATS)
def test_tensor_saved_three_times_is_stored_and_converted_back_once(fmt):
    torch.manual_seed(0)
    x0 = torch.randn(64, 64) * 0.5
    x = x0.clone().requires_grad_()
    ctx = offloading(fmt)
    got = square_of_exp(x, ctx, distinct=False)
    s = ctx.stats()
    # exp saves its result, mul saves both operands: one conversion, two shares
    assert s["tensors_converted"] == 1 and s["tensors_offloaded"] == 1
    assert s["tensors_deduplicated"] == 2 and s["bytes_deduplicated"] == 2 * x0.numel() * 4
    assert s["bytes_offloaded"] == x0.numel() * 4
    assert s["bytes_stored"] == narrow_bytes(x0.numel(), fmt)
    # one reload and one conversion back, the other two unpacks share the full-width storage
    assert s["tensors_reloaded"] == 1 and s["tensors_reload_shared"] == 2

    xr = x0.clone().requires_grad_()
    ref_ctx = offloading(fmt)
    ref = square_of_exp(xr, ref_ctx, distinct=True)
    r = ref_ctx.stats()
    assert r["tensors_converted"] == 2 and r["tensors_deduplicated"] == 1  # the clone is its own copy
    assert r["bytes_stored"] == 2 * narrow_bytes(x0.numel(), fmt)
    assert_bit_identical({"x": got}, {"x": ref})

    xe = x0.clone().requires_grad_()
    exact = square_of_exp(xe, co.offload(devices=["cpu"], min_bytes=0), distinct=False)
    tol = 2e-2 if fmt == torch.bfloat16 else 2e-1
    assert not torch.equal(got, exact)
    assert torch.allclose(got, exact, rtol=tol, atol=tol)


def attention(q, k, v, ctx, distinct):
    """softmax saves its output p; the bmm with v saves p reshaped (another layout, the same span)."""
    b, h, t, d = q.shape
    with ctx:
        p = torch.softmax(q @ k.transpose(-1, -2) / d**0.5, dim=-1)
        p2 = (p.clone() if distinct else p).reshape(b * h, t, t)
        out = torch.bmm(p2, v.reshape(b * h, t, d))
        loss = out.square().sum()
    loss.backward()
    return {"q": q.grad, "k": k.grad, "v": v.grad}


@pytest.mark.parametrize("fmt", FORMATS)
def test_softmax_output_and_its_reshaped_view_share_one_copy(fmt):
    torch.manual_seed(1)
    base = [torch.randn(2, 4, 32, 16) for _ in range(3)]

    def leaves():
        return [t.clone().requires_grad_() for t in base]

    ctx = offloading(fmt)
    got = attention(*leaves(), ctx, distinct=False)
    s = ctx.stats()
    p_bytes = 2 * 4 * 32 * 32 * 4
    assert s["tensors_deduplicated"] == 1 and s["bytes_deduplicated"] == p_bytes

    ref_ctx = offloading(fmt)
    ref = attention(*leaves(), ref_ctx, distinct=True)
    r = ref_ctx.stats()
    assert r["tensors_deduplicated"] == 0 and r["tensors_converted"] == s["tensors_converted"] + 1
    assert r["bytes_stored"] - s["bytes_stored"] == narrow_bytes(p_bytes // 4, fmt)
    assert_bit_identical(got, ref)

    exact = attention(*leaves(), co.offload(devices=["cpu"], min_bytes=0), distinct=False)
    tol = 5e-2 if fmt == torch.bfloat16 else 0.5
    for n in got:
        assert torch.linalg.norm(got[n] - exact[n]) <= tol * torch.linalg.norm(exact[n]), n


def test_shared_across_entries_with_keep_dedup():
    torch.manual_seed(2)
    x = torch.randn(32, 64, requires_grad=True)
    y = x.exp()
    ctx = offloading(torch.bfloat16, keep_dedup=True)
    with ctx:
        a = y.sin()
    with ctx:
        b = y.reshape(64, 32).cos()  # the same span, another layout, in the next entry
    (a.sum() + b.sum()).backward()
    s = ctx.stats()
    assert s["tensors_converted"] == 1 and s["tensors_deduplicated"] == 1
    # the reference: b from a clone of y (the same values in another storage)
    xr = x.detach().clone().requires_grad_()
    yr = xr.exp()
    ref_ctx = offloading(torch.bfloat16)
    with ref_ctx:
        ar = yr.sin()
        br = yr.clone().reshape(64, 32).cos()
    (ar.sum() + br.sum()).backward()
    assert ref_ctx.stats()["tensors_converted"] == 2
    assert_bit_identical({"x": x.grad}, {"x": xr.grad})


def test_without_keep_dedup_each_entry_converts_its_own():
    x = torch.randn(32, 64, requires_grad=True)
    y = x.exp()
    ctx = offloading(torch.bfloat16)
    with ctx:
        a = y.sin()
    with ctx:
        b = y.cos()
    (a.sum() + b.sum()).backward()
    s = ctx.stats()
    assert s["tensors_converted"] == 2 and s["tensors_deduplicated"] == 0


def test_transformer_offloads_exactly_the_exact_arms_bytes():
    cfg = make_config("tiny", dropout=0.0)
    tokens = make_batch(cfg, batch=cfg.batch, seed=3, device="cpu")
    stats, grads = {}, {}
    for name, fmt in [("exact", None), ("bf16", torch.bfloat16)]:
        model = TinyTransformer(**cfg.model_kwargs(), seed=0)
        ctx = co.offload(devices=["cpu"], min_bytes=0, store_dtype=fmt)
        with ctx:
            loss = lm_loss(model, tokens)
        loss.backward()
        stats[name], grads[name] = ctx.stats(), grads_of(model)
    exact, bf16 = stats["exact"], stats["bf16"]
    # the int64 token ids are the only tensors stored exactly: the model's input tokens[:, :-1] (a view of the
    # (batch, seq + 1) batch) and the targets (a copy)
    b, t = tokens.shape[0], tokens.shape[1] - 1
    token_bytes = ((b - 1) * (t + 1) + t) * 8 + b * t * 8
    float_bytes = exact["bytes_offloaded"] - token_bytes
    assert float_bytes > 0 and float_bytes % 4 == 0
    assert bf16["bytes_offloaded"] == exact["bytes_offloaded"]  # nothing counted twice
    assert bf16["tensors_offloaded"] == exact["tensors_offloaded"]
    assert bf16["tensors_deduplicated"] == exact["tensors_deduplicated"] > 0
    assert bf16["bytes_stored"] == exact["bytes_offloaded"] - float_bytes // 2
    assert bf16["tensors_reloaded"] == exact["tensors_reloaded"]
    for n, e in grads["exact"].items():
        assert torch.linalg.norm(grads["bf16"][n] - e) <= 2e-2 * torch.linalg.norm(e), n

    # bit-identical to the same step with every floating-point activation rounded by torch's own cast, one by
    # one (parameters and views of them are kept as they are, as ckpt_offload keeps them)
    def pack(t):
        param = isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)
        return t if param or not t.is_floating_point() else t.to(torch.bfloat16)

    model = TinyTransformer(**cfg.model_kwargs(), seed=0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t.float() if t.dtype == torch.bfloat16 else t):
        loss = lm_loss(model, tokens)
    loss.backward()
    assert_bit_identical(grads["bf16"], grads_of(model))


def test_in_place_modification_after_the_shared_save_raises():
    x = torch.randn(64, 64, requires_grad=True)
    with offloading(torch.bfloat16) as ctx:
        y = x.exp()
        loss = (y * y).sum()
    assert ctx.stats()["tensors_deduplicated"] == 2
    with torch.no_grad():
        y.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_a_new_version_of_the_span_is_converted_again():
    x = torch.randn(64, 64, requires_grad=True)
    with offloading(torch.bfloat16) as ctx:
        y = x * 1.0
        a = y.sin()  # saves y at version 0
        y.mul_(3.0)  # version 1: the bytes differ
        b = y.cos()  # saves y again: not the stored copy
    s = ctx.stats()
    assert s["tensors_deduplicated"] == 0 and s["tensors_converted"] >= 2
    del a, b, y  # the graph dies unpacked: the pool gets every block back (the fixture checks)


def test_overlapping_spans_are_converted_apart_with_correct_gradients():
    torch.manual_seed(4)
    x0 = torch.randn(64, 64) * 0.5

    def run(ctx):
        x = x0.clone().requires_grad_()
        with ctx:
            y = x.exp()
            a, b = y[:48], y[16:]  # overlapping, not equal: each its own copy
            c = y.reshape(32, 128)  # equal to y's span: shared
            loss = a.sin().sum() + b.cos().sum() + c.sin().square().sum()
        loss.backward()
        return x.grad

    ctx = offloading(torch.bfloat16)
    got = run(ctx)
    s = ctx.stats()
    assert s["tensors_converted"] == 4  # y, y[:48], y[16:], and c.sin() saved by square
    assert s["tensors_deduplicated"] == 1  # the reshape c, saved by sin: the span of y
    # the same graph with every saved tensor rounded by torch's own cast, one by one
    rounding = torch.autograd.graph.saved_tensors_hooks(lambda t: t.to(torch.bfloat16), lambda t: t.float())
    assert_bit_identical({"x": got}, {"x": run(rounding)})
    exact = run(co.offload(devices=["cpu"], min_bytes=0))
    assert not torch.equal(got, exact)
    assert torch.linalg.norm(got - exact) <= 2e-2 * torch.linalg.norm(exact)


def test_shared_reload_is_one_storage_with_each_layout():
    """Each saved tensor comes back with its own sizes, strides and offset over the one converted storage."""
    seen = []

    class Both(torch.autograd.Function):
        @staticmethod
        def forward(ctx, y, v):
            ctx.save_for_backward(y, v)
            return y * 2

        @staticmethod
        def backward(ctx, g):
            y, v = ctx.saved_tensors
            seen.append(
                (
                    y.untyped_storage().data_ptr(),
                    v.untyped_storage().data_ptr(),
                    v.size(),
                    v.stride(),
                    v.storage_offset() - y.storage_offset(),
                    torch.equal(v, y.t()),
                )
            )
            return g * 2, None

    x = torch.randn(48, 80, requires_grad=True)
    with offloading(torch.bfloat16) as ctx:
        y = x.exp()
        out = Both.apply(y, y.t())
    out.sum().backward()
    assert ctx.stats()["tensors_deduplicated"] >= 1
    ((py_, pv, size, stride, off, same),) = seen
    assert py_ == pv and size == (80, 48) and stride == (1, 80) and off == 0 and same


def test_batched_small_tensors_are_not_affected():
    x = torch.randn(8, 8, requires_grad=True)
    with co.offload(devices=["cpu"], min_bytes=0, store_dtype=torch.bfloat16, store_min_bytes=1 << 20) as ctx:
        y = x.exp()
        loss = (y * y).sum()
    loss.backward()
    s = ctx.stats()
    assert s["tensors_converted"] == 0 and s["tensors_deduplicated"] == 2  # the exact path's dedup
    assert torch.equal(x.grad, (2 * x.detach().exp() ** 2))


def test_retain_graph_converts_the_shared_copy_back_again_with_the_same_bits():
    torch.manual_seed(5)
    x = (torch.randn(64, 64) * 0.5).requires_grad_()
    with offloading(torch.bfloat16) as ctx:
        y = x.exp()
        loss = (y * y).sum()
    loss.backward(retain_graph=True)
    first = x.grad.clone()
    x.grad = None
    loss.backward()  # every saved tensor unpacks again: the narrow copy is reloaded and converted again
    assert_bit_identical({"x": first}, {"x": x.grad})
    s = ctx.stats()
    # the first backward converts back once; the second keeps no reload for later unpacks (each saved tensor
    # already unpacked once), so the one exp's backward asks for is converted back again once mul's is freed
    assert s["tensors_converted"] == 1 and s["tensors_reloaded"] + s["tensors_reload_shared"] == 6
    assert s["tensors_reloaded"] <= 3


def test_partial_backward_leaves_nothing_behind():
    """Only one of the two saved tensors over a copy unpacks (the other's branch gets no gradient): the kept
    full-width reload and the copy go with the graph (the fixture checks the pool and the device bytes)."""
    x = torch.randn(64, 64, requires_grad=True)
    w = torch.randn(64, 64, requires_grad=True)
    with offloading(torch.bfloat16) as ctx:
        y = x.exp()
        a = y.sin()  # saves y
        b = y.reshape(32, 128) * w.reshape(32, 128)  # saves y reshaped (and w)
    torch.autograd.backward(a.sum(), inputs=[x])
    assert ctx.stats()["tensors_deduplicated"] >= 1
    del a, b, y
