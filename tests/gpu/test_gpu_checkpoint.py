"""GPU tests for recompute with offloaded inputs (co.checkpoint / co.apply on CUDA).

Marked ``gpu``; skipped cleanly without a usable CUDA device.
"""

import pytest
import torch
import torch.nn as nn

import ckpt_offload as co
from helpers import GPU_REASON, HAS_GPU
from models_for_tests import Block


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAS_GPU, reason=GPU_REASON),
]


class Stack(nn.Module):
    def __init__(self, layers=4, dim=256):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, heads=4, dropout=0.1) for _ in range(layers))

    def forward(self, x, scale):
        for blk in self.blocks:
            x = blk(x) * scale
        return x


def _grads(model, x, scale, seed):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    model(x, scale).square().mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _reproducible(model, x, scale):
    a, b = _grads(model, x, scale, 1), _grads(model, x, scale, 1)
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("stream", ["side", "compute"])
def test_apply_with_offload_matches_and_holds_inputs_in_pool(stream):
    torch.manual_seed(0)
    model = Stack().cuda()
    x = torch.randn(4, 128, 256, device="cuda", requires_grad=True)
    scale = torch.tensor(0.9, device="cuda")
    if not _reproducible(model, x, scale):
        pytest.skip("this GPU's kernels are not bit-reproducible run to run")
    base = _grads(model, x, scale, 1)
    pool = co.HostPool()
    assert pool.backend == "pinned"
    handle = co.apply(model, offload={"pool": pool, "stream": stream, "min_bytes": 0})
    try:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        out = model(x, scale)
        torch.cuda.synchronize()
        # one input per block (x, then each block's output times scale); x*scale shares nothing
        assert pool.stats()["num_blocks_in_use"] == 4
        assert pool.stats()["bytes_requested"] == 4 * x.numel() * 4
        out.square().mean().backward()
        got = {n: p.grad.clone() for n, p in model.named_parameters()}
        for k in base:
            assert torch.equal(base[k], got[k]), k
        assert pool.stats()["bytes_in_use"] == 0
    finally:
        handle.remove()


def test_checkpoint_offload_frees_device_memory_of_inputs():
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block(512, heads=8, dropout=0.0) for _ in range(6)).cuda()
    x = torch.randn(2, 512, 512, device="cuda", requires_grad=True)

    def run(offload):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        h = x
        for blk in blocks:
            h = co.checkpoint(blk, h, offload=offload)
        co.synchronize()
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        h.sum().backward()
        return held

    plain = run(False)
    offloaded = run({"min_bytes": 0})
    # without offload the 5 intermediate inputs (plus the output) stay on the device
    assert plain >= 5 * x.numel() * 4
    assert offloaded <= plain - 4 * x.numel() * 4


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="nn.DataParallel replication needs 2 or more GPUs")
def test_apply_under_data_parallel_replicas_use_their_own_weights():
    # DataParallel replicates every block with a shallow copy of its __dict__; each replica must
    # checkpoint its own forward (with the weights broadcast to its GPU), not the original's.
    from models_for_tests import MLP

    torch.manual_seed(0)
    ref = nn.Sequential(*[MLP(dim=64, hidden=128) for _ in range(3)]).cuda()
    model = nn.Sequential(*[MLP(dim=64, hidden=128) for _ in range(3)]).cuda()
    model.load_state_dict(ref.state_dict())
    co.apply(model, offload={"min_bytes": 0})
    x = torch.randn(16, 64, device="cuda")
    nn.DataParallel(ref, device_ids=[0, 1])(x).sum().backward()
    nn.DataParallel(model, device_ids=[0, 1])(x).sum().backward()
    for (name, p), (_, q) in zip(ref.named_parameters(), model.named_parameters()):
        assert torch.equal(p.grad, q.grad), name
