"""Wrapping a model's blocks: which blocks, one forward installer, one handle.

:func:`apply` (``co.apply``) and plans (``Plan.apply``) both install a :class:`BlockForward` in each
block's ``__dict__``: the block's own forward, run the way its :class:`Unit` says -- kept as is,
inside an offload context, checkpointed (its input kept or offloaded), selectively recomputed, or
as part of a segment (one checkpoint around consecutive blocks). The wrapper holds the block as an
attribute, not in a closure: ``copy.deepcopy`` and ``pickle`` of the model carry it with the block,
``nn.DataParallel`` replicas get their own, and :meth:`CheckpointHandle.remove` puts back exactly
the forward the block had. A handle owns its blocks' offload contexts, so ``handle.stats()``
counts its blocks only.

Offloaded blocks and checkpoints with offloaded inputs of one handle share one offload context per
option set, so the engine's prefetcher sees their saved tensors in one pack order and brings back
the next block's while backward works on this one.

A recompute (of a checkpoint or a segment) made for a plan runs inside a ``ckpt_offload::recompute``
profiler range, which is how the planner's measurement tells recomputed activations from
temporaries.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import threading

import torch
import torch.utils.checkpoint
from torch.profiler import record_function
from torch.utils._pytree import tree_flatten

try:  # torch's selective checkpoint (2.4+); without it plans have no "selective"
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
except ImportError:  # pragma: no cover - older torch
    CheckpointPolicy = create_selective_checkpoint_contexts = None

from ckpt_offload._args import check_int
from ckpt_offload._compile import (
    CompiledCall,
    compiled_forward,
    fullgraph_tracing,
    skip_frame_only,
    skipped_by_dynamo,
    warn_whole_forward,
    watch_for_dynamo,
)
from ckpt_offload._compile import eager as eager_code
from ckpt_offload._compile_ops import prepare as prepare_compiled_offload
from ckpt_offload._compile_ops import traced_checkpoint, untraced_reason
from ckpt_offload._stats import StatsCollector
from ckpt_offload._units import Unit, choice_names
from ckpt_offload._warn import FULLGRAPH_MESSAGE, graph_break_if_compiling, logger, warn_at_user_line
from ckpt_offload.checkpointing import (
    TORCH_KEYWORDS,
    check_checkpoint_keywords,
    check_reentrant,
    context_for,
    run_checkpoint,
)
from ckpt_offload.options import OffloadOptions, as_options, check_offloads_something
from ckpt_offload.tile_model import as_tile_options, tile_blocks

__all__ = [
    "SELECTIVE_SAVE_OPS",
    "BlockForward",
    "CheckpointHandle",
    "InContext",
    "active_handle",
    "apply",
    "check_not_applied",
    "install_units",
    "running_stats",
    "select_blocks",
    "selective_policy",
]

# What selective recompute keeps (its outputs are saved, everything else is recomputed): the ops
# whose recompute costs the most per byte they produce (Korthikanti et al. 2022 keep the matmuls and
# recompute attention's cheap pointwise ops).
SELECTIVE_SAVE_OPS = tuple(
    op for op in (
        getattr(torch.ops.aten, name, None)
        for name in ("mm", "addmm", "bmm", "baddbmm", "convolution", "_scaled_dot_product_flash_attention",
                     "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                     "_scaled_dot_product_flash_attention_for_cpu")
    ) if op is not None
)
_SAVE = set(SELECTIVE_SAVE_OPS)


def selective_policy(ctx, op, *args, **kwargs):
    """Torch's selective-checkpoint policy of the planner's "selective": keep the outputs of matmuls,
    convolutions and fused attention, recompute everything else."""
    packet = getattr(op, "overloadpacket", op)
    return CheckpointPolicy.MUST_SAVE if packet in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(selective_policy)


def offload_policy(ctx, op, *args, **kwargs):
    """The planner's "selective_offload": :func:`selective_policy` with the outputs it saves
    offloaded (``CheckpointPolicy.MUST_CPU_OFFLOAD``) instead of kept on the device."""
    packet = getattr(op, "overloadpacket", op)
    return CheckpointPolicy.MUST_CPU_OFFLOAD if packet in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE


_selective_offloads_lock = threading.Lock()
_selective_offloads: dict = {}  # options -> context_fn of the blocks wrapped without a handle


def _selective_offload_context(options, collector):
    """The ``context_fn`` of a "selective_offload" block: one per handle and options (its packer's
    counts are the handle's, in ``handle.stats()``)."""
    from ckpt_offload.selective import selective_offload_context

    table = _selective_offloads if collector is None else collector.__dict__.setdefault("_selective_offloads", {})
    key = (options.replace(pool=None), id(options.pool))
    with _selective_offloads_lock:
        context_fn = table.get(key)
        if context_fn is None:
            context_fn = table[key] = selective_offload_context(offload_policy, options)
    if collector is not None:
        collector.add(context_fn._context)
    return context_fn


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


# record_function is a torch op: inside a selective checkpoint's recompute it would be dispatched
# to the policy's cache and fail. RecordFunctionFast opens the same profiler range without an op.
_StopRecomputation = getattr(torch.utils.checkpoint, "_StopRecomputationError", ())
_FastRange = getattr(torch._C._profiler, "_RecordFunctionFast", None)


#: The profiler range a plan's recomputes run in (the planner's measurement reads it).
RECOMPUTE_RANGE = "ckpt_offload::recompute"


def _range(name):
    return _FastRange(name) if _FastRange is not None else record_function(name)


def _ranged(fn):
    """``fn`` that, when run by a recompute in backward, runs inside a named profiler range."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not _in_backward():
            return fn(*args, **kwargs)
        with _range(RECOMPUTE_RANGE):
            try:
                return fn(*args, **kwargs)
            except _StopRecomputation as e:
                # torch's early stop ends a recompute by raising through the block; the traceback's
                # frames hold the last op's output. Dropped here, so that when the range ends only
                # what the recompute keeps for backward is left.
                e.__traceback__ = None
                raise

    return run


# --- how a wrapped block runs in training -------------------------------------------------------
# One small picklable object per block says it (module-level classes, no closures: the wrapper
# survives copy, pickle and DataParallel). Each is called with the block's own forward.


class _Checkpoint:
    """``co.apply``'s blocks and a plan's "recompute" / "recompute_offload" / "selective": the
    forward under :func:`~ckpt_offload.checkpointing.run_checkpoint` (its input offloaded with
    ``options``), counted in the handle's collector."""

    def __init__(self, options, use_reentrant=False, torch_kwargs=None, collector=None, ranged=False,
                 selective=False, selective_offload=None):
        self.options = options
        self.use_reentrant = use_reentrant
        self.torch_kwargs = dict(torch_kwargs or {})
        self.collector = collector
        self.ranged = ranged  # a plan's: its recompute runs inside the ckpt_offload::recompute range
        self.selective = selective
        self.selective_offload = selective_offload  # options: the policy's outputs go to the pool
        prepare_compiled_offload(options)  # Note [Wrappers under fullgraph=True]

    def __setstate__(self, state):
        self.__dict__.update(state)
        prepare_compiled_offload(self.options)  # unpickled in another process: its pool numbered here

    def __call__(self, forward, args, kwargs):
        torch_kwargs = dict(self.torch_kwargs)
        if self.ranged:
            forward = _ranged(forward)
            kwargs = dict(kwargs)
            torch_kwargs.update({k: kwargs.pop(k) for k in TORCH_KEYWORDS if k in kwargs})
        if self.selective_offload is not None:
            torch_kwargs["context_fn"] = _selective_offload_context(self.selective_offload, self.collector)
        elif self.selective:
            torch_kwargs["context_fn"] = _selective_context
        return run_checkpoint(forward, args, kwargs, self.options, self.use_reentrant, torch_kwargs, self.collector)

    def traced(self):
        """The run Dynamo traces into a fullgraph=True graph (Note [Wrappers under fullgraph=True]),
        or None where this checkpoint has none (then it is the graph break, an error there)."""
        if self.selective or self.selective_offload is not None or self.untraced() is not None:
            return None
        return self._traced

    def untraced(self) -> str | None:
        """Which of this checkpoint's keywords keeps it from being traced, why, and what to do
        (Note [Keywords under fullgraph=True]); None when it traces, or is a plan's selective kind
        (FULLGRAPH_MESSAGE covers those)."""
        if self.selective or self.selective_offload is not None:
            return None
        return untraced_reason(self.options, self.use_reentrant, self.torch_kwargs)

    def _traced(self, forward, args, kwargs):
        # The recompute's profiler range is for the planner's eager measurement: not traced.
        return traced_checkpoint(forward, args, kwargs, self.options, self.torch_kwargs)

    def describe(self) -> str:
        return f"checkpointed, offload={self.options!r}"


class _Offload:
    """A plan's "offload": the forward inside the handle's offload context for ``options``."""

    def __init__(self, options, collector):
        self.options = options
        self.collector = collector

    def __call__(self, forward, args, kwargs):
        ctx = context_for(self.options, owner=self.collector)
        self.collector.add(ctx)
        with ctx:
            out = forward(*args, **kwargs)
        self.collector.note_device_bytes(ctx.pool)  # the block's saved tensors are in the pool now
        return out

    def describe(self) -> str:
        return f"offloaded, {self.options!r}"


class InContext:
    """The whole forward inside one offload context the caller owns (``co.hf.OffloadCallback``
    wraps a model's forward with it: offload without recompute)."""

    def __init__(self, context):
        self.context = context

    def __call__(self, forward, args, kwargs):
        if isinstance(forward, CompiledCall):
            warn_whole_forward()  # one compiled region in one context: no saving
        with self.context:
            return forward(*args, **kwargs)

    def describe(self) -> str:
        return f"inside {self.context!r}"


class _SegmentFirst:
    """The first block of a segment: runs the whole segment inside one checkpoint."""

    def __init__(self, segment):
        self.segment = segment

    def __call__(self, forward, args, kwargs):
        # Under torch.compile of the model, the segment's blocks run compiled too (forward and recompute).
        self.segment.callback = forward.callback if isinstance(forward, CompiledCall) else None
        return self.segment.first(args, kwargs)

    def describe(self) -> str:
        return f"first of segment {self.segment.names[0]} .. {self.segment.names[-1]}"


class _SegmentLater:
    """A later block of a segment: hands back its own output, computed by the segment's first
    block (also outside training, where the segment did not run: then the forward itself)."""

    always = True  # called in eval and no_grad too: the segment decides

    def __init__(self, segment, index):
        self.segment = segment
        self.index = index

    def __call__(self, forward, args, kwargs):
        return self.segment.later(self.index, forward, args, kwargs)

    def describe(self) -> str:
        return f"block {self.index} of segment {self.segment.names[0]} .. {self.segment.names[-1]}"


class BlockForward:
    """The ``forward`` that :func:`apply` or a plan sets on a block (in its ``__dict__``): in
    training mode with gradients enabled, the block's own forward run as ``run`` says; otherwise
    the block's own forward, unchanged.

    Holds the block as an attribute instead of capturing it in a closure: ``copy.deepcopy`` of
    the model copies this object with the block it belongs to, so a copy computes with its own
    weights; ``pickle`` / ``torch.save`` store it by class name (module-level, no locals).
    """

    def __init__(self, block: torch.nn.Module, run, original=None):
        self.block = block
        self.run = run
        # An instance-level forward the block had before (None: the class's, looked up at call
        # time, so the copy's class method is bound to the copy).
        self.original = original if original is not None else block.__dict__.get("forward")

    def install(self) -> None:
        watch_for_dynamo()  # Note [Wrappers under fullgraph=True]
        block = self.block
        block.__dict__["forward"] = self
        block.__dict__["_ckpt_offload_wrapped"] = True
        # nn.DataParallel replicates a module with a shallow copy of its __dict__, which would
        # leave the replica's forward pointing at the original block: give the replica its own.
        block.__dict__["_replicate_for_data_parallel"] = _ReplicateWithForward(self)

    @staticmethod
    def uninstall(block: torch.nn.Module) -> None:
        """Puts back the forward the block had before :meth:`install` (its class's, or the
        instance-level one it carried)."""
        wrapper = block.__dict__.get("forward")
        if isinstance(wrapper, BlockForward) and wrapper.original is not None:
            block.__dict__["forward"] = wrapper.original
        else:
            block.__dict__.pop("forward", None)
        block.__dict__.pop("_ckpt_offload_wrapped", None)
        block.__dict__.pop("_replicate_for_data_parallel", None)

    def own_forward(self):
        """The block's forward without this wrapper."""
        if self.original is not None:
            return self.original
        if torch.compiler.is_compiling():
            # A partial while Dynamo traces: torch 2.11's traces neither forward.__get__ nor
            # types.MethodType under fullgraph=True.
            return functools.partial(type(self.block).forward, self.block)
        return type(self.block).forward.__get__(self.block)

    @property
    def __signature__(self):
        # The block's own signature (Trainer reads model.forward's to drop unused dataset columns).
        return inspect.signature(self.own_forward())

    @skip_frame_only
    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling() and fullgraph_tracing():
            # Dynamo traces this under fullgraph=True: Note [Wrappers under fullgraph=True].
            if not (self.block.training and torch.is_grad_enabled()):
                return self.own_forward()(*args, **kwargs)
            traced = getattr(self.run, "traced", None)
            run = traced() if traced is not None else None
            if run is not None:
                return run(self.own_forward(), args, kwargs)
            untraced = getattr(self.run, "untraced", None)
            why = untraced() if untraced is not None else None
            if why is not None:
                graph_break_if_compiling(why)  # fullgraph=True: the error, naming the keyword
        return self._call(*args, **kwargs)

    @skipped_by_dynamo(FULLGRAPH_MESSAGE)
    def _call(self, *args, **kwargs):
        # Under torch.compile of the model: Dynamo skips this frame, and only the block's own
        # forward is compiled (Note [Wrappers under torch.compile]).
        with eager_code() as callback:
            forward = compiled_forward(self.own_forward(), callback)
            if getattr(self.run, "always", False) or (self.block.training and torch.is_grad_enabled()):
                return self.run(forward, args, kwargs)
            return forward(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<ckpt_offload forward of {type(self.block).__name__}: {self.run.describe()}>"


class _ReplicateWithForward:
    """``block._replicate_for_data_parallel()`` that re-targets the replica's wrapped forward."""

    def __init__(self, wrapper: BlockForward):
        self.wrapper = wrapper

    def __call__(self):
        w = self.wrapper
        replica = type(w.block)._replicate_for_data_parallel(w.block)
        replica.__dict__.pop("forward", None)  # the shallow copy's: the original block's wrapper
        BlockForward(replica, w.run, w.original).install()
        return replica


def _own_forward(block):
    """``block``'s forward without a ckpt_offload wrapper."""
    f = block.__dict__.get("forward")
    return f.own_forward() if isinstance(f, BlockForward) else block.forward


# --- the handle --------------------------------------------------------------------------------


class CheckpointHandle:
    """Returned by :func:`apply`, ``Plan.apply`` and ``co.hf.enable`` (its
    :class:`~ckpt_offload.integrations.hf.HFCheckpointHandle` is this class with Hugging Face's
    installing and restoring): which blocks are wrapped (:attr:`names`) and what each does
    (:attr:`kinds`), their offload counts (:meth:`stats`), and :meth:`remove` to restore the model.

    Example::

        handle = co.apply(model, offload=True)
        print(handle.names[:2], handle.kinds[:2])   # ['layers.0', 'layers.1'] ['recompute_offload', ...]
        handle.remove()                             # every block has its own forward back
    """

    def __init__(self, model: torch.nn.Module, blocks: list, names: list, kinds: list, every_n_layers: int = 1,
                 collector: StatsCollector | None = None):
        self._model = model
        self._blocks = blocks
        self.names = names  #: qualified names of the wrapped blocks
        self._kinds = kinds
        self.every_n_layers = every_n_layers
        self.removed = False
        self._collector = collector if collector is not None else StatsCollector()
        #: the :class:`~ckpt_offload.tile_model.TileHandle` of ``tile=`` (None without it)
        self.tiles = None

    @property
    def kinds(self) -> list:
        """Per wrapped block, what it does (as ``plan.choices`` names it)."""
        return self._kinds

    def stats(self) -> dict:
        """What offload did in this handle's checkpoints, and only theirs: the keys of
        :meth:`ckpt_offload.offload.stats` summed over the contexts they used (the handle's own:
        another model wrapped with equal options counts apart; peaks: the largest),
        ``pool_peak_bytes`` (the most bytes in use in the pool, read at each pack and unpack of
        these checkpoints' inputs, since the last :meth:`reset_stats`) and ``device_saved_peak_bytes``
        (the most bytes of saved activations held on the device at once -- kept, reloaded,
        prefetched -- as co.profile() reports it, sampled at each pack and unpack of these
        checkpoints' inputs; see Note [Handle device peak] in ``_stats.py``). All
        zeros without ``offload``.

        Example::

            handle = co.apply(model, offload=True)
            model(x).sum().backward()
            print(handle.stats()["bytes_offloaded"], handle.stats()["kept_by_reason"])
            print(handle.stats()["device_saved_peak_bytes"])    # the device's peak of saved bytes
        """
        return self._collector.stats()

    def reset_stats(self) -> None:
        """Counts from zero again, the device peak included (see :meth:`stats`)."""
        self._collector.reset()

    def remove(self) -> None:
        """Restores every wrapped block's own ``forward`` (the one it had before). Calling it
        twice is harmless."""
        if self.removed:
            return
        if self.tiles is not None:
            self.tiles.remove()
        self._restore()
        if self._model.__dict__.get(HANDLE_ATTR) is self:
            del self._model.__dict__[HANDLE_ATTR]
        self.removed = True

    def _restore(self) -> None:
        """What :meth:`remove` undoes besides the model's handle attribute (a route's own part)."""
        for block in self._blocks:
            BlockForward.uninstall(block)

    def __repr__(self) -> str:
        every = f", every_n_layers={self.every_n_layers}" if self.every_n_layers != 1 else ""
        return f"{type(self).__name__}({len(self.names)} blocks{every}, removed={self.removed})"


#: Where a model keeps the handle of what ckpt_offload applied to it (co.apply, a plan, co.hf.enable).
HANDLE_ATTR = "_ckpt_offload_handle"


def active_handle(model: torch.nn.Module) -> CheckpointHandle | None:
    """The handle of what co.apply, a plan or co.hf.enable applied to ``model``, while it is
    applied (not removed); else None."""
    handle = getattr(model, "__dict__", {}).get(HANDLE_ATTR)
    return handle if isinstance(handle, CheckpointHandle) and not handle.removed else None


def check_not_applied(model: torch.nn.Module, named_blocks=(), route: str = "co.apply", why: str = "") -> None:
    """Refuses a model (or one of ``named_blocks``) that co.apply, co.hf.enable or a plan already
    wraps: wrapping twice would checkpoint twice (and ``remove`` could not restore the model)."""
    if active_handle(model) is not None:
        raise RuntimeError(
            f"{route}: the model is already wrapped by co.apply, co.hf.enable or a plan (ckpt_offload is already "
            f"applied to it){why}. Call .remove() on the handle it returned (model._ckpt_offload_handle.remove()) "
            "first")
    for name, block in named_blocks:
        if "_ckpt_offload_wrapped" in block.__dict__:
            raise RuntimeError(
                f"{route}: block {name!r} is already wrapped by co.apply or a plan{why}; call .remove() on that "
                "handle first")


def _hidden(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def hidden_key(module) -> str:
    """The keyword a block's hidden state comes by when the model calls it by keyword: the first
    parameter of its forward (``x`` of ``forward(self, x, mask)``; ``hidden_states`` for Hugging
    Face layers and for a forward that takes ``*args``)."""
    try:
        first = next(iter(inspect.signature(module.forward).parameters.values()), None)
    except (TypeError, ValueError):
        first = None
    if first is None or first.kind not in (first.POSITIONAL_ONLY, first.POSITIONAL_OR_KEYWORD):
        return "hidden_states"
    return first.name


def unchained_reason(out) -> str | None:
    """Why a segment cannot hand ``out``, a block's output, on to the next block (None: it can)."""
    from collections.abc import Mapping

    if isinstance(out, Mapping):
        keys = ", ".join(repr(k) for k in list(out)[:4])
        return (f"returns a dict ({keys}) that the model unpacks before the next block, while a segment hands "
                "a block's output (or its first element) to the next block as its first argument")
    return None


def _next_args(out, args, kwargs, key="hidden_states"):
    """The arguments of the next block of a segment: the previous block's hidden state as its first
    argument (positional, or ``key=`` (:func:`hidden_key`) when the blocks are called by keyword),
    the others unchanged."""
    h = _hidden(out)
    if args:
        return (h, *args[1:]), kwargs
    kwargs = dict(kwargs)
    kwargs[key] = h
    return (), kwargs


def _rest(args, kwargs, key="hidden_states"):
    """What a segment's block gets besides its hidden state (the first argument, or ``key=``)."""
    if args:
        return args[1:], kwargs
    return (), {k: v for k, v in kwargs.items() if k != key}


def _same_leaf(a, b) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) or type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError):  # == raises or is not a bool: only itself is the same
        return False


def _same_rest(got, expected) -> bool:
    """Whether a later block of a segment got the arguments (besides its hidden state) the segment
    ran it with: the first block's, the same tensors (by identity) and equal other values."""
    (ga, gk), (ea, ek) = got, expected
    if len(ga) != len(ea) or set(gk) != set(ek):
        return False
    g_leaves, g_spec = tree_flatten((ga, gk))
    e_leaves, e_spec = tree_flatten((ea, {k: ek[k] for k in gk}))
    return g_spec == e_spec and all(_same_leaf(a, b) for a, b in zip(g_leaves, e_leaves))


def running_stats(module):
    """Prefixes (``"bn."``) of the submodules of ``module`` that update running statistics in
    forward (BatchNorm and the like in training mode, tracking them)."""
    from torch.nn.modules.batchnorm import _NormBase

    return [f"{n}." if n else "" for n, m in module.named_modules()
            if isinstance(m, _NormBase) and m.training and m.track_running_stats]


class _Segment:
    """Blocks ``a..b`` as one checkpoint. The model calls them one after another; the first block's
    wrapper runs all of them inside the checkpoint (each next block gets the previous one's hidden
    state as its first argument, the other arguments unchanged), which returns every block's own
    output; each later block's wrapper hands back its own. So a model that uses more than the
    first output of each block (an auxiliary loss, attention weights) or collects every block's
    output (``output_hidden_states``) sees what it would without the segment. Needs blocks
    chained through their first argument and called with the same other arguments, as in a
    transformer's layer loop; a call that breaks this raises.

    A nested segment (``unit.inner``) runs its inner checkpoints as ``co.checkpoint`` calls inside
    the outer one's function: torch's non-reentrant checkpoint nests, so the outer recompute keeps
    only the inner checkpoints' inputs, and each inner one recomputes its blocks when backward
    reaches it."""

    def __init__(self, blocks, names, offload, unit, collector, allow=frozenset()):
        self.names, self.offload = names, offload
        self.unit = unit
        self.collector = collector  # the plan handle's StatsCollector
        self.blocks = list(blocks)  # the modules (their own forwards run; a recompute must not write their buffers)
        self.key = hidden_key(self.blocks[0])  # the hidden state's keyword, for blocks called by keyword
        self.allow = allow  # the inexact reasons (planner/costs.py INEXACT_REASONS) allowed
        self.callback = None  # the torch.compile callback its blocks' forwards run under (None: eager)
        self._reset()

    def _checked(self, j, args, kwargs):
        """Runs block ``j`` of the segment in forward, refusing what its recompute would not
        repeat exactly: an in-place write to one of its inputs, or to one of its buffers (running
        statistics, which the recompute would update a second time)."""
        watch = []
        if "input_write" not in self.allow:
            watch += [("input", t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if "state_write" not in self.allow:
            watch += [(f"buffer {n!r}", t) for n, t in self.blocks[j].named_buffers()]
        before = [t._version for _, t in watch]
        out = compiled_forward(_own_forward(self.blocks[j]), self.callback)(*args, **kwargs)
        changed = [what for (what, t), v in zip(watch, before) if t._version != v]
        if changed:
            buffers = [w[len("buffer "):] for w in changed if w != "input"]
            # BatchNorm's kernels update running_mean/var without bumping their version counter:
            # only num_batches_tracked shows it; name the statistics too.
            stats = [repr(f"{name}{stat}") for name in running_stats(self.blocks[j])
                     for stat in ("running_mean", "running_var")]
            buffers = [b for b in stats if b not in buffers] + buffers
            why = ("writes its input in place: its recompute would read the written value" if "input" in changed
                   else f"updates its buffer(s) {', '.join(buffers)} in forward (running statistics): its recompute "
                   "would update them a second time")
            raise RuntimeError(
                f"a segment recomputes {self.names[j]} in backward, but it {why}. Keep this block out of segments "
                "(co.plan excludes such blocks by itself; co.plan(..., allow_inexact=...) allows them)")
        return out

    def _reset(self):
        # outs: the outputs not yet handed out (None once handed); prev: the last one handed out,
        # whose hidden state the next block must get; rest: the arguments the segment ran with.
        self.outs, self.prev, self.rest, self.next = None, None, None, 0

    def _runner(self, parts):
        """A function running ``parts`` (units, block indices absolute) one after another and
        returning every block's output, in order (a tuple, one entry per block)."""
        base, blocks = self.unit.start, self.blocks

        def chain(*a, **kw):
            outs = []
            forward = not _in_backward()
            for j, p in enumerate(parts):
                if j:
                    why = unchained_reason(outs[-1])
                    if why is not None:
                        self._refuse(p.start - base, f"follows {self.names[p.start - base - 1]}, which {why}",
                                     fix="checkpoint these blocks one by one (co.apply(model, ...) without "
                                     "segments=; co.plan offers no segments over them)")
                args, kwargs = (a, kw) if j == 0 else _next_args(outs[-1], a, kw, self.key)
                if p.kind == "keep" and forward:
                    outs.append(self._checked(p.start - base, args, kwargs))
                elif p.kind == "keep":
                    outs.append(compiled_forward(_own_forward(blocks[p.start - base]), self.callback)(*args, **kwargs))
                else:  # an inner checkpoint, its inputs kept by the enclosing one's recompute only
                    outs.extend(_inner_checkpoint(_ranged(self._runner(p.parts)), *args, **kwargs))
            return tuple(outs)

        return chain

    def first(self, args, kwargs):
        outs = _Checkpoint(self.offload, collector=self.collector, ranged=True)(self._runner(self.unit.parts), args, kwargs)
        self.outs, self.prev, self.rest, self.next = list(outs), outs[0], _rest(args, kwargs, self.key), 1
        self.outs[0] = None
        del outs
        return self.prev

    def _refuse(self, j, why, fix=None):
        self._reset()
        raise RuntimeError(
            f"a plan segment ({self.names[0]} .. {self.names[-1]}) runs its blocks one after another, each with the "
            f"previous one's output as its first argument and the other arguments the first block got; "
            f"{self.names[j]} {why}. "
            + (fix[0].upper() + fix[1:] if fix else "Plan without segments (co.plan(..., segments=False)), or "
               "apply without segments, for this model")
            + ".")

    def later(self, j, original, args, kwargs):
        if self.outs is None:
            return original(*args, **kwargs)
        if j != self.next:
            self._refuse(j, f"was called out of order (after {self.names[self.next - 1]})")
        given = args[0] if args else kwargs.get(self.key)
        if given is not _hidden(self.prev):
            self._refuse(j, "got another input")
        if not _same_rest(_rest(args, kwargs, self.key), self.rest):
            self._refuse(j, "got other arguments than the first block")
        out = self.outs[j]
        self.outs[j] = None  # handed out: the segment no longer holds it
        if j == len(self.blocks) - 1:
            self._reset()
        else:
            self.prev, self.next = out, j + 1
        return out


def _inner_checkpoint(function, *args, **kwargs):
    """An inner checkpoint of a nested segment: ``co.checkpoint(function, *args, **kwargs)`` without
    offload (its inputs are kept by the enclosing recompute only)."""
    return run_checkpoint(function, args, kwargs, None, False, {})


# --- installing units ----------------------------------------------------------------------------


def install_units(model, named_blocks, units, options: OffloadOptions | None, allow=frozenset(), *,
                  every_n_layers: int = 1, use_reentrant: bool = False, torch_kwargs=None,
                  ranged: bool = True, route: str = "a plan", store_dtype=None) -> CheckpointHandle:
    """Wraps the blocks of ``named_blocks`` as ``units`` (:class:`~ckpt_offload._units.Unit`) say;
    returns the :class:`CheckpointHandle`.

    ``options`` are the offload options of every offload and offloaded checkpoint input;
    ``allow``: the inexact reasons (``INEXACT_REASONS`` of the planner's cost model) a segment does
    not refuse; ``ranged``: recomputes run inside the ``ckpt_offload::recompute`` range (plans);
    ``store_dtype``: what the units with ``store=True`` (a plan's lossy ones) store in -- their
    options get ``store_dtype=``, so they share an offload context of their own.
    """
    options = as_options(options)
    lossy = None
    if any(getattr(u, "store", False) for u in units):
        if store_dtype is None or options is None:
            raise ValueError("units store lossy (Unit.store) but no store_dtype (or no offload options) was given")
        lossy = dataclasses.replace(options, store_dtype=store_dtype)
    check_not_applied(model, named_blocks, route)
    collector = StatsCollector()  # the handle's: its blocks' contexts and counts
    labels = choice_names(units)
    wrapped, names, kinds = [], [], []
    for u in units:
        if u.kind == "keep":
            continue
        offload = (lossy if u.store else options) if u.kind in ("offload", "recompute_offload") else None
        if u.kind == "selective_offload":
            offload = None  # the checkpoint's input stays; the policy's outputs go to the pool
        if u.end > u.start:
            members = named_blocks[u.start:u.end + 1]
            seg = _Segment([b for _, b in members], [n for n, _ in members], offload, u, collector,
                           allow=frozenset(allow))
            runs = [_SegmentFirst(seg)] + [_SegmentLater(seg, j) for j in range(1, len(members))]
        else:
            members = [named_blocks[u.start]]
            if u.kind == "offload":
                runs = [_Offload(offload, collector)]
            else:
                runs = [_Checkpoint(offload, use_reentrant, torch_kwargs, collector, ranged=ranged,
                                    selective=u.kind in ("selective", "selective_offload"),
                                    selective_offload=options if u.kind == "selective_offload" else None)]
        for j, ((name, block), run) in enumerate(zip(members, runs)):
            BlockForward(block, run).install()
            wrapped.append(block)
            names.append(name)
            kinds.append(labels[u.start + j])
    handle = CheckpointHandle(model, wrapped, names, kinds, every_n_layers, collector)
    model.__dict__[HANDLE_ATTR] = handle
    return handle


def _segment_units(n: int, segments) -> list:
    """``co.apply(segments=...)``: ``"sqrt"`` -> round(sqrt(n)) runs of consecutive blocks (Chen et
    al.), an int k -> exactly k runs; as (start, end) pairs.

    Example::

        _segment_units(9, 6)   # [(0, 1), (2, 3), (4, 5), (6, 6), (7, 7), (8, 8)]
    """
    if segments == "sqrt":
        k = max(1, round(math.sqrt(n)))
    elif isinstance(segments, str):
        raise ValueError(f"segments must be 'sqrt', an int >= 1 or None, got {segments!r}")
    else:
        k = check_int("segments", segments, minimum=1)
        if k > n:
            raise ValueError(f"segments ({k}) cannot exceed the number of blocks ({n})")
    # k runs whose lengths differ by at most one, the longer ones first (a ceil(n / k) step would
    # give fewer than k runs: 9 blocks in 6 segments would be 5 runs of 2, 2, 2, 2, 1).
    out, start = [], 0
    for i in range(k):
        length = n // k + (1 if i < n % k else 0)
        out.append((start, start + length - 1))
        start += length
    return out


# --- choosing the blocks, and co.apply ----------------------------------------------------------


# Note [The last block's input]
# Every checkpointed block's input goes to the host pool, the last one's too, although backward
# needs it first (prefetch starts after the first unpack, so its reload is always on demand: one
# stall of one input's bytes over the host link per step, ~5 ms for 256 MiB at 55 GB/s, about
# 0.1-0.2% of such a model's step). DeepSpeed keeps it on the device (keep_last_count=1). Here
# co.checkpoint cannot tell which call is a step's last (only deferring every input's copy to the
# next call could, holding each input a block longer), and co.apply could (its last block) at the
# cost of one input's device bytes from that block's forward through the loss, where the logits
# often set the peak. Not measured on a GPU against that cost yet, so the default stays, and the
# memory formula in docs/api.md holds exactly. See docs/api.md, "The last block's input".
def _is_expert_list(name: str) -> bool:
    """A mixture-of-experts list: its members run for some tokens each, not one after another,
    so they are never "the blocks" (checkpointing them would recompute per expert)."""
    last = name.rsplit(".", 1)[-1].lower()
    return "expert" in last


def _largest_block_list(model: torch.nn.Module):
    """The list of same-class blocks (2 or more) holding the most of the model's parameters;
    warns when another list holds nearly as many (say which, and how to pass layers=)."""
    candidates = []  # (params, count, name, blocks)
    for name, mod in model.named_modules():
        if not isinstance(mod, (torch.nn.ModuleList, torch.nn.Sequential)) or _is_expert_list(name):
            continue
        children = list(mod.named_children())
        if len(children) < 2 or len({type(c) for _, c in children}) != 1:
            continue
        size = sum(p.numel() for p in mod.parameters())
        prefix = f"{name}." if name else ""
        candidates.append((size, len(children), name, [(prefix + n, c) for n, c in children]))
    if not candidates:
        return []
    candidates.sort(key=lambda c: (c[0], c[1]), reverse=True)
    best = candidates[0]
    for other in candidates[1:]:
        nested = best[2] == "" or other[2].startswith(best[2] + ".") or best[2].startswith(other[2] + ".")
        if not nested and best[0] > 0 and other[0] >= 0.8 * best[0]:
            block = type(best[3][0][1]).__name__
            warn_at_user_line(
                f"co.apply: two lists of blocks hold a similar share of the parameters: {best[2] or '<model>'!r} "
                f"({best[1]} x {block}, {best[0]} parameters, chosen) and {other[2]!r} ({other[1]} x "
                f"{type(other[3][0][1]).__name__}, {other[0]} parameters). Pass layers= to choose, e.g. "
                f"co.apply(model, layers={block}) or layers=lambda name, m: name.startswith({best[2] + '.'!r}).",
                key="co.apply-ambiguous",
            )
            break
    logger.info("co.apply: checkpointing %d x %s in %r", best[1], type(best[3][0][1]).__name__, best[2])
    return best[3]


def select_blocks(model: torch.nn.Module, layers, route: str = "co.apply"):
    """``[(name, block), ...]``: the blocks ``layers`` selects in ``model`` (see :func:`apply`),
    outermost matches only; raises ValueError naming ``route`` when there are none."""
    if layers is None:
        found = _largest_block_list(model)
        what = "list of identical blocks (an nn.ModuleList or nn.Sequential of 2 or more modules of one class)"
    elif isinstance(layers, type) and issubclass(layers, torch.nn.Module):
        found = [(n, m) for n, m in model.named_modules() if isinstance(m, layers) and m is not model]
        what = f"submodule of class {layers.__name__}"
    elif isinstance(layers, type):
        # A class is callable, but calling it as a predicate would fail with an unrelated error.
        raise TypeError(
            f"layers is the class {layers.__name__}, which is not an nn.Module subclass; pass None, "
            "an nn.Module subclass (the block class), or a predicate layers(name, module) -> bool"
        )
    elif callable(layers):
        found = [(n, m) for n, m in model.named_modules() if m is not model and layers(n, m)]
        what = "submodule for which layers(name, module) is true"
    else:
        raise TypeError(
            "layers must be None, an nn.Module subclass, or a predicate layers(name, module) -> bool; "
            f"got {type(layers).__name__}"
        )
    # A match nested inside another match would be checkpointed twice: keep the outermost.
    outer = []
    for name, mod in found:
        if not any(name.startswith(o + ".") for o, _ in outer):
            outer.append((name, mod))
    if not outer:
        raise ValueError(
            f"{route} found no {what} in {type(model).__name__}. Pass layers=<the block class> "
            "(for example layers=type(model.layers[0])) or a predicate layers=lambda name, module: ..."
        )
    return outer


def apply(model: torch.nn.Module, layers=None, every_n_layers: int = 1, offload=False, segments=None, tile=None,
          **checkpoint_kwargs):
    """Checkpoints the repeated blocks of ``model``: block ``i`` recomputes in backward when
    ``i % every_n_layers == 0`` (Hugging Face's rule), optionally with its inputs offloaded.

    Args:
        model: any ``nn.Module``.
        layers: which blocks: ``None`` finds the ``nn.ModuleList``/``nn.Sequential`` of blocks
            of one class (2 or more) holding the most parameters -- never a mixture-of-experts
            list (a name with "expert") -- and warns when another list holds nearly as many; a module class selects every submodule of it; a predicate
            ``layers(name, module) -> bool`` selects what it accepts (outermost matches only).
        every_n_layers: checkpoint one block in ``every_n_layers`` (>= 1), starting with the first.
        offload: as in :func:`~ckpt_offload.checkpoint`.
        segments: ``None`` (default) checkpoints blocks one by one; ``"sqrt"`` (Chen et al.) or an
            int k groups the n blocks into about sqrt(n) (or k) runs of consecutive blocks, each
            checkpointed as one (only its first input is kept), through the planner's segments
            (blocks must be chained through their first argument). Not with ``every_n_layers`` or
            checkpoint keywords.
        tile: ``None`` (default) or a :class:`~ckpt_offload.TileOptions` (``True``, an int of
            positions per tile, a size string, a dict of its fields): every block's MLP found by
            structure (a child named ``mlp``/``feed_forward``/``ffn`` or whose class is named like an
            MLP) and its norms run as :func:`ckpt_offload.tiled` along the sequence, and a Hugging
            Face causal LM's head is fused with its loss (docs/api.md, "Sequence-tiled recompute").
        **checkpoint_kwargs: ``use_reentrant``, ``preserve_rng_state``, ``context_fn``,
            ``determinism_check``, ``debug``, ``early_stop``.

    The blocks' parameters and ``state_dict()`` keys do not change: only the blocks' ``forward``
    is wrapped, and the wrapper checkpoints only in training mode with gradients enabled (in
    ``eval()`` or under ``torch.no_grad()`` it calls the block directly). The wrapped model can
    be deep-copied, pickled, ``torch.save``-d and replicated by ``nn.DataParallel``: each copy
    checkpoints its own blocks, with its own weights.

    Returns:
        a :class:`CheckpointHandle`; ``handle.remove()`` restores the model.

    Example::

        handle = co.apply(model, every_n_layers=2, offload=True)
        loss = model(x).sum(); loss.backward()
        handle.remove()
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    check_int("every_n_layers", every_n_layers, minimum=1)
    options = as_options(offload)
    tiles = as_tile_options(tile)
    check_checkpoint_keywords(checkpoint_kwargs, "co.apply",
                              own=("layers", "every_n_layers", "offload", "segments", "tile"))
    use_reentrant = check_reentrant(checkpoint_kwargs.pop("use_reentrant", None), options)
    if options is not None:
        check_offloads_something(options.devices, "co.apply(offload=...)")
    check_not_applied(model)
    kind = "recompute" if options is None else "recompute_offload"
    if segments is not None:
        if every_n_layers != 1 or checkpoint_kwargs or use_reentrant:
            raise ValueError("segments= cannot be combined with every_n_layers, use_reentrant or checkpoint keywords")
        named = select_blocks(model, layers)
        units = [Unit(s, e, kind) for s, e in _segment_units(len(named), segments)]
        return _with_tiles(install_units(model, named, units, options, route="co.apply"), model, named, tiles)
    named = select_blocks(model, layers)
    units = [Unit(i, i, kind if i % every_n_layers == 0 else "keep") for i in range(len(named))]
    # co.apply's checkpoints are co.checkpoint's (no profiler range of the planner's).
    handle = install_units(model, named, units, options, every_n_layers=every_n_layers, use_reentrant=use_reentrant,
                           torch_kwargs=checkpoint_kwargs, ranged=False, route="co.apply")
    return _with_tiles(handle, model, named, tiles)


def _with_tiles(handle, model, named, tiles, route="co.apply"):
    """``handle`` with ``tile=``'s parts tiled (``handle.tiles``); removed again if that fails."""
    if tiles is None:
        return handle
    try:
        handle.tiles = tile_blocks(model, named, tiles, route)
    except BaseException:
        handle.remove()
        raise
    return handle
