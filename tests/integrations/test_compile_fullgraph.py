"""torch.compile(model, fullgraph=True) over a model whose blocks co.apply (or a plan) checkpointed
with their inputs offloaded: one graph, no break.

While Dynamo traces with fullgraph=True the wrapper is traced too: torch's non-reentrant
checkpoint (a higher-order op) around the block, its offloaded inputs copied into the pool by the
``ckpt_offload::to_host`` op (a CPU tensor over a pool block, what AOTAutograd saves) and brought
back by ``ckpt_offload::to_device`` as the checkpointed region starts (so the recompute in
backward starts there too). The tests check, for the demo model, GPT-2 and Llama from tiny
configs: one graph and no graph break, gradients bit-identical to the same model compiled without
ckpt_offload (``aot_eager``), the pool back to 0 bytes, the ops' fake kernels (``opcheck``), the
forward's device peak (torch.profiler memory events), and once, inductor. Also: a broadcast input
stored at its source's size (the pool's peak and the forward's, against eager co.apply), torch's
checkpoint keywords traced, and those that cannot be traced named in the error.
"""

import functools
import itertools
import math
import os

import pytest
import torch
from compile_models import MODELS, CountingBackend, forward_peak, grads, mlp_blocks, reference, wrap
from conftest import assert_bit_identical

import ckpt_offload as co

pytest.importorskip("torch._dynamo")
from torch._dynamo.utils import counters

OPTS = {"devices": ["cpu"], "min_bytes": 0}


pytestmark = pytest.mark.usefixtures("_fresh_dynamo")  # tests/conftest.py


def build(name):
    model, loss_fn, blocks = MODELS[name]()
    # transformers' loss_function warns through a logger when loss_type is unset: under
    # fullgraph=True that call would be the graph break (nothing of ckpt_offload's).
    if hasattr(model, "loss_function"):
        model.loss_type = "ForCausalLM"
    return model, loss_fn, blocks


def torch_checkpoint_refuses(name):
    """Why torch.compile(fullgraph=True) cannot trace the model with the model's own gradient
    checkpointing (torch's non-reentrant checkpoint, no ckpt_offload), or None when it can. A block
    whose forward changes state outside it (transformers' hub kernels set a context variable in
    attention's forward) is refused by Dynamo inside any checkpoint."""
    model, loss_fn, _ = build(name)
    if not hasattr(model, "gradient_checkpointing_enable"):
        return None
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    torch._dynamo.reset()
    try:
        loss_fn(torch.compile(model, backend="aot_eager", fullgraph=True)).backward()
    except torch._dynamo.exc.Unsupported as e:
        return str(e).splitlines()[0]
    finally:
        torch._dynamo.reset()
    return None


CASES = [
    ("demo", "co.apply"),
    ("demo", "plan recompute_offload"),
    ("gpt2", "co.apply"),
    ("llama", "co.apply"),
    ("gpt2", "co.hf.enable"),
    ("llama", "co.hf.enable"),
]


@pytest.mark.parametrize("name,route", CASES, ids=[f"{n}-{r.replace(' ', '_')}" for n, r in CASES])
def test_fullgraph_compiles_one_graph_with_bit_identical_gradients(pool, name, route):
    expected = reference(name)
    counters.clear()
    model, loss_fn, blocks = build(name)
    handle = wrap(route, model, loss_fn, pool)
    backend = CountingBackend()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1234)
    try:
        loss = loss_fn(compiled)
    except torch._dynamo.exc.Unsupported:
        why = torch_checkpoint_refuses(name)
        if why is None:
            raise  # torch's own checkpoint traces this model: so must ours
        pytest.skip(f"torch's own checkpoint cannot trace this model's blocks under fullgraph=True either: {why}")
    # One graph for the whole model; each block's input offloaded once inside it.
    assert backend.graphs == 1 and not counters["graph_break"], dict(counters["graph_break"])
    assert backend.ops.count("ckpt_offload.to_host") >= len(blocks), backend.ops
    # Between forward and backward the blocks' inputs wait in the pool.
    assert pool.stats()["num_blocks_in_use"] >= len(blocks), pool.stats()
    loss.backward()
    got = {k.replace("_orig_mod.", ""): p.grad.clone() for k, p in compiled.named_parameters() if p.grad is not None}
    assert pool.stats()["bytes_in_use"] == 0 and pool.stats()["num_allocs"] > 0, pool.stats()
    assert_bit_identical(expected, got)
    # Eager, the same wrapped model still offloads through its contexts (the handle counts them).
    grads(model, loss_fn)
    assert handle.stats()["tensors_offloaded"] > 0


def test_default_mode_is_unchanged(pool):
    """Without fullgraph the wrapper is still a graph break and each block's forward a graph of its own."""
    model, loss_fn, _ = MODELS["demo"]()
    handle = co.apply(model, offload={**OPTS, "pool": pool})
    backend = CountingBackend()
    grads(torch.compile(model, backend=backend), loss_fn)
    # The blocks ran compiled inside their offload contexts (which count), no op in any graph.
    assert backend.graphs >= 1 and not backend.ops, (backend.graphs, backend.ops)
    assert handle.stats()["tensors_offloaded"] > 0
    assert pool.stats()["bytes_in_use"] == 0


def _policy_context():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])


TRACED_KEYWORDS = {
    "determinism_check": {"determinism_check": "none"},
    "early_stop": {"early_stop": False},
    "debug_preserve_rng_state": {"debug": False, "preserve_rng_state": False},
}


@pytest.mark.parametrize("keywords", list(TRACED_KEYWORDS.values()), ids=list(TRACED_KEYWORDS))
def test_torch_checkpoint_keywords_trace_with_bit_identical_gradients(pool, keywords):
    """The keywords torch's own checkpoint compiles with fullgraph=True compile through co.apply
    too (Note [Keywords under fullgraph=True]): one graph, each block's input offloaded in it, the
    gradients those of the model compiled without ckpt_offload."""
    expected = reference("sequential")
    model, loss_fn, blocks = build("sequential")
    wrap("co.apply", model, loss_fn, pool, **keywords)
    backend = CountingBackend()
    got = grads(torch.compile(model, backend=backend, fullgraph=True), loss_fn)
    assert backend.graphs == 1 and not counters["graph_break"], dict(counters["graph_break"])
    assert backend.ops.count("ckpt_offload.to_host") == len(blocks), backend.ops
    assert pool.stats()["bytes_in_use"] == 0 and pool.stats()["num_allocs"] >= len(blocks), pool.stats()
    assert_bit_identical(expected, got)


def test_selective_checkpoint_without_offload_traces(pool):
    """co.apply(model, context_fn=...) without offload is torch's selective checkpoint, which
    compiles with fullgraph=True: so does co.apply's."""
    expected = reference("sequential")
    model, loss_fn, _ = build("sequential")
    co.apply(model, context_fn=_policy_context())
    backend = CountingBackend()
    got = grads(torch.compile(model, backend=backend, fullgraph=True), loss_fn)
    assert backend.graphs == 1 and not counters["graph_break"], dict(counters["graph_break"])
    assert_bit_identical(expected, got)


BF16 = "offload={'store_dtype': torch.bfloat16}"
UNTRACED = {  # (model, route, keywords, what the message names); context_fn None: a policy's
    "store_dtype": ("sequential", "co.apply", {"store_dtype": torch.bfloat16}, BF16),
    "debug": ("sequential", "co.apply", {"debug": True}, "debug=True"),
    "context_fn_with_offload": ("sequential", "co.apply", {"context_fn": None}, "context_fn= (a selective-checkpoint"),
    "hf_store_dtype": ("gpt2", "co.hf.enable", {"store_dtype": torch.bfloat16}, BF16),
}


@pytest.mark.parametrize("name,route,keywords,named", list(UNTRACED.values()), ids=list(UNTRACED))
def test_a_keyword_that_cannot_be_traced_is_named(pool, name, route, keywords, named):
    """A keyword whose checkpoint cannot be traced faithfully raises under fullgraph=True with a
    message naming that keyword and what to do -- not the message that lists co.apply(model,
    offload=...) as what compiles, which is what the user wrote."""
    if keywords.get("context_fn", 0) is None:
        keywords = {"context_fn": _policy_context()}
    model, loss_fn, _ = build(name)
    wrap(route, model, loss_fn, pool, **keywords)
    with pytest.raises(Exception, match=r"fullgraph=True") as info:
        loss_fn(torch.compile(model, backend="aot_eager", fullgraph=True))
    message = str(info.value)
    assert f"cannot trace {named}" in message, message
    assert "compile without fullgraph" in message, message
    assert "What compiles with fullgraph=True" not in message, message


def test_the_ops_have_fake_kernels(pool):
    from ckpt_offload._compile_ops import pool_key

    x = torch.randn(4, 8)
    key = pool_key(pool)
    torch.library.opcheck(torch.ops.ckpt_offload.to_host.default, (x, key, False))
    host = torch.ops.ckpt_offload.to_host(x, key, False)
    assert co._runtime._C.compile_pool_backed(host) and host.device.type == "cpu"
    assert pool.stats()["bytes_in_use"] >= x.numel() * x.element_size()
    torch.library.opcheck(torch.ops.ckpt_offload.to_device.default, (host, torch.device("cpu"), False))
    back = torch.ops.ckpt_offload.to_device(host, torch.device("cpu"), False)
    assert torch.equal(back, x)
    del host
    assert pool.stats()["bytes_in_use"] == 0


def test_a_route_that_cannot_compile_fullgraph_says_which_does(pool):
    model, loss_fn, _ = MODELS["demo"]()
    plan = co.plan(
        model,
        lambda: loss_fn(model).backward(),
        budget=2**40,
        bandwidth=math.inf,
        kinds=("offload",),
        segments=False,
        offload={**OPTS, "pool": pool},
    )
    model.zero_grad(set_to_none=True)
    plan.apply()
    with pytest.raises(Exception, match=r"fullgraph=True") as info:
        loss_fn(torch.compile(model, backend="aot_eager", fullgraph=True))
    assert "co.apply(model, offload=...)" in str(info.value) and "recompute_offload" in str(info.value), str(info.value)


def test_a_full_pool_raises_in_the_compiled_graph():
    """The graph cannot keep an input on the device instead of in a full pool: it says so."""
    small = co.HostPool(pinned=False, max_bytes=4096)
    model = mlp_blocks(2, 128)
    co.apply(model, offload={**OPTS, "pool": small})
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with pytest.raises(co.PoolFullError):
        compiled(torch.randn(64, 128))  # 32 KiB per block input, over the 4 KiB cap
    assert small.stats()["bytes_in_use"] == 0


def test_fullgraph_forward_peak_is_eager_offloaded_peak(pool):
    """The compiled model's forward keeps what eager co.apply keeps on the device (+5%), and far
    less than the same model compiled without ckpt_offload."""
    x = torch.randn(64, 128)
    peaks = {}
    for compiled in (False, True):
        model = mlp_blocks()
        # Copies on the compute stream: both peaks are the model's, not how far delayed side-stream
        # copies lagged behind the forward.
        co.apply(model, offload={**OPTS, "pool": pool, "stream": "compute"})
        fn = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
        fn(x).sum().backward()  # warm-up (compiles)
        peaks[compiled] = forward_peak(lambda fn=fn: fn(x).sum())
        assert pool.stats()["bytes_in_use"] == 0
    plain = torch.compile(mlp_blocks(), backend="aot_eager")
    without = forward_peak(lambda: plain(x).sum())
    assert peaks[True] <= 1.05 * peaks[False], peaks
    assert peaks[True] < 0.5 * without, (peaks, without)


class AddBias(torch.nn.Module):
    """A block that takes the broadcast tensor as its second input."""

    def __init__(self, dim=32):
        super().__init__()
        self.a, self.b = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim)

    def forward(self, x, bias):
        return self.b(torch.nn.functional.gelu(self.a(x).unsqueeze(1) + bias)).mean(1)


class BroadcastModel(torch.nn.Module):
    """Four blocks, each given one broadcast tensor: tanh(p) expanded over the batch (stride 0),
    64 times the bytes of its source."""

    def __init__(self, n=4, dim=32, t=8):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(AddBias(dim) for _ in range(n))
        self.p = torch.nn.Parameter(torch.randn(1, t, dim))

    def forward(self, x):
        bias = torch.tanh(self.p).expand(x.shape[0], -1, -1)
        for block in self.blocks:
            x = block(x, bias)
        return x


def test_fullgraph_stores_a_broadcast_input_at_its_source_size(pool):
    """An expanded (broadcast) input of every block is stored at its source's size, as the eager
    route stores it (Note [Span copies in a compiled graph]): the pool's peak and the forward's
    device peak (profiler memory events) are eager co.apply's, and the gradients those of the model
    compiled without ckpt_offload."""
    x = torch.randn(64, 32)
    source_bytes, dense_bytes = 8 * 32 * 4, 64 * 8 * 32 * 4
    pool_peak, forward_peaks, got = {}, {}, {}
    for compiled in (False, True):
        model = BroadcastModel()
        co.apply(model, offload={**OPTS, "pool": pool, "stream": "compute"})
        fn = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
        fn(x).sum().backward()  # warm-up (compiles)
        model.zero_grad(set_to_none=True)
        pool.reset_peak()
        loss = fn(x).sum()
        pool_peak[compiled] = pool.stats()["peak_bytes_in_use"]
        loss.backward()
        got[compiled] = {k: p.grad.clone() for k, p in model.named_parameters()}
        forward_peaks[compiled] = forward_peak(lambda fn=fn: fn(x).sum())
        assert pool.stats()["bytes_in_use"] == 0
    inputs = 4 * 64 * 32 * 4  # the four blocks' x
    # Eager stores the broadcast tensor once, at its source's size (+ each block's 512-byte alignment).
    assert pool_peak[False] <= inputs + source_bytes + 5 * 512 < inputs + dense_bytes, pool_peak
    assert pool_peak[True] <= pool_peak[False], pool_peak
    assert forward_peaks[True] <= 1.05 * forward_peaks[False], forward_peaks
    plain = BroadcastModel()
    plain_grads = grads(torch.compile(plain, backend="aot_eager"), lambda m: m(x).sum())
    assert_bit_identical(plain_grads, got[True])
    assert_bit_identical(got[False], got[True])


def test_the_ops_keep_sizes_and_strides_and_copy_the_span(pool):
    """to_host / to_device of an expanded and a transposed tensor: the same sizes, strides and
    values, a pool block of the span's bytes (not the expanded size), and fake kernels that say so."""
    from ckpt_offload._compile_ops import pool_key

    key = pool_key(pool)
    source = torch.randn(1, 8, 32)
    for x in (source.expand(64, 8, 32), torch.randn(32, 16).t(), torch.randn(4, 8)[:, ::2]):
        torch.library.opcheck(torch.ops.ckpt_offload.to_host.default, (x, key, False))
        host = torch.ops.ckpt_offload.to_host(x, key, False)
        assert (host.shape, host.stride()) == (x.shape, x.stride()), (host.stride(), x.stride())
        span = host.untyped_storage().nbytes()
        assert span == (1 + sum((n - 1) * st for n, st in zip(x.shape, x.stride()))) * x.element_size()
        assert pool.stats()["bytes_requested"] == span, pool.stats()
        torch.library.opcheck(torch.ops.ckpt_offload.to_device.default, (host, torch.device("cpu"), False))
        back = torch.ops.ckpt_offload.to_device(host, torch.device("cpu"), False)
        assert (back.shape, back.stride()) == (x.shape, x.stride()) and torch.equal(back, x)
        assert back.untyped_storage().nbytes() == span
        del host
        assert pool.stats()["bytes_in_use"] == 0


@pytest.mark.xfail(
    tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 12),
    strict=True,
    reason="torch 2.11's partitioner puts 3 of the 4 reloads in the forward graph (docs/scale_out.md)",
)
def test_backward_reloads_block_by_block(pool):
    """In the compiled backward each block's input comes back as that block's backward starts
    (between the matmuls of the block after it and its own), not all up front."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    order = []

    def bw(gm, example_inputs):
        order.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return make_boxed_func(gm)

    model = mlp_blocks(4, 64)
    co.apply(model, offload={**OPTS, "pool": pool})
    backend = aot_autograd(fw_compiler=lambda gm, example_inputs: make_boxed_func(gm), bw_compiler=bw)
    torch.compile(model, backend=backend, fullgraph=True)(torch.randn(8, 64)).sum().backward()
    reloads = [i for i, t in enumerate(order) if t == "ckpt_offload.to_device.default"]
    assert len(reloads) == 4, order
    for a, b in itertools.pairwise(reloads):
        assert any(t == "aten.mm.default" for t in order[a:b]), (a, b, order)
    assert pool.stats()["bytes_in_use"] == 0


def test_compiled_autograd_gradients_and_pool(pool):
    """Compiled autograd over the fullgraph model: bit-identical gradients, the pool drained."""
    expected = reference("demo")
    model, loss_fn, _ = build("demo")
    co.apply(model, offload={**OPTS, "pool": pool})
    torch._dynamo.config.compiled_autograd = True
    try:
        got = grads(torch.compile(model, backend="aot_eager", fullgraph=True), loss_fn)
    finally:
        torch._dynamo.config.compiled_autograd = False
    assert pool.stats()["bytes_in_use"] == 0 and pool.stats()["num_allocs"] > 0, pool.stats()
    assert_bit_identical(expected, got)


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("CKPT_OFFLOAD_SLOW_TESTS"), reason="slow (inductor's C++ compile); set CKPT_OFFLOAD_SLOW_TESTS=1"
)
def test_fullgraph_inductor_compiles_and_runs(pool):
    model, loss_fn, blocks = MODELS["demo"]()
    torch.manual_seed(1234)
    plain = grads(torch.compile(MODELS["demo"]()[0], backend="inductor"), loss_fn)
    torch._dynamo.reset()
    co.apply(model, offload={**OPTS, "pool": pool})
    got = grads(torch.compile(model, backend="inductor", fullgraph=True), loss_fn)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert pool.stats()["bytes_in_use"] == 0 and pool.stats()["num_allocs"] >= len(blocks), pool.stats()
    # Inductor fuses differently with and without the checkpoint: within its own float32 noise.
    for k in plain:
        torch.testing.assert_close(got[k], plain[k], rtol=1e-4, atol=1e-5 * max(1.0, plain[k].abs().max().item()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("stream", ["side", "compute"])
def test_fullgraph_on_cuda_offloads_through_the_pool(stream):
    pool = co.HostPool()
    torch.manual_seed(0)
    x = torch.randn(64, 128, device="cuda")
    expected_model = mlp_blocks().cuda()
    expected_model(x).sum().backward()
    expected = {k: p.grad.clone() for k, p in expected_model.named_parameters()}
    model = mlp_blocks().cuda()
    co.apply(model, offload={"devices": ["cuda"], "min_bytes": 0, "pool": pool, "stream": stream})
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    loss = compiled(x).sum()
    assert pool.stats()["num_blocks_in_use"] >= 6
    loss.backward()
    torch.cuda.synchronize()
    got = {k.replace("_orig_mod.", ""): p.grad for k, p in compiled.named_parameters()}
    assert_bit_identical(expected, got)
    co.synchronize()
    pool.synchronize()
    assert pool.stats()["bytes_in_use"] == 0, pool.stats()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_ops_copy_through_the_pool_in_stream_order():
    from ckpt_offload._compile_ops import pool_key

    pool = co.HostPool()
    key = pool_key(pool)
    x = torch.randn(1 << 20, device="cuda")
    expected = x.clone()
    host = torch.ops.ckpt_offload.to_host(x, key, True)
    x.add_(1)  # after the op returned: the copy reads a clone made before
    first = torch.ops.ckpt_offload.to_device(host, torch.device("cuda"), True)  # the forward's: from the clone
    again = torch.ops.ckpt_offload.to_device(host, torch.device("cuda"), True)  # the backward's: from the block
    assert torch.equal(first, expected) and torch.equal(again, expected)
    assert co._runtime._C.compile_pool_backed(host) and host.device.type == "cpu"
    del host, first, again
    torch.cuda.synchronize()
    co.synchronize()
    pool.synchronize()
    assert pool.stats()["bytes_in_use"] == 0, pool.stats()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_ops_copy_the_span_of_a_broadcast_tensor():
    """On a GPU too (the forward's reload from the clone, the backward's from the block): an
    expanded tensor takes its source's bytes and comes back with its sizes and strides."""
    from ckpt_offload._compile_ops import pool_key

    pool = co.HostPool()
    key = pool_key(pool)
    source = torch.randn(1, 8, 1024, device="cuda")
    x = source.expand(64, 8, 1024)
    host = torch.ops.ckpt_offload.to_host(x, key, True)
    assert (host.shape, host.stride()) == (x.shape, x.stride())
    assert pool.stats()["bytes_requested"] == source.numel() * source.element_size(), pool.stats()
    first = torch.ops.ckpt_offload.to_device(host, torch.device("cuda"), True)  # the forward's: from the clone
    again = torch.ops.ckpt_offload.to_device(host, torch.device("cuda"), True)  # the backward's: from the block
    for back in (first, again):
        assert (back.shape, back.stride()) == (x.shape, x.stride())
        assert back.untyped_storage().nbytes() == source.numel() * source.element_size()
        assert torch.equal(back, x)
    del host, first, again
    torch.cuda.synchronize()
    co.synchronize()
    pool.synchronize()
    assert pool.stats()["bytes_in_use"] == 0, pool.stats()
