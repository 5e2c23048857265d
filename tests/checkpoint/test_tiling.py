"""co.tiled, co.tiled_cross_entropy and co.tile: sequence-tiled recompute of token-wise functions.

What is promised (docs/api.md, "Sequence-tiled recompute"): forward outputs and input gradients
equal the untiled ones per token (bit-identical on CPU float32), parameter gradients within a
stated tolerance (summed over tiles), dropout replayed per tile, nothing of the function kept but
its inputs (measured by torch.profiler, not by our counters), no recompute added inside a
checkpoint, nothing left in the pool, and clear errors for token-mixing modules and bad arguments.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from conftest import step_peak_bytes
from models_for_tests import TinyTransformer, lm_loss, make_batch, make_config
from torch import nn

import ckpt_offload as co

#: Relative error of float32 parameter gradients summed over tiles against one matmul (measured
#: here about 3e-7; docs/api.md states 1e-5 as the bound).
PARAM_RTOL = 1e-5
CPU = {"devices": ["cpu"], "min_bytes": 0}


def mlp(h=32, f=128, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(h, f), nn.GELU(), nn.Linear(f, h))


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def grads(module, *inputs) -> list:
    return [t.grad.clone() for t in inputs] + [p.grad.clone() for p in module.parameters()]


def run(fn, module, x, g):
    module.zero_grad(set_to_none=True)
    x.grad = None
    y = fn(x)
    y.backward(g)
    return y.detach(), grads(module, x)


# --- exactness -----------------------------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 3])
def test_forward_and_input_grad_bit_identical_params_within_tolerance(batch):
    m = mlp()
    x = torch.randn(batch, 300, 32, requires_grad=True)
    g = torch.randn(batch, 300, 32)
    y_ref, ref = run(m, m, x, g)
    tiled = co.tiled(m, tile=64)
    y, got = run(tiled, m, x, g)
    assert tiled.stats()["tiles"] == 5 and tiled.stats()["tiles_recomputed"] == 5  # 4 x 64 + 44
    assert torch.equal(y, y_ref)  # every token's output: the untiled bits
    assert torch.equal(got[0], ref[0])  # the input's gradient too, tile by tile
    for a, b in zip(got[1:], ref[1:]):  # parameters: summed over tiles
        assert rel(a, b) <= PARAM_RTOL


def test_each_tile_is_the_function_on_that_tile():
    """Per tile: the tiled output's rows are the function applied to those rows alone."""
    m = mlp()
    x = torch.randn(1, 200, 32)
    y = co.tiled(m, tile=50)(x)
    with torch.no_grad():
        for s in range(0, 200, 50):
            assert torch.equal(y[:, s : s + 50], m(x[:, s : s + 50]))


def test_measure_error_reports_against_the_untiled_run():
    m = mlp()
    x = torch.randn(2, 256, 32, requires_grad=True)
    tiled = co.tiled(m, tile=32, measure_error=True)
    tiled(x).square().sum().backward()
    err = tiled.stats()["tile_error"]
    assert err["output"]["bit_identical"] and err["output"]["max_rel_error"] == 0
    assert err["input_grad"]["bit_identical"] and err["input_grad"]["tensors"] == 1
    p = err["param_grad"]
    assert p["tensors"] == 4 and 0 <= p["max_rel_error"] <= PARAM_RTOL and p["mean_rel_error"] <= p["max_rel_error"]
    tiled.reset_stats()
    assert tiled.stats()["tile_error"] == {} and tiled.stats()["calls"] == 0


def test_low_precision_parameter_gradients_accumulate_in_float32():
    m = mlp().to(torch.bfloat16)
    x = torch.randn(1, 1024, 32, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(1, 1024, 32, dtype=torch.bfloat16)
    _, ref = run(lambda t: m.float()(t.float()).to(torch.bfloat16), m, x, g)  # float32 reference
    m.to(torch.bfloat16)
    _, got = run(co.tiled(m, tile=16), m, x, g)  # 64 tiles
    for a, b in zip(got[1:], ref[1:]):
        assert a.dtype == torch.bfloat16
        assert rel(a.float(), b.float()) < 2e-2  # a bf16 rounding, not 64 of them


# --- what it keeps -------------------------------------------------------------------------------


def _slope(make_step, n0=1024, n1=2048) -> float:
    """Peak bytes per token of a step, from profiler peaks at two lengths."""
    return (step_peak_bytes(make_step(n1)) - step_peak_bytes(make_step(n0))) / (n1 - n0)


def test_peak_bytes_per_token_measured_by_the_profiler():
    h, f = 32, 128
    m = mlp(h, f)

    def make_step(fn):
        def at(n):
            x = torch.randn(1, n, h, requires_grad=True)

            def step():
                x.grad = None
                fn(x).sum().backward()

            return step

        return at

    untiled = _slope(make_step(m))
    tiled = _slope(make_step(co.tiled(m, tile=64)))
    width = h * 4
    # Untiled the MLP keeps two f-wide tensors per token (fc's output, GELU's: 8 widths) besides
    # what the step holds at its peak either way (a width or two: the output, the input's gradient).
    assert untiled >= 2 * f * 4, untiled
    assert tiled <= 2 * width, tiled
    assert untiled - tiled >= 2 * f * 4 - width, (untiled, tiled)


def test_nested_in_a_checkpoint_with_offload_no_extra_recompute_and_no_leak():
    torch.manual_seed(0)
    norm, m = nn.LayerNorm(32), mlp()
    tiled = co.tiled(m, tile=64)
    pool = co.HostPool(pinned=False)

    def block(h, tiled_mlp):
        return h + (tiled_mlp or m)(norm(h))

    x = torch.randn(2, 256, 32, requires_grad=True)
    out = co.checkpoint(block, x, None)
    out.square().sum().backward()
    ref = grads(m, x) + [p.grad.clone() for p in norm.parameters()]
    x.grad = None
    m.zero_grad(set_to_none=True)
    norm.zero_grad(set_to_none=True)
    out = co.checkpoint(block, x, tiled, offload={**CPU, "pool": pool})
    assert pool.stats()["bytes_in_use"] > 0
    out.square().sum().backward()
    got = grads(m, x) + [p.grad.clone() for p in norm.parameters()]
    assert torch.equal(got[0], ref[0]) or rel(got[0], ref[0]) <= PARAM_RTOL
    assert all(rel(a, b) <= PARAM_RTOL for a, b in zip(got, ref))
    # The block's recompute stopped at the tiled call's saved inputs (torch's early stop): the
    # tiles ran once in forward and once each in backward, as an untiled checkpoint runs the MLP.
    assert tiled.stats()["calls"] == 1 and tiled.stats()["tiles_recomputed"] == 4
    co.synchronize()
    assert pool.stats()["bytes_in_use"] == 0


def test_store_dtype_around_the_tiled_call():
    """Offloaded in bf16 (store_dtype), the tiled call's saved input comes back rounded: gradients
    within bf16's error of the exact run, the bytes stored halved, nothing left in the pool."""
    m = mlp()
    pool = co.HostPool(pinned=False)
    x = torch.randn(1, 512, 32, requires_grad=True)
    m(x * 1.0).square().sum().backward()
    ref = grads(m, x)
    m.zero_grad(set_to_none=True)
    x.grad = None
    with co.offload(**CPU, pool=pool, store_dtype=torch.bfloat16) as ctx:
        y = co.tiled(m, tile=128)(x * 1.0)
    assert ctx.stats()["bytes_stored"] == ctx.stats()["bytes_offloaded"] // 2 > 0
    y.square().sum().backward()
    got = grads(m, x)
    assert all(0 < rel(a, b) < 1e-2 for a, b in zip(got, ref))
    co.synchronize()
    assert pool.stats()["bytes_in_use"] == 0


def test_offload_around_the_tiled_call_stores_only_its_inputs():
    m = mlp()
    x = torch.randn(1, 512, 32, requires_grad=True)
    with co.offload(**CPU, pool=co.HostPool(pinned=False)) as ctx:
        y = co.tiled(m, tile=128)(x * 1.0)
    assert ctx.stats()["bytes_offloaded"] == x.numel() * 4  # x * 1.0, saved once: no MLP activation
    y.sum().backward()
    assert x.grad is not None


def test_retain_graph_and_dropped_graph_leave_the_pool_empty():
    m = mlp()
    pool = co.HostPool(pinned=False)
    x = torch.randn(1, 256, 32, requires_grad=True)
    with co.offload(**CPU, pool=pool):
        y = co.tiled(m, tile=64)(x * 2)
    y.sum().backward(retain_graph=True)
    first = x.grad.clone()
    y.sum().backward()
    assert torch.equal(x.grad, 2 * first)
    co.synchronize()
    assert pool.stats()["bytes_in_use"] == 0
    with co.offload(**CPU, pool=pool):
        y = co.tiled(m, tile=64)(x * 2)
    assert pool.stats()["bytes_in_use"] > 0
    del y
    co.synchronize()
    assert pool.stats()["bytes_in_use"] == 0


# --- RNG, autocast, arguments --------------------------------------------------------------------


@pytest.mark.parametrize("preserve", [True, False])
def test_dropout_is_replayed_per_tile(preserve):
    p = 0.5
    x = torch.randn(1, 512, 16, requires_grad=True)
    tiled = co.tiled(lambda t: F.dropout(t, p, training=True), tile=64, preserve_rng_state=preserve)
    torch.manual_seed(0)
    y = tiled(x)
    y.backward(torch.ones_like(y))
    kept = (y != 0).float() / (1 - p)  # the masks forward drew
    if preserve:
        assert torch.equal(x.grad, kept)
    else:
        assert not torch.equal(x.grad, kept)  # the test can fail: other masks in backward


def test_autocast_is_replayed_in_backward():
    m = mlp()
    x = torch.randn(1, 256, 32, requires_grad=True)
    g = torch.randn(1, 256, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_ref = m(x)
    y_ref.backward(g)
    ref = grads(m, x)
    m.zero_grad(set_to_none=True)
    x.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = co.tiled(m, tile=64)(x)
    assert y.dtype == torch.bfloat16 and torch.equal(y, y_ref)
    y.backward(g)
    got = grads(m, x)
    assert torch.equal(got[0], ref[0])
    assert all(rel(a, b) < 1e-2 for a, b in zip(got[1:], ref[1:]))  # bf16 matmuls, float32 sums


def test_split_and_shared_arguments():
    """labels split with the input (split={1: 1}); a scale (shared by every tile) gets its
    gradient summed over tiles; keyword tensors too."""
    w = torch.randn(16, 10, requires_grad=True)
    scale = torch.randn(16, requires_grad=True)

    def f(h, labels, *, bias):
        return F.cross_entropy((h * scale) @ w + bias, labels, reduction="none")

    h = torch.randn(2, 96, 16, requires_grad=True)
    labels = torch.randint(0, 10, (2, 96))
    bias = torch.randn(10, requires_grad=True)
    ref_loss = f(h.reshape(-1, 16), labels.reshape(-1), bias=bias).reshape(2, 96)
    ref_loss.sum().backward()
    ref = [t.grad.clone() for t in (h, w, scale, bias)]
    for t in (h, w, scale, bias):
        t.grad = None
    tiled = co.tiled(
        lambda a, b, bias: f(a.reshape(-1, 16), b.reshape(-1), bias=bias).reshape(a.shape[:2]),
        tile=32,
        dim=1,
        split={1: 1},
    )
    loss = tiled(h, labels, bias=bias)
    assert tiled.stats()["tiles"] == 3
    assert torch.allclose(loss, ref_loss, rtol=1e-6, atol=1e-6)
    loss.sum().backward()
    for t, r in zip((h, w, scale, bias), ref):
        assert rel(t.grad, r) <= PARAM_RTOL


def test_a_closed_over_parameter_is_found_and_an_activation_refused():
    head = nn.Linear(16, 8)
    h = torch.randn(1, 128, 16, requires_grad=True)
    head(h).sum().backward()
    ref = head.weight.grad.clone()
    head.zero_grad(set_to_none=True)
    co.tiled(lambda t: head(t), tile=32)(h).sum().backward()  # no params=: found at the first call
    assert rel(head.weight.grad, ref) <= PARAM_RTOL
    act = torch.randn(16, requires_grad=True) * 2  # a non-leaf requiring grad
    with pytest.raises(RuntimeError, match="neither one of its arguments nor a parameter"):
        co.tiled(lambda t: t * act, tile=32)(h)


def test_inplace_writes_after_forward_raise():
    m = mlp()
    x = torch.randn(1, 128, 32, requires_grad=True)
    y0 = x * 1.0
    out = co.tiled(m, tile=32)(y0)
    with torch.no_grad():
        y0.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
    out = co.tiled(m, tile=32)(x)
    with torch.no_grad():
        m[0].weight.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_no_grad_and_short_inputs_run_untiled_or_without_a_graph():
    m = mlp()
    tiled = co.tiled(m, tile=64)
    x = torch.randn(1, 200, 32)
    with torch.no_grad():
        y = tiled(x)
    assert not y.requires_grad and tiled.stats()["tiles"] == 4
    short = torch.randn(1, 64, 32, requires_grad=True)
    assert torch.equal(tiled(short), m(short)) and tiled.stats()["untiled_calls"] == 1


# --- cross-entropy -------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_tiled_cross_entropy_matches_the_untiled_loss(reduction):
    torch.manual_seed(0)
    head = nn.Linear(32, 500, bias=False)
    h = torch.randn(2, 150, 32, requires_grad=True)
    labels = torch.randint(0, 500, (2, 150))
    labels[0, :40] = -100
    labels[1, -7:] = -100

    def untiled():
        return F.cross_entropy(head(h).float().reshape(-1, 500), labels.reshape(-1), reduction=reduction)

    ref = untiled()
    (ref.sum() if reduction == "none" else ref).backward()
    ref_grads = (h.grad.clone(), head.weight.grad.clone())
    h.grad = None
    head.zero_grad(set_to_none=True)
    loss = co.tiled_cross_entropy(h, head, labels, tile=64, reduction=reduction)
    if reduction == "none":
        assert loss.shape == labels.shape and torch.equal(loss.reshape(-1), ref)
    else:
        # mean: over the 253 positions with a target, as torch's
        assert torch.allclose(loss, ref, rtol=1e-6)
    (loss.sum() if reduction == "none" else loss).backward()
    assert rel(h.grad, ref_grads[0]) <= PARAM_RTOL and rel(head.weight.grad, ref_grads[1]) <= PARAM_RTOL


def test_tiled_cross_entropy_edge_cases():
    head = nn.Linear(8, 20)
    h = torch.randn(1, 40, 8, requires_grad=True)
    labels = torch.full((1, 40), -100)
    assert torch.isnan(co.tiled_cross_entropy(h, head, labels, tile=8))  # nothing to average, as torch
    labels = torch.randint(0, 20, (1, 40))
    smooth = co.tiled_cross_entropy(h, head, labels, tile=8, label_smoothing=0.1, ignore_index=3)
    ref = F.cross_entropy(head(h).reshape(-1, 20), labels.reshape(-1), label_smoothing=0.1, ignore_index=3)
    assert torch.allclose(smooth, ref, rtol=1e-6)
    # tile as bytes of one tile's float32 logits: 20 * 4 bytes per token, 640 bytes -> 8 tokens
    wrapped = co.tiled_cross_entropy(h, head, labels, tile="640B")
    assert torch.allclose(wrapped, F.cross_entropy(head(h).reshape(-1, 20), labels.reshape(-1)), rtol=1e-6)


# --- refusals and bad arguments ------------------------------------------------------------------


class FakeAttention(nn.Module):  # Hugging Face-style naming: the structure says attention
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.q_proj(x)


@pytest.mark.parametrize(
    "module",
    [
        nn.MultiheadAttention(8, 2),
        nn.TransformerEncoderLayer(8, 2),
        nn.Conv1d(8, 8, 3),
        nn.BatchNorm1d(8),
        nn.GRU(8, 8),
        FakeAttention(),
        nn.Sequential(nn.Linear(8, 8), FakeAttention()),
    ],
    ids=lambda m: type(m).__name__,
)
def test_token_mixing_modules_are_refused(module):
    with pytest.raises(ValueError, match="mixes tokens.*token_wise=True"):
        co.tiled(module, tile=4)
    with pytest.raises(ValueError, match="mixes tokens"):
        co.tile(module, tile=4)


def test_token_wise_true_is_the_callers_promise():
    m = FakeAttention()
    x = torch.randn(1, 16, 8)
    assert torch.equal(co.tiled(m, tile=4, token_wise=True)(x), m(x))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"tile": 0}, ValueError, "tile must be >= 1"),
        ({"tile": "lots"}, ValueError, "tile: cannot read 'lots'"),
        ({"tile": 1.5}, TypeError, "tile must be an int"),
        ({"tile": 8, "tiles": 2}, ValueError, "not both"),
        ({"tiles": 0}, ValueError, "tiles must be >= 1"),
        ({"reduce": "mean"}, ValueError, "reduce must be None"),
        ({"split": [1]}, TypeError, "split must be a dict"),
        ({"split": {0: 1}}, ValueError, "split: 0 is not an argument position"),
        ({"dim": "seq"}, TypeError, "dim must be an int"),
        ({"params": 3}, TypeError, "params must be an iterable"),
        ({"token_wise": False}, ValueError, "token_wise must be None"),
        ({"measure_error": 1}, TypeError, "measure_error must be True or False"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        co.tiled(nn.Linear(4, 4), **kwargs)


def test_bad_calls_name_what_is_wrong():
    with pytest.raises(TypeError, match="not callable|must be callable"):
        co.tiled(3)
    t = co.tiled(nn.Linear(4, 4), tile=2, dim=3)
    with pytest.raises(ValueError, match="dim=3 is not a dimension"):
        t(torch.randn(2, 8, 4))
    with pytest.raises(TypeError, match="first positional argument is the tensor to tile"):
        co.tiled(nn.Linear(4, 4), tile=2)(x=torch.randn(2, 8, 4))
    with pytest.raises(ValueError, match="no dimension of 8 positions"):
        co.tiled(lambda a, b: a + b, tile=2, split={1: 0})(torch.randn(1, 8, 4), torch.randn(3, 4))
    with pytest.raises(ValueError, match="labels must have the shape"):
        co.tiled_cross_entropy(torch.randn(2, 8, 4), nn.Linear(4, 5), torch.zeros(2, 7, dtype=torch.long))
    with pytest.raises(ValueError, match="reduction must be one of"):
        co.tiled_cross_entropy(
            torch.randn(2, 8, 4), nn.Linear(4, 5), torch.zeros(2, 8, dtype=torch.long), reduction="avg"
        )
    with pytest.raises(TypeError, match="modules must be None, 'mlp'"):
        co.tile(nn.Linear(4, 4), modules="attention")


# --- in place: co.tile and co.apply(tile=...) ----------------------------------------------------


def test_co_tile_in_place_keeps_parameters_and_state_dict_and_removes():
    model = nn.Sequential(nn.LayerNorm(32), mlp())
    keys = list(model.state_dict())
    x = torch.randn(1, 256, 32, requires_grad=True)
    model(x).sum().backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    handle = co.tile(model[1], tile=64)
    assert list(model.state_dict()) == keys and handle.names == [""] and handle.kinds == ["module"]
    model(x).sum().backward()
    assert all(rel(p.grad, r) <= PARAM_RTOL for p, r in zip(model.parameters(), ref))
    assert handle.stats()["tiles"] == 4
    copied = copy.deepcopy(model)  # each copy tiles its own module
    assert copied[1].forward.tiled.module is copied[1]
    restored = pickle.loads(pickle.dumps(model))
    assert restored[1].forward.tiled.module is restored[1]
    with pytest.raises(RuntimeError, match="already tiled"):
        co.tile(model[1], tile=64)
    handle.remove()
    handle.remove()
    assert "forward" not in model[1].__dict__


def test_co_apply_tile_finds_the_demo_models_mlps():
    cfg = make_config("tiny", layers=2, dim=32, heads=2, seq=64, vocab=61, batch=2)
    model = TinyTransformer(
        vocab=cfg.vocab, dim=cfg.dim, layers=cfg.layers, heads=cfg.heads, seq=cfg.seq, dropout=0.0, seed=0
    ).train()
    batch = make_batch(cfg, seed=1)
    lm_loss(model, batch).backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    handle = co.apply(model, offload=CPU, tile=16)
    assert handle.tiles.names == [
        "blocks.0.mlp",
        "blocks.1.mlp",
        "blocks.0.ln1",
        "blocks.0.ln2",
        "blocks.1.ln1",
        "blocks.1.ln2",
    ]
    assert handle.tiles.kinds == ["mlp", "mlp", "norm", "norm", "norm", "norm"]
    lm_loss(model, batch).backward()
    for n, p in model.named_parameters():
        assert rel(p.grad, ref[n]) <= PARAM_RTOL, n
    assert handle.tiles.stats()["tiles_recomputed"] == 6 * 4
    handle.remove()
    assert all("forward" not in b.mlp.__dict__ for b in model.blocks)


def test_co_apply_tile_refuses_blocks_without_an_mlp():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    with pytest.raises(ValueError, match="found no MLP"):
        co.apply(model, tile=True)
    assert co.blocks.active_handle(model) is None  # nothing left applied
    with pytest.raises(TypeError, match="tile: unknown option"):
        co.apply(model, tile={"tokens": 4})
