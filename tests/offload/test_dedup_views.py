"""Views of one storage whose spans overlap or interleave (strided, chunked, split, overlapping slices) are copied to
the host once, as one span covering their union, and reloaded into one storage (Note [One copy per storage],
csrc/torch/offloaded_storage.h): exact pool bytes, shared reloaded storages, bit-identical gradients."""

import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import (
    assert_bit_identical,
    cpu_offload,
    device_bytes_saved,
    grads_of,
    hypothesis_examples,
    run_a_backward,
)

import ckpt_offload as co

CELL = 512  # the pool's alignment: every block is rounded to it


def round_up(n, a=CELL):
    return (n + a - 1) // a * a


def cells(lo, hi, storage_bytes):
    """Bytes of the 512-byte cells of a storage that [lo, hi) touches, as the copies are widened to them."""
    return min(round_up(hi), storage_bytes) - lo // CELL * CELL


class Saves(torch.autograd.Function):
    """Saves x and the views through autograd; backward checks each view comes back with the same values, layout
    and storage offset (modulo 512 bytes, as documented), and records the reloaded storages' addresses."""

    storages = []

    @staticmethod
    def forward(ctx, x, *views):
        ctx.save_for_backward(x, *views)
        ctx.expected = [(v.clone(), v.size(), v.stride(), v.storage_offset()) for v in views]
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        _, *views = ctx.saved_tensors
        for got, (val, size, stride, offset) in zip(views, ctx.expected):
            per_cell = CELL // got.element_size()
            assert got.size() == size and got.stride() == stride
            assert got.storage_offset() % per_cell == offset % per_cell
            assert torch.equal(got, val)
        Saves.storages = [v.untyped_storage().data_ptr() for v in views]
        return (grad * 2,) + (None,) * len(views)


def save_views(pool, stream, views):
    """Saves `views` (in this order) with x (3 floats: one 512-byte block) in co.offload; returns the pool's bytes
    in use for the views after the forward, the stats, and the reloaded storages' addresses after backward."""
    x = torch.randn(3, requires_grad=True)
    with cpu_offload(pool, stream=stream) as ctx:
        y = Saves.apply(x, *views)
    co.synchronize()
    in_use = pool.stats()["bytes_in_use"] - CELL
    requested = pool.stats()["bytes_requested"] - 3 * 4
    Saves.storages = []
    y.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0))
    co.synchronize()
    assert pool.stats()["bytes_in_use"] == 0  # every block came back after backward
    return in_use, requested, ctx.stats(), Saves.storages


@pytest.mark.parametrize("order", ["even_first", "odd_first"])
def test_even_and_odd_elements_copied_once(pool, stream, order):
    base = torch.randn(32768)  # 131,072 bytes; x[::2] reaches [0, 131068), x[1::2] [4, 131072)
    views = [base[::2], base[1::2]]
    if order == "odd_first":
        views.reverse()
    in_use, requested, s, storages = save_views(pool, stream, views)
    assert in_use == 131072 and requested == 131072  # the storage's bytes, once (was 258,048)
    assert s["tensors_offloaded"] == 2 and s["tensors_deduplicated"] == 1  # x and the first view
    assert len(set(storages)) == 1  # reloaded into one storage, as the originals share one


@pytest.mark.parametrize("how", ["chunk", "split", "unbind_heads"])
def test_qkv_views_of_one_projection_copied_once(pool, stream, how):
    qkv = torch.randn(128, 192)  # 98,304 bytes: q, k, v of 64 features each
    if how == "chunk":
        views = list(qkv.chunk(3, dim=-1))
    elif how == "split":
        views = list(qkv.split(64, dim=-1))
    else:  # as attention reshapes them: (T, 3, H, D) -> three (H, T, D) views
        views = [t.transpose(0, 1) for t in qkv.view(128, 3, 4, 16).unbind(1)]
    in_use, requested, s, storages = save_views(pool, stream, views)
    assert in_use == 98304 and requested == 98304  # one storage's bytes (was 293,376)
    assert s["tensors_offloaded"] == 2 and s["tensors_deduplicated"] == 2
    assert len(set(storages)) == 1


def test_split_into_many_interleaved_views(pool, stream):
    base = torch.randn(40, 24 * 16)  # 61,440 bytes
    views = list(base.split(16, dim=1))  # 24 interleaved column blocks
    views = views[1::2] + views[0::2]  # packed in an order that grows the copy both ways
    in_use, requested, s, storages = save_views(pool, stream, views)
    assert in_use == requested == 61440
    assert s["tensors_deduplicated"] == 23
    assert len(set(storages)) == 1


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_overlapping_slices_in_either_order(pool, stream, order):
    base = torch.randn(1000)  # 4,000 bytes
    a, b = base[100:600], base[400:900]  # bytes [400, 2400) and [1600, 3600)
    in_use, requested, s, storages = save_views(pool, stream, [(a, b)[i] for i in order])
    assert requested == cells(400, 3600, 4000) == 4000  # the union's cells, once
    assert in_use == round_up(requested)
    assert s["tensors_deduplicated"] == 1 and len(set(storages)) == 1


def test_view_bridging_two_copies_merges_them(pool, stream):
    base = torch.randn(1000)
    # Two copies in disjoint cells, then a view that bridges them: the second copy's bytes move into the first
    # (not copied again), the gap between them is copied, and all three reload into one storage.
    views = [base[0:100], base[800:900], base[50:850]]
    in_use, requested, s, storages = save_views(pool, stream, views)
    assert requested == cells(0, 3600, 4000) and in_use == round_up(requested)
    assert s["tensors_offloaded"] == 3 and s["tensors_deduplicated"] == 1  # x, base[0:100], base[800:900]
    assert len(set(storages)) == 1


def test_views_in_disjoint_cells_stay_separate(pool, stream):
    """Chunks that share no 512-byte cell are separate copies, reloaded (and freed) separately in backward."""
    base = torch.randn(4, 256)  # rows of 1,024 bytes
    in_use, requested, s, storages = save_views(pool, stream, list(base.chunk(4, dim=0)))
    assert in_use == requested == 4096
    assert s["tensors_offloaded"] == 5 and s["tensors_deduplicated"] == 0
    assert len(set(storages)) == 4


def test_view_of_another_version_is_not_joined(pool):
    base = torch.randn(1000)
    x = torch.randn(3, requires_grad=True)
    with cpu_offload(pool) as ctx:
        y1 = Saves.apply(x, base[:600])
        base[900:].mul_(2)  # a new version of the storage: base[400:] holds other bytes now
        y2 = Saves.apply(x, base[400:])
    s = ctx.stats()
    assert s["tensors_offloaded"] == 3  # x, base[:600] and base[400:] at the new version
    y2.sum().backward()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y1.sum().backward()  # base[:600] was modified in place after it was saved
    run_a_backward()  # the engine keeps what a raising backward had queued until the next one


def test_view_extending_a_reloaded_copy_gets_its_own(pool, stream):
    """A copy that has been reloaded is sealed (its device storage cannot grow): a later view reaching past it is
    copied on its own, and both still come back right."""
    base = torch.randn(1000)
    x = torch.randn(3, requires_grad=True)
    with cpu_offload(pool, stream=stream) as ctx:
        y1 = Saves.apply(x, base[100:600])
        y1.sum().backward(retain_graph=True)  # reloads base[100:600]'s copy
        y2 = Saves.apply(x, base[400:900])
        s = ctx.stats()
        # x (saved twice: the second joins its copy), base[100:600], and base[400:900] on its own
        assert s["tensors_offloaded"] == 3 and s["tensors_deduplicated"] == 1
        y2.sum().backward()
        y1.sum().backward()
    co.synchronize()
    assert pool.stats()["bytes_in_use"] == 0


def test_reloaded_view_values_unchanged_by_later_growth(pool, stream):
    """A view saved first keeps its values and offset when later views grow its copy below and above it."""
    base = torch.randn(2000)
    middle = base[700:1300]
    in_use, requested, s, storages = save_views(pool, stream, [middle, base[300:900], base[1100:1900], base[::3]])
    assert requested == 8000 and in_use == round_up(8000) and s["tensors_deduplicated"] == 3 and len(set(storages)) == 1


def test_extension_refused_by_a_full_pool_keeps_the_view(stream):
    base = torch.randn(4096)  # 16 KiB
    small = co.HostPool(pinned=False, max_bytes=12 * 1024)
    x = torch.randn(3, requires_grad=True)
    with pytest.warns(UserWarning, match="at its cap"), cpu_offload(small, stream=stream) as ctx:
        y = Saves.apply(x, base[:2048], base[1024:])  # the second needs 8 KiB more than the cap allows
    s = ctx.stats()
    assert s["tensors_offloaded"] == 2 and s["kept_by_reason"]["pool_full"] == 1
    y.sum().backward()
    co.synchronize()
    assert small.stats()["bytes_in_use"] == 0


# Gradients: an attention block whose q, k, v are chunk(3) of one projection, and GPT-2.


class ChunkAttention(nn.Module):
    def __init__(self, dim=64, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # saves the q, k and v views
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


def distinct_saved_storage_bytes(model, loss_of):
    """Sum over the distinct storages autograd saves (parameters' left out) of their bytes rounded to the pool's
    alignment: what the pool may hold at most when each is copied once."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params and st.nbytes() > 0:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_of(model)
    return sum(round_up(n) for n in seen.values())


def compare_grads(model, loss_of, pool, stream):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    base_loss = loss_of(model)
    base_loss.backward()
    base = grads_of(model)
    bound = distinct_saved_storage_bytes(model, loss_of)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    ctx = cpu_offload(pool, stream=stream)
    with ctx:
        loss = loss_of(model)
    co.synchronize()
    in_use = pool.stats()["bytes_in_use"]
    loss.backward()
    assert torch.equal(base_loss, loss)
    assert_bit_identical(base, grads_of(model))
    co.synchronize()
    assert pool.stats()["bytes_in_use"] == 0
    # Each saved storage at most once (before: q, k and v each copied most of the projection's output).
    assert 0 < in_use <= bound, (in_use, bound)
    return ctx.stats()


def test_chunk_attention_grads_bit_identical(pool, stream):
    torch.manual_seed(5)
    model = ChunkAttention()
    x = torch.randn(2, 16, 64, requires_grad=True)
    s = compare_grads(model, lambda m: m(x).pow(2).mean(), pool, stream)
    assert s["tensors_deduplicated"] >= 2


def test_gpt2_grads_bit_identical(pool, stream):
    pytest.importorskip("transformers")
    from helpers import VOCAB, B, T, gpt2

    torch.manual_seed(6)
    model = gpt2()  # a tiny config: no download
    model.config.attn_pdrop = model.config.resid_pdrop = model.config.embd_pdrop = 0.0
    model.eval()  # no dropout: the same loss with and without offload
    tokens = torch.randint(0, VOCAB, (B, T))
    # On CPU, torch's flash kernel saves q as the view of c_attn's output and k, v as contiguous copies; the GPU
    # kernels save all three views (test_gpu.py). Here: the same gradients, and each saved storage at most once.
    compare_grads(model, lambda m: m(tokens, labels=tokens).loss, pool, stream)


# Property: any views of one storage, packed in any order.

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@st.composite
def views_of_one_storage(draw):
    n = draw(st.integers(16, 3000))
    base = torch.arange(n, dtype=torch.float32)
    views = []
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["slice", "chunk", "rows"]))
        if kind == "slice":
            start = draw(st.integers(0, n - 1))
            stop = draw(st.integers(start + 1, n))
            step = draw(st.integers(1, 9))
            views.append(base[start:stop:step])
        elif kind == "chunk":
            cols = draw(st.sampled_from([c for c in (2, 3, 4, 6, 8) if n % c == 0] or [1]))
            parts = base.view(n // cols, cols).chunk(draw(st.integers(1, cols)), dim=1)
            views.extend(draw(st.lists(st.sampled_from(parts), min_size=1, max_size=3)))
        else:
            rows = base[: n // 4 * 4].view(-1, 4)
            lo = draw(st.integers(0, rows.shape[0] - 1))
            views.append(rows[lo : draw(st.integers(lo + 1, rows.shape[0]))].t())
    order = draw(st.permutations(range(len(views))))
    return base, [views[i] for i in order]


@pytest.fixture(scope="module")
def shared_pool():
    """One pool for every example (a fresh 64 MiB segment each would dominate the time); each example checks that
    its bytes came back."""
    return co.HostPool(pinned=False, segment_bytes=1 << 20)


@settings(max_examples=hypothesis_examples(60))
@given(case=views_of_one_storage(), side=st.booleans())
def test_property_random_views_of_one_storage_copied_once(shared_pool, case, side):
    """Pool bytes at most the storage's (rounded as the pool rounds), values and layouts back exactly (Saves checks
    them), every block back after backward."""
    base, views = case
    pool = shared_pool
    in_use, requested, s, _ = save_views(pool, "side" if side else "compute", views)
    storage_bytes = base.untyped_storage().nbytes()
    assert in_use <= round_up(storage_bytes) and requested <= storage_bytes
    assert s["tensors_offloaded"] + s["tensors_deduplicated"] == len(views) + 1


# The other paths a joined copy goes through: prefetch, the disk tier, batching.


@pytest.mark.parametrize("prefetch_bytes", [0, 1 << 20])
def test_joined_copies_with_and_without_prefetch(pool, prefetch_bytes):
    """Two bridged copies and a grown one, each saved by its own node, so that backward prefetches the joined
    copies (an absorbed copy has nothing left to prefetch) before their unpacks."""
    base = torch.randn(4000)
    x = torch.randn(3, requires_grad=True)
    with cpu_offload(pool, prefetch_bytes=prefetch_bytes) as ctx:
        y = Saves.apply(x, base[0:100])
        y = Saves.apply(y, base[3000:3100])
        y = Saves.apply(y, base[50:3050])  # bridges the two copies above
        y = Saves.apply(y, base[1::2])  # grows the joined copy to the whole storage
        y = Saves.apply(y, torch.randn(1000))  # another storage in between
    co.synchronize()
    assert pool.stats()["bytes_in_use"] == 5 * CELL + round_up(4000) + round_up(16000)  # x, y..., the other, base once
    y.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 32.0))
    s = ctx.stats()
    assert s["tensors_reloaded"] == 1 + 1 + 5  # base's joined copy once, the other storage, x's five
    if prefetch_bytes:
        assert s["prefetches"] > 0
    co.synchronize()
    assert pool.stats()["bytes_in_use"] == 0


def test_joined_copy_spilled_to_disk(tmp_path, stream):
    """Pieces of one copy may land in the pool or on the disk tier; the reload reads each back."""
    spill = co.HostPool(pinned=False, max_bytes=8192, spill_dir=str(tmp_path), spill_file_bytes=1 << 20)
    base = torch.randn(8192)  # 32 KiB: most of it spills
    _, _, s, storages = save_views(spill, stream, [base[::2], base[1::2], base[100:5000]])
    assert s["tensors_offloaded"] == 2 and s["tensors_deduplicated"] == 2 and len(set(storages)) == 1
    assert s["bytes_spilled"] > 0


def test_batched_small_views_come_back_right(pool, stream):
    """A batch member cannot grow: an interleaved view of it gets a copy of its own (correct, not minimal)."""
    base = torch.randn(64, 6)
    views = list(base.chunk(3, dim=1))
    x = torch.randn(3, requires_grad=True)
    with cpu_offload(pool, stream=stream, batch_below=4096) as ctx:
        y = Saves.apply(x, *views)
    y.sum().backward()
    assert ctx.stats()["tensors_batched"] >= 3
    co.synchronize()
    assert pool.stats()["bytes_in_use"] == 0


def test_a_table_past_its_prune_size_still_finds_the_live_copies(pool):
    """Note [Flat copy table]: past 1024 storages in one activation the copy table is rebuilt from
    its live entries. The copies of storages still saved are found again (a later view of each
    joins its copy: no new bytes), those whose saved tensors died are dropped, and every view
    comes back with its values."""
    x = torch.randn(3, requires_grad=True)
    bases = [torch.randn(256) for _ in range(1500)]  # b[:128]: 512 bytes, one pool cell
    with cpu_offload(pool) as ctx:
        ys = [Saves.apply(x, b[:128]) for b in bases[:700]]
        dropped = [Saves.apply(x, b[:128]) for b in bases[700:1400]]
        del dropped  # their graphs die, and with them their copies
        ys += [Saves.apply(x, b[:128]) for b in bases[1400:]]  # the table passes 1024 entries here
        again = [Saves.apply(x, b[64:128]) for b in bases[:700]]  # inside each first copy
        co.synchronize()
        in_use = pool.stats()["bytes_in_use"]
    assert in_use == CELL * (1 + 800)  # x, and the 800 bases still saved; `again` added nothing
    s = ctx.stats()
    assert s["tensors_offloaded"] == 1 + 1500
    assert s["tensors_deduplicated"] == (2200 - 1) + 700  # x after its first save, and `again`
    sum(y.sum() for y in ys + again).backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0 * (800 + 700)))
    del ys, again
    assert pool.stats()["bytes_in_use"] == 0


class SavesTwice(torch.autograd.Function):
    """Saves w twice and w.t() once (three saved tensors of one host copy); backward records what each
    unpack gave."""

    seen = []

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(w, w, w.t())
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        SavesTwice.seen = list(ctx.saved_tensors)
        return grad * 2, None


@pytest.mark.parametrize("retain", [False, True])
def test_a_tensor_saved_twice_unpacks_to_one_tensor(pool, stream, retain, device):
    # Note [Same view, same tensor]: the second unpack of an identical view gets the tensor the first
    # made, as autograd without hooks hands each node the saved tensor itself; another view of the
    # same copy gets a tensor of its own over the same reload, sharing its version counter (Note [One
    # version per device copy]). Nothing is held once all have unpacked. A second backward
    # (retain_graph) reloads once more and shares the reload, not the tensor.
    x, w = torch.randn(3, device=device, requires_grad=True), torch.randn(8, 8, device=device)
    with co.offload(pool=pool, stream=stream, devices=[device], min_bytes=0) as ctx:
        y = SavesTwice.apply(x, w)
    for second in [False, True] if retain else [False]:
        y.sum().backward(retain_graph=retain)
        a, b, c = SavesTwice.seen
        assert (a is b) != second and c is not a
        assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() == c.untyped_storage().data_ptr()
        assert torch.equal(a, w) and torch.equal(b, w) and torch.equal(c, w.t()) and c.stride() == w.t().stride()
        before = (a._version, b._version, c._version)
        a.add_(0)  # a write through one is one write for all (it happens after every unpack: no error)
        assert (a._version, b._version, c._version) == tuple(v + 1 for v in before)
        gone = weakref.ref(a)
        SavesTwice.seen = []
        del a, b, c
        assert gone() is None  # neither the copy nor the graph holds the unpacked tensor
    assert torch.equal(x.grad, torch.full_like(x, 4.0 if retain else 2.0))
    s = ctx.stats()
    assert (s["tensors_offloaded"], s["tensors_deduplicated"]) == (1, 2)
    assert (s["tensors_reloaded"], s["tensors_reload_shared"]) == ((2, 4) if retain else (1, 2))
    del y
    co.synchronize()
    assert pool.stats()["bytes_in_use"] == 0 and device_bytes_saved() == 0
