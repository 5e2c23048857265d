"""GPU tests: the CUDA copy engine, pinned pool and stream ordering on a real device.

Every test here is marked ``gpu`` and skips cleanly when no CUDA device is usable (or when
ckpt_offload was built without CUDA), so ``pytest tests/`` stays green on CPU-only machines.
On a GPU machine run them with ``python3 -m pytest -m gpu -v tests/`` (benchmarks/gpu_suite.sh
does). The whole file is meant to take well under a minute on an H200.

What they guard (Note [Stream ordering] in csrc/torch/runtime.h, and the layout and pool rules):

* gradients are bit-identical with and without ``co.offload`` (both stream modes, fp32, bf16,
  autocast), also when the forward runs on a non-default ``torch.cuda.Stream``;
* the D2H copy waits for the kernel that produced the tensor; the consumer of a reloaded
  tensor waits for the H2D copy; the H2D copy waits until its freshly allocated destination is
  free in compute-stream order; the caching allocator does not hand the source memory of a
  pending D2H copy to a new tensor;
* exact layout round trips (strides, storage offset, alignment, expanded tensors, dtypes);
* offloading actually frees device memory, the pool accounts for exactly what was offloaded,
  and every block comes back (after backward, a dropped graph, a raising backward,
  ``retain_graph=True``).

The ordering tests make a hazard *likely to show* rather than merely possible: a spin kernel
(``torch.cuda._sleep``) holds the compute stream so that a copy that forgot to wait would run
early, and sentinel values make early or late copies visible. They never assert timing.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ckpt_offload as co
from ckpt_offload.options import DEFAULT_PREFETCH_BYTES
from helpers import GPU_REASON, HAS_GPU, TESTS_DIR, cuda_device
from helpers import sleep_stream as _sleep


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not HAS_GPU,
        reason=GPU_REASON,
    ),
]

STREAMS = ("side", "compute")
MiB = 1 << 20


@pytest.fixture
def device():
    """The CUDA device (this file is GPU-only; conftest's `device` also runs on CPU)."""
    yield from cuda_device()


@pytest.fixture
def pool():
    """A fresh pinned pool per test, so byte counts start at zero."""
    p = co.HostPool()
    yield p
    co.synchronize()
    p.synchronize()


# ----------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------


def make_mlp(width=512, depth=4):
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers += [nn.Linear(width, width)]
    return nn.Sequential(*layers)


class Block(nn.Module):
    """A pre-LN transformer block with explicit attention math.

    Attention is written out (no fused SDPA kernel): flash / memory-efficient attention
    backward accumulates with atomics and is not bit-reproducible even without offload.
    Saves views of one storage (the softmax's output, and its (b*h, t, t) view that att @ v
    saves), transposed (non-contiguous) tensors, a boolean mask buffer and layer-norm statistics.
    """

    def __init__(self, dim=256, heads=4, seq=128):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.register_buffer("mask", torch.ones(seq, seq, dtype=torch.bool).triu(1), persistent=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // self.heads))
        att = att.masked_fill(self.mask[:t, :t], float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def make_transformer():
    return nn.Sequential(Block(), Block())


MODELS = {
    "mlp": (make_mlp, lambda dev: torch.randn(256, 512, device=dev)),
    "transformer": (make_transformer, lambda dev: torch.randn(4, 128, 256, device=dev)),
}
# "autocast_bf16": fp32 weights under torch.autocast; the cast weights are fresh tensors (not
# parameter views), so they are offloaded too and must come back bit-exact.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "autocast_bf16": torch.float32}


def _step(model, x, ctx, autocast: bool):
    """One forward/backward; returns the loss, the input's grad and the parameters' grads."""
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with ctx, amp:
        out = model(x)
        loss = out.float().pow(2).mean()
    loss.backward()
    torch.cuda.synchronize()
    return loss.detach().clone(), x.grad.clone(), [p.grad.clone() for p in model.parameters()]


def _assert_bit_identical(a, b, what=""):
    loss_a, gx_a, gp_a = a
    loss_b, gx_b, gp_b = b
    assert torch.equal(loss_a, loss_b), f"{what}: loss differs ({loss_a.item()} vs {loss_b.item()})"
    assert torch.equal(gx_a, gx_b), f"{what}: input gradient differs (max abs diff {(gx_a - gx_b).abs().max()})"
    for i, (ga, gb) in enumerate(zip(gp_a, gp_b)):
        assert torch.equal(ga, gb), f"{what}: gradient of parameter {i} differs (max abs diff {(ga - gb).abs().max()})"


def _reference(model, x, autocast):
    ref = _step(model, x, contextlib.nullcontext(), autocast)
    again = _step(model, x, contextlib.nullcontext(), autocast)
    try:
        _assert_bit_identical(ref, again, "reference vs reference")
    except AssertionError as e:  # the model itself is not reproducible here: nothing to compare against
        pytest.skip(f"the model is not bit-reproducible on this GPU without offload ({e})")
    return ref


# ----------------------------------------------------------------------------------------------
# Backend
# ----------------------------------------------------------------------------------------------


def test_build_and_pinned_backend():
    info = co.build_info()
    assert info["cuda_compiled"] and info["gpu_available"]
    assert info["pool_backend"] == "pinned"
    assert info["cuda_runtime_version"]
    assert co.HostPool().backend == "pinned"
    assert co.HostPool().pinned
    assert co.default_pool().backend == "pinned"
    assert co.HostPool(pinned=False).backend == "pageable"
    assert co.HostPool(pinned=True).backend == "pinned"


def test_pool_memory_is_really_pinned(device):
    """A pool made with pinned=None on a GPU reserves page-locked segments (cudaHostAlloc) and
    round-trips through them."""
    pool = co.HostPool()
    x = torch.arange(4 * MiB, device=device, dtype=torch.float32)
    h = co.offload_tensor(x, pool=pool)
    co.synchronize()
    s = pool.stats()
    assert s["backend"] == "pinned" and s["num_backend_allocs"] >= 1 and s["bytes_reserved"] >= x.nbytes
    assert torch.equal(h.reload(), x)


# ----------------------------------------------------------------------------------------------
# Invariant 1: gradients are bit-identical
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", STREAMS)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("model_name", list(MODELS))
def test_gradients_bit_identical(device, pool, model_name, dtype_name, stream):
    make, make_input = MODELS[model_name]
    torch.manual_seed(0)
    dtype = DTYPES[dtype_name]
    autocast = dtype_name.startswith("autocast")
    model = make().to(device=device, dtype=dtype)
    x = make_input(device).to(dtype)

    ref = _reference(model, x, autocast)
    ctx = co.offload(min_bytes=0, stream=stream, pool=pool)
    got = _step(model, x, ctx, autocast)
    _assert_bit_identical(ref, got, f"{model_name}/{dtype_name}/{stream}")

    st = ctx.stats()
    assert st["tensors_offloaded"] > 0 and st["tensors_reloaded"] > 0
    # nn.Linear saves weight.t(): a view of a parameter must be kept, never copied. Under
    # autocast the Linear saves the bf16 cast of its weight instead, which autocast's weight
    # cache holds for the region: kept as "autocast_cast" (Note [Parameters and buffers]).
    kept = st["kept_by_reason"]
    assert kept["parameter"] + kept["autocast_cast"] > 0, kept
    if autocast:
        assert kept["autocast_cast"] > 0, kept
    if model_name == "transformer":
        assert st["kept_by_reason"].get("buffer", 0) > 0  # the causal mask
        if not autocast:
            # The softmax's output: saved by the softmax, and as a (b*h, t, t) view by att @ v.
            # (q, k and v are copied by the matmuls' reshapes.) Under CUDA autocast the softmax
            # runs in float32 and att @ v saves its bf16 cast, another storage: nothing to share
            # (on 2026-12-04's GPU run the gradients there were bit-identical, dedup 0).
            assert st["tensors_deduplicated"] > 0
    del got
    assert pool.stats()["bytes_in_use"] == 0


@pytest.mark.parametrize("stream", STREAMS)
def test_training_steps_bit_identical(device, pool, stream):
    """Several optimizer steps: a race that corrupts one step drifts the weights after."""

    def train(offload: bool):
        torch.manual_seed(1)
        model = make_mlp(width=512, depth=3).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        gen = torch.Generator(device=device).manual_seed(2)
        for _ in range(8):
            x = torch.randn(512, 512, device=device, generator=gen)
            ctx = co.offload(min_bytes=0, stream=stream, pool=pool) if offload else contextlib.nullcontext()
            with ctx:
                loss = model(x).pow(2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        torch.cuda.synchronize()
        return [p.detach().clone() for p in model.parameters()]

    ref, got = train(False), train(True)
    if not all(torch.equal(a, b) for a, b in zip(ref, train(False))):
        pytest.skip("training is not bit-reproducible on this GPU without offload")
    for i, (a, b) in enumerate(zip(ref, got)):
        assert torch.equal(a, b), f"parameter {i} differs after 8 steps (max abs diff {(a - b).abs().max()})"
    assert pool.stats()["bytes_in_use"] == 0


@pytest.mark.parametrize("stream", STREAMS)
def test_forward_backward_on_non_default_stream(device, pool, stream):
    """The current stream is read at every call (Note [Stream ordering]; TRL #7195): a forward and backward
    run under ``with torch.cuda.stream(s)`` must order the copies after *s*, not stream 0."""
    torch.manual_seed(0)
    model = make_transformer().to(device)
    x = torch.randn(4, 128, 256, device=device)

    def run(offload: bool):
        s = torch.cuda.Stream(device=device)
        s.wait_stream(torch.cuda.current_stream(device))
        ctx = co.offload(min_bytes=0, stream=stream, pool=pool) if offload else contextlib.nullcontext()
        with torch.cuda.stream(s):
            _sleep()  # s is busy: a copy ordered after the default stream instead would run now
            model.zero_grad(set_to_none=True)
            xi = x.detach().clone().requires_grad_(True)
            with ctx:
                loss = model(xi).float().pow(2).mean()
            _sleep()
            loss.backward()
            got = (loss.detach().clone(), xi.grad.clone(), [p.grad.clone() for p in model.parameters()])
        torch.cuda.current_stream(device).wait_stream(s)
        torch.cuda.synchronize()
        return got, ctx

    ref, _ = run(False)
    again, _ = run(False)
    try:
        _assert_bit_identical(ref, again, "reference vs reference")
    except AssertionError as e:
        pytest.skip(f"the model is not bit-reproducible on this GPU without offload ({e})")
    got, ctx = run(True)
    assert ctx.stats()["tensors_offloaded"] > 0
    _assert_bit_identical(ref, got, f"non-default stream/{stream}")


# ----------------------------------------------------------------------------------------------
# Offloading frees device memory; the pool holds exactly the offloaded bytes; blocks return
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", STREAMS)
def test_offload_frees_device_memory(device, pool, stream):
    torch.manual_seed(0)
    # 4096 x 2048 fp32 activations: 32 MiB each; 5 saved ones (4 ReLU outputs, the output):
    # ~160 MiB held without offload.
    model = make_mlp(width=2048, depth=4).to(device)
    x = torch.randn(4096, 2048, device=device)
    act = x.nbytes  # one activation
    # Warm up: cuBLAS / cuBLASLt workspaces are allocated through the caching allocator on first
    # use; they must not land inside either measurement.
    model(x).pow(2).mean().backward()
    model.zero_grad(set_to_none=True)

    def forward_delta(ctx):
        co.synchronize()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(device)
        with ctx:
            loss = model(x).pow(2).mean()
        # Release the sources held until their D2H copies finished.
        co.synchronize()
        torch.cuda.synchronize()
        return loss, torch.cuda.memory_allocated(device) - before

    loss_ref, held_without = forward_delta(contextlib.nullcontext())
    del loss_ref
    # What autograd saves that did not exist before: the four ReLU outputs (each also the next
    # Linear's input) and the output (pow saves it); x existed before.
    assert held_without >= 5 * act, f"the test model should hold 5 activations ({5 * act}), held {held_without}"

    start = pool.stats()
    ctx = co.offload(min_bytes=0, stream=stream, pool=pool)
    loss, held_with = forward_delta(ctx)

    st, ps = ctx.stats(), pool.stats()
    # Derived, not guessed: without offload the forward's new memory is the saved activations
    # that are new allocations (what this context offloads, less x) plus the rest (the loss).
    # With offload only the rest stays, with what the context kept that is new memory (not
    # parameters or buffers). The allocator counts a freed source at once, even while its
    # copy is still reading it (recordStream), so nothing else can remain.
    rest = held_without - (st["bytes_offloaded"] - act)
    kept_new = st["bytes_kept"] - st["kept_bytes_by_reason"]["parameter"] - st["kept_bytes_by_reason"]["buffer"]
    assert 0 <= rest < act
    assert held_with <= kept_new + rest, (
        f"offload kept {held_with / MiB:.1f} MiB on the device vs {held_without / MiB:.1f} MiB without "
        f"(kept by the context {kept_new} B, other allocations {rest} B)"
    )
    assert st["kept_by_reason"].get("parameter", 0) > 0
    # The pool holds exactly the offloaded bytes (bytes_requested), in blocks rounded to the
    # alignment only (bytes_in_use), never to a power of two.
    assert ps["bytes_requested"] - start["bytes_requested"] == st["bytes_offloaded"]
    in_use = ps["bytes_in_use"] - start["bytes_in_use"]
    align = co.build_info()["alignment"]
    assert st["bytes_offloaded"] <= in_use <= st["bytes_offloaded"] + align * st["tensors_offloaded"]
    # x, four ReLU outputs (each also the next Linear's input: deduplicated) and the output.
    assert st["bytes_offloaded"] >= 5 * act
    assert st["tensors_deduplicated"] >= 3
    assert ps["num_blocks_in_use"] == st["tensors_offloaded"]

    loss.backward()
    del loss
    torch.cuda.synchronize()
    assert pool.stats()["bytes_in_use"] == start["bytes_in_use"]
    assert pool.stats()["bytes_requested"] == start["bytes_requested"]
    pool.synchronize()
    assert pool.stats()["bytes_pending"] == 0


def _settle_device_thread(device):
    """After a backward that raised on autograd's CUDA device thread, that thread may still hold
    the raising node (its task) for a moment after the error reached the caller, so the graph the
    caller deletes can die there, just after `del`. A tiny backward on the same device runs on that
    thread after it let go, so a byte count read afterwards sees the graph gone."""
    t = torch.ones(1, device=device, requires_grad=True)
    (t * 2).sum().backward()


@pytest.mark.parametrize("stream", STREAMS)
def test_pool_blocks_return(device, pool, stream):
    """Invariant 4: after backward, a dropped graph, a raising backward, retain_graph twice."""
    torch.manual_seed(0)
    model = make_transformer().to(device)
    x = torch.randn(4, 128, 256, device=device, requires_grad=True)

    def forward():
        with co.offload(min_bytes=0, stream=stream, pool=pool):
            return model(x).pow(2).mean()

    # 1. backward
    loss = forward()
    assert pool.stats()["bytes_in_use"] > 0
    loss.backward()
    del loss
    assert pool.stats()["bytes_in_use"] == 0

    # 2. a graph dropped without backward
    loss = forward()
    assert pool.stats()["bytes_in_use"] > 0
    del loss
    assert pool.stats()["bytes_in_use"] == 0

    # 3. retain_graph=True twice: both backwards see the same values
    model.zero_grad(set_to_none=True)
    x.grad = None
    loss = forward()
    loss.backward(retain_graph=True)
    g1 = x.grad.clone()
    loss.backward()
    torch.cuda.synchronize()
    assert torch.equal(x.grad, 2 * g1)
    del loss
    assert pool.stats()["bytes_in_use"] == 0

    # 4. a backward that raises (a saved tensor modified in place)
    with co.offload(min_bytes=0, stream=stream, pool=pool):
        y = x.exp()
    y.mul_(2)
    loss = y.sum()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    del loss, y
    _settle_device_thread(device)
    assert pool.stats()["bytes_in_use"] == 0

    co.synchronize()
    pool.synchronize()
    st = pool.stats()
    assert st["bytes_pending"] == 0 and st["num_blocks_in_use"] == 0


@pytest.mark.parametrize("size", [1024, 8 * MiB // 4])  # kept (too small) and offloaded
@pytest.mark.parametrize("stream", STREAMS)
def test_inplace_modification_after_save_raises(device, pool, stream, size):
    x = torch.randn(size, device=device, requires_grad=True)
    with co.offload(min_bytes=64 * 1024, stream=stream, pool=pool) as ctx:
        y = x.exp()  # exp saves its result
    assert ctx.stats()["tensors_offloaded" if size * 4 >= 64 * 1024 else "tensors_kept"] >= 1
    y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


# A backward that raises on autograd's CUDA device thread (the unpack of an offloaded tensor that
# was modified in place), alone in a fresh process: a crash there (the H200 GPU machine's run of
# 2026-11-30 died by SIGSEGV in test_pool_blocks_return) fails this test with the faulthandler
# output instead of killing the whole pytest run. `warm`: the first steps of test_pool_blocks_return
# run before it in the same process (a backward, a dropped graph, retain_graph twice).
_RAISING_BACKWARD_SCRIPT = r"""
import faulthandler, sys
faulthandler.enable(all_threads=True)
import torch
import ckpt_offload as co

stream, size, warm = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
device = torch.device("cuda", torch.cuda.current_device())
pool = co.HostPool()
torch.manual_seed(0)
if warm:
    sys.path[:0] = sys.argv[4:6]  # this file's folder, and the helpers' it imports
    from test_gpu import make_transformer
    model = make_transformer().to(device)
    xm = torch.randn(4, 128, 256, device=device, requires_grad=True)
    for backward in ("once", "dropped", "retain"):
        with co.offload(min_bytes=0, stream=stream, pool=pool):
            loss = model(xm).pow(2).mean()
        if backward == "once":
            loss.backward()
        elif backward == "retain":
            loss.backward(retain_graph=True)
            loss.backward()
        del loss
    torch.cuda.synchronize()
    assert pool.stats()["bytes_in_use"] == 0, pool.stats()
x = torch.randn(size, device=device, requires_grad=True)
with co.offload(min_bytes=0, stream=stream, pool=pool) as ctx:
    y = x.exp()  # exp saves its result
assert ctx.stats()["tensors_offloaded"] == 1, ctx.stats()
y.mul_(2)
loss = y.sum()
try:
    loss.backward()
except RuntimeError as e:
    assert "modified by an inplace operation" in str(e), str(e)
else:
    raise AssertionError("backward did not raise")
del loss, y
# The device thread may still hold the raising node for a moment; a backward there orders after it.
t = torch.ones(1, device=device, requires_grad=True)
(t * 2).sum().backward()
torch.cuda.synchronize()
co.synchronize()
pool.synchronize()
st = pool.stats()
assert st["bytes_in_use"] == 0 and st["bytes_pending"] == 0 and st["num_blocks_in_use"] == 0, st
# The device thread is still usable: a normal offloaded backward after the raising one.
with co.offload(min_bytes=0, stream=stream, pool=pool):
    z = x.exp().sum()
z.backward()
torch.cuda.synchronize()
del z
co.synchronize()
pool.synchronize()
assert pool.stats()["bytes_in_use"] == 0, pool.stats()
print("clean")
"""


@pytest.mark.parametrize("warm", [False, True], ids=["alone", "after_steps_1_to_3"])
@pytest.mark.parametrize("size", [4 * 128 * 256, 8 * MiB // 4])
@pytest.mark.parametrize("stream", STREAMS)
def test_raising_backward_in_a_fresh_process(device, stream, size, warm, tmp_path):
    import os
    import subprocess
    import sys

    script = tmp_path / "raising_backward.py"
    script.write_text(_RAISING_BACKWARD_SCRIPT)
    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run(
        [sys.executable, "-X", "faulthandler", str(script), stream, str(size), "1" if warm else "0", here, TESTS_DIR],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and "clean" in proc.stdout, (
        f"exit {proc.returncode} (negative: killed by that signal)\nstdout:\n{proc.stdout[-4000:]}\n"
        f"stderr:\n{proc.stderr[-6000:]}"
    )


# ----------------------------------------------------------------------------------------------
# Invariant 2: stream ordering
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", STREAMS)
def test_d2h_copy_waits_for_producer(device, pool, stream):
    """The tensor is written by a kernel queued behind a long one, then offloaded at once: the
    D2H copy must not start before that kernel has run (else it copies the old bytes)."""
    n = 16 * MiB // 4
    buf = torch.empty(n, device=device)
    for i in range(20):
        buf.fill_(-1.0)
        torch.cuda.synchronize()
        _sleep()
        buf.fill_(float(i))  # the producer: runs only after the spin kernel
        h = co.offload_tensor(buf, pool=pool, stream=stream)
        out = h.reload()
        assert torch.equal(out, torch.full_like(out, float(i))), f"iteration {i}: D2H copy read stale data"


@pytest.mark.parametrize("stream", STREAMS)
def test_d2h_copy_after_matmul_chain(device, pool, stream):
    """Same hazard with real work: a chain of matmuls writes the saved tensor's memory last."""
    n = 2048
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, generator=gen)
    w = torch.randn(n, n, device=device, generator=gen) / math.sqrt(n)
    out = torch.empty(n, n, device=device)
    for i in range(6):
        out.fill_(float("nan"))
        y = a
        for _ in range(6):
            y = y @ w
        torch.mm(y, w, out=out)
        h = co.offload_tensor(out, pool=pool, stream=stream)
        ref = out.cpu()  # synchronizes; out still holds the product
        assert torch.equal(h.reload().cpu(), ref), f"iteration {i}: offloaded copy differs from the product"
        a = a.roll(1, 0)


@pytest.mark.parametrize("stream", STREAMS)
def test_source_memory_not_reused_before_d2h_finishes(device, pool, stream):
    """``del x`` right after offload: the caching allocator may hand x's block to the next
    same-size tensor at once. If the offload does not hold x until its copy has read it, the
    new tensor's fill (compute stream) overwrites bytes the D2H copy (side stream) still reads."""
    n = 64 * MiB // 4
    keep = []
    for i in range(12):
        x = torch.full((n,), float(i), device=device)
        _sleep()  # the D2H copy can start only after this; so can the fill below
        h = co.offload_tensor(x, pool=pool, stream=stream)
        del x
        y = torch.empty(n, device=device)
        y.fill_(-7.0)  # same size: the allocator's first choice is x's old block
        keep.append((i, h, y))
    for i, h, y in keep:
        r = h.reload()
        assert torch.equal(r, torch.full_like(r, float(i))), f"offload {i}: source memory was reused too early"
        assert torch.equal(y, torch.full_like(y, -7.0))


@pytest.mark.parametrize("stream", STREAMS)
def test_reload_consumer_waits_for_h2d(device, pool, stream):
    """The consumer of a reloaded tensor runs right after reload on the compute stream: it must
    not read the device buffer before the H2D copy has written it. Values change every
    iteration so that a stale buffer from the previous one is caught too."""
    n = 32 * MiB // 4
    base = torch.arange(n, device=device, dtype=torch.float32)
    handles = []
    for i in range(8):
        handles.append((i, co.offload_tensor(base + i, pool=pool, stream=stream)))
    co.synchronize()
    for _ in range(3):
        for i, h in handles:
            r = h.reload()
            consumed = r - i  # the consumer, enqueued right behind the copy
            assert torch.equal(consumed, base), f"handle {i}: consumer read the buffer before the H2D copy"
            del r, consumed


@pytest.mark.parametrize("stream", STREAMS)
def test_h2d_copy_waits_for_destination_to_be_free(device, pool, stream):
    """Note [Stream ordering] rule 2 (pytorch #106360 mirror): the reload buffer is allocated in compute-stream
    order. Its memory may still be the target of a kernel queued on the compute stream (here a
    fill of a freed tensor, held back by a spin kernel). A side-stream H2D copy that does not
    wait would land first and then be overwritten by the fill."""
    n = 32 * MiB // 4
    handles = [co.offload_tensor(torch.full((n,), float(i), device=device), pool=pool, stream=stream) for i in range(8)]
    co.synchronize()
    torch.cuda.synchronize()
    for i, h in enumerate(handles):
        _sleep()
        stale = torch.empty(n, device=device)
        stale.fill_(-1.0)  # queued behind the spin kernel
        del stale  # its block goes back to the allocator at once (stream-ordered reuse)
        r = h.reload()  # very likely gets that block
        got = r.clone()  # consumer
        assert torch.equal(got, torch.full_like(got, float(i))), f"reload {i}: H2D copy was overwritten"


@pytest.mark.parametrize("stream", STREAMS)
def test_offload_tensor_on_non_default_stream(device, pool, stream):
    """A tensor produced on a side ``torch.cuda.Stream`` and offloaded inside
    ``with torch.cuda.stream(s)``: the copy orders after *s*; reloading on s and on the
    default stream both see the values."""
    n = 16 * MiB // 4
    s = torch.cuda.Stream(device=device)
    s.wait_stream(torch.cuda.current_stream(device))
    results = []
    with torch.cuda.stream(s):
        for i in range(6):
            x = torch.empty(n, device=device)
            _sleep()
            x.fill_(float(i + 1))
            h = co.offload_tensor(x, pool=pool, stream=stream)
            del x
            z = torch.empty(n, device=device).fill_(-3.0)  # may take x's block (same stream)
            r = h.reload()
            results.append((i, h, r.clone(), z))
    torch.cuda.current_stream(device).wait_stream(s)
    for i, h, on_s, z in results:
        want = torch.full((n,), float(i + 1), device=device)
        assert torch.equal(on_s, want), f"{i}: reload on the producing stream differs"
        assert torch.equal(h.reload(), want), f"{i}: reload on the default stream differs"
        assert torch.equal(z, torch.full_like(z, -3.0))


# ----------------------------------------------------------------------------------------------
# Exact round trips
# ----------------------------------------------------------------------------------------------


ROUNDTRIP_DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int8,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
]


def _source(dtype, device, shape=(96, 160)):
    t = torch.arange(math.prod(shape), device=device).reshape(shape) % 251
    if dtype == torch.bool:
        return (t % 3) == 0
    signed = dtype.is_floating_point or dtype in (torch.int8, torch.int32, torch.int64)
    return (t - 125).to(dtype) if signed else t.to(dtype)


def _extent(t):
    """Elements of its storage a tensor reaches, from its first one."""
    if t.numel() == 0:
        return 0
    return 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))


def _layouts(base):
    return {
        "contiguous": base,
        "transposed": base.t(),
        "sliced_offset": base[3:, 5:],
        "row_offset": base[7],
        "strided_step": base[1::2, ::3],
        "expanded": base[0, :64].unsqueeze(1).expand(-1, 48),
        "expanded_column": base[:, :1].expand(-1, 64),
        "broadcast_row": base[0].unsqueeze(0).expand(32, -1),
        "scalar": base[4, 4],
        "permuted_3d": base.reshape(12, 8, 160).permute(2, 0, 1),
    }


@pytest.mark.parametrize("stream", STREAMS)
@pytest.mark.parametrize("dtype", ROUNDTRIP_DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_roundtrip_layouts(device, pool, dtype, stream):
    base = _source(dtype, device)
    for name, t in _layouts(base).items():
        h = co.offload_tensor(t, pool=pool, stream=stream)
        assert h.offloaded
        itemsize = t.element_size()
        # Exactly the span of storage the tensor reaches: an expanded tensor is stored at the
        # size of its source, not of the expansion.
        assert h.nbytes == _extent(t) * itemsize, f"{name}: nbytes {h.nbytes}"
        if name in ("expanded", "broadcast_row"):
            assert h.nbytes < t.numel() * itemsize
        r = h.reload()
        assert r.device == t.device and r.dtype == t.dtype, name
        assert r.shape == t.shape, name
        assert r.stride() == t.stride(), f"{name}: strides {r.stride()} != {t.stride()}"
        assert r.storage_offset() % max(1, 512 // itemsize) == t.storage_offset() % max(1, 512 // itemsize), name
        # The data pointer keeps its alignment mod 512: kernels pick code paths by alignment.
        assert r.data_ptr() % 512 == t.data_ptr() % 512, f"{name}: alignment changed"
        assert torch.equal(r, t), f"{name}: values differ"
    del r, h
    assert pool.stats()["bytes_in_use"] == 0


def test_roundtrip_pageable_pool_on_cuda(device):
    """A CUDA tensor into a pageable pool (pinned=False) still round-trips exactly."""
    pool = co.HostPool(pinned=False)
    x = torch.randn(1 << 20, device=device)[100:]
    for stream in STREAMS:
        h = co.offload_tensor(x, pool=pool, stream=stream)
        assert torch.equal(h.reload(), x)


@pytest.mark.parametrize("backend", ["pinned", "registered"])
def test_numa_placed_pinned_pool(device, backend):
    """Note [NUMA-local segments]: a pinned pool placed on a node (the GPU's where the host has
    several, else the first with memory) pins mapped memory with cudaHostRegister -- page-locked,
    not the pageable fallback -- round-trips through it, and every reserved byte is on the node."""
    from ckpt_offload import _numa

    node = co.HostPool(pinned=False).numa["numa_node"]
    if node is None:
        nodes = _numa.memory_nodes()
        if not nodes:
            pytest.skip("this kernel shows no NUMA nodes")
        node = nodes[0]
    pool = co.HostPool(backend=backend, numa_node=node)
    x = torch.randn(3 * MiB, device=device)[7:]
    for stream in STREAMS:
        h = co.offload_tensor(x, pool=pool, stream=stream)
        assert torch.equal(h.reload(), x)
    s = pool.stats()
    assert s["numa_node"] == node and s["backend"] == backend
    assert s["bytes_by_node"] == {node: s["bytes_reserved"]} and s["bytes_reserved"] >= x.nbytes
    assert pool.pinned_fallback()["segments"] == 0


@pytest.mark.parametrize("stream", STREAMS)
def test_reload_twice_and_shared_reload(device, pool, stream):
    x = torch.randn(4 * MiB // 4, device=device)
    h = co.offload_tensor(x, pool=pool, stream=stream)
    del x
    a = h.reload()
    b = h.reload()  # while `a` lives, the reloaded storage is shared
    assert torch.equal(a, b)
    ref = a.clone()
    del a, b
    c = h.reload()  # a fresh copy
    assert torch.equal(c, ref)


def test_offload_tensor_on_second_device(pool):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    dev = torch.device("cuda", 1)
    x = torch.randn(1 << 20, device=dev)
    for stream in STREAMS:
        h = co.offload_tensor(x, pool=pool, stream=stream)
        r = h.reload()
        assert r.device == dev and torch.equal(r, x)


WIDTH, HIDDEN, ROWS = 1024, 4096, 2048


def _mlp_step(blocks: int, options: dict | None) -> dict:
    """One measured training step of a `blocks`-deep MLP (Linear(1024, 4096), GELU,
    Linear(4096, 1024) per block, input 2048 x 1024 fp32), under one co.offload(**options)
    context reused for every step (None: no offload), after two warm-up steps (gradients exist,
    cuBLAS workspaces are allocated, the window's lead has adapted to this machine).

    Returns ``peak`` (max_memory_allocated during the step's backward above what was allocated
    at the step's start), ``held`` (allocated after the forward, copies drained, above the
    start: the saved activations still on the device), ``block`` (bytes one block saves: its
    input, the first Linear's output that GELU saves, GELU's output that the second Linear
    saves), ``largest`` (one saved tensor of the hidden width) and ``stats`` (the context's
    stats() of the measured step; None without offload).

    The backward is measured on its own, after the forward's copies have drained: a forward
    source stays allocated until its device-to-host copy has read it, so while copies lag
    behind compute the forward of an offloaded step can hold up to what the plain one holds.
    The prefetch window acts on the backward."""
    torch.manual_seed(0)
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, WIDTH)) for _ in range(blocks)]
    ).cuda()
    x = torch.randn(ROWS, WIDTH, device="cuda")
    ctx = co.offload(pool=co.HostPool(), **options) if options is not None else contextlib.nullcontext()

    def forward():
        with ctx:
            return model(x).sum()

    for _ in range(2):
        forward().backward()
    co.synchronize()
    torch.cuda.synchronize()
    if options is not None:
        ctx.reset_stats()  # the lead stays: it lives in the context
    start = torch.cuda.memory_allocated()
    loss = forward()
    co.synchronize()  # the forward's copies have finished and released their sources
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - start
    torch.cuda.reset_peak_memory_stats()
    loss.backward()
    del loss
    co.synchronize()
    torch.cuda.synchronize()
    return {
        "peak": torch.cuda.max_memory_allocated() - start,
        "held": held,
        "block": ROWS * (WIDTH + 2 * HIDDEN) * x.element_size(),
        "largest": ROWS * HIDDEN * x.element_size(),  # one saved tensor of the hidden width
        "stats": ctx.stats() if options is not None else None,
    }


def test_default_prefetch_window_lowers_the_backward_peak(device):
    """Note [Prefetch window] on a GPU, with thresholds derived from what the test measures and
    the memory formula of docs/api.md ("What stays on the device"), none guessed.

    Without offload the backward peaks at ``S + t``: the ``S`` bytes of saved activations
    (measured: allocated after the forward) plus the backward's temporaries ``t``. With offload the
    forward leaves ``K`` on the device (measured the same way), and backward holds, per the
    formula, the block being differentiated (at most one block's saved bytes ``A``, its reloads)
    plus what is prefetched (``P``, the context's own peak_prefetch_bytes, which the formula
    bounds by ``lead * A``, lead <= 8, and the 256 MiB cap -- checked too) plus the same kind of
    temporaries; those may peak at another node than the plain run's peak, by at most one more
    block's saved bytes. Hence ``auto <= plain - S + K + 2 * A + P``, a drop of at least
    ``S - K - 2 * A - P`` (12 blocks of 72 MiB: over half the step's activations). A window
    larger than the step prefetches every offloaded tensor but the first one backward asks for,
    all on the device at once: its peak is at least ``K + P_whole`` with ``P_whole >= offloaded -
    A``, i.e. back near the plain run's."""
    blocks = 12
    plain = _mlp_step(blocks, None)
    auto = _mlp_step(blocks, {})
    whole = _mlp_step(blocks, {"prefetch_bytes": 16 << 30})
    A = plain["block"]
    S = plain["held"]
    # The plain run's saved activations: every block's, but the first block's input x, which
    # existed before the step (nothing else stays: the final Linear's output is not saved).
    assert S >= blocks * A - ROWS * WIDTH * 4, (S, blocks * A)
    st = auto["stats"]
    P = st["peak_prefetch_bytes"]
    assert st["bytes_offloaded"] >= blocks * A - ROWS * WIDTH * 4  # everything went to the pool
    # The formula's bound on the window: lead (<= 8) blocks, at most 256 MiB, and at least one
    # reload in flight (a single tensor may exceed the window).
    assert P <= max(min(8 * A, DEFAULT_PREFETCH_BYTES), auto["largest"]), (P, A)
    K = auto["held"]
    assert K < A, (K, A)  # the forward kept (almost) nothing: parameters are not new memory
    bound = plain["peak"] - S + K + 2 * A + P
    assert auto["peak"] <= bound, (
        f"offload peak {auto['peak'] / MiB:.1f} MiB > {bound / MiB:.1f} MiB (plain {plain['peak'] / MiB:.1f} MiB, "
        f"saved {S / MiB:.1f} MiB, kept {K / MiB:.1f} MiB, block {A / MiB:.1f} MiB, prefetched {P / MiB:.1f} MiB)"
    )
    assert bound < plain["peak"]  # the check above is a real drop, not a restatement
    ws = whole["stats"]
    assert ws["peak_prefetch_bytes"] >= ws["bytes_offloaded"] - A, (ws["peak_prefetch_bytes"], ws["bytes_offloaded"])
    assert whole["peak"] >= whole["held"] + ws["peak_prefetch_bytes"], (whole["peak"], ws["peak_prefetch_bytes"])
