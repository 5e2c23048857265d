"""The result of ``co.profile()``: :class:`ProfileReport`, the records and what they add up to.

Totals, per-module rows and the summary table are computed here; the exporters (Chrome trace,
CSV / JSON, memory plot) are functions over a report in their own modules, which the methods of
the same names call.

Example::

    with co.profile(model) as prof:          # prof is a ProfileReport
        with co.offload():
            loss = model(x).sum()
        loss.backward()
    print(prof.totals()["hidden_fraction"])
"""

from __future__ import annotations

import os
from collections import OrderedDict

from ckpt_offload._runtime import _C
from ckpt_offload.profiling import export_table, export_trace, plot
from ckpt_offload.profiling._aggregate import Row, rows_by_module
from ckpt_offload.profiling._records import NO_MODULE, fmt_bytes, time_span
from ckpt_offload.profiling.summary import format_summary

__all__ = ["KEEP_REASONS", "RECORD_KEYS", "RECORD_KINDS", "ProfileReport"]

#: Why a saved tensor can stay on the device (``ProfileReport.to_dict()["totals"]["kept_by_reason"]``):
#: every reason the native packer counts (its table, Note [Stats table] in csrc/torch/counters.h).
KEEP_REASONS = tuple(_C.keep_reasons())

#: The keys of each kind of record (``ProfileReport.records[kind]``), in order: kind -> tuple of keys,
#: from the native record tables (Note [Profiler record tables] in csrc/torch/profiling.cpp).
RECORD_KEYS = dict(_C.PROFILER_RECORD_KEYS)
#: The kinds of record a profile holds (``"copies"``, ``"disk"``, ``"waits"``, ...), besides ``"dropped"``.
RECORD_KINDS = tuple(RECORD_KEYS)


class ProfileReport:
    """The records of one ``co.profile()`` block and what they add up to (``co.Profile`` is a
    deprecated alias of this class).

    Filled when the ``with co.profile()`` block exits. ``records`` holds the raw records (see
    :meth:`to_dict`), ``pool_stats`` the counters of the pool(s) at exit.

    Example::

        with co.profile(model) as prof:
            ...
        print(prof.summary(top=10))
        totals = prof.to_dict()["totals"]
        print(totals["h2d_gbps"], totals["stall_seconds"])
    """

    #: The columns of :meth:`export_csv`, in order.
    CSV_COLUMNS = export_table.CSV_COLUMNS

    def __init__(self, records: dict | None = None, pool_stats=None, record_shapes: bool = True):
        self.records: dict = {}
        self.pool_stats: list = []
        self._ready = False
        if records is not None:
            self._load(records, pool_stats or [], record_shapes=record_shapes)

    @classmethod
    def from_records(cls, records: dict, pool_stats=None) -> ProfileReport:
        """A profile made from records (``_C.profiler_records()``, or the ``records`` of a
        :meth:`to_dict` / ``profile.json``), for reading a saved profile again.

        Example::

            d = json.load(open("profile_out/profile.json"))
            print(co.ProfileReport.from_records(d["records"], d["pool_stats"]).summary())
        """
        return cls(records, pool_stats)

    def _load(self, records: dict, pool_stats: list, record_shapes: bool = True) -> None:
        # Called once: by __init__, or by profile.__exit__ (context.py) on the report it handed out.
        r = {k: records.get(k, []) for k in RECORD_KINDS}
        r = {k: [dict(x) for x in v] for k, v in r.items()}
        r["dropped"] = int(records.get("dropped", 0) or 0)
        if not record_shapes:
            for rec in r["handles"] + r["keeps"]:
                rec.pop("shape", None)
                rec.pop("dtype", None)
        for rec in r["handles"] + r["keeps"]:
            if "shape" in rec:
                rec["shape"] = [int(s) for s in rec["shape"]]
        self.records = r
        self.pool_stats = [dict(s) for s in pool_stats]
        self._handles = {h["handle"]: h for h in r["handles"]}
        self._ready = True

    def check_ready(self) -> None:
        """Raises RuntimeError while the records are not collected yet (inside the ``with`` block).

        Example::

            prof.check_ready()      # after the block: returns None
        """
        if not self._ready:
            raise RuntimeError(
                "this ProfileReport has no records yet: they are collected when the `with co.profile()` block "
                "exits; read them after it"
            )

    def handle(self, handle) -> dict:
        """The record of the offloaded storage ``handle`` (bytes, shape, dtype, module, ...); ``{}``
        when the records have none (a copy whose storage record was dropped).

        Example::

            prof.handle(prof.records["copies"][0]["handle"]).get("module")
        """
        return self._handles.get(handle, {})

    def module_of_handle(self, handle) -> str:
        """The module that saved the storage ``handle``, or ``"(no module)"``."""
        return self.handle(handle).get("module") or NO_MODULE

    @property
    def devices(self) -> list:
        """The devices that appear in the records, in order of first appearance."""
        self.check_ready()
        seen = OrderedDict()
        for key in ("compute", "copies", "waits", "keeps"):
            for rec in self.records[key]:
                if rec.get("device"):
                    seen[rec["device"]] = None
        return list(seen)

    @property
    def cpu_only(self) -> bool:
        """True when every copy recorded was between CPU tensors and the pool (memcpy)."""
        devs = {c["device"] for c in self.records.get("copies", [])} or set(self.devices)
        return all(str(d).startswith("cpu") for d in devs)

    # ---------------------------------------------------------------- aggregation

    def totals(self) -> dict:
        """The numbers of the total row and the pool, as a dict (also ``to_dict()["totals"]``).

        Keys: ``d2h_bytes``, ``d2h_seconds`` (summed durations of the D2H copies), ``h2d_bytes``,
        ``h2d_seconds``, ``d2h_gbps``, ``h2d_gbps`` (bytes / summed duration, 1e9 bytes per GB;
        0.0 without copies), ``copy_seconds`` (both directions), ``stall_seconds`` (time the
        compute stream waited for reloads), ``hidden_fraction`` (``(copy - stall) / copy``,
        floored at 0; 0.0 without copies), ``tensors_offloaded``, ``tensors_reloaded``,
        ``tensors_kept``, ``kept_by_reason``, ``kept_bytes_by_reason``, ``pool_peak_bytes``
        (highest pool bytes in use sampled during the profile), ``pool_reserved_bytes`` (at
        exit), ``backend_allocs``, ``backend_alloc_seconds``, ``cap_hits``, ``prefetched_copies``,
        ``device_saved_peak_bytes`` (most bytes of saved activations held on the device at once:
        kept, reloaded, prefetched), ``saved_total_bytes`` (what autograd saved in all, the
        device peak without offload: the pool's bytes plus the device's at the pool's peak, the
        end of a forward), ``device_saved_fraction`` (``device_saved_peak_bytes /
        saved_total_bytes``; None when nothing was saved), ``device_allocated_peak_bytes`` (None on CPU),
        ``wall_seconds`` (first to last record), ``copies``, ``dropped_records``, ``untimed_records``
        (copies and waits whose events had no time: counted in bytes, not in times), ``cpu_only``.

        Example::

            t = prof.totals()
            print(f"{t['hidden_fraction']:.0%} of copy time hidden, {t['stall_seconds'] * 1e3:.1f} ms stalled")
        """
        self.check_ready()
        r = self.records
        t = Row()
        for a in rows_by_module(self).values():
            t.add(a)
        kept_by_reason = {k: 0 for k in KEEP_REASONS}
        kept_bytes_by_reason = {k: 0 for k in KEEP_REASONS}
        for k in r["keeps"]:
            kept_by_reason[k["reason"]] = kept_by_reason.get(k["reason"], 0) + 1
            kept_bytes_by_reason[k["reason"]] = kept_bytes_by_reason.get(k["reason"], 0) + k["bytes"]
        allocs = [p for p in r["pool"] if p["kind"] == "backend_alloc"]
        mem = r["memory"]
        allocated = [m["device_bytes_allocated"] for m in mem if m.get("device_bytes_allocated") is not None]
        times = [x for key in ("copies", "compute", "pool") for rec in r[key] for x in (time_span(rec) or ())]
        times += [m["t_us"] for m in mem]
        copy_s = t.copy_us / 1e6
        device_peak = max((m["device_bytes_saved"] for m in mem), default=0)
        at_pool_peak = max(mem, key=lambda m: m["pool_bytes_in_use"], default=None)
        saved_total = (at_pool_peak["pool_bytes_in_use"] + at_pool_peak["device_bytes_saved"]) if at_pool_peak else 0
        saved_total = max(saved_total, device_peak)
        return {
            "d2h_bytes": t.d2h_bytes,
            "d2h_seconds": t.d2h_us / 1e6,
            "h2d_bytes": t.h2d_bytes,
            "h2d_seconds": t.h2d_us / 1e6,
            "d2h_gbps": t.d2h_gbps,
            "h2d_gbps": t.h2d_gbps,
            "copy_seconds": copy_s,
            "stall_seconds": t.stall_us / 1e6,
            "hidden_fraction": (t.hidden_us / t.copy_us) if t.copy_us > 0 else 0.0,
            "tensors_offloaded": t.d2h_n,
            "tensors_reloaded": t.h2d_n,
            "tensors_kept": len(r["keeps"]),
            "kept_by_reason": kept_by_reason,
            "kept_bytes_by_reason": kept_bytes_by_reason,
            "pool_peak_bytes": max((m["pool_bytes_in_use"] for m in mem), default=0),
            "pool_reserved_bytes": sum(s.get("bytes_reserved", 0) for s in self.pool_stats),
            "backend_allocs": len(allocs),
            "backend_alloc_seconds": sum(max(0.0, p["end_us"] - p["start_us"]) for p in allocs) / 1e6,
            "cap_hits": sum(1 for p in r["pool"] if p["kind"] == "cap_hit"),
            "prefetched_copies": t.prefetched,
            "device_saved_peak_bytes": device_peak,
            "saved_total_bytes": saved_total,
            "device_saved_fraction": device_peak / saved_total if saved_total else None,
            "device_allocated_peak_bytes": max(allocated) if allocated else None,
            "wall_seconds": (max(times) - min(times)) / 1e6 if times else 0.0,
            "copies": len(r["copies"]),
            "dropped_records": r["dropped"],
            "untimed_records": t.untimed,
            "cpu_only": self.cpu_only,
        }

    def by_module(self) -> list:
        """One dict per module (in order of first copy), with the columns of :meth:`summary`.

        Example::

            worst = max(prof.by_module(), key=lambda m: m["stall_seconds"])
        """
        self.check_ready()
        out = []
        for name, a in rows_by_module(self).items():
            out.append(
                {
                    "module": name,
                    "tensors_offloaded": a.d2h_n,
                    "d2h_bytes": a.d2h_bytes,
                    "d2h_seconds": a.d2h_us / 1e6,
                    "d2h_gbps": a.d2h_gbps,
                    "tensors_reloaded": a.h2d_n,
                    "h2d_bytes": a.h2d_bytes,
                    "h2d_seconds": a.h2d_us / 1e6,
                    "h2d_gbps": a.h2d_gbps,
                    "copy_seconds": a.copy_us / 1e6,
                    "hidden_seconds": a.hidden_us / 1e6,
                    "stall_seconds": a.stall_us / 1e6,
                    "prefetched_copies": a.prefetched,
                    "tensors_kept": a.kept,
                    "bytes_kept": a.kept_bytes,
                }
            )
        return out

    # ---------------------------------------------------------------- summary

    def summary(self, by: str = "module", top: int | None = None) -> str:
        """A fixed-width table: one row per module (``by="module"``) and a total row, then the pool,
        device memory and the tensors kept on the device with their reasons.

        Columns: tensors offloaded, bytes offloaded (D2H) and reloaded (H2D), achieved bandwidth
        per direction (bytes / summed copy durations), copy time, the part of it hidden behind
        compute (copy - stall, floored at 0), the compute stream's stall waiting for reloads,
        prefetched copies, tensors kept. ``by="total"`` prints only the total row. ``top=N``
        keeps the N modules that moved the most bytes and folds the rest into one row.

        Example::

            print(prof.summary())                 # every module
            print(prof.summary(top=5))            # the five heaviest, the rest as "(other ...)"
            print(prof.summary(by="total"))
        """
        self.check_ready()
        return format_summary(self, by=by, top=top)

    def __repr__(self) -> str:
        name = type(self).__name__
        if not self._ready:
            return f"{name}(<recording>)"
        t = self.totals()
        return (
            f"{name}(copies={t['copies']}, d2h={fmt_bytes(t['d2h_bytes'])}, h2d={fmt_bytes(t['h2d_bytes'])}, "
            f"stall_ms={t['stall_seconds'] * 1e3:.2f})"
        )

    # ---------------------------------------------------------------- exports (see the export modules)

    def to_dict(self) -> dict:
        """Everything as JSON-serialisable data: see :func:`ckpt_offload.profiling.export_table.to_dict`.

        Example::

            d = prof.to_dict()
            d["totals"]["d2h_gbps"], len(d["records"]["copies"])
        """
        return export_table.to_dict(self)

    def export_json(self, path) -> str:
        """Writes :meth:`to_dict` to ``path``; returns the path.

        Example::

            prof.export_json("profile.json")
        """
        return export_table.export_json(self, path)

    def export_csv(self, path) -> str:
        """Writes one row per copy record (columns :attr:`CSV_COLUMNS`); returns the path. See
        :func:`ckpt_offload.profiling.export_table.export_csv`.

        Example::

            prof.export_csv("records.csv")      # then pandas.read_csv("records.csv")
        """
        return export_table.export_csv(self, path)

    def chrome_trace(self) -> dict:
        """The trace-event dict that :meth:`export_chrome_trace` writes.

        Example::

            names = {e["name"] for e in prof.chrome_trace()["traceEvents"]}
        """
        return export_trace.chrome_trace(self)

    def export_chrome_trace(self, path) -> str:
        """Writes a Chrome trace-event JSON file (open it in https://ui.perfetto.dev); returns the
        path. See :func:`ckpt_offload.profiling.export_trace.export_chrome_trace` for its tracks.

        Example::

            prof.export_chrome_trace("trace.json")
        """
        return export_trace.export_chrome_trace(self, path)

    def plot_memory(self, path) -> str:
        """Saves a PNG of the memory timeline; returns the path. Needs matplotlib. See
        :func:`ckpt_offload.profiling.plot.plot_memory`.

        Example::

            prof.plot_memory("memory.png")
        """
        return plot.plot_memory(self, path)

    def save(self, folder) -> dict:
        """Writes ``summary.txt``, ``trace.json``, ``records.csv``, ``profile.json`` and
        ``memory.png`` into ``folder`` (created); returns ``{name: path}`` for what was written.
        Without matplotlib the PNG is skipped and ``summary.txt`` says so.

        Example::

            paths = prof.save("ckpt_offload_profile")
            print(paths["trace"])
        """
        self.check_ready()
        folder = os.fspath(folder)
        if os.path.exists(folder) and not os.path.isdir(folder):
            raise ValueError(f"folder: {folder!r} exists and is not a folder; pass a folder path (it is created)")
        try:
            os.makedirs(folder, exist_ok=True)
            probe = os.path.join(folder, ".ckpt_offload_write_check")
            with open(probe, "w"):
                pass
            os.remove(probe)
        except OSError as e:
            raise type(e)(
                e.errno,
                f"ProfileReport.save: cannot write into the folder {folder!r} "
                f"({e.strerror or e}); pass a folder you can create and write to, e.g. "
                "prof.save('ckpt_offload_profile')",
            ) from e
        paths = {}
        summary = self.summary()
        try:
            paths["memory"] = self.plot_memory(os.path.join(folder, "memory.png"))
        except ImportError:
            summary += "\n(memory.png not written: matplotlib is not installed; `pip install matplotlib`)"
        paths["trace"] = self.export_chrome_trace(os.path.join(folder, "trace.json"))
        paths["csv"] = self.export_csv(os.path.join(folder, "records.csv"))
        paths["json"] = self.export_json(os.path.join(folder, "profile.json"))
        summary_path = os.path.join(folder, "summary.txt")
        with open(summary_path, "w") as f:
            f.write(summary + "\n")
        paths["summary"] = summary_path
        return paths
