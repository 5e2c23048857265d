"""The stats of co.offload contexts and of handles: one native table of keys (Note [Stats table] in
csrc/torch/counters.h) that the struct, reset, the dict and Python's lists come from; per-handle
counts (two models wrapped with equal options count apart); size strings for byte arguments."""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.nn as nn
from conftest import assert_bit_identical, cpu_offload
from helpers import REPO_ROOT, step_grads
from models_for_tests import Chain

import ckpt_offload as co
from ckpt_offload import _C
from ckpt_offload._stats import zero_stats
from ckpt_offload.profiling import KEEP_REASONS

MiB = 1 << 20
ROOT = REPO_ROOT
# What reset_stats() zeroes; tensors_converted needs store_dtype (tests/offload/test_store_dtype.py
# checks its reset), store_dtype is an option's name and store_error a dict of classes.
COUNTS = {k for k, merge in _C.stats_keys() if merge not in ("state", "name", "by_class")} - {"tensors_converted"}


def _cpu(pool=None, **kw):
    return dict({"devices": ["cpu"], "min_bytes": 0}, **({"pool": pool} if pool is not None else {}), **kw)


# ---------------------------------------------------------------- one table


def test_stats_keys_are_what_stats_returns_in_order():
    s = cpu_offload().stats()
    assert list(s) == [k for k, _ in _C.stats_keys()]
    assert list(s["kept_by_reason"]) == list(s["kept_bytes_by_reason"]) == _C.keep_reasons()
    assert {merge for _, merge in _C.stats_keys()} == {"sum", "max", "per_reason", "state", "name", "by_class"}


def test_python_reason_lists_come_from_the_table():
    # The reasons the packer can produce that a hand-written list once lacked.
    assert {"disk_full", "autocast_cast"} <= set(KEEP_REASONS)
    assert KEEP_REASONS == tuple(_C.keep_reasons())
    zero = zero_stats()
    assert list(zero) == list(cpu_offload().stats())
    assert all(v == 0 for k, v in zero.items() if not isinstance(v, dict) and k != "store_dtype")
    assert zero["store_dtype"] is None and zero["store_error"] == {}
    assert zero["kept_by_reason"] == dict.fromkeys(_C.keep_reasons(), 0)


def _busy_steps(spill_dir) -> co.offload:
    """A context after steps that make every counter of the table non-zero: spills to disk (and
    reads back by prefetch), batches, deduplicated and shared reloads, a prefetch that fails, one
    left unused, and tensors kept for several reasons."""
    pool = co.HostPool(pinned=False, max_bytes=2 * MiB, spill_dir=spill_dir, spill_file_bytes=8 * MiB)
    ctx = cpu_offload(pool, prefetch_bytes=64 * MiB, batch_below=1024, batch_bytes=4096)
    torch.manual_seed(0)
    model, x = Chain(n=6), torch.randn(512, 512)
    small = torch.randn(8, 8, requires_grad=True)
    ref = step_grads(model, x)
    model.zero_grad(set_to_none=True)
    with ctx:
        y = model(x)
        z = (small * small).sum()  # 256 bytes: batched
    ((y * y).sum() + z).backward()
    got = {n: p.grad for n, p in model.named_parameters()}
    assert_bit_identical(ref, got)
    # A prefetch that raises (backward reloads that tensor when asked) ...
    _C.testing.fail_next_prefetches(1)
    try:
        with ctx:
            y = model(x)
        (y * y).sum().backward()
    finally:
        _C.testing.fail_next_prefetches(0)
    # ... and prefetches nobody takes: backward stops at a middle activation, so the tensors
    # packed before it were prefetched for nothing.
    with ctx:
        h = torch.tanh(model.layers[0](x))
        h.retain_grad()
        mid = torch.tanh(model.layers[1](h))
        y = torch.tanh(model.layers[2](mid))
    torch.autograd.grad((y * y).sum(), [mid])
    del h, mid, y
    co.synchronize()
    return ctx


def test_reset_stats_zeroes_every_counter_of_the_table(tmp_path):
    ctx = _busy_steps(str(tmp_path))
    s = ctx.stats()
    zero = [k for k in COUNTS if not isinstance(s[k], dict) and s[k] == 0]
    assert zero == [], f"the steps left these counters at 0, so the test would not see a missing reset: {zero}"
    assert s["tensors_spilled"] > 0 and s["bytes_spilled"] > 0 and s["disk_prefetches"] > 0
    assert sum(s["kept_by_reason"].values()) > 0
    ctx.reset_stats()
    after = ctx.stats()
    for k in COUNTS:
        if isinstance(after[k], dict):
            assert set(after[k].values()) == {0}, k
        else:
            assert after[k] == 0, k
    # The window the prefetcher learned is state, not a count: reset leaves it.
    assert after["prefetch_window_bytes"] == s["prefetch_window_bytes"]


def test_docs_list_every_stats_key_and_keep_reason():
    with open(os.path.join(ROOT, "docs", "api.md")) as f:
        api = f.read()
    named = set(re.findall(r"`([a-z_0-9]+)`", api))
    missing = [k for k, _ in _C.stats_keys() if k not in named] + [r for r in _C.keep_reasons() if r not in named]
    assert missing == [], f"docs/api.md does not name {missing}"
    doc = co.offload.stats.__doc__
    missing = [k for k, _ in _C.stats_keys() if f"``{k}``" not in doc] + [
        r for r in _C.keep_reasons() if f"``{r}``" not in doc
    ]
    assert missing == [], f"co.offload.stats's docstring does not name {missing}"


# ---------------------------------------------------------------- the pool's and the disk tier's tables


def test_pool_stats_keys_are_what_stats_returns_in_order():
    pool = co.HostPool(pinned=False)
    keys = list(pool.stats())
    assert keys == list(_C.POOL_STATS_KEYS) == list(co.HostPool.STATS_KEYS)
    assert len(set(keys)) == len(keys)
    assert pool.stats()["max_bytes"] is None and pool.stats()["backend"] == "pageable"
    assert co.HostPool(pinned=False, max_bytes=MiB).stats()["max_bytes"] == MiB


def test_pool_reset_peak_sets_every_peak_of_the_table_back():
    pool = co.HostPool(pinned=False, segment_bytes=64 << 10)  # the big block: a segment of its own
    big = co.offload_tensor(torch.randn(MiB // 4), pool=pool)
    small = co.offload_tensor(torch.randn(1000), pool=pool)
    del big
    pool.empty_cache()
    s = pool.stats()
    peaks = [k for k in s if k.startswith("peak_")]
    assert peaks == ["peak_bytes_in_use", "peak_bytes_reserved"]
    assert all(s[k] > s[k[len("peak_") :]] for k in peaks), s  # the test would see a peak left alone
    pool.reset_peak()
    after = pool.stats()
    assert all(after[k] == after[k[len("peak_") :]] > 0 for k in peaks), after
    del small


def test_disk_stats_keys_are_what_stats_returns_in_order(tmp_path):
    pool = co.HostPool(pinned=False, max_bytes=2 * MiB, spill_dir=str(tmp_path), spill_file_bytes=8 * MiB)
    d = pool.stats()["disk"]
    assert list(d) == list(_C.DISK_STATS_KEYS) == list(co.HostPool.DISK_STATS_KEYS)
    assert list(pool._tier.stats()) == list(_C.FILE_TIER_STATS_KEYS)
    assert list(_C.DISK_STATS_KEYS[: len(_C.FILE_TIER_STATS_KEYS)]) == list(_C.FILE_TIER_STATS_KEYS)
    # Computed keys before any I/O, and the raw counts they come from left out.
    assert d["dir"] == str(tmp_path) and d["write_bandwidth"] is None and d["read_stall_seconds"] == 0.0
    assert not {"write_busy_ns", "read_busy_ns", "read_stall_ns", "stalls"} & set(d)


def test_docs_list_every_pool_stats_key():
    with open(os.path.join(ROOT, "docs", "api.md")) as f:
        named = set(re.findall(r"`([a-z_0-9]+)`", f.read()))
    doc = co.HostPool.stats.__doc__
    missing = [k for k in _C.POOL_STATS_KEYS if k not in named or f"``{k}``" not in doc]
    assert missing == [], f"docs/api.md or HostPool.stats's docstring does not name {missing}"


# ---------------------------------------------------------------- per-handle stats


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x):
        return torch.tanh(self.lin(x))


def _model(n=4):
    torch.manual_seed(0)
    return nn.Sequential(*[_Layer() for _ in range(n)])


def _step(model):
    model(torch.randn(8, 32, requires_grad=True)).sum().backward()


def _two_models_count_apart(wrap):
    """``wrap(model)`` -> handle, for two models with equal options: a step of the second leaves
    the first handle's counts as they were, and each counts its own blocks."""
    pool = co.HostPool(pinned=False)
    a, b = _model(), _model()
    ha, hb = wrap(a, pool), wrap(b, pool)
    _step(a)
    alone = ha.stats()
    assert alone["tensors_offloaded"] > 0
    _step(b)
    assert ha.stats()["tensors_offloaded"] == alone["tensors_offloaded"]
    assert ha.stats()["bytes_offloaded"] == alone["bytes_offloaded"]
    assert hb.stats()["tensors_offloaded"] == alone["tensors_offloaded"]
    hb.reset_stats()
    assert ha.stats()["tensors_offloaded"] == alone["tensors_offloaded"]  # b's reset is b's own
    ha.remove()
    hb.remove()


def test_apply_handles_with_equal_options_count_apart():
    _two_models_count_apart(lambda m, pool: co.apply(m, offload=_cpu(pool)))


def test_apply_handles_with_the_default_pool_count_apart():
    _two_models_count_apart(lambda m, pool: co.apply(m, offload=_cpu()))


def test_segment_handles_count_apart():
    _two_models_count_apart(lambda m, pool: co.apply(m, segments=2, offload=_cpu(pool)))


def test_plan_handles_count_their_blocks_apart():
    from ckpt_offload.blocks import install_units
    from ckpt_offload.planner.simulator import Unit

    def wrap(model, pool):
        blocks = list(model.named_children())
        units = [Unit(0, 0, "offload"), Unit(1, 1, "recompute_offload"), Unit(2, 3, "recompute_offload")]
        return install_units(model, blocks, units, _cpu(pool))

    _two_models_count_apart(wrap)


def test_plan_handle_stats_were_zero_before_and_count_now():
    from ckpt_offload.blocks import install_units
    from ckpt_offload.planner.simulator import Unit

    pool = co.HostPool(pinned=False)
    model = _model()
    handle = install_units(model, list(model.named_children()), [Unit(i, i, "offload") for i in range(4)], _cpu(pool))
    _step(model)
    s = handle.stats()
    # Every saved tensor of the four offloaded blocks: each Linear's input and tanh's output.
    assert s["tensors_offloaded"] >= 4 and s["bytes_offloaded"] == pool.stats()["peak_bytes_in_use"] > 0
    assert 0 < s["pool_peak_bytes"] <= pool.stats()["peak_bytes_in_use"]
    handle.remove()


def test_handle_pool_peak_is_its_own():
    pool = co.HostPool(pinned=False)
    a, b = _model(), _model(n=8)
    hb = co.apply(b, offload=_cpu(pool))
    _step(b)  # the pool's peak is now b's
    ha = co.apply(a, offload=_cpu(pool, min_bytes=1 << 40))  # offloads nothing
    _step(a)
    assert pool.stats()["peak_bytes_in_use"] > 0
    assert ha.stats()["pool_peak_bytes"] == 0
    assert ha.stats()["tensors_offloaded"] == 0
    assert 0 < hb.stats()["pool_peak_bytes"] <= pool.stats()["peak_bytes_in_use"]
    hb.reset_stats()
    assert hb.stats()["pool_peak_bytes"] == 0
    ha.remove()
    hb.remove()


def test_gradients_unchanged_with_two_handles():
    ref_model = _model()
    x = torch.randn(8, 32, requires_grad=True)
    ref_model(x).sum().backward()
    ref = {n: p.grad.clone() for n, p in ref_model.named_parameters()}
    a, b = _model(), _model()
    ha, hb = co.apply(a, offload=_cpu()), co.apply(b, offload=_cpu())
    for m in (a, b):
        m(x).sum().backward()
        assert_bit_identical(ref, {n: p.grad for n, p in m.named_parameters()})
    ha.remove()
    hb.remove()


def test_hf_enable_handles_count_apart():
    pytest.importorskip("transformers")
    from helpers import gpt2, loss_of

    pool = co.HostPool(pinned=False)
    torch.manual_seed(0)
    a, b = gpt2().train(), gpt2().train()
    for m in (a, b):
        m.config.use_cache = False
    ha = co.hf.enable(a, offload=_cpu(pool))
    hb = co.hf.enable(b, offload=_cpu(pool))
    loss_of(a).backward()
    alone = ha.stats()["tensors_offloaded"]
    assert alone > 0
    loss_of(b).backward()
    assert ha.stats()["tensors_offloaded"] == alone
    assert hb.stats()["tensors_offloaded"] == alone
    ha.remove()
    hb.remove()


def _trainer_logs(tmp_path, model, callback) -> list:
    """The log entries (as the callbacks after ours see them) of a 3-step train() of ``model``."""
    from helpers import train
    from transformers import TrainerCallback

    class Recorder(TrainerCallback):
        def __init__(self):
            self.logs = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs))

    recorder = Recorder()
    train(tmp_path, model, [callback, recorder])
    return recorder.logs


def _logged(logs, key):
    return [e[f"ckpt_offload/{key}"] for e in logs if f"ckpt_offload/{key}" in e]


def _hf_model():
    from helpers import gpt2

    torch.manual_seed(0)
    model = gpt2()
    model.config.use_cache = False
    return model


@pytest.mark.parametrize("kind", ["checkpoint", "offload"])
def test_trainer_logs_describe_each_run(tmp_path, kind):
    pytest.importorskip("transformers")
    pool = co.HostPool(pinned=False)
    model = _hf_model()
    if kind == "checkpoint":
        cb = co.hf.OffloadCheckpointCallback(offload=_cpu(pool))
    else:
        cb = co.hf.OffloadCallback(**_cpu(pool))
    first = _trainer_logs(tmp_path, model, cb)
    second = _trainer_logs(tmp_path, model, cb)  # the same callback (and handle), a second run
    # Counters are logged per step (``<key>_per_step``), peaks as they are (both since train() began).
    for key in ("tensors_offloaded_per_step", "bytes_offloaded_per_step"):
        assert _logged(first, key)[0] > 0
        assert _logged(second, key) == _logged(first, key), key  # per run, not carried over
    if kind == "checkpoint":
        assert _logged(second, "pool_peak_bytes")[0] > 0


def test_trainer_pool_peak_is_this_runs(tmp_path):
    pytest.importorskip("transformers")
    pool = co.HostPool(pinned=False)
    _trainer_logs(tmp_path, _hf_model(), co.hf.OffloadCheckpointCallback(offload=_cpu(pool)))
    assert pool.stats()["peak_bytes_in_use"] > 0
    # A later run, on another model, whose callback offloads nothing into the same pool: the
    # pool's peak from the run before is not this run's.
    quiet = co.hf.OffloadCheckpointCallback(offload=_cpu(pool, min_bytes=1 << 40))
    logs = _trainer_logs(tmp_path, _hf_model(), quiet)
    for key in ("bytes_offloaded_per_step", "pool_peak_bytes"):
        values = _logged(logs, key)
        assert len(values) >= 3 and set(values) == {0}, (key, values)


# ---------------------------------------------------------------- size strings


def test_parse_bytes_is_one_function():
    from ckpt_offload._args import parse_bytes

    assert co.planner.parse_bytes is parse_bytes
    assert parse_bytes("x", "1GiB") == 1 << 30
    assert parse_bytes("x", "512MiB") == 512 << 20
    assert parse_bytes("x", "1.5 kb") == 1500
    assert parse_bytes("x", "64") == 64


def test_offload_takes_size_strings():
    ctx = co.offload(devices=["cpu"], min_bytes="1KiB", prefetch_bytes="2MiB", batch_below="4KiB", batch_bytes="1MiB")
    assert (ctx.min_bytes, ctx.prefetch_bytes, ctx.batch_below, ctx.batch_bytes) == (1024, 2 * MiB, 4096, MiB)
    x = torch.randn(64, 64, requires_grad=True)  # 16 KiB: offloaded; the 4-element one is too small
    small = torch.randn(2, 2, requires_grad=True)
    with ctx:
        y = (x * x).sum() + (small * small).sum()
    y.backward()
    assert torch.equal(x.grad, 2 * x) and torch.equal(small.grad, 2 * small)
    s = ctx.stats()
    assert s["tensors_offloaded"] >= 1 and s["kept_by_reason"]["too_small"] >= 1
    assert s["prefetch_window_bytes"] == 2 * MiB


def test_offload_option_dicts_take_size_strings_and_share_a_context():
    from ckpt_offload.checkpointing import context_for
    from ckpt_offload.options import as_options

    given = as_options({"devices": ["cpu"], "min_bytes": "64KiB"})
    assert given.min_bytes == 64 * 1024
    assert context_for(given) is context_for(as_options({"devices": ["cpu"], "min_bytes": 65536}))
    model = _model()
    handle = co.apply(model, offload={"devices": ["cpu"], "min_bytes": "0B", "batch_bytes": "1MiB"})
    _step(model)
    assert handle.stats()["tensors_offloaded"] > 0
    handle.remove()


def test_host_pool_takes_size_strings(tmp_path):
    pool = co.HostPool(pinned=False, max_bytes="4MiB", segment_bytes="1MiB")
    assert pool.max_bytes == 4 * MiB and pool._impl.segment_bytes == MiB
    pool.set_max_bytes("8MiB")
    assert pool.max_bytes == 8 * MiB
    pool.max_bytes = "2 MiB"
    assert pool.max_bytes == 2 * MiB
    assert pool.reserve("1MiB") >= MiB
    spill = co.HostPool(
        pinned=False,
        max_bytes="1MiB",
        spill_dir=str(tmp_path),
        spill_max_bytes="64MiB",
        spill_file_bytes="8MiB",
        spill_staging_bytes="2MiB",
    )
    assert spill.max_bytes == MiB


def test_plan_takes_size_strings():
    from ckpt_offload.planner.costs import Bandwidth, BlockCost, CostModel

    model = _model()
    costs = CostModel(blocks=[BlockCost(name=str(i)) for i in range(4)], bandwidth=Bandwidth(1e9, 1e9))
    p = co.plan(model, lambda: None, budget="1MiB", costs=costs, offload={"devices": ["cpu"], "min_bytes": "1KiB"})
    assert p.costs.min_bytes == 1024 and costs.min_bytes == 0  # the plan's copy, not the caller's costs
    with pytest.raises(ValueError, match=r"min_bytes: cannot read 'lots' as bytes"):
        co.plan(model, lambda: None, budget="1MiB", costs=costs, offload={"devices": ["cpu"], "min_bytes": "lots"})


@pytest.mark.parametrize(
    "call",
    [
        lambda: co.offload(devices=["cpu"], min_bytes="lots"),
        lambda: co.HostPool(pinned=False, max_bytes="12 parsecs"),
        lambda: co.HostPool(pinned=False).set_max_bytes("-1MiB"),
    ],
)
def test_bad_size_strings_name_the_argument(call):
    with pytest.raises(ValueError, match=r"(min_bytes|max_bytes): cannot read .* as bytes; write e.g. '2GiB'"):
        call()


def test_size_below_minimum_names_the_argument():
    with pytest.raises(ValueError, match=r"batch_bytes must be >= 1, got 0"):
        co.offload(devices=["cpu"], batch_bytes="0KiB")
    with pytest.raises(TypeError, match=r"max_bytes must be an int or None \(or a size string such as '512MiB'\)"):
        co.HostPool(pinned=False, max_bytes=[1])


# ---------------------------------------------------------------- counts that add up


def test_joined_views_count_the_bytes_the_host_holds():
    # Three views of one storage: two in cells of their own, then one that bridges them, which
    # joins both copies into one (only the missing cells are copied). The stats say what the
    # pool holds, not just the first two views' spans.
    pool = co.HostPool(pinned=False)
    leaf = torch.randn(4096, requires_grad=True)
    with cpu_offload(pool) as ctx:
        x = leaf * 1.0  # 4096 float32: 16,384 bytes, saved by nothing (a scalar multiply)
        ys = [x[:100].sin(), x[4000:].sin(), x[50:4050].sin()]  # sin saves its input view
    s = ctx.stats()
    held = pool.stats()["bytes_in_use"]
    assert held == 16384, pool.stats()
    assert s["tensors_offloaded"] == 2 and s["tensors_deduplicated"] == 1, s
    assert s["bytes_offloaded"] == s["bytes_stored"] == held, s
    ref = leaf.detach()
    sum(y.sum() for y in ys).backward()
    expect = torch.zeros(4096)
    for sl in (slice(0, 100), slice(4000, 4096), slice(50, 4050)):
        expect[sl] += ref[sl].cos()
    assert torch.equal(leaf.grad, expect)


def _in_a_thread(step):
    """Runs ``step()`` in a new thread that has ended when this returns (its errors raise here)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1) as pool:  # leaving the block joins the thread
        pool.submit(step).result()


def test_apply_handle_keeps_counts_of_a_thread_that_ended():
    import gc

    torch.manual_seed(0)
    model = _model()
    handle = co.apply(model, offload=_cpu(co.HostPool(pinned=False)))
    x = torch.randn(8, 32, requires_grad=True)
    _in_a_thread(lambda: model(x).sum().backward())
    gc.collect()  # the thread's contexts are gone
    in_thread = handle.stats()["tensors_offloaded"]
    model(x).sum().backward()
    on_main = handle.stats()["tensors_offloaded"] - in_thread
    assert on_main > 0 and in_thread == on_main, (in_thread, on_main)
    _in_a_thread(lambda: model(x).sum().backward())
    gc.collect()
    assert handle.stats()["tensors_offloaded"] == 3 * on_main  # counts never go backwards
    handle.remove()


def test_hf_handle_keeps_counts_of_a_thread_that_ended():
    pytest.importorskip("transformers")
    import gc

    from helpers import gpt2, loss_of

    torch.manual_seed(0)
    model = gpt2().train()
    model.config.use_cache = False
    handle = co.hf.enable(model, offload=_cpu(co.HostPool(pinned=False)))
    _in_a_thread(lambda: loss_of(model).backward())
    gc.collect()
    in_thread = handle.stats()["tensors_offloaded"]
    loss_of(model).backward()
    assert in_thread > 0 and handle.stats()["tensors_offloaded"] == 2 * in_thread
    handle.remove()
