"""GPU tests of the overlap machinery: prefetch in backward, the gather/scatter kernel of
batched small copies, and the cudaHostRegister backend. Marked ``gpu``; skipped without one.

A spin kernel (``torch.cuda._sleep``) holds the compute stream so that a copy that forgot to
wait for it would read or overwrite too early; sentinel values make that visible.
"""

from __future__ import annotations

import random

import pytest
import torch
from models_for_tests import Chain
from helpers import HAS_GPU, cuda_device, step_grads
from helpers import sleep_stream as _sleep

import ckpt_offload as co

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU and a CUDA build of ckpt_offload"),
]


@pytest.fixture
def device():
    """The CUDA device (this file is GPU-only; conftest's `device` also runs on CPU)."""
    yield from cuda_device()


MiB = 1 << 20


def _assert_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("backend", ["pinned", "registered"])
def test_prefetch_bit_identical_and_used(device, backend):
    torch.manual_seed(0)
    model = Chain(width=1024).to(device)
    x = torch.randn(2048, 1024, device=device)
    ref = step_grads(model, x)
    pool = co.HostPool(backend=backend)
    ctx = co.offload(pool=pool, prefetch_bytes=64 * MiB)
    got = step_grads(model, x, ctx)
    _assert_equal(ref, got)
    s = ctx.stats()
    assert s["prefetches"] > 0 and s["prefetch_hits"] == s["prefetches"]
    assert s["peak_prefetch_bytes"] <= 64 * MiB
    assert pool.backend == backend and pool.pinned
    co.synchronize()
    assert pool.stats()["bytes_in_use"] == 0


def test_prefetched_reload_waits_for_its_copy_under_a_busy_stream(device):
    pool = co.HostPool()
    ctx = co.offload(pool=pool, min_bytes=0, prefetch_bytes=256 * MiB)
    values = [float(i + 1) for i in range(8)]
    with ctx:
        handles = [ctx._packer.pack(torch.full((4 * MiB // 4,), v, device=device)) for v in values]
    for i in reversed(range(8)):
        _sleep()  # the compute stream is busy while the prefetches are in flight
        got = ctx._packer.unpack(handles[i])
        assert torch.all(got == values[i]).item(), i
    assert ctx.stats()["prefetch_hits"] == 7


def test_unused_prefetches_do_not_return_memory_mid_copy(device):
    pool = co.HostPool()
    ctx = co.offload(pool=pool, min_bytes=0, prefetch_bytes=256 * MiB)
    with ctx:
        handles = [ctx._packer.pack(torch.full((8 * MiB // 4,), float(i), device=device)) for i in range(8)]
    ctx._packer.unpack(handles[-1])
    del handles  # the prefetched reloads die unused while their copies may still run
    # New tensors on the compute stream must not see a late prefetch write.
    fresh = [torch.full((8 * MiB // 4,), -1.0, device=device) for _ in range(8)]
    torch.cuda.synchronize(device)
    assert all(torch.all(f == -1.0).item() for f in fresh)
    co.synchronize()
    assert ctx.stats()["prefetches_unused"] == 7
    assert pool.stats()["bytes_in_use"] == 0


@pytest.fixture(params=[True, False], ids=["staging", "member_by_member"])
def staging(request):
    """Batches through a device staging block (the gather/scatter kernel), or member by member
    (what a batch does when device memory for the staging block is short)."""
    co._C.testing.set_batch_staging(request.param)
    yield request.param
    co._C.testing.set_batch_staging(True)


def test_gather_scatter_matches_plain_copies(device, staging):
    """Many small tensors of several dtypes, at odd storage offsets, batched."""
    rng = random.Random(0)
    pool = co.HostPool()
    ctx = co.offload(pool=pool, min_bytes=0, batch_below=64 * 1024, batch_bytes=512 * 1024)
    tensors, expect_batched = [], 0
    for _ in range(300):
        dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float64])
        n = rng.randrange(1, 20000)
        base = torch.randint(-100, 100, (n + 64,), device=device).to(dtype)
        off = rng.randrange(0, 64)
        tensors.append(base[off : off + n])
        # Only spans under batch_below are batched; the larger ones are offloaded one by one.
        expect_batched += n * tensors[-1].element_size() < 64 * 1024
    assert 0 < expect_batched < 300
    with ctx:
        _sleep()
        produced = [t * 1 for t in tensors]  # written after the spin: the gather must wait
        handles = [ctx._packer.pack(t) for t in produced]
    s = ctx.stats()
    assert s["tensors_batched"] == expect_batched and s["batches"] > 1
    assert s["tensors_offloaded"] == 300
    for h, t in zip(handles, produced):
        _sleep(1_000_000)
        got = ctx._packer.unpack(h)
        assert got.dtype == t.dtype and got.shape == t.shape
        assert got.data_ptr() % 512 == t.data_ptr() % 512
        assert torch.equal(got, t)


def test_batched_checkpoint_offload_bit_identical(device, staging):
    torch.manual_seed(0)
    model = Chain(n=6, width=256).to(device)
    x = torch.randn(64, 256, device=device, requires_grad=True)

    def run(opts):
        model.zero_grad(set_to_none=True)
        h = x
        for layer in model.layers:
            h = co.checkpoint(lambda t, layer=layer: torch.tanh(layer(t)), h, offload=opts)
        h.sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    ref = run(False)
    _assert_equal(ref, run({"min_bytes": 0, "batch_below": 128 * 1024}))
    _assert_equal(ref, run({"min_bytes": 0, "batch_below": 128 * 1024, "stream": "compute"}))


def test_registered_backend_round_trip(device):
    pool = co.HostPool(backend="registered", segment_bytes=8 * MiB)
    x = torch.randn(3 * MiB, device=device)
    h = co.offload_tensor(x, pool=pool)
    assert torch.equal(h.reload(), x)
    s = pool.stats()
    assert s["backend"] == "registered" and s["bytes_reserved"] >= x.numel() * 4
    del h
    co.synchronize()
    assert pool.empty_cache() > 0
