"""Tables of a profile: everything as JSON data (``to_dict``, ``profile.json``) and the copies as CSV.

Functions over a :class:`~ckpt_offload.profiling.report.ProfileReport`; its methods of the same
names call them.

Example::

    from ckpt_offload.profiling.export_table import export_csv, to_dict

    export_csv(prof, "records.csv")
    d = to_dict(prof)
"""

from __future__ import annotations

import csv
import json
import os
from typing import TYPE_CHECKING

from ckpt_offload.profiling._records import gbps, start_key, time_span, to_jsonable

if TYPE_CHECKING:
    from ckpt_offload.profiling.report import ProfileReport

#: The columns of :func:`export_csv`, in order.
CSV_COLUMNS = (
    "id",
    "kind",
    "handle",
    "module",
    "bytes",
    "shape",
    "dtype",
    "device",
    "stream",
    "start_us",
    "end_us",
    "duration_us",
    "gbps",
    "prefetch",
    "members",
)


def to_dict(report: ProfileReport) -> dict:
    """Everything as JSON-serialisable data: ``records`` (copies, handles, waits, keeps, pool,
    compute, memory, dropped; times in microseconds from the start of the profile),
    ``totals`` (see :meth:`ProfileReport.totals`), ``by_module`` (see :meth:`ProfileReport.by_module`), ``pool_stats``
    and ``devices``.

    Example::

        d = to_dict(prof)
        d["totals"]["d2h_gbps"], len(d["records"]["copies"])
    """
    report.check_ready()
    return to_jsonable(
        {
            "format": "ckpt_offload.profile/1",
            "devices": report.devices,
            "totals": report.totals(),
            "by_module": report.by_module(),
            "pool_stats": report.pool_stats,
            "records": report.records,
        }
    )


def export_json(report: ProfileReport, path) -> str:
    """Writes :func:`to_dict` to ``path``; returns the path.

    Example::

        export_json(prof, "profile.json")
    """
    path = os.fspath(path)
    with open(path, "w") as f:
        json.dump(to_dict(report), f, indent=1)
    return path


def stream_names(copies) -> dict:
    """``(device, stream pointer) -> name`` for the copy records: ``"compute"`` for a stream that
    carried copies of both directions (``stream="compute"`` copies on the compute stream),
    ``"d2h"`` / ``"h2d"`` for a side stream of one direction, numbered from the second one on a
    device (``"h2d.2"``: the demand-reload stream next to the prefetch one).

    Example::

        stream_names([{"device": 0, "stream": 7, "kind": "d2h"}])   # {(0, 7): 'd2h'}
    """
    kinds: dict = {}
    for c in sorted(copies, key=lambda c: c["id"]):
        kinds.setdefault((c["device"], c["stream"]), set()).add(c["kind"])
    names, used = {}, {}
    for key, ks in kinds.items():
        base = "compute" if len(ks) > 1 else next(iter(ks))
        n = used[(key[0], base)] = used.get((key[0], base), 0) + 1
        names[key] = base if n == 1 else f"{base}.{n}"
    return names


def export_csv(report: ProfileReport, path) -> str:
    """Writes one row per copy record, joined with its storage's shape, dtype and module;
    returns the path. Columns: :data:`CSV_COLUMNS` (shape as JSON, ``"[4, 64, 64]"``; ``"[]"`` for a 0-d tensor).

    Example::

        export_csv(prof, "records.csv")      # then pandas.read_csv("records.csv")
    """
    report.check_ready()
    path = os.fspath(path)
    names = stream_names(report.records["copies"])
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        for c in sorted(report.records["copies"], key=lambda c: (start_key(c), c["id"])):
            h = report.handle(c["handle"])
            span = time_span(c)
            dur = max(0.0, span[1] - span[0]) if span else None
            shape = h.get("shape")
            w.writerow(
                [
                    c["id"],
                    c["kind"],
                    c["handle"],
                    h.get("module") or "",
                    c["bytes"],
                    json.dumps(shape) if shape is not None else "",
                    h.get("dtype", ""),
                    c["device"],
                    names[(c["device"], c["stream"])],
                    f"{span[0]:.3f}" if span else "",
                    f"{span[1]:.3f}" if span else "",
                    f"{dur:.3f}" if span else "",
                    f"{gbps(c['bytes'], dur / 1e6):.4f}" if span else "",
                    int(bool(c.get("prefetch"))),
                    c.get("members", 1),
                ]
            )
    return path
