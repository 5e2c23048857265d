"""A segment: consecutive blocks recomputed as one checkpoint (``co.apply(segments=...)`` and a
plan's segments, flat or nested). The first block's run executes every block of the segment inside
the checkpoint; each later block's run hands back its own output."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten

from ckpt_offload._compile import CompiledCall, compiled_forward
from ckpt_offload.blocks.chain import hidden, hidden_key, next_args, rest, running_stats, same_rest, unchained_reason
from ckpt_offload.blocks.forward import own_forward
from ckpt_offload.blocks.recompute_range import in_backward, ranged
from ckpt_offload.blocks.runs import _Checkpoint
from ckpt_offload.checkpointing import run_checkpoint


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
        out = compiled_forward(own_forward(self.blocks[j]), self.callback)(*args, **kwargs)
        changed = [what for (what, t), v in zip(watch, before) if t._version != v]
        if changed:
            buffers = [w[len("buffer ") :] for w in changed if w != "input"]
            # BatchNorm's kernels update running_mean/var without bumping their version counter:
            # only num_batches_tracked shows it; name the statistics too.
            stats = [
                repr(f"{name}{stat}")
                for name in running_stats(self.blocks[j])
                for stat in ("running_mean", "running_var")
            ]
            buffers = [b for b in stats if b not in buffers] + buffers
            why = (
                "writes its input in place: its recompute would read the written value"
                if "input" in changed
                else f"updates its buffer(s) {', '.join(buffers)} in forward (running statistics): its recompute "
                "would update them a second time"
            )
            raise RuntimeError(
                f"a segment recomputes {self.names[j]} in backward, but it {why}. Keep this block out of segments "
                "(co.plan excludes such blocks by itself; co.plan(..., allow_inexact=...) allows them)"
            )
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
            forward = not in_backward()
            for j, p in enumerate(parts):
                if j:
                    why = unchained_reason(outs[-1])
                    if why is not None:
                        self._refuse(
                            p.start - base,
                            f"follows {self.names[p.start - base - 1]}, which {why}",
                            fix="checkpoint these blocks one by one (co.apply(model, ...) without "
                            "segments=; co.plan offers no segments over them)",
                        )
                args, kwargs = (a, kw) if j == 0 else next_args(outs[-1], a, kw, self.key)
                if p.kind == "keep" and forward:
                    outs.append(self._checked(p.start - base, args, kwargs))
                elif p.kind == "keep":
                    outs.append(compiled_forward(own_forward(blocks[p.start - base]), self.callback)(*args, **kwargs))
                else:  # an inner checkpoint, its inputs kept by the enclosing one's recompute only
                    outs.extend(_inner_checkpoint(ranged(self._runner(p.parts)), *args, **kwargs))
            return tuple(outs)

        return chain

    def first(self, args, kwargs):
        run = _Checkpoint(self.offload, collector=self.collector, ranged=True)
        outs = run(self._runner(self.unit.parts), args, kwargs)
        self.outs, self.prev, self.rest, self.next = list(outs), outs[0], rest(args, kwargs, self.key), 1
        self.outs[0] = None
        del outs
        return self.prev

    def _refuse(self, j, why, fix=None):
        self._reset()
        raise RuntimeError(
            f"a plan segment ({self.names[0]} .. {self.names[-1]}) runs its blocks one after another, each with the "
            f"previous one's output as its first argument and the other arguments the first block got; "
            f"{self.names[j]} {why}. "
            + (
                fix[0].upper() + fix[1:]
                if fix
                else "Plan without segments (co.plan(..., segments=False)), or apply without segments, for this model"
            )
            + "."
        )

    def later(self, j, original, args, kwargs):
        if self.outs is None:
            return original(*args, **kwargs)
        if j != self.next:
            self._refuse(j, f"was called out of order (after {self.names[self.next - 1]})")
        given = args[0] if args else kwargs.get(self.key)
        if given is not hidden(self.prev):
            self._refuse(j, "got another input")
        if not same_rest(rest(args, kwargs, self.key), self.rest):
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
