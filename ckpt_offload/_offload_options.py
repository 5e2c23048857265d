"""Options, constants and warning helpers of ``co.offload()`` (private; re-exported by
:mod:`ckpt_offload.offload`, where every name here is importable as before)."""

from __future__ import annotations

import logging
import os
import sys
import threading
import warnings

import torch

from ckpt_offload import _C
from ckpt_offload._args import check_bytes, check_choice, device_types
from ckpt_offload.pool import HostPool

#: Tensors whose bytes are fewer than this stay on the device by default. Small saved tensors
#: (layer-norm statistics, biases' inputs of tiny layers) free little memory and each costs a
#: copy launch plus an event; see README "Choosing min_bytes" for how this was chosen.
DEFAULT_MIN_BYTES = 256 * 1024
#: The most bytes of prefetched (reloaded ahead of need, not yet used) tensors the default,
#: automatic window may hold on the device: by default the window is about one block of the
#: model (see ``prefetch_bytes`` in :class:`~ckpt_offload.offload.offload`), and never more than this.
DEFAULT_PREFETCH_BYTES = 256 * 1024 * 1024
#: Size of the blocks that batched small tensors are gathered into (``batch_below``).
DEFAULT_BATCH_BYTES = 4 * 1024 * 1024
STREAM_MODES = ("side", "compute")
#: The narrower formats ``store_dtype`` accepts (besides None: exact storage).
STORE_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)
ON_FULL_POLICIES = ("keep", "raise")

_warn_lock = threading.Lock()
_warned_sites: set = set()  # (route, filename, lineno) warned that they offload nothing
_quiet = threading.local()  # .on: contexts built by a route that checked its options itself

#: The library's logger: what ckpt_offload decided (windows, blocks chosen, stats) at INFO/DEBUG.
logger = logging.getLogger("ckpt_offload")

# Frames in these folders are not "the user's line": a warning about what the user asked for
# points past them (nn.Module's __call__, Trainer's loop, our own wrappers).
_LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep
    for m in (sys.modules["ckpt_offload"], torch, sys.modules["contextlib"])
    if getattr(m, "__file__", None)
)


def _user_frame():
    """The innermost frame outside ckpt_offload, torch, transformers, accelerate and contextlib."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name.startswith(_LIBRARY_DIRS) or "/transformers/" in name or "/accelerate/" in name
                or name.startswith("<frozen")):
            return frame
        frame = frame.f_back
    return None


def mirror_to_logger(message: str) -> None:
    """Repeats a warning on the ``ckpt_offload`` logger, but only where logging is set up: without
    a handler, logging's last-resort handler would print the message a second time next to the
    warning itself; under ``logging.captureWarnings(True)`` the warning already is a log record."""
    if getattr(logging, "_warnings_showwarning", None) is not None:
        return  # captureWarnings(True): warnings go to the 'py.warnings' logger already
    if logger.hasHandlers() and logger.isEnabledFor(logging.WARNING):
        logger.warning(message)


def warn(message: str, category=UserWarning, stacklevel: int = 1) -> None:
    """``warnings.warn`` (one channel), mirrored to the logger where logging is configured."""
    warnings.warn(message, category, stacklevel=stacklevel + 1)
    mirror_to_logger(message)


def warn_at_user_line(message: str, key: str | None, category=UserWarning) -> None:
    """Warns with ``message`` at the user's own line (the innermost frame outside the libraries
    on the way), once per ``key`` and call site; ``key=None``: every time (the caller keeps its
    own once-only state, e.g. per context -- an ``id()`` in a key could be reused by a new object).
    The warning is mirrored to the ``ckpt_offload`` logger (see :func:`mirror_to_logger`)."""
    frame = _user_frame()
    if frame is None:
        warn(message, category, stacklevel=2)
        return
    if key is not None:
        site = (key, frame.f_code.co_filename, frame.f_lineno)
        with _warn_lock:
            if site in _warned_sites:
                return
            _warned_sites.add(site)
    warnings.warn_explicit(message, category, frame.f_code.co_filename, frame.f_lineno,
                           module=frame.f_globals.get("__name__"),
                           registry=frame.f_globals.setdefault("__warningregistry__", {}))
    mirror_to_logger(message)


def _usable_types() -> set:
    """Device types with tensors to offload here: ``cpu`` always, ``cuda`` with a usable GPU
    and a CUDA build."""
    return {"cpu", "cuda"} if (_C.cuda_compiled() and torch.cuda.is_available()) else {"cpu"}


def check_offloads_something(devices, route: str) -> None:
    """Warns at the user's line (once per call site) when ``devices`` (a co.offload ``devices``
    argument; None: the default) selects no device that has tensors here. ``route`` names the
    API the user called, e.g. ``"co.apply(offload=...)"``."""
    if devices is None:
        types = ["cuda"] if "cuda" in _usable_types() else []
    else:
        try:
            types = device_types("devices", devices)
        except (TypeError, ValueError):
            return  # the context raises its own clear error
    if any(t in _usable_types() for t in types):
        return
    asked = "devices=None (the default: the GPU)" if devices is None else f"devices={list(types)}"
    warn_at_user_line(
        f"{route}: {asked} selects no device with tensors here (no usable CUDA GPU: "
        f"torch.cuda.is_available()={torch.cuda.is_available()}, ckpt_offload cuda_compiled={_C.cuda_compiled()}), "
        "so nothing is offloaded: every saved tensor stays where it is (kept_by_reason['device']). "
        "To offload CPU tensors into the host pool pass devices=['cpu'] "
        "(co.offload(devices=['cpu']), or offload={'devices': ['cpu']}).",
        key=route,
    )


FULLGRAPH_MESSAGE = (
    "ckpt_offload inside a torch.compile(fullgraph=True) graph: its offload contexts and checkpoints "
    "are C++ objects that Dynamo cannot trace into a graph. What works: torch.compile without "
    "fullgraph (the default; Dynamo breaks the graph around ckpt_offload, which runs eagerly, with "
    "gradients unchanged), or compile inside each block -- block.forward = torch.compile(block.forward, "
    "fullgraph=True) for each block, then co.apply(model, offload=True), or the compiled code inside "
    "`with co.offload():` (docs/scale_out.md, 'torch.compile')."
)


def graph_break_if_compiling() -> None:
    """Where Dynamo traces ckpt_offload's Python code, break the graph here with a message that
    says what works: under fullgraph=True that message is the error, instead of Dynamo's about
    the pybind11 function it would reach next; without fullgraph the graph breaks as it would
    anyway, and ckpt_offload runs eagerly. Eager callers pay one ``is_compiling()`` call."""
    if torch.compiler.is_compiling():
        graph_break = getattr(getattr(torch, "_dynamo", None), "graph_break", None)
        if graph_break is not None:
            graph_break(msg=FULLGRAPH_MESSAGE)


def hooks_disabled_reason() -> str | None:
    """torch's message when saved-tensor hooks cannot be entered on this thread (inside
    ``torch.func.grad``, ``vjp``, ``jacrev``, ``hessian``, or
    ``torch.autograd.graph.disable_saved_tensors_hooks``), else None."""
    autograd = torch._C._autograd
    is_enabled = getattr(autograd, "_saved_tensors_hooks_is_enabled", None)
    if is_enabled is None or is_enabled():
        return None
    get_message = getattr(autograd, "_saved_tensors_hooks_get_disabled_error_message", None)
    message = get_message() if get_message is not None else None
    return message or "saved tensor hooks are disabled"


#: The byte-valued options of co.offload and how each is bounded: each takes an int or a size
#: string such as ``"512KiB"`` (ckpt_offload._args.parse_bytes).
BYTE_OPTIONS = {"min_bytes": {}, "prefetch_bytes": {"allow_none": True}, "batch_below": {},
                "batch_bytes": {"minimum": 1}, "store_min_bytes": {}}


def option_bytes(name: str, value):
    """The byte-valued co.offload option ``name`` as an int (None for a default prefetch window);
    a size string is read as bytes. Raises naming the option."""
    return check_bytes(name, value, **BYTE_OPTIONS[name])


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


def check_options(
    min_bytes: int = DEFAULT_MIN_BYTES,
    stream: str = "side",
    devices=None,
    pool: HostPool | None = None,
    on_full: str = "keep",
    prefetch_bytes: int | None = None,
    batch_below: int = 0,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
    store_dtype: torch.dtype | None = None,
    store_min_bytes: int = 0,
    measure_error: bool = False,
) -> list[str] | None:
    """Checks :class:`~ckpt_offload.offload.offload`'s arguments (each error names the argument and what it accepts)
    and returns ``devices`` as a list of device types, or None when it was not given.

    :class:`~ckpt_offload.offload.offload` calls it, and so does every ``offload={...}`` option dict when it is passed
    (``co.checkpoint``, ``co.apply``, ``co.hf``), so a bad option fails there and not at the
    first forward.

    Example::

        check_options(devices={"cpu"}, min_bytes=0)   # -> ["cpu"]
        check_options(min_bytes="64KiB")              # sizes may be strings; -> None
        check_options(stream="gpu")                   # ValueError: stream must be one of ('side', 'compute')
    """
    check_not_devices("min_bytes", min_bytes)
    min_bytes = option_bytes("min_bytes", min_bytes)
    check_choice("stream", stream, STREAM_MODES)
    check_choice("on_full", on_full, ON_FULL_POLICIES)
    option_bytes("prefetch_bytes", prefetch_bytes)  # None: the window follows the model (Note [Prefetch window])
    batch_below = option_bytes("batch_below", batch_below)
    batch_bytes = option_bytes("batch_bytes", batch_bytes)
    if batch_below > batch_bytes:
        raise ValueError(
            f"batch_below ({batch_below}) must not exceed batch_bytes ({batch_bytes}): a batched tensor "
            "has to fit in a batch block; raise batch_bytes or lower batch_below"
        )
    check_store_dtype(store_dtype)
    option_bytes("store_min_bytes", store_min_bytes)
    if not isinstance(measure_error, bool):
        raise TypeError(f"measure_error must be True or False, got {type(measure_error).__name__}")
    if pool is not None and not isinstance(pool, HostPool):
        raise TypeError(f"pool must be a ckpt_offload.HostPool or None, got {type(pool).__name__}")
    if devices is None:
        return None
    types = device_types("devices", devices)
    if "cuda" in types and not _C.cuda_compiled():
        raise ValueError(
            "devices includes 'cuda' but this ckpt_offload build has no CUDA "
            "(co.build_info()['cuda_compiled'] is False). Reinstall with a CUDA build of torch and nvcc "
            "(CKPT_OFFLOAD_CUDA=1 pip install --no-build-isolation .), or pass devices=['cpu']."
        )
    return types


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
        raise TypeError(f"store_dtype must be None or a torch.dtype ({accepted}), got {type(store_dtype).__name__}")
    if store_dtype not in STORE_DTYPES:
        raise ValueError(f"store_dtype must be None or one of {accepted}; got {store_dtype}")
    return str(store_dtype).removeprefix("torch.")
