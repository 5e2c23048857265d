"""The planner's cost model, as data: what each block saves for backward and how long it computes
(:class:`BlockCost`, its :class:`Storage`), the host link (:class:`Bandwidth`), and everything the
simulator needs of a step (:class:`CostModel`). ``measuring.py`` measures one from the user's step
(``recorder.py``: the bytes, ``timing.py``: the seconds); ``lossy.py`` says what a narrower storage
dtype would store of it.

What is counted (see docs/planner.md, "What the bytes mean"): a *saved activation* is a storage that
autograd saves for backward and that was allocated during the step (an op's fresh output). Not
counted: parameters, buffers and views of them, inputs created before the step (token ids), and
temporaries that die before backward. A storage saved several times (a view saved by two ops, the
block input saved by a LayerNorm and a Linear) counts once, for the block that saved it first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

__all__ = ["Storage", "BlockCost", "CostModel", "Bandwidth", "INEXACT_REASONS", "UNCHAINED"]

#: Why a recompute of a block can differ from its forward, and the choices each reason rules out:
#: ``input_write``: the block writes one of its inputs in place (a checkpoint's recompute then
#: reads the written value: torch raises for a single checkpoint and nested ones give wrong
#: gradients); ``state_write``: it writes a tensor from outside itself in forward -- a module's
#: running statistics (BatchNorm), a parameter, a cache -- which a recompute writes a second time;
#: ``saved_mutation``: it writes in place the output of an op selective recompute saves (torch's
#: selective checkpoint raises "... has been mutated").
INEXACT_REASONS = {
    "input_write": ("recompute", "recompute_offload", "selective", "selective_offload"),
    "state_write": ("recompute", "recompute_offload", "selective", "selective_offload"),
    "saved_mutation": ("selective", "selective_offload"),
}
#: A reason in a block's ``inexact`` that no ``allow_inexact`` allows: the block does not hand its
#: output on to the next block the way a segment would (a dict the model unpacks, a next block
#: called by keyword without its first parameter, something between them), so no segment may
#: span it and the next one; in a plan's ``excluded`` as the pseudo-kind ``"segment"``.
UNCHAINED = "unchained"


@dataclass
class Storage:
    """One saved storage of a block: ``nbytes``, the first and last pack position (index in the
    block's list of saved tensors, forward order) and whether it is the block's input."""

    nbytes: int
    first: int
    last: int
    is_input: bool = False


@dataclass
class BlockCost:
    """Measured costs of one block.

    ``storages``: the saved storages the block owns (saved here first); ``packs``: for every tensor
    the block saved, in order, the index of its storage in ``storages`` (-1: not an activation, or
    owned elsewhere); ``nodes``: for every saved tensor, when backward unpacked it (a count of ops;
    equal counts: one autograd node, which unpacks its saved tensors together; -1: never unpacked);
    ``input_bytes``: bytes of the block's own inputs (what a checkpoint keeps);
    ``input_sizes``: those inputs one by one; ``selective``: sizes of the storages selective recompute
    keeps besides the input, and ``selective_saved``: which of them are also saved storages (their
    index), -1 if not, and ``selective_last_use``: how many tensors the block had saved when the last op
    reading them ran (a recompute frees them there); ``forward_s`` / ``backward_s``: compute seconds;
    ``selective_recompute_s``:
    seconds to recompute what selective drops; ``inexact``: what the measured step showed makes a
    recompute of the block differ from its forward, ``{reason: what was seen}`` with reason in
    :data:`INEXACT_REASONS` (empty: every choice is exact); ``calls``: how many times the step called
    the block. A block called several times holds every call's costs, one after another; the
    :class:`CostModel`'s ``call_blocks`` has each call's own, which is what the simulator runs.
    ``pack_dtypes`` / ``pack_spans``: for every saved tensor (as ``packs``), its dtype's name and
    the bytes it spans in its storage, and ``input_dtypes`` / ``input_spans`` the same for
    ``input_sizes``: what ``co.offload(store_dtype=...)`` would convert (floating-point tensors
    wider than the storage dtype) and into how many bytes (:func:`converted_packs`);
    ``pack_starts``: each saved tensor's first byte in its storage and its version, which tell the
    saved tensors that share one converted copy (the same span of the same storage, saved twice).
    """

    name: str
    storages: list = field(default_factory=list)
    packs: list = field(default_factory=list)
    nodes: list = field(default_factory=list)
    input_sizes: list = field(default_factory=list)
    selective: list = field(default_factory=list)
    selective_saved: list = field(default_factory=list)
    selective_last_use: list = field(default_factory=list)
    forward_s: float = 0.0
    backward_s: float = 0.0
    selective_recompute_s: float = 0.0
    inexact: dict = field(default_factory=dict)
    calls: int = 1
    pack_dtypes: list = field(default_factory=list)
    pack_spans: list = field(default_factory=list)
    pack_starts: list = field(default_factory=list)
    input_dtypes: list = field(default_factory=list)
    input_spans: list = field(default_factory=list)

    @property
    def saved_bytes(self) -> int:
        return sum(s.nbytes for s in self.storages)

    @property
    def input_bytes(self) -> int:
        return sum(self.input_sizes)


@dataclass
class Bandwidth:
    """The host link: bytes per second each way and seconds of fixed cost per copy. ``0`` bytes/s
    means no link (nothing can be offloaded); ``math.inf`` a free one.

    ``latency``: seconds from a copy's start until its bytes have arrived, beyond ``bytes / bw``
    (one copy and a synchronize: on the H200 of 2026-11-30 about 80 us); ``issue``: seconds each
    copy holds its queue besides its bytes, i.e. the cost per copy of copies issued back to back
    (there about 11-18 us); ``None``: ``latency`` (copies wait for each other's whole latency).
    Note [Copy latency is a delay]: a copy's latency delays its own end, not the next copy's
    start; only ``issue`` is queue time. ``n`` back-to-back copies of ``b`` bytes end
    ``n * issue + b / bw + (latency - issue)`` after the first starts.

    ``convert``: how fast the device converts to and from a narrower storage dtype (``co.plan(...,
    lossy=...)``), in bytes of the full-width tensor per second, each way; ``None``: not known
    (``co.plan`` measures it when a plan may store lossy, :func:`measure_conversion`)."""

    d2h: float
    h2d: float
    latency: float = 0.0
    convert: float | None = None
    issue: float | None = None

    @property
    def issue_seconds(self) -> float:
        """Queue time per copy besides its bytes: ``issue``, at most ``latency`` (None: ``latency``)."""
        return self.latency if self.issue is None else min(self.issue, self.latency)

    def queue_seconds(self, nbytes: int, copies: int, direction: str) -> float:
        """How long ``copies`` copies of ``nbytes`` in all hold the ``direction`` queue."""
        bw = self.d2h if direction == "d2h" else self.h2d
        if nbytes <= 0 and copies <= 0:
            return 0.0
        if bw <= 0:
            return math.inf
        return copies * self.issue_seconds + (0.0 if math.isinf(bw) else nbytes / bw)

    def convert_seconds(self, nbytes: int) -> float:
        """Seconds to convert ``nbytes`` (full width) one way; 0 when ``convert`` is None or inf."""
        if nbytes <= 0 or self.convert is None or math.isinf(self.convert):
            return 0.0
        return nbytes / self.convert if self.convert > 0 else math.inf

    def copy_seconds(self, nbytes: int, copies: int, direction: str) -> float:
        """From the first of ``copies`` back-to-back copies (``nbytes`` in all) starting until the
        last one ends: their queue time plus the last one's remaining latency."""
        q = self.queue_seconds(nbytes, copies, direction)
        return q + (self.latency - self.issue_seconds if copies > 0 else 0.0)


@dataclass
class CostModel:
    """Everything the simulator needs: per-block costs, what is saved outside the blocks (kept on
    the device whatever the plan: ``pre_bytes`` from before the first block until the end,
    ``post_bytes`` from the last block's forward until backward reaches it), the compute outside
    the blocks (``pre_s``, ``mid_s``, ``post_s``), the link, ``min_bytes`` (smaller saved tensors
    stay on the device when offloading, as in co.offload) and ``checkpoint_bytes``: what every
    checkpoint keeps on the device from its forward to its backward besides its inputs -- torch's
    copy of the CPU random state when the device is the CPU (``preserve_rng_state``; on a GPU the
    random states are copied to host memory: 0). A nested segment has one per checkpoint.
    ``excluded``: per block, ``{kind: why}`` for the kinds no plan may give it (set by
    :func:`ckpt_offload.plan` from the blocks' ``inexact``; empty: none excluded); a segment is
    excluded where one of its blocks excludes ``"recompute"``.
    ``call_order``: the block (index) of every block call of the step, in execution order, and
    ``call_blocks`` each call's own :class:`BlockCost` -- set only when the step calls a block more
    than once or out of order (empty: every block once, in order). The simulator then runs the
    calls, each block's choice applying to each of its calls (one module, one wrapper).
    ``store_dtype``: the narrower storage a unit with ``store=True`` uses (set by
    :func:`ckpt_offload.plan` from ``lossy``; None: no unit may store lossy)."""

    blocks: list
    bandwidth: Bandwidth
    min_bytes: int = 0
    pre_bytes: int = 0
    post_bytes: int = 0
    pre_s: float = 0.0
    mid_s: float = 0.0
    post_s: float = 0.0
    baseline_step_s: float = 0.0
    device: str = "cpu"
    checkpoint_bytes: int = 0
    excluded: list = field(default_factory=list)
    call_order: list = field(default_factory=list)
    call_blocks: list = field(default_factory=list)
    store_dtype: torch.dtype | None = None

    @property
    def names(self) -> list:
        return [b.name for b in self.blocks]

    @property
    def compute_s(self) -> float:
        """Seconds of compute of a step without any plan (what the simulator predicts for it)."""
        return self.pre_s + self.mid_s + self.post_s + sum(b.forward_s + b.backward_s for b in self.blocks)
