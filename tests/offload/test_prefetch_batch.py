"""Prefetch in backward and batched small copies, on the engine's CPU path.

The CPU side streams are worker threads with a delay before every copy (conftest), so a
prefetched reload really is in flight when its unpack comes, and the bookkeeping (pack order,
byte budget, any unpack order, unused prefetches, batch flush and scatter) runs as on a GPU.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn as nn
from conftest import TEST_DELAY_US, assert_bit_identical, cpu_offload, grads_of
from helpers import train_step
from models_for_tests import Chain  # 512 x 512 float32: 1 MiB per saved activation

import ckpt_offload as co

MiB = 1 << 20


_run = train_step


def _inputs(seed=0, rows=512, width=512):
    torch.manual_seed(seed)
    return torch.randn(rows, width)


def test_prefetch_gradients_bit_identical_and_prefetches_happen(pool):
    torch.manual_seed(0)
    model, x = Chain(), _inputs()
    ref, _ = _run(model, x)
    ctx = cpu_offload(pool, prefetch_bytes=64 * MiB)
    got, _ = _run(model, x, ctx)
    assert_bit_identical(ref, got)
    s = ctx.stats()
    assert s["tensors_offloaded"] >= 8
    assert s["prefetches"] > 0
    # Every reload is either a prefetch that was used or an on-demand copy; none went unused.
    assert s["prefetch_hits"] == s["prefetches"]
    assert s["prefetches_unused"] == 0
    assert s["tensors_reloaded"] == s["tensors_offloaded"]
    co.synchronize()
    assert pool.stats()["bytes_in_use"] == 0


def test_prefetch_follows_reverse_pack_order(pool):
    torch.manual_seed(0)
    model, x = Chain(n=6), _inputs()
    ctx = cpu_offload(pool, prefetch_bytes=64 * MiB)
    with co.profile() as prof:
        _run(model, x, ctx)
    records = prof.to_dict()["records"]
    d2h = [c["handle"] for c in records["copies"] if c["kind"] == "d2h"]
    h2d = [(c["handle"], c["prefetch"]) for c in records["copies"] if c["kind"] == "h2d"]
    assert sorted(h for h, _ in h2d) == sorted(d2h), "one reload per offloaded storage"
    # Backward asks for the last packed first; everything after it was prefetched, and in the
    # reverse of the pack order.
    assert h2d[0] == (d2h[-1], False)
    assert [h for h, _ in h2d] == list(reversed(d2h))
    assert all(p for _, p in h2d[1:])


def test_prefetch_budget_bounds_waiting_bytes(pool):
    torch.manual_seed(0)
    model, x = Chain(n=8), _inputs()
    one = 512 * 512 * 4
    ref, _ = _run(model, x)
    ctx = cpu_offload(pool, prefetch_bytes=2 * one)
    got, _ = _run(model, x, ctx)
    assert_bit_identical(ref, got)
    s = ctx.stats()
    assert 0 < s["peak_prefetch_bytes"] <= 2 * one
    # A budget smaller than any tensor prefetches nothing.
    small = cpu_offload(co.HostPool(pinned=False), prefetch_bytes=one - 1)
    got, _ = _run(model, x, small)
    assert_bit_identical(ref, got)
    assert small.stats()["prefetches"] == 0


@pytest.mark.parametrize("options", [{"prefetch_bytes": 0}, {"stream": "compute"}])
def test_no_prefetch_when_off_or_on_the_compute_stream(pool, options):
    torch.manual_seed(0)
    model, x = Chain(n=4), _inputs()
    ref, _ = _run(model, x)
    ctx = cpu_offload(pool, **options)
    got, _ = _run(model, x, ctx)
    assert_bit_identical(ref, got)
    assert ctx.stats()["prefetches"] == 0


def test_any_unpack_order_and_unpacking_twice(pool):
    ctx = cpu_offload(pool, prefetch_bytes=3 * MiB)
    tensors = [torch.randn(256, 1024) + i for i in range(12)]
    baseline_saved = co._C.device_bytes_saved()
    with ctx:
        handles = [ctx._packer.pack(t) for t in tensors]
    order = list(range(12))
    random.Random(0).shuffle(order)
    for i in order + order[:5]:
        got = ctx._packer.unpack(handles[i])
        assert torch.equal(got, tensors[i]), i
    s = ctx.stats()
    assert s["prefetches"] > 0 and s["peak_prefetch_bytes"] <= 3 * MiB
    del handles, got
    co.synchronize()
    assert pool.stats()["bytes_in_use"] == 0
    assert co._C.device_bytes_saved() == baseline_saved


def test_unused_prefetches_are_released_after_their_copy(pool):
    ctx = cpu_offload(pool, prefetch_bytes=64 * MiB)
    tensors = [torch.randn(256, 1024) for _ in range(6)]
    with ctx:
        handles = [ctx._packer.pack(t) for t in tensors]
    assert torch.equal(ctx._packer.unpack(handles[-1]), tensors[-1])  # prefetches the other five
    assert ctx.stats()["prefetches"] == 5
    del handles  # the graph is dropped before backward got to them
    co.synchronize()
    s = ctx.stats()
    assert s["prefetches_unused"] == 5 and s["prefetch_hits"] == 0
    assert pool.stats()["bytes_in_use"] == 0


def test_branches_and_retain_graph_with_prefetch(pool):
    torch.manual_seed(0)
    a, b = Chain(n=3), Chain(n=3)
    x = _inputs()

    def step(ctx=None):
        for m in (a, b):
            m.zero_grad(set_to_none=True)
        with ctx if ctx is not None else torch.enable_grad():
            y = a(x) * b(x.flip(0))
        loss = y.sum()
        loss.backward(retain_graph=True)
        first = {**grads_of(a), **{"b." + k: v for k, v in grads_of(b).items()}}
        loss.backward()
        second = {**grads_of(a), **{"b." + k: v for k, v in grads_of(b).items()}}
        return first, second

    ref = step()
    ctx = cpu_offload(pool, prefetch_bytes=64 * MiB)
    got = step(ctx)
    assert_bit_identical(ref[0], got[0])
    assert_bit_identical(ref[1], got[1])
    co.synchronize()
    assert pool.stats()["bytes_in_use"] == 0


# ---- batching --------------------------------------------------------------------------------


class Small(nn.Module):
    """Many small saved tensors (a few KiB each), some of them views of one storage."""

    def __init__(self, n=6, width=64):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            h = layer(x)
            a, b = h.chunk(2, dim=-1)  # views at an offset of one storage
            x = torch.cat([torch.sigmoid(a) * b, torch.tanh(b)], dim=-1) + x
        return x


@pytest.mark.parametrize("stream", ["side", "compute"])
def test_batched_small_tensors_bit_identical(pool, stream):
    torch.manual_seed(0)
    model, x = Small(), torch.randn(32, 64)
    ref, _ = _run(model, x)
    ctx = cpu_offload(pool, stream=stream, batch_below=16 * 1024, batch_bytes=32 * 1024)
    with co.profile() as prof:
        got, _ = _run(model, x, ctx)
    assert_bit_identical(ref, got)
    s = ctx.stats()
    assert s["tensors_batched"] == s["tensors_offloaded"] > 10
    assert 1 < s["batches"] < s["tensors_batched"], "several tensors per copy, several copies (32 KiB blocks)"
    copies = prof.to_dict()["records"]["copies"]
    d2h = [c for c in copies if c["kind"] == "d2h"]
    assert len(d2h) == s["batches"]
    assert sum(c["members"] for c in d2h) == s["tensors_batched"]
    co.synchronize()
    assert pool.stats()["bytes_in_use"] == 0


def test_batch_member_unpacked_before_the_context_exits(pool):
    ctx = cpu_offload(pool, batch_below=MiB)
    xs = [torch.randn(100 + i, 7) for i in range(5)]
    with ctx:
        handles = [ctx._packer.pack(t) for t in xs]
        # Still inside: the batch is open; unpacking a member copies it out first.
        assert torch.equal(ctx._packer.unpack(handles[2]), xs[2])
    for h, t in zip(handles, xs):
        assert torch.equal(ctx._packer.unpack(h), t)
    assert ctx.stats()["batches"] == 1


def test_batched_views_keep_layout_and_dedup(pool):
    ctx = cpu_offload(pool, batch_below=MiB)
    base = torch.randn(64, 33)
    views = [base.t(), base[1:, 3:], base[5], base[::2, ::3]]  # the first spans the storage
    with ctx:
        handles = [ctx._packer.pack(v) for v in views]
    s = ctx.stats()
    assert s["tensors_offloaded"] == 1 and s["tensors_deduplicated"] == 3
    for h, v in zip(handles, views):
        got = ctx._packer.unpack(h)
        assert got.shape == v.shape and got.stride() == v.stride()
        assert torch.equal(got, v)


def test_batch_with_a_full_pool_keeps_tensors_on_the_device():
    torch.manual_seed(0)
    model, x = Small(), torch.randn(32, 64)
    ref, _ = _run(model, x)
    tiny = co.HostPool(pinned=False, max_bytes=4096, segment_bytes=4096)
    ctx = cpu_offload(tiny, batch_below=16 * 1024, batch_bytes=32 * 1024)
    got, _ = _run(model, x, ctx)
    assert_bit_identical(ref, got)
    s = ctx.stats()
    assert s["kept_by_reason"].get("pool_full", 0) > 0
    assert s["tensors_offloaded"] + s["kept_by_reason"]["pool_full"] >= 10
    strict = cpu_offload(
        co.HostPool(pinned=False, max_bytes=4096, segment_bytes=4096), batch_below=64 * 1024, on_full="raise"
    )
    with pytest.raises(co.PoolFullError, match="batch of .* small saved tensors"), strict:
        model(x)


def test_batch_options_are_checked():
    with pytest.raises(ValueError, match="batch_below"):
        co.offload(devices=["cpu"], batch_below=8 * MiB, batch_bytes=MiB)
    with pytest.raises(ValueError, match="prefetch_bytes"):
        co.offload(devices=["cpu"], prefetch_bytes=-1)
    with pytest.raises(TypeError, match="unknown co.offload option"):
        co.checkpoint(lambda t: t, torch.ones(1, requires_grad=True), offload={"prefetch": 1})


def test_checkpoint_passes_prefetch_and_batch_options(pool):
    torch.manual_seed(0)
    model, x = Chain(n=4), _inputs().requires_grad_()

    def fwd(opts):
        model.zero_grad(set_to_none=True)
        h = x
        for layer in model.layers:
            h = co.checkpoint(lambda t, layer=layer: torch.tanh(layer(t)), h, offload=opts)
        h.sum().backward()
        return grads_of(model)

    ref = fwd(False)
    opts = {"devices": ["cpu"], "min_bytes": 0, "pool": pool, "prefetch_bytes": 64 * MiB, "batch_below": 4096}
    assert_bit_identical(ref, fwd(opts))
    co.synchronize()
    assert pool.stats()["bytes_in_use"] == 0


# ---- the gather/scatter plan -----------------------------------------------------------------


def test_chunk_plan_copies_like_plain_copies():
    """The kernel's index computation (csrc/core/batch_plan.h), run on the host: sizes around
    the chunk size, empty copies, odd alignments, more copies than one launch holds."""
    chunk = co._C.BATCH_CHUNK_BYTES
    rng = random.Random(1)
    sizes = [0, 1, 15, 16, 17, chunk - 1, chunk, chunk + 1, 3 * chunk + 5] + [
        rng.randrange(0, 3 * chunk) for _ in range(80)
    ]
    src = torch.randint(0, 256, (sum(sizes) + 4096,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    segs, expected, offset = [], torch.zeros_like(src), 0
    for i, n in enumerate(sizes):
        s_off = offset + (i % 7)  # misaligned sources
        d_off = offset + (i % 13)  # and destinations, differently
        segs.append((dst.data_ptr() + d_off, src.data_ptr() + s_off, n))
        expected[d_off : d_off + n] = src[s_off : s_off + n]
        offset += n + 16
    co._C.testing.copy_batch_on_host(segs)
    assert torch.equal(dst, expected)


# ---- pool backends -----------------------------------------------------------------------------


def test_backend_argument_is_checked():
    with pytest.raises(ValueError, match="backend"):
        co.HostPool(backend="cuda")
    with pytest.raises(ValueError, match="contradicts"):
        co.HostPool(pinned=False, backend="registered")
    assert co.HostPool(backend="pageable").backend == "pageable"
    if not co.pool.pinned_available():
        with pytest.raises(ValueError, match="registered.*pageable"):
            co.HostPool(backend="registered")


# ---- torch.profiler integration ----------------------------------------------------------------


def test_copies_are_named_ranges_in_torch_profiler(pool):
    torch.manual_seed(0)
    model, x = Chain(n=4), _inputs()
    ctx = cpu_offload(pool, prefetch_bytes=64 * MiB)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _run(model, x, ctx)
    names = {e.key for e in prof.key_averages()}
    assert {"ckpt_offload::offload", "ckpt_offload::reload", "ckpt_offload::prefetch"} <= names
    batched = cpu_offload(co.HostPool(pinned=False), batch_below=MiB)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _run(Small(), torch.randn(8, 64), batched)
    names = {e.key for e in prof.key_averages()}
    assert {"ckpt_offload::offload_batch", "ckpt_offload::reload_batch"} <= names


@pytest.mark.parametrize("batch_below", [0, 2 * MiB])
def test_a_failing_prefetch_does_not_fail_backward(pool, batch_below):
    """Prefetch is an optimization: when it raises (out of device memory on a GPU), backward
    goes on and reloads on demand."""
    torch.manual_seed(0)
    model, x = Chain(n=6), _inputs()
    ref, _ = _run(model, x)
    ctx = cpu_offload(pool, prefetch_bytes=64 * MiB, batch_below=batch_below, batch_bytes=4 * MiB)
    co._C.testing.fail_next_prefetches(2)
    try:
        got, _ = _run(model, x, ctx)
    finally:
        co._C.testing.fail_next_prefetches(0)
    assert_bit_identical(ref, got)
    s = ctx.stats()
    assert s["prefetch_failures"] == 2
    assert (s["batches"] > 0) == bool(batch_below)
    co.synchronize()
    assert pool.stats()["bytes_in_use"] == 0


# ---- what a backward leaves behind, and demand reloads -------------------------------------------


def test_unused_prefetches_are_released_when_their_backward_ends(pool):
    """A backward prefetches the handles packed before the ones it unpacks, also those of another
    graph it never uses. They are let go when that backward ends, not when the other graph dies."""
    torch.manual_seed(0)
    a, b = Chain(n=2), Chain(n=3)
    x = _inputs()
    ref_a, _ = _run(a, x)
    b.zero_grad(set_to_none=True)
    b(x).sum().backward()
    ref_b = grads_of(b)
    for m in (a, b):
        m.zero_grad(set_to_none=True)

    ctx = cpu_offload(pool, prefetch_bytes=64 * MiB)
    with ctx:
        yb = b(x)  # packed first: a's backward walks down into b's handles
        ya = a(x)
    co.synchronize()  # the forward's sources are let go: what is counted now is stable
    before = co._C.device_bytes_saved()
    (ya * ya).sum().backward()
    s = ctx.stats()
    unused = s["prefetches"] - s["prefetch_hits"]
    assert unused > 0  # b's handles were prefetched and a's backward did not take them
    # Dropped at the end of a's backward, while b's graph is still alive.
    assert s["prefetches_unused"] == unused
    assert co._C.device_bytes_saved() <= before  # b's prefetched reloads are not held any more
    assert_bit_identical(ref_a, grads_of(a))
    yb.sum().backward()  # b's tensors come back on demand (or prefetched again)
    assert_bit_identical(ref_b, grads_of(b))
    co.synchronize()
    assert pool.stats()["bytes_in_use"] == 0


def test_a_batched_small_view_does_not_hold_its_whole_activation(pool):
    """A batch member is copied out of a storage much larger than itself, so the batch does not
    keep the whole activation alive until it flushes."""
    from torch.multiprocessing.reductions import StorageWeakRef

    w = torch.randn(16, requires_grad=True)
    ctx = cpu_offload(pool, batch_below=64 * 1024)
    with ctx:
        big = torch.randn(1 << 20)  # 4 MiB
        view = big[100:116]
        expected = view.clone()
        y = view * w  # saves `view` (for w's gradient): 64 bytes, batched
        watch = StorageWeakRef(big.untyped_storage())
        del big, view
        assert watch.expired()  # the batch is still open here: it holds 64 bytes, not 4 MiB
    assert ctx.stats()["tensors_batched"] == 1
    y.sum().backward()
    assert torch.equal(w.grad, expected)


def test_batched_tensors_kept_on_a_full_pool_unpack_twice():
    """With batching and a full pool, the members' device copies are their only copy:
    retain_graph=True and a second backward must find them again."""
    torch.manual_seed(0)
    model, x = Small(), torch.randn(32, 64)

    def twice(ctx=None):
        model.zero_grad(set_to_none=True)
        with ctx if ctx is not None else torch.enable_grad():
            y = model(x)
        loss = (y * y).sum()
        loss.backward(retain_graph=True)
        first = grads_of(model)
        loss.backward()
        return first, grads_of(model)

    ref = twice()
    tiny = co.HostPool(pinned=False, max_bytes=4096, segment_bytes=4096)
    ctx = cpu_offload(tiny, batch_below=16 * 1024, batch_bytes=32 * 1024)
    got = twice(ctx)
    assert ctx.stats()["kept_by_reason"].get("pool_full", 0) > 0
    assert_bit_identical(ref[0], got[0])
    assert_bit_identical(ref[1], got[1])


def test_pool_releases_at_the_cap_wait_for_the_end_of_backward():
    """Growing a capped pool takes its wholly free segments off the pool without releasing them
    in forward (cudaFreeHost synchronizes the device, under the pool lock); the end of backward
    gives them back."""
    pool = co.HostPool(pinned=False, max_bytes=4 * MiB, segment_bytes=1 * MiB)
    ctx = cpu_offload(pool)
    with ctx:
        handles = [ctx._packer.pack(torch.randn(256, 1024)) for _ in range(4)]  # 4 segments of 1 MiB
    del handles
    co.synchronize()
    s = pool.stats()
    assert s["bytes_reserved"] == 4 * MiB and s["bytes_in_use"] == 0
    frees = s["num_backend_frees"]
    x = torch.randn(512, 1024, requires_grad=True)
    with ctx:
        y = x.sin()  # saves x: 2 MiB, which no free 1 MiB segment holds
    s = pool.stats()
    assert ctx.stats()["tensors_offloaded"] == 5
    assert s["num_backend_frees"] == frees  # nothing released in forward
    assert s["bytes_retired"] == 4 * MiB
    y.sum().backward()
    s = pool.stats()
    assert s["bytes_retired"] == 0
    assert s["num_backend_frees"] == frees + 4
    assert torch.equal(x.grad, x.detach().cos())


def test_demand_reload_does_not_wait_behind_prefetches(pool):
    """An unpack that was not prefetched reloads on a stream of its own: it does not queue behind
    the prefetches in flight (order of completion, from the profiler's copy records)."""
    ctx = cpu_offload(pool, prefetch_bytes=3 * MiB)
    tensors = [torch.randn(256, 1024) for _ in range(6)]  # 1 MiB each
    with ctx:
        handles = [ctx._packer.pack(t) for t in tensors]
    co.synchronize()
    co._C.testing.set_cpu_copy_delay_us(20_000)  # every copy waits 20 ms on its worker stream
    co._C.profiler_start()
    try:
        assert torch.equal(ctx._packer.unpack(handles[5]), tensors[5])  # prefetches 4, 3, 2
        assert torch.equal(ctx._packer.unpack(handles[0]), tensors[0])  # not prefetched: on demand
        records = co._C.profiler_records()
    finally:
        co._C.profiler_stop()
        co._C.testing.set_cpu_copy_delay_us(TEST_DELAY_US)
    h2d = [c for c in records["copies"] if c["kind"] == "h2d"]
    prefetches = [c for c in h2d if c["prefetch"]]
    demand = [c for c in h2d if not c["prefetch"]]
    assert len(prefetches) == 3 and len(demand) == 2
    last_demand = max(demand, key=lambda c: c["start_us"])
    assert last_demand["end_us"] < max(c["end_us"] for c in prefetches)
    assert {c["stream"] for c in demand}.isdisjoint({c["stream"] for c in prefetches})


@pytest.mark.parametrize("stream", ["side", "compute"])
def test_a_batch_flushed_by_an_unpack_into_a_full_pool_still_unpacks(stream):
    """Double backward inside the context: the first unpack flushes the open batch, and the pool
    at its cap refuses it. Its members stay on the device, and that unpack (and the second
    backward's) returns them instead of looking for a reload that was never made."""
    pool = co.HostPool(pinned=False, max_bytes=4096)
    with cpu_offload(pool):
        a = torch.randn(1024, requires_grad=True)
        held = (a * 2).exp()  # exp saves its 4096-byte result: the pool is at its cap
    assert pool.stats()["bytes_in_use"] == 4096

    def run(ctx):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0)).requires_grad_()
        with ctx if ctx is not None else torch.enable_grad():
            y = torch.tanh(x)
            (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
            (g * g).sum().backward()
        return [x.grad]

    ref = run(None)
    ctx = cpu_offload(pool, stream=stream, prefetch_bytes=0, batch_below=512, batch_bytes=65536)
    got = run(ctx)
    assert torch.equal(ref[0], got[0])
    s = ctx.stats()
    assert s["kept_by_reason"]["pool_full"] > 0 and s["tensors_offloaded"] == 0, s
    del held
