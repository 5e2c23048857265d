"""co.checkpoint, co.checkpoint_sequential and co.apply: recompute, with inputs offloaded."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as tc

import ckpt_offload as co
from conftest import assert_bit_identical, grads_of
from models_for_tests import Block, Transformer

CPU = {"devices": ["cpu"], "min_bytes": 0}


def cpu_opts(pool, **kw):
    return dict(CPU, pool=pool, **kw)


class Layer(nn.Module):
    """A block that takes tensors by keyword and inside containers, as Hugging Face layers do."""

    def __init__(self, dim=32):
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.drop = nn.Dropout(0.2)

    def forward(self, x, extras=(), *, rope=None, mask=None, scale=1.0):
        h = self.drop(self.lin(x))
        if rope is not None:
            h = h * rope
        if mask is not None:
            h = h.masked_fill(~mask, 0.0)
        for e in extras:
            h = h + e["bias"]
        return torch.tanh(h) * scale


def make_inputs(seed=0, dim=32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, dim, generator=g, requires_grad=True)
    rope = torch.randn(8, dim, generator=g).requires_grad_()
    mask = torch.rand(8, dim, generator=g) > 0.3
    bias = torch.randn(dim, generator=g).requires_grad_()
    return x, rope, mask, bias


def run_layers(layers, x, rope, mask, bias, wrap=None):
    h = x * 1.0
    for layer in layers:
        if wrap is None:
            h = layer(h, [{"bias": bias}], rope=rope, mask=mask, scale=0.5)
        else:
            h = wrap(layer, h, [{"bias": bias}], rope=rope, mask=mask, scale=0.5)
    return h


def grads(layers, inputs, wrap=None, seed=0, pool=None):
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    for t in inputs:
        t.grad = None
    torch.manual_seed(seed)
    out = run_layers(layers, *inputs, wrap=wrap)
    after_forward = pool.stats()["bytes_requested"] if pool is not None else None
    out.square().sum().backward()
    g = {f"{i}.{n}": p.grad.clone() for i, layer in enumerate(layers) for n, p in layer.named_parameters()}
    g.update({f"input{i}": t.grad.clone() for i, t in enumerate(inputs) if t.grad is not None})
    return g, after_forward


@pytest.mark.parametrize("offload", [False, True])
def test_checkpoint_matches_no_checkpoint_with_dropout(pool, stream, offload):
    torch.manual_seed(0)
    layers = nn.ModuleList(Layer() for _ in range(4))
    inputs = make_inputs()
    base, _ = grads(layers, inputs)
    opts = cpu_opts(pool, stream=stream) if offload else False
    got, _ = grads(layers, inputs, wrap=lambda f, *a, **kw: co.checkpoint(f, *a, offload=opts, **kw))
    assert_bit_identical(base, got)
    assert pool.stats()["bytes_in_use"] == 0


def test_offload_holds_keyword_and_container_inputs_once(pool):
    torch.manual_seed(0)
    layers = nn.ModuleList(Layer() for _ in range(4))
    x, rope, mask, bias = inputs = make_inputs()
    wrap = lambda f, *a, **kw: co.checkpoint(f, *a, offload=cpu_opts(pool), **kw)  # noqa: E731
    _, held = grads(layers, inputs, wrap=wrap, pool=pool)
    h = x.numel() * 4
    # each layer's own input (x*1, then 3 layer outputs) + rope + mask + bias, shared ones once
    assert held == 4 * h + rope.numel() * 4 + mask.numel() + bias.numel() * 4


def test_torch_checkpoint_under_offload_keeps_keyword_inputs_on_device(pool):
    """What we fix: torch's checkpoint lets only positional inputs reach the hooks."""
    torch.manual_seed(0)
    layer = Layer()
    x, rope, mask, bias = make_inputs()
    with co.offload(pool=pool, **CPU) as ctx:
        tc.checkpoint(layer, x * 1.0, [{"bias": bias}], rope=rope, mask=mask, use_reentrant=False)
    assert ctx.stats()["tensors_offloaded"] == 1  # only x*1.0
    pool2 = co.HostPool(pinned=False)
    out = co.checkpoint(layer, x * 1.0, [{"bias": bias}], rope=rope, mask=mask, offload=cpu_opts(pool2))
    assert pool2.stats()["num_blocks_in_use"] == 4  # x, bias, rope, mask
    out.sum().backward()
    assert pool2.stats()["num_blocks_in_use"] == 0


def test_checkpoint_outputs_and_nontensor_args():
    def f(a, n, *, d):
        return a * n + d["k"], {"n": n}

    a = torch.randn(5, requires_grad=True)
    (out, meta) = co.checkpoint(f, a, 3, d={"k": torch.ones(5)}, offload=CPU)
    assert meta == {"n": 3}
    out.sum().backward()
    assert torch.equal(a.grad, torch.full((5,), 3.0))


def test_checkpoint_keywords_pass_through():
    a = torch.randn(5, requires_grad=True)
    calls = []

    def ctx_fn():
        import contextlib

        calls.append(1)
        return contextlib.nullcontext(), contextlib.nullcontext()

    y = co.checkpoint(torch.sin, a, offload=CPU, determinism_check="none", preserve_rng_state=False, context_fn=ctx_fn)
    y.sum().backward()
    assert calls and torch.allclose(a.grad, a.detach().cos())
    with pytest.raises(ValueError, match="determinism_check"):
        co.checkpoint(torch.sin, a, determinism_check="bogus")


def test_reentrant_and_offload():
    a = torch.randn(5, requires_grad=True)
    with pytest.raises(ValueError, match="offload needs use_reentrant=False"):
        co.checkpoint(torch.sin, a, offload=True, use_reentrant=True)
    y = co.checkpoint(torch.sin, a, use_reentrant=True)  # without offload: torch's reentrant path
    y.sum().backward()
    assert torch.allclose(a.grad, a.detach().cos())


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: co.checkpoint(3, torch.ones(1)), TypeError, "function must be callable"),
        (lambda: co.checkpoint(torch.sin, torch.ones(1), offload="yes"), TypeError, "offload must be False, True"),
        (lambda: co.checkpoint(torch.sin, torch.ones(1), offload={"speed": 1}), TypeError, "unknown co.offload"),
        (lambda: co.checkpoint(torch.sin, torch.ones(1), offload={"stream": "x"}), ValueError, "stream must be"),
        (lambda: co.checkpoint(torch.sin, torch.ones(1), use_reentrant="no"), TypeError, "use_reentrant"),
    ],
)
def test_checkpoint_bad_arguments(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize("segments", [1, 2, 3])
def test_checkpoint_sequential(pool, segments):
    torch.manual_seed(0)
    seq = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.1), nn.GELU()) for _ in range(6)))
    x = torch.randn(4, 16, requires_grad=True)
    torch.manual_seed(1)
    seq(x).sum().backward()
    base = grads_of(seq)
    seq.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    co.checkpoint_sequential(seq, segments, x, offload=cpu_opts(pool)).sum().backward()
    assert_bit_identical(base, grads_of(seq))
    with pytest.raises(ValueError, match="segments"):
        co.checkpoint_sequential(seq, 7, x)
    with pytest.raises(ValueError, match="segments must be >= 1"):
        co.checkpoint_sequential(seq, 0, x)


# --- co.apply -----------------------------------------------------------------------------


def count_block_runs(model):
    counts = {}
    for i, blk in enumerate(model.blocks):
        blk.ln1.register_forward_pre_hook(lambda m, a, i=i: counts.__setitem__(i, counts.get(i, 0) + 1))
    return counts


def lm_loss(model, tokens):
    return F.cross_entropy(model(tokens).flatten(0, 1), tokens.roll(-1, 1).flatten())


@pytest.mark.parametrize("every_n_layers, offload", [(1, False), (2, True), (3, True)])
def test_apply_selects_layers_and_matches(pool, every_n_layers, offload):
    torch.manual_seed(0)
    model = Transformer(layers=4)
    tokens = torch.randint(0, 97, (2, 16))
    torch.manual_seed(5)
    lm_loss(model, tokens).backward()
    base = grads_of(model)
    keys = list(model.state_dict())
    model.zero_grad(set_to_none=True)

    handle = co.apply(model, every_n_layers=every_n_layers, offload=cpu_opts(pool) if offload else False)
    assert handle.names == [f"blocks.{i}" for i in range(4) if i % every_n_layers == 0]
    assert list(model.state_dict()) == keys
    counts = count_block_runs(model)
    torch.manual_seed(5)
    loss = lm_loss(model, tokens)
    if offload:
        assert pool.stats()["num_blocks_in_use"] == len(handle.names)  # one input per checkpointed block
    loss.backward()
    assert_bit_identical(base, grads_of(model))
    assert counts == {i: 2 if i % every_n_layers == 0 else 1 for i in range(4)}  # recomputed exactly there
    handle.remove()
    assert all("forward" not in b.__dict__ for b in model.blocks)


def test_apply_is_a_no_op_in_eval_and_no_grad():
    model = Transformer(layers=2)
    co.apply(model)
    counts = count_block_runs(model)
    tokens = torch.randint(0, 97, (1, 8))
    model.eval()
    lm_loss(model, tokens).backward()
    assert counts == {0: 1, 1: 1}
    model.train()
    with torch.no_grad():
        model(tokens)
    assert counts == {0: 2, 1: 2}


def test_apply_layers_argument_and_errors():
    model = Transformer(layers=3)
    h = co.apply(model, layers=Block)
    assert h.names == ["blocks.0", "blocks.1", "blocks.2"]
    with pytest.raises(RuntimeError, match="already applied"):
        co.apply(model)
    h.remove()
    h.remove()  # harmless
    h = co.apply(model, layers=lambda name, m: name in ("blocks.1", "head"))
    assert h.names == ["blocks.1", "head"]
    h.remove()
    with pytest.raises(ValueError, match="every_n_layers must be >= 1"):
        co.apply(model, every_n_layers=0)
    with pytest.raises(ValueError, match="found no a submodule of class Conv2d|found no .*Conv2d"):
        co.apply(model, layers=nn.Conv2d)
    with pytest.raises(ValueError, match="layers=<the block class>"):
        co.apply(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="layers must be None"):
        co.apply(model, layers="blocks")
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        co.apply(lambda x: x)
    with pytest.raises(TypeError, match="unknown checkpoint keyword"):
        co.apply(model, speed=3)
    with pytest.raises(ValueError, match="offload needs use_reentrant=False"):
        co.apply(model, offload=True, use_reentrant=True)


# ---------------------------------------------------------------- which blocks co.apply picks


class _Layer(nn.Module):
    def __init__(self, d=32, experts=0):
        super().__init__()
        self.attn = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.experts = nn.ModuleList([nn.Linear(d, d) for _ in range(experts)])

    def forward(self, x):
        x = x + self.attn(x)
        for e in self.experts:
            x = x + e(x)
        return x + self.mlp(x)


def test_apply_prefers_the_blocks_holding_the_parameters_over_a_longer_list():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.adapters = nn.ModuleList([nn.Linear(4, 4) for _ in range(8)])  # longer, tiny
            self.layers = nn.ModuleList([_Layer() for _ in range(4)])

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    handle = co.apply(Model())
    assert handle.names == [f"layers.{i}" for i in range(4)]
    handle.remove()


def test_apply_never_picks_expert_lists():
    class MoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([_Layer(experts=16) for _ in range(2)])

    handle = co.apply(MoE())
    assert handle.names == ["layers.0", "layers.1"]
    handle.remove()


def test_apply_warns_when_two_candidates_are_close():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = nn.ModuleList([_Layer() for _ in range(3)])
            self.decoder = nn.ModuleList([_Layer() for _ in range(3)])

    with pytest.warns(UserWarning, match=r"'encoder'.*'decoder'.*Pass layers=") as record:
        handle = co.apply(Two())
    assert record[0].filename == __file__
    handle.remove()


def test_apply_handle_stats_count_offloaded_inputs_and_reset():
    model = nn.Sequential(*[_Layer() for _ in range(3)])
    handle = co.apply(model, offload={"devices": ["cpu"], "min_bytes": 0, "pool": co.HostPool(pinned=False)})
    model(torch.randn(8, 32, requires_grad=True)).sum().backward()
    s = handle.stats()
    assert s["tensors_offloaded"] >= 3 and s["bytes_offloaded"] > 0 and s["pool_peak_bytes"] > 0
    assert set(s["kept_by_reason"]) >= {"parameter", "buffer", "too_small", "device", "pool_full"}
    handle.reset_stats()
    assert handle.stats()["bytes_offloaded"] == 0
    handle.remove()


def test_apply_logs_its_choice_through_the_library_logger(caplog):
    with caplog.at_level("INFO", logger="ckpt_offload"):
        handle = co.apply(nn.Sequential(*[_Layer() for _ in range(2)]))
    handle.remove()
    assert any(r.name == "ckpt_offload" and "2 x _Layer" in r.getMessage() for r in caplog.records)


def test_apply_handle_device_peak_is_the_profiles_and_below_the_saved_total():
    # The handle reports the device peak of saved activations that co.profile()
    # measures for the same step (one count, _C.device_bytes_saved; Note [Handle device peak]).
    from models_for_tests import Chain

    torch.manual_seed(0)
    model = Chain(n=8, width=256)
    x = torch.randn(512, 256)
    one_input = x.numel() * x.element_size()  # what each checkpointed Linear keeps: 512 KiB
    pool = co.HostPool(pinned=False)
    # Each block's offload copy is drained before the next block packs: a copy finishing on a
    # worker thread between the profile's sample and the handle's cannot differ them then.
    drains = [layer.register_forward_pre_hook(lambda *_: co.synchronize()) for layer in model.layers]
    handle = co.apply(model, offload={"devices": ["cpu"], "min_bytes": 0, "pool": pool, "prefetch_bytes": one_input})
    assert handle.stats()["device_saved_peak_bytes"] == 0 and handle.stats()["bytes_offloaded"] == 0
    base = co._C.device_bytes_saved()
    with co.profile(pools=[pool]) as prof:
        torch.tanh(model(x)).sum().backward()
    s = handle.stats()
    total = s["bytes_offloaded"]
    assert total == 8 * one_input  # every block's input went to the pool
    peak = s["device_saved_peak_bytes"]
    assert peak == prof.totals()["device_saved_peak_bytes"]
    # A window of one input: the input being recomputed and the next one, never the whole step.
    assert s["prefetches"] > 0
    assert base + one_input < peak <= base + 2 * one_input < total
    handle.reset_stats()
    assert handle.stats()["device_saved_peak_bytes"] == 0 and handle.stats()["bytes_offloaded"] == 0
    # Counts again after a reset: a window of the whole step brings every input back at once.
    handle.remove()
    handle = co.apply(model, offload={"devices": ["cpu"], "min_bytes": 0, "pool": pool, "prefetch_bytes": total})
    with co.profile(pools=[pool]) as prof:
        torch.tanh(model(x)).sum().backward()
    assert handle.stats()["device_saved_peak_bytes"] == prof.totals()["device_saved_peak_bytes"] == base + total
    handle.remove()
    for d in drains:
        d.remove()
