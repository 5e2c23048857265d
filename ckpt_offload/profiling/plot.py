"""The memory timeline of a profile as a PNG (matplotlib, no global pyplot state).

Example::

    from ckpt_offload.profiling.plot import plot_memory

    plot_memory(prof, "memory.png")
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ckpt_offload.profiling.report import ProfileReport


def plot_memory(report: ProfileReport, path) -> str:
    """Saves a PNG of the memory timeline: bytes of saved activations held on the device
    (and torch's allocator total, on a GPU) against the pool's bytes in use; returns the path.
    Needs matplotlib (``pip install matplotlib``); uses no global pyplot state.

    Example::

        plot_memory(prof, "memory.png")
    """
    report.check_ready()
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(f"plot_memory needs matplotlib ({e}); install it with `pip install matplotlib`") from e
    mem = sorted(report.records["memory"], key=lambda m: m["t_us"])
    ts = [m["t_us"] / 1e3 for m in mem]
    mib = 1 / (1 << 20)
    fig = Figure(figsize=(9, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.step(ts, [m["device_bytes_saved"] * mib for m in mem], where="post", label="saved activations on the device")
    allocated = [m.get("device_bytes_allocated") for m in mem]
    if any(a is not None for a in allocated):
        ax.step(ts, [(a or 0) * mib for a in allocated], where="post", label="device allocator total")
    ax.step(ts, [m["pool_bytes_in_use"] * mib for m in mem], where="post", label="host pool in use", linestyle="--")
    if any(m.get("disk_bytes_in_use") for m in mem):
        ax.step(
            ts, [m.get("disk_bytes_in_use", 0) * mib for m in mem], where="post", label="spilled to disk", linestyle=":"
        )
    ax.set_xlabel("time since profile start (ms)")
    ax.set_ylabel("MiB")
    title = "ckpt_offload memory timeline"
    if report.cpu_only:
        title += " (CPU tensors: 'device' is host memory here)"
    ax.set_title(title)
    if not mem:
        ax.text(
            0.5,
            0.5,
            "no samples (nothing was packed or unpacked)",
            ha="center",
            va="center",
            transform=ax.transAxes,
        )
    else:
        ax.legend(loc="upper right")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    path = os.fspath(path)
    fig.savefig(path, format="png")
    return path
