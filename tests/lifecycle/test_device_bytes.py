"""The memory timeline's "saved activations on the device" counter (``_C.device_bytes_saved``)
goes back to where it started once a graph is gone, whatever way the graph went: every holder
of device bytes counts them for exactly its own lifetime (csrc/torch/device_bytes.h)."""

import gc

import pytest
import torch

import ckpt_offload as co
from conftest import cpu_offload, device_bytes_saved as saved_bytes, run_a_backward
from models_for_tests import Chain

MiB = 1 << 20


def _forward(model, ctx=None, rows=16):
    x = torch.randn(rows, model.layers[0].in_features, requires_grad=True)
    if ctx is None:
        return model(x).sum()
    with ctx:
        return model(x).sum()


OPTIONS = {
    "default": {},
    "prefetch off": {"prefetch_bytes": 0},
    "prefetch wide": {"prefetch_bytes": 64 * MiB},
    "compute stream": {"stream": "compute"},
    "batching": {"batch_below": 1 * MiB, "batch_bytes": 1 * MiB},
    "batching, no prefetch": {"batch_below": 1 * MiB, "batch_bytes": 1 * MiB, "prefetch_bytes": 0},
}


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
def test_zero_after_backward(pool, options):
    start = saved_bytes()
    loss = _forward(Chain(n=4), cpu_offload(pool, **options))
    loss.backward()
    del loss
    assert saved_bytes() == start


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
def test_zero_after_a_dropped_graph(pool, options):
    start = saved_bytes()
    loss = _forward(Chain(n=4), cpu_offload(pool, **options))
    del loss  # no backward: the saved tensors die with the graph
    assert saved_bytes() == start


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
def test_retain_graph_twice_counts_reloads_until_the_graph_goes(pool, options):
    start = saved_bytes()
    loss = _forward(Chain(n=4), cpu_offload(pool, **options))
    loss.backward(retain_graph=True)
    # The reloads live as long as the saved tensors that unpacked them: counted meanwhile.
    assert saved_bytes() > start
    loss.backward()
    del loss
    assert saved_bytes() == start


def test_kept_tensors_count_until_the_graph_goes():
    # A pool too small for anything: every saved activation is kept on its device (on_full="keep").
    tiny = co.HostPool(pinned=False, max_bytes=4096, segment_bytes=4096)
    start = saved_bytes()
    with pytest.warns(UserWarning, match="at its cap"):
        loss = _forward(Chain(n=4), cpu_offload(tiny))
    assert saved_bytes() - start >= 4 * 16 * 512 * 4  # at least one (16, 512) float32 per layer
    loss.backward()
    del loss
    assert saved_bytes() == start


def test_batch_kept_on_device_when_the_pool_is_full():
    tiny = co.HostPool(pinned=False, max_bytes=4096, segment_bytes=4096)
    start = saved_bytes()
    with pytest.warns(UserWarning, match="at its cap"):
        loss = _forward(Chain(n=4, width=64), cpu_offload(tiny, batch_below=64 * 1024, batch_bytes=64 * 1024))
    assert saved_bytes() > start
    loss.backward()
    del loss
    assert saved_bytes() == start


@pytest.mark.parametrize("offload", [False, True], ids=["recompute", "recompute+offload"])
def test_zero_after_checkpoint(offload):
    start = saved_bytes()
    model = Chain(n=4)
    x = torch.randn(16, 512, requires_grad=True)
    opts = {"devices": ["cpu"], "min_bytes": 0} if offload else False
    loss = co.checkpoint(model, x, offload=opts).sum()
    loss.backward()
    del loss
    assert saved_bytes() == start
    loss = co.checkpoint(model, x, offload=opts).sum()
    del loss  # dropped
    assert saved_bytes() == start


class Raise(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x):
        return x.clone()

    @staticmethod
    def backward(fctx, grad):
        raise RuntimeError("boom in backward")


@pytest.mark.parametrize("options", [{}, {"batch_below": 1 * MiB, "batch_bytes": 1 * MiB}], ids=["plain", "batching"])
def test_zero_after_a_backward_that_raises(pool, options):
    start = saved_bytes()
    model = Chain(n=4)
    x = torch.randn(16, 512, requires_grad=True)
    with cpu_offload(pool, **options):
        # The raise comes after the last layers' unpacks (reloads made) and before the first's.
        h = Raise.apply(model.layers[0](x))
        loss = torch.tanh(model.layers[1](torch.tanh(h))).sum()
    with pytest.raises(RuntimeError, match="boom in backward"):
        loss.backward()
    del loss, h
    gc.collect()  # the exception's traceback
    run_a_backward()  # PyTorch frees the nodes the raising backward left queued only now
    assert saved_bytes() == start


@pytest.mark.parametrize("stream", ["side", "compute"])
def test_zero_after_offload_tensor_handles(pool, stream):
    start = saved_bytes()
    t = torch.randn(64, 512)
    h = co.offload_tensor(t, pool, stream=stream)
    back = h.reload()
    assert torch.equal(back, t)
    assert saved_bytes() > start  # the reload, until the handle goes
    del h, back
    assert saved_bytes() == start
    h = co.offload_tensor(t, pool, stream=stream)
    del h  # never reloaded
    assert saved_bytes() == start


@pytest.mark.parametrize(
    "options",
    [{"stream": "compute", "prefetch_bytes": 0}, {"prefetch_bytes": 64 * MiB}],
    ids=["compute stream", "prefetch wide"],
)
def test_context_stats_device_peak_is_the_profiles(options):
    """``stats()["device_saved_peak_bytes"]`` is the most device bytes of saved activations seen
    at this context's packs and unpacks: the same quantity co.profile's memory timeline samples,
    so the two agree; it lies between one activation and the total offloaded, and reset_stats
    zeroes it."""
    torch.manual_seed(0)
    model = Chain(n=6, width=128)
    x = torch.randn(32, 128, requires_grad=True)
    act = 32 * 128 * 4
    ctx = cpu_offload(**options)
    with co.profile() as prof:
        with ctx:
            loss = model(x).sum()
        loss.backward()
    co.synchronize()
    s = ctx.stats()
    peak = s["device_saved_peak_bytes"]
    assert peak == prof.totals()["device_saved_peak_bytes"]
    assert act <= peak <= s["bytes_offloaded"]
    if options.get("prefetch_bytes") == 0:
        # Nothing prefetched, compute-stream copies: one reloaded activation at a time.
        assert peak == act
    else:
        # Every activation prefetched at the start of backward.
        assert peak >= s["bytes_offloaded"] - act
    ctx.reset_stats()
    assert ctx.stats()["device_saved_peak_bytes"] == 0
