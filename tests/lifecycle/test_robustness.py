"""Never a crash, a hang or a stuck state: tensors without data, fork, caps below the
smallest block, and contexts exited where they cannot pop their hooks."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import threading
import traceback
import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn as nn

import ckpt_offload as co
from ckpt_offload.checkpointing import TORCH_KEYWORDS
from conftest import assert_bit_identical, cpu_offload, grads_of
from helpers import REPO_ROOT

CPU = {"devices": ["cpu"], "min_bytes": 0}


def top_hooks():
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def small_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))


def step_grads(model, x, ctx=None):
    model.zero_grad(set_to_none=True)
    with ctx if ctx is not None else contextlib.nullcontext():
        loss = model(x).square().sum()
    loss.backward()
    return grads_of(model)


# --- ZeroTensors and other tensors without data are kept, never copied -----------------------


def test_forward_mode_dual_then_backward_keeps_the_zero_tangent(pool):
    def run(ctx):
        torch.manual_seed(0)
        x = torch.randn(64, 64, requires_grad=True)
        w = torch.randn(64, 64, requires_grad=True)
        with fwAD.dual_level():
            d = fwAD.make_dual(x, torch.randn(64, 64))
            with ctx if ctx is not None else contextlib.nullcontext():
                y = (d * w).sin().sum()
        y.backward()
        return x.grad, w.grad

    ctx = cpu_offload(pool)
    expected = run(None)
    got = run(ctx)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    s = ctx.stats()
    assert s["kept_by_reason"]["no_data"] >= 1, s["kept_by_reason"]
    assert s["kept_bytes_by_reason"]["no_data"] == 0  # it holds no device memory
    assert s["tensors_offloaded"] >= 1  # the other saved tensors still went to the pool


def test_packing_an_efficient_zero_tensor_is_kept(pool):
    class SaveBoth(torch.autograd.Function):
        @staticmethod
        def forward(fctx, x, z):
            fctx.save_for_backward(x, z)
            return x * 2

        @staticmethod
        def backward(fctx, grad):
            _, z = fctx.saved_tensors
            assert z._is_zerotensor()
            return grad * 2 + z, None

    x = torch.randn(128, 128, requires_grad=True)
    z = torch._efficientzerotensor(128, 128)
    ctx = cpu_offload(pool)
    with ctx:
        y = SaveBoth.apply(x, z).sum()
    y.backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0))
    s = ctx.stats()
    assert s["kept_by_reason"]["no_data"] == 1 and s["tensors_offloaded"] == 1, s


def test_a_tensor_whose_storage_was_freed_is_kept_not_read(pool):
    # FSDP and torch.compile resize storages to 0 under live tensors; copying one reads freed memory.
    class SaveFreed(torch.autograd.Function):
        @staticmethod
        def forward(fctx, x):
            gone = torch.randn(256, 256)
            gone.untyped_storage().resize_(0)
            fctx.save_for_backward(gone)
            return x * 3

        @staticmethod
        def backward(fctx, grad):
            return grad * 3

    x = torch.randn(16, requires_grad=True)
    ctx = cpu_offload(pool)
    with ctx:
        y = SaveFreed.apply(x).sum()
    y.backward()
    assert torch.equal(x.grad, torch.full_like(x, 3.0))
    assert ctx.stats()["kept_by_reason"]["no_data"] == 1


def test_offload_tensor_of_a_zero_tensor_raises_a_clear_error(pool):
    with pytest.raises(ValueError, match="ZeroTensor.*no data to copy"):
        co.offload_tensor(torch._efficientzerotensor(1024), pool=pool)
    with pytest.raises(ValueError, match="ZeroTensor"):
        co._C.offload_tensor(torch._efficientzerotensor(1024), pool._impl, True)  # the native check too
    assert pool.stats()["num_allocs"] == 0


def test_no_data_is_a_reason_everywhere_reasons_are_listed(pool):
    from ckpt_offload.profiling import KEEP_REASONS

    reasons = set(cpu_offload(pool).stats()["kept_by_reason"])
    assert "no_data" in reasons
    assert reasons == set(KEEP_REASONS), reasons ^ set(KEEP_REASONS)
    with open(os.path.join(REPO_ROOT, "docs", "api.md")) as f:
        api = f.read()
    assert all(f"`{r}`" in api for r in reasons), [r for r in reasons if f"`{r}`" not in api]


# --- a forked child gets fresh copy threads --------------------------------------------------


def _in_child(conn, fn, *args):
    # As DataLoader workers do: torch's OpenMP thread pool does not survive fork either, and an op
    # that uses it in the child hangs (without ckpt_offload too).
    torch.set_num_threads(1)
    try:
        fn(*args)
        conn.send(None)
    except BaseException:
        conn.send(traceback.format_exc())
    finally:
        conn.close()


def _forked(fn, *args, timeout=120):
    """Runs fn(*args) in a child made by fork: its traceback, None when it returned, or why it did
    not (it hung: killed after `timeout` s; it died)."""
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_in_child, args=(child, fn, *args))
    p.start()
    child.close()
    p.join(timeout)
    if p.is_alive():
        p.kill()
        p.join()
        return f"the forked child hung ({timeout} s) running {fn.__name__}"
    return parent.recv() if parent.poll() else f"the child died with exit code {p.exitcode}"


def run_forked(fn, *args, timeout=120):
    """Runs fn(*args) in a child made by fork; fails (never hangs) when the child hangs or fails."""
    error = _forked(fn, *args, timeout=timeout)
    assert error is None, error


def _plain_backward():
    torch.ones(4, requires_grad=True).mul(2).sum().backward()


def skip_unless_torch_runs_backward_after_fork():
    """Skips the test where torch itself refuses a backward in a forked child: once a process has run
    a backward on a machine with a GPU, autograd's device threads exist and torch raises "Unable to
    handle autograd's threading in combination with fork-based multiprocessing" in any child, with
    or without ckpt_offload. Probed, not guessed: the parent runs a backward, a child tries one."""
    _plain_backward()
    error = _forked(_plain_backward, timeout=60)
    if error and "Autograd-and-Fork" in error:
        pytest.skip(
            "torch refuses backward in a forked child here (autograd's device threads started: "
            "a machine with a GPU); the same child without ckpt_offload fails alike"
        )


def _train_in_child(expected, stream, parent_graph):
    model = small_model()
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    for s in ("side", "compute") if stream is None else (stream,):
        ctx = co.offload(stream=s, **CPU)  # the default pool, inherited from the parent
        got = step_grads(model, x, ctx)
        assert ctx.stats()["tensors_offloaded"] > 0
        assert_bit_identical(expected, got)
        co.synchronize()
    if parent_graph is not None:
        # The parent's forward was offloaded with copies still queued at the fork: its bytes
        # reached the pool before the fork, so backward works here too.
        loss, leaf, want = parent_graph
        loss.backward()
        assert torch.equal(leaf.grad, want)


@pytest.mark.parametrize("stream", ["side", "compute"])
def test_forked_child_trains_a_step(stream):
    skip_unless_torch_runs_backward_after_fork()
    model = small_model()
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    expected = step_grads(model, x)
    # The parent has run offloaded steps (the copy threads exist) ...
    assert_bit_identical(expected, step_grads(model, x, co.offload(stream=stream, **CPU)))
    # ... and forks with copies in flight (the tests delay every CPU copy).
    leaf = torch.randn(512, 512, requires_grad=True)
    with co.offload(stream=stream, **CPU):
        loss = leaf.exp().sin().sum()
    want = leaf.detach().exp().cos() * leaf.detach().exp()
    run_forked(_train_in_child, expected, stream, (loss, leaf, want))
    loss.backward()  # the parent's own copy of the graph is intact too
    assert torch.allclose(leaf.grad, want)


class _OffloadedStepDataset(torch.utils.data.Dataset):
    """Each item trains a step under co.offload in the DataLoader worker and returns whether its
    gradients match the step without offload."""

    def __init__(self, expected):
        self.expected = expected

    def __len__(self):
        return 4

    def __getitem__(self, i):
        model = small_model()
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
        got = step_grads(model, x, co.offload(stream="side" if i % 2 else "compute", **CPU))
        co.synchronize()
        return all(torch.equal(got[k], self.expected[k]) for k in self.expected)


def test_dataloader_fork_workers_offload():
    skip_unless_torch_runs_backward_after_fork()
    model = small_model()
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    expected = step_grads(model, x)
    step_grads(model, x, co.offload(**CPU))  # the copy threads exist before the workers fork
    loader = torch.utils.data.DataLoader(
        _OffloadedStepDataset(expected), batch_size=None, num_workers=2, multiprocessing_context="fork", timeout=120
    )
    assert list(loader) == [True] * 4


def _spill_in_child(pool):
    x = torch.randn(256, 256, requires_grad=True)
    with pytest.raises(co.SpillError, match="forked child"):
        with co.offload(pool=pool, **CPU):
            y = x.exp().sin().exp()  # three 256 KiB saves into a 256 KiB pool: the rest spills
        del y
    pool.synchronize()  # returns: nothing of this process is queued on the disk
    # A pool of its own spills fine.
    own = co.HostPool(pinned=False, max_bytes=256 * 1024, spill_dir=pool.spill_dir)
    with co.offload(pool=own, **CPU):
        y = x.exp().sin().exp()
    y.sum().backward()
    assert own.stats()["disk"]["blocks_spilled"] > 0
    want = x.detach().exp().sin().exp() * x.detach().exp().cos() * x.detach().exp()
    assert torch.allclose(x.grad, want)


def test_forked_child_gets_a_clear_error_from_the_parents_disk_tier(tmp_path):
    skip_unless_torch_runs_backward_after_fork()
    pool = co.HostPool(pinned=False, max_bytes=256 * 1024, spill_dir=str(tmp_path))
    x = torch.randn(256, 256, requires_grad=True)
    with co.offload(pool=pool, **CPU):
        y = x.exp().sin().exp()
    assert pool.stats()["disk"]["blocks_spilled"] > 0  # the parent's tier has run
    run_forked(_spill_in_child, pool)
    y.sum().backward()


def _disk_writes_done_in_child(pool, expected_spilled):
    s = pool.stats()["disk"]  # the tier as the fork left it, read without waiting for anything
    assert s["blocks_spilled"] == expected_spilled
    assert s["blocks_written"] == s["blocks_spilled"], s
    pool.synchronize()


def test_fork_waits_for_the_disk_tiers_writes(tmp_path):
    """Note [Fork]: the disk tier's I/O threads free each written staging block under the
    staging pool's lock, and do not exist in a fork child: a fork while a write was running left
    that lock held there for good (the child hung in pool.synchronize()). Forking now waits for
    every queued read and write first, so the child sees them all done."""
    pool = co.HostPool(pinned=False, max_bytes=1 << 20, spill_dir=str(tmp_path))
    x = torch.randn(1024, 1024, requires_grad=True)  # 4 MiB saves: most of them spill
    with co.offload(pool=pool, **CPU):
        y = x.exp().sin().exp()
    spilled = pool.stats()["disk"]["blocks_spilled"]
    assert spilled >= 2
    run_forked(_disk_writes_done_in_child, pool, spilled, timeout=60)  # forks at once, writes in flight
    y.sum().backward()


# --- caps below the smallest block are refused -------------------------------------------------


@pytest.mark.parametrize("cap", [1, 100, 4095])
def test_spill_cap_below_a_page_is_refused_not_unlimited(tmp_path, cap):
    with pytest.raises(ValueError, match=rf"spill_max_bytes={cap} is below the minimum of 4096 bytes"):
        co.HostPool(pinned=False, max_bytes=1 << 20, spill_dir=str(tmp_path), spill_max_bytes=cap)
    with pytest.raises(ValueError, match="spill_max_bytes"):  # the native tier refuses it too
        co._C.FileTier(dir=str(tmp_path), max_bytes=cap)


def test_spill_cap_of_one_page_is_honoured(tmp_path):
    pool = co.HostPool(pinned=False, max_bytes=64 * 1024, spill_dir=str(tmp_path), spill_max_bytes=4096)
    x = torch.randn(512, 512, requires_grad=True)
    with co.offload(pool=pool, **CPU) as ctx:
        y = x.exp().sin()
    y.sum().backward()
    s = pool.stats()["disk"]
    assert s["bytes_reserved"] <= 4096 and s["blocks_spilled"] == 0
    assert ctx.stats()["kept_by_reason"]["disk_full"] >= 1


@pytest.mark.parametrize("cap", [1, 128, 4095])
def test_pool_cap_below_a_page_is_refused(cap):
    with pytest.raises(ValueError, match=rf"max_bytes={cap} is below the minimum of 4096 bytes.*None for no cap"):
        co.HostPool(pinned=False, max_bytes=cap)
    pool = co.HostPool(pinned=False, max_bytes=4096)
    with pytest.raises(ValueError, match=rf"max_bytes={cap}"):
        pool.max_bytes = cap
    assert pool.max_bytes == 4096
    with pytest.raises(ValueError, match="4096"):  # the native pool refuses it too
        co._C.HostPool(backend="pageable", max_bytes=cap, segment_bytes=1 << 20)


def test_pool_cap_of_one_page_holds_a_block():
    pool = co.HostPool(pinned=False, max_bytes=4096, segment_bytes=4096)
    t = torch.randn(1024)  # 4096 bytes
    h = co.offload_tensor(t, pool=pool)
    assert torch.equal(h.reload(), t)
    assert pool.stats()["num_blocks_in_use"] == 1


# --- every exit exits, and leaves nothing installed --------------------------------------------


@contextlib.contextmanager
def offload_scope(pool):
    with cpu_offload(pool) as ctx:
        yield ctx


def test_contextmanager_scope_closed_out_of_order_leaves_nothing_installed(pool):
    x = torch.randn(64, 64, requires_grad=True)
    scope = offload_scope(pool)
    outer = scope.__enter__()
    inner = cpu_offload(pool)
    inner.__enter__()
    with pytest.warns(RuntimeWarning, match="reverse order"):
        scope.__exit__(None, None, None)  # out of order: the generator's `with` exits first
    assert not outer.active and inner.active
    y = x.exp()  # the inner context is still in force
    assert inner.stats()["tensors_offloaded"] == 1 and outer.stats()["tensors_offloaded"] == 0
    inner.__exit__()
    assert top_hooks() is None
    z = x.sin()  # a plain op: offloaded by nobody
    assert outer.stats()["tensors_offloaded"] == 0 and inner.stats()["tensors_offloaded"] == 1
    (y.sum() + z.sum()).backward()
    assert torch.allclose(x.grad, x.detach().exp() + x.detach().cos())


def test_out_of_order_exit_under_torch_hooks_ends_with_an_empty_stack(pool):
    x = torch.randn(64, 64, requires_grad=True)
    a = cpu_offload(pool)
    a.__enter__()
    inner = torch.autograd.graph.save_on_cpu()
    inner.__enter__()
    with pytest.warns(RuntimeWarning, match="reverse order"):
        a.__exit__(None, None, None)
    assert top_hooks() is not None  # save_on_cpu's own entry, still in force
    y = x.exp()
    assert a.stats()["tensors_offloaded"] == 0
    inner.__exit__(None, None, None)
    assert top_hooks() is None
    y.sum().backward()
    assert torch.equal(x.grad, x.detach().exp())


def test_exit_from_another_thread_leaves_nothing_offloading(pool):
    x = torch.randn(64, 64, requires_grad=True)
    ctx = cpu_offload(pool)
    ctx.__enter__()
    caught = []

    def other():
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            ctx.__exit__(None, None, None)
        caught.extend(str(m.message) for m in w)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert any("different thread" in m for m in caught), caught
    assert not ctx.active
    y = x.exp()  # the entry left on this thread's stack hands tensors back as they are
    assert ctx.stats()["tensors_offloaded"] == 0 and pool.stats()["bytes_in_use"] == 0
    with cpu_offload(pool) as fresh:  # the next co.offload here drops the stale entry
        z = x.sin()
    assert top_hooks() is None and fresh.stats()["tensors_offloaded"] == 1
    (y.sum() + z.sum()).backward()
    assert torch.allclose(x.grad, x.detach().exp() + x.detach().cos())


def test_exit_from_inside_backward_leaves_nothing_offloading(pool):
    ctx = cpu_offload(pool)
    caught = []

    class ExitInBackward(torch.autograd.Function):
        @staticmethod
        def forward(fctx, x):
            return x * 2

        @staticmethod
        def backward(fctx, grad):
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                ctx.__exit__(None, None, None)  # misuse: the hooks stack here is backward's copy
            caught.extend(str(m.message) for m in w)
            return grad * 2

    x = torch.randn(64, 64, requires_grad=True)
    ctx.__enter__()
    y = ExitInBackward.apply(x).sum()
    y.backward()
    assert any("inside a backward" in m for m in caught), caught
    assert not ctx.active
    assert torch.equal(x.grad, torch.full_like(x, 2.0))
    z = x.exp()  # not offloaded into the exited context
    assert ctx.stats()["tensors_offloaded"] == 0
    with cpu_offload(pool):
        pass
    assert top_hooks() is None
    z.sum().backward()


def test_exit_takes_no_arguments(pool):
    ctx = cpu_offload(pool)
    ctx.__enter__()
    ctx.__exit__()
    assert not ctx.active and top_hooks() is None
    ctx.__exit__()  # a second exit does nothing


def _sac_step(hooks, allow_mutation, x, w):
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    def block(x):
        h = x @ w
        h.mul_(2)  # mutates the tensor SAC cached: allowed with allow_cache_entry_mutation=True
        return h.sin().sum()

    def contexts():
        return create_selective_checkpoint_contexts(policy, allow_cache_entry_mutation=allow_mutation)

    with hooks if hooks is not None else contextlib.nullcontext():
        loss = checkpoint(block, x, use_reentrant=False, context_fn=contexts, respect_saved_tensors_hooks=True)
    loss.backward()
    return x.grad, w.grad


@pytest.mark.skipif(
    "respect_saved_tensors_hooks" not in TORCH_KEYWORDS,
    reason="torch without respect_saved_tensors_hooks (its cache bypasses saved-tensor hooks)",
)
@pytest.mark.parametrize("min_bytes", [0, 1 << 30], ids=["offloaded", "kept"])
def test_selective_checkpoint_allow_cache_entry_mutation_is_honoured(pool, min_bytes):
    def inputs():
        g = torch.Generator().manual_seed(3)
        return torch.randn(64, 64, generator=g, requires_grad=True), torch.randn(
            64, 64, generator=g, requires_grad=True
        )

    # Offloading returns the copy made when SAC cached the tensor (a clone at pack time: what
    # save_on_cpu returns on a GPU; on CPU its .cpu() is the tensor itself), whether the copy
    # runs on the side stream (slowed down by the suite's copy delay, so it would otherwise read
    # the bytes after the block's mul_ wrote them) or in a batch copied at context exit; keeping
    # it returns the tensor as it is now, as SAC does without hooks.
    reference = torch.autograd.graph.saved_tensors_hooks(torch.clone, lambda t: t) if min_bytes == 0 else None
    expected = _sac_step(reference, True, *inputs())
    for options in ({}, {"stream": "compute"}, {"batch_below": 1 << 20}):
        ctx = co.offload(devices=["cpu"], min_bytes=min_bytes, pool=pool, **options)
        got = _sac_step(ctx, True, *inputs())
        assert all(torch.equal(a, b) for a, b in zip(expected, got)), options
        if min_bytes == 0:
            assert ctx.stats()["tensors_offloaded"] >= 1
    # Without the option the mutation is still an error.
    with pytest.raises(RuntimeError, match="modified by an inplace operation|has been mutated"):
        _sac_step(co.offload(devices=["cpu"], min_bytes=min_bytes, pool=pool), False, *inputs())
