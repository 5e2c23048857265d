"""Gradients with co.offload are bit-identical to gradients without it."""

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_bit_identical, cpu_offload, grads_of
from helpers import Probe
from models_for_tests import MLP, ConvNet, Transformer


def train_step(model, make_loss, ctx=None, seed=0):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    if ctx is None:
        loss = make_loss(model)
    else:
        with ctx:
            loss = make_loss(model)
    loss.backward()
    return loss.detach(), grads_of(model)


def compare(model, make_loss, pool, stream, device="cpu", **kw):
    base_loss, base = train_step(model, make_loss)
    ctx = cpu_offload(pool, stream=stream, devices=[torch.device(device).type], **kw)
    loss, got = train_step(model, make_loss, ctx)
    assert torch.equal(base_loss, loss)
    assert_bit_identical(base, got)
    s = ctx.stats()
    assert s["tensors_offloaded"] > 0
    assert pool.stats()["bytes_in_use"] == 0  # every block came back after backward
    return s


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mlp(pool, stream, dtype, device):
    torch.manual_seed(1)
    model = MLP(dtype=dtype).to(device)
    x = torch.randn(32, 64, dtype=dtype, device=device)
    s = compare(model, lambda m: m(x).float().pow(2).mean(), pool, stream, device)
    assert s["kept_by_reason"].get("parameter", 0) >= 2  # weight.t() views kept


def test_convnet_with_batchnorm_and_int_indices(pool, stream):
    torch.manual_seed(2)
    model = ConvNet()
    x = torch.randn(4, 3, 16, 16)
    compare(model, lambda m: F.cross_entropy(m(x), torch.arange(4)), pool, stream)


def test_transformer_with_dropout(pool, stream):
    torch.manual_seed(3)
    model = Transformer()
    tokens = torch.randint(0, 97, (3, 16))

    def loss(m):
        logits = m(tokens)
        return F.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten())

    s = compare(model, loss, pool, stream)
    # q, k, v are views of one qkv output: stored once
    assert s["tensors_deduplicated"] > 0


def test_transformer_sdpa(pool, stream):
    torch.manual_seed(4)
    q, k, v = (torch.randn(2, 4, 32, 16, requires_grad=True) for _ in range(3))

    def run(ctx=None):
        for t in (q, k, v):
            t.grad = None
        if ctx:
            with ctx:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.square().sum().backward()
        return [t.grad.clone() for t in (q, k, v)]

    base = run()
    got = run(cpu_offload(pool, stream=stream))
    for a, b in zip(base, got):
        assert torch.equal(a, b)


def layouts(device="cpu"):
    # Made on `device` itself: moving a view with .to() would copy it contiguous, losing the layout.
    d = {"device": device}
    base = torch.randn(40, 30, **d)
    return {
        "transpose": base.t(),
        "slice_with_offset": base[3:17, 5:25],
        "non_contiguous_step": base[::3, ::2],
        "expand": torch.randn(1, 30, **d).expand(500, 30),
        "broadcast_scalar": torch.tensor(3.0, **d).expand(20, 20),
        "permute_3d": torch.randn(4, 5, 6, **d).permute(2, 0, 1),
        "bf16": torch.randn(33, 7, **d).to(torch.bfloat16)[1:],
        "fp16_t": torch.randn(17, 9, **d).half().t(),
        "int64": torch.randint(-(2**40), 2**40, (64,), **d),
        "int32_slice": torch.randint(0, 100, (50, 3), dtype=torch.int32, **d)[:, 1],
        "uint8": torch.randint(0, 255, (300,), dtype=torch.uint8, **d),
        "bool": torch.rand(123, **d) > 0.5,
        "complex": torch.randn(10, dtype=torch.complex64, **d),
        "float64": torch.randn(5, 5, dtype=torch.float64, **d),
    }


@pytest.mark.parametrize("name", sorted(layouts()))
def test_layout_round_trip(pool, stream, name, device):
    t = layouts(device)[name]
    x = torch.randn(8, requires_grad=True, device=device)
    with cpu_offload(pool, stream=stream, devices=[device.type]) as ctx:
        y = Probe.apply(x, t)
    assert ctx.stats()["tensors_offloaded"] >= 1
    Probe.seen.clear()
    y.sum().backward()
    assert Probe.seen == [t.dtype]
    assert torch.equal(x.grad, torch.full_like(x, 2.0))


def test_expanded_tensor_is_stored_at_source_size(pool):
    src = torch.randn(1, 1000)
    x = torch.randn(3, requires_grad=True)
    with cpu_offload(pool) as ctx:
        y = Probe.apply(x, src.expand(1000, 1000))
    # x (12 bytes) and the 1000-float source row, not 1000x1000 floats
    assert ctx.stats()["bytes_offloaded"] == 3 * 4 + 1000 * 4
    assert pool.stats()["bytes_requested"] == 3 * 4 + 1000 * 4
    y.sum().backward()


def test_retain_graph_two_backwards(pool, stream, device):
    torch.manual_seed(5)
    model = MLP().to(device)
    x = torch.randn(16, 64, device=device)
    loss = model(x).square().mean()
    loss.backward(retain_graph=True)
    loss.backward()
    base = grads_of(model)
    model.zero_grad(set_to_none=True)
    with cpu_offload(pool, stream=stream, devices=[device.type]) as ctx:
        loss = model(x).square().mean()
    loss.backward(retain_graph=True)
    in_use = pool.stats()["bytes_in_use"]
    assert in_use > 0  # still held for the second backward
    loss.backward()
    assert_bit_identical(base, grads_of(model))
    assert ctx.stats()["tensors_reloaded"] >= 2 * ctx.stats()["tensors_offloaded"]
    del loss
    assert pool.stats()["bytes_in_use"] == 0


def test_double_backward(pool, stream):
    torch.manual_seed(6)
    w = torch.randn(32, 32, requires_grad=True)
    x = torch.randn(8, 32, requires_grad=True)

    def gradient_penalty(ctx=None):
        w.grad = None
        x.grad = None
        if ctx:
            with ctx:
                y = torch.tanh(x @ w).pow(3).sum()
                (gx,) = torch.autograd.grad(y, x, create_graph=True)
                penalty = gx.square().sum()
        else:
            y = torch.tanh(x @ w).pow(3).sum()
            (gx,) = torch.autograd.grad(y, x, create_graph=True)
            penalty = gx.square().sum()
        penalty.backward()
        return w.grad.clone(), x.grad.clone()

    base = gradient_penalty()
    got = gradient_penalty(cpu_offload(pool, stream=stream))
    assert all(torch.equal(a, b) for a, b in zip(base, got))


def test_backward_on_another_thread(pool, stream):
    import threading

    torch.manual_seed(7)
    model = MLP()
    x = torch.randn(16, 64)
    model(x).sum().backward()
    base = grads_of(model)
    model.zero_grad(set_to_none=True)
    with cpu_offload(pool, stream=stream):
        loss = model(x).sum()
    errors = []

    def run():
        try:
            loss.backward()
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    th = threading.Thread(target=run)
    th.start()
    th.join()
    assert not errors
    assert_bit_identical(base, grads_of(model))


def test_many_steps_stay_identical(pool):
    """Several optimizer steps: parameters end identical, pool returns to zero each step."""
    torch.manual_seed(8)
    a, b = Transformer(layers=1), Transformer(layers=1)
    b.load_state_dict(a.state_dict())
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1)
    for step in range(4):
        tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(step))
        torch.manual_seed(100 + step)
        F.cross_entropy(a(tokens).flatten(0, 1), tokens.flatten()).backward()
        torch.manual_seed(100 + step)
        with cpu_offload(pool):
            loss = F.cross_entropy(b(tokens).flatten(0, 1), tokens.flatten())
        loss.backward()
        opt_a.step(), opt_b.step(), opt_a.zero_grad(), opt_b.zero_grad()
        assert pool.stats()["bytes_in_use"] == 0
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    assert pool.stats()["num_backend_allocs"] == 1  # steps after the first reuse the segment
