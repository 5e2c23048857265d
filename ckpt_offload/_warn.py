"""How ckpt_offload tells the user something: warnings at the user's own line (once per call site),
mirrored to the ``ckpt_offload`` logger where logging is set up, and the messages of the two places
where torch itself stops us (``torch.compile(fullgraph=True)``, saved-tensor hooks disabled)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import warnings

import torch

_warn_lock = threading.Lock()
_warned_sites: set = set()  # (route, filename, lineno) warned that they offload nothing
# Callers that are themselves the user's line of a warned site, as (key, id(code), f_lasti) ->
# the code object (held, so that its id is not reused): asked again (a fresh context per step
# exits at the same place every step), they need no frame walk. Neither key part costs a hash
# of the code object or a line-table look-up.
_warned_callers: dict = {}

#: The library's logger: what ckpt_offload decided (windows, blocks chosen, stats) at INFO/DEBUG.
logger = logging.getLogger("ckpt_offload")

# Frames in these folders are not "the user's line": a warning about what the user asked for
# points past them (nn.Module's __call__, Trainer's loop, our own wrappers).
_LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(path)) + os.sep
    for path in (__file__, torch.__file__, contextlib.__file__)  # ckpt_offload/, torch/, the stdlib's
)


def _user_frame():
    """The innermost frame outside ckpt_offload, torch, transformers, accelerate and contextlib."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not (
            name.startswith(_LIBRARY_DIRS)
            or "/transformers/" in name
            or "/accelerate/" in name
            or name.startswith("<frozen")
        ):
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


def warn_at_user_line(message, key: str | None, category=UserWarning, caller=None) -> None:
    """Warns with ``message`` at the user's own line (the innermost frame outside the libraries
    on the way), once per ``key`` and call site; ``key=None``: every time (the caller keeps its
    own once-only state, e.g. per context -- an ``id()`` in a key could be reused by a new object).
    The warning is mirrored to the ``ckpt_offload`` logger (see :func:`mirror_to_logger`).
    ``message`` may be a function of no arguments returning it, called only when it is shown.
    ``caller`` (optional, with a key): the frame that called into the library; when it is the
    user's line itself, a site that has warned is recognised from it without walking the stack."""
    if caller is not None and key is not None and (key, id(caller.f_code), caller.f_lasti) in _warned_callers:
        return
    frame = _user_frame()
    if frame is None:
        warn(message() if callable(message) else message, category, stacklevel=2)
        return
    if key is not None:
        site = (key, frame.f_code.co_filename, frame.f_lineno)
        with _warn_lock:
            if frame is caller:
                _warned_callers[(key, id(frame.f_code), frame.f_lasti)] = frame.f_code
            if site in _warned_sites:
                return
            _warned_sites.add(site)
    if callable(message):
        message = message()
    warnings.warn_explicit(
        message,
        category,
        frame.f_code.co_filename,
        frame.f_lineno,
        module=frame.f_globals.get("__name__"),
        registry=frame.f_globals.setdefault("__warningregistry__", {}),
    )
    mirror_to_logger(message)


FULLGRAPH_MESSAGE = (
    "ckpt_offload inside a torch.compile(fullgraph=True) graph: this route's offload contexts and "
    "checkpoints are C++ objects and hooks that Dynamo cannot put in one graph. What compiles with "
    "fullgraph=True: blocks checkpointed one by one with their inputs offloaded or kept -- co.apply(model, "
    "offload=...) without segments or selective checkpoint keywords, co.hf.enable(model, offload=...), or a "
    "plan whose kinds are only 'keep', "
    "'recompute' and 'recompute_offload' (segments=False) -- traced into the graph, the offload and reload "
    "as ops in it. Otherwise: torch.compile without fullgraph (the default): the graph breaks at each block "
    "co.apply, a plan or co.hf wrapped, and each block's own forward is compiled as a graph of its own, run "
    "inside its offload context or checkpoint (its recompute runs the compiled graph again); or compile "
    "inside each block -- block.forward = torch.compile(block.forward, fullgraph=True) for each block, then "
    "co.apply(model, offload=True), or the compiled code inside `with co.offload():` (docs/scale_out.md, "
    "'torch.compile')."
)


def graph_break_if_compiling(message: str = FULLGRAPH_MESSAGE) -> None:
    """Where Dynamo traces ckpt_offload's Python code, break the graph here with a message that
    says what works (``message``): under fullgraph=True that message is the error, instead of
    Dynamo's about the pybind11 function it would reach next; without fullgraph the graph breaks
    as it would anyway, and ckpt_offload runs eagerly. Eager callers pay one ``is_compiling()`` call."""
    if torch.compiler.is_compiling():
        graph_break = getattr(getattr(torch, "_dynamo", None), "graph_break", None)
        if graph_break is not None:
            graph_break(msg=message)


# Looked up once: every co.offload entry asks.
_hooks_enabled = getattr(torch._C._autograd, "_saved_tensors_hooks_is_enabled", None)


def hooks_disabled_reason() -> str | None:
    """torch's message when saved-tensor hooks cannot be entered on this thread (inside
    ``torch.func.grad``, ``vjp``, ``jacrev``, ``hessian``, or
    ``torch.autograd.graph.disable_saved_tensors_hooks``), else None."""
    if _hooks_enabled is None or _hooks_enabled():
        return None
    autograd = torch._C._autograd
    get_message = getattr(autograd, "_saved_tensors_hooks_get_disabled_error_message", None)
    message = get_message() if get_message is not None else None
    return message or "saved tensor hooks are disabled"


def deprecated_names(module: str, aliases: dict, stacklevel: int = 2):
    """The ``__getattr__`` of a module that keeps old names for one release: ``aliases`` maps each
    old name to ``(message, get)``; reading the name warns ``DeprecationWarning`` with ``message``
    at the reader's line and returns ``get()``. Any other name raises ``AttributeError``.
    ``stacklevel``: 2 when the result is the module's ``__getattr__``, one more per caller in between.

    Example::

        __getattr__ = deprecated_names(__name__, {"Old": ("Old goes in 0.3.0: use New", lambda: New)})
    """

    def __getattr__(name):
        entry = aliases.get(name)
        if entry is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        message, get = entry
        warnings.warn(message, DeprecationWarning, stacklevel=stacklevel)
        return get()

    return __getattr__
