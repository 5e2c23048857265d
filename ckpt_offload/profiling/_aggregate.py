"""Per-module sums of a profile's records: the rows of the summary table and of ``by_module()``.

Example::

    rows = rows_by_module(report)        # {"blocks.0.attn": Row, ...}
    total = Row()
    for r in rows.values():
        total.add(r)
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from ckpt_offload.profiling._records import NO_MODULE, gbps, start_key, time_span

if TYPE_CHECKING:
    from ckpt_offload.profiling.report import ProfileReport


class Row:
    """Sums for one row of the summary (a module, or the total). Bandwidth uses only the copies
    that have timestamps (``*_timed_bytes``); byte totals use every copy."""

    __slots__ = (
        "d2h_bytes",
        "d2h_n",
        "d2h_timed_bytes",
        "d2h_us",
        "h2d_bytes",
        "h2d_n",
        "h2d_timed_bytes",
        "h2d_us",
        "kept",
        "kept_bytes",
        "prefetched",
        "stall_us",
        "untimed",
    )

    def __init__(self):
        for k in self.__slots__:
            setattr(self, k, 0)
        self.d2h_us = self.h2d_us = self.stall_us = 0.0

    def add(self, other: Row):
        for k in self.__slots__:
            setattr(self, k, getattr(self, k) + getattr(other, k))

    @property
    def copy_us(self) -> float:
        return self.d2h_us + self.h2d_us

    @property
    def hidden_us(self) -> float:
        return max(0.0, self.copy_us - self.stall_us)

    @property
    def d2h_gbps(self) -> float:
        return gbps(self.d2h_timed_bytes, self.d2h_us / 1e6)

    @property
    def h2d_gbps(self) -> float:
        return gbps(self.h2d_timed_bytes, self.h2d_us / 1e6)


def rows_by_module(report: ProfileReport) -> OrderedDict[str, Row]:
    """One :class:`Row` per module, in order of first copy (modules with only waits or keeps
    after them); records without a module are summed under ``NO_MODULE``."""
    rows: OrderedDict[str, Row] = OrderedDict()

    def row(module) -> Row:
        m = module or NO_MODULE
        if m not in rows:
            rows[m] = Row()
        return rows[m]

    for c in sorted(report.records["copies"], key=start_key):
        a = row(report.module_of_handle(c["handle"]))
        span = time_span(c)
        dur = max(0.0, span[1] - span[0]) if span else 0.0
        n = int(c.get("members", 1) or 1)
        if span is None:
            a.untimed += 1
        if c["kind"] == "d2h":
            a.d2h_bytes += c["bytes"]
            a.d2h_n += n
            if span:
                a.d2h_us += dur
                a.d2h_timed_bytes += c["bytes"]
        else:
            a.h2d_bytes += c["bytes"]
            a.h2d_n += n
            if span:
                a.h2d_us += dur
                a.h2d_timed_bytes += c["bytes"]
        if c.get("prefetch"):
            a.prefetched += 1
    for w in report.records["waits"]:
        a = row(report.module_of_handle(w["handle"]))
        if w.get("stall_us") is None:
            a.untimed += 1
        else:
            a.stall_us += max(0.0, w["stall_us"])
    for k in report.records["keeps"]:
        a = row(k.get("module"))
        a.kept += 1
        a.kept_bytes += k["bytes"]
    return rows
