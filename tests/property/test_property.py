"""Property-based tests (hypothesis): random autograd graphs and random checkpointed models give
bit-identical gradients with ckpt_offload and without it; random plans and co.apply options on
blocks that return tuples, write their inputs or a matmul's output in place, or hold running
statistics never change a loss, a gradient or a module's state (or are refused with a clear
error); and a random sequence of HostPool operations keeps the pool's accounting exact.

CI runs the derandomized "ci" profile (tests/conftest.py); CKPT_OFFLOAD_HYPOTHESIS_PROFILE=thorough
draws ten times as many fresh examples. A failure prints the smallest example hypothesis found
and an @reproduce_failure line to replay it.
"""

from __future__ import annotations

import gc
import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

pytest.importorskip("hypothesis")  # installed by scripts/dev.sh; CI has it

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, multiple, rule  # noqa: E402

import ckpt_offload as co  # noqa: E402
from ckpt_offload.pool import MIN_MAX_BYTES  # noqa: E402
from conftest import cpu_offload, hypothesis_examples, nonzero, run_a_backward  # noqa: E402

DTYPES = (torch.float32, torch.bfloat16, torch.float64)
# Gradients are compared as raw bits: NaN and -0.0 included, nothing is "close enough".
_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float64: torch.int64}


def assert_same_bits(ref: list, got: list, what: str):
    assert len(ref) == len(got)
    for i, (a, b) in enumerate(zip(ref, got)):
        assert (a is None) == (b is None), f"{what} {i}: gradient present in one run only"
        if a is None:
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what} {i}"
        assert torch.equal(a.view(_BITS[a.dtype]), b.view(_BITS[b.dtype])), f"{what} {i}: gradient bits differ"


@pytest.fixture(scope="module")
def shared_pool():
    """One pool for every example (a fresh 64 MiB segment per example would dominate the time);
    each example checks that the bytes it used came back. Pageable, and passed to every example
    that offloads: the default pool is pinned on a GPU machine, where the examples would otherwise
    pin host memory (and start a CUDA context) to test the same CPU path."""
    return co.HostPool(pinned=False, segment_bytes=1 << 20)


def _settle():
    co.synchronize()
    co._C.poll()


def _assert_drained(pool, start: int):
    """The example gave back every byte it took from ``pool`` (a graph held only by a reference
    cycle, an exception's traceback, is collected first, and after a backward that raised the
    nodes torch's engine still holds are released by another backward)."""
    _settle()
    if pool.stats()["bytes_in_use"] != start:
        gc.collect()
        run_a_backward()
        _settle()
    assert pool.stats()["bytes_in_use"] == start, "a block outlived its graph"


# --- random autograd graphs -----------------------------------------------------------------

# One step of a graph: (name, i, j, p, q). i and j pick operands among the values made so far
# (modulo their number), p and q parametrize the op; all are plain integers so that hypothesis
# shrinks a failure to a short program with small numbers.
OPS = (
    "unary",
    "mul",
    "matmul",
    "t",
    "slice",
    "expand",
    "as_strided",
    "inplace",
    "dropout",
    "conv",
    "linear",
    "softmax",
    "cat",
)
_op = st.tuples(st.sampled_from(OPS), st.integers(0, 63), st.integers(0, 63), st.integers(0, 63), st.integers(0, 63))
_UNARY = (torch.tanh, torch.sigmoid, torch.sin, torch.relu, F.gelu, lambda x: x * x, F.silu)


@dataclass
class Graph:
    dtype: torch.dtype
    shapes: list
    ops: list
    outputs: list
    seed: int


@st.composite
def graphs(draw):
    n_inputs = draw(st.integers(1, 3))
    return Graph(
        dtype=draw(st.sampled_from(DTYPES)),
        shapes=[(draw(st.integers(1, 6)), draw(st.integers(1, 6))) for _ in range(n_inputs)],
        ops=draw(st.lists(_op, min_size=1, max_size=10)),
        outputs=draw(st.lists(st.integers(0, 63), min_size=0, max_size=2)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _leaves(g: Graph):
    """The graph's leaves, made afresh from its seed for each run: inputs, conv weights (plain
    tensors, offloaded), a Parameter (kept: nn.Linear-style weight views are recognised)."""
    gen = torch.Generator().manual_seed(g.seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(g.dtype)

    inputs = [randn(*s).requires_grad_() for s in g.shapes]
    conv_w = [randn(2, 1, k, k).requires_grad_() for k in (1, 2, 3)]
    weight = nn.Parameter(randn(5, 6))
    return inputs, conv_w, weight, gen


def _forward(g: Graph, inputs, conv_w, weight):
    torch.manual_seed(g.seed)  # dropout draws the same masks in both runs
    values = list(inputs)
    for name, i, j, p, q in g.ops:
        a, b = values[i % len(values)], values[j % len(values)]
        m, n = a.shape
        if name == "unary":
            v = _UNARY[p % len(_UNARY)](a)
        elif name == "mul":  # slices of both operands (views with storage offsets) are saved
            r, c = min(m, b.shape[0]), min(n, b.shape[1])
            v = a[m - r :, :c] * b[:r, b.shape[1] - c :]
        elif name == "matmul":
            k = min(n, b.shape[0])
            v = a[:, :k] @ b[:k, :]
        elif name == "t":
            v = a.t()
        elif name == "slice":
            v = a[p % m :, q % n :: 1 + (p + q) % 2]
        elif name == "expand":  # a stride-0 view; whatever saves it saves the expanded tensor
            v = a[:, :1].expand(-1, 1 + q % 6) if p % 2 else a[:1].expand(1 + q % 6, -1)
        elif name == "as_strided":  # possibly overlapping windows over a fresh storage
            base = a * 1.5
            numel = base.numel()
            off, s0, s1 = p % numel, q % 3, 1 + (q // 3) % 2
            rows, cols = 1 + p % 4, 1 + q % 4
            while off + (rows - 1) * s0 + (cols - 1) * s1 >= numel:
                if rows > 1:
                    rows -= 1
                elif cols > 1:
                    cols -= 1
                else:
                    off = 0
            v = base.as_strided((rows, cols), (s0, s1), off)
        elif name == "inplace":  # in-place ops on a tensor nothing has saved yet
            v = a + 0.0
            target = v[: 1 + q % m] if p % 2 else v
            kind = (p // 2) % 4
            if kind == 0:
                target.mul_(0.5)
            elif kind == 1:
                target.add_(0.25)
            elif kind == 2:
                target.relu_()  # saves its result, which is then not modified again
            else:
                target.sigmoid_()
        elif name == "dropout":
            v = F.dropout(a, p=0.25 + 0.25 * (p % 2), training=True)
        elif name == "conv":
            k = 1 + p % min(3, m + 2, n + 2)
            pad = 1 if (k > min(m, n) or q % 2) else 0
            if k > min(m, n) + 2 * pad:
                k = 1
            out = F.conv2d(a[None, None], conv_w[k - 1], padding=pad)
            v = out.reshape(-1, out.shape[-1])
        elif name == "linear":
            k = min(n, 6)
            v = F.linear(a[:, :k], weight[:, :k])  # saves a view of a Parameter: kept
        elif name == "softmax":
            v = a.softmax(dim=p % 2)
        else:  # cat along rows, columns cropped to match
            c = min(n, b.shape[1])
            v = torch.cat([a[:, :c], b[:, :c]])
        values.append(v)
    outs = [values[-1]] + [values[k % len(values)] for k in g.outputs]
    return [o for o in outs if o.requires_grad]


def _grads(g: Graph, ctx_factory, double: bool = False):
    inputs, conv_w, weight, gen = _leaves(g)
    leaves = inputs + conv_w + [weight]
    with ctx_factory() as ctx:
        outs = _forward(g, inputs, conv_w, weight)
        # Non-scalar backward of several outputs (possibly the same tensor twice).
        grad_outs = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype) for o in outs]
        if double and outs:
            # Double backward inside the context: the first unpacks come while small tensors'
            # batch is still open (the unpack flushes it), and the gradient graph's own saved
            # tensors are packed in backward; then the backward of a function of the gradients.
            firsts = torch.autograd.grad(outs, leaves, grad_outs, create_graph=True, allow_unused=True)
            second = [(f * f).sum() for f in firsts if f is not None and f.requires_grad]
            if second:
                torch.autograd.backward(second)
    if not double:
        torch.autograd.backward(outs, grad_tensors=grad_outs)
    return [x.grad for x in leaves], ctx


class _NoHooks:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


_configs = st.fixed_dictionaries(
    {
        "stream": st.sampled_from(("side", "compute")),
        "prefetch_bytes": st.sampled_from((0, 1 << 20)),
        "batch_below": st.sampled_from((0, 512, 4096)),
        "batch_bytes": st.sampled_from((8192, 65536)),
    }
)
# The pool: the shared one (no cap), or one at a one-page cap with this many bytes still free
# (the rest held by another graph), so that copies and batch flushes are refused.
_free = st.sampled_from((None, None, 0, 512, 2048, 4096))


def _capped_pool(free: int):
    pool = co.HostPool(pinned=False, max_bytes=MIN_MAX_BYTES)
    held = None
    if free < MIN_MAX_BYTES:
        with cpu_offload(pool):
            a = torch.zeros((MIN_MAX_BYTES - free) // 4, requires_grad=True)
            held = (a * 2).exp()  # exp saves its result: the pool holds it until `held` goes
    return pool, held


@pytest.mark.filterwarnings("ignore:.*the host pool is at its cap:UserWarning")  # the capped pools
@settings(max_examples=hypothesis_examples(1000))
@given(g=graphs(), cfg=_configs, double=st.booleans(), free=_free)
def test_random_graph_gradients_are_bit_identical(g, cfg, double, free, shared_pool):
    pool, held = (shared_pool, None) if free is None else _capped_pool(free)
    start = pool.stats()["bytes_in_use"]
    ref, _ = _grads(g, _NoHooks, double)
    got, ctx = _grads(g, lambda: cpu_offload(pool, **cfg), double)
    assert_same_bits(ref, got, "leaf")
    s = ctx.stats()
    # Everything but the Parameter was offloaded (or, at the cap, kept as pool_full): nothing
    # kept for size, layout or device.
    allowed = {"parameter"} if free is None else {"parameter", "pool_full"}
    assert set(nonzero(s["kept_by_reason"])) <= allowed, s["kept_by_reason"]
    del ctx
    _settle()
    assert pool.stats()["bytes_in_use"] == start, "a block outlived its graph"
    del held


# --- chunked views under every storage dtype ------------------------------------------------

_STORE = (None, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)
_SOURCES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _stored(t: torch.Tensor, store) -> torch.Tensor:
    """What docs/api.md says a saved tensor comes back as under ``store_dtype=store``: itself when
    stored exactly; torch's cast and back for bf16 / fp16; for fp8, a scale from the tensor's own
    finite values (amax / 448 or / 57344; / 416 for an e4m3fn tensor holding +-inf, which keeps
    them in the codes of +-448), infinities and NaN kept."""
    width = 2 if store in (torch.bfloat16, torch.float16) else 1
    if store is None or t.element_size() <= width:
        return t
    if width == 2:
        return t.to(store).to(t.dtype)
    f = t.float()
    finite = torch.isfinite(f)
    amax = torch.where(finite, f.abs(), 0).max()
    inf = bool(torch.isinf(f).any())
    top = (416.0 if inf else 448.0) if store == torch.float8_e4m3fn else 57344.0
    scale = amax / top if amax > 0 else torch.tensor(1.0)
    back = torch.where(finite, f / scale, 0).to(store).float() * scale
    return torch.where(finite, back, f).to(t.dtype)


def _same_values(got: torch.Tensor, ref: torch.Tensor) -> bool:
    nan = torch.isnan(ref)
    ints = _INT[ref.element_size()]
    return torch.equal(torch.isnan(got), nan) and torch.equal(got.view(ints)[~nan], ref.view(ints)[~nan])


@st.composite
def chunk_cases(draw):
    chunks = draw(st.integers(2, 4))
    return {
        "store": draw(st.sampled_from(_STORE)),
        "dtype": draw(st.sampled_from(_SOURCES)),
        "rows": draw(st.integers(1, 9)),
        "cols": draw(st.integers(1, 9)),
        "chunks": chunks,
        "dim": draw(st.sampled_from((0, -1))),
        # Each chunk's magnitude, as a power of two: a chunk far larger than its neighbours is
        # what a scale taken over the span (gaps included) gets wrong.
        "exps": draw(st.lists(st.integers(-24, 24), min_size=chunks, max_size=chunks)),
        # (flat index, value) of +-inf and NaN
        "specials": draw(
            st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(("inf", "-inf", "nan"))), max_size=3)
        ),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


@settings(max_examples=hypothesis_examples(200))
@given(c=chunk_cases())
def test_chunked_views_come_back_as_the_storage_dtype_promises(c, shared_pool):
    """q, k, v-like chunks of one activation, of unequal magnitudes, with infinities and NaN: each
    saved chunk comes back as its own conversion says, and gradients are as finite as without
    offload."""
    gen = torch.Generator().manual_seed(c["seed"])
    shape = [c["rows"], c["cols"]]
    shape[c["dim"]] *= c["chunks"]
    base = torch.randn(*shape, generator=gen, dtype=torch.float64)
    parts = base.chunk(c["chunks"], c["dim"])
    for p, e in zip(parts, c["exps"]):
        p.mul_(2.0**e)
    flat = base.view(-1)
    for i, v in c["specials"]:
        flat[i % flat.numel()] = float(v)
    leaf = base.to(c["dtype"]).requires_grad_()
    ws = [torch.ones(p.shape, dtype=c["dtype"], requires_grad=True) for p in parts]
    start = shared_pool.stats()["bytes_in_use"]
    with cpu_offload(shared_pool, store_dtype=c["store"]) as ctx:
        views = (leaf * 1).chunk(c["chunks"], c["dim"])
        y = sum((v * w).sum() for v, w in zip(views, ws))  # w.grad is the saved view, as unpacked
    y.backward()
    assert ctx.stats()["tensors_offloaded"] > 0
    for i, (v, w) in enumerate(zip(views, ws)):
        ref = _stored(v.detach(), c["store"])
        assert _same_values(w.grad, ref), f"chunk {i}: {w.grad} != {ref}"
        assert torch.equal(torch.isfinite(w.grad), torch.isfinite(ref))
    del views, y
    _assert_drained(shared_pool, start)


# --- random checkpointed models -------------------------------------------------------------


class RBlock(nn.Module):
    """Takes a tensor by keyword and tensors inside a dict and a list; may checkpoint a part of
    itself (a checkpoint nested in another one's forward and recompute)."""

    def __init__(self, dim: int, nested, dropout: float, dtype):
        super().__init__()
        self.lin = nn.Linear(dim, dim, dtype=dtype)
        self.lin2 = nn.Linear(dim, dim, dtype=dtype)
        self.drop = nn.Dropout(dropout)
        self.nested = nested  # None: no inner checkpoint; else its offload= argument

    def _inner(self, h, pair):
        a, b = pair
        return self.lin2(h * torch.sigmoid(a)) + b

    def forward(self, x, *, scale, extras):
        h = torch.tanh(self.lin(x)) * scale + extras["bias"]
        if self.nested is None:
            h = self._inner(h, extras["pair"])
        else:
            h = co.checkpoint(self._inner, h, extras["pair"], offload=self.nested)
        return x + self.drop(h)


class RModel(nn.Module):
    def __init__(self, n: int, dim: int, nested: list, dropout: float, dtype):
        super().__init__()
        self.blocks = nn.ModuleList(RBlock(dim, nested[i], dropout, dtype) for i in range(n))

    def forward(self, x, bias, a, b, ckpt=None):
        pair = [torch.cos(a), b * 2]  # non-leaf tensors in a list, shared by every block
        for i, blk in enumerate(self.blocks):
            kw = {"scale": 0.5 + 0.1 * i, "extras": {"bias": bias, "pair": pair}}
            if ckpt is not None and i % ckpt[0] == 0:
                x = co.checkpoint(blk, x, offload=ckpt[1], **kw)
            else:
                x = blk(x, **kw)
        return x


@dataclass
class ModelCase:
    n: int
    dim: int
    rows: int
    nested: list
    dropout: float
    dtype: torch.dtype
    every: int
    how: str  # "checkpoint" or "apply"
    offload: bool
    seed: int


@st.composite
def model_cases(draw):
    n = draw(st.integers(1, 5))
    return ModelCase(
        n=n,
        dim=draw(st.integers(1, 8)),
        rows=draw(st.integers(1, 4)),
        nested=draw(st.lists(st.sampled_from((None, False, True)), min_size=n, max_size=n)),
        dropout=draw(st.sampled_from((0.0, 0.3))),
        dtype=draw(st.sampled_from(DTYPES)),
        every=draw(st.integers(1, 3)),
        how=draw(st.sampled_from(("checkpoint", "apply"))),
        offload=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _model_grads(c: ModelCase, pool, checkpointed: bool):
    opts = {"devices": ["cpu"], "min_bytes": 0, "pool": pool}
    nested = [o if o is None else (dict(opts) if o else False) for o in c.nested]
    torch.manual_seed(c.seed)
    model = RModel(c.n, c.dim, nested if checkpointed else [None] * c.n, c.dropout, c.dtype)
    gen = torch.Generator().manual_seed(c.seed)
    x, bias, a, b = (
        torch.randn(c.rows, c.dim, generator=gen, dtype=torch.float64).to(c.dtype).requires_grad_() for _ in range(4)
    )
    offload = dict(opts) if c.offload else False
    ckpt, handle = None, None
    if checkpointed and c.how == "apply":
        handle = co.apply(model, layers=RBlock, every_n_layers=c.every, offload=offload)
    elif checkpointed:
        ckpt = (c.every, offload)
    torch.manual_seed(c.seed + 1)
    out = model(x, bias, a, b, ckpt=ckpt)
    out.backward(torch.randn(out.shape, generator=gen, dtype=torch.float64).to(c.dtype))
    if handle is not None:
        handle.remove()
    return [p.grad for p in model.parameters()] + [t.grad for t in (x, bias, a, b)]


@settings(max_examples=hypothesis_examples(150))
@given(c=model_cases())
def test_random_checkpointed_model_gradients_are_bit_identical(c, shared_pool):
    start = shared_pool.stats()["bytes_in_use"]
    ref = _model_grads(c, shared_pool, checkpointed=False)
    got = _model_grads(c, shared_pool, checkpointed=True)
    assert_same_bits(ref, got, "parameter/input")
    _settle()
    assert shared_pool.stats()["bytes_in_use"] == start


# --- HostPool state machine ------------------------------------------------------------------

_ALIGN = int(co._C.ALIGNMENT)  # every block is a multiple of this
_PAGE = 4096  # segments (and reserve()) are whole pages
_SEGMENT = 16 << 10


def _round(n: int, a: int) -> int:
    return (n + a - 1) // a * a


class HostPoolMachine(RuleBasedStateMachine):
    """Random offload_tensor / free / reload / cap / empty_cache / reserve / reset_peak sequences,
    checked against a model of the accounting: bytes_in_use and bytes_requested exact, the peak
    exact, the cap never exceeded by growth, a refusal only when the cap leaves no room, data intact."""

    handles = Bundle("handles")

    def __init__(self):
        super().__init__()
        self.pool = co.HostPool(pinned=False, segment_bytes=_SEGMENT)
        self.live = {}  # key -> (handle, source tensor, block bytes, requested bytes)
        self.next_key = 0
        self.in_use = self.requested = self.peak = 0
        self.cap = None
        self.reserved_bound = None  # reserved may exceed a cap lowered below it, but never grows then
        self.allocs = self.cap_hits = 0

    def _stats(self) -> dict:
        # The block of a dropped handle is pending until its copies finish: settle first, so
        # the counters are exact.
        _settle()
        self.pool.synchronize()
        return self.pool.stats()

    @rule(
        target=handles,
        nbytes=st.integers(1, 3 * _SEGMENT),
        stream=st.sampled_from(("side", "compute")),
        seed=st.integers(0, 255),
    )
    def offload(self, nbytes, stream, seed):
        src = (torch.arange(nbytes, dtype=torch.int32) * 7 + seed).remainder(251).to(torch.uint8)
        block = _round(nbytes, _ALIGN)
        before = self._stats()
        try:
            handle = co.offload_tensor(src, self.pool, stream=stream)
        except co.PoolFullError:
            after = self._stats()
            assert self.cap is not None, "refused without a cap"
            assert before["bytes_reserved"] + _round(block, _PAGE) > self.cap, "refused although growth fitted"
            assert after["bytes_reserved"] + _round(block, _PAGE) > self.cap
            self.cap_hits += 1
            assert after["num_cap_hits"] == self.cap_hits
            return multiple()
        # Refusal is required when neither a free block nor growth can hold it.
        assert self.cap is None or self.in_use + block <= max(self.cap, before["bytes_reserved"])
        self.allocs += 1
        self.in_use += block
        self.requested += nbytes
        self.peak = max(self.peak, self.in_use)
        key = self.next_key
        self.next_key += 1
        self.live[key] = (handle, src, block, nbytes)
        return key

    @rule(key=consumes(handles))
    def free(self, key):
        _, _, block, nbytes = self.live.pop(key)
        self.in_use -= block
        self.requested -= nbytes

    @rule(key=handles)
    def reload(self, key):
        handle, src, _, _ = self.live[key]
        back = handle.reload()
        assert back.dtype == src.dtype and back.shape == src.shape
        assert torch.equal(back, src)

    # A cap below one page is refused (MIN_MAX_BYTES): nothing could ever be stored under it.
    @rule(cap=st.one_of(st.none(), st.integers(MIN_MAX_BYTES, 8 * _SEGMENT)))
    def set_cap(self, cap):
        before = self._stats()
        self.pool.max_bytes = cap
        self.cap = cap
        after = self._stats()
        assert after["max_bytes"] == cap
        assert after["bytes_reserved"] <= before["bytes_reserved"]  # a cap frees, never takes
        self.reserved_bound = None if cap is None else max(cap, after["bytes_reserved"])

    @rule()
    def empty_cache(self):
        before = self._stats()
        released = self.pool.empty_cache()
        after = self._stats()
        # What it releases: the wholly free segments it retires now, and those retired before
        # (a grow near the cap retires free segments without releasing them; whether a segment
        # was wholly free then depends on when its copies finished).
        assert after["bytes_retired"] == 0
        assert released == (before["bytes_reserved"] - after["bytes_reserved"]) + before["bytes_retired"]
        if not self.live:
            assert after["bytes_reserved"] == 0 and after["num_segments"] == 0

    @rule(nbytes=st.integers(1, 4 * _SEGMENT))
    def reserve(self, nbytes):
        before = self._stats()
        need = _round(nbytes, _PAGE)
        try:
            got = self.pool.reserve(nbytes)
        except co.PoolFullError:
            after = self._stats()
            assert self.cap is not None and before["bytes_reserved"] + need > self.cap
            assert after["bytes_reserved"] + need > self.cap
            return
        assert got == need, "reserve takes one page-rounded segment of the size asked"
        assert self.cap is None or self._stats()["bytes_reserved"] <= self.cap

    @rule()
    def reset_peak(self):
        self.pool.reset_peak()
        self.peak = self.in_use

    @invariant()
    def accounting_matches(self):
        s = self._stats()
        assert s["bytes_in_use"] == self.in_use
        assert s["bytes_requested"] == self.requested
        assert s["num_blocks_in_use"] == len(self.live)
        assert s["bytes_pending"] == 0
        assert s["peak_bytes_in_use"] == self.peak
        assert s["num_allocs"] == self.allocs
        assert s["bytes_reserved"] >= s["bytes_in_use"]
        assert s["peak_bytes_reserved"] >= s["bytes_reserved"]
        if self.reserved_bound is not None:
            assert s["bytes_reserved"] <= self.reserved_bound
        assert self.pool._impl.check_invariants() == ""

    def teardown(self):
        self.live.clear()
        s = self._stats()
        assert s["bytes_in_use"] == 0 and s["num_blocks_in_use"] == 0


TestHostPoolMachine = HostPoolMachine.TestCase
TestHostPoolMachine.settings = settings(max_examples=hypothesis_examples(60), stateful_step_count=25)


# --- random plans and co.apply segments on blocks that are hard to recompute exactly ------------


class HBlock(nn.Module):
    """A block whose ``spec`` may make it return ``(h, aux)`` (the model's loss uses every aux) or
    a dict ``{"h": h, "aux": aux}`` the model unpacks, be called by keyword (``b(x=h)``), write its
    input in place, write a matmul's output in place, or hold a BatchNorm (running statistics):
    each valid without a plan, each a trap for recompute or for segments."""

    def __init__(self, dim: int, spec: dict):
        super().__init__()
        self.spec = spec
        self.lin = nn.Linear(dim, dim, dtype=torch.float64)
        self.bn = nn.BatchNorm1d(dim, dtype=torch.float64) if spec["bn"] else None

    def forward(self, x):
        if self.spec["inplace_input"]:
            x.mul_(0.75)  # nothing has saved x yet (the previous block's output is a fresh product)
        h = self.lin(x)
        if self.spec["mutate_matmul"]:
            h.add_(0.5)  # nothing has saved the matmul's output yet; selective recompute would
        if self.bn is not None:
            h = self.bn(h)
        h = torch.tanh(h) * torch.sigmoid(h)
        if self.spec["aux"]:
            if self.spec["dict"]:
                return {"h": h, "aux": h.mean()}
            return h, h.mean()  # saves nothing: the next block may write h in place
        return h


class HModel(nn.Module):
    def __init__(self, specs, dim):
        super().__init__()
        self.blocks = nn.ModuleList(HBlock(dim, s) for s in specs)

    def forward(self, x):
        h, aux = x * 1.0, []
        for b in self.blocks:
            out = b(x=h) if b.spec["keyword"] else b(h)
            if isinstance(out, dict):
                h, a = out["h"], out["aux"]
                aux.append(a)
            elif isinstance(out, tuple):
                h, a = out
                aux.append(a)
            else:
                h = out
        return h.sum() + sum((i + 2) * a for i, a in enumerate(aux))


_spec = st.fixed_dictionaries(
    {
        "aux": st.booleans(),
        "inplace_input": st.booleans(),
        "mutate_matmul": st.booleans(),
        "bn": st.booleans(),
        "dict": st.booleans(),
        "keyword": st.booleans(),
    }
)


@dataclass
class HCase:
    specs: list
    rows: int
    seed: int


@st.composite
def h_cases(draw):
    n = draw(st.integers(2, 4))
    return HCase(
        specs=draw(st.lists(_spec, min_size=n, max_size=n)),
        rows=draw(st.integers(32, 64)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


_DIM = 32  # with rows >= 32, saved tensors (8 KiB+) outweigh the RNG state (5 KiB) a CPU checkpoint keeps


def _h_models(c: HCase, copies: int):
    import copy

    torch.manual_seed(c.seed)
    model = HModel(c.specs, _DIM)
    x = torch.randn(c.rows, _DIM, generator=torch.Generator().manual_seed(c.seed), dtype=torch.float64)
    return [copy.deepcopy(model) for _ in range(copies)], x


def _h_step(model, x):
    model.zero_grad(set_to_none=True)
    loss = model(x)
    loss.backward()
    state = {f"grad {n}": p.grad for n, p in model.named_parameters() if p.grad is not None}
    state.update({f"buffer {n}": b.clone() for n, b in model.named_buffers()})
    return loss.detach(), state


def _assert_same_step(ref, got, what):
    (l1, s1), (l2, s2) = ref, got
    assert torch.equal(l1, l2), f"{what}: loss {l1.item()} vs {l2.item()}"
    assert s1.keys() == s2.keys(), what
    differing = [k for k in s1 if not torch.equal(s1[k], s2[k])]
    assert not differing, f"{what}: {differing} differ"


_plan_options = st.fixed_dictionaries(
    {
        "fraction": st.sampled_from((0.0, 0.5, 0.8)),  # of the peak without a plan; 0: the least any plan reaches
        "kinds": st.sampled_from(
            (
                ("keep", "recompute"),
                ("keep", "selective"),
                ("keep", "offload", "recompute", "recompute_offload", "selective"),
            )
        ),
        "levels": st.integers(1, 2),
        "segments": st.booleans(),
    }
)


@settings(max_examples=hypothesis_examples(8))
@given(c=h_cases(), o=_plan_options)
def test_random_plans_never_change_loss_gradients_or_state(c, o, shared_pool):
    from ckpt_offload.blocks import select_blocks as _select_blocks
    from ckpt_offload.planner import Bandwidth, measure_costs, simulate
    from ckpt_offload.planner.simulator import singles

    (ref_model, planned, probe), x = _h_models(c, 3)
    start = shared_pool.stats()["bytes_in_use"]
    ref = _h_step(ref_model, x)
    costs = measure_costs(
        lambda: probe(x).backward(),
        _select_blocks(probe, None),
        "cpu",
        bandwidth=Bandwidth(math.inf, math.inf, 0.0),
        min_bytes=0,
    )
    full = simulate(costs, singles(["keep"] * len(costs.blocks))).peak_bytes
    opts = dict(
        offload={"devices": ["cpu"], "min_bytes": 0, "pool": shared_pool},
        kinds=o["kinds"],
        levels=o["levels"],
        segments=o["segments"],
        costs=costs,
    )
    try:
        plan = co.plan(planned, lambda: None, budget=max(1, int(full * o["fraction"])), **opts)
    except co.planner.InfeasibleBudget as e:
        plan = co.plan(planned, lambda: None, budget=e.minimum, **opts)
    handle = plan.apply()
    try:
        got = _h_step(planned, x)
    finally:
        handle.remove()
    _assert_same_step(ref, got, f"plan {plan.choices}")
    _assert_drained(shared_pool, start)


_apply_options = st.one_of(
    st.fixed_dictionaries({"segments": st.sampled_from((1, 2, "sqrt")), "offload": st.booleans()}),
    st.fixed_dictionaries({"every_n_layers": st.integers(1, 2), "offload": st.booleans()}),
)


@settings(max_examples=hypothesis_examples(15))
@given(c=h_cases(), o=_apply_options)
def test_random_apply_options_never_change_loss_gradients_or_state(c, o, shared_pool):
    if "every_n_layers" in o:
        # co.apply without segments is torch's checkpoint per block: it updates running statistics
        # in its recompute as torch's does (documented); the planner and segments refuse that.
        c.specs = [dict(s, bn=False) for s in c.specs]
    (ref_model, applied), x = _h_models(c, 2)
    start = shared_pool.stats()["bytes_in_use"]
    ref = _h_step(ref_model, x)
    offload = {"devices": ["cpu"], "min_bytes": 0, "pool": shared_pool} if o["offload"] else False
    handle = co.apply(applied, layers=HBlock, offload=offload, **{k: v for k, v in o.items() if k != "offload"})
    try:
        got = _h_step(applied, x)
    except RuntimeError as e:  # refused: a block a recompute cannot repeat (an in-place write)
        msg = str(e)
        # ... or a segment over a block whose dict the model unpacks
        assert "in place" in msg or "inplace" in msg or "running statistics" in msg or "returns a dict" in msg, msg
        got = None
    finally:
        handle.remove()
    if got is not None:
        _assert_same_step(ref, got, f"co.apply({o})")
    _assert_drained(shared_pool, start)
