"""The default prefetch window follows the model (Note [Prefetch window]): backward holds about
the block it differentiates plus one block prefetched, not the whole step. Peaks are measured
independently of ckpt_offload's counters, with torch.profiler's CPU memory events."""

import pytest
import torch
from torch import nn

import ckpt_offload as co
from ckpt_offload.options import DEFAULT_PREFETCH_BYTES
from conftest import step_peak_bytes

WIDTH, HIDDEN, ROWS = 256, 1024, 128  # one block saves 0.5 MiB + 0.5 MiB + 0.125 MiB (GELU input/output, Linear input)


def mlp(blocks: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, WIDTH)) for _ in range(blocks)]
    )


def offload_step(model, x, **options):
    def step():
        with co.offload(devices=["cpu"], pool=co.HostPool(pinned=False), **options):
            loss = model(x).sum()
        loss.backward()
        model.zero_grad(set_to_none=False)

    return step


def plain_step(model, x):
    def step():
        model(x).sum().backward()
        model.zero_grad(set_to_none=False)

    return step


def test_default_window_keeps_the_backward_peak_well_below_no_offload():
    model, x = mlp(12), torch.randn(ROWS, WIDTH)
    plain = step_peak_bytes(plain_step(model, x))
    auto = step_peak_bytes(offload_step(model, x), warmup=2)
    whole = step_peak_bytes(offload_step(model, x, prefetch_bytes=256 * 2**20), warmup=2)
    # Without the automatic window the whole step comes back at the start of backward.
    assert whole > 0.9 * plain
    assert auto < 0.5 * plain, (auto, plain)


def test_default_window_reports_a_block_and_stays_under_the_cap():
    model, x = mlp(8), torch.randn(ROWS, WIDTH)
    ctx = co.offload(devices=["cpu"], pool=co.HostPool(pinned=False))
    for _ in range(2):
        with ctx:
            loss = model(x).sum()
        loss.backward()
    s = ctx.stats()
    assert s["prefetches"] > 0 and s["prefetch_hits"] > 0
    assert 0 < s["prefetch_block_bytes"] <= s["bytes_offloaded"] // 2 // 4  # a block, not a quarter of a step
    # The last backward's window: its lead (1 to 8) times the block; the lead reported is the
    # one the next backward uses, adapted to whether this one waited for copies.
    block = s["prefetch_block_bytes"]
    assert block <= s["prefetch_window_bytes"] <= min(8 * block, DEFAULT_PREFETCH_BYTES)
    assert s["prefetch_window_bytes"] % block == 0
    assert 1 <= s["prefetch_lead"] <= 8


def test_user_prefetch_bytes_is_a_fixed_window():
    model, x = mlp(4), torch.randn(ROWS, WIDTH)
    ctx = co.offload(devices=["cpu"], pool=co.HostPool(pinned=False), prefetch_bytes=2**20)
    with ctx:
        loss = model(x).sum()
    loss.backward()
    s = ctx.stats()
    assert s["prefetch_window_bytes"] == 2**20 and s["peak_prefetch_bytes"] <= 2**20


@pytest.mark.parametrize("window", [None, 256 * 2**20])
def test_checkpoint_with_offload_stays_flat_with_depth(window):
    x = torch.randn(ROWS, WIDTH, requires_grad=True)

    def peak(blocks):
        model = mlp(blocks)

        def step():
            h = x
            for block in model:
                h = co.checkpoint(
                    block, h, offload={"devices": ["cpu"], "pool": pool, "min_bytes": 0, "prefetch_bytes": window}
                )
            h.sum().backward()
            model.zero_grad(set_to_none=False)

        pool = co.HostPool(pinned=False)
        return step_peak_bytes(step)

    growth = peak(16) - peak(4)
    one_input = ROWS * WIDTH * 4
    if window is None:
        assert growth < 4 * one_input, growth  # flat: no more than a few inputs' worth
    else:
        assert growth > 8 * one_input, growth  # the whole step's inputs prefetched: grows with depth
