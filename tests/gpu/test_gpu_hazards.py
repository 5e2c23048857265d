"""GPU hazards the CPU stream emulation cannot show: producing streams of batch
members, reload buffers consumed on another stream, CUDA graph capture, co.synchronize and other
threads, demand reloads vs prefetches, the profiler's timing epoch.

Marked ``gpu``; skipped cleanly without a CUDA device. Like test_gpu.py, they make a hazard
likely to show (a spin kernel holds a stream, so work that forgot to wait for it runs early) and
assert values and order, never durations. The rules they guard are Note [Stream ordering] and
Note [Graph capture] in csrc/torch/runtime.h.
"""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch
from helpers import HAS_GPU, cuda_device
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


@pytest.mark.parametrize("full_pool", [False, True])
def test_batched_members_wait_for_the_stream_that_produced_them(device, full_pool):
    """Members written under torch.cuda.stream(s) and flushed on the default stream: the gather
    (and the device copies of the pool-full fallback) wait for s."""
    pool = co.HostPool(max_bytes=4096, segment_bytes=4096) if full_pool else co.HostPool()
    ctx = co.offload(pool=pool, min_bytes=0, batch_below=64 * 1024)
    src = [torch.randn(1000 + 17 * i, device=device) for i in range(20)]
    s = torch.cuda.Stream(device)
    s.wait_stream(torch.cuda.current_stream(device))
    with ctx:
        with torch.cuda.stream(s):
            _sleep()  # s is busy: the members below are written late
            produced = [t * 2 for t in src]
            handles = [ctx._packer.pack(t) for t in produced]
    # The context exit flushed the batch on the default stream.
    torch.cuda.synchronize(device)
    assert ctx.stats()["tensors_batched"] == (0 if full_pool else 20)
    for h, t in zip(handles, src):
        assert torch.equal(ctx._packer.unpack(h), t * 2)


def test_prefetched_reload_consumed_on_another_stream_is_not_reused_early(device):
    """A prefetch allocated under stream s1 and consumed under s2 gets record_stream on s2: the
    caching allocator does not hand its memory to s1 while s2's kernels still read it."""
    ctx = co.offload(pool=co.HostPool(), min_bytes=0, prefetch_bytes=256 * MiB)
    ts = [torch.randn(1 << 20, device=device) for _ in range(3)]
    with ctx:
        handles = [ctx._packer.pack(t) for t in ts]
    torch.cuda.synchronize(device)
    s1, s2 = torch.cuda.Stream(device), torch.cuda.Stream(device)
    with torch.cuda.stream(s1):
        ctx._packer.unpack(handles[2])  # prefetches handles 1 and 0, allocated in s1's order
    with torch.cuda.stream(s2):
        _sleep()  # s2 is busy: its read of the reload below runs late
        got = ctx._packer.unpack(handles[1])
        out = got * 1
    del got  # back to the allocator: without record_stream, free for s1 at once
    with torch.cuda.stream(s1):
        junk = torch.full_like(ts[1], 7.0)  # the same size: the freed block, if it were free
    torch.cuda.synchronize(device)
    assert torch.equal(out, ts[1])
    del junk


@pytest.mark.skipif(HAS_GPU and torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_prefetch_never_starts_another_devices_reloads(device):
    """An unpack on cuda:1 prefetches only cuda:1's handles: cuda:0's would run from cuda:1's
    autograd thread, on cuda:0's default stream there."""
    ctx = co.offload(pool=co.HostPool(), min_bytes=0, prefetch_bytes=256 * MiB)
    ts = [torch.randn(1 << 18, device=f"cuda:{i % 2}") for i in range(6)]
    with ctx:
        handles = [ctx._packer.pack(t) for t in ts]
    with torch.cuda.device(1):
        assert torch.equal(ctx._packer.unpack(handles[5]), ts[5])  # on cuda:1
    assert ctx.stats()["prefetches"] == 2  # handles 3 and 1 (cuda:1), not 4, 2, 0
    for h, t in zip(handles[:5], ts[:5]):
        assert torch.equal(ctx._packer.unpack(h), t)


def test_unpacking_a_pool_held_tensor_during_graph_capture_raises(device):
    ctx = co.offload(pool=co.HostPool(), min_bytes=0)
    t = torch.randn(1 << 16, device=device)
    with ctx:
        h = ctx._packer.pack(t)
    assert h.offloaded
    torch.cuda.synchronize(device)
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="CUDA graph is being captured"):
        with torch.cuda.graph(g):
            ctx._packer.unpack(h)
    assert torch.equal(ctx._packer.unpack(h), t)  # outside the capture it reloads


def test_graph_capture_with_kept_tensors_and_pool_frees(device):
    """Tensors saved under capture stay on the device and unpack under it; a pool block freed
    during the capture (a dropped graph) queries no event, which would invalidate the capture."""
    ctx = co.offload(pool=co.HostPool(), min_bytes=0)
    with ctx:
        dropped = ctx._packer.pack(torch.randn(1 << 16, device=device))
    assert dropped.offloaded
    static = torch.randn(1 << 16, device=device)
    torch.cuda.synchronize(device)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        with ctx:
            kept = ctx._packer.pack(static * 3)
        assert not kept.offloaded
        out = ctx._packer.unpack(kept) + 1
        del dropped  # HostBuffer -> HostPool::free during capture
        gc.collect()
    assert ctx.stats()["kept_by_reason"]["cuda_graph_capture"] == 1
    static.copy_(torch.ones_like(static))
    g.replay()
    torch.cuda.synchronize(device)
    assert torch.equal(out, torch.full_like(static, 4.0))


def test_synchronize_does_not_stall_packs_on_other_threads(device):
    """co.synchronize() waits for the side streams without holding the lock every pack takes."""
    pool = co.HostPool()
    pool.reserve(64 * MiB)  # no cudaHostAlloc below
    ctx = co.offload(pool=pool, min_bytes=0)
    t = torch.randn(1 << 20, device=device)
    with ctx:
        _sleep(200 * 10_000_000)  # the compute stream is busy for a long while
        h = ctx._packer.pack(t * 1)  # its D2H copy waits behind the spin
    finished = threading.Event()

    def sync():
        co.synchronize()
        finished.set()

    th = threading.Thread(target=sync)
    th.start()
    time.sleep(0.2)  # let the thread enter its wait
    assert not finished.is_set()
    with ctx:
        h2 = ctx._packer.pack(torch.randn(1 << 16, device=device))  # looks up the side stream
    # The pack returned while synchronize was still waiting: it did not queue behind it.
    assert not finished.is_set()
    th.join()
    assert torch.equal(ctx._packer.unpack(h), t)
    del h2


def test_demand_reloads_run_on_their_own_stream(device):
    ctx = co.offload(pool=co.HostPool(), min_bytes=0, prefetch_bytes=3 * MiB)
    ts = [torch.randn(256, 1024, device=device) for _ in range(6)]  # 1 MiB each
    with ctx:
        handles = [ctx._packer.pack(t) for t in ts]
    torch.cuda.synchronize(device)
    co._C.profiler_start()
    try:
        ctx._packer.unpack(handles[5])  # on demand; prefetches 4, 3, 2
        got = ctx._packer.unpack(handles[0])  # not prefetched: on demand
        records = co._C.profiler_records()
    finally:
        co._C.profiler_stop()
    assert torch.equal(got, ts[0])
    h2d = [c for c in records["copies"] if c["kind"] == "h2d"]
    demand = {c["stream"] for c in h2d if not c["prefetch"]}
    prefetch = {c["stream"] for c in h2d if c["prefetch"]}
    assert demand and prefetch and demand.isdisjoint(prefetch)


def test_profiler_timing_epoch_is_taken_at_start(device):
    torch.ones(1, device=device)  # the device is in use
    before = time.monotonic_ns()  # CLOCK_MONOTONIC, as std::chrono::steady_clock on Linux
    co._C.profiler_start()
    after = time.monotonic_ns()
    try:
        epoch = co._C._timing_epoch_ns(device.index)
    finally:
        co._C.profiler_stop()
    assert before <= epoch <= after
