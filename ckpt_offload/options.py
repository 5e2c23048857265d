"""The offload options: one set, :class:`OffloadOptions`, that every route takes.

``co.offload(min_bytes=..., ...)``, ``co.checkpoint(f, x, offload={...})``, ``co.apply``,
``co.hf.enable``, ``co.hf.OffloadCallback(**options)`` and ``co.plan`` all build (or take) an
:class:`OffloadOptions`: its fields are the option list, its defaults the defaults, its checks the
checks (each error names the option), and :meth:`OffloadOptions.packer_kwargs` what the native
packer receives. Keyword arguments and ``offload={...}`` dicts are spellings of it.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ckpt_offload import _option_cache as cache
from ckpt_offload._option_cache import call_key, made_before
from ckpt_offload._args import check_bytes, check_choice, closest, device_types
from ckpt_offload._option_docs import args_section, field_docs
from ckpt_offload._runtime import _C, cuda_compiled, default_devices, usable_device_types
from ckpt_offload._warn import warn_at_user_line
from ckpt_offload.pool import HostPool

__all__ = [
    "OffloadOptions",
    "as_options",
    "OFFLOAD_KEYS",
    "DEFAULT_MIN_BYTES",
    "DEFAULT_PREFETCH_BYTES",
    "DEFAULT_BATCH_BYTES",
    "STREAM_MODES",
    "STORE_DTYPES",
    "ON_FULL_POLICIES",
]

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
BYTE_OPTIONS = {
    "min_bytes": {},
    "prefetch_bytes": {"allow_none": True},
    "batch_below": {},
    "batch_bytes": {"minimum": 1},
    "store_min_bytes": {},
}


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
STORE_DTYPE_NAMES = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def store_dtype_named(name: str) -> torch.dtype:
    """``"bf16"``, ``"fp16"``, ``"fp8"`` (e4m3fn), ``"fp8_e5m2"`` or a dtype's own name
    (``"bfloat16"``, ``"float8_e4m3fn"``) -> the storage dtype."""
    by_name = {**STORE_DTYPE_NAMES, **{str(d).removeprefix("torch."): d for d in STORE_DTYPES}}
    got = by_name.get(name.strip().lower())
    if got is None:
        raise ValueError(
            f"store_dtype: unknown name {name!r}; accepted: None, {', '.join(map(repr, by_name))} "
            f"or a torch.dtype ({', '.join(str(d) for d in STORE_DTYPES)})"
        )
    return got


def _without_effect(options) -> bool:
    """True when _warn_if_without_effect has something to say about ``options``."""
    return (options.store_dtype is None and bool(options.measure_error or options.store_min_bytes)) or (
        options.stream == "compute" and bool(options.prefetch_bytes)
    )


def _warn_if_without_effect(options) -> None:
    """Options that would silently do nothing: a warning that names what makes them work."""
    if options.store_dtype is None:
        given = [
            k
            for k, on in (
                ("measure_error=True", options.measure_error),
                (f"store_min_bytes={options.store_min_bytes}", options.store_min_bytes),
            )
            if on
        ]
        if given:
            warn_at_user_line(
                f"co.offload(): {' and '.join(given)} without store_dtype does nothing: only converted tensors "
                "are measured or exempted, and without store_dtype every tensor is stored exactly. Set "
                "store_dtype (e.g. store_dtype=torch.bfloat16), or drop the option.",
                key="co.offload-store-options",
            )
    if options.stream == "compute" and options.prefetch_bytes:
        warn_at_user_line(
            f"co.offload(): prefetch_bytes={options.prefetch_bytes} does nothing with stream='compute' (reloads run "
            "on the compute stream when backward asks for them; nothing is prefetched). Use stream='side' to "
            "prefetch, or drop prefetch_bytes.",
            key="co.offload-prefetch-compute",
        )


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
        raise TypeError(
            f"store_dtype must be None, a torch.dtype ({accepted}) or one of the names "
            f"{', '.join(map(repr, STORE_DTYPE_NAMES))}, got {type(store_dtype).__name__}"
        )
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
    _: dataclasses.KW_ONLY  # the options after min_bytes are keyword-only (DEPRECATED_POSITIONAL_KEYS)
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
    it; infinities and NaN come back as themselves; fp16 / bf16 tensors are converted too. Not bit-exact: an accuracy
    trade-off ("Low-precision storage" in docs/api.md);
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
        return {k: v for k, v in self.__dict__.items() if k not in cache.CACHE_ATTRS}

    def replace(self, **changes) -> "OffloadOptions":
        """A copy with ``changes`` (checked like the original). Example: ``opts.replace(min_bytes=0)``."""
        unknown = sorted(set(changes) - set(OFFLOAD_KEYS))
        if unknown:
            raise TypeError(_unknown_message("OffloadOptions.replace", unknown))
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """The options that differ from the defaults, as a dict ``offload={...}`` accepts."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) != f.default}

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


#: The option names, in the order of :class:`OffloadOptions`' fields.
OFFLOAD_KEYS = tuple(f.name for f in dataclasses.fields(OffloadOptions))
#: The options ``co.offload`` and ``OffloadOptions`` take by position: ``min_bytes``; the rest are
#: keyword-only.
POSITIONAL_KEYS = OFFLOAD_KEYS[:1]
#: The options after ``min_bytes`` that were positional before 0.2 (in this order): still taken by
#: position, with a DeprecationWarning, until 0.3.0.
DEPRECATED_POSITIONAL_KEYS = OFFLOAD_KEYS[1:8]


def _positional(route: str, args: tuple) -> dict:
    """``args`` given by position to ``route`` as ``{option: value}``: ``min_bytes``, then (with a
    DeprecationWarning that spells the call with keywords) the options that were positional before."""
    named = POSITIONAL_KEYS + DEPRECATED_POSITIONAL_KEYS
    if len(args) > len(named):
        raise TypeError(
            f"{route} takes one positional option (min_bytes), got {len(args)}; pass the others by "
            f"keyword: {', '.join(OFFLOAD_KEYS[1:])}"
        )
    given = dict(zip(named, args))
    if len(args) > len(POSITIONAL_KEYS):
        spelled = ", ".join(f"{k}={v!r}" for k, v in given.items())
        warn_at_user_line(
            f"{route}: the options after min_bytes by position are deprecated and go in 0.3.0; pass them by "
            f"keyword: {route.removesuffix('()')}({spelled})",
            key=f"{route}-positional",
            category=DeprecationWarning,
        )
    return given


def _unknown_message(route: str, unknown) -> str:
    hints = [
        f"{k!r} (did you mean {closest(k, OFFLOAD_KEYS)!r}?)" if closest(k, OFFLOAD_KEYS) else repr(k) for k in unknown
    ]
    return f"{route}: unknown co.offload option(s) {', '.join(hints)}; allowed: {list(OFFLOAD_KEYS)}"


def _init_naming_unknown_options(init):
    # The dataclass's own __init__ answers a typo with Python's bare "unexpected keyword argument".
    # The warnings are given here, not in __post_init__: under the generated __init__ (whose file
    # is "<string>") they would point there instead of at the user's line.
    def __init__(self, *args, **kwargs):
        unknown = sorted(set(kwargs) - set(OFFLOAD_KEYS))
        if unknown:
            raise TypeError(_unknown_message("co.OffloadOptions", unknown))
        if args:
            given = _positional("co.OffloadOptions()", args)
            twice = [k for k in given if k in kwargs]
            if twice:
                raise TypeError(f"co.OffloadOptions() got {twice[0]} both by position and by keyword")
            kwargs = {**given, **kwargs}
        init(self, **kwargs)
        _warn_if_without_effect(self)

    __init__.__wrapped__ = init  # inspect.signature shows the fields
    __init__.__doc__, __init__.__qualname__ = init.__doc__, init.__qualname__
    return __init__


OffloadOptions.__init__ = _init_naming_unknown_options(OffloadOptions.__init__)


@functools.cache
def _default_options() -> "OffloadOptions":
    """``as_options(True)``: the defaults, one frozen instance (Note [Fixed cost per call])."""
    return OffloadOptions()


def pool_free_key(options: "OffloadOptions") -> "OffloadOptions":
    """``options`` without their pool (what the checkpoint routes' shared contexts are keyed by),
    made once per options object (Note [Fixed cost per call])."""
    if options.pool is None:
        return options
    key = options.__dict__.get("_pool_free_key")
    if key is None:
        fields = cache.fields_of(options)
        fields["pool"] = None
        key = cache.made_of(OffloadOptions, fields)
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


def _remember(key, made: "OffloadOptions") -> None:
    """Caches ``made`` (without its pool) for ``key``, unless it warns (then it warns at every call site)."""
    if not _without_effect(made):
        cache.remember(key, pool_free_key(made))


def from_arguments(route: str, args: tuple, kwargs: dict) -> OffloadOptions:
    """The options of a call such as ``co.offload(0, devices=["cpu"])``: ``min_bytes`` by position
    (the seven options after it too, deprecated: :func:`_positional`), the rest by keyword, or one
    :class:`OffloadOptions`."""
    if len(args) == 1 and isinstance(args[0], OffloadOptions):
        if kwargs:
            return args[0].replace(**kwargs)
        return args[0]
    # A call with deprecated positional options is never cached: each call site hears about them.
    key = call_key(POSITIONAL_KEYS, args, kwargs) if len(args) <= len(POSITIONAL_KEYS) else None
    made = made_before(key, kwargs.get("pool"), HostPool)
    if made is not None:
        return made
    unknown = sorted(set(kwargs) - set(OFFLOAD_KEYS))
    if unknown:
        raise TypeError(_unknown_message(route, unknown))
    given = _positional(route, args)
    twice = [k for k in given if k in kwargs]
    if twice:
        raise TypeError(f"{route} got {twice[0]} both by position and by keyword")
    made = OffloadOptions(**given, **kwargs)
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
        key = call_key(POSITIONAL_KEYS, (), offload, in_any_order=True)
        made = made_before(key, offload.get("pool"), HostPool)
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


# --- the options' descriptions: the string under each field (ckpt_offload/_option_docs.py) -------------


@functools.cache
def option_docs() -> dict:
    """``{option: description}`` in field order: the string under each field of
    :class:`OffloadOptions`, as one line (empty where the source cannot be read)."""
    return field_docs(__file__, "OffloadOptions", OFFLOAD_KEYS)


if OffloadOptions.__doc__ and option_docs():  # None under python -OO
    OffloadOptions.__doc__ += "\n    Fields:\n" + args_section(option_docs()) + "\n"
