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
import threading

import torch

try:
    from torch._C._dynamo import eval_frame as _eval_frame

    _get_callback = _eval_frame.get_eval_frame_callback
    _set_callback = _eval_frame.set_eval_frame
    _SKIP_FRAME_ONLY = _eval_frame._FrameExecStrategy(_eval_frame._FrameAction.SKIP, _eval_frame._FrameAction.DEFAULT)
    _SKIP_ALL = _eval_frame._FrameExecStrategy(_eval_frame._FrameAction.SKIP, _eval_frame._FrameAction.SKIP)
except (ImportError, AttributeError, TypeError):  # pragma: no cover - a torch without these
    _eval_frame = _get_callback = _set_callback = _SKIP_FRAME_ONLY = _SKIP_ALL = None

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
        # A block's own region, compiled inside its own context: Note [Compiled regions inside co.offload].
        _local.blocks = getattr(_local, "blocks", 0) + 1
        prior = _set_callback(self.callback)
        try:
            return self.fn(*args, **kwargs)
        finally:
            _set_callback(prior)
            _local.blocks -= 1


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


# Note [Compiled regions inside co.offload]
# AOTAutograd hands a compiled region's saved tensors to the active saved-tensor hooks all at once,
# when the region's forward ends: inside co.offload() they are offloaded then, so every activation
# of the region is on the device together at that point. A region that is one block costs one
# block; a whole model compiled inside co.offload() keeps no saving at all, silently. So when
# Dynamo starts compiling while a co.offload context's hooks are the innermost ones (and not a
# block's own forward that a wrapper compiles inside its context, see CompiledCall), it warns once,
# naming the routes that compile block by block.
REGION_MESSAGE = (
    "torch.compile is compiling code inside co.offload(): a compiled region hands the tensors it saves "
    "for backward to the offload hooks only when its forward ends, so all of the region's activations are "
    "on the device together at that point -- around a whole model, the forward's device peak is what it "
    "is without offload (gradients are unchanged). To keep the saving, wrap the blocks and compile the "
    "model after: co.apply(model, offload=...) or a plan (co.plan(...).apply()); torch.compile(model) then "
    "compiles each block as a region of its own, inside its own offload context. (Warned once.)"
)
_region_check = {"warned": False}
_local = threading.local()


def check_compiled_regions() -> None:
    """Called as a co.offload context is entered: once ``torch._dynamo`` is imported (someone
    called torch.compile), registers the compile-start check of Note [Compiled regions inside
    co.offload] (again after ``torch._dynamo.reset()``, which drops it). A dictionary look-up
    otherwise."""
    dynamo = sys.modules.get("torch._dynamo")
    handler = getattr(dynamo, "callback_handler", None) if dynamo is not None else None
    if handler is None or _region_check["warned"] or _on_compile_start in handler.start_callbacks:
        return
    handler.register_start_callback(_on_compile_start)


def _on_compile_start(args=None) -> None:
    # Dynamo runs its start callbacks with its lock held, and sometimes with a compile callback on
    # (AOTAutograd's lazy backward compile under compiled autograd): were this frame compiled, the
    # nested compile would wait for that lock forever. Dynamo skips it and all it calls (below).
    if _region_check["warned"] or getattr(_local, "blocks", 0):
        return
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    hooks = top(False) if top is not None else None
    # The innermost hooks are a co.offload context's: its pack hook is the extension's function.
    if not hooks or not (getattr(hooks[0], "__doc__", None) or "").startswith("co.offload's pack hook"):
        return
    _region_check["warned"] = True
    from ckpt_offload._warn import warn_at_user_line

    warn_at_user_line(REGION_MESSAGE, key=None)


if _SKIP_ALL is not None:
    _eval_frame.set_code_exec_strategy(_on_compile_start.__code__, _SKIP_ALL)


WHOLE_FORWARD_MESSAGE = (
    "co.hf.OffloadCallback under torch.compile: the model's whole forward runs inside one offload context, "
    "and compiled as one region it hands its saved tensors to the offload hooks only when the forward "
    "ends, so the forward's device peak is what it is without offload (gradients are unchanged). To keep "
    "the saving under torch.compile, checkpoint or offload block by block: co.hf.OffloadCheckpointCallback, "
    "co.apply(model, offload=...) or a plan. (Warned once.)"
)
_warned_whole_forward = False


def warn_whole_forward() -> None:
    """Warns once that a whole forward compiled inside one offload context keeps no saving."""
    global _warned_whole_forward
    if _warned_whole_forward:
        return
    _warned_whole_forward = True
    from ckpt_offload._warn import warn_at_user_line

    warn_at_user_line(WHOLE_FORWARD_MESSAGE, key=None)
