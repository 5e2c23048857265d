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
  recompute of a checkpoint in backward runs the same compiled graph again. The frame Dynamo
  starts on there is one of ours, not the forward's own (Note [A compiled region of its own]).

Nothing here imports ``torch._dynamo`` (seconds of start-up): the frame-only skip and the
callback are functions of torch's C extension, loaded with torch itself.
"""

from __future__ import annotations

import sys
import threading
import types
import weakref

import torch

from ckpt_offload._warn import FULLGRAPH_MESSAGE

try:
    from torch._C._dynamo import eval_frame as _eval_frame

    _get_callback = _eval_frame.get_eval_frame_callback
    _set_callback = _eval_frame.set_eval_frame
    _SKIP_FRAME_ONLY = _eval_frame._FrameExecStrategy(_eval_frame._FrameAction.SKIP, _eval_frame._FrameAction.DEFAULT)
    _SKIP_ALL = _eval_frame._FrameExecStrategy(_eval_frame._FrameAction.SKIP, _eval_frame._FrameAction.SKIP)
except (ImportError, AttributeError, TypeError):  # pragma: no cover - a torch without these
    _eval_frame = _get_callback = _set_callback = _SKIP_FRAME_ONLY = _SKIP_ALL = None

__all__ = [
    "AVAILABLE",
    "CompiledCall",
    "compile_callback",
    "compiled_forward",
    "fullgraph_tracing",
    "skip_frame_only",
    "skipped_by_dynamo",
    "watch_for_dynamo",
]

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


def skip_frame_only(fn):
    """Decorator: when ``fn`` runs under compiled code, its own frame is not compiled (the
    functions it calls may be); Dynamo still inlines ``fn`` where it traces a call of it (Note
    [Wrappers under fullgraph=True])."""
    if AVAILABLE:
        _eval_frame.set_code_exec_strategy(fn.__code__, _SKIP_FRAME_ONLY)
    return fn


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
        region = region_for(self.fn)
        prior = _set_callback(self.callback)
        try:
            return region(self.fn, args, kwargs)
        finally:
            _set_callback(prior)
            _local.blocks -= 1


# Note [A compiled region of its own]
# With the torch.compile callback on, Dynamo compiles the first frame that runs, unless its file
# is one Dynamo never starts on: torch's own, torch/nn/modules/* included (it inlines them when
# it traces a caller, but skips them as the first frame). Started on the block's forward itself,
# a block whose forward is torch's -- an nn.Sequential of layers, nn.TransformerEncoderLayer --
# had every frame skipped (its forward, then each layer's), and compiled nothing, silently. So
# CompiledCall starts Dynamo on a function of this file, which calls the forward: Dynamo compiles
# that frame and inlines the forward into its graph, whatever file it is in. Dynamo keeps its
# compiled graphs per code object, so each block class (and forward function) gets a copy of
# its own of that function, with its own code object: blocks of one class share one entry, and
# many block classes do not crowd one code object past Dynamo's recompile limit.


def _region(fn, args, kwargs):
    return fn(*args, **kwargs)


# Block class (None: a forward that is not a bound method) -> forward's code -> its region. Weak
# in the class: a class defined and dropped (a test's) takes its regions with it.
_regions: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_unbound_regions: dict = {}
_regions_lock = threading.Lock()


def region_for(fn):
    """The function :class:`CompiledCall` runs ``fn`` through: one of its own per block class and
    forward (Note [A compiled region of its own]). Called as ``region(fn, args, kwargs)``."""
    owner = getattr(fn, "__self__", None)
    func = getattr(fn, "__func__", fn)
    code = getattr(func, "__code__", None)
    key = code if code is not None else type(func)
    with _regions_lock:
        table = _unbound_regions if owner is None else _regions.setdefault(type(owner), {})
        region = table.get(key)
        if region is None:
            name = getattr(func, "__qualname__", type(func).__qualname__)
            if owner is not None:
                name = f"{type(owner).__qualname__}.{name.rpartition('.')[2]}"
            label = f"ckpt_offload_region_of_{name}"
            code = _region.__code__.replace(co_name=label, co_qualname=label)
            region = table[key] = types.FunctionType(code, _region.__globals__, label)
    return region


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


# Note [Wrappers under fullgraph=True]
# With torch.compile(model, fullgraph=True) a graph break is an error, so a wrapper that Dynamo
# skips (Note [Wrappers under torch.compile]) cannot be used. The wrapper therefore asks, while
# Dynamo traces it, whether this trace allows no graph break (fullgraph=True, or
# torch._dynamo.error_on_graph_break(True)): :func:`fullgraph_tracing`, which Dynamo calls while
# tracing and folds into a constant (it is registered as an in-graph function whose result is a
# constant, once ``torch._dynamo`` is imported; see :func:`watch_for_dynamo`). Then the wrapper is
# traced into the graph (ckpt_offload/_compile_ops.py offloads inside it) where its run supports
# it; otherwise, and always without fullgraph, it is the graph break of the Note above.
# Registering needs two dictionaries of Dynamo's; where this torch lacks them the probe is left
# as a skipped function: fullgraph=True then raises FULLGRAPH_MESSAGE as before (never a silent
# eager run), and nothing else changes.


def fullgraph_tracing() -> bool:
    """True while Dynamo traces a frame that allows no graph break. Only meaningful under
    Dynamo (Note [Wrappers under fullgraph=True]); called eagerly, False."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
    except Exception:  # noqa: BLE001 - not tracing
        return False
    if tx is None:
        return False
    return bool(getattr(tx, "one_graph", False) or getattr(tx, "error_on_graph_break", False))


def _register_probe(dynamo) -> bool:
    """Makes Dynamo fold :func:`fullgraph_tracing` into a constant while tracing; True when done."""
    if getattr(fullgraph_tracing, "_ckpt_offload_registered", False):
        return True
    try:
        from torch._dynamo.variables import torch as dynamo_torch

        folds = dynamo_torch.constant_fold_functions
        if not isinstance(folds, dict):
            return False
        dynamo.allow_in_graph(fullgraph_tracing)
        folds[fullgraph_tracing] = None
        del fullgraph_tracing._torchdynamo_disable
    except Exception:  # noqa: BLE001 - another torch: the probe stays a skipped function
        return False
    fullgraph_tracing._ckpt_offload_registered = True
    return True


# Until registered, Dynamo skips the probe like the wrappers (fullgraph=True: FULLGRAPH_MESSAGE).
fullgraph_tracing._torchdynamo_disable = True
fullgraph_tracing._torchdynamo_disable_msg = FULLGRAPH_MESSAGE


class _DynamoLoader:
    """Loads ``torch._dynamo`` with its own loader, then registers the probe."""

    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        _register_probe(module)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _DynamoFinder:
    """A ``sys.meta_path`` entry that waits for ``torch._dynamo``'s import (torch.compile imports
    it on first use) and wraps its loader, then removes itself."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch._dynamo":
            return None
        _remove_finder()
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _DynamoLoader(spec.loader)
        return spec


_finder_lock = threading.Lock()
_finder: _DynamoFinder | None = None


def _remove_finder() -> None:
    global _finder
    with _finder_lock:
        if _finder is not None:
            try:
                sys.meta_path.remove(_finder)
            except ValueError:
                pass
            _finder = None


def watch_for_dynamo() -> None:
    """Registers :func:`fullgraph_tracing` with Dynamo now when ``torch._dynamo`` is imported, or
    as soon as it is (without importing it: seconds of start-up). Called when a wrapper is installed."""
    global _finder
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None and hasattr(dynamo, "allow_in_graph"):
        _register_probe(dynamo)
        return
    with _finder_lock:
        if _finder is None and "torch._dynamo" not in sys.modules:
            _finder = _DynamoFinder()
            sys.meta_path.insert(0, _finder)
