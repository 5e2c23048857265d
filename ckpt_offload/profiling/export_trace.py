"""The Chrome trace of a profile (like torch's ``_chrome_trace_export``): open it in
https://ui.perfetto.dev or chrome://tracing.

Functions over a :class:`~ckpt_offload.profiling.report.ProfileReport`; its methods of the same
names call them.

Example::

    from ckpt_offload.profiling.export_trace import export_chrome_trace

    export_chrome_trace(prof, "trace.json")
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from ckpt_offload.profiling._records import gbps, time_span, to_jsonable

if TYPE_CHECKING:
    from ckpt_offload.profiling.report import ProfileReport


def chrome_trace(report: ProfileReport) -> dict:
    """The trace-event dict that :func:`export_chrome_trace` writes.

    Example::

        names = {e["name"] for e in chrome_trace(prof)["traceEvents"]}
    """
    report.check_ready()
    r = report.records
    events = []
    pids: dict = {}
    tid_names = {1: "compute", 2: "D2H", 3: "H2D"}

    def pid_of(device: str) -> int:
        if device not in pids:
            pids[device] = len(pids) + 1
            p = pids[device]
            events.append({"name": "process_name", "ph": "M", "pid": p, "tid": 0, "args": {"name": device}})
            events.append({"name": "process_sort_index", "ph": "M", "pid": p, "tid": 0, "args": {"sort_index": p}})
            for tid, tname in tid_names.items():
                events.append({"name": "thread_name", "ph": "M", "pid": p, "tid": tid, "args": {"name": tname}})
                events.append(
                    {"name": "thread_sort_index", "ph": "M", "pid": p, "tid": tid, "args": {"sort_index": tid}}
                )
        return pids[device]

    for d in report.devices:
        pid_of(d)

    # Copies of one direction on one stream never overlap, so they nest on one track; a
    # second stream of a direction (stream="compute" and "side" in one profile) gets its own.
    stream_tids: dict = {}

    def copy_tid(pid: int, kind: str, stream) -> int:
        key = (pid, kind, stream)
        if key not in stream_tids:
            base = "D2H" if kind == "d2h" else "H2D"
            n = sum(1 for k in stream_tids if k[:2] == (pid, kind))
            tid = (2 if kind == "d2h" else 3) if n == 0 else 10 + len(stream_tids)
            stream_tids[key] = tid
            if n:
                events.append(
                    {
                        "name": "thread_name",
                        "ph": "M",
                        "pid": pid,
                        "tid": tid,
                        "args": {"name": f"{base} (stream {stream})"},
                    }
                )
                events.append(
                    {"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}}
                )
        return stream_tids[key]

    def x(name, cat, pid, tid, start, end, args):
        if start is None or end is None:  # untimed: nothing to place on a timeline
            return
        events.append(
            {
                "name": name,
                "cat": cat,
                "ph": "X",
                "pid": pid,
                "tid": tid,
                "ts": float(start),
                "dur": max(0.0, float(end) - float(start)),
                "args": args,
            }
        )

    # Compute ranges: outer ones first at equal start, so viewers nest them.
    timed = [c for c in r["compute"] if time_span(c)]
    for c in sorted(timed, key=lambda c: (c["start_us"], -(c["end_us"] - c["start_us"]))):
        x(c["name"], "compute", pid_of(c["device"]), 1, c["start_us"], c["end_us"], {"module": c["name"]})
    for w in r["waits"]:
        if not w.get("stall_us") or w.get("ready_us") is None:
            continue
        h = report.handle(w["handle"])
        x(
            f"stall: wait for H2D #{w['handle']}",
            "stall",
            pid_of(w["device"]),
            1,
            w["ready_us"] - w["stall_us"],
            w["ready_us"],
            {
                "handle": w["handle"],
                "module": h.get("module") or "",
                "bytes": h.get("bytes"),
                "stall_us": w["stall_us"],
                "request_us": w["request_us"],
                "ready_us": w["ready_us"],
            },
        )
    for c in r["copies"]:
        h = report.handle(c["handle"])
        span = time_span(c)
        dur = max(0.0, span[1] - span[0]) if span else 0.0
        d2h = c["kind"] == "d2h"
        module = h.get("module") or ""
        args = {
            "bytes": c["bytes"],
            "handle": c["handle"],
            "module": module,
            "shape": h.get("shape"),
            "dtype": h.get("dtype"),
            "GB/s": round(gbps(c["bytes"], dur / 1e6), 4),
            "stream": c["stream"],
            "prefetch": bool(c.get("prefetch")),
            "members": c.get("members", 1),
            "id": c["id"],
        }
        label = ("D2H " if d2h else ("H2D prefetch " if c.get("prefetch") else "H2D ")) + (module or f"#{c['handle']}")
        pid = pid_of(c["device"])
        x(
            label,
            "d2h" if d2h else "h2d",
            pid,
            copy_tid(pid, c["kind"], c["stream"]),
            c["start_us"],
            c["end_us"],
            args,
        )

    # The host pool and the memory counters: a process of their own (the pool is not per device).
    pool_pid = len(pids) + 1
    events.append({"name": "process_name", "ph": "M", "pid": pool_pid, "tid": 0, "args": {"name": "host pool"}})
    events.append(
        {"name": "process_sort_index", "ph": "M", "pid": pool_pid, "tid": 0, "args": {"sort_index": pool_pid}}
    )
    events.append({"name": "thread_name", "ph": "M", "pid": pool_pid, "tid": 4, "args": {"name": "pool"}})
    for p in r["pool"]:
        x(p["kind"], "pool", pool_pid, 4, p["start_us"], p["end_us"], {"bytes": p["bytes"]})
    # The disk tier (a pool's spill_dir): one track per direction, a slice per spilled block.
    for tid, kind, name in ((5, "disk_write", "disk write"), (6, "disk_read", "disk read")):
        recs = [d for d in r.get("disk", []) if d["kind"] == kind]
        if recs:
            events.append({"name": "thread_name", "ph": "M", "pid": pool_pid, "tid": tid, "args": {"name": name}})
        for d in recs:
            dur = max(0.0, d["end_us"] - d["start_us"])
            label = (
                ("prefetch " if d.get("prefetch") else "")
                + f"{name} "
                + ((report.handle(d["handle"]) or {}).get("module") or f"#{d['handle']}")
            )
            x(
                label,
                kind,
                pool_pid,
                tid,
                d["start_us"],
                d["end_us"],
                {"bytes": d["bytes"], "handle": d["handle"], "GB/s": round(gbps(d["bytes"], dur / 1e6), 4)},
            )
    for m in r["memory"]:
        events.append(
            {
                "name": "memory (bytes)",
                "ph": "C",
                "pid": pool_pid,
                "tid": 4,
                "ts": float(m["t_us"]),
                "args": {
                    "pool_bytes_in_use": m["pool_bytes_in_use"],
                    "device_bytes_saved": m["device_bytes_saved"],
                    "disk_bytes_in_use": m.get("disk_bytes_in_use", 0),
                },
            }
        )
    return {
        "traceEvents": to_jsonable(events),
        "displayTimeUnit": "ms",
        "otherData": {"generator": "ckpt_offload.profile", "cpu_only": report.cpu_only},
    }


def export_chrome_trace(report: ProfileReport, path) -> str:
    """Writes a Chrome trace-event JSON file; returns the path. Open it in https://ui.perfetto.dev
    or chrome://tracing: one process per device with "compute" (module forward ranges and
    stalls waiting for reloads), "D2H" and "H2D" tracks, and a "host pool" process with
    backend allocations, cap hits and the memory counters. Click a copy for its bytes,
    shape, dtype, module, handle and GB/s.

    Example::

        export_chrome_trace(prof, "trace.json")
    """
    path = os.fspath(path)
    with open(path, "w") as f:
        json.dump(chrome_trace(report), f)
    return path
