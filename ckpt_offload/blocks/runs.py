"""How a wrapped block runs in training: one small picklable object per block says it, called by
its :class:`~ckpt_offload.blocks.forward.BlockForward` with the block's own forward --
checkpointed (its input kept or offloaded, selective or not), inside the handle's offload context,
or inside a context the caller owns. (A segment's runs are ``segment.py``'s.) Module-level classes,
no closures: the wrapper survives copy, pickle and DataParallel."""

from __future__ import annotations

from ckpt_offload._compile import CompiledCall, warn_whole_forward
from ckpt_offload._compile_ops import prepare as prepare_compiled_offload
from ckpt_offload._compile_ops import traced_checkpoint, untraced_reason
from ckpt_offload.blocks.recompute_range import ranged
from ckpt_offload.checkpointing import TORCH_KEYWORDS, context_for, run_checkpoint
from ckpt_offload.selective import context_fn_selective, context_fn_selective_offload

__all__ = ["InContext"]


class _Checkpoint:
    """``co.apply``'s blocks and a plan's "recompute" / "recompute_offload" / "selective": the
    forward under :func:`~ckpt_offload.checkpointing.run_checkpoint` (its input offloaded with
    ``options``), counted in the handle's collector."""

    def __init__(
        self,
        options,
        use_reentrant=False,
        torch_kwargs=None,
        collector=None,
        ranged=False,
        selective=False,
        selective_offload=None,
    ):
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
            forward = ranged(forward)
            kwargs = dict(kwargs)
            torch_kwargs.update({k: kwargs.pop(k) for k in TORCH_KEYWORDS if k in kwargs})
        if self.selective_offload is not None:
            torch_kwargs["context_fn"] = context_fn_selective_offload(self.selective_offload, self.collector)
        elif self.selective:
            torch_kwargs["context_fn"] = context_fn_selective
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
