"""Installing a plan on a model: each block's ``forward`` is wrapped with the public pieces of
ckpt_offload -- ``co.offload`` for "offload", ``co.checkpoint`` for "recompute",
``co.checkpoint(offload=...)`` for "recompute_offload", ``co.checkpoint`` with torch's selective
checkpoint policy for "selective" -- and a segment of blocks is one checkpoint around all of them.

Offloaded blocks and checkpoints with offloaded inputs share one ``co.offload`` context (the plan
handle's own, per option set, as ``co.apply``'s handles have), so the engine's prefetcher sees their
saved tensors in one pack order and brings back the next block's while backward works on this one,
and ``handle.stats()`` counts this plan's blocks only.

A recompute (of a checkpoint or a segment) runs inside a ``ckpt_offload::recompute`` profiler range,
which is how :func:`ckpt_offload.planner.measure.saved_activation_peak` tells recomputed activations
from temporaries.
"""

from __future__ import annotations

import functools

import torch
import torch.utils.checkpoint
from torch.profiler import record_function
try:  # torch's selective checkpoint (2.4+); without it plans have no "selective"
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
except ImportError:  # pragma: no cover - older torch
    CheckpointPolicy = create_selective_checkpoint_contexts = None

from ckpt_offload._checkpoint_core import TORCH_KEYWORDS, StatsCollector, run_checkpoint
from ckpt_offload._checkpoint_core import context_for as _context_for
from ckpt_offload.checkpoint import CheckpointHandle, checkpoint
from ckpt_offload.planner.costs import SELECTIVE_SAVE_OPS

__all__ = ["apply_units", "PlanHandle", "selective_policy"]

_SAVE = set(SELECTIVE_SAVE_OPS)


def selective_policy(ctx, op, *args, **kwargs):
    """Torch's selective-checkpoint policy of the planner's "selective": keep the outputs of matmuls,
    convolutions and fused attention, recompute everything else."""
    packet = getattr(op, "overloadpacket", op)
    return CheckpointPolicy.MUST_SAVE if packet in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(selective_policy)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


# record_function is a torch op: inside a selective checkpoint's recompute it would be dispatched
# to the policy's cache and fail. RecordFunctionFast opens the same profiler range without an op.
_StopRecomputation = getattr(torch.utils.checkpoint, "_StopRecomputationError", ())
_FastRange = getattr(torch._C._profiler, "_RecordFunctionFast", None)


def _range(name):
    return _FastRange(name) if _FastRange is not None else record_function(name)


def _ranged(fn):
    """``fn`` that, when run by a recompute in backward, runs inside a named profiler range."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not _in_backward():
            return fn(*args, **kwargs)
        with _range("ckpt_offload::recompute"):
            try:
                return fn(*args, **kwargs)
            except _StopRecomputation as e:
                # torch's early stop ends a recompute by raising through the block; the traceback's
                # frames hold the last op's output. Dropped here, so that when the range ends only
                # what the recompute keeps for backward is left.
                e.__traceback__ = None
                raise

    return run


class PlanHandle(CheckpointHandle):
    """Returned by :meth:`Plan.apply` (and ``co.apply(segments=...)``): which blocks are wrapped;
    :meth:`remove` restores them."""

    def __init__(self, model, blocks, names, kinds):
        super().__init__(model, blocks, names, every_n_layers=1)
        self.kinds = kinds  #: per wrapped block, what it does

    def remove(self) -> None:
        if self.removed:
            return
        for block in self._blocks:
            block.__dict__.pop("forward", None)
            block.__dict__.pop("_ckpt_offload_wrapped", None)
        if getattr(self._model, "_ckpt_offload_handle", None) is self:
            del self._model._ckpt_offload_handle
        self.removed = True

    def __repr__(self) -> str:
        return f"PlanHandle({len(self.names)} blocks, removed={self.removed})"


def _checkpoint(function, args, kwargs, options, collector, **torch_kwargs):
    """``co.checkpoint(function, *args, offload=options, **kwargs)`` counted in ``collector`` (the
    plan handle's): its offloaded inputs go to the handle's own context."""
    kwargs = dict(kwargs)
    torch_kwargs.update({k: kwargs.pop(k) for k in TORCH_KEYWORDS if k in kwargs})
    return run_checkpoint(function, args, kwargs, options, False, torch_kwargs, collector)


def _offloaded(function, args, kwargs, options, collector):
    """``function(*args, **kwargs)`` inside the plan handle's co.offload context for ``options``."""
    ctx = _context_for(options, owner=collector)
    collector.add(ctx)
    with ctx:
        out = function(*args, **kwargs)
    collector.note_device_bytes(ctx.pool)  # the block's saved tensors are in the pool now
    return out


def _hidden(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _next_args(out, args, kwargs):
    """The arguments of the next block of a segment: the previous block's hidden state as its first
    argument (positional, or ``hidden_states=`` when the blocks are called by keyword), the others
    unchanged."""
    h = _hidden(out)
    if args:
        return (h, *args[1:]), kwargs
    kwargs = dict(kwargs)
    kwargs["hidden_states"] = h
    return (), kwargs


def _rest(args, kwargs):
    """What a segment's block gets besides its hidden state (the first argument, or
    ``hidden_states=``)."""
    if args:
        return args[1:], kwargs
    return (), {k: v for k, v in kwargs.items() if k != "hidden_states"}


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
    from torch.utils._pytree import tree_flatten

    (ga, gk), (ea, ek) = got, expected
    if len(ga) != len(ea) or set(gk) != set(ek):
        return False
    g_leaves, g_spec = tree_flatten((ga, gk))
    e_leaves, e_spec = tree_flatten((ea, {k: ek[k] for k in gk}))
    return g_spec == e_spec and all(_same_leaf(a, b) for a, b in zip(g_leaves, e_leaves))


def _running_stats(module):
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

    def __init__(self, originals, names, offload, unit, collector, blocks=(), allow=frozenset()):
        self.originals, self.names, self.offload = originals, names, offload
        self.unit = unit
        self.collector = collector  # the plan handle's StatsCollector
        self.blocks = list(blocks)  # the modules, whose buffers a recompute must not write again
        self.allow = allow  # the inexact reasons (planner/costs.py INEXACT_REASONS) allowed
        self._reset()

    def _checked(self, j, args, kwargs):
        """Runs block ``j`` of the segment in forward, refusing what its recompute would not
        repeat exactly: an in-place write to one of its inputs, or to one of its buffers (running
        statistics, which the recompute would update a second time)."""
        from torch.utils._pytree import tree_flatten

        watch = []
        if "input_write" not in self.allow:
            watch += [("input", t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if "state_write" not in self.allow and j < len(self.blocks):
            watch += [(f"buffer {n!r}", t) for n, t in self.blocks[j].named_buffers()]
        before = [t._version for _, t in watch]
        out = self.originals[j](*args, **kwargs)
        changed = [what for (what, t), v in zip(watch, before) if t._version != v]
        if changed:
            buffers = [w[len("buffer "):] for w in changed if w != "input"]
            # BatchNorm's kernels update running_mean/var without bumping their version counter:
            # only num_batches_tracked shows it; name the statistics too.
            stats = [repr(f"{name}{stat}") for name in (_running_stats(self.blocks[j]) if j < len(self.blocks) else ())
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
        base, originals = self.unit.start, self.originals

        def chain(*a, **kw):
            outs = []
            forward = not _in_backward()
            for j, p in enumerate(parts):
                args, kwargs = (a, kw) if j == 0 else _next_args(outs[-1], a, kw)
                if p.kind == "keep" and forward:
                    outs.append(self._checked(p.start - base, args, kwargs))
                elif p.kind == "keep":
                    outs.append(originals[p.start - base](*args, **kwargs))
                else:  # an inner checkpoint, its inputs kept by the enclosing one's recompute only
                    outs.extend(checkpoint(_ranged(self._runner(p.parts)), *args, **kwargs))
            return tuple(outs)

        return chain

    def first(self, args, kwargs):
        outs = _checkpoint(_ranged(self._runner(self.unit.parts)), args, kwargs, self.offload, self.collector)
        self.outs, self.prev, self.rest, self.next = list(outs), outs[0], _rest(args, kwargs), 1
        self.outs[0] = None
        del outs
        return self.prev

    def _refuse(self, j, why):
        self._reset()
        raise RuntimeError(
            f"a plan segment ({self.names[0]} .. {self.names[-1]}) runs its blocks one after another, each with the "
            f"previous one's output as its first argument and the other arguments the first block got; "
            f"{self.names[j]} {why}. Plan without segments (co.plan(..., segments=False)), or apply without "
            "segments, for this model")

    def later(self, j, original, args, kwargs):
        if self.outs is None:
            return original(*args, **kwargs)
        if j != self.next:
            self._refuse(j, f"was called out of order (after {self.names[self.next - 1]})")
        given = args[0] if args else kwargs.get("hidden_states")
        if given is not _hidden(self.prev):
            self._refuse(j, "got another input")
        if not _same_rest(_rest(args, kwargs), self.rest):
            self._refuse(j, "got other arguments than the first block")
        out = self.outs[j]
        self.outs[j] = None  # handed out: the segment no longer holds it
        if j == len(self.originals) - 1:
            self._reset()
        else:
            self.prev, self.next = out, j + 1
        return out


def apply_units(model, named_blocks, units, offload_options, allow=frozenset(), store_dtype=None):
    """Wraps the blocks of ``named_blocks`` as ``units`` say; returns a :class:`PlanHandle`.

    ``offload_options`` are the co.offload options of every offload and offloaded checkpoint input;
    ``allow``: the reasons of ``INEXACT_REASONS`` (planner/costs.py) a segment does not refuse;
    ``store_dtype``: what the units with ``store=True`` store in (their options get
    ``store_dtype=``, so they share a co.offload context of their own).
    """
    if any(u.store for u in units):
        if store_dtype is None:
            raise ValueError("units store lossy (Unit.store) but no store_dtype was given")
        lossy_options = dict(offload_options, store_dtype=store_dtype)

    def options_of(u):
        return lossy_options if u.store else offload_options

    existing = getattr(model, "_ckpt_offload_handle", None)
    if existing is not None and not existing.removed:
        raise RuntimeError(
            "co.apply, co.hf.enable or a plan was already applied to this model; call .remove() on the handle "
            "it returned (model._ckpt_offload_handle.remove()) before applying again")
    for name, block in named_blocks:
        if "_ckpt_offload_wrapped" in block.__dict__:
            raise RuntimeError(f"block {name!r} is already wrapped by co.apply or a plan; remove that one first")
    wrapped, names, kinds = [], [], []
    collector = StatsCollector()  # the handle's: its blocks' contexts and counts

    def install(block, name, kind, forward):
        block.forward = forward
        block._ckpt_offload_wrapped = True
        wrapped.append(block)
        names.append(name)
        kinds.append(kind)

    from ckpt_offload.planner.simulator import choice_names

    labels = choice_names(units)
    for u in units:
        if u.kind == "keep":
            continue
        if u.end > u.start:
            members = named_blocks[u.start:u.end + 1]
            seg = _Segment([b.forward for _, b in members], [n for n, _ in members],
                           options_of(u) if u.kind == "recompute_offload" else None, u, collector,
                           blocks=[b for _, b in members], allow=frozenset(allow))
            for j, (name, block) in enumerate(members):
                original = block.forward
                if j == 0:
                    def forward(*args, _seg=seg, _block=block, _orig=original, **kwargs):
                        if _block.training and torch.is_grad_enabled():
                            return _seg.first(args, kwargs)
                        return _orig(*args, **kwargs)
                else:
                    def forward(*args, _seg=seg, _j=j, _orig=original, **kwargs):
                        return _seg.later(_j, _orig, args, kwargs)
                install(block, name, labels[u.start + j], forward)
            continue
        name, block = named_blocks[u.start]
        original = block.forward
        kind = u.kind
        options = options_of(u)

        def forward(*args, _orig=original, _block=block, _kind=kind, _options=options, **kwargs):
            if not (_block.training and torch.is_grad_enabled()):
                return _orig(*args, **kwargs)
            if _kind == "offload":
                return _offloaded(_orig, args, kwargs, _options, collector)
            if _kind == "recompute":
                return checkpoint(_ranged(_orig), *args, **kwargs)
            if _kind == "recompute_offload":
                return _checkpoint(_ranged(_orig), args, kwargs, _options, collector)
            return checkpoint(_ranged(_orig), *args, context_fn=_selective_context, **kwargs)

        install(block, name, kind, forward)
    handle = PlanHandle(model, wrapped, names, kinds)
    handle._collector = collector
    model._ckpt_offload_handle = handle
    return handle


def apply_segments(model, named_blocks, segments, offload_options):
    """``co.apply(model, segments=...)``: ``"sqrt"`` -> round(sqrt(n)) segments (Chen et al.), an int
    k -> k segments of consecutive blocks, each checkpointed as one (inputs offloaded when
    ``offload_options`` is not None)."""
    import math

    from ckpt_offload._args import check_int
    from ckpt_offload.planner.simulator import Unit

    n = len(named_blocks)
    if segments == "sqrt":
        k = max(1, round(math.sqrt(n)))
    elif isinstance(segments, str):
        raise ValueError(f"segments must be 'sqrt', an int >= 1 or None, got {segments!r}")
    else:
        k = check_int("segments", segments, minimum=1)
        if k > n:
            raise ValueError(f"segments ({k}) cannot exceed the number of blocks ({n})")
    size = math.ceil(n / k)
    kind = "recompute" if offload_options is None else "recompute_offload"
    units = [Unit(s, min(n, s + size) - 1, kind) for s in range(0, n, size)]
    return apply_units(model, named_blocks, units, offload_options)
