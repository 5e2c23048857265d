"""NUMA-local segments (Note [NUMA-local segments] in csrc/core/numa.h): ``co.HostPool(numa_node=...)``.

Node discovery runs against a fake sysfs (``_numa._ROOT``) with a fake current GPU: ``"auto"``
takes the node of the GPU's PCI device, and no node where there is no GPU, one node with memory,
a device sysfs gives no node (-1), or a torchrun rank that has not chosen its device yet.
Placement runs against the real kernel: a pool bound to a node this process may use reports
every reserved byte on that node, measured from the pages themselves (move_pages); the policy of
the pages is checked by the native test (tests/native/test_numa.cpp). An unbound pool, and every
pool on a machine without a GPU by default, reports no placement, as before.
"""

from __future__ import annotations

import pytest
import torch

import ckpt_offload as co
from ckpt_offload import _numa

GPU_ADDRESS = "0000:17:00.0"


def real_memory_nodes() -> list[int]:
    nodes = _numa.memory_nodes()
    if not nodes:
        pytest.skip("this kernel shows no NUMA nodes (/sys/devices/system/node): nothing to place on")
    return nodes


@pytest.fixture
def fake_sysfs(tmp_path, monkeypatch):
    """A sysfs with the given nodes with memory and the fake GPU's node (None: no file)."""

    def make(has_memory: str, gpu_node: str | None, gpu=(0, GPU_ADDRESS), device_count: int = 1):
        (tmp_path / "sys/devices/system/node").mkdir(parents=True)
        (tmp_path / "sys/devices/system/node/has_memory").write_text(has_memory + "\n")
        if gpu_node is not None:
            d = tmp_path / "sys/bus/pci/devices" / GPU_ADDRESS
            d.mkdir(parents=True)
            (d / "numa_node").write_text(gpu_node + "\n")
        monkeypatch.setattr(_numa, "_ROOT", str(tmp_path))
        monkeypatch.setattr(_numa, "_current_gpu", lambda: gpu)
        monkeypatch.setattr(_numa, "_device_count", lambda: device_count)

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    return make


@pytest.mark.parametrize("text, nodes", [("0", [0]), ("0-1", [0, 1]), ("0-1,3\n", [0, 1, 3]), ("", []), ("0-x", [])])
def test_parse_node_list(text, nodes):
    assert _numa.parse_node_list(text) == nodes


def test_pci_address_is_sysfs_spelling():
    assert _numa.pci_address(0, 0x17, 0) == GPU_ADDRESS
    assert _numa.pci_address(0x10000, 0xC1, 0x1F) == "10000:c1:1f.0"


def test_auto_takes_the_gpus_node(fake_sysfs):
    fake_sysfs("0-1", "1")
    assert _numa.resolve("auto") == (1, f"GPU 0 ({GPU_ADDRESS}) is on node 1")


@pytest.mark.parametrize(
    "has_memory, gpu_node, gpu, reason",
    [
        ("0-1", "1", None, "no usable GPU"),
        ("0", "0", (0, GPU_ADDRESS), "one NUMA node with memory (0): nothing to choose"),
        ("0-1", "-1", (0, GPU_ADDRESS), f"sysfs gives GPU 0 ({GPU_ADDRESS}) no NUMA node"),
        ("0-1", None, (0, GPU_ADDRESS), f"sysfs gives GPU 0 ({GPU_ADDRESS}) no NUMA node"),
        ("0-1", "2", (0, GPU_ADDRESS), f"GPU 0 ({GPU_ADDRESS}) is on node 2, which has no memory"),
    ],
)
def test_auto_places_nothing_without_a_known_node(fake_sysfs, has_memory, gpu_node, gpu, reason):
    fake_sysfs(has_memory, gpu_node, gpu)
    assert _numa.resolve("auto") == (None, reason)


def test_auto_before_set_device_under_torchrun_places_nothing(fake_sysfs, monkeypatch):
    fake_sysfs("0-1", "0", device_count=8)
    monkeypatch.setenv("LOCAL_RANK", "5")
    node, reason = _numa.resolve("auto")
    assert node is None and "LOCAL_RANK=5" in reason and "torch.cuda.set_device" in reason
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert _numa.resolve("auto")[0] == 0


def test_auto_pool_on_the_gpus_node_places_its_bytes_there(fake_sysfs):
    node = real_memory_nodes()[0]
    fake_sysfs(f"{node}-{node + 1}", str(node))  # a second node, so that "auto" has a choice
    pool = co.HostPool(pinned=False, segment_bytes=1 << 20)
    assert pool.numa == {"numa_node": node, "reason": f"GPU 0 ({GPU_ADDRESS}) is on node {node}"}
    assert pool.stats()["bytes_by_node"] == {}
    got = pool.reserve(3 << 20)
    s = pool.stats()
    assert s["numa_node"] == node and s["bytes_by_node"] == {node: got} == {node: s["bytes_reserved"]}


def test_bound_pool_round_trips_and_follows_its_segments():
    node = real_memory_nodes()[-1]
    pool = co.HostPool(pinned=False, numa_node=node, segment_bytes=1 << 20)
    x = torch.randn(1 << 18)  # 1 MiB: a segment of its own
    h = co.offload_tensor(x, pool=pool)
    assert torch.equal(h.reload(), x)
    s = pool.stats()
    assert s["bytes_by_node"] == {node: s["bytes_reserved"]} and s["bytes_reserved"] >= x.nbytes
    del h
    co.synchronize()
    pool.empty_cache()
    assert pool.stats()["bytes_by_node"] == {} and pool.stats()["bytes_reserved"] == 0


def test_spilling_pool_stages_on_its_node(tmp_path):
    node = real_memory_nodes()[0]
    pool = co.HostPool(pinned=False, numa_node=node, max_bytes=1 << 20, spill_dir=tmp_path)
    x = torch.randn(1 << 19)  # 2 MiB: past the cap, to disk through the staging pool
    h = co.offload_tensor(x, pool=pool)
    assert torch.equal(h.reload(), x)
    assert pool._staging.stats()["numa_node"] == node
    assert pool.stats()["disk"]["blocks_spilled"] >= 1


def test_unbound_pool_reports_no_placement():
    pool = co.HostPool(pinned=False, numa_node=None)
    pool.reserve(1 << 16)
    s = pool.stats()
    assert (s["numa_node"], s["bytes_by_node"]) == (None, None)
    assert pool.numa == {"numa_node": None, "reason": "numa_node=None"}


@pytest.mark.skipif(co.build_info()["gpu_available"], reason="a machine with a GPU may bind by default")
def test_default_pool_without_a_gpu_places_nothing():
    """No GPU: "auto" binds nothing, and the pool allocates as it always has."""
    assert co.HostPool().numa == {"numa_node": None, "reason": "no usable GPU"}
    assert co.default_pool().stats()["numa_node"] is None


@pytest.mark.parametrize(
    "value, error, match",
    [
        ("fast", ValueError, "numa_node must be 'auto', a node number or None"),
        (True, TypeError, "numa_node must be an int"),
        (1.0, TypeError, "numa_node must be an int"),
        (-1, ValueError, "numa_node must be >= 0"),
        (1 << 40, ValueError, "numa_node must be <= 1023"),
    ],
)
def test_bad_numa_node(value, error, match):
    with pytest.raises(error, match=match):
        co.HostPool(pinned=False, numa_node=value)


def test_node_this_process_may_not_use_names_the_allowed_ones():
    nodes = real_memory_nodes()
    with pytest.raises(
        ValueError,
        match=rf"numa_node=1000 is not a node this process may place memory on "
        rf"\(allowed: {nodes[0]}",
    ):
        co.HostPool(pinned=False, numa_node=1000)
