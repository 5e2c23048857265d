"""What a handle's blocks did: one handle's offload contexts counted together (``handle.stats()``).

The keys and how several contexts' values combine come from the native stats table
(Note [Stats table] in csrc/torch/counters.h); nothing here lists them again.
"""

from __future__ import annotations

import functools
import threading
import weakref

from ckpt_offload._runtime import _C

__all__ = ["StatsCollector", "merge_stats", "zero_stats"]


@functools.cache
def _stats_merge() -> dict:
    """Key -> how several contexts' values of it combine ("sum", "max", "per_reason", "state", "name",
    "by_class"), from the
    native table (Note [Stats table] in csrc/torch/counters.h)."""
    return dict(_C.stats_keys())


def merge_stats(stats: list) -> dict:
    """Several co.offload contexts' :meth:`~ckpt_offload.offload.stats` as one: counts and
    bytes add up (per reason in the nested dicts), peaks and the window take the largest."""
    merge = _stats_merge()
    out: dict = {}
    for s in stats:
        for k, v in s.items():
            if merge.get(k) == "name":  # the storage dtype: the contexts share one option dict
                out[k] = out.get(k) or v
            elif merge.get(k) == "by_class":
                _merge_by_class(out.setdefault(k, {}), v)
            elif isinstance(v, dict):
                d = out.setdefault(k, {})
                for r, n in v.items():
                    d[r] = d.get(r, 0) + n
            elif merge.get(k) in ("max", "state"):
                out[k] = max(out.get(k, 0), v)
            else:
                out[k] = out.get(k, 0) + v
    return out


def _merge_by_class(into: dict, more: dict) -> None:
    """Adds one context's ``store_error`` classes to ``into``: tensors add, means are weighted."""
    for cls, e in more.items():
        have = into.get(cls)
        if have is None:
            into[cls] = dict(e)
            continue
        n = have["tensors"] + e["tensors"]
        have["mean_rel_error"] = (have["mean_rel_error"] * have["tensors"] + e["mean_rel_error"] * e["tensors"]) / max(
            n, 1
        )
        have["max_rel_error"] = max(have["max_rel_error"], e["max_rel_error"])
        have["tensors"] = n


def zero_stats() -> dict:
    """Every key of :meth:`ckpt_offload.offload.stats` at zero (nested reason dicts included):
    what a handle reports before its first offloading checkpoint, or with offload off."""
    reasons = _C.keep_reasons()
    zeros = {"per_reason": lambda: {r: 0 for r in reasons}, "name": lambda: None, "by_class": dict}
    return {k: zeros.get(merge, int)() for k, merge in _C.stats_keys()}


class StatsCollector:
    """What one handle's checkpoints did, for ``handle.stats()``: the co.offload contexts they
    shared are the handle's own (``checkpointing.context_for`` with ``owner``), so two models wrapped
    with equal options count apart; fresh contexts of nested checkpoints are tracked weakly.
    Copied or pickled with a model, it starts empty: the copy's counts are its own.

    Note [Handle device peak]: ``device_saved_peak_bytes`` is the largest value of
    ``_C.device_bytes_saved()`` -- the process-wide count of saved-activation bytes ckpt_offload
    holds on the device (kept, being copied, reloaded, prefetched), the very count co.profile()
    samples for its own ``device_saved_peak_bytes`` -- read by :meth:`note_device_bytes` each time
    one of the handle's checkpoints has packed its inputs (forward) or unpacked them with the
    prefetches that unpack started (the recompute in backward). For the tensors these
    checkpoints save, those are the moments the count rises; between them it only falls (copies
    finish, reloads are released). It is a maximum over time of one count that already sums
    every context alive at that moment, not a sum of per-context peaks: the shared context of a
    forward and the fresh ones of nested checkpoints hold their bytes at the same time, and a sum
    of their separate peaks (reached at different times) would overstate the peak. Being
    process-wide, the count includes what other contexts (other threads, a co.offload of your
    own) hold at those moments. ``pool_peak_bytes`` is sampled the same way, from the bytes in
    use of the pool the checkpoint used: the pool's own ``peak_bytes_in_use`` would carry any
    other user's (an earlier run's, another model's) peak into this handle's stats.
    """

    def __init__(self):
        self._contexts = weakref.WeakSet()
        self._local = threading.local()  # .contexts: this handle's shared contexts, per thread
        self._retired: dict = {}  # stats of contexts that died, so counts never go backwards
        self._device_peak = 0
        self._pool_peak = 0
        self._peak_lock = threading.Lock()

    def _table(self) -> dict:
        table = getattr(self._local, "contexts", None)
        if table is None:
            table = self._local.contexts = {}
        return table

    def note_device_bytes(self, pool=None) -> None:
        """Samples the device count (Note [Handle device peak]), and ``pool``'s bytes in use."""
        now = _C.device_bytes_saved()
        in_pool = pool._impl.bytes_in_use() if pool is not None else 0
        if now > self._device_peak or in_pool > self._pool_peak:
            with self._peak_lock:  # two threads' checkpoints: the larger sample wins
                self._device_peak = max(self._device_peak, now)
                self._pool_peak = max(self._pool_peak, in_pool)

    def add(self, ctx) -> None:
        if ctx not in self._contexts:
            self._contexts.add(ctx)
            # Its counts stay once it dies: a fresh (nested) context when its graph goes, the
            # handle's shared context of a thread when that thread ends (its table is
            # thread-local). The finalizer holds only a weak reference to this collector and the
            # packer's bound method, so it keeps neither the handle nor the context alive.
            # Not at interpreter exit: nothing reads the counts then.
            weakref.finalize(ctx, _retire_into, weakref.ref(self), ctx._packer.stats).atexit = False

    def stats(self) -> dict:
        contexts = list(self._contexts)
        out = merge_stats([zero_stats(), self._retired, *[c.stats() for c in contexts]])
        # Sampled at this handle's checkpoints since its last reset (Note [Handle device peak]).
        out["pool_peak_bytes"] = self._pool_peak
        # The contexts sample the same count after each of their packs and unpacks (their own
        # device_saved_peak_bytes); the handle's samples add the checkpoint boundaries.
        out["device_saved_peak_bytes"] = max(self._device_peak, out.get("device_saved_peak_bytes", 0))
        return out

    def reset(self) -> None:
        self._retired = {}
        self._device_peak = 0
        self._pool_peak = 0
        for c in list(self._contexts):
            c.reset_stats()

    def __reduce__(self):
        return (StatsCollector, ())


def _retire_into(collector_ref, stats) -> None:
    collector = collector_ref()
    if collector is not None:
        collector._retired = merge_stats([collector._retired, stats()])
