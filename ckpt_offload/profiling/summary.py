"""The fixed-width summary table of a profile (``ProfileReport.summary()``).

Example::

    print(format_summary(report, top=5))
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ckpt_offload.profiling._aggregate import Row, rows_by_module
from ckpt_offload.profiling._records import fmt_bytes, gbps

if TYPE_CHECKING:
    from ckpt_offload.profiling.report import ProfileReport


def saved_line(peak: int, total: int) -> str:
    """``"X of Y, Z% less"``: a device peak against what it would have been without offload.

    Example::

        saved_line(18 * 2**20, 64 * 2**20)   # '18.0 MiB of 64.0 MiB, 72% less'
    """
    if total <= 0:
        return f"{fmt_bytes(peak)} of {fmt_bytes(total)}"
    return f"{fmt_bytes(peak)} of {fmt_bytes(total)}, {1 - peak / total:.0%} less"


def format_summary(report: ProfileReport, by: str = "module", top: int | None = None) -> str:
    """The text of :meth:`ProfileReport.summary <ckpt_offload.profiling.report.ProfileReport.summary>`
    (see there for the columns, ``by`` and ``top``).

    Example::

        print(format_summary(report, by="total"))
    """
    if by not in ("module", "total"):
        raise ValueError(f"by must be 'module' or 'total', got {by!r}")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < 1):
        raise ValueError(f"top must be a positive int or None, got {top!r}")
    rows = rows_by_module(report)
    total = Row()
    for a in rows.values():
        total.add(a)
    t = report.totals()

    shown = list(rows.items())
    if top is not None and len(shown) > top:
        heavy = sorted(shown, key=lambda kv: -(kv[1].d2h_bytes + kv[1].h2d_bytes))[:top]
        keep = {name for name, _ in heavy}
        other = Row()
        n_other = 0
        for name, a in shown:
            if name not in keep:
                other.add(a)
                n_other += 1
        shown = [(name, a) for name, a in shown if name in keep]
        shown.append((f"(other {n_other} modules)", other))
    if by == "total":
        shown = []

    devices = report.devices
    lines = []
    where = ", ".join(devices) if devices else "no device"
    if report.cpu_only and t["copies"]:
        kind = "CPU copies (memcpy): bandwidth below is host memory copy speed, not GPU transfer speed"
    elif t["copies"]:
        kind = "GPU copies (PCIe/NVLink), timed with CUDA events"
    else:
        kind = "no copies recorded"
    lines.append(f"ckpt_offload profile: {where}; {kind}")
    lines.append(
        f"{t['copies']} copies ({t['tensors_offloaded']} offloaded, {t['tensors_reloaded']} reloaded, "
        f"{t['prefetched_copies']} prefetched) over {t['wall_seconds'] * 1e3:.1f} ms"
    )
    lines += disk_lines(report.records.get("disk") or [])
    if t["untimed_records"]:
        lines.append(
            f"note: {t['untimed_records']} copy/wait records have no timestamp (their event was not timed); "
            "they count in bytes, not in times or bandwidth"
        )
    if t["dropped_records"]:
        lines.append(f"WARNING: {t['dropped_records']} records were dropped (recorder cap hit): totals are low")
    lines.append("")

    name_w = max([len("module")] + [len(n) for n, _ in shown] + [len("TOTAL")])
    name_w = min(name_w, 48)
    cols = [
        ("tensors", 7),
        ("offloaded", 10),
        ("reloaded", 10),
        ("D2H GB/s", 8),
        ("H2D GB/s", 8),
        ("copy ms", 8),
        ("hidden ms", 9),
        ("stall ms", 8),
        ("prefetch", 8),
        ("kept", 5),
    ]
    header = f"{'module':<{name_w}}  " + "  ".join(f"{c:>{w}}" for c, w in cols)
    lines.append(header)
    lines.append("-" * len(header))

    def fmt_row(name: str, a: Row) -> str:
        if len(name) > name_w:
            name = "..." + name[-(name_w - 3) :]
        vals = [
            str(a.d2h_n),
            fmt_bytes(a.d2h_bytes),
            fmt_bytes(a.h2d_bytes),
            f"{a.d2h_gbps:.2f}" if a.d2h_us > 0 else "-",
            f"{a.h2d_gbps:.2f}" if a.h2d_us > 0 else "-",
            f"{a.copy_us / 1e3:.2f}",
            f"{a.hidden_us / 1e3:.2f}",
            f"{a.stall_us / 1e3:.2f}",
            str(a.prefetched),
            str(a.kept),
        ]
        return f"{name:<{name_w}}  " + "  ".join(f"{v:>{w}}" for v, (_, w) in zip(vals, cols))

    for name, a in shown:
        lines.append(fmt_row(name, a))
    if shown:
        lines.append("-" * len(header))
    lines.append(fmt_row("TOTAL", total))
    lines.append("")
    if t["copy_seconds"] > 0:
        lines.append(
            f"copies: {t['copy_seconds'] * 1e3:.2f} ms in all, {t['hidden_fraction']:.0%} hidden behind compute; "
            f"compute stream stalled {t['stall_seconds'] * 1e3:.2f} ms waiting for reloads"
        )

    ps = report.pool_stats
    cap = ps[0].get("max_bytes") if len(ps) == 1 else None
    backend = "/".join(sorted({str(s.get("backend")) for s in ps})) if ps else "?"
    lines.append(
        f"host pool ({backend}): peak in use {fmt_bytes(t['pool_peak_bytes'])} during the profile, "
        f"reserved {fmt_bytes(t['pool_reserved_bytes'])} at exit, cap {'none' if cap is None else fmt_bytes(cap)}"
    )
    n = t["backend_allocs"]
    lines.append(
        f"  {n} backend allocation{'' if n == 1 else 's'} ({t['backend_alloc_seconds'] * 1e3:.2f} ms), "
        f"{t['cap_hits']} cap hit{'' if t['cap_hits'] == 1 else 's'}"
    )
    alloc = t["device_allocated_peak_bytes"]
    lines.append(
        "device: saved activations held on the device peaked at "
        + saved_line(t["device_saved_peak_bytes"], t["saved_total_bytes"])
        + " (what autograd saved in all: the peak without offload)"
        + (f"; allocator peak {fmt_bytes(alloc)}" if alloc is not None else "")
    )
    kept = [(k, n, t["kept_bytes_by_reason"].get(k, 0)) for k, n in t["kept_by_reason"].items() if n]
    if kept:
        lines.append(
            f"kept on the device ({t['tensors_kept']}): " + ", ".join(f"{k} {n} ({fmt_bytes(b)})" for k, n, b in kept)
        )
    else:
        lines.append("kept on the device: none")
    return "\n".join(lines)


def disk_lines(disk: list) -> list[str]:
    """One line per direction of the disk tier (a pool's spill_dir): blocks, bytes, and the bandwidth
    over the time at least one block was moving, as the pool's disk stats count it."""
    lines = []
    for kind, verb in (("disk_write", "written to"), ("disk_read", "read from")):
        recs = [d for d in disk if d["kind"] == kind]
        if not recs:
            continue
        busy, end = 0.0, -math.inf
        for a, b in sorted((d["start_us"], d["end_us"]) for d in recs):
            busy += max(0.0, b - max(a, end))
            end = max(end, b)
        nbytes = sum(d["bytes"] for d in recs)
        pre = sum(1 for d in recs if d.get("prefetch"))
        lines.append(
            f"disk: {len(recs)} blocks ({fmt_bytes(nbytes)}) {verb} the spill files at "
            f"{gbps(nbytes, busy / 1e6):.2f} GB/s" + (f", {pre} started by prefetch" if pre else "")
        )
    return lines
