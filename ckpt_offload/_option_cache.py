"""Options made once per distinct call (Note [Fixed cost per call]): the keys of a call's
arguments, and the cache of the options made from them, without their pool.

Knows nothing of the option schema: :mod:`ckpt_offload.options` (the schema) passes its class and
its checks in. Everything here holds frozen values only, so no call can see another's changes.
"""

from __future__ import annotations

import torch

# Note [Fixed cost per call]
# co.checkpoint, co.apply's blocks, co.hf and plans run once per block per step, in forward and
# again in the recompute: whatever a call does before torch's checkpoint is paid that often. A
# training loop that writes `with co.offload(...):` makes a context every step, and what the
# construction leaves in the caches slows the step that follows it. Checking and normalizing
# options costs about as much as torch's checkpoint itself adds on a small block, so what
# depends only on the options is done once per distinct options:
#  - offload=True is always the same defaults (one frozen instance, options._default_options);
#  - the options of a co.offload(...) call, and of an offload={...} dict written in a route's
#    call, are made once per distinct arguments (MADE_FROM_CALLS, keyed by call_key: the
#    names, values and their types, so 1 and True, or a list and a set, are never mistaken for
#    each other). Only plain values (strings, numbers, dtypes, devices, lists of them) are
#    cached, and the pool is left out: the cache holds the options without their pool, and a
#    call that gives one gets a copy with it (made_before), so that the cache never keeps a
#    pool alive (the caller's to drop). Options that do nothing (those the schema warns about)
#    are made again at every call, so that every call site hears about them; bad ones raise at
#    every call (they are never cached);
#  - the key of the checkpoint routes' shared context (the options without their pool) is made
#    once per options object (options.pool_free_key), and so are the options' hash
#    (OffloadOptions.__hash__) and the native packer's options (options.native_packer_options, on
#    the pool-free options); none is pickled (a string's hash differs from one process to the next);
#  - a context reads its options through ctx.options (no copy of each into every context);
#  - options.check_offloads_something remembers the devices arguments that select a device here;
#  - inputs that are all tensors, by position, go to torch's checkpoint as they are (no pytree
#    flatten, and no unflatten in forward and recompute: checkpointing._as_positional);
#  - the route makes the compile check once (run_checkpoint) and enters and exits its context
#    through offload._enter / _exit, which are __enter__ / __exit__ without theirs.
# benchmarks/call_overhead.py measures what a call costs against torch's checkpoint, and what
# making a co.offload(...) context costs.

#: The attributes an options object caches (not fields, never pickled).
CACHE_ATTRS = ("_hash", "_pool_free_key", "_packer_options")

# The values a cached call may give: plain values only, so that the cache keeps no object alive
# (the pool is left out of it) and no value can change after it was read.
_PLAIN_VALUES = (str, int, float, bool, type(None), torch.dtype, torch.device)
_SCALARS = frozenset((str, int, float, bool, type(None)))


def _frozen(value):
    """A hashable stand-in for an option's value that tells types apart (1 from True, a list
    from a set); TypeError for anything but plain values and lists, tuples and sets of them."""
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_frozen(v) for v in value))
    if isinstance(value, (set, frozenset)):
        return (type(value), frozenset(_frozen(v) for v in value))
    if type(value) not in _PLAIN_VALUES:
        raise TypeError(f"not cached: {type(value).__name__}")
    return (type(value), value)


def fields_of(options) -> dict:
    """The fields of ``options`` as a new dict (their caches left out)."""
    fields = dict(options.__dict__)
    for name in CACHE_ATTRS:
        fields.pop(name, None)
    return fields


def made_of(cls, fields: dict):
    """An instance of the frozen ``cls`` whose ``__dict__`` is ``fields``, taken as checked
    already (no __post_init__)."""
    made = object.__new__(cls)
    object.__setattr__(made, "__dict__", fields)  # frozen: its fields are written once, here
    return made


# Options made from a call's arguments, without their pool: {call_key: (options, their fields)}.
MADE_FROM_CALLS: dict = {}
_MADE_FROM_CALLS_MAX = 256  # distinct calls remembered; cleared when full
_POOL_SLOT = ("pool",)  # the pool's place in a key: it is put back on a hit


def call_key(positional_keys: tuple, args: tuple, kwargs: dict, in_any_order: bool = False):
    """The cache key of options given as ``co.offload(*args, **kwargs)`` (``args`` named by
    ``positional_keys``; or as a dict, in ``kwargs``, with ``in_any_order``: its keys in name
    order), or None when a value cannot be cached. Each item is (name, type, value) for a scalar,
    (name, type, the items' types, the items) for a list or tuple of scalars, (name,
    _frozen(value)) otherwise (never one for another: their lengths differ), so that 1 and True,
    or a list and a set, never match; the positional ones first, with their count (an option
    given by position never matches one given by name)."""
    key = [len(args)]
    append = key.append
    try:
        items = sorted(kwargs.items()) if in_any_order else kwargs.items()
        if args:
            items = [*zip(positional_keys, args), *items]
        for name, value in items:
            kind = type(value)
            if kind in _SCALARS:
                append((name, kind, value))
            elif name == "pool":
                append(_POOL_SLOT)
            elif (kind is list or kind is tuple) and all(type(v) in _SCALARS for v in value):
                append((name, kind, tuple(map(type, value)), tuple(value)))
            else:
                append((name, _frozen(value)))
    except TypeError:  # a value of another kind, or a dict key that is not a string
        return None
    return tuple(key)


def made_before(key, pool, pool_type):
    """The options made for ``key`` earlier, with ``pool``; None when there are none (or the pool
    is not a ``pool_type``: the call then makes its options, and raises)."""
    made = MADE_FROM_CALLS.get(key) if key is not None else None
    if made is None:
        return None
    if pool is None:
        return made[0]
    if not isinstance(pool, pool_type):
        return None
    fields = made[1].copy()
    fields["pool"] = pool
    fields["_pool_free_key"] = made[0]
    return made_of(type(made[0]), fields)


def remember(key, free) -> None:
    """Caches ``free`` (options without their pool) for ``key``."""
    if key is None:
        return
    if len(MADE_FROM_CALLS) >= _MADE_FROM_CALLS_MAX:
        MADE_FROM_CALLS.clear()
    MADE_FROM_CALLS[key] = (free, fields_of(free))
