"""One host shared by many ranks: ``co.HostPool(max_bytes="auto")`` divides a node budget between
the local ranks, the excess goes to ``spill_dir``, the first rank to reach its share says so once;
a refused pinned segment falls back to pageable memory with a warning naming the host limit.

The multi-rank test launches 4 CPU processes (gloo on 127.0.0.1, tests/gloo_ranks.py, under a
timeout) with a node budget well below what their activations need: the pools' reserved bytes,
summed over the ranks, never exceed it (each pool's peak is at most its share, and the shares sum
to at most the budget), the rest is spilled to disk, gradients are bit-identical, and exactly one
rank warns.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch

import ckpt_offload as co
from ckpt_offload import _host_memory
from ckpt_offload import pool as pool_module
from gloo_ranks import gloo_available, launch_ranks, wait_ranks

WORKER = Path(__file__).with_name("host_share_worker.py")
RANKS = 4
NODE_MAX_BYTES = 1 << 20  # 256 KiB per rank; each rank's two steps save ~2 MiB of activations


@pytest.fixture
def no_simulated_refusal():
    yield
    co._C.testing.simulate_pinned_refusal("")


def test_auto_divides_node_budget_between_local_ranks(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    pool = co.HostPool(max_bytes="auto", node_max_bytes="1MiB", pinned=False)
    share = (1 << 20) // 3 // 4096 * 4096  # rounded down to whole pages: 3 shares fit in the budget
    assert pool.max_bytes == share
    assert {
        k: pool.share[k] for k in ("max_bytes", "node_max_bytes", "local_world_size", "host_fraction", "bounded_by")
    } == {
        "max_bytes": share,
        "node_max_bytes": 1 << 20,
        "local_world_size": 3,
        "host_fraction": None,
        "bounded_by": "node_max_bytes",
    }
    # local_world_size= overrides the environment.
    assert co.HostPool(max_bytes="auto", node_max_bytes="1MiB", local_world_size=4, pinned=False).max_bytes == 1 << 18


def test_auto_uses_a_fraction_of_available_memory(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(
        _host_memory,
        "available",
        lambda: {
            "available_bytes": 100 << 20,
            "bounded_by": "MemAvailable",
            "mem_available": 100 << 20,
            "cgroup": None,
        },
    )
    pool = co.HostPool(max_bytes="auto", pinned=False)
    assert pool.share["host_fraction"] == pool_module.DEFAULT_HOST_FRACTION == 0.5
    assert pool.max_bytes == (50 << 20) // 2
    assert co.HostPool(max_bytes="auto", host_fraction=0.25, pinned=False).max_bytes == (25 << 20) // 2


def test_auto_reads_real_available_memory():
    available = _host_memory.mem_available()
    assert available > 0
    with open("/proc/meminfo") as f:
        meminfo = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    assert abs(available - meminfo["MemAvailable"]) < (256 << 20)  # read moments apart


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_bytes="auto", node_max_bytes="1MiB", host_fraction=0.5), "node_max_bytes or host_fraction, not both"),
        (dict(max_bytes="auto", host_fraction=0), r"host_fraction must be a number in \(0, 1\]"),
        (dict(max_bytes="auto", host_fraction=1.5), r"host_fraction must be a number in \(0, 1\]"),
        (
            dict(max_bytes="auto", node_max_bytes=4096, local_world_size=8),
            "LOCAL_WORLD_SIZE=8 local ranks leave 0 bytes",
        ),
        (dict(max_bytes=1 << 20, node_max_bytes="1MiB"), "node_max_bytes needs max_bytes='auto'"),
        (dict(host_fraction=0.5), "host_fraction needs max_bytes='auto'"),
        (dict(max_bytes="auto", local_world_size=0), "local_world_size"),
    ],
)
def test_auto_bad_arguments(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        co.HostPool(pinned=False, **kwargs)


def test_auto_bad_local_world_size_env(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "four")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE='four' is not a positive integer"):
        co.HostPool(max_bytes="auto", node_max_bytes="1MiB", pinned=False)


def _train(pool=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh())
    x = torch.randn(128, 64, generator=torch.Generator().manual_seed(1))
    if pool is None:
        model(x).square().mean().backward()
    else:
        with co.offload(devices=["cpu"], min_bytes=0, pool=pool) as ctx:
            loss = model(x).square().mean()
        loss.backward()
        assert ctx.stats()["tensors_offloaded"] > 0
    return [p.grad for p in model.parameters()]


@pytest.mark.parametrize("limit", ["vm.max_map_count", "RLIMIT_MEMLOCK"])
def test_refused_pinned_memory_falls_back_to_pageable_with_a_warning(limit, no_simulated_refusal):
    """The driver refusing page-locked memory (simulated: this machine may have no GPU) is not a
    full pool: the segment is taken as pageable memory, the pool warns once naming the limit, and
    backward is unchanged."""
    plain = _train()
    co._C.testing.simulate_pinned_refusal(limit)
    pool = co.HostPool(backend="pinned", max_bytes="4MiB", segment_bytes=64 << 10)
    with pytest.warns(UserWarning, match=rf"page-locked memory .* refused .*limit: {limit}") as caught:
        got = _train(pool)
    assert sum("page-locked" in str(w.message) for w in caught) == 1
    for a, b in zip(plain, got):
        assert torch.equal(a, b)
    fb = pool.pinned_fallback()
    assert fb["segments"] >= 1 and fb["bytes"] == pool.stats()["bytes_reserved"] > 0, fb
    assert limit in fb["reason"]
    assert pool.stats()["bytes_in_use"] == 0
    assert pool.stats()["num_cap_hits"] == 0  # not the cap: every tensor went to the pool
    # Once per pool: a second step warns no more.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train(pool)
    # The pageable segments go back to the allocator they came from.
    pool.empty_cache()
    assert pool.pinned_fallback()["bytes"] == 0 and pool.stats()["bytes_reserved"] == 0


def test_reserve_falls_back_and_warns(no_simulated_refusal):
    co._C.testing.simulate_pinned_refusal("RLIMIT_MEMLOCK")
    pool = co.HostPool(backend="registered")
    with pytest.warns(UserWarning, match="RLIMIT_MEMLOCK"):
        assert pool.reserve(1 << 20) == 1 << 20
    assert pool.pinned_fallback()["bytes"] == 1 << 20


def test_simulated_refusal_names_a_known_limit():
    with pytest.raises(ValueError, match="limit must be 'vm.max_map_count', 'RLIMIT_MEMLOCK' or ''"):
        co._C.testing.simulate_pinned_refusal("nofile")


def test_pageable_pool_reports_no_fallback():
    assert co.HostPool(pinned=False).pinned_fallback() is None


def test_auto_share_full_without_spill_dir_warns_naming_the_option(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_PORT", f"test-{uuid.uuid4().hex}")  # a launch of its own: a fresh marker
    pool = co.HostPool(max_bytes="auto", node_max_bytes=4 * 65536, pinned=False, segment_bytes=65536)
    plain = _train()
    with pytest.warns(
        UserWarning,
        match=r"max_bytes='auto'.*node_max_bytes=262144.*LOCAL_WORLD_SIZE=4.*"
        r"65536 bytes per rank.*kept_by_reason\['pool_full'\].*spill_dir=",
    ):
        got = _train(pool)
    for a, b in zip(plain, got):
        assert torch.equal(a, b)
    assert pool.stats()["peak_bytes_reserved"] <= 65536


@pytest.mark.skipif(not gloo_available(), reason="torch.distributed with gloo is not available")
def test_four_local_ranks_never_exceed_the_node_budget(tmp_path, spill_dir):
    spill = Path(spill_dir)
    out = tmp_path / "out"
    out.mkdir()
    wait_ranks(launch_ranks(WORKER, out, [NODE_MAX_BYTES, spill], world_size=RANKS), out, 180)
    results = [torch.load(out / f"rank{r}.pt") for r in range(RANKS)]
    for r, res in enumerate(results):
        assert "error" not in res, f"rank {r}:\n{res['error']}"
        assert res["share"]["local_world_size"] == RANKS and res["share"]["max_bytes"] == NODE_MAX_BYTES // RANKS
        assert res["same_grads"], f"rank {r}: gradients differ with ckpt_offload"
        assert res["pool"]["bytes_in_use"] == 0 and res["disk"]["bytes_in_use"] == 0, res
        assert res["disk"]["blocks_spilled"] > 0, res["disk"]  # the excess went to disk, nothing stayed behind
        assert res["ctx"]["kept_by_reason"]["pool_full"] == 0 and res["ctx"]["kept_by_reason"]["disk_full"] == 0
    # Each pool's peak is at most its share, so at no moment did the ranks together reserve more
    # than the node's budget.
    assert sum(res["pool"]["peak_bytes_reserved"] for res in results) <= NODE_MAX_BYTES
    said = [r for r, res in enumerate(results) for w in res["warnings"] if "max_bytes='auto'" in w]
    assert len(said) == 1, [res["warnings"] for res in results]
    message = next(w for w in results[said[0]]["warnings"] if "max_bytes='auto'" in w)
    assert f"node_max_bytes={NODE_MAX_BYTES}" in message and f"spill_dir='{spill}'" in message


def test_auto_share_of_a_single_rank_always_says_so(monkeypatch):
    """With one rank on the host there is no one to coordinate with: every such pool warns, even a
    second run from the same parent and port (a marker file would have silenced it)."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    for _ in range(2):
        pool = co.HostPool(max_bytes="auto", node_max_bytes=65536, pinned=False, segment_bytes=65536)
        with pytest.warns(UserWarning, match=r"max_bytes='auto'.*LOCAL_WORLD_SIZE=1"):
            _train(pool)


# One local rank (of two: LOCAL_WORLD_SIZE=2) of a launch: reaches its share of the node and prints
# the warnings it gave. (That only one rank of a launch says it: the four-rank test above.)
_LAUNCHED_RANK = r"""
import json, warnings
import torch
import ckpt_offload as co

co._C.testing.set_cpu_copy_delay_us(0)
torch.set_num_threads(1)
pool = co.HostPool(max_bytes="auto", node_max_bytes=2 * 65536, pinned=False, segment_bytes=65536)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh())
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with co.offload(devices=["cpu"], min_bytes=0, pool=pool):
        loss = model(torch.randn(512, 64)).square().mean()  # 128 KiB per saved activation: over the share
    loss.backward()
print(json.dumps([str(w.message) for w in caught if "max_bytes='auto'" in str(w.message)]))
"""


def test_each_launch_from_one_parent_and_port_warns_and_leaves_no_marker():
    """Two launches from this process with the same MASTER_PORT (mp.spawn run twice with a fixed
    port): the second one's rank reaching its share warns too (the first launch's marker named the
    same parent and port), and no marker is left in the temporary directory afterwards."""
    import json
    import os
    import subprocess
    import sys
    import tempfile

    port = f"test-{uuid.uuid4().hex}"
    env = dict(
        os.environ,
        LOCAL_WORLD_SIZE="2",
        MASTER_PORT=port,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(
            p for p in (str(Path(co.__file__).resolve().parent.parent), os.environ.get("PYTHONPATH")) if p
        ),
    )
    for launch in range(2):
        rank = subprocess.run(  # outside the tree: a checkout's ckpt_offload/ would shadow the installed one
            [sys.executable, "-c", _LAUNCHED_RANK],
            env=env,
            cwd=tempfile.gettempdir(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert rank.returncode == 0, f"launch {launch}:\n{rank.stderr[-3000:]}"
        said = json.loads(rank.stdout.strip().splitlines()[-1])
        assert len(said) == 1 and "LOCAL_WORLD_SIZE=2" in said[0], f"launch {launch}: {said}"
    left = [n for n in os.listdir(tempfile.gettempdir()) if n.startswith("ckpt_offload-") and n.endswith(port)]
    assert left == [], left
