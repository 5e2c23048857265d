"""torch.compile of a whole model that co.apply, a plan or co.hf.enable wrapped.

Each wrapped block is a graph break: Dynamo skips the wrapper, and the block's own forward is
compiled as a graph of its own, run inside the block's offload context or checkpoint (the
recompute in backward runs the compiled graph again). The tests check, for the demo model and
GPT-2 built from tiny configs, and for blocks that are torch's own nn.Sequential:

- no block forward runs eagerly, in forward or in its recompute: a probe on a layer inside each
  block counts its eager calls (a hook that Dynamo traces into the graph counts nothing at run
  time), and a counting backend counts the compiled graphs' runs: at least one per block in
  forward, and one more per checkpoint in backward;
- gradients bit-identical to the same compiled model without ckpt_offload (``aot_eager`` runs the
  same ATen ops as eager), the pool back to 0 bytes;
- the forward's device peak (torch.profiler memory events) equal to eager's with co.apply;
- compiled autograd brings the offloaded tensors back one by one;
- ``fullgraph=True`` over a route that has no traced form raises, saying what works.
"""

import math
import warnings

import pytest
import torch
from compile_models import MODELS, CountingBackend, EagerProbe, forward_peak, grads, mlp_blocks, reference, wrap
from conftest import assert_bit_identical

import ckpt_offload as co

pytest.importorskip("torch._dynamo")
from torch._dynamo.utils import counters

OPTS = {"devices": ["cpu"], "min_bytes": 0}


pytestmark = pytest.mark.usefixtures("_fresh_dynamo")  # tests/conftest.py


# --- every wrapped block runs compiled, forward and recompute ---------------------------------------

CASES = [
    ("demo", "co.apply"),
    ("demo", "co.apply segments"),
    ("demo", "plan offload"),
    ("demo", "plan recompute_offload"),
    ("gpt2", "co.hf.enable"),
    ("sequential", "co.apply"),
]
RECOMPUTES = {
    "co.apply": True,
    "co.apply segments": True,
    "plan offload": False,
    "plan recompute_offload": True,
    "co.hf.enable": True,
}


@pytest.mark.parametrize("name,route", CASES, ids=[f"{n}-{r.replace(' ', '_')}" for n, r in CASES])
def test_each_block_is_compiled_and_gradients_are_bit_identical(pool, name, route):
    """torch.compile(model) over a wrapped model: no block's forward runs eagerly, in forward or in
    its recompute (a probe inside each block counts eager calls; a counting backend counts the
    compiled graphs' runs), and the gradients are those of the same model compiled without
    ckpt_offload. The "sequential" blocks are torch's own nn.Sequential (Note [A compiled region of
    its own])."""
    expected = reference(name)
    model, loss_fn, probed = MODELS[name](part="mlp")
    probe = EagerProbe(probed)
    handle = wrap(route, model, loss_fn, pool)
    grads(model, loss_fn)
    assert probe.calls >= len(probed), "the probe counts eager calls"  # it can fail
    probe.calls = 0
    backend = CountingBackend()
    compiled = torch.compile(model, backend=backend)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1234)
    loss = loss_fn(compiled)
    assert probe.calls == 0, f"{probe.calls} block forwards ran eagerly under torch.compile (forward)"
    assert backend.graphs >= 1 and backend.runs >= len(probed), (backend.graphs, backend.runs)
    forward_runs = backend.runs
    loss.backward()
    assert probe.calls == 0, f"{probe.calls} block forwards ran eagerly under torch.compile (recompute)"
    if RECOMPUTES[route]:
        # Backward runs no forward graph but the recomputes: at least one per checkpoint.
        checkpoints = 1 if route == "co.apply segments" else len(probed)
        assert backend.runs - forward_runs >= checkpoints, (forward_runs, backend.runs)
    else:
        assert backend.runs == forward_runs, (forward_runs, backend.runs)
    got = {k.replace("_orig_mod.", ""): p.grad.clone() for k, p in compiled.named_parameters() if p.grad is not None}
    assert pool.stats()["bytes_in_use"] == 0 and pool.stats()["num_allocs"] > 0, pool.stats()
    assert handle.stats()["tensors_offloaded"] > 0
    assert_bit_identical(expected, got)


def test_recompute_runs_the_compiled_graph(pool):
    """A checkpointed block's forward and its recompute are both runs of its compiled graph: one of
    each per block, and the blocks (of one class) share one compiled graph."""
    model, loss_fn, blocks = MODELS["sequential"]()
    co.apply(model, offload={**OPTS, "pool": pool})
    backend = CountingBackend()
    compiled = torch.compile(model, backend=backend)
    loss_fn(compiled).backward()  # compiles (the first block's call may compile twice: its input needs no grad)
    graphs, runs = backend.graphs, backend.runs
    loss = loss_fn(compiled)
    assert backend.runs - runs == len(blocks), (runs, backend.runs)  # one run per block forward
    forward_runs = backend.runs
    loss.backward()
    assert backend.runs - forward_runs == len(blocks), (forward_runs, backend.runs)  # one per recompute
    assert backend.graphs == graphs <= 2, (graphs, backend.graphs)  # nothing compiled again, nor per block
    assert pool.stats()["bytes_in_use"] == 0


def test_co_apply_keeps_its_forward_peak_under_whole_model_compile(pool):
    """The blocks run compiled (counted), and the forward's peak stays eager co.apply's but for what
    one compiled block holds: its graph hands the activations it saves for backward to the
    checkpoint (which drops them) only when it ends, where eager drops each as it is made -- at most
    one block's saved activations (its hidden layer before and after GELU) more."""
    x = torch.randn(64, 128)
    one_block_saved = 2 * 64 * 512 * 4
    peaks = {}
    for compiled in (False, True):
        model = mlp_blocks()
        # Copies on the compute stream: each source is released as its copy ends, so both peaks are
        # the model's, not how far the side stream's (delayed) copies lagged behind the forward.
        co.apply(model, offload={**OPTS, "pool": pool, "stream": "compute"})
        backend = CountingBackend()
        fn = torch.compile(model, backend=backend) if compiled else model
        fn(x).sum().backward()  # warm-up (compiles)
        runs = backend.runs
        peaks[compiled] = forward_peak(lambda fn=fn: fn(x).sum())
        assert backend.runs - runs == (len(model) if compiled else 0), (runs, backend.runs)
        assert pool.stats()["bytes_in_use"] == 0
    plain = mlp_blocks()
    without = forward_peak(lambda: torch.compile(plain, backend="aot_eager")(x).sum())
    assert peaks[True] <= peaks[False] + one_block_saved, peaks
    assert peaks[True] < 0.5 * without, (peaks, without)  # the saving is real: less than half


# --- compiled autograd ---------------------------------------------------------------------------


@pytest.mark.parametrize("route", ["co.apply", "plan offload"])
def test_compiled_autograd_reloads_one_by_one_and_warns_once(pool, route, monkeypatch):
    """Under compiled autograd backward reloads the offloaded tensors block by block as it needs
    them (counted when each block's first weight gets its gradient: one block's more each time),
    gradients bit-identical, the pool drained. Compiled autograd's graph keeps what it unpacked
    alive to its end (measured: the pool's bytes in use stay at the step's until backward ends,
    where without it they fall block by block), so ckpt_offload warns once, saying so."""
    from ckpt_offload import _compile

    monkeypatch.setattr(_compile, "_warned_compiled_autograd", False)
    n = 4
    x = torch.randn(32, 64, requires_grad=True)

    def run(compiled_autograd):
        torch._dynamo.reset()
        model = mlp_blocks(n, 64)
        opts = {**OPTS, "pool": pool, "prefetch_bytes": 0}
        if route == "co.apply":
            handle = co.apply(model, offload=opts)
        else:
            handle = co.plan(
                model,
                lambda: model(x).sum().backward(),
                budget=2**40,
                bandwidth=math.inf,
                kinds=("offload",),
                segments=False,
                offload=opts,
            ).apply()
        model.zero_grad(set_to_none=True)
        x.grad = None
        reloads = []  # (block, tensors reloaded so far, pool bytes in use) as each block's weight gets its grad
        for i, block in enumerate(model):
            block[0].weight.register_post_accumulate_grad_hook(
                lambda p, i=i: reloads.append((i, handle.stats()["tensors_reloaded"], pool.stats()["bytes_in_use"]))
            )
        # Compiled autograd is on for the backward of a compiled step made while the flag is set.
        monkeypatch.setattr(torch._dynamo.config, "compiled_autograd", compiled_autograd)
        compiled = torch.compile(model, backend="aot_eager")

        def step():
            compiled(x).sum().backward()

        handle.reset_stats()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.compile(step, backend="aot_eager")()
        monkeypatch.setattr(torch._dynamo.config, "compiled_autograd", False)
        g = {k: p.grad.clone() for k, p in model.named_parameters()}
        g["x"] = x.grad.clone()
        per_block = handle.stats()["tensors_reloaded"] // n
        return g, reloads, per_block, [str(w.message) for w in caught if "compiled autograd" in str(w.message)]

    counters.clear()
    base, plain_reloads, per_block, quiet = run(False)
    got, reloads, _, warned = run(True)
    assert counters["compiled_autograd"]["captures"] >= 1, dict(counters["compiled_autograd"])
    assert per_block >= 1
    one_by_one = [(n - 1 - k, per_block * (k + 1)) for k in range(n)]
    assert [r[:2] for r in plain_reloads] == one_by_one, plain_reloads
    assert [r[:2] for r in reloads] == one_by_one, reloads
    assert not quiet
    assert len(warned) == 1 and "one by one" in warned[0] and "Keep compiled autograd off" in warned[0], warned
    assert pool.stats()["bytes_in_use"] == 0
    assert_bit_identical(base, got)


# --- fullgraph -----------------------------------------------------------------------------------


def test_fullgraph_over_wrapped_model_says_what_works(pool):
    # A plan's "offload" blocks run inside an offload context: no fullgraph route (co.apply's
    # checkpoints have one: tests/integrations/test_compile_fullgraph.py).
    model = mlp_blocks(2, 16)
    x = torch.randn(2, 16)
    co.plan(
        model,
        lambda: model(x).sum().backward(),
        budget=2**40,
        bandwidth=math.inf,
        kinds=("offload",),
        segments=False,
        offload={**OPTS, "pool": pool},
    ).apply()
    model.zero_grad(set_to_none=True)
    with pytest.raises(Exception, match=r"fullgraph=True") as info:
        torch.compile(model, backend="aot_eager", fullgraph=True)(torch.randn(2, 16))
    message = str(info.value)
    assert "without fullgraph" in message and "compiled as a graph of its own" in message, message
    assert "co.apply(model, offload=...)" in message, message


# --- routes that compile but keep no saving warn once --------------------------------------------


def _messages(caught, needle):
    return [str(w.message) for w in caught if needle in str(w.message)]


def test_whole_model_compiled_inside_co_offload_warns_once(pool, monkeypatch):
    from ckpt_offload import _compile

    monkeypatch.setattr(_compile, "_region_check", {"warned": False})
    x = torch.randn(16, 32)
    expected = grads(torch.compile(mlp_blocks(2, 32), backend="aot_eager"), lambda m: m(x).sum())
    torch._dynamo.reset()
    model = mlp_blocks(2, 32)
    compiled = torch.compile(model, backend="aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # warned at the first compile only
            got = grads(compiled, lambda m: _in_offload(m, x, pool))
    warned = _messages(caught, "compiling code inside co.offload()")
    assert len(warned) == 1 and "co.apply(model, offload=...)" in warned[0], warned
    assert pool.stats()["bytes_in_use"] == 0
    assert_bit_identical(expected, got)


def _in_offload(model, x, pool):
    with co.offload(pool=pool, **OPTS):
        return model(x).sum()


def test_wrapped_model_compiled_inside_its_own_contexts_does_not_warn(pool, monkeypatch):
    from ckpt_offload import _compile

    monkeypatch.setattr(_compile, "_region_check", {"warned": False})
    model = mlp_blocks(2, 32)
    co.apply(model, offload={**OPTS, "pool": pool})
    plan_model = mlp_blocks(2, 32)
    x = torch.randn(16, 32)
    co.plan(
        plan_model,
        lambda: plan_model(x).sum().backward(),
        budget=2**40,
        bandwidth=math.inf,
        kinds=("offload",),
        segments=False,
        offload={**OPTS, "pool": pool},
    ).apply()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for m in (model, plan_model):
            torch.compile(m, backend="aot_eager")(x).sum().backward()
    assert not _messages(caught, "co.offload()"), [str(w.message) for w in caught]
    assert pool.stats()["bytes_in_use"] == 0


def test_offload_callback_under_compile_warns_once(pool, monkeypatch):
    pytest.importorskip("transformers")
    from ckpt_offload import _compile

    monkeypatch.setattr(_compile, "_warned_whole_forward", False)
    monkeypatch.setattr(_compile, "_region_check", {"warned": False})
    model = mlp_blocks(2, 32)
    callback = co.hf.OffloadCallback(pool=pool, **OPTS)
    callback._install(model)
    x = torch.randn(16, 32)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compiled = torch.compile(model, backend="aot_eager")
            for _ in range(2):
                compiled(x).sum().backward()
    finally:
        callback.remove()
    warned = _messages(caught, "OffloadCallback under torch.compile")
    assert len(warned) == 1 and "OffloadCheckpointCallback" in warned[0], warned
    assert not _messages(caught, "compiling code inside co.offload()")  # one warning, the callback's own
    assert callback.stats()["tensors_offloaded"] > 0
    assert pool.stats()["bytes_in_use"] == 0
