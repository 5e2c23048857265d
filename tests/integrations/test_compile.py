"""ckpt_offload with torch.compile: what works, measured on torch 2.14.1 (see README "Scale out").

- A compiled function or module inside ``co.offload``: AOTAutograd's compiled autograd function
  saves its tensors for backward with ``save_for_backward`` when it runs, so the active
  saved-tensor hooks -- ours -- see them. They are offloaded, and gradients are bit-identical to
  the same compiled code without ckpt_offload (and, with the ``aot_eager`` backend, to eager).
- A compiled block inside ``co.checkpoint(..., offload=...)`` / ``co.apply``: compile what the
  checkpoint runs (``co.checkpoint(torch.compile(block.forward), x, offload=True)``, or
  ``block.forward = torch.compile(block.forward)`` for each block, then ``co.apply``). The
  checkpoint's inputs go to the pool, the recompute in backward runs the compiled graph again.
- ``torch.compile`` *around* a checkpointed block (``co.apply`` then ``torch.compile(model)``):
  Dynamo skips the wrapper (a graph break) and the block's own forward is compiled as a graph of
  its own, run inside the checkpoint; tests/integrations/test_compile_wrapped_models.py checks that no block
  runs eagerly, for the demo model, GPT-2 and Llama.

Most tests use the ``aot_eager`` backend: it runs Dynamo and AOTAutograd (the parts that decide
what is saved for backward and through which hooks) without generating kernels, which takes
seconds on a 2-core CPU; one test uses inductor on a tiny function.
"""

import os
import warnings

import pytest
import torch

import ckpt_offload as co
from conftest import assert_bit_identical, cpu_offload, grads_of
from models_for_tests import Transformer

from torch._dynamo.utils import counters  # noqa: E402

VOCAB, SEQ = 97, 16


pytestmark = pytest.mark.usefixtures("_fresh_dynamo")  # tests/conftest.py


def make():
    torch.manual_seed(0)
    return Transformer(vocab=VOCAB, dim=64, layers=2, seq=SEQ).train()


def tokens():
    return torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(3))


def loss_of(model, ctx=None):
    t = tokens()
    torch.manual_seed(1234)  # dropout
    with ctx if ctx is not None else torch.enable_grad():
        logits = model(t[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), t[:, 1:].reshape(-1))


def grads(model, ctx=None):
    loss_of(model, ctx).backward()
    # torch.compile(module) puts the original under "_orig_mod."; the parameters are the same.
    return {k.replace("_orig_mod.", ""): v for k, v in grads_of(model).items()}


def graphs_compiled():
    return counters["stats"]["unique_graphs"]


def mlp_step(x, w1, w2):
    # A graph that saves several activations for backward (tanh's output, the hidden layer).
    h = torch.tanh(x @ w1)
    return (torch.nn.functional.gelu(h @ w2) * h.sum(-1, keepdim=True)).sum()


@pytest.mark.parametrize(
    "backend",
    [
        "aot_eager",
        # Inductor generates and compiles C++ kernels: ~50 s on a busy 2-core machine, too slow for CI.
        pytest.param(
            "inductor",
            marks=[
                pytest.mark.slow,
                pytest.mark.skipif(
                    not os.environ.get("CKPT_OFFLOAD_SLOW_TESTS"),
                    reason="slow (inductor's C++ compile); set CKPT_OFFLOAD_SLOW_TESTS=1",
                ),
            ],
        ),
    ],
)
def test_compiled_function_saved_tensors_are_offloaded(pool, backend):
    """One graph, no breaks: the tensors AOTAutograd's compiled function saves for backward go
    through co.offload's hooks into the pool, and come back bit-identical."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 128, generator=g, requires_grad=True)
    w1 = torch.randn(128, 256, generator=g, requires_grad=True)
    w2 = torch.randn(256, 128, generator=g, requires_grad=True)

    def run(f, ctx=None):
        for t in (x, w1, w2):
            t.grad = None
        with ctx if ctx is not None else torch.enable_grad():
            out = f(x, w1, w2)
        out.backward()
        return {n: t.grad.clone() for n, t in (("x", x), ("w1", w1), ("w2", w2))}

    eager = run(mlp_step)
    compiled = torch.compile(mlp_step, backend=backend)
    plain = run(compiled)
    ctx = cpu_offload(pool)
    got = run(compiled, ctx)
    assert graphs_compiled() == 1 and not counters["graph_break"], dict(counters["graph_break"])
    assert ctx.stats()["tensors_offloaded"] > 0 and ctx.stats()["tensors_reloaded"] > 0, ctx.stats()
    assert pool.stats()["bytes_in_use"] == 0
    assert_bit_identical(plain, got)  # the same compiled code with and without ckpt_offload
    if backend == "aot_eager":
        assert_bit_identical(eager, got)  # aot_eager runs the same ATen ops as eager
    else:
        # Inductor fuses and reorders the float32 sums (reassociation), so it differs from eager
        # by itself, by ~1e-5 of each gradient's scale here; ckpt_offload adds nothing (above).
        for k in eager:
            torch.testing.assert_close(got[k], eager[k], rtol=1e-3, atol=1e-3 * eager[k].abs().max().item())


def test_compiled_blocks_inside_offload_bit_identical(pool):
    base = grads(make())
    model = make()
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block, backend="aot_eager")
    plain = grads(model)
    model = make()
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block, backend="aot_eager")
    ctx = cpu_offload(pool)
    got = grads(model, ctx)
    assert graphs_compiled() > 0
    assert ctx.stats()["tensors_offloaded"] > 0
    assert pool.stats()["bytes_in_use"] == 0
    assert_bit_identical(plain, got)
    assert_bit_identical(base, got)


@pytest.mark.parametrize("how", ["checkpoint_compiled_forward", "compile_forward_then_apply"])
def test_compiled_code_inside_checkpoint_offload(pool, how):
    base = grads(make())
    model = make()
    opts = {"devices": ["cpu"], "min_bytes": 0, "pool": pool}
    if how == "checkpoint_compiled_forward":
        # The user's forward loop checkpoints a compiled block.
        for block in model.blocks:
            compiled = torch.compile(block.forward, backend="aot_eager")
            block.forward = lambda x, _c=compiled: co.checkpoint(_c, x, offload=opts)
    else:
        # Compile each block's forward, then let co.apply checkpoint what is there.
        for block in model.blocks:
            block.forward = torch.compile(block.forward, backend="aot_eager")
        co.apply(model, offload=opts)
    got = grads(model)
    assert graphs_compiled() > 0  # the compiled graphs ran (forward and the recompute)
    assert pool.stats()["num_allocs"] > 0 and pool.stats()["bytes_in_use"] == 0
    assert_bit_identical(base, got)


def test_compile_around_checkpointed_blocks_offloads_their_inputs(pool):
    """co.apply, then torch.compile of the whole model: Dynamo skips the wrapper and compiles the
    block's forward inside the checkpoint. Bit-identical gradients, the checkpoints' inputs in the
    pool."""
    base = grads(make())
    model = make()
    handle = co.apply(model, offload={"devices": ["cpu"], "min_bytes": 0, "pool": pool})
    compiled = torch.compile(model, backend="aot_eager")
    loss = loss_of(compiled)
    # One input per checkpointed block waits in the pool until backward.
    assert pool.stats()["num_blocks_in_use"] == len(handle.names) == 2
    loss.backward()
    got = {k.replace("_orig_mod.", ""): v for k, v in grads_of(compiled).items()}
    assert pool.stats()["bytes_in_use"] == 0
    assert_bit_identical(base, got)


def test_offload_adds_no_global_hook_warning_or_graph_break(pool):
    model = make()
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block, backend="aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grads(model, cpu_offload(pool))
    hooks_warnings = [str(w.message) for w in caught if "global hooks" in str(w.message)]
    assert not hooks_warnings, hooks_warnings
    assert not counters["graph_break"], dict(counters["graph_break"])
