"""Seconds, measured: each block call's forward and backward in the user's step, the host link's
bandwidth and per-copy latency through the engine, and the engine's conversion to a narrower
storage dtype. What :func:`~ckpt_offload.planner.measuring.measure_costs` times."""

from __future__ import annotations

import math
import time

import torch
from torch.utils._pytree import tree_flatten

from ckpt_offload._runtime import _C, synchronize
from ckpt_offload.host_copy import offload_tensor
from ckpt_offload.planner.costs import Bandwidth
from ckpt_offload.pool import HostPool

__all__ = ["measure_bandwidth", "measure_conversion", "measure_times", "sync_for", "tensors_in"]


def sync_for(device: str):
    """A function that waits for ``device``'s queued work (a no-op on the CPU)."""
    if device == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def tensors_in(obj) -> list:
    """The tensors among the leaves of ``obj`` (arguments, outputs)."""
    return [x for x in tree_flatten(obj)[0] if isinstance(x, torch.Tensor)]


def measure_times(step, named_blocks, device):
    """Run 2: compute seconds per block call, forward (hooks) and backward (hooks on the gradients
    of the call's output and input), and the step's total. Returns per call (execution order)
    ``fwd``, ``bwd``, then ``pre``, ``mid``, ``post`` and ``total``."""
    sync = sync_for(device)
    fwd_start, fwd_end, bwd_start, bwd_end = [], [], [], []  # per call
    active = {"i": None}

    def stamp(arr, c):
        def hook(*_):
            if arr[c] is None:
                sync()
                arr[c] = time.perf_counter()

        return hook

    def pre_hook(i):
        def hook(module, args, kwargs):
            if active["i"] is not None:
                return
            active["i"] = i
            c = len(fwd_start)
            for arr in (fwd_start, fwd_end, bwd_start, bwd_end):
                arr.append(None)
            for t in tensors_in((args, kwargs)):
                if t.requires_grad:
                    t.register_hook(stamp(bwd_end, c))
                    break
            sync()
            fwd_start[c] = time.perf_counter()

        return hook

    def post_hook(i):
        def hook(module, args, kwargs, output):
            if active["i"] != i:
                return
            active["i"] = None
            c = len(fwd_start) - 1
            sync()
            fwd_end[c] = time.perf_counter()
            for t in tensors_in(output):
                if t.requires_grad:
                    t.register_hook(stamp(bwd_start, c))
                    break

        return hook

    handles = []
    for i, (_, m) in enumerate(named_blocks):
        handles.append(m.register_forward_pre_hook(pre_hook(i), with_kwargs=True))
        handles.append(m.register_forward_hook(post_hook(i), with_kwargs=True))
    try:
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        t1 = time.perf_counter()
    finally:
        for h in handles:
            h.remove()
    n = len(fwd_start)
    fwd = [max(0.0, (e or 0) - (s or 0)) for s, e in zip(fwd_start, fwd_end)]
    bwd = []
    for c in range(n):
        s, e = bwd_start[c], bwd_end[c]
        if s is None or e is None or e < s:
            bwd.append(None)
        else:
            bwd.append(e - s)
    known = [b for b in bwd if b is not None]
    ratio = (sum(known) / sum(f for f, b in zip(fwd, bwd) if b is not None)) if known and sum(fwd) > 0 else 2.0
    bwd = [b if b is not None else ratio * f for f, b in zip(fwd, bwd)]
    total = t1 - t0
    pre = (fwd_start[0] - t0) if n and fwd_start[0] else 0.0
    last_fwd = (fwd_end[-1] if n else None) or t0
    first_bwd = (bwd_start[-1] if n else None) or last_fwd
    mid = max(0.0, first_bwd - last_fwd)
    post = max(0.0, total - pre - mid - sum(fwd) - sum(bwd))
    return fwd, bwd, pre, mid, post, total


def measure_bandwidth(device: str = "cpu", nbytes: int = 8 << 20) -> Bandwidth:
    """Times copies through a fresh host pool with ckpt_offload's engine (side stream): one small and
    one ``nbytes`` tensor each way; the small one gives the per-copy latency, the difference the
    bandwidth, and 16 small ones issued back to back the queue time per copy (``issue``).

    Example::

        bw = measure_bandwidth("cuda")      # Bandwidth(d2h=..., h2d=..., latency=..., issue=...)
    """

    pool = HostPool(pinned=None if device == "cuda" else False)
    sync = sync_for(device)
    small, big = 4096, max(int(nbytes), 1 << 20)

    def timed(n, count=1, reps=3):
        """The best of ``reps`` times of ``count`` copies of ``n`` bytes issued back to back, each way."""
        xs = [torch.empty(n // 4, dtype=torch.float32, device=device).fill_(1.0) for _ in range(count)]
        d2h, h2d = [], []
        for _ in range(reps):
            sync()
            t0 = time.perf_counter()
            hs = [offload_tensor(x, pool=pool) for x in xs]
            synchronize()
            sync()
            t1 = time.perf_counter()
            ys = [h.reload() for h in hs]
            sync()
            synchronize()
            t2 = time.perf_counter()
            d2h.append(t1 - t0)
            h2d.append(t2 - t1)
            del ys, hs
        return min(d2h), min(h2d)

    timed(small, reps=1)  # warm-up: the pool's first segment, the copy threads
    s_d, s_h = timed(small)
    b_d, b_h = timed(big)
    latency = max(0.0, min(s_d, s_h))
    d2h = (big - small) / max(b_d - s_d, 1e-9)
    h2d = (big - small) / max(b_h - s_h, 1e-9)
    # n copies back to back end (n - 1) * issue + latency after the first starts (Note [Copy
    # latency is a delay]); the bytes' own time is taken out.
    count = 16
    m_d, m_h = timed(small, count)
    issue_d = (m_d - s_d - (count - 1) * small / d2h) / (count - 1)
    issue_h = (m_h - s_h - (count - 1) * small / h2d) / (count - 1)
    issue = min(latency, max(0.0, min(issue_d, issue_h)))
    return Bandwidth(d2h=d2h, h2d=h2d, latency=latency, issue=issue)


def measure_conversion(device: str = "cpu", store_dtype=torch.bfloat16, nbytes: int = 4 << 20) -> float:
    """Bytes (of the full-width tensor) per second ckpt_offload's own conversion to ``store_dtype``
    and back runs at on ``device``, one way: an fp32 tensor of ``nbytes`` converted down and up
    (the engine's kernels, ``co._C._store_convert``), the best of three, its bytes twice over the time.

    Measured like the host link (:func:`measure_bandwidth`), because on a CPU the conversion is a
    loop over memory whose speed depends on the machine and competes with compute: a stated
    constant would be wrong by several times from one machine to another. On a GPU it is a
    memory-bound kernel (hundreds of GB/s and more), far faster than the link.

    Example::

        measure_conversion("cpu", torch.bfloat16)   # e.g. 3e9 (bytes/s)
    """
    sync = sync_for(device)
    name = str(store_dtype).removeprefix("torch.")
    x = torch.randn(max(int(nbytes), 1 << 16) // 4, dtype=torch.float32, device=device)
    _C._store_convert(x, name)  # warm-up
    best = math.inf
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        _C._store_convert(x, name)
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * x.nbytes / max(best, 1e-9)
