"""GPU tests for sequence-tiled recompute (co.tiled, co.apply(tile=...)) on CUDA: the CUDA RNG
replayed per tile, tiles nested in offloaded checkpoints, and the device peak the tiles save
(max_memory_allocated, independent of ckpt_offload's counters).

Marked ``gpu``; skipped cleanly without a usable CUDA device.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ckpt_offload as co
from helpers import GPU_REASON, HAS_GPU

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAS_GPU, reason=GPU_REASON),
]


def mlp(h=256, f=1024):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(h, f), nn.GELU(), nn.Linear(f, h)).cuda()


def test_cuda_dropout_is_replayed_per_tile():
    x = torch.randn(1, 4096, 64, device="cuda", requires_grad=True)
    torch.manual_seed(0)
    y = co.tiled(lambda t: F.dropout(t, 0.5, training=True), tile=512)(x)
    y.backward(torch.ones_like(y))
    assert torch.equal(x.grad, (y != 0).float() * 2.0)


def test_tiled_mlp_in_offloaded_checkpoints_gradients_within_tolerance():
    m, norm = mlp(), nn.LayerNorm(256).cuda()
    x = torch.randn(2, 2048, 256, device="cuda", requires_grad=True)

    def block(h, tiled):
        return h + (tiled or m)(norm(h))

    co.checkpoint(block, x, None).square().mean().backward()
    ref = [p.grad.clone() for p in m.parameters()]
    m.zero_grad(set_to_none=True)
    tiled = co.tiled(m, tile=256)
    co.checkpoint(block, x, tiled, offload=True).square().mean().backward()
    co.synchronize()
    for p, r in zip(m.parameters(), ref):
        assert float((p.grad - r).norm() / r.norm()) < 1e-4
    assert tiled.stats()["calls"] == 1 and co.default_pool().stats()["bytes_in_use"] == 0


def test_tiles_lower_the_device_peak():
    m = mlp(256, 4096)
    x = torch.randn(1, 16384, 256, device="cuda", requires_grad=True)

    def peak(fn):
        fn(x).sum().backward()  # warm-up: gradients exist
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        x.grad = None
        fn(x).sum().backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start

    untiled, tiled = peak(m), peak(co.tiled(m, tile=1024))
    # untiled: two 4096-wide float32 tensors per token (16 MiB each per 1024 tokens); tiled: one tile's
    assert untiled - tiled >= 2 * 16384 * 4096 * 4 * 0.9, (untiled, tiled)
