"""The offload options: one set, :class:`OffloadOptions`, that every route takes.

``co.offload(min_bytes=..., ...)``, ``co.checkpoint(f, x, offload={...})``, ``co.apply``,
``co.hf.enable``, ``co.hf.OffloadCallback(**options)`` and ``co.plan`` all build (or take) an
:class:`OffloadOptions`: its fields are the option list, its defaults the defaults, its checks the
checks (each error names the option), and :meth:`OffloadOptions.packer_kwargs` what the native
packer receives. Keyword arguments and ``offload={...}`` dicts are spellings of it.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import itertools
import re
import textwrap

import torch

from ckpt_offload._args import check_bytes, check_choice, closest, device_types
from ckpt_offload._runtime import _C, cuda_compiled, default_devices, usable_device_types
from ckpt_offload._warn import warn_at_user_line
from ckpt_offload.pool import HostPool

__all__ = ["OffloadOptions", "as_options", "OFFLOAD_KEYS", "DEFAULT_MIN_BYTES", "DEFAULT_PREFETCH_BYTES",
           "DEFAULT_BATCH_BYTES", "STREAM_MODES", "STORE_DTYPES", "ON_FULL_POLICIES"]

#: Tensors whose bytes are fewer than this stay on the device by default. Small saved tensors
#: (layer-norm statistics, biases' inputs of tiny layers) free little memory and each costs a
#: copy launch plus an event; see README "Choosing min_bytes" for how this was chosen.
DEFAULT_MIN_BYTES = 256 * 1024
#: The most bytes of prefetched (reloaded ahead of need, not yet used) tensors the default,
#: automatic window may hold on the device: by default the window is about one block of the
#: model (see ``prefetch_bytes`` in :class:`~ckpt_offload.offload`), and never more than this.
DEFAULT_PREFETCH_BYTES = 256 * 1024 * 1024
#: Size of the blocks that batched small tensors are gathered into (``batch_below``).
DEFAULT_BATCH_BYTES = 4 * 1024 * 1024
STREAM_MODES = ("side", "compute")
#: The narrower formats ``store_dtype`` accepts (besides None: exact storage): the engine's list.
STORE_DTYPES = tuple(getattr(torch, name) for name in _C.store_formats())
ON_FULL_POLICIES = ("keep", "raise")


_offloading_devices: set = set()  # devices arguments that select a device with tensors here


def check_offloads_something(devices, route: str) -> None:
    """Warns at the user's line (once per call site) when ``devices`` (a co.offload ``devices``
    argument; None: the default) selects no device that has tensors here. ``route`` names the
    API the user called, e.g. ``"co.apply(offload=...)"``."""
    try:
        if devices in _offloading_devices:  # Note [Fixed cost per call]
            return
    except TypeError:  # unhashable (a list): checked below
        pass
    if devices is None:
        types = ["cuda"] if "cuda" in usable_device_types() else []
    else:
        try:
            types = device_types("devices", devices)
        except (TypeError, ValueError):
            return  # the context raises its own clear error
    if any(t in usable_device_types() for t in types):
        if isinstance(devices, (tuple, str, type(None))):
            _offloading_devices.add(devices)
        return
    asked = "devices=None (the default: the GPU)" if devices is None else f"devices={list(types)}"
    warn_at_user_line(
        f"{route}: {asked} selects no device with tensors here (no usable CUDA GPU: "
        f"torch.cuda.is_available()={torch.cuda.is_available()}, ckpt_offload cuda_compiled={cuda_compiled()}), "
        "so nothing is offloaded: every saved tensor stays where it is (kept_by_reason['device']). "
        "To offload CPU tensors into the host pool pass devices=['cpu'] "
        "(co.offload(devices=['cpu']), or offload={'devices': ['cpu']}).",
        key=route,
    )


#: The byte-valued options of co.offload and how each is bounded: each takes an int or a size
#: string such as ``"512KiB"`` (ckpt_offload._args.parse_bytes).
BYTE_OPTIONS = {"min_bytes": {}, "prefetch_bytes": {"allow_none": True}, "batch_below": {},
                "batch_bytes": {"minimum": 1}, "store_min_bytes": {}}


def check_not_devices(name: str, value) -> None:
    """``co.offload("cpu")`` puts a device where the first positional argument, ``min_bytes``,
    goes: say so, instead of only that an int was expected."""
    items = [value] if isinstance(value, (str, torch.device)) else value
    if not isinstance(items, (list, tuple, set, frozenset)) or not items:
        return
    try:
        types = device_types(name, items)
    except (TypeError, ValueError):
        return  # not devices: the size check's own message
    raise TypeError(
        f"{name} must be an int (bytes), got {value!r}, which names a device: co.offload's first positional "
        f"argument is min_bytes. To choose what is offloaded pass devices=, e.g. co.offload(devices={types!r})"
    )


#: The names ``store_dtype=`` (and ``co.plan``'s ``lossy=``) takes for the storage dtypes.
STORE_DTYPE_NAMES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn,
                     "fp8_e5m2": torch.float8_e5m2}


def store_dtype_named(name: str) -> torch.dtype:
    """``"bf16"``, ``"fp16"``, ``"fp8"`` (e4m3fn), ``"fp8_e5m2"`` or a dtype's own name
    (``"bfloat16"``, ``"float8_e4m3fn"``) -> the storage dtype."""
    by_name = {**STORE_DTYPE_NAMES, **{str(d).removeprefix("torch."): d for d in STORE_DTYPES}}
    got = by_name.get(name.strip().lower())
    if got is None:
        raise ValueError(f"store_dtype: unknown name {name!r}; accepted: None, {', '.join(map(repr, by_name))} "
                         f"or a torch.dtype ({', '.join(str(d) for d in STORE_DTYPES)})")
    return got


def _without_effect(options) -> bool:
    """True when _warn_if_without_effect has something to say about ``options``."""
    return (options.store_dtype is None and bool(options.measure_error or options.store_min_bytes)) or (
        options.stream == "compute" and bool(options.prefetch_bytes))


def _warn_if_without_effect(options) -> None:
    """Options that would silently do nothing: a warning that names what makes them work."""
    if options.store_dtype is None:
        given = [k for k, on in (("measure_error=True", options.measure_error),
                                 (f"store_min_bytes={options.store_min_bytes}", options.store_min_bytes)) if on]
        if given:
            warn_at_user_line(
                f"co.offload(): {' and '.join(given)} without store_dtype does nothing: only converted tensors "
                "are measured or exempted, and without store_dtype every tensor is stored exactly. Set "
                "store_dtype (e.g. store_dtype=torch.bfloat16), or drop the option.", key="co.offload-store-options")
    if options.stream == "compute" and options.prefetch_bytes:
        warn_at_user_line(
            f"co.offload(): prefetch_bytes={options.prefetch_bytes} does nothing with stream='compute' (reloads run "
            "on the compute stream when backward asks for them; nothing is prefetched). Use stream='side' to "
            "prefetch, or drop prefetch_bytes.", key="co.offload-prefetch-compute")


def check_store_dtype(store_dtype) -> str:
    """Checks ``store_dtype`` and returns the engine's name for it (``""`` for None: exact).

    Example::

        check_store_dtype(torch.bfloat16)   # -> "bfloat16"
        check_store_dtype(torch.int8)       # ValueError: store_dtype must be None or one of ...
    """
    if store_dtype is None:
        return ""
    accepted = "None (exact), " + ", ".join(str(d) for d in STORE_DTYPES)
    if not isinstance(store_dtype, torch.dtype):
        raise TypeError(f"store_dtype must be None, a torch.dtype ({accepted}) or one of the names "
                        f"{', '.join(map(repr, STORE_DTYPE_NAMES))}, got {type(store_dtype).__name__}")
    if store_dtype not in STORE_DTYPES:
        raise ValueError(f"store_dtype must be None or one of {accepted}; got {store_dtype}")
    return str(store_dtype).removeprefix("torch.")


@dataclasses.dataclass(frozen=True)
class OffloadOptions:
    """The options of an offload: what is offloaded, where to, and how it is copied.

    The fields are :class:`~ckpt_offload.offload`'s arguments (its docstring says what each does);
    sizes may be given as strings (``"64KiB"``) and are stored as ints, ``devices`` as a sorted
    tuple of device types. Bad values raise when the options are made, naming the option. Frozen
    and hashable: equal options share one offload context per handle.

    Example::

        opts = co.OffloadOptions(devices=["cpu"], min_bytes="64KiB")
        opts.min_bytes                      # 65536
        with co.offload(opts):              # the same as co.offload(devices=["cpu"], min_bytes="64KiB")
            ...
        co.apply(model, offload=opts)       # every route takes it, as it takes a dict of the same keys
        opts.replace(stream="compute")      # a changed copy
    """

    min_bytes: int = DEFAULT_MIN_BYTES
    """The smallest tensor (bytes of storage it spans) worth a copy; smaller ones stay on the device.
    Default `DEFAULT_MIN_BYTES` (256 KiB; how it was chosen: "Choosing `min_bytes`" in docs/api.md). This
    and the other byte counts (`prefetch_bytes`, `batch_below`, `batch_bytes`, `store_min_bytes`) take an
    int or a size string such as `"64KiB"` or `"1MiB"`."""
    stream: str = "side"
    """`"side"` (default): copies on a dedicated copy stream per device and direction, ordered after the
    compute stream by events, so copies overlap compute. `"compute"`: copies on the current stream
    (simplest, no overlap)."""
    devices: tuple | None = None
    """Device types whose tensors are offloaded: `"cuda"`, `"cpu"`, or a list. Default: the accelerator
    in use (`["cuda"]` with a GPU; nothing, with a warning, on a machine without one)."""
    pool: HostPool | None = None
    """The `co.HostPool` to use; default `co.default_pool()`."""
    on_full: str = "keep"
    """At the pool's cap: `"keep"` (default) leaves the tensor on the device and counts it as
    `kept_by_reason["pool_full"]`; `"raise"` raises `co.PoolFullError`."""
    prefetch_bytes: int | None = None
    """With `stream="side"`, each reload in backward starts the reloads of the tensors packed just before
    it (the ones backward needs next) on the copy stream, while fewer than a window of bytes of such
    prefetched tensors wait unused on the device. `None` (default): the window follows the model --
    about one block (a checkpointed block, or one of the repeated layers the forward packed), started
    as many blocks ahead as the copies need to hide behind compute (measured as backward runs, 1 to 8
    blocks), at most `DEFAULT_PREFETCH_BYTES` (256 MiB); so backward holds about the block it
    differentiates, one block prefetched and what is kept, not the whole step. An int fixes the window
    at that many bytes; `0` turns prefetch off. Correct for any unpack order: a prefetched tensor is
    used by whichever unpack asks first and, if none does, released once its copy has finished.
    `stats()` reports `prefetch_window_bytes`, `prefetch_block_bytes` and `prefetch_lead`."""
    batch_below: int = 0
    """Saved tensors spanning fewer bytes than this (and at least `min_bytes`) are gathered into shared
    blocks of `batch_bytes` and copied once (a gather kernel on a GPU), then scattered back into tensors
    of their own on reload. `0` (default) turns batching off. Lower `min_bytes` with it to offload small
    tensors cheaply, e.g. `co.offload(min_bytes=4096, batch_below=256 * 1024)`."""
    batch_bytes: int = DEFAULT_BATCH_BYTES
    """Size of a batch block (default `DEFAULT_BATCH_BYTES`, 4 MiB). A batch is copied when full, when
    the context exits, or when one of its tensors is needed."""
    store_dtype: torch.dtype | None = None
    """`None` (default): every offloaded byte is stored exactly, and gradients are bit-identical. A
    storage dtype may also be given by name: `"bf16"`, `"fp16"`, `"fp8"` (e4m3fn), `"fp8_e5m2"` or the
    dtype's own (`"bfloat16"`, ...), as `co.plan(lossy=...)` takes them. `torch.bfloat16` /
    `torch.float16`: a floating-point saved tensor wider than that (fp32, fp64) is
    converted before its copy to the host and converted back after its reload -- half the host bytes
    and copy time of fp32, with the rounding error of `t.to(store_dtype).to(t.dtype)`.
    `torch.float8_e4m3fn` / `torch.float8_e5m2`: a quarter of fp32's bytes, with a per-tensor scale
    (the absolute maximum of the tensor's own finite elements / the format's largest value) stored with
    it; infinities and NaN come back as themselves; fp16 / bf16 tensors are converted too. Not bit-exact: an accuracy trade-off ("Low-precision storage" in docs/api.md);
    `stats()` counts `bytes_stored` against `bytes_offloaded`. Integer, bool and complex tensors, and
    tensors already at or below the storage width, are stored exactly. Converted tensors are copied one
    by one (never batched). A saved tensor whose span is exactly an earlier converted one's (same
    storage, first and last byte, dtype and version: the same tensor saved twice, or a view of it in
    another layout, like softmax's output reshaped for a matmul) shares its narrow copy and its
    conversion back (counted in `tensors_deduplicated`; gradients are the same bits as converting it
    again); views whose spans only overlap are converted each on its own."""
    store_min_bytes: int = 0
    """With `store_dtype`: tensors spanning fewer bytes than this are stored exactly (default `0`: every
    offloaded floating-point tensor is converted). Without `store_dtype` it does nothing, and warns."""
    measure_error: bool = False
    """With `store_dtype`: measure the relative error `norm(x - stored(x)) / norm(x)` of every converted
    tensor into `stats()["store_error"]`, per class `"<dtype>-><store dtype>"` (plus `" @ <module>"` under
    `co.profile()`). Synchronizes with the device once per tensor: for measuring, not for training.
    Without `store_dtype` it does nothing, and warns."""

    def __post_init__(self):
        put = object.__setattr__  # frozen: the checks normalize in place, once
        check_not_devices("min_bytes", self.min_bytes)  # co.offload("cpu"): say a device was meant
        for name, bounds in BYTE_OPTIONS.items():
            put(self, name, check_bytes(name, getattr(self, name), **bounds))
        check_choice("stream", self.stream, STREAM_MODES)
        check_choice("on_full", self.on_full, ON_FULL_POLICIES)
        if self.batch_below > self.batch_bytes:
            raise ValueError(
                f"batch_below ({self.batch_below}) must not exceed batch_bytes ({self.batch_bytes}): a batched "
                "tensor has to fit in a batch block; raise batch_bytes or lower batch_below"
            )
        if isinstance(self.store_dtype, str):  # "bf16" as co.plan's lossy= takes it
            put(self, "store_dtype", store_dtype_named(self.store_dtype))
        check_store_dtype(self.store_dtype)
        if not isinstance(self.measure_error, bool):
            raise TypeError(f"measure_error must be True or False, got {type(self.measure_error).__name__}")
        if self.pool is not None and not isinstance(self.pool, HostPool):
            raise TypeError(f"pool must be a ckpt_offload.HostPool or None, got {type(self.pool).__name__}")
        if self.devices is not None:
            types = device_types("devices", self.devices)
            if "cuda" in types and not cuda_compiled():
                raise ValueError(
                    "devices includes 'cuda' but this ckpt_offload build has no CUDA "
                    "(co.build_info()['cuda_compiled'] is False). Reinstall with a CUDA build of torch and nvcc "
                    "(CKPT_OFFLOAD_CUDA=1 pip install --no-build-isolation .), or pass devices=['cpu']."
                )
            put(self, "devices", tuple(sorted(set(types))))

    @property
    def device_types(self) -> tuple:
        """The device types offloaded: ``devices``, or for ``None`` the accelerator in use
        (``("cuda",)`` with a usable GPU, ``()`` without one)."""
        return self.devices if self.devices is not None else tuple(default_devices())

    def __hash__(self) -> int:
        # The generated hash (the fields' tuple), computed once: the checkpoint routes look their
        # shared context up by these options on every call (Note [Fixed cost per call]).
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self) -> dict:
        # The caches stay behind: a string's hash differs from one process to the next.
        return {k: v for k, v in self.__dict__.items() if k not in _CACHE_ATTRS}

    def replace(self, **changes) -> "OffloadOptions":
        """A copy with ``changes`` (checked like the original). Example: ``opts.replace(min_bytes=0)``."""
        unknown = sorted(set(changes) - set(OFFLOAD_KEYS))
        if unknown:
            raise TypeError(_unknown_message("OffloadOptions.replace", unknown))
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """The options that differ from the defaults, as a dict ``offload={...}`` accepts."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != f.default}

    def packer_kwargs(self) -> dict:
        """What the native packer receives (its argument list, the one at the C++ boundary); the
        pool is resolved by the caller."""
        types = self.device_types
        return dict(
            min_bytes=self.min_bytes,
            offload_cpu="cpu" in types,
            offload_cuda="cuda" in types,
            side_stream=self.stream == "side",
            raise_on_full=self.on_full == "raise",
            # None: a window that follows the model, capped (Note [Prefetch window]).
            prefetch_bytes=DEFAULT_PREFETCH_BYTES if self.prefetch_bytes is None else self.prefetch_bytes,
            prefetch_auto=self.prefetch_bytes is None,
            batch_below=self.batch_below,
            batch_bytes=self.batch_bytes,
            store_dtype=check_store_dtype(self.store_dtype),
            store_min_bytes=self.store_min_bytes,
            measure_error=self.measure_error,
        )

    def __repr__(self) -> str:
        given = ", ".join(f"{k}={v!r}" for k, v in self.to_dict().items())
        return f"OffloadOptions({given})"


_CACHE_ATTRS = ("_hash", "_pool_free_key", "_packer_options")  # OffloadOptions' caches (not fields, never pickled)

#: The option names, in the order of :class:`OffloadOptions`' fields.
OFFLOAD_KEYS = tuple(f.name for f in dataclasses.fields(OffloadOptions))
#: How many of them ``co.offload`` takes by position (the rest are keyword-only).
POSITIONAL_KEYS = OFFLOAD_KEYS[:8]


def _unknown_message(route: str, unknown) -> str:
    hints = [f"{k!r} (did you mean {closest(k, OFFLOAD_KEYS)!r}?)" if closest(k, OFFLOAD_KEYS) else repr(k)
             for k in unknown]
    return f"{route}: unknown co.offload option(s) {', '.join(hints)}; allowed: {list(OFFLOAD_KEYS)}"


def _init_naming_unknown_options(init):
    # The dataclass's own __init__ answers a typo with Python's bare "unexpected keyword argument".
    # The warnings are given here, not in __post_init__: under the generated __init__ (whose file
    # is "<string>") they would point there instead of at the user's line.
    def __init__(self, *args, **kwargs):
        unknown = sorted(set(kwargs) - set(OFFLOAD_KEYS))
        if unknown:
            raise TypeError(_unknown_message("co.OffloadOptions", unknown))
        init(self, *args, **kwargs)
        _warn_if_without_effect(self)

    __init__.__wrapped__ = init  # inspect.signature shows the fields
    __init__.__doc__, __init__.__qualname__ = init.__doc__, init.__qualname__
    return __init__


OffloadOptions.__init__ = _init_naming_unknown_options(OffloadOptions.__init__)


# Note [Fixed cost per call]
# co.checkpoint, co.apply's blocks, co.hf and plans run once per block per step, in forward and
# again in the recompute: whatever a call does before torch's checkpoint is paid that often. A
# training loop that writes `with co.offload(...):` makes a context every step, and what the
# construction leaves in the caches slows the step that follows it. Checking and normalizing
# options costs about as much as torch's checkpoint itself adds on a small block, so what
# depends only on the options is done once per distinct options:
#  - offload=True is always the same defaults (one frozen instance, _default_options);
#  - the options of a co.offload(...) call, and of an offload={...} dict written in a route's
#    call, are made once per distinct arguments (_made_from_calls, keyed by _call_key: the
#    names, values and their types, so 1 and True, or a list and a set, are never mistaken for
#    each other). Only plain values (strings, numbers, dtypes, devices, lists of them) are
#    cached, and the pool is left out: the cache holds the options without their pool, and a
#    call that gives one gets a copy with it (_made_before), so that the cache never keeps a
#    pool alive (the caller's to drop). Options that do nothing (those _warn_if_without_effect
#    warns about) are made again at every call, so that every call site hears about them; bad
#    ones raise at every call (they are never cached);
#  - the key of the checkpoint routes' shared context (the options without their pool) is made
#    once per options object (pool_free_key), and so are the options' hash (OffloadOptions.__hash__)
#    and the native packer's options (native_packer_options, on the pool-free options); none is
#    pickled (a string's hash differs from one process to the next);
#  - a context reads its options through ctx.options (no copy of each into every context);
#  - check_offloads_something remembers the devices arguments that select a device here;
#  - inputs that are all tensors, by position, go to torch's checkpoint as they are (no pytree
#    flatten, and no unflatten in forward and recompute: checkpointing._as_positional);
#  - the route makes the compile check once (run_checkpoint) and enters and exits its context
#    through offload._enter / _exit, which are __enter__ / __exit__ without theirs.
# Every cache holds frozen values only, so no call can see another's changes.
# benchmarks/call_overhead.py measures what a call costs against torch's checkpoint, and what
# making a co.offload(...) context costs.


@functools.cache
def _default_options() -> "OffloadOptions":
    """``as_options(True)``: the defaults, one frozen instance (Note [Fixed cost per call])."""
    return OffloadOptions()


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


def _fields(options: "OffloadOptions") -> dict:
    """The fields of ``options`` as a new dict (their caches left out)."""
    fields = dict(options.__dict__)
    for name in _CACHE_ATTRS:
        fields.pop(name, None)
    return fields


def _made_of(fields: dict) -> "OffloadOptions":
    """Options whose ``__dict__`` is ``fields``, taken as checked already (no __post_init__)."""
    made = object.__new__(OffloadOptions)
    object.__setattr__(made, "__dict__", fields)  # frozen: its fields are written once, here
    return made


def pool_free_key(options: "OffloadOptions") -> "OffloadOptions":
    """``options`` without their pool (what the checkpoint routes' shared contexts are keyed by),
    made once per options object (Note [Fixed cost per call])."""
    if options.pool is None:
        return options
    key = options.__dict__.get("_pool_free_key")
    if key is None:
        fields = _fields(options)
        fields["pool"] = None
        key = _made_of(fields)
        object.__setattr__(options, "_pool_free_key", key)  # frozen: a cache, not a field
    return key


def native_packer_options(options: "OffloadOptions"):
    """``options.packer_kwargs()`` as the native packer's options object (``_C.PackerOptions``),
    made once per options without their pool (Note [Fixed cost per call])."""
    holder = pool_free_key(options)
    made = holder.__dict__.get("_packer_options")
    if made is None:
        made = _C.PackerOptions(**holder.packer_kwargs())
        object.__setattr__(holder, "_packer_options", made)  # frozen: a cache, not a field
    return made


# Options made from a call's arguments, without their pool: {_call_key: (options, their fields)}.
_made_from_calls: dict = {}
_MADE_FROM_CALLS_MAX = 256  # distinct calls remembered; cleared when full
_POOL_INDEX = POSITIONAL_KEYS.index("pool")
_POOL_SLOT = ("pool",)  # the pool's place in a key: it is put back on a hit


def _call_key(args: tuple, kwargs: dict, in_any_order: bool = False):
    """The cache key of options given as ``co.offload(*args, **kwargs)`` (or as a dict, in
    ``kwargs``, with ``in_any_order``: its keys in name order), or None when a value cannot be
    cached. Each item is (name, type, value) for a scalar, (name, type, the items' types, the
    items) for a list or tuple of scalars, (name, _frozen(value)) otherwise (never one for
    another: their lengths differ), so that 1 and True, or a list and a set, never match; the
    positional ones first, with their count (an option given by position never matches one
    given by name)."""
    key = [len(args)]
    append = key.append
    try:
        items = sorted(kwargs.items()) if in_any_order else kwargs.items()
        if args:
            items = [*zip(POSITIONAL_KEYS, args), *items]
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


def _made_before(key, pool) -> "OffloadOptions | None":
    """The options made for ``key`` earlier, with ``pool``; None when there are none (or the pool
    is no pool: the call then makes its options, and raises)."""
    made = _made_from_calls.get(key) if key is not None else None
    if made is None:
        return None
    if pool is None:
        return made[0]
    if not isinstance(pool, HostPool):
        return None
    fields = made[1].copy()
    fields["pool"] = pool
    fields["_pool_free_key"] = made[0]
    return _made_of(fields)


def _remember(key, made: "OffloadOptions") -> None:
    """Caches ``made`` (without its pool) for ``key``, unless it warns (then it warns at every call site)."""
    if key is None or _without_effect(made):
        return
    if len(_made_from_calls) >= _MADE_FROM_CALLS_MAX:
        _made_from_calls.clear()
    free = pool_free_key(made)
    _made_from_calls[key] = (free, _fields(free))


def from_arguments(route: str, args: tuple, kwargs: dict) -> OffloadOptions:
    """The options of a call such as ``co.offload(0, "side", devices=["cpu"])``: positional
    arguments in field order (the first eight), keywords by name, or one :class:`OffloadOptions`."""
    if len(args) == 1 and isinstance(args[0], OffloadOptions):
        if kwargs:
            return args[0].replace(**kwargs)
        return args[0]
    key = _call_key(args, kwargs)
    made = _made_before(key, args[_POOL_INDEX] if len(args) > _POOL_INDEX else kwargs.get("pool"))
    if made is not None:
        return made
    if len(args) > len(POSITIONAL_KEYS):
        raise TypeError(f"{route} takes at most {len(POSITIONAL_KEYS)} positional options "
                        f"({', '.join(POSITIONAL_KEYS)}), got {len(args)}; pass the others by keyword")
    unknown = sorted(set(kwargs) - set(OFFLOAD_KEYS))
    if unknown:
        raise TypeError(_unknown_message(route, unknown))
    twice = [k for k in POSITIONAL_KEYS[:len(args)] if k in kwargs]
    if twice:
        raise TypeError(f"{route} got {twice[0]} both by position and by keyword")
    made = OffloadOptions(**dict(zip(POSITIONAL_KEYS, args)), **kwargs)
    _remember(key, made)
    return made


def as_options(offload, *, name: str = "offload") -> OffloadOptions | None:
    """An ``offload=`` argument as options: ``False``/``None`` -> None (off), ``True`` -> the
    defaults, a dict of option names -> those, an :class:`OffloadOptions` -> itself. Errors name
    ``name`` and the option.

    Example::

        as_options({"devices": {"cpu"}, "min_bytes": "64KiB"})   # OffloadOptions(min_bytes=65536, devices=('cpu',))
        as_options(True)                                         # OffloadOptions()
    """
    if offload is None or offload is False:
        return None
    if offload is True:
        return _default_options()
    if isinstance(offload, OffloadOptions):
        return offload
    if isinstance(offload, dict):
        key = _call_key((), offload, in_any_order=True)
        made = _made_before(key, offload.get("pool"))
        if made is not None:
            return made
        unknown = sorted(set(offload) - set(OFFLOAD_KEYS), key=repr)
        if unknown:
            raise TypeError(_unknown_message(name, [str(k) for k in unknown]))
        try:
            made = OffloadOptions(**offload)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{name}: {e}") from None
        _remember(key, made)
        return made
    raise TypeError(
        f"{name} must be False, True, or a dict of co.offload options ({', '.join(OFFLOAD_KEYS)}) "
        f"or a co.OffloadOptions; got {type(offload).__name__}"
    )


# --- the options' descriptions ---------------------------------------------------------------------
# Each option is described once, in the string under its field in OffloadOptions (markdown-style
# `code`). co.offload's docstring, OffloadOptions' and the table in docs/api.md are made from them
# (scripts/option_docs.py writes the table; tests/core/test_docs.py checks it is current).


@functools.cache
def option_docs() -> dict:
    """``{option: description}`` in field order: the string under each field of
    :class:`OffloadOptions`, as one line. Empty where the source cannot be read (a frozen
    install): the docstrings then say less, the options work the same."""
    try:
        with open(__file__, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError):  # pragma: no cover - no source
        return {}
    body = next(n.body for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "OffloadOptions")
    docs = {}
    for node, after in itertools.pairwise(body):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return {k: docs[k] for k in OFFLOAD_KEYS if k in docs}


def _rst(text: str) -> str:
    """A description's `code` as reStructuredText's ``code``."""
    return re.sub(r"`([^`]+)`", r"``\1``", text)


def args_section(docs: dict, indent: int = 8) -> str:
    """``docs`` (``{name: description}``) as the entries of a docstring's ``Args:``, wrapped at
    100 columns, continuation lines 4 deeper."""
    lines = []
    for name, text in docs.items():
        lines += textwrap.wrap(f"{name}: {_rst(text)}", 100, initial_indent=" " * indent,
                               subsequent_indent=" " * (indent + 4), break_on_hyphens=False)
    return "\n".join(lines)


def markdown_table(docs: dict) -> str:
    """``docs`` as the argument table of docs/api.md (a description holds no ``|``)."""
    rows = ["| argument | meaning |", "| --- | --- |"]
    rows += [f"| `{name}` | {text} |" for name, text in docs.items()]
    return "\n".join(rows)


if OffloadOptions.__doc__ and option_docs():  # None under python -OO
    OffloadOptions.__doc__ += "\n    Fields:\n" + args_section(option_docs()) + "\n"
