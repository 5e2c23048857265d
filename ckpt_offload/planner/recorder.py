"""The instrumented run of the user's step that measures its bytes: which saved tensors each block
call saves (saved-tensor hooks), which storages ops freshly allocate and which outputs selective
recompute would keep (a dispatch mode, :class:`_Recorder`), what makes a block's recompute inexact,
and whether each block hands its output on as a segment would. See
:mod:`ckpt_offload.planner.costs` for what is counted."""

from __future__ import annotations

import functools
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ckpt_offload._runtime import _C
from ckpt_offload.blocks.chain import hidden, hidden_key, running_stats, unchained_reason
from ckpt_offload.planner.costs import UNCHAINED, BlockCost, Storage
from ckpt_offload.planner.timing import sync_for, tensors_in
from ckpt_offload.selective import SELECTIVE_SAVE_OPS

__all__ = ["measure_bytes"]

_SAVE_PACKETS = {op for op in SELECTIVE_SAVE_OPS}


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


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


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


def measure_bytes(step, named_blocks, device, min_bytes):
    """Run 1: saved tensors per block (saved_tensors_hooks), fresh storages and selective outputs
    (a dispatch mode)."""
    run = _BytesRun(named_blocks, sync_for(device))
    run.record(step)
    return run.result()


class _BytesRun:
    """One instrumented run of the step (:func:`measure_bytes`): the blocks' forward hooks, the
    saved-tensor hooks and the dispatch mode, and what they record."""

    def __init__(self, named_blocks, sync):
        self.named_blocks = named_blocks
        self.sync = sync
        self.recs = [_BlockRecord(n) for n, _ in named_blocks]
        # Every call of a block is recorded on its own (a block called twice saves two sets of tensors,
        # which backward frees call by call); recs[i] gets block i's calls joined afterwards.
        self.calls, self.call_order = [], []  # per call: its _BlockRecord, its block's index
        self.owner = {}  # storage key -> ("block", call) | ("pre",) | ("post",)
        self.outside = {"pre": {}, "post": {}}
        # grad: a block ran with gradients enabled; requires_grad: a block's output needs a gradient;
        # backward: a gradient reached one
        self.state = state = {
            "current": None,
            "done": set(),
            "started": False,
            "grad": False,
            "requires_grad": False,
            "backward": False,
        }

        def reached(_):
            state["backward"] = True

        self.reached = reached
        self.rec_mode = _Recorder(sync)

        # Whether a segment could run block i+1 inside block i's checkpoint: the model must call it
        # right after block i with block i's output (or its first element) as its first argument,
        # as a segment does (blocks/chain.py). unchained[i]: why not, between i and i+1.
        self.unchained = {}

    def check_chain(self, i, module, args, kwargs):
        named_blocks = self.named_blocks
        last = self.state.pop("last_out", None)
        if last is None or last[0] != i - 1:
            return
        out = last[1]
        why = unchained_reason(out)
        if why is None:
            key = hidden_key(module)
            given = args[0] if args else kwargs.get(key, last)
            if given is last:
                why = (
                    f"is followed by {named_blocks[i][0]}, which the model calls by keyword without "
                    f"{key}= (its forward's first parameter), while a segment passes the hidden state so"
                )
            elif given is not hidden(out):
                why = (
                    f"is followed by {named_blocks[i][0]}, whose first argument is not its output (or the "
                    "output's first element), while a segment passes exactly that"
                )
        if why is not None:
            self.unchained.setdefault(i - 1, why)

    def before(self, i, module, args, kwargs):
        """Block ``i``'s forward pre-hook: a new call of it starts being recorded."""
        state, named_blocks, rec_mode, owner = self.state, self.named_blocks, self.rec_mode, self.owner
        if state["current"] is not None:
            return  # a block inside a block: attributed to the outer one
        self.check_chain(i, module, args, kwargs)
        state["current"] = i
        state["started"] = True
        self.recs[i].calls += 1
        r = _BlockRecord(named_blocks[i][0])
        c = state["call"] = len(self.calls)
        self.calls.append(r)
        self.call_order.append(i)
        state["grad"] |= torch.is_grad_enabled()
        r.own = set()
        r.arg_keys = {}
        named_args = [(f"input {j}", a) for j, a in enumerate(args)] + [
            (f"argument {name!r}", v) for name, v in kwargs.items()
        ]
        for where, a in named_args:
            for t in tensors_in(a):
                k = _storage_key(t)
                if k is not None:
                    r.arg_keys.setdefault(k, where)
        for prefix in running_stats(module):
            # BatchNorm's kernels write running_mean/var without an op that says so
            r.cost.inexact.setdefault(
                "state_write", f"{named_blocks[i][0]}.{prefix}running_mean/running_var are updated in forward"
            )
        r.state_names = {}
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            k = _storage_key(t)
            if k is not None:
                r.state_names.setdefault(k, f"{named_blocks[i][0]}.{name}")
        for t in tensors_in((args, kwargs)):
            k = _storage_key(t)
            if k is not None and k in rec_mode.fresh and k not in owner and k not in r.input_keys:
                r.input_keys.append(k)
                owner[k] = ("block", c)
                r.cost.input_sizes.append(k[2])
                r.cost.input_dtypes.append(_dtype_name(t))
                r.cost.input_spans.append(_C.span_bytes(t))
        rec_mode.block = r

    def after(self, i, module, args, kwargs, output):
        """Block ``i``'s forward hook: the call being recorded ends."""
        state = self.state
        if state["current"] != i:
            return
        r = self.calls[state["call"]]
        for k, _ in r.selective_refs.items():
            r.cost.selective.append(k[2])
            r.cost.selective_saved.append(r.keys.get(k, -1))
            r.cost.selective_last_use.append(r.selective_uses.get(k, len(r.cost.packs)))
        r.selective_refs = {}
        for t in tensors_in(output):
            if t.requires_grad:
                state["requires_grad"] = True
                t.register_hook(self.reached)
                break
        state["current"] = None
        state["done"].add(i)
        state["last_out"] = (i, output)  # held until the next block starts (check_chain)
        self.rec_mode.block = None

    def pack(self, t):
        calls = self.calls
        k = _storage_key(t)
        if self.state["current"] is not None:
            c = self.state["call"]
            calls[c].cost.nodes.append(-1)
            calls[c].cost.pack_dtypes.append(_dtype_name(t))
            calls[c].cost.pack_spans.append(_C.span_bytes(t))
            calls[c].cost.pack_starts.append((t.storage_offset() * t.element_size(), t._version))
            self.pack_block(t, k, c)
            return _Packed(t, c, len(calls[c].cost.nodes) - 1)
        return self._pack_outside(t, k)

    def _pack_outside(self, t, k):
        if k is None or k not in self.rec_mode.fresh:
            return t
        where = "post" if self.state["done"] else "pre"
        if k not in self.owner:
            self.owner[k] = (where,)
            self.outside[where][k] = k[2]
        return t

    def unpack(self, p):
        if isinstance(p, _Packed):
            # A node unpacks all its saved tensors before running any op of its backward: tensors
            # unpacked with no op between them belong to one node (and are freed together).
            self.calls[p.block].cost.nodes[p.pos] = self.rec_mode.count
            return p.t
        return p

    def pack_block(self, t, k, c):
        calls, owner = self.calls, self.owner
        if k is None or k not in self.rec_mode.fresh:
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

    def record(self, step) -> None:
        """Runs ``step`` once under the hooks and the dispatch mode."""
        handles = []
        for i, (_, m) in enumerate(self.named_blocks):
            handles.append(m.register_forward_pre_hook(functools.partial(self.before, i), with_kwargs=True))
            handles.append(m.register_forward_hook(functools.partial(self.after, i), with_kwargs=True))
        try:
            with self.rec_mode, torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                step()
            self.sync()
        finally:
            for h in handles:
                h.remove()
            self.state.pop("last_out", None)

    def result(self):
        """``(recs, pre, post, calls, call_order)``: per block its calls joined, the bytes saved
        before and after the blocks, per call its record and its block; raises where the step gave
        nothing to plan."""
        named_blocks, recs, calls, call_order = self.named_blocks, self.recs, self.calls, self.call_order
        state, outside = self.state, self.outside
        missing = [named_blocks[i][0] for i in range(len(recs)) if i not in state["done"]]
        if missing:
            raise ValueError(
                f"co.plan: step() never ran block(s) {missing[:4]}: pass layers= selecting blocks "
                "that step() calls, or a step that runs the model's forward and backward"
            )
        if not state["grad"]:
            raise ValueError(
                "co.plan: step() ran the blocks with gradients disabled (under torch.no_grad() or "
                "torch.inference_mode()), so they save nothing for backward and there is nothing to plan: "
                "pass a training step, e.g. lambda: loss_fn(model(x)).backward(), run with gradients "
                "enabled"
            )
        if not state["requires_grad"]:
            raise ValueError(
                "co.plan: no output of the blocks requires a gradient (their parameters are frozen and "
                "their inputs need none), so backward never reaches them and there is nothing to plan: "
                "plan a step that trains parameters of the blocks (or whose input requires grad)"
            )
        if not state["backward"]:
            raise ValueError(
                "co.plan: step() never ran backward through the blocks, so what they save for backward "
                "cannot be measured: pass a step that runs forward and backward, e.g. "
                "lambda: loss_fn(model(x)).backward()"
            )
        for r in calls:
            r._fraction_dropped = (1.0 - r.saved_op_s / r.op_s) if r.op_s > 0 else 1.0
        for i, r in enumerate(recs):
            r.cost = _joined(r.cost.name, [cr.cost for cr, b in zip(calls, call_order) if b == i])
            r.cost.calls = r.calls
            mine = [cr for cr, b in zip(calls, call_order) if b == i]
            op_s = sum(cr.op_s for cr in mine)
            r._fraction_dropped = (1.0 - sum(cr.saved_op_s for cr in mine) / op_s) if op_s > 0 else 1.0
        for i, why in self.unchained.items():
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
