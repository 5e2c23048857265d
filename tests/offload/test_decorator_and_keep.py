"""co.offload as a decorator and co.keep(): a region (or a decorated function) inside an offload
context that keeps its saved tensors on the device, with gradients unchanged."""

import torch
from torch import nn

import ckpt_offload as co


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))


def test_offload_as_decorator_offloads_and_matches_grads():
    model, x = _model(), torch.randn(32, 64)
    model(x).sum().backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ctx = co.offload(devices=["cpu"], min_bytes=0, pool=co.HostPool(pinned=False))

    @ctx
    def forward(inp):
        return model(inp).sum()

    forward(x).backward()
    assert ctx.stats()["tensors_offloaded"] > 0 and not ctx.active
    assert all(torch.equal(p.grad, r) for p, r in zip(model.parameters(), ref))
    assert forward.__name__ == "forward"


def test_keep_region_keeps_inside_offload_and_grads_match():
    model, head, x = _model(), nn.Linear(64, 512), torch.randn(32, 64)
    (head(model(x)).logsumexp(-1).sum()).backward()
    ref = [p.grad.clone() for p in [*model.parameters(), *head.parameters()]]
    model.zero_grad()
    head.zero_grad()
    ctx = co.offload(devices=["cpu"], min_bytes=0, pool=co.HostPool(pinned=False))
    with ctx:
        h = model(x)
        before = ctx.stats()["tensors_offloaded"] + ctx.stats()["tensors_kept"]
        with co.keep():
            loss = head(h).logsumexp(-1).sum()
        after = ctx.stats()["tensors_offloaded"] + ctx.stats()["tensors_kept"]
    assert before > 0 and after == before  # nothing inside co.keep() reached the offload hooks
    loss.backward()
    got = [p.grad for p in [*model.parameters(), *head.parameters()]]
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_keep_as_decorator():
    ctx = co.offload(devices=["cpu"], min_bytes=0, pool=co.HostPool(pinned=False))

    @co.keep()
    def loss_fn(t):
        return (t * t).sum()

    x = torch.randn(100, requires_grad=True)
    with ctx:
        loss = loss_fn(x.sin())
    loss.backward()
    assert ctx.stats()["tensors_offloaded"] == 1  # sin's input; t * t saved nothing offloaded
    assert torch.equal(x.grad, 2 * x.detach().sin() * x.detach().cos())
