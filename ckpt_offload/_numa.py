"""Which NUMA node a pool's segments go on: ``co.HostPool(numa_node="auto" | int | None)``.

``"auto"`` is the node of the current GPU, read from sysfs through the device's PCI address
(``/sys/bus/pci/devices/<domain:bus:device.0>/numa_node``), where there is a GPU and the host has
more than one node with memory; otherwise no node (the pool allocates as it always has). How the
pages are placed is the core's (Note [NUMA-local segments] in csrc/core/numa.h).

The root of /sys is ``_ROOT``, which tests point at a fake tree.
"""

from __future__ import annotations

import os

from ckpt_offload._args import check_int
from ckpt_offload._runtime import gpu_usable

#: Where /sys is read from: "/" except in tests, which point it at a fake tree.
_ROOT = "/"

#: The largest node number a kernel has (MAX_NUMNODES is at most 1 << 10).
MAX_NODE = 1023


def _read(path: str) -> str | None:
    try:
        with open(os.path.join(_ROOT, path.lstrip("/"))) as f:
            return f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None


def parse_node_list(text: str) -> list[int]:
    """A sysfs node list (``"0-1,3"``) as ints: ``[0, 1, 3]``; [] for an empty or bad one."""
    nodes = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        try:
            nodes.extend(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            return []
    return sorted(set(nodes))


def memory_nodes() -> list[int]:
    """The nodes with memory (``/sys/devices/system/node/has_memory``, else ``online``); [] where
    the kernel shows no nodes."""
    for name in ("has_memory", "online"):
        text = _read(f"/sys/devices/system/node/{name}")
        if text is not None:
            return parse_node_list(text)
    return []


def pci_address(domain: int, bus: int, device: int) -> str:
    """The sysfs name of a PCI device's function 0: ``"0000:17:00.0"``."""
    return f"{domain:04x}:{bus:02x}:{device:02x}.0"


def pci_device_node(address: str) -> int | None:
    """The NUMA node of the PCI device at ``address``; None where sysfs gives none (-1, as in
    many virtual machines, or no such file)."""
    text = _read(f"/sys/bus/pci/devices/{address}/numa_node")
    try:
        node = int(text) if text is not None else -1
    except ValueError:
        return None
    return node if node >= 0 else None


def _current_gpu() -> tuple[int, str] | None:
    """``(index, PCI address)`` of the current CUDA device, None without a usable GPU or a PCI
    address (torch too old to report it)."""
    if not gpu_usable():
        return None
    import torch

    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    try:
        return index, pci_address(props.pci_domain_id, props.pci_bus_id, props.pci_device_id)
    except AttributeError:
        return None


def _device_count() -> int:
    import torch

    return torch.cuda.device_count()


def resolve(numa_node) -> tuple[int | None, str]:
    """``numa_node`` as co.HostPool takes it -> (the node to place segments on or None, why).

    Example::

        node, why = resolve("auto")   # (None, "no usable GPU") on a CPU-only machine
    """
    if numa_node is None:
        return None, "numa_node=None"
    if isinstance(numa_node, str):
        if numa_node != "auto":
            raise ValueError(f"numa_node must be 'auto', a node number or None, got {numa_node!r}")
        gpu = _current_gpu()
        if gpu is None:
            return None, "no usable GPU"
        nodes = memory_nodes()
        if len(nodes) < 2:
            return None, f"one NUMA node with memory ({nodes[0] if nodes else 'none shown'}): nothing to choose"
        index, address = gpu
        rank = os.environ.get("LOCAL_RANK")
        if rank not in (None, str(index)) and index == 0 and _device_count() > 1:
            # Under torchrun a pool made before torch.cuda.set_device(local_rank) would take GPU 0's
            # node for every rank: no binding is better than the wrong node.
            return None, (
                f"LOCAL_RANK={rank} but the current device is GPU 0: call torch.cuda.set_device("
                "local_rank) before making the pool"
            )
        node = pci_device_node(address)
        if node is None:
            return None, f"sysfs gives GPU {index} ({address}) no NUMA node"
        if node not in nodes:
            return None, f"GPU {index} ({address}) is on node {node}, which has no memory"
        return node, f"GPU {index} ({address}) is on node {node}"
    node = check_int("numa_node", numa_node, minimum=0, maximum=MAX_NODE)
    return node, f"numa_node={node}"
