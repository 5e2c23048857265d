"""Property-based tests (hypothesis) for the class of bugs where one unpacked tensor is shared: random graphs whose
custom Functions save a tensor twice (and a same-layout view, a transpose, chunks of one base) or write a saved tensor
in place in backward, under every stream mode, batching, prefetch, store dtype and the checkpoint route; and
random selective-checkpoint programs over view ops (same-layout views, expands, int64 index views) through
co.checkpoint's offload and co.selective_offload_context. Each against the same program without ckpt_offload:
gradients bit-identical, or torch's own in-place error -- never a gradient torch would not compute
(Note [One version per device copy], csrc/torch/device_memory.h).

CI runs the derandomized "ci" profile (tests/conftest.py); CKPT_OFFLOAD_HYPOTHESIS_PROFILE=thorough draws ten times as
many fresh examples.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

pytest.importorskip("hypothesis")  # installed by scripts/dev.sh; CI has it

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import ckpt_offload as co  # noqa: E402
from conftest import hypothesis_examples, run_a_backward  # noqa: E402
from helpers import Scribble  # noqa: E402

INPLACE = "modified by an inplace operation"
_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same_bits(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        (x is None) == (y is None)
        and (
            x is None
            or (
                x.dtype == y.dtype
                and x.shape == y.shape
                and torch.equal(x.view(_INT[x.element_size()]), y.view(_INT[y.element_size()]))
            )
        )
        for x, y in zip(a, b)
    )


@pytest.fixture(scope="module")
def pool():
    """One pageable pool for every example; each checks that the bytes it used came back."""
    return co.HostPool(pinned=False, segment_bytes=1 << 20)


def _drained(pool, start):
    co.synchronize()
    if pool.stats()["bytes_in_use"] != start:
        run_a_backward()  # after a raising backward the engine keeps its queued nodes until the next one
        co.synchronize()
    assert pool.stats()["bytes_in_use"] == start, "a block outlived its graph"


# --- custom Functions that save a tensor twice or write it in backward -------------------------------------------


class Twice(torch.autograd.Function):
    """Saves a twice, a same-layout view of it and its transpose: four saved tensors of one storage."""

    @staticmethod
    def forward(ctx, a):
        ctx.save_for_backward(a, a, a.view(a.shape), a.t())
        return a * a

    @staticmethod
    def backward(ctx, g):
        a, a2, v, t = ctx.saved_tensors
        return g * a + g * a2 + (g * v - g * t.t())


# Square values (m x m, m even): every op keeps the shape, so any value can feed any op.
OPS = ("tanh", "mul", "matmul", "t", "view", "chunk", "scribble", "twice", "sin")
_op = st.tuples(st.sampled_from(OPS), st.integers(0, 31), st.integers(0, 31))


@dataclass
class Graph:
    m: int
    n_inputs: int
    ops: list
    dtype: torch.dtype
    seed: int


@st.composite
def graphs(draw):
    return Graph(
        m=draw(st.sampled_from((2, 4, 6))),
        n_inputs=draw(st.integers(1, 3)),
        ops=draw(st.lists(_op, min_size=1, max_size=8)),
        dtype=draw(st.sampled_from((torch.float32, torch.float64))),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _program(g: Graph):
    def fn(*inputs):
        values = list(inputs)
        for name, i, j in g.ops:
            a, b = values[i % len(values)], values[j % len(values)]
            if name == "tanh":
                v = torch.tanh(a)
            elif name == "sin":
                v = torch.sin(a)
            elif name == "mul":
                v = a * b
            elif name == "matmul":
                v = a @ b
            elif name == "t":
                v = a.t()
            elif name == "view":  # the same layout as a: a view whose sizes, strides and offset are a's
                v = a.view(a.shape) * 1.0 if a.is_contiguous() else a.reshape(a.shape) * 1.0
            elif name == "chunk":  # q and k: two views of one base, saved by the same mul
                q, k = (a * 1.0).chunk(2, dim=1)
                v = torch.cat([q * k, k], dim=1)
            elif name == "scribble":
                v = Scribble.apply(a, b)
            else:
                v = Twice.apply(a)
            values.append(v)
        return sum(v.sum() for v in values[len(inputs) :])

    return fn


def _run(g: Graph, route: str, cfg: dict | None, pool, writes: bool):
    """Gradients of the graph's inputs, or the error backward raised. cfg None: without ckpt_offload."""
    gen = torch.Generator().manual_seed(g.seed)
    inputs = [
        torch.randn(g.m, g.m, generator=gen, dtype=torch.float64).to(g.dtype).requires_grad_()
        for _ in range(g.n_inputs)
    ]
    fn = _program(g)
    opts = None if cfg is None else dict(cfg, devices=["cpu"], min_bytes=0, pool=pool)
    Scribble.writes = writes  # False: the "clean" run, where Scribble's write goes nowhere
    try:
        if route == "checkpoint" and opts is not None:
            out = co.checkpoint(fn, *inputs, offload=opts)
        elif route == "checkpoint":
            out = checkpoint(fn, *inputs, use_reentrant=False)
        elif opts is not None:
            with co.offload(**opts):
                out = fn(*inputs)
        else:
            out = fn(*inputs)
        out.backward()
    except RuntimeError as e:
        run_a_backward()
        return str(e)
    finally:
        Scribble.writes = True
    return [x.grad for x in inputs]


_configs = st.sampled_from(
    [
        {"stream": "compute", "batch_below": 0},
        {"stream": "compute", "batch_below": 4096},
        {"stream": "side", "prefetch_bytes": 0, "batch_below": 0},
        {"stream": "side", "prefetch_bytes": 1 << 20, "batch_below": 0},
        {"stream": "side", "prefetch_bytes": 1 << 20, "batch_below": 4096},
    ]
)


def _check(ref, clean, got, close=None):
    """got agrees with torch: where torch computes gradients, the same ones; where torch raises its in-place error,
    the same error, or the gradients of the program whose write went nowhere (a saved tensor that did not share the
    written bytes came back as saved). Never another error, never other gradients."""
    if isinstance(got, str):
        assert INPLACE in got, got
        assert isinstance(ref, str) and INPLACE in ref, f"raised where torch computes: {got}"
        return
    want = clean if isinstance(ref, str) else ref
    assert not isinstance(want, str), want
    if close is None:
        assert _same_bits(want, got), "gradients differ from torch's"
    else:
        for w, x in zip(want, got):
            assert (w is None) == (x is None), "a gradient present in one run only"
            assert w is None or (x - w).norm() <= close * (w.norm() + 1e-6), "gradients far from torch's"


@settings(max_examples=hypothesis_examples(300), deadline=None)
@given(g=graphs(), cfg=_configs, route=st.sampled_from(("offload", "checkpoint")))
def test_saved_twice_or_written_in_backward_matches_torch(g, cfg, route, pool):
    start = pool.stats()["bytes_in_use"]
    ref = _run(g, route, None, pool, writes=True)
    clean = _run(g, route, None, pool, writes=False)
    got = _run(g, route, cfg, pool, writes=True)
    _check(ref, clean, got)
    _drained(pool, start)


@settings(max_examples=hypothesis_examples(100), deadline=None)
@given(g=graphs(), stream=st.sampled_from(("side", "compute")))
def test_saved_twice_or_written_in_backward_under_store_dtype_raises_as_torch(g, stream, pool):
    # Stored in bf16: gradients are close, not equal; an in-place error is still torch's, where torch raises it.
    g.dtype = torch.float32
    start = pool.stats()["bytes_in_use"]
    ref = _run(g, "offload", None, pool, writes=True)
    clean = _run(g, "offload", None, pool, writes=False)
    got = _run(g, "offload", {"stream": stream, "store_dtype": torch.bfloat16}, pool, writes=True)
    _check(ref, clean, got, close=5e-2)
    _drained(pool, start)


# --- selective checkpointing over view ops ----------------------------------------------------------------------

SAC_OPS = ("view_flat", "view_same", "transpose", "mul", "sin", "bmm", "expand", "gather")
_CHOICES = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_CPU_OFFLOAD)
# The aten ops a policy decides for (SAC asks for every op; the rest recompute).
_ATEN = (
    torch.ops.aten.view.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.transpose.int,
    torch.ops.aten.mul.Tensor,
    torch.ops.aten.sin.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.expand.default,
    torch.ops.aten.index.Tensor,
    torch.ops.aten.arange.default,
    torch.ops.aten.clone.default,
)


@dataclass
class SacCase:
    ops: list
    policy: dict  # aten op index -> choice index
    stream: str
    seed: int


@st.composite
def sac_cases(draw):
    return SacCase(
        ops=draw(
            st.lists(
                st.tuples(st.sampled_from(SAC_OPS), st.integers(0, 15), st.integers(0, 15)), min_size=1, max_size=6
            )
        ),
        policy=draw(st.dictionaries(st.integers(0, len(_ATEN) - 1), st.integers(0, 2))),
        stream=draw(st.sampled_from(("side", "compute"))),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _sac_program(c: SacCase):
    def fn(x, w):
        values = [x, w]
        for name, i, j in c.ops:
            a, b = values[i % len(values)], values[j % len(values)]
            if name == "view_flat":
                v = a.reshape(-1).view(a.shape)
            elif name == "view_same":
                v = a.view(a.shape) if a.is_contiguous() else a.reshape(a.shape)
            elif name == "transpose":
                v = a.transpose(-1, -2)
            elif name == "mul":
                v = a * b
            elif name == "sin":
                v = a.sin()
            elif name == "bmm":  # 3-D matmul: autograd saves its operands' expand views
                v = a @ b
            elif name == "expand":
                v = a[:, :1].expand_as(a) * b
            else:  # an int64 index, viewed the same way as it was made
                idx = torch.arange(a.numel()).view(-1)
                v = a.reshape(-1)[idx.view(-1)].view(a.shape)
            values.append(v)
        return sum(v.sum() for v in values[2:])

    return fn


def _policies(c: SacCase):
    chosen = {_ATEN[k]: _CHOICES[v] for k, v in c.policy.items()}

    def offload_policy(ctx, op, *args, **kwargs):
        return chosen.get(op, CheckpointPolicy.PREFER_RECOMPUTE)

    def save_policy(ctx, op, *args, **kwargs):  # torch's reading: offload is save
        p = offload_policy(ctx, op, *args, **kwargs)
        return CheckpointPolicy.MUST_SAVE if p == CheckpointPolicy.MUST_CPU_OFFLOAD else p

    return offload_policy, save_policy


@settings(max_examples=hypothesis_examples(150), deadline=None)
@given(c=sac_cases(), route=st.sampled_from(("selective_offload_context", "co.checkpoint", "inside co.offload")))
def test_selective_checkpoint_over_views_matches_torchs(c, route, pool):
    start = pool.stats()["bytes_in_use"]
    offload_policy, save_policy = _policies(c)
    fn = _sac_program(c)
    opts = {"devices": ["cpu"], "min_bytes": 0, "pool": pool, "stream": c.stream}

    def run(use_co):
        gen = torch.Generator().manual_seed(c.seed)
        x = torch.randn(2, 4, 4, generator=gen, requires_grad=True)
        w = torch.randn(2, 4, 4, generator=gen, requires_grad=True)
        torch_ctx = functools.partial(create_selective_checkpoint_contexts, save_policy)
        if not use_co:
            out = checkpoint(fn, x, w, use_reentrant=False, context_fn=torch_ctx)
        elif route == "co.checkpoint":
            out = co.checkpoint(fn, x, w, offload=opts, context_fn=torch_ctx)
        elif route == "inside co.offload":  # what the policy saves goes through the user's offload context
            with co.offload(**opts):
                out = co.checkpoint(fn, x, w, context_fn=torch_ctx)
        else:
            out = checkpoint(
                fn, x, w, use_reentrant=False, context_fn=co.selective_offload_context(offload_policy, offload=opts)
            )
        out.backward()
        return [x.grad, w.grad]

    assert _same_bits(run(False), run(True)), "gradients differ from torch's selective checkpoint"
    _drained(pool, start)
