"""The ``forward`` a wrapped block gets: :class:`BlockForward`, set in the block's ``__dict__``,
runs the block's own forward the way its run says (``runs.py``, ``segment.py``) in training, and
unchanged otherwise. It holds the block as an attribute, not in a closure: ``copy.deepcopy`` and
``pickle`` of the model carry it with the block, ``nn.DataParallel`` replicas get their own, and
:meth:`BlockForward.uninstall` puts back exactly the forward the block had."""

from __future__ import annotations

import functools
import inspect

import torch

from ckpt_offload._compile import (
    compiled_forward,
    fullgraph_tracing,
    skip_frame_only,
    skipped_by_dynamo,
    watch_for_dynamo,
)
from ckpt_offload._compile import eager as eager_code
from ckpt_offload._warn import FULLGRAPH_MESSAGE, graph_break_if_compiling

__all__ = ["BlockForward", "own_forward"]


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


def own_forward(block):
    """``block``'s forward without a ckpt_offload wrapper."""
    f = block.__dict__.get("forward")
    return f.own_forward() if isinstance(f, BlockForward) else block.forward
