"""One co.offload context entered again and again: each entry offloads as the first did, also after
an exit that could not pop its hooks (whose hook functions that exit closed), and the side
streams give bit-identical gradients when their copies run on the caller (no copy delay)."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_bit_identical, cpu_offload
from helpers import exit_from_another_thread

import ckpt_offload as co


def _step(ctx, w, x):
    with ctx:
        loss = torch.tanh(x @ w).pow(2).sum()
    loss.backward()


def test_entries_of_one_context_each_offload(pool):
    ctx = cpu_offload(pool)
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(32, 64)
    for step in range(1, 4):
        _step(ctx, w, x)
        assert ctx.stats()["tensors_offloaded"] == 2 * step  # tanh's output and x @ w's input x
    assert pool.stats()["bytes_in_use"] == 0


def test_entry_after_an_exit_from_another_thread_offloads(pool):
    # That exit closes the hook functions it could not pop (they hand tensors back unchanged):
    # the next entry must push new ones, or it would offload nothing.
    ctx = cpu_offload(pool)
    ctx.__enter__()
    exit_from_another_thread(ctx)
    ctx.__exit__(None, None, None)  # drops the closed entry from this thread's stack
    before = ctx.stats()["tensors_offloaded"]
    w = torch.randn(64, 64, requires_grad=True)
    _step(ctx, w, torch.randn(32, 64))
    assert ctx.stats()["tensors_offloaded"] == before + 2
    assert pool.stats()["bytes_in_use"] == 0


@pytest.mark.parametrize("prefetch_bytes", [0, None])
def test_side_stream_copies_on_the_caller_are_bit_identical(pool, prefetch_bytes):
    # With no copy delay, small copies onto an idle CPU side stream run on the calling thread
    # (Note [Idle worker runs inline]); large ones still go to the worker. Both in one step.
    torch.manual_seed(0)
    w1 = torch.randn(64, 64, requires_grad=True)
    w2 = torch.randn(64, 512, requires_grad=True)
    x = torch.randn(16, 64)

    def grads(ctx):
        w1.grad = w2.grad = None
        if ctx is None:
            loss = torch.tanh(torch.tanh(x @ w1) @ w2).sum()  # 4 KiB and 32 KiB saved tensors
        else:
            with ctx:
                loss = torch.tanh(torch.tanh(x @ w1) @ w2).sum()
        loss.backward()
        return {"w1": w1.grad.clone(), "w2": w2.grad.clone()}

    big = torch.randn(256, 512, requires_grad=True)  # 512 KiB: over the inline limit

    def big_grad(ctx):
        big.grad = None
        with ctx:
            loss = torch.tanh(big * 2).sum()
        loss.backward()
        return big.grad.clone()

    reference = grads(None)
    torch.tanh(big * 2).sum().backward()
    reference_big = big.grad.clone()
    delay = co._C.testing.cpu_copy_delay_us()
    co._C.testing.set_cpu_copy_delay_us(0)
    try:
        for _ in range(3):
            ctx = cpu_offload(pool, stream="side", prefetch_bytes=prefetch_bytes)
            assert_bit_identical(grads(ctx), reference)
            assert ctx.stats()["tensors_offloaded"] >= 3
            assert torch.equal(big_grad(cpu_offload(pool, stream="side", prefetch_bytes=prefetch_bytes)), reference_big)
    finally:
        co._C.testing.set_cpu_copy_delay_us(delay)
    co.synchronize()
    assert pool.stats()["bytes_in_use"] == 0
