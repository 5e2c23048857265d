"""Mixed precision: co.offload and co.checkpoint(offload=...) under torch.autocast.

Under autocast an ``nn.Linear`` runs on a low-precision *cast* of its weight (``weight.to(bf16)``,
kept in autocast's weight cache for the region), and saves that cast (transposed) for backward.
Gradients must stay bit-identical to the same autocast run without ckpt_offload: on CPU for
bf16 and fp16 here, on a GPU (cuda autocast, and fp16 with ``GradScaler``) in the gpu-marked
tests below.

The cast is a copy of a parameter that autocast keeps alive anyway, so offloading it would only
cost a copy: the C++ pack path recognises it and keeps it, under a kept reason of its own
(``autocast_cast``).
"""

import pytest
import torch

import ckpt_offload as co
from conftest import assert_bit_identical, cpu_offload, grads_of
from models_for_tests import MLP, Transformer
from helpers import HAS_GPU

VOCAB, SEQ = 97, 16
# The kept reasons co.offload reports today (README, co.offload.stats()).
KNOWN_REASONS = {
    "parameter",
    "buffer",
    "too_small",
    "device",
    "layout",
    "subclass",
    "pool_full",
    "cuda_graph_capture",
    "disk_full",
    "no_data",
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices on a busy 2-core machine
    yield
    torch.set_num_threads(threads)


def make(device="cpu"):
    torch.manual_seed(0)
    return Transformer(vocab=VOCAB, dim=64, layers=2, seq=SEQ).to(device).train()


def step(model, device_type, dtype, ctx=None, scaler=None):
    """One autocast forward (inside ``ctx`` if given) and backward; returns the gradients."""
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(3))
    tokens = tokens.to(next(model.parameters()).device)
    torch.manual_seed(1234)  # dropout
    with torch.autocast(device_type, dtype=dtype):
        with ctx if ctx is not None else torch.enable_grad():
            logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    (scaler.scale(loss) if scaler is not None else loss).backward()
    return grads_of(model)


def is_weight_cast(t: torch.Tensor) -> bool:
    """A tensor autocast made from a parameter (``weight.to(low precision)``), or a view of one."""
    base = t._base if t._base is not None else t
    fn = base.grad_fn
    if fn is None or type(fn).__name__ != "ToCopyBackward0":
        return False
    source = fn.next_functions[0][0]
    return isinstance(getattr(source, "variable", None), torch.nn.Parameter)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("how", ["offload", "checkpoint"])
def test_cpu_autocast_bit_identical(pool, dtype, how):
    base = step(make(), "cpu", dtype)
    assert all(g.dtype == torch.float32 for g in base.values())  # fp32 master weights
    model = make()
    ctx = None
    if how == "offload":
        ctx = cpu_offload(pool)
    else:
        # The recompute in backward must run under the same autocast state as the forward.
        co.apply(model, offload={"devices": ["cpu"], "min_bytes": 0, "pool": pool})
    got = step(model, "cpu", dtype, ctx)
    assert pool.stats()["num_allocs"] > 0 and pool.stats()["bytes_in_use"] == 0
    if ctx is not None:
        assert ctx.stats()["tensors_offloaded"] > 0
    assert_bit_identical(base, got)


def count_weight_casts_saved(model, dtype):
    saved = []

    def pack(t):
        saved.append(is_weight_cast(t))
        return t

    x = torch.randn(8, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=dtype), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).float().sum().backward()
    model.zero_grad(set_to_none=True)
    return sum(saved)


def test_autocast_weight_casts_kept_under_their_own_reason(pool):
    torch.manual_seed(0)
    model = MLP()
    casts = count_weight_casts_saved(model, torch.bfloat16)
    assert casts == 3  # one per nn.Linear: its bf16 weight, saved (transposed) for the input's gradient
    ctx = cpu_offload(pool)
    x = torch.randn(8, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with ctx:
            out = model(x)
        out.float().sum().backward()
    stats = ctx.stats()
    new_reasons = {k: v for k, v in stats["kept_by_reason"].items() if k not in KNOWN_REASONS and v}
    assert list(new_reasons.values()) == [casts], stats["kept_by_reason"]
    assert stats["kept_by_reason"]["autocast_cast"] == casts


# --- GPU: cuda autocast and GradScaler ------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU and a CUDA build of ckpt_offload")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("how", ["offload", "checkpoint"])
def test_cuda_autocast_bit_identical(dtype, how):
    pool = co.HostPool()
    base = step(make("cuda"), "cuda", dtype)
    model = make("cuda")
    ctx = None
    if how == "offload":
        ctx = co.offload(min_bytes=0, pool=pool)
    else:
        co.apply(model, offload={"min_bytes": 0, "pool": pool})
    got = step(model, "cuda", dtype, ctx)
    co.synchronize()
    assert pool.stats()["num_allocs"] > 0 and pool.stats()["bytes_in_use"] == 0
    assert_bit_identical(base, got)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU and a CUDA build of ckpt_offload")
def test_cuda_fp16_grad_scaler_training_bit_identical():
    def train(ctx_factory):
        model = make("cuda")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0**14)
        for _ in range(3):
            step(model, "cuda", torch.float16, ctx_factory(), scaler)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
        return {n: p.detach().clone() for n, p in model.named_parameters()}, scaler.get_scale()

    pool = co.HostPool()
    base, base_scale = train(lambda: None)
    got, scale = train(lambda: co.offload(min_bytes=0, pool=pool))
    co.synchronize()
    assert pool.stats()["num_allocs"] > 0 and pool.stats()["bytes_in_use"] == 0
    assert scale == base_scale
    assert_bit_identical(base, got)
