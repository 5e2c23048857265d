"""The checkpoint call that ``co.checkpoint``, ``co.apply`` and ``co.hf`` share (private).

Interface (used by ``ckpt_offload/checkpoint.py`` and ``ckpt_offload/integrations/hf.py``):

- :data:`TORCH_KEYWORDS`: the keywords of torch's checkpoint that the installed torch accepts;
- :func:`offload_options`: normalizes an ``offload=`` argument;
- :func:`check_reentrant`: validates ``use_reentrant`` against the offload options;
- :func:`run_checkpoint`: one checkpointed call, with the inputs offloaded when asked;
- :func:`context_for`: the co.offload context a checkpoint with these options enters.
"""

from __future__ import annotations

import functools
import inspect
import threading
import weakref

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.utils._pytree import tree_flatten, tree_unflatten

from ckpt_offload._offload_options import BYTE_OPTIONS, option_bytes
from ckpt_offload.offload import check_options as check_offload_options
from ckpt_offload.offload import _quiet, graph_break_if_compiling, hooks_disabled_reason, offload as offload_context
from ckpt_offload.pool import HostPool

__all__ = ["OFFLOAD_KEYS", "TORCH_KEYWORDS", "check_checkpoint_keywords", "offload_options", "check_reentrant", "run_checkpoint", "context_for"]

OFFLOAD_KEYS = ("min_bytes", "stream", "devices", "pool", "on_full", "prefetch_bytes", "batch_below", "batch_bytes",
                "store_dtype", "store_min_bytes", "measure_error")
_CHECKPOINT_PARAMETERS = inspect.signature(torch_checkpoint.checkpoint).parameters
# Keywords of torch's checkpoint that this torch has (the rest of **kwargs go to the function).
# preserve_rng_state is one in every torch, but before 2.14 it is read from **kwargs, not named
# in the signature.
TORCH_KEYWORDS = ("preserve_rng_state",) + tuple(
    name
    for name in ("context_fn", "determinism_check", "debug", "early_stop", "respect_saved_tensors_hooks")
    if name in _CHECKPOINT_PARAMETERS
)
# Selective checkpointing (a context_fn policy) keeps the tensors its policy saves outside
# autograd's saved tensors; torch 2.14 routes them through the active saved-tensor hooks (ours)
# only with respect_saved_tensors_hooks=True, and warns on every call when it is left unset.
_HAS_RESPECT_HOOKS = "respect_saved_tensors_hooks" in _CHECKPOINT_PARAMETERS


def offload_options(offload, *, name: str = "offload") -> dict | None:
    """Normalizes an ``offload=`` argument: False/None -> None, True -> {}, a dict -> checked copy."""
    if offload is None or offload is False:
        return None
    if offload is True:
        return {}
    if isinstance(offload, dict):
        unknown = sorted(set(offload) - set(OFFLOAD_KEYS), key=repr)
        if unknown:
            raise TypeError(f"{name}: unknown co.offload option(s) {unknown}; allowed: {list(OFFLOAD_KEYS)}")
        # The checks co.offload makes, now rather than at the first forward.
        try:
            devices = check_offload_options(**offload)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{name}: {e}") from None
        options = dict(offload)
        for key in BYTE_OPTIONS.keys() & options.keys():  # "512KiB" -> 524288: one context per option set
            options[key] = option_bytes(key, options[key])
        if devices is not None:
            options["devices"] = tuple(devices)  # normalized, hashable: {"cpu"} works as in co.offload
        return options
    raise TypeError(
        f"{name} must be False, True, or a dict of co.offload options ({', '.join(OFFLOAD_KEYS)}); "
        f"got {type(offload).__name__}"
    )


def check_checkpoint_keywords(kwargs, route: str) -> None:
    """Raises TypeError for a keyword of ``route`` that is neither ``use_reentrant`` nor one of
    torch's checkpoint keywords; a co.offload option there gets told to go inside ``offload={...}``."""
    unknown = sorted(set(kwargs) - {"use_reentrant", *TORCH_KEYWORDS})
    misplaced = [k for k in unknown if k in OFFLOAD_KEYS]
    if misplaced:
        one = len(misplaced) == 1
        raise TypeError(
            f"{route}: {misplaced} {'is a co.offload option' if one else 'are co.offload options'}; pass "
            f"{'it' if one else 'them'} inside offload={{...}}, e.g. offload={{{misplaced[0]!r}: ...}}"
        )
    if unknown:
        raise TypeError(f"{route}: unknown checkpoint keyword(s) {unknown}; allowed: "
                        f"{['use_reentrant', *TORCH_KEYWORDS]}")


def check_reentrant(use_reentrant, options) -> bool:
    """``use_reentrant`` as a bool (None -> False); refuses reentrant with offload on."""
    if use_reentrant is None:
        return False
    if not isinstance(use_reentrant, bool):
        raise TypeError(f"use_reentrant must be True or False, got {use_reentrant!r}")
    if use_reentrant and options is not None:
        raise ValueError(
            "offload needs use_reentrant=False: the reentrant checkpoint keeps its inputs outside "
            "autograd's saved tensors, so they could not be offloaded. Pass use_reentrant=False "
            "(the default of co.checkpoint), or offload=False."
        )
    return use_reentrant


# Contexts are shared per thread and option set, so that one deduplication table spans all the
# layers of a forward. Those with the default pool live in this thread-local table; those with a
# pool passed in the options live in a thread-local table stored on that pool, so that the only
# references to the context come from the pool itself: a pool the user drops is freed (with its
# memory) by the garbage collector, instead of being kept alive by the cache forever.
_local = threading.local()
_POOL_ATTR = "_ckpt_offload_checkpoint_contexts"


def _hashable(value):
    if isinstance(value, (list, tuple, set, frozenset)):
        return tuple(sorted(str(v) for v in value))
    return value


def _table_for(pool) -> dict:
    if pool is None:
        local = _local
    else:
        # dict.setdefault is atomic: two threads get the same thread-local object.
        local = pool.__dict__.setdefault(_POOL_ATTR, threading.local())
    table = getattr(local, "contexts", None)
    if table is None:
        table = local.contexts = {}
    return table


def _options_key(options: dict):
    return tuple(sorted((k, _hashable(v)) for k, v in options.items() if k != "pool"))


def context_for(options: dict, owner: "StatsCollector | None" = None) -> offload_context:
    """The co.offload context for a checkpoint with these options: this thread's shared one
    (kept across calls with ``keep_dedup``, so an input every layer receives is stored once), or
    a fresh one when the shared one is already active (a checkpoint nested in another one).

    With ``owner`` (a handle's :class:`StatsCollector`) the shared context is that handle's own:
    two models wrapped with equal options count their blocks apart (``handle.stats()``), and the
    context lives as long as the handle."""
    pool = options.get("pool")
    key = _options_key(options)
    try:
        hash(key)
    except TypeError:
        return offload_context(**options)  # raises the option's own clear error
    if pool is not None and not isinstance(pool, HostPool):
        return offload_context(**options)  # same
    if owner is not None:
        table, key = owner._table(), (key, id(pool))  # the context holds the pool: its id stays its own
    else:
        table = _table_for(pool)
    ctx = table.get(key)
    # The routes that get here (co.checkpoint, co.apply, co.hf) checked at the user's own line
    # that these options offload something; the context must not warn again from inside forward.
    _quiet.on = True
    try:
        if ctx is None:
            ctx = table[key] = offload_context(**options, keep_dedup=True)
        if ctx.active:
            ctx = offload_context(**options)
    finally:
        _quiet.on = False
    return ctx


@functools.cache
def _stats_merge() -> dict:
    """Key -> how several contexts' values of it combine ("sum", "max", "per_reason", "state", "name",
    "by_class"), from the
    native table (Note [Stats table] in csrc/torch/counters.h)."""
    from ckpt_offload import _C

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
        have["mean_rel_error"] = (have["mean_rel_error"] * have["tensors"] + e["mean_rel_error"] * e["tensors"]) / max(n, 1)
        have["max_rel_error"] = max(have["max_rel_error"], e["max_rel_error"])
        have["tensors"] = n


def zero_stats() -> dict:
    """Every key of :meth:`ckpt_offload.offload.stats` at zero (nested reason dicts included):
    what a handle reports before its first offloading checkpoint, or with offload off."""
    from ckpt_offload import _C

    reasons = _C.keep_reasons()
    zeros = {"per_reason": lambda: {r: 0 for r in reasons}, "name": lambda: None, "by_class": dict}
    return {k: zeros.get(merge, int)() for k, merge in _C.stats_keys()}


class StatsCollector:
    """What one handle's checkpoints did, for ``handle.stats()``: the co.offload contexts they
    shared are the handle's own (:func:`context_for` with ``owner``), so two models wrapped
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

    def note_device_bytes(self, pool: HostPool | None = None) -> None:
        """Samples the device count (Note [Handle device peak]), and ``pool``'s bytes in use."""
        from ckpt_offload import _C

        now = _C.device_bytes_saved()
        in_pool = pool._impl.stats()["bytes_in_use"] if pool is not None else 0
        if now > self._device_peak or in_pool > self._pool_peak:
            with self._peak_lock:  # two threads' checkpoints: the larger sample wins
                self._device_peak = max(self._device_peak, now)
                self._pool_peak = max(self._pool_peak, in_pool)

    def add(self, ctx: offload_context) -> None:
        if ctx not in self._contexts:
            self._contexts.add(ctx)
            if not any(ctx is c for c in self._table().values()):
                # A fresh (nested) context: its counts stay once it dies. The finalizer holds
                # only the packer's bound method; the handle's own contexts need none (they
                # live as long as it does, and a finalizer would keep the handle alive).
                weakref.finalize(ctx, _retire_into, weakref.ref(self), ctx._packer.stats)

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


def run_checkpoint(function, args, kwargs, options, use_reentrant: bool, torch_kwargs: dict,
                   collector: StatsCollector | None = None):
    """Runs ``function(*args, **kwargs)`` under torch's checkpoint; with ``options`` (co.offload
    options, already normalized by :func:`offload_options`) the tensors the checkpoint keeps
    wait in the host pool -- also those inside ``kwargs`` and containers."""
    if use_reentrant or options is None:
        return torch_checkpoint.checkpoint(function, *args, use_reentrant=use_reentrant, **torch_kwargs, **kwargs)
    graph_break_if_compiling()  # fullgraph=True: say what works (the offload context is C++)
    if hooks_disabled_reason() is not None:
        # Inside torch.func.grad / vjp / jacrev / hessian: torch's checkpoint itself refuses
        # there, with its own clear error; entering our context first would only add noise.
        return torch_checkpoint.checkpoint(function, *args, use_reentrant=False, **torch_kwargs, **kwargs)
    if _HAS_RESPECT_HOOKS and "context_fn" in torch_kwargs and "respect_saved_tensors_hooks" not in torch_kwargs:
        # The tensors a selective-checkpoint policy saves go to the pool too (and torch does
        # not warn that our hooks are in scope).
        torch_kwargs = {**torch_kwargs, "respect_saved_tensors_hooks": True}
    # Every tensor input becomes a positional argument of torch's checkpoint, which saves those
    # through the active saved-tensor hooks (ours). The closure keeps only the non-tensor
    # leaves: a tensor in it would stay on the device until backward.
    leaves, spec = tree_flatten((args, kwargs))
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    tensors = [leaves[i] for i in positions]
    skeleton = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
    del leaves, args, kwargs

    def run(*inputs):
        if collector is not None:
            # Called right after this checkpoint packed its inputs (forward), or unpacked them
            # for the recompute (backward): Note [Handle device peak].
            collector.note_device_bytes(ctx.pool)
        filled = list(skeleton)
        for i, t in zip(positions, inputs):
            filled[i] = t
        a, kw = tree_unflatten(filled, spec)
        return function(*a, **kw)

    ctx = context_for(options, owner=collector)
    if collector is not None:
        collector.add(ctx)
    with ctx:
        return torch_checkpoint.checkpoint(run, *tensors, use_reentrant=False, **torch_kwargs)
