"""benchmarks/bandwidth.py on CPU, two sizes, no fixed-cost part: ``--numa-node`` places the pool's
memory on that node and the report says where the pool's bytes were (the hook that compares local
and remote host memory on a two-node GPU machine); every round trip came back intact.

The benchmark measures; this test checks what it reports, never how fast anything ran.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os

import pytest
from helpers import REPO_ROOT

from ckpt_offload import _numa

SCRIPT = os.path.join(REPO_ROOT, "benchmarks", "bandwidth.py")


def _load():
    spec = importlib.util.spec_from_file_location("bandwidth_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_numa_node_option_places_the_pool_and_reports_it(tmp_path):
    nodes = _numa.memory_nodes()
    if not nodes:
        pytest.skip("this kernel shows no NUMA nodes (/sys/devices/system/node)")
    bw = _load()
    code = bw.main(
        [
            "--device",
            "cpu",
            "--quick",
            "--min-size",
            "64K",
            "--max-size",
            "256K",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--skip-overhead",
            "--numa-node",
            str(nodes[-1]),
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    report = json.loads((tmp_path / "bandwidth.json").read_text())
    numa = report["numa"]
    assert (numa["numa_node"], numa["reason"]) == (nodes[-1], f"numa_node={nodes[-1]}")
    reserved = report["pool_stats_end"]["bytes_reserved"]
    assert reserved > 0 and numa["bytes_by_node"] == {str(nodes[-1]): reserved}
    assert numa["gpu_numa_node"] is None and numa["memory_nodes"] == nodes  # the CPU path: no GPU
    assert report["verified"] and report["overhead"] is None
    assert f"Pool NUMA node: {nodes[-1]}" in (tmp_path / "bandwidth.md").read_text()


@pytest.mark.parametrize("text, value", [("auto", "auto"), ("none", None), ("NONE", None), ("1", 1)])
def test_numa_node_argument(text, value):
    assert _load().parse_numa_node(text) == value


@pytest.mark.parametrize("text", ["-1", "near"])
def test_bad_numa_node_argument(text):
    with pytest.raises(argparse.ArgumentTypeError, match="NUMA node"):
        _load().parse_numa_node(text)
