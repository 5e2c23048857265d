"""ckpt_offload's wrappers under ``torch.compile`` of a whole model.

Note [Wrappers under torch.compile]
A block that ``co.apply``, a plan, ``co.hf.enable`` or a Trainer callback wrapped runs its
forward inside an offload context and/or torch's checkpoint: C++ objects and hooks that Dynamo
cannot put in a graph. Left to itself, Dynamo traced into the wrapper, met them, and ran the
whole block eagerly -- the user asked for compiled code and silently got none. So each wrapper's
``__call__`` is one that Dynamo skips without recursing:

- while tracing the model, a call of the wrapper is a graph break (the graph before the block
  and the one after it are compiled as usual), because the function carries Dynamo's
  ``_torchdynamo_disable`` mark, with :data:`~ckpt_offload._warn.FULLGRAPH_MESSAGE` as its reason
  (what ``fullgraph=True`` reports);
- when the compiled code then calls the wrapper, its frame is skipped (the frame-only skip of
  ``torch.compiler.disable(recursive=False)``, set on its code object); the wrapper reads the
  ``torch.compile`` callback that is active, turns it off for its own work (contexts, torch's
  checkpoint) and turns it back on around the block's own forward only (:class:`CompiledCall`):
  Dynamo compiles that forward as a graph of its own, once for blocks of one class, and the
  recompute of a checkpoint in backward runs the same compiled graph again.

Nothing here imports ``torch._dynamo`` (seconds of start-up): the frame-only skip and the
callback are functions of torch's C extension, loaded with torch itself.
"""

from __future__ import annotations

import sys

try:
    from torch._C._dynamo import eval_frame as _eval_frame

    _get_callback = _eval_frame.get_eval_frame_callback
    _set_callback = _eval_frame.set_eval_frame
    _SKIP_FRAME_ONLY = _eval_frame._FrameExecStrategy(_eval_frame._FrameAction.SKIP, _eval_frame._FrameAction.DEFAULT)
except (ImportError, AttributeError, TypeError):  # pragma: no cover - a torch without these
    _eval_frame = _get_callback = _set_callback = _SKIP_FRAME_ONLY = None

__all__ = ["AVAILABLE", "CompiledCall", "compile_callback", "compiled_forward", "skipped_by_dynamo"]

#: Whether this torch lets a wrapper be skipped by Dynamo while the block inside it is compiled.
AVAILABLE = _SKIP_FRAME_ONLY is not None


def skipped_by_dynamo(reason: str):
    """Decorator: Dynamo never traces the decorated function (a call of it while tracing is a
    graph break whose reason is ``reason``; its frame is skipped when it runs), but may compile
    the functions it calls (Note [Wrappers under torch.compile])."""

    def mark(fn):
        if not AVAILABLE:
            return fn
        _eval_frame.set_code_exec_strategy(fn.__code__, _SKIP_FRAME_ONLY)
        fn._torchdynamo_disable = True
        fn._torchdynamo_disable_msg = reason
        fn._torchdynamo_disable_recursive = False
        return fn

    return mark


def compile_callback():
    """The ``torch.compile`` callback active on this thread (compiled code is calling us), or
    None (eager). ``False`` is Dynamo's run-only mode (cached graphs, no new compiles)."""
    if _get_callback is None:
        return None
    return _get_callback()


class CompiledCall:
    """``fn`` called with the ``torch.compile`` callback ``callback`` on: Dynamo compiles (or
    finds in its cache) ``fn``'s frame as a graph of its own; everything around it stays eager.
    Picklable as long as ``fn`` is; holds no state of its own."""

    __slots__ = ("callback", "fn")

    def __init__(self, callback, fn):
        self.callback = callback
        self.fn = fn

    def __call__(self, *args, **kwargs):
        prior = _set_callback(self.callback)
        try:
            return self.fn(*args, **kwargs)
        finally:
            _set_callback(prior)


def compiled_forward(forward, callback):
    """``forward``, compiled by ``callback`` when there is one (see :func:`compile_callback`)."""
    if callback is None:
        return forward
    warn_if_compiled_autograd()
    return CompiledCall(callback, forward)


class eager:
    """Context manager: the ``torch.compile`` callback off (our own code runs eagerly inside it,
    as Dynamo would not trace it anyway), back on at exit. Yields the callback that was on."""

    __slots__ = ("prior",)

    def __enter__(self):
        self.prior = _set_callback(None) if _set_callback is not None else None
        return self.prior

    def __exit__(self, *exc):
        if _set_callback is not None:
            _set_callback(self.prior)


COMPILED_AUTOGRAD_MESSAGE = (
    "ckpt_offload under compiled autograd (torch._dynamo.config.compiled_autograd=True): backward still "
    "reloads the offloaded tensors one by one as it needs them, but compiled autograd's graph, which breaks "
    "at ckpt_offload's unpack hook, keeps every unpacked tensor and its pool block alive until the whole "
    "backward ends, so backward's device peak is what it is without offload (gradients are unchanged). "
    "Keep compiled autograd off (the default) for offloaded models: torch.compile(model) still compiles "
    "each block's forward and its recompute, and backward frees each block's reloaded tensors as it moves "
    "on. (Warned once.)"
)
_warned_compiled_autograd = False


def warn_if_compiled_autograd() -> None:
    """Warns once when compiled autograd is on (only called under torch.compile, where
    ``torch._dynamo`` is imported already)."""
    global _warned_compiled_autograd
    if _warned_compiled_autograd:
        return
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None or not getattr(dynamo.config, "compiled_autograd", False):
        return
    _warned_compiled_autograd = True
    from ckpt_offload._warn import warn_at_user_line

    warn_at_user_line(COMPILED_AUTOGRAD_MESSAGE, key=None)
