"""Recompute (gradient checkpointing) with the checkpoint's inputs optionally offloaded.

``co.checkpoint`` is a drop-in for ``torch.utils.checkpoint.checkpoint`` (non-reentrant). With
``offload=...`` the tensors the checkpoint keeps for backward -- its inputs, including those
passed by keyword or inside lists, tuples and dicts, which torch's checkpoint keeps on the
device -- wait in the host pool instead.

:func:`run_checkpoint` is the one checkpointed call that ``co.checkpoint``, the blocks ``co.apply``
and plans wrap, and ``co.hf`` share; :func:`context_for` the offload context it enters.
"""

from __future__ import annotations

import inspect
import math
import threading
from typing import Any, Callable

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.utils._pytree import tree_flatten, tree_unflatten

from ckpt_offload._args import check_int, closest
from ckpt_offload._stats import StatsCollector
from ckpt_offload._warn import graph_break_if_compiling, hooks_disabled_reason, warn_at_user_line
from ckpt_offload.offloading import offload as offload_context
from ckpt_offload.options import OFFLOAD_KEYS, OffloadOptions, as_options, check_offloads_something, pool_free_key

__all__ = [
    "checkpoint",
    "checkpoint_sequential",
    "run_checkpoint",
    "context_for",
    "TORCH_KEYWORDS",
    "check_checkpoint_keywords",
    "check_reentrant",
]

_CHECKPOINT_PARAMETERS = inspect.signature(torch_checkpoint.checkpoint).parameters
# Keywords of torch's checkpoint that this torch has (the rest of **kwargs go to the function).
# preserve_rng_state is one in every torch, but before 2.14 it is read from **kwargs, not named
# in the signature.
TORCH_KEYWORDS = ("preserve_rng_state",) + tuple(
    name
    for name in ("context_fn", "determinism_check", "debug", "early_stop", "respect_saved_tensors_hooks")
    if name in _CHECKPOINT_PARAMETERS
)
# Note [Selective checkpoint under our hooks]
# torch's selective checkpoint (a context_fn made by create_selective_checkpoint_contexts) keeps
# the tensors its policy saves in a cache of its own, outside autograd's saved tensors. torch 2.14
# routes them through the active saved-tensor hooks only with respect_saved_tensors_hooks=True;
# left unset, it warns (FutureWarning) at every checkpoint where a hook is active -- our own
# offload context, or a `with co.offload():` around a checkpoint without offload -- and keeps
# them on the device; the next torch makes the unset value an error and True its default. Every
# non-reentrant route here passes True unless the caller passed the keyword: the policy's saved
# tensors reach whatever hooks are active (with offload: the pool), as they will in torch's
# default. In eager mode torch reads CheckpointPolicy.MUST_CPU_OFFLOAD / PREFER_CPU_OFFLOAD as
# recompute; where the user asked this checkpoint to offload (offload=...), its policy's offload
# decisions are read as save instead (_OffloadAsSave), so that with True those outputs go through
# our hooks to the pool, as co.selective_offload_context keeps them. Where they cannot reach the
# pool (the caller's respect_saved_tensors_hooks=False, a torch without the keyword) torch
# recomputes them, and we warn once at the user's line.
_HAS_RESPECT_HOOKS = "respect_saved_tensors_hooks" in _CHECKPOINT_PARAMETERS
_CachingMode = getattr(torch_checkpoint, "_CachingTorchDispatchMode", None)
_Policy = getattr(torch_checkpoint, "CheckpointPolicy", None)
# Offload decision -> the save decision of the same strength.
_AS_SAVE = (
    {}
    if _Policy is None or not hasattr(_Policy, "MUST_CPU_OFFLOAD")
    else {_Policy.MUST_CPU_OFFLOAD: _Policy.MUST_SAVE, _Policy.PREFER_CPU_OFFLOAD: _Policy.PREFER_SAVE}
)


def _respecting_hooks(torch_kwargs: dict) -> dict:
    """``torch_kwargs`` with ``respect_saved_tensors_hooks=True`` where a ``context_fn`` is given
    and the caller did not choose (Note [Selective checkpoint under our hooks])."""
    if _HAS_RESPECT_HOOKS and "context_fn" in torch_kwargs and "respect_saved_tensors_hooks" not in torch_kwargs:
        return {**torch_kwargs, "respect_saved_tensors_hooks": True}
    return torch_kwargs


class _OffloadAsSave:
    """A torch selective-checkpoint policy whose offload decisions are read as save (kept through
    our hooks, in the pool), or, where ``to_pool`` is False, left to torch (recomputed) with one
    warning. Note [Selective checkpoint under our hooks]."""

    __slots__ = ("policy_fn", "to_pool")

    def __init__(self, policy_fn, to_pool: bool):
        self.policy_fn = policy_fn
        self.to_pool = to_pool

    def __call__(self, ctx, op, *args, **kwargs):
        decision = self.policy_fn(ctx, op, *args, **kwargs)
        if decision.__class__ is _Policy and decision in _AS_SAVE:
            if self.to_pool:
                return _AS_SAVE[decision]
            warn_at_user_line(
                lambda: (
                    "co.checkpoint(offload=...): the context_fn's policy returned "
                    f"CheckpointPolicy.{decision.name} for "
                    f"{op}, but with respect_saved_tensors_hooks=False (or a torch without it) the tensors torch's "
                    "selective checkpoint keeps bypass the pool, so torch recomputes that output in backward (its "
                    "eager meaning of the offload policies). Leave respect_saved_tensors_hooks unset to keep it in "
                    "the pool, or use co.selective_offload_context(policy) as the context_fn."
                ),
                key="sac-offload-recomputed",
            )
        return decision


def _offload_honoured(context_fn, torch_kwargs: dict):
    """``context_fn`` whose torch selective-checkpoint contexts read the policy's offload decisions
    as save (Note [Selective checkpoint under our hooks]); other context_fns come back as given."""
    if _CachingMode is None or not _AS_SAVE:
        return context_fn
    to_pool = _HAS_RESPECT_HOOKS and torch_kwargs.get("respect_saved_tensors_hooks") is True

    def contexts():
        forward_context, recompute_context = context_fn()
        if isinstance(forward_context, _CachingMode) and not torch.compiler.is_compiling():
            forward_context.policy_fn = _OffloadAsSave(forward_context.policy_fn, to_pool)
        return forward_context, recompute_context

    return contexts


def check_checkpoint_keywords(kwargs, route: str, own=()) -> None:
    """Raises TypeError for a keyword of ``route`` that is neither ``use_reentrant`` nor one of
    torch's checkpoint keywords; a co.offload option there gets told to go inside ``offload={...}``.
    ``own``: the route's own keywords, among which a typo's closest match is looked for too."""
    unknown = sorted(set(kwargs) - {"use_reentrant", *TORCH_KEYWORDS})
    misplaced = [k for k in unknown if k in OFFLOAD_KEYS]
    if misplaced:
        one = len(misplaced) == 1
        raise TypeError(
            f"{route}: {misplaced} {'is a co.offload option' if one else 'are co.offload options'}; pass "
            f"{'it' if one else 'them'} inside offload={{...}}, e.g. offload={{{misplaced[0]!r}: ...}}"
        )
    if unknown:
        names = [*own, "use_reentrant", *TORCH_KEYWORDS]
        hints = [f"{k!r} (did you mean {closest(k, names)!r}?)" if closest(k, names) else repr(k) for k in unknown]
        raise TypeError(f"{route}: unknown checkpoint keyword(s) {', '.join(hints)}; allowed: {names}")


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


def _table_for(pool) -> dict:
    if pool is None:
        local = _local
    else:
        # dict.setdefault is atomic: two threads get the same thread-local object.
        local = pool.__dict__.get(_POOL_ATTR) or pool.__dict__.setdefault(_POOL_ATTR, threading.local())
    table = getattr(local, "contexts", None)
    if table is None:
        table = local.contexts = {}
    return table


def context_for(options: OffloadOptions, owner: "StatsCollector | None" = None) -> offload_context:
    """The co.offload context for a checkpoint with these options: this thread's shared one
    (kept across calls with ``keep_dedup``, so an input every layer receives is stored once), or
    a fresh one when the shared one is already active (a checkpoint nested in another one).

    With ``owner`` (a handle's :class:`~ckpt_offload._stats.StatsCollector`) the shared context is
    that handle's own: two models wrapped with equal options count their blocks apart
    (``handle.stats()``), and the context lives as long as the handle.

    The routes that get here (co.checkpoint, co.apply, co.hf, a plan) checked at the user's own
    line that these options offload something, so the contexts made here do not warn again."""
    pool = options.pool
    key = pool_free_key(options)  # frozen and hashable; the pool by identity below
    if owner is not None:
        table, key = owner._table(), (key, id(pool))  # the context holds the pool: its id stays its own
    else:
        table = _table_for(pool)
    ctx = table.get(key)
    if ctx is None:
        ctx = table[key] = offload_context._from_options(options, keep_dedup=True)
    if ctx.active:
        ctx = offload_context._from_options(options)
    return ctx


def _all_tensors(args) -> bool:
    for a in args:
        if not isinstance(a, torch.Tensor):
            return False
    return True


def _as_positional(function, args, kwargs, before=None):
    """``(run, tensors)``: every tensor leaf of ``(args, kwargs)`` -- also those passed by keyword
    and inside lists, tuples and dicts -- as one positional argument of ``run``, which puts them
    back where they were and calls ``function``. The closure keeps only the non-tensor leaves.

    torch's non-reentrant checkpoint saves (and checks the version of) only its top-level
    positional tensors; one passed by keyword or in a container it keeps in its closure, and
    recomputes from whatever it holds by then: a function that writes such an input in place
    would get wrong gradients instead of the "modified by an inplace operation" error. Handed
    over this way, each one is saved, so torch's own check sees the write; with offload, the
    active saved-tensor hooks (ours) hold them in the pool instead of on the device.
    ``before``: called at the start of every run (the forward and the recompute).

    The usual call -- only tensors, by position -- is handed over as it is: no flatten, and no
    unflatten in the forward and again in the recompute (Note [Fixed cost per call])."""
    if not kwargs and _all_tensors(args):
        if before is None:
            return function, list(args)

        def run_plain(*inputs):
            before()
            return function(*inputs)

        return run_plain, list(args)
    leaves, spec = tree_flatten((args, kwargs))
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    tensors = [leaves[i] for i in positions]
    skeleton = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
    del leaves, args, kwargs

    def run(*inputs):
        if before is not None:
            before()
        filled = list(skeleton)
        for i, t in zip(positions, inputs):
            filled[i] = t
        a, kw = tree_unflatten(filled, spec)
        return function(*a, **kw)

    return run, tensors


def run_checkpoint(
    function, args, kwargs, options, use_reentrant: bool, torch_kwargs: dict, collector: StatsCollector | None = None
):
    """Runs ``function(*args, **kwargs)`` under torch's checkpoint; with ``options`` (co.offload
    options: an :class:`~ckpt_offload.OffloadOptions`) the tensors the checkpoint keeps
    wait in the host pool -- also those inside ``kwargs`` and containers."""
    if use_reentrant:
        return torch_checkpoint.checkpoint(function, *args, use_reentrant=True, **torch_kwargs, **kwargs)
    if "context_fn" in torch_kwargs:  # Note [Selective checkpoint under our hooks]
        torch_kwargs = _respecting_hooks(torch_kwargs)
        if options is not None:
            torch_kwargs = {**torch_kwargs, "context_fn": _offload_honoured(torch_kwargs["context_fn"], torch_kwargs)}
    if options is None or hooks_disabled_reason() is not None:
        # Without offload (or inside torch.func.grad / vjp / jacrev / hessian, where torch's
        # checkpoint itself refuses, with its own clear error; entering our context first would
        # only add noise), torch's checkpoint alone -- its tensor inputs handed over positionally
        # all the same, so that it saves and version-checks those passed by keyword too.
        run, tensors = _as_positional(function, args, kwargs)
        return torch_checkpoint.checkpoint(run, *tensors, use_reentrant=False, **torch_kwargs)
    graph_break_if_compiling()  # fullgraph=True: say what works (the offload context is C++)
    ctx = context_for(options, owner=collector)
    # Called right after this checkpoint packed its inputs (forward), or unpacked them for the
    # recompute (backward): Note [Handle device peak].
    before = None if collector is None else (lambda: collector.note_device_bytes(ctx.pool))
    run, tensors = _as_positional(function, args, kwargs, before)
    del args, kwargs
    if collector is not None:
        collector.add(ctx)
    # `with ctx:`, without its two compile checks: graph_break_if_compiling above made that
    # check for this whole call (Note [Fixed cost per call]).
    ctx._enter()
    try:
        out = torch_checkpoint.checkpoint(run, *tensors, use_reentrant=False, **torch_kwargs)
    except BaseException as e:
        ctx._exit(type(e))
        raise
    ctx._exit()
    return out


def checkpoint(function: Callable, *args: Any, offload=False, use_reentrant: bool | None = None, **kwargs: Any):
    """Runs ``function(*args, **kwargs)`` without keeping its activations; backward recomputes them.

    A drop-in for ``torch.utils.checkpoint.checkpoint`` with non-reentrant semantics: it accepts
    and honours ``preserve_rng_state``, ``context_fn``, ``determinism_check``, ``debug`` and
    ``early_stop`` (where the installed torch has them); every other keyword goes to
    ``function``. Gradients equal those without checkpointing, dropout included (the RNG state
    is restored for the recompute). With a selective-checkpoint ``context_fn``,
    ``respect_saved_tensors_hooks=True`` is passed where torch has it, unless you pass that
    keyword yourself: the tensors its policy saves go through the active saved-tensor hooks (with
    ``offload``, or inside ``co.offload()``: to the host pool). With ``offload``, the outputs
    the policy marks ``MUST_CPU_OFFLOAD`` / ``PREFER_CPU_OFFLOAD`` wait in the pool too (torch's
    eager contexts would recompute them).

    Args:
        function: the callable to checkpoint (a module, or a function of tensors).
        offload: ``False`` (default), ``True``, a :class:`~ckpt_offload.OffloadOptions`, or a
            dict of its options (``{"devices": ["cpu"], "min_bytes": 0}``). When on, the tensors the
            checkpoint keeps for backward (its inputs) live in the host pool between forward and
            backward -- also those passed by keyword and inside lists, tuples and dicts. An input
            shared by every layer (a rotary table, a mask) is stored once.
        use_reentrant: ``False`` (default) or ``True`` (torch's reentrant variant, which
            cannot offload: ``offload`` must then be off).

    Example::

        def block(x, *, mask):
            return layer(x, mask)

        y = co.checkpoint(block, x, mask=mask, offload=True)
    """
    if not callable(function):
        raise TypeError(f"function must be callable, got {type(function).__name__}")
    options = as_options(offload)
    if options is not None:
        check_offloads_something(options.devices, "co.checkpoint(offload=...)")
    torch_kwargs = {k: kwargs.pop(k) for k in TORCH_KEYWORDS if k in kwargs} if kwargs else {}
    if kwargs:
        _check_function_keywords(function, kwargs)
    return run_checkpoint(function, args, kwargs, options, check_reentrant(use_reentrant, options), torch_kwargs)


_OUR_KEYWORDS = ("offload", "use_reentrant", *TORCH_KEYWORDS)


def _named_parameters(function) -> set | None:
    """The keyword names ``function`` declares (a module: its forward's), or None when its
    signature cannot be read (a builtin)."""
    try:
        params = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return None
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _check_function_keywords(function, kwargs: dict) -> None:
    """co.checkpoint passes unknown keywords on to ``function``; one that ``function`` does not
    declare and that looks like a keyword of co.checkpoint (a typo: ``offlaod=True``) or is a
    co.offload option is far more likely a mistake than an argument for ``function`` (silently
    passed on it would turn offload off, or fail inside the function with an unrelated error)."""
    suspects = {k: closest(k, _OUR_KEYWORDS) for k in kwargs if k in OFFLOAD_KEYS or closest(k, _OUR_KEYWORDS)}
    if not suspects:
        return
    declared = _named_parameters(function)
    for k, near in suspects.items():
        if declared is not None and k in declared:
            continue
        name = getattr(function, "__name__", type(function).__name__)
        if k in OFFLOAD_KEYS:
            raise TypeError(
                f"co.checkpoint: {k}= is a co.offload option, which {name} does not take; pass it inside "
                f"offload={{...}}, e.g. co.checkpoint(f, x, offload={{{k!r}: ...}})"
            )
        raise TypeError(
            f"co.checkpoint: unknown keyword {k}= (did you mean {near}=?). {name} does not declare it, so "
            f"it would be passed on to {name}. co.checkpoint's own keywords: {', '.join(_OUR_KEYWORDS)}. "
            f"To pass {k}= to the function, declare it in its signature or bind it with functools.partial."
        )


def checkpoint_sequential(functions, segments, input, offload=False, use_reentrant: bool | None = None, **kwargs):
    """Like ``torch.utils.checkpoint.checkpoint_sequential``: splits ``functions`` (an
    ``nn.Sequential`` or a list of modules/functions run one after another) into ``segments``
    chunks, checkpoints every chunk but the last, and returns the output. ``segments="sqrt"`` is
    Chen et al.'s rule: round(sqrt(n)) chunks for n functions. ``offload`` and the checkpoint
    keywords are as in :func:`checkpoint`.

    Example::

        out = co.checkpoint_sequential(model.layers, 4, x, offload=True)
        out = co.checkpoint_sequential(model.layers, "sqrt", x)
    """
    if isinstance(functions, torch.nn.Sequential):
        functions = list(functions.children())
    try:
        functions = list(functions)
    except TypeError:
        raise TypeError(
            f"functions must be an nn.Sequential or a list of callables, got {type(functions).__name__}"
        ) from None
    if not functions:
        raise ValueError("functions is empty")
    for i, f in enumerate(functions):
        if not callable(f):
            raise TypeError(f"functions[{i}] is not callable ({type(f).__name__})")
    if segments == "sqrt":
        segments = max(1, round(math.sqrt(len(functions))))
    elif isinstance(segments, str):
        raise ValueError(f"segments must be an int >= 1 or 'sqrt', got {segments!r}")
    check_int("segments", segments, minimum=1)
    if segments > len(functions):
        raise ValueError(f"segments ({segments}) cannot exceed the number of functions ({len(functions)})")

    def run_range(start, end):
        def forward(x):
            for j in range(start, end + 1):
                x = functions[j](x)
            return x

        return forward

    size = len(functions) // segments
    end = -1
    for start in range(0, size * (segments - 1), size):
        end = start + size - 1
        input = checkpoint(run_range(start, end), input, offload=offload, use_reentrant=use_reentrant, **kwargs)
    return run_range(end + 1, len(functions) - 1)(input)
