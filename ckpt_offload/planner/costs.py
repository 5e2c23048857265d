"""The planner's cost model: what each block saves for backward and how long it computes, measured
from one instrumented run of the user's step, plus the host link's bandwidth and per-copy latency.

What is counted (see docs/planner.md, "What the bytes mean"): a *saved activation* is a storage that
autograd saves for backward and that was allocated during the step (an op's fresh output). Not
counted: parameters, buffers and views of them, inputs created before the step (token ids), and
temporaries that die before backward. A storage saved several times (a view saved by two ops, the
block input saved by a LayerNorm and a Linear) counts once, for the block that saved it first.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ckpt_offload._runtime import _C, synchronize
from ckpt_offload.blocks.chain import hidden, hidden_key, running_stats, unchained_reason
from ckpt_offload.offloading import offload_tensor
from ckpt_offload.pool import HostPool
from ckpt_offload.selective import SELECTIVE_SAVE_OPS

__all__ = ["Storage", "BlockCost", "CostModel", "Bandwidth", "measure_costs", "measure_bandwidth",
           "measure_conversion", "stored_bytes", "converted_packs", "converted_shares", "SELECTIVE_SAVE_OPS", "INEXACT_REASONS"]

_SAVE_PACKETS = {op for op in SELECTIVE_SAVE_OPS}

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


def _written(func, args, kwargs):
    """The tensors ``func`` writes in place (its schema's mutable arguments, ``out=`` included)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return []
    out = []
    for i, a in enumerate(schema.arguments):
        info = a.alias_info
        if info is None or not info.is_write:
            continue
        if a.kwarg_only or i >= len(args):
            v = kwargs.get(a.name)
        else:
            v = args[i]
        out += [t for t in tree_flatten(v)[0] if isinstance(t, torch.Tensor)]
    return out
_NO_COMPUTE = {torch.ops.aten.detach, torch.ops.aten.alias, torch.ops.aten.lift_fresh}


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


# ---- lossy storage (co.offload(store_dtype=...)) -------------------------------------------------

def stored_bytes(dtype_name: str, span: int, store_dtype) -> int | None:
    """The host bytes ``co.offload(store_dtype=store_dtype)`` stores for a saved tensor of dtype
    ``dtype_name`` spanning ``span`` bytes, or None when it stores it exactly (not a floating-point
    dtype wider than the storage): the engine's own rule (``_C.stored_bytes``), fp8's fp32 scale
    included.

    Example::

        stored_bytes("float32", 4096, torch.bfloat16)   # 2048
        stored_bytes("int64", 4096, torch.bfloat16)     # None: exact
    """
    if store_dtype is None:
        return None
    return _engine_stored_bytes(dtype_name, int(span), str(store_dtype).removeprefix("torch."))


@functools.lru_cache(maxsize=1 << 16)
def _engine_stored_bytes(dtype_name: str, span: int, store_format: str) -> int | None:
    # Cached: a plan asks for the same few (dtype, span) pairs at every evaluation of a block.
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        return None  # a dtype this torch does not have: nothing the engine would convert
    return _C.stored_bytes(dtype, span, store_format)


def converted_packs(b: BlockCost, store_dtype) -> dict:
    """``{storage index: [(pack position, span bytes, stored bytes), ...]}``: the storages of ``b``
    that ``store_dtype`` converts, one entry per converted copy: the engine converts and copies
    each saved tensor of a converted storage on its own, except one whose span (first byte,
    bytes, dtype, version) is an earlier one's, which shares that copy (:func:`converted_shares`).
    A storage counts only when all its packs convert; one with an exact pack (an integer view) is
    exact. Empty when the costs were measured without dtypes."""
    return _converted(b, store_dtype)[0]


def converted_shares(b: BlockCost, store_dtype) -> dict:
    """``{pack position: the position whose converted copy it shares}`` for the packs of ``b``
    that :func:`converted_packs` leaves out: saved tensors of exactly an earlier one's span."""
    return _converted(b, store_dtype)[1]


def _converted(b: BlockCost, store_dtype):
    if store_dtype is None or len(b.pack_dtypes) != len(b.packs) or len(b.pack_spans) != len(b.packs):
        return {}, {}
    cache = b.__dict__.setdefault("_converted", {})
    if store_dtype in cache:
        return cache[store_dtype]
    starts = b.pack_starts if len(b.pack_starts) == len(b.packs) else [None] * len(b.packs)
    out, exact, shares, first = {}, set(), {}, {}
    for pos, si in enumerate(b.packs):
        if si < 0 or si in exact:
            continue
        n = stored_bytes(b.pack_dtypes[pos], b.pack_spans[pos], store_dtype)
        if n is None:
            exact.add(si)
            out.pop(si, None)
            continue
        key = None if starts[pos] is None else (si, tuple(starts[pos]), b.pack_spans[pos], b.pack_dtypes[pos])
        if key is not None and key in first:
            shares[pos] = first[key]
            continue
        if key is not None:
            first[key] = pos
        out.setdefault(si, []).append((pos, b.pack_spans[pos], n))
    shares = {p: q for p, q in shares.items() if b.packs[p] in out}
    cache[store_dtype] = out, shares
    return out, shares


def converted_inputs(b: BlockCost, store_dtype) -> list:
    """Per entry of ``b.input_sizes``: ``(span, stored bytes)`` when ``store_dtype`` converts it, else None."""
    if store_dtype is None or len(b.input_dtypes) != len(b.input_sizes):
        return [None] * len(b.input_sizes)
    out = []
    for name, span in zip(b.input_dtypes, b.input_spans):
        n = stored_bytes(name, span, store_dtype)
        out.append(None if n is None else (span, n))
    return out


def measure_conversion(device: str = "cpu", store_dtype=torch.bfloat16, nbytes: int = 4 << 20) -> float:
    """Bytes (of the full-width tensor) per second ckpt_offload's own conversion to ``store_dtype``
    and back runs at on ``device``, one way: an fp32 tensor of ``nbytes`` converted down and up
    (the engine's kernels, ``co._C._store_convert``), the best of three, its bytes twice over the time.

    Measured like the host link (:func:`measure_bandwidth`), because on a CPU the conversion is a
    loop over memory whose speed depends on the machine and competes with compute: a stated
    constant would be wrong by several times from one machine to another. On a GPU it is a
    memory-bound kernel (hundreds of GB/s and more), far faster than the link.

    Example::

        measure_conversion("cpu", torch.bfloat16)   # e.g. 3e9 (bytes/s)
    """
    sync = _sync_for(device)
    name = str(store_dtype).removeprefix("torch.")
    x = torch.randn(max(int(nbytes), 1 << 16) // 4, dtype=torch.float32, device=device)
    _C._store_convert(x, name)  # warm-up
    best = math.inf
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        _C._store_convert(x, name)
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * x.nbytes / max(best, 1e-9)


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


# ---- measuring ----------------------------------------------------------------------------------


def _storage_key(t: torch.Tensor):
    try:
        s = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse, nested, some subclasses
        return None
    if s.nbytes() == 0 or s.device.type == "meta":
        return None
    return (s.device.type, s.data_ptr(), s.nbytes())


class _Recorder(TorchDispatchMode):
    """Sees every op of the step: which storages ops freshly allocate (activations, as opposed to
    views of parameters or of inputs made before the step), and, per block, the outputs of the ops
    selective recompute keeps and how long each op takes."""

    def __init__(self, sync):
        super().__init__()
        self.fresh = set()
        self.block = None  # the _BlockRecord of the block running, or None
        self.sync = sync
        self.count = 0  # ops completed

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        in_keys = {_storage_key(a) for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)}
        block = self.block
        if block is not None:
            for k in in_keys:
                if k in block.selective_refs:
                    block.selective_uses[k] = len(block.cost.packs)
            self.sync()
            t0 = time.perf_counter()
        if block is not None and getattr(func, "_schema", None) is not None and func._schema.is_mutable:
            block.note_writes(func, _written(func, args, kwargs))
        out = func(*args, **kwargs)
        if not getattr(func, "is_view", False) and func.overloadpacket not in _NO_COMPUTE:
            self.count += 1  # views: unpacking a saved view re-creates it; not a node's work
        if block is not None:
            self.sync()
            dt = time.perf_counter() - t0
            keep = func.overloadpacket in _SAVE_PACKETS or func in _SAVE_PACKETS
            if keep:
                block.saved_op_s += dt
            block.op_s += dt
        for o in tree_flatten(out)[0]:
            if isinstance(o, torch.Tensor):
                k = _storage_key(o)
                if k is not None and k not in in_keys:
                    self.fresh.add(k)
                    if block is not None:
                        block.own.add(k)
                    if block is not None and keep:
                        block.selective_refs[k] = o  # held, as selective recompute would
        return out


class _Packed:
    __slots__ = ("t", "block", "pos")

    def __init__(self, t, block, pos):
        self.t, self.block, self.pos = t, block, pos


class _BlockRecord:
    def __init__(self, name):
        self.cost = BlockCost(name)
        self.keys = {}  # storage key -> index in cost.storages
        self.input_keys = []
        self.selective_refs = {}
        self.selective_uses = {}
        self.saved_op_s = 0.0
        self.op_s = 0.0
        self.calls = 0
        self.own = set()  # storages the block's ops allocated
        self.arg_keys = {}  # storage key -> which argument ("input 0", "hidden_states")
        self.state_names = {}  # storage key -> name of a parameter or buffer of the block

    def note_writes(self, func, tensors):
        """An op of the block writes ``tensors`` in place: record why that makes a recompute
        inexact, if it does (a write to what the block allocated itself is repeated identically)."""
        inexact = self.cost.inexact
        op = str(getattr(func, "overloadpacket", func))
        for t in tensors:
            k = _storage_key(t)
            if k is None:
                continue
            if k in self.selective_refs:
                inexact.setdefault("saved_mutation", f"{op} writes the output of a matmul/convolution/attention op")
            elif k in self.own:
                continue
            elif k in self.arg_keys:
                inexact.setdefault("input_write", f"{op} writes its {self.arg_keys[k]} in place")
            elif k in self.state_names:
                inexact.setdefault("state_write", f"{op} updates {self.state_names[k]!r} in forward")
            else:
                inexact.setdefault("state_write", f"{op} writes a tensor made outside the block in place")


def _sync_for(device: str):
    if device == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def _tensors(obj):
    return [x for x in tree_flatten(obj)[0] if isinstance(x, torch.Tensor)]


def _measure_bytes(step, named_blocks, device, min_bytes):
    """Run 1: saved tensors per block (saved_tensors_hooks), fresh storages and selective outputs
    (a dispatch mode)."""
    sync = _sync_for(device)
    recs = [_BlockRecord(n) for n, _ in named_blocks]
    # Every call of a block is recorded on its own (a block called twice saves two sets of tensors,
    # which backward frees call by call); recs[i] gets block i's calls joined afterwards.
    calls, call_order = [], []  # per call: its _BlockRecord, its block's index
    owner = {}  # storage key -> ("block", call) | ("pre",) | ("post",)
    outside = {"pre": {}, "post": {}}
    # grad: a block ran with gradients enabled; requires_grad: a block's output needs a gradient;
    # backward: a gradient reached one
    state = {"current": None, "done": set(), "started": False, "grad": False, "requires_grad": False,
             "backward": False}

    def reached(_):
        state["backward"] = True
    rec_mode = _Recorder(sync)

    # Whether a segment could run block i+1 inside block i's checkpoint: the model must call it
    # right after block i with block i's output (or its first element) as its first argument,
    # as a segment does (blocks/chain.py). unchained[i]: why not, between i and i+1.
    unchained = {}

    def check_chain(i, module, args, kwargs):
        last = state.pop("last_out", None)
        if last is None or last[0] != i - 1:
            return
        out = last[1]
        why = unchained_reason(out)
        if why is None:
            key = hidden_key(module)
            given = args[0] if args else kwargs.get(key, last)
            if given is last:
                why = (f"is followed by {named_blocks[i][0]}, which the model calls by keyword without "
                       f"{key}= (its forward's first parameter), while a segment passes the hidden state so")
            elif given is not hidden(out):
                why = (f"is followed by {named_blocks[i][0]}, whose first argument is not its output (or the "
                       "output's first element), while a segment passes exactly that")
        if why is not None:
            unchained.setdefault(i - 1, why)

    def pre_hook(i):
        def hook(module, args, kwargs):
            if state["current"] is not None:
                return  # a block inside a block: attributed to the outer one
            check_chain(i, module, args, kwargs)
            state["current"] = i
            state["started"] = True
            recs[i].calls += 1
            r = _BlockRecord(named_blocks[i][0])
            c = state["call"] = len(calls)
            calls.append(r)
            call_order.append(i)
            state["grad"] |= torch.is_grad_enabled()
            r.own = set()
            r.arg_keys = {}
            named_args = [(f"input {j}", a) for j, a in enumerate(args)] + [
                (f"argument {name!r}", v) for name, v in kwargs.items()]
            for where, a in named_args:
                for t in _tensors(a):
                    k = _storage_key(t)
                    if k is not None:
                        r.arg_keys.setdefault(k, where)
            for prefix in running_stats(module):
                # BatchNorm's kernels write running_mean/var without an op that says so
                r.cost.inexact.setdefault(
                    "state_write", f"{named_blocks[i][0]}.{prefix}running_mean/running_var are updated in forward")
            r.state_names = {}
            for name, t in list(module.named_parameters()) + list(module.named_buffers()):
                k = _storage_key(t)
                if k is not None:
                    r.state_names.setdefault(k, f"{named_blocks[i][0]}.{name}")
            for t in _tensors((args, kwargs)):
                k = _storage_key(t)
                if k is not None and k in rec_mode.fresh and k not in owner and k not in r.input_keys:
                    r.input_keys.append(k)
                    owner[k] = ("block", c)
                    r.cost.input_sizes.append(k[2])
                    r.cost.input_dtypes.append(_dtype_name(t))
                    r.cost.input_spans.append(_C.span_bytes(t))
            rec_mode.block = r
        return hook

    def post_hook(i):
        def hook(module, args, kwargs, output):
            if state["current"] != i:
                return
            r = calls[state["call"]]
            for k, _ in r.selective_refs.items():
                r.cost.selective.append(k[2])
                r.cost.selective_saved.append(r.keys.get(k, -1))
                r.cost.selective_last_use.append(r.selective_uses.get(k, len(r.cost.packs)))
            r.selective_refs = {}
            for t in _tensors(output):
                if t.requires_grad:
                    state["requires_grad"] = True
                    t.register_hook(reached)
                    break
            state["current"] = None
            state["done"].add(i)
            state["last_out"] = (i, output)  # held until the next block starts (check_chain)
            rec_mode.block = None
        return hook

    def pack(t):
        k = _storage_key(t)
        if state["current"] is not None:
            c = state["call"]
            calls[c].cost.nodes.append(-1)
            calls[c].cost.pack_dtypes.append(_dtype_name(t))
            calls[c].cost.pack_spans.append(_C.span_bytes(t))
            calls[c].cost.pack_starts.append((t.storage_offset() * t.element_size(), t._version))
            pack_block(t, k, c)
            return _Packed(t, c, len(calls[c].cost.nodes) - 1)
        return _pack_outside(t, k)

    def _pack_outside(t, k):
        if k is None or k not in rec_mode.fresh:
            return t
        where = "post" if state["done"] else "pre"
        if k not in owner:
            owner[k] = (where,)
            outside[where][k] = k[2]
        return t

    def unpack(p):
        if isinstance(p, _Packed):
            # A node unpacks all its saved tensors before running any op of its backward: tensors
            # unpacked with no op between them belong to one node (and are freed together).
            calls[p.block].cost.nodes[p.pos] = rec_mode.count
            return p.t
        return p

    def pack_block(t, k, c):
        if k is None or k not in rec_mode.fresh:
            calls[c].cost.packs.append(-1)
            return
        r = calls[c]
        pos = len(r.cost.packs)
        if k in r.keys:
            idx = r.keys[k]
            r.cost.storages[idx].last = pos
        elif k not in owner or owner[k] == ("block", c):
            owner[k] = ("block", c)
            idx = r.keys[k] = len(r.cost.storages)
            r.cost.storages.append(Storage(k[2], pos, pos, is_input=k in r.input_keys))
        else:
            idx = -1  # owned by an earlier block (or call) or saved before the blocks
        r.cost.packs.append(idx)

    handles = []
    for i, (_, m) in enumerate(named_blocks):
        handles.append(m.register_forward_pre_hook(pre_hook(i), with_kwargs=True))
        handles.append(m.register_forward_hook(post_hook(i), with_kwargs=True))
    try:
        with rec_mode, torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            step()
        sync()
    finally:
        for h in handles:
            h.remove()
        state.pop("last_out", None)
    missing = [named_blocks[i][0] for i in range(len(recs)) if i not in state["done"]]
    if missing:
        raise ValueError(f"co.plan: step() never ran block(s) {missing[:4]}: pass layers= selecting blocks "
                         "that step() calls, or a step that runs the model's forward and backward")
    if not state["grad"]:
        raise ValueError("co.plan: step() ran the blocks with gradients disabled (under torch.no_grad() or "
                         "torch.inference_mode()), so they save nothing for backward and there is nothing to plan: "
                         "pass a training step, e.g. lambda: loss_fn(model(x)).backward(), run with gradients "
                         "enabled")
    if not state["requires_grad"]:
        raise ValueError("co.plan: no output of the blocks requires a gradient (their parameters are frozen and "
                         "their inputs need none), so backward never reaches them and there is nothing to plan: "
                         "plan a step that trains parameters of the blocks (or whose input requires grad)")
    if not state["backward"]:
        raise ValueError("co.plan: step() never ran backward through the blocks, so what they save for backward "
                         "cannot be measured: pass a step that runs forward and backward, e.g. "
                         "lambda: loss_fn(model(x)).backward()")
    for r in calls:
        r._fraction_dropped = (1.0 - r.saved_op_s / r.op_s) if r.op_s > 0 else 1.0
    for i, r in enumerate(recs):
        r.cost = _joined(r.cost.name, [cr.cost for cr, b in zip(calls, call_order) if b == i])
        r.cost.calls = r.calls
        mine = [cr for cr, b in zip(calls, call_order) if b == i]
        op_s = sum(cr.op_s for cr in mine)
        r._fraction_dropped = (1.0 - sum(cr.saved_op_s for cr in mine) / op_s) if op_s > 0 else 1.0
    for i, why in unchained.items():
        recs[i].cost.inexact.setdefault(UNCHAINED, why)
    pre = sum(outside["pre"].values())
    post = sum(outside["post"].values())
    return recs, pre, post, calls, call_order


def _joined(name, costs) -> BlockCost:
    """One block's calls as one :class:`BlockCost`: their saved tensors one after another (what
    the block saves in a step), their times summed."""
    out = BlockCost(name)
    for c in costs:
        s0, p0 = len(out.storages), len(out.packs)
        out.storages += [Storage(s.nbytes, s.first + p0, s.last + p0, s.is_input) for s in c.storages]
        out.packs += [p + s0 if p >= 0 else -1 for p in c.packs]
        out.nodes += c.nodes
        out.input_sizes += c.input_sizes
        out.pack_dtypes += c.pack_dtypes
        out.pack_spans += c.pack_spans
        out.pack_starts += c.pack_starts
        out.input_dtypes += c.input_dtypes
        out.input_spans += c.input_spans
        out.selective += c.selective
        out.selective_saved += [x + s0 if x >= 0 else -1 for x in c.selective_saved]
        out.selective_last_use += [u + p0 for u in c.selective_last_use]
        out.forward_s += c.forward_s
        out.backward_s += c.backward_s
        out.selective_recompute_s += c.selective_recompute_s
        for k, v in c.inexact.items():
            out.inexact.setdefault(k, v)
    out.calls = len(costs)
    return out


def _measure_times(step, named_blocks, device):
    """Run 2: compute seconds per block call, forward (hooks) and backward (hooks on the gradients
    of the call's output and input), and the step's total. Returns per call (execution order)
    ``fwd``, ``bwd``, then ``pre``, ``mid``, ``post`` and ``total``."""
    sync = _sync_for(device)
    fwd_start, fwd_end, bwd_start, bwd_end = [], [], [], []  # per call
    active = {"i": None}

    def stamp(arr, c):
        def hook(*_):
            if arr[c] is None:
                sync()
                arr[c] = time.perf_counter()
        return hook

    def pre_hook(i):
        def hook(module, args, kwargs):
            if active["i"] is not None:
                return
            active["i"] = i
            c = len(fwd_start)
            for arr in (fwd_start, fwd_end, bwd_start, bwd_end):
                arr.append(None)
            for t in _tensors((args, kwargs)):
                if t.requires_grad:
                    t.register_hook(stamp(bwd_end, c))
                    break
            sync()
            fwd_start[c] = time.perf_counter()
        return hook

    def post_hook(i):
        def hook(module, args, kwargs, output):
            if active["i"] != i:
                return
            active["i"] = None
            c = len(fwd_start) - 1
            sync()
            fwd_end[c] = time.perf_counter()
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(stamp(bwd_start, c))
                    break
        return hook

    handles = []
    for i, (_, m) in enumerate(named_blocks):
        handles.append(m.register_forward_pre_hook(pre_hook(i), with_kwargs=True))
        handles.append(m.register_forward_hook(post_hook(i), with_kwargs=True))
    try:
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        t1 = time.perf_counter()
    finally:
        for h in handles:
            h.remove()
    n = len(fwd_start)
    fwd = [max(0.0, (e or 0) - (s or 0)) for s, e in zip(fwd_start, fwd_end)]
    bwd = []
    for c in range(n):
        s, e = bwd_start[c], bwd_end[c]
        if s is None or e is None or e < s:
            bwd.append(None)
        else:
            bwd.append(e - s)
    known = [b for b in bwd if b is not None]
    ratio = (sum(known) / sum(f for f, b in zip(fwd, bwd) if b is not None)) if known and sum(fwd) > 0 else 2.0
    bwd = [b if b is not None else ratio * f for f, b in zip(fwd, bwd)]
    total = t1 - t0
    pre = (fwd_start[0] - t0) if n and fwd_start[0] else 0.0
    last_fwd = (fwd_end[-1] if n else None) or t0
    first_bwd = (bwd_start[-1] if n else None) or last_fwd
    mid = max(0.0, first_bwd - last_fwd)
    post = max(0.0, total - pre - mid - sum(fwd) - sum(bwd))
    return fwd, bwd, pre, mid, post, total


def measure_bandwidth(device: str = "cpu", nbytes: int = 8 << 20) -> Bandwidth:
    """Times copies through a fresh host pool with ckpt_offload's engine (side stream): one small and
    one ``nbytes`` tensor each way; the small one gives the per-copy latency, the difference the
    bandwidth, and 16 small ones issued back to back the queue time per copy (``issue``).

    Example::

        bw = measure_bandwidth("cuda")      # Bandwidth(d2h=..., h2d=..., latency=..., issue=...)
    """

    pool = HostPool(pinned=None if device == "cuda" else False)
    sync = _sync_for(device)
    small, big = 4096, max(int(nbytes), 1 << 20)

    def timed(n, count=1, reps=3):
        """The best of ``reps`` times of ``count`` copies of ``n`` bytes issued back to back, each way."""
        xs = [torch.empty(n // 4, dtype=torch.float32, device=device).fill_(1.0) for _ in range(count)]
        d2h, h2d = [], []
        for _ in range(reps):
            sync()
            t0 = time.perf_counter()
            hs = [offload_tensor(x, pool=pool) for x in xs]
            synchronize()
            sync()
            t1 = time.perf_counter()
            ys = [h.reload() for h in hs]
            sync()
            synchronize()
            t2 = time.perf_counter()
            d2h.append(t1 - t0)
            h2d.append(t2 - t1)
            del ys, hs
        return min(d2h), min(h2d)

    timed(small, reps=1)  # warm-up: the pool's first segment, the copy threads
    s_d, s_h = timed(small)
    b_d, b_h = timed(big)
    latency = max(0.0, min(s_d, s_h))
    d2h = (big - small) / max(b_d - s_d, 1e-9)
    h2d = (big - small) / max(b_h - s_h, 1e-9)
    # n copies back to back end (n - 1) * issue + latency after the first starts (Note [Copy
    # latency is a delay]); the bytes' own time is taken out.
    count = 16
    m_d, m_h = timed(small, count)
    issue_d = (m_d - s_d - (count - 1) * small / d2h) / (count - 1)
    issue_h = (m_h - s_h - (count - 1) * small / h2d) / (count - 1)
    issue = min(latency, max(0.0, min(issue_d, issue_h)))
    return Bandwidth(d2h=d2h, h2d=h2d, latency=latency, issue=issue)


def measure_costs(step, named_blocks, device: str = "cpu", bandwidth: Bandwidth | None = None,
                  min_bytes: int = 0) -> CostModel:
    """Measures a :class:`CostModel` for ``step`` (one forward + backward) over ``named_blocks``
    (``[(name, module), ...]`` in execution order). Runs the step three times: a warm-up, one
    instrumented for bytes, one timed; the last also gives the baseline step time.

    Example::

        cm = measure_costs(lambda: model(x).sum().backward(), list(model.layers.named_children()))
    """
    step()  # warm-up: gradients exist, lazy initialisation done, allocator warm
    recs, pre_b, post_b, calls, call_order = _measure_bytes(step, named_blocks, device, min_bytes)
    fwd, bwd, pre_s, mid_s, post_s, total = _measure_times(step, named_blocks, device)
    if len(fwd) != len(calls):  # the step ran its blocks differently the second time: no per-call times
        f1 = {i: f for i, f in enumerate(fwd)}
        fwd = [f1.get(c, 0.0) for c in range(len(calls))]
        bwd = [bwd[c] if c < len(bwd) else 2.0 * fwd[c] for c in range(len(calls))]
    for r, f, b in zip(calls, fwd, bwd):
        c = r.cost
        c.forward_s, c.backward_s = f, b
        c.selective_recompute_s = f * r._fraction_dropped
    blocks = []
    for i, r in enumerate(recs):
        c = r.cost
        mine = [k for k, b in enumerate(call_order) if b == i]
        c.forward_s = sum(fwd[k] for k in mine)
        c.backward_s = sum(bwd[k] for k in mine)
        c.selective_recompute_s = c.forward_s * r._fraction_dropped
        blocks.append(c)
    in_order = call_order == list(range(len(recs)))
    if bandwidth is None:
        bandwidth = measure_bandwidth(device, (32 << 20) if device == "cuda" else (2 << 20))
    bw = bandwidth
    rng = torch.get_rng_state().nbytes if device == "cpu" else 0
    return CostModel(blocks=blocks, bandwidth=bw, min_bytes=min_bytes, pre_bytes=pre_b, post_bytes=post_b,
                     pre_s=pre_s, mid_s=mid_s, post_s=post_s, baseline_step_s=total, device=device,
                     checkpoint_bytes=rng, call_order=[] if in_order else call_order,
                     call_blocks=[] if in_order else [r.cost for r in calls])
