"""Measuring the device memory of saved activations over a step, from torch.profiler's allocator
events -- independently of the planner's cost model, to check its predictions.

Every allocation torch's allocator makes during the step is an event (address, bytes, time), and so
is every free. An allocation counts as a *saved activation* when it was

* made during the forward, still alive when backward starts and freed before backward ends (what
  autograd keeps and backward releases: kept saved tensors, a checkpoint's inputs, selective
  recompute's kept outputs, offloaded tensors whose copy has not finished) -- from its allocation
  until it is freed. What outlives backward (the loss, outputs the step still holds) is not an
  activation the graph keeps;
* made inside a ``ckpt_offload::reload`` / ``ckpt_offload::prefetch`` range (a saved tensor brought
  back from the host pool; ``ckpt_offload::reload_convert``: converted back from its narrower
  storage, ``co.offload(store_dtype=...)``) -- until it is freed. The range as the host ran it: on
  a GPU the trace also has its twin on the device's lane, the copy as the GPU ran it, later
  (Note [Ranges on the host]);
* made inside a ``ckpt_offload::recompute`` range (the planner's recompute) and still alive at the
  range's end (a recomputed saved tensor) -- until it is freed.

Not counted: forward temporaries (freed before backward), gradients and backward temporaries,
parameters and anything allocated before the step, the host pool (its memory is not torch's).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

from ckpt_offload._runtime import _C
from ckpt_offload.blocks.recompute_range import RECOMPUTE_RANGE

__all__ = ["saved_activation_peak", "SavedTimeline"]

# The range names are written once: the copy ranges in C++ (csrc/torch/runtime.h), the
# recompute range where plans open it (ckpt_offload/blocks/recompute_range.py).
_RELOAD_RANGES = tuple(
    _C.COPY_RANGES[k] for k in ("reload", "prefetch", "reload_batch", "prefetch_batch", "reload_convert")
)
_RECOMPUTE = RECOMPUTE_RANGE
_BACKWARD_PREFIX = "autograd::engine::evaluate_function"

# Note [Ranges on the host]
# A USER_SCOPE range (the engine's copy ranges, CopyRange in csrc/torch/runtime.cpp; torch's
# record_function, which the recompute range falls back to without RecordFunctionFast) is in a
# CUDA trace twice: on the host thread that ran it, and as a twin of the same name on the GPU's
# lane (kineto's "gpu_user_annotation"), spanning the kernels and copies enqueued inside it as the
# GPU ran them -- later than the host, behind the compute stream, for as long as the copy took.
# Allocations are host events: what the host allocated while a prefetch's copy ran on the GPU
# (backward's gradients and temporaries) is no reload. Only the host's ranges are read.
_DEVICE_LANE_CATEGORIES = ("gpu_", "kernel")


def _on_device_lane(event) -> bool:
    """An event of a device's timeline (a kernel, a copy, a range's GPU twin), not the host's."""
    return str(event.get("cat", "")).lower().startswith(_DEVICE_LANE_CATEGORIES)


class SavedTimeline:
    """``peak_bytes``; ``timeline``: (seconds since the step's first event, live bytes) at every
    change; ``backward_start_s``; ``allocations``: the counted ones, ``(alloc_s, free_s, bytes,
    why)`` with ``why`` in ``forward``, ``reload``, ``recompute``."""

    def __init__(self, peak_bytes, timeline, backward_start_s, allocations=()):
        self.peak_bytes, self.timeline, self.backward_start_s = peak_bytes, timeline, backward_start_s
        self.allocations = list(allocations)

    def __repr__(self):
        return f"SavedTimeline(peak_bytes={self.peak_bytes}, events={len(self.timeline)})"


def _device_type_code(device: str):
    return 1 if device.startswith("cuda") else 0


@contextlib.contextmanager
def _quiet_kineto():
    """A CUDA build of torch on a machine without a usable GPU: kineto (torch.profiler's native
    side) prints "ERROR: ... gpuGetDeviceCount failed with code 35" and "USDT ... profiler_start"
    lines to stderr at every profiled step, about a GPU nobody asked for. Its log level is read
    from KINETO_LOG_LEVEL when the profiler first starts in the process; 6 is above every level it
    logs at. Left alone where a GPU is usable (its messages may matter there), where torch has no
    CUDA, or when the user set the variable. Restored after: child processes inherit no change."""
    if os.environ.get("KINETO_LOG_LEVEL") is not None or not torch.version.cuda or torch.cuda.is_available():
        yield
        return
    os.environ["KINETO_LOG_LEVEL"] = "6"
    try:
        yield
    finally:
        os.environ.pop("KINETO_LOG_LEVEL", None)


def saved_activation_peak(step, device: str = "cpu") -> SavedTimeline:
    """Runs ``step()`` once under torch.profiler and returns the device memory of saved activations
    over it (see the module docstring for what is counted).

    Example::

        r = saved_activation_peak(lambda: model(x).sum().backward())
        r.peak_bytes
    """
    activities = [ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    with _quiet_kineto(), profile(activities=activities, profile_memory=True) as prof:
        step()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    return _saved_timeline(_trace_events(prof), device)


def _trace_events(prof):
    """The chrome-trace events of a finished profile."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.remove(path)
    return events


def _saved_timeline(events, device: str) -> SavedTimeline:
    """The saved-activation timeline of one profiled step, from its trace events."""
    code = _device_type_code(device)
    mem = sorted(
        (e for e in events if e.get("name") == "[memory]" and e.get("args", {}).get("Device Type") == code),
        key=lambda e: e["ts"],
    )
    ranges = [e for e in events if e.get("ph") == "X" and not _on_device_lane(e)]
    bwd = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in ranges if str(e.get("name", "")).startswith(_BACKWARD_PREFIX)]
    t_bwd = min(a for a, _ in bwd) if bwd else float("inf")
    t_bwd_end = max(b for _, b in bwd) if bwd else float("inf")
    reloads = sorted((e["ts"], e["ts"] + e["dur"]) for e in ranges if e.get("name") in _RELOAD_RANGES)
    recomputes = sorted((e["ts"], e["ts"] + e["dur"]) for e in ranges if e.get("name") == _RECOMPUTE)

    def inside(ts, spans):
        for a, b in spans:
            if a <= ts <= b:
                return (a, b)
            if a > ts:
                break
        return None

    # pair allocations with their frees by address
    open_allocs = {}
    allocs = []  # [ts_alloc, bytes, ts_free]
    for e in mem:
        a = e["args"]
        addr, nbytes, ts = a.get("Addr"), a.get("Bytes", 0), e["ts"]
        if nbytes > 0:
            rec = [ts, nbytes, float("inf")]
            allocs.append(rec)
            open_allocs[addr] = rec
        elif nbytes < 0:
            rec = open_allocs.pop(addr, None)
            if rec is not None:
                rec[2] = ts
    counted, kept = [], []
    t0 = mem[0]["ts"] if mem else 0
    for ts, nbytes, tf in allocs:
        why = None
        if ts < t_bwd < tf <= t_bwd_end:
            why = "forward"
        elif ts >= t_bwd and inside(ts, reloads):
            why = "reload"
        else:
            span = inside(ts, recomputes)
            if span is not None and tf > span[1]:
                why = "recompute"
        if why:
            kept.append(((ts - t0) * 1e-6, (tf - t0) * 1e-6, nbytes, why))
            counted.append((ts, nbytes))
            if tf != float("inf"):
                counted.append((tf, -nbytes))
    counted.sort()
    live, peak, timeline = 0, 0, [(0.0, 0)]
    for ts, d in counted:
        live += d
        peak = max(peak, live)
        timeline.append(((ts - t0) * 1e-6, live))
    return SavedTimeline(peak, timeline, (t_bwd - t0) * 1e-6 if bwd else None, kept)
