"""``co.profile()``: every copy, every stall and the memory timeline of offloaded activations.

The C++ side records, while profiling is on, each device-to-host and host-to-device copy
(bytes, stream, start and end: CUDA events on a GPU, a steady clock on CPU), each storage it
offloaded (shape, dtype, module), each unpack that waited for a reload, each tensor kept on the
device and why, the pool's backend allocations and cap hits, and a memory sample at every pack
and unpack. This module adds the module names (forward hooks keep a module path per thread) and
the compute ranges, and turns the records into a summary table, a Chrome trace, a CSV, JSON and
a memory plot.

Example::

    import ckpt_offload as co

    with co.profile(model) as prof:
        with co.offload():
            loss = model(x).sum()
        loss.backward()
    print(prof.summary())
    prof.save("profile_out")        # summary.txt, trace.json, records.csv, profile.json, memory.png
"""

from __future__ import annotations

import csv
import json
import math
import os
import threading
from collections import OrderedDict

import torch

from ckpt_offload import _C

__all__ = ["KEEP_REASONS", "Profile", "profile"]

#: Why a saved tensor can stay on the device (``Profile.to_dict()["totals"]["kept_by_reason"]``).
KEEP_REASONS = ("parameter", "buffer", "too_small", "device", "layout", "subclass", "pool_full", "cuda_graph_capture")

_NO_MODULE = "(no module)"

# One profile at a time: the C++ recorder is process-wide.
_active_lock = threading.Lock()
_active: profile | None = None


def _require_native():
    missing = [
        name
        for name in (
            "profiler_start",
            "profiler_stop",
            "profiler_enabled",
            "profiler_set_scope",
            "profiler_range",
            "profiler_records",
        )
        if not hasattr(_C, name)
    ]
    if missing:
        raise RuntimeError(
            f"ckpt_offload: this build of the native extension has no profiler ({', '.join(missing)} missing). "
            "Rebuild it: `pip install --no-build-isolation .` (or `python setup.py build_ext --inplace` in the "
            "source folder)."
        )


def _first_device(args) -> str | None:
    """The device of the first tensor among a forward's positional arguments (one level into
    lists, tuples and dicts), as ``"cuda:0"`` / ``"cpu"``; None when there is none."""
    for a in args:
        items = a if isinstance(a, (list, tuple)) else a.values() if isinstance(a, dict) else (a,)
        for b in items:
            if isinstance(b, torch.Tensor):
                return _device_str(b.device)
    return None


def _device_str(device: torch.device) -> str | None:
    if device.type not in ("cpu", "cuda"):  # meta, xla, ...: nothing the recorder can time
        return None
    if device.type == "cuda" and device.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(device)


class _ModuleTracker:
    """Global forward hooks that keep, per thread, the path of the module running now; they
    tell the C++ recorder the scope (pack records take it) and open / close compute ranges."""

    def __init__(self, model: torch.nn.Module | None):
        self._names: dict[int, tuple[torch.nn.Module, str]] = {}
        if model is not None:
            for name, m in model.named_modules(remove_duplicate=False):
                # The root's name is "": call it by its class so top-level ops have a scope.
                self._names.setdefault(id(m), (m, name or type(m).__name__))
        self._tls = threading.local()
        self._handles = []

    def _stack(self) -> list:
        st = getattr(self._tls, "stack", None)
        if st is None:
            st = self._tls.stack = []
        return st

    def _path(self, module, parent: str) -> str:
        hit = self._names.get(id(module))
        if hit is not None and hit[0] is module:
            return hit[1]
        cls = type(module).__name__
        return f"{parent}/{cls}" if parent else cls

    def _pre(self, module, args):
        st = self._stack()
        path = self._path(module, st[-1][0] if st else "")
        device = _first_device(args)
        if device is not None:
            _C.profiler_range(path, device, True)
        st.append((path, device))
        _C.profiler_set_scope(path)

    def _post(self, module, args, output):
        st = self._stack()
        if not st:  # hooks installed while this forward was already running
            return
        path, device = st.pop()
        if device is not None:
            _C.profiler_range(path, device, False)
        _C.profiler_set_scope(st[-1][0] if st else "")

    def install(self):
        mod = torch.nn.modules.module
        self._handles.append(mod.register_module_forward_pre_hook(self._pre))
        try:
            # always_call: the path is popped even when a forward raises.
            self._handles.append(mod.register_module_forward_hook(self._post, always_call=True))
        except TypeError:  # torch without always_call
            self._handles.append(mod.register_module_forward_hook(self._post))

    def remove(self):
        for h in self._handles:
            h.remove()
        self._handles = []
        self._stack().clear()


class profile:
    """Context manager that records what ckpt_offload does inside it; ``as`` gives a :class:`Profile`.

    Records every offload (D2H) and reload (H2D) copy with its bytes, stream, start and end
    (CUDA events on a GPU, a steady clock on CPU), every wait of the compute stream for a reload,
    every tensor kept on the device and why, the pool's backend allocations and cap hits, module
    forward ranges, and a memory sample at each pack and unpack. Outside a profile nothing is
    recorded. One profile at a time per process (a nested or concurrent one raises RuntimeError).

    Args:
        model: optional ``nn.Module``; its ``named_modules()`` names ("blocks.3.attn") label
            the records. Without it, modules are named by their classes joined with "/"
            ("TinyTransformer/Block/CausalSelfAttention").
        record_shapes: keep each offloaded tensor's shape and dtype in the records (default
            True); False drops them from the stored records and exports.
        pools: the :class:`~ckpt_offload.HostPool` (or list of them) whose counters are
            captured at exit for the summary; default :func:`~ckpt_offload.default_pool`.

    The records are fetched once, at exit (this waits for the copies still in flight). Read
    them after the ``with`` block, after backward has run inside it.

    Example::

        with co.profile(model) as prof:
            with co.offload():
                loss = lm_loss(model, tokens)
            loss.backward()
        print(prof.summary())
        prof.export_chrome_trace("trace.json")    # open in https://ui.perfetto.dev
    """

    def __init__(self, model: torch.nn.Module | None = None, record_shapes: bool = True, pools=None):
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module or None, got {type(model).__name__}")
        if not isinstance(record_shapes, bool):
            raise TypeError(f"record_shapes must be True or False, got {type(record_shapes).__name__}")
        from ckpt_offload.pool import HostPool

        if pools is None:
            pools = []
        elif isinstance(pools, HostPool):
            pools = [pools]
        else:
            pools = list(pools)
        for p in pools:
            if not isinstance(p, HostPool):
                raise TypeError(f"pools must be a ckpt_offload.HostPool or a list of them, got {type(p).__name__}")
        self.model = model
        self.record_shapes = record_shapes
        self._pools = pools
        self._tracker = None
        self._profile: Profile | None = None

    def __enter__(self) -> Profile:
        global _active
        _require_native()
        with _active_lock:
            if _active is not None:
                raise RuntimeError(
                    "co.profile(): another profile is already active in this process (profiles cannot be nested "
                    "or run concurrently: the recorder is process-wide). Exit it first."
                )
            if _C.profiler_enabled():
                raise RuntimeError(
                    "co.profile(): the native profiler is already recording (started through ckpt_offload._C "
                    "directly?); call ckpt_offload._C.profiler_stop() first."
                )
            _active = self
        try:
            self._profile = Profile(None)
            self._tracker = _ModuleTracker(self.model)
            _C.profiler_start()
            self._tracker.install()
            _C.profiler_set_scope("")
        except BaseException:
            self._teardown()
            raise
        return self._profile

    def _teardown(self) -> dict | None:
        global _active
        records = None
        try:
            if self._tracker is not None:
                self._tracker.remove()
                self._tracker = None
            try:
                _C.profiler_set_scope("")
            finally:
                _C.profiler_stop()
            records = _C.profiler_records()
        finally:
            with _active_lock:
                _active = None
        return records

    def __exit__(self, *exc) -> None:
        records = self._teardown()
        from ckpt_offload.pool import default_pool

        pools = self._pools or [default_pool()]
        pool_stats = []
        for p in pools:
            p.synchronize()
            pool_stats.append(dict(p.stats()))
        self._profile._load(records, pool_stats, record_shapes=self.record_shapes)


def _to_jsonable(x):
    if isinstance(x, dict):
        return {str(k): _to_jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_to_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    if hasattr(x, "item"):
        return x.item()
    return str(x)


def _fmt_bytes(n) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def _start_key(rec) -> float:
    t = rec.get("start_us")
    return math.inf if t is None else t


def _gbps(nbytes, seconds) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def _span(rec, start="start_us", end="end_us"):
    """(start, end) of a record in microseconds, or None when the recorder had no time for it."""
    t0, t1 = rec.get(start), rec.get(end)
    return None if t0 is None or t1 is None else (float(t0), float(t1))


class _Acc:
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

    def add(self, other: _Acc):
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
        return _gbps(self.d2h_timed_bytes, self.d2h_us / 1e6)

    @property
    def h2d_gbps(self) -> float:
        return _gbps(self.h2d_timed_bytes, self.h2d_us / 1e6)


class Profile:
    """The records of one :class:`profile` block and what they add up to.

    Filled when the ``with co.profile()`` block exits. ``records`` holds the raw records (see
    :meth:`to_dict`), ``pool_stats`` the counters of the pool(s) at exit.

    Example::

        with co.profile(model) as prof:
            ...
        print(prof.summary(top=10))
        totals = prof.to_dict()["totals"]
        print(totals["h2d_gbps"], totals["stall_seconds"])
    """

    def __init__(self, records: dict | None = None, pool_stats=None, record_shapes: bool = True):
        self.records: dict = {}
        self.pool_stats: list = []
        self._ready = False
        if records is not None:
            self._load(records, pool_stats or [], record_shapes=record_shapes)

    @classmethod
    def from_records(cls, records: dict, pool_stats=None) -> Profile:
        """A profile made from records (``_C.profiler_records()``, or the ``records`` of a
        :meth:`to_dict` / ``profile.json``), for reading a saved profile again.

        Example::

            d = json.load(open("profile_out/profile.json"))
            print(co.Profile.from_records(d["records"], d["pool_stats"]).summary())
        """
        return cls(records, pool_stats)

    # ---------------------------------------------------------------- loading

    def _load(self, records: dict, pool_stats: list, record_shapes: bool = True) -> None:
        r = {k: records.get(k, []) for k in ("copies", "handles", "waits", "keeps", "pool", "compute", "memory", "disk")}
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

    def _check(self):
        if not self._ready:
            raise RuntimeError(
                "this Profile has no records yet: they are collected when the `with co.profile()` block exits; "
                "read them after it"
            )

    def _module_of_handle(self, handle) -> str:
        h = self._handles.get(handle)
        return (h.get("module") if h else None) or _NO_MODULE

    @property
    def devices(self) -> list:
        """The devices that appear in the records, in order of first appearance."""
        self._check()
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

    def _rows(self) -> OrderedDict[str, _Acc]:
        rows: OrderedDict[str, _Acc] = OrderedDict()

        def row(module) -> _Acc:
            m = module or _NO_MODULE
            if m not in rows:
                rows[m] = _Acc()
            return rows[m]

        for c in sorted(self.records["copies"], key=_start_key):
            a = row(self._module_of_handle(c["handle"]))
            span = _span(c)
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
        for w in self.records["waits"]:
            a = row(self._module_of_handle(w["handle"]))
            if w.get("stall_us") is None:
                a.untimed += 1
            else:
                a.stall_us += max(0.0, w["stall_us"])
        for k in self.records["keeps"]:
            a = row(k.get("module"))
            a.kept += 1
            a.kept_bytes += k["bytes"]
        return rows

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
        ``device_saved_peak_bytes``, ``device_allocated_peak_bytes`` (None on CPU),
        ``wall_seconds`` (first to last record), ``copies``, ``dropped_records``, ``untimed_records``
        (copies and waits whose events had no time: counted in bytes, not in times), ``cpu_only``.

        Example::

            t = prof.totals()
            print(f"{t['hidden_fraction']:.0%} of copy time hidden, {t['stall_seconds'] * 1e3:.1f} ms stalled")
        """
        self._check()
        r = self.records
        t = _Acc()
        for a in self._rows().values():
            t.add(a)
        kept_by_reason = {k: 0 for k in KEEP_REASONS}
        kept_bytes_by_reason = {k: 0 for k in KEEP_REASONS}
        for k in r["keeps"]:
            kept_by_reason[k["reason"]] = kept_by_reason.get(k["reason"], 0) + 1
            kept_bytes_by_reason[k["reason"]] = kept_bytes_by_reason.get(k["reason"], 0) + k["bytes"]
        allocs = [p for p in r["pool"] if p["kind"] == "backend_alloc"]
        mem = r["memory"]
        allocated = [m["device_bytes_allocated"] for m in mem if m.get("device_bytes_allocated") is not None]
        times = [x for key in ("copies", "compute", "pool") for rec in r[key] for x in (_span(rec) or ())]
        times += [m["t_us"] for m in mem]
        copy_s = t.copy_us / 1e6
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
            "device_saved_peak_bytes": max((m["device_bytes_saved"] for m in mem), default=0),
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
        self._check()
        out = []
        for name, a in self._rows().items():
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
        self._check()
        if by not in ("module", "total"):
            raise ValueError(f"by must be 'module' or 'total', got {by!r}")
        if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < 1):
            raise ValueError(f"top must be a positive int or None, got {top!r}")
        rows = self._rows()
        total = _Acc()
        for a in rows.values():
            total.add(a)
        t = self.totals()

        shown = list(rows.items())
        if top is not None and len(shown) > top:
            heavy = sorted(shown, key=lambda kv: -(kv[1].d2h_bytes + kv[1].h2d_bytes))[:top]
            keep = {name for name, _ in heavy}
            other = _Acc()
            n_other = 0
            for name, a in shown:
                if name not in keep:
                    other.add(a)
                    n_other += 1
            shown = [(name, a) for name, a in shown if name in keep]
            shown.append((f"(other {n_other} modules)", other))
        if by == "total":
            shown = []

        devices = self.devices
        lines = []
        where = ", ".join(devices) if devices else "no device"
        if self.cpu_only and t["copies"]:
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
        disk = self.records.get("disk") or []
        if disk:
            # Bandwidth over the time at least one block was moving, as the pool's disk stats count it.
            for kind, verb in (("disk_write", "written to"), ("disk_read", "read from")):
                recs = [d for d in disk if d["kind"] == kind]
                spans = sorted((d["start_us"], d["end_us"]) for d in recs)
                busy, end = 0.0, -math.inf
                for a, b in spans:
                    busy += max(0.0, b - max(a, end))
                    end = max(end, b)
                nbytes = sum(d["bytes"] for d in recs)
                pre = sum(1 for d in recs if d.get("prefetch"))
                lines.append(
                    f"disk: {len(recs)} blocks ({_fmt_bytes(nbytes)}) {verb} the spill files at "
                    f"{_gbps(nbytes, busy / 1e6):.2f} GB/s" + (f", {pre} started by prefetch" if pre else "")
                )
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

        def fmt_row(name: str, a: _Acc) -> str:
            if len(name) > name_w:
                name = "..." + name[-(name_w - 3) :]
            vals = [
                str(a.d2h_n),
                _fmt_bytes(a.d2h_bytes),
                _fmt_bytes(a.h2d_bytes),
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

        ps = self.pool_stats
        cap = ps[0].get("max_bytes") if len(ps) == 1 else None
        backend = "/".join(sorted({str(s.get("backend")) for s in ps})) if ps else "?"
        lines.append(
            f"host pool ({backend}): peak in use {_fmt_bytes(t['pool_peak_bytes'])} during the profile, "
            f"reserved {_fmt_bytes(t['pool_reserved_bytes'])} at exit, cap {'none' if cap is None else _fmt_bytes(cap)}"
        )
        n = t["backend_allocs"]
        lines.append(
            f"  {n} backend allocation{'' if n == 1 else 's'} ({t['backend_alloc_seconds'] * 1e3:.2f} ms), "
            f"{t['cap_hits']} cap hit{'' if t['cap_hits'] == 1 else 's'}"
        )
        alloc = t["device_allocated_peak_bytes"]
        lines.append(
            f"device: saved activations held on the device peaked at {_fmt_bytes(t['device_saved_peak_bytes'])}"
            + (f"; allocator peak {_fmt_bytes(alloc)}" if alloc is not None else "")
        )
        kept = [(k, n, t["kept_bytes_by_reason"].get(k, 0)) for k, n in t["kept_by_reason"].items() if n]
        if kept:
            lines.append(
                f"kept on the device ({t['tensors_kept']}): "
                + ", ".join(f"{k} {n} ({_fmt_bytes(b)})" for k, n, b in kept)
            )
        else:
            lines.append("kept on the device: none")
        return "\n".join(lines)

    def __repr__(self) -> str:
        if not self._ready:
            return "Profile(<recording>)"
        t = self.totals()
        return (
            f"Profile(copies={t['copies']}, d2h={_fmt_bytes(t['d2h_bytes'])}, h2d={_fmt_bytes(t['h2d_bytes'])}, "
            f"stall_ms={t['stall_seconds'] * 1e3:.2f})"
        )

    # ---------------------------------------------------------------- exports

    def to_dict(self) -> dict:
        """Everything as JSON-serialisable data: ``records`` (copies, handles, waits, keeps, pool,
        compute, memory, dropped; times in microseconds from the start of the profile),
        ``totals`` (see :meth:`totals`), ``by_module`` (see :meth:`by_module`), ``pool_stats``
        and ``devices``.

        Example::

            d = prof.to_dict()
            d["totals"]["d2h_gbps"], len(d["records"]["copies"])
        """
        self._check()
        return _to_jsonable(
            {
                "format": "ckpt_offload.profile/1",
                "devices": self.devices,
                "totals": self.totals(),
                "by_module": self.by_module(),
                "pool_stats": self.pool_stats,
                "records": self.records,
            }
        )

    def export_json(self, path) -> str:
        """Writes :meth:`to_dict` to ``path``; returns the path.

        Example::

            prof.export_json("profile.json")
        """
        path = os.fspath(path)
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
        return path

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

    def export_csv(self, path) -> str:
        """Writes one row per copy record, joined with its storage's shape, dtype and module;
        returns the path. Columns: :attr:`CSV_COLUMNS` (shape as JSON, ``"[4, 64, 64]"``; ``"[]"`` for a 0-d tensor).

        Example::

            prof.export_csv("records.csv")      # then pandas.read_csv("records.csv")
        """
        self._check()
        path = os.fspath(path)
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(self.CSV_COLUMNS)
            for c in sorted(self.records["copies"], key=lambda c: (_start_key(c), c["id"])):
                h = self._handles.get(c["handle"], {})
                span = _span(c)
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
                        c["stream"],
                        f"{span[0]:.3f}" if span else "",
                        f"{span[1]:.3f}" if span else "",
                        f"{dur:.3f}" if span else "",
                        f"{_gbps(c['bytes'], dur / 1e6):.4f}" if span else "",
                        int(bool(c.get("prefetch"))),
                        c.get("members", 1),
                    ]
                )
        return path

    def chrome_trace(self) -> dict:
        """The trace-event dict that :meth:`export_chrome_trace` writes.

        Example::

            names = {e["name"] for e in prof.chrome_trace()["traceEvents"]}
        """
        self._check()
        r = self.records
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

        for d in self.devices:
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
        timed = [c for c in r["compute"] if _span(c)]
        for c in sorted(timed, key=lambda c: (c["start_us"], -(c["end_us"] - c["start_us"]))):
            x(c["name"], "compute", pid_of(c["device"]), 1, c["start_us"], c["end_us"], {"module": c["name"]})
        for w in r["waits"]:
            if not w.get("stall_us") or w.get("ready_us") is None:
                continue
            h = self._handles.get(w["handle"], {})
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
            h = self._handles.get(c["handle"], {})
            span = _span(c)
            dur = max(0.0, span[1] - span[0]) if span else 0.0
            d2h = c["kind"] == "d2h"
            module = h.get("module") or ""
            args = {
                "bytes": c["bytes"],
                "handle": c["handle"],
                "module": module,
                "shape": h.get("shape"),
                "dtype": h.get("dtype"),
                "GB/s": round(_gbps(c["bytes"], dur / 1e6), 4),
                "stream": c["stream"],
                "prefetch": bool(c.get("prefetch")),
                "members": c.get("members", 1),
                "id": c["id"],
            }
            label = ("D2H " if d2h else ("H2D prefetch " if c.get("prefetch") else "H2D ")) + (
                module or f"#{c['handle']}"
            )
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
            recs = [d for d in r["disk"] if d["kind"] == kind]
            if recs:
                events.append({"name": "thread_name", "ph": "M", "pid": pool_pid, "tid": tid, "args": {"name": name}})
            for d in recs:
                dur = max(0.0, d["end_us"] - d["start_us"])
                label = ("prefetch " if d.get("prefetch") else "") + f"{name} " + (
                    self._handles.get(d["handle"], {}).get("module") or f"#{d['handle']}")
                x(label, kind, pool_pid, tid, d["start_us"], d["end_us"],
                  {"bytes": d["bytes"], "handle": d["handle"], "GB/s": round(_gbps(d["bytes"], dur / 1e6), 4)})
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
            "traceEvents": _to_jsonable(events),
            "displayTimeUnit": "ms",
            "otherData": {"generator": "ckpt_offload.profile", "cpu_only": self.cpu_only},
        }

    def export_chrome_trace(self, path) -> str:
        """Writes a Chrome trace-event JSON file; returns the path. Open it in https://ui.perfetto.dev
        or chrome://tracing: one process per device with "compute" (module forward ranges and
        stalls waiting for reloads), "D2H" and "H2D" tracks, and a "host pool" process with
        backend allocations, cap hits and the memory counters. Click a copy for its bytes,
        shape, dtype, module, handle and GB/s.

        Example::

            prof.export_chrome_trace("trace.json")
        """
        path = os.fspath(path)
        with open(path, "w") as f:
            json.dump(self.chrome_trace(), f)
        return path

    def plot_memory(self, path) -> str:
        """Saves a PNG of the memory timeline: bytes of saved activations held on the device
        (and torch's allocator total, on a GPU) against the pool's bytes in use; returns the path.
        Needs matplotlib (``pip install matplotlib``); uses no global pyplot state.

        Example::

            prof.plot_memory("memory.png")
        """
        self._check()
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
        except ImportError as e:
            raise ImportError(
                f"Profile.plot_memory needs matplotlib ({e}); install it with `pip install matplotlib`"
            ) from e
        mem = sorted(self.records["memory"], key=lambda m: m["t_us"])
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
            ax.step(ts, [m.get("disk_bytes_in_use", 0) * mib for m in mem], where="post", label="spilled to disk",
                    linestyle=":")
        ax.set_xlabel("time since profile start (ms)")
        ax.set_ylabel("MiB")
        title = "ckpt_offload memory timeline"
        if self.cpu_only:
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

    def save(self, folder) -> dict:
        """Writes ``summary.txt``, ``trace.json``, ``records.csv``, ``profile.json`` and
        ``memory.png`` into ``folder`` (created); returns ``{name: path}`` for what was written.
        Without matplotlib the PNG is skipped and ``summary.txt`` says so.

        Example::

            paths = prof.save("ckpt_offload_profile")
            print(paths["trace"])
        """
        self._check()
        folder = os.fspath(folder)
        if os.path.exists(folder) and not os.path.isdir(folder):
            raise ValueError(f"folder: {folder!r} exists and is not a folder; pass a folder path (it is created)")
        os.makedirs(folder, exist_ok=True)
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
