"""An event simulator of one training step under a plan.

Three queues: the compute stream, a device-to-host (D2H) and a host-to-device (H2D) copy queue, each
copy holding its queue for ``issue + bytes / bandwidth`` and ending ``latency + bytes / bandwidth``
after it starts (the latency is a delay, not queue time: Note [Copy latency is a delay]). Forward: offloaded storages
are copied after their
block's forward and leave the device when their copy is done (the copy *backlog* is device memory).
Backward walks the blocks in reverse, saved tensor by saved tensor (the pack order the cost model
recorded), and reproduces the engine's prefetcher: every unpack of an offloaded storage starts the
reloads of the storages packed just before it while fewer than ``prefetch_bytes`` prefetched bytes
wait unused; an unpack whose storage is not on the device reloads it on demand and the compute
stream waits. A storage leaves the device after the backward of the first tensor that saved it (what
autograd does), a checkpoint's input at the end of its segment's backward.

The memory it predicts is the device memory of saved activations (kept, recomputed, reloaded or
prefetched, and offloaded ones whose copy has not finished), the quantity
:func:`ckpt_offload.planner.saved_peak.saved_activation_peak` measures.

A unit with ``store=True`` keeps what it offloads in the cost model's narrower ``store_dtype``
(``co.offload(store_dtype=...)``), as the engine does: each saved tensor of a converted storage is
(unless it is exactly an earlier one's span, which shares that one's copy and full-width tensor)
converted on the compute stream (``Bandwidth.convert_seconds`` of its full-width bytes) into a
narrow staging tensor, which its D2H copy reads (the copy backlog is narrow bytes) and the
storage leaves the device after its last conversion; in backward the narrow bytes come back (the
prefetch window counts them), are converted up on the compute stream into a full-width tensor
of the copy's own (not shared with the storage's other copies), which autograd frees after the
last node that unpacked it. Storages the storage dtype does not convert (integers,
bool, narrower floats) go the exact way. Lossy units run in a co.offload context of their own,
with its own prefetch window, apart from the exact units' one.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

# The vocabulary of units lives with the block installer's, so both read one definition.
from ckpt_offload._units import (  # noqa: F401
    INNER_KINDS,
    KINDS,
    OFFLOADING_KINDS,
    SEGMENT_KINDS,
    STORE_KINDS,
    Unit,
    choice_names,
)
from ckpt_offload.planner.lossy import converted_inputs, converted_packs, converted_shares

__all__ = ["Unit", "SimResult", "simulate", "KINDS", "SEGMENT_KINDS", "INNER_KINDS", "STORE_KINDS", "choice_names"]


def singles(kinds) -> list:
    """``["keep", "offload", ...]`` -> one :class:`Unit` per block."""
    return [Unit(i, i, k) for i, k in enumerate(kinds)]


@dataclass
class SimResult:
    """``peak_bytes``: device peak of saved activations; ``step_s``: step time; ``timeline``: (time,
    bytes) after every change; ``units``: per unit ``dict(device_bytes, pool_bytes, recompute_s,
    copy_s, stall_s, convert_s)`` (``pool_bytes``: host bytes, narrow ones for a lossy unit;
    ``convert_s``: its conversions, both ways); ``forward_end_s``; ``feasible``: False when a copy
    would never end (no link)."""

    peak_bytes: int
    step_s: float
    timeline: list = field(default_factory=list)
    units: list = field(default_factory=list)
    forward_end_s: float = 0.0
    feasible: bool = True


class _Queue:
    def __init__(self, bw, direction):
        self.bw, self.dir, self.free = bw, direction, 0.0

    def copy(self, t, nbytes, copies=1):
        """Queues a copy at ``t``; returns when its bytes have arrived. The queue is held for its
        issue cost and bytes, its latency only delays its own end (Note [Copy latency is a
        delay] in costs.py)."""
        start = max(t, self.free)
        self.free = start + self.bw.queue_seconds(nbytes, copies, self.dir)
        return start + self.bw.copy_seconds(nbytes, copies, self.dir)


class _Handle:
    """An offloaded storage as the engine's Prefetcher sees it (``group``: its context's, lossy
    or exact; ``full``: a converted tensor's full-width bytes, 0 for an exact storage)."""

    __slots__ = ("nbytes", "pending", "staged", "ready", "resident", "seq", "group", "full", "up", "users")

    def __init__(self, nbytes, pending, seq, group=False, full=0):
        self.nbytes, self.pending, self.seq = nbytes, pending, seq
        self.staged = False  # prefetched, not yet unpacked
        self.ready = 0.0
        self.resident = False  # reloaded and still on the device
        self.group, self.full = group, full
        self.up = False  # a converted copy's full-width tensor is on the device
        self.users = pending  # saved tensors over a converted copy whose node has not finished


def simulate(costs, units, prefetch_bytes: int = 0) -> SimResult:
    """Simulates one step of ``costs`` (a :class:`~ckpt_offload.planner.costs.CostModel`) under
    ``units`` (a list of :class:`Unit` covering every block once, in order).

    Example::

        r = simulate(cm, singles(["offload"] * len(cm.blocks)), prefetch_bytes=64 << 20)
        r.peak_bytes, r.step_s
    """
    _check_units(units, len(costs.blocks))
    if getattr(costs, "call_order", None):
        return _simulate_calls(costs, units, prefetch_bytes)
    step = _Step(costs, units, prefetch_bytes)
    for run, arg in step.schedule():
        run(arg)
    return step.result()


class _Step:
    """One simulated step: its clock, its queues, the device memory changes it records, and the
    named steps :func:`simulate` runs in order (:meth:`schedule`): the work before the blocks,
    each unit's forward, the loss between forward and backward, each unit's backward (last unit
    first), the work after. Memory is a list of ``(time, order, delta)`` events, sorted at the end
    (:meth:`result`); ``order`` keeps equal times in the order they were recorded."""

    def __init__(self, costs, units, prefetch_bytes):
        self.costs, self.units = costs, units
        self.blocks, self.bw, self.min_bytes = costs.blocks, costs.bandwidth, costs.min_bytes
        self.events = []  # (time, order, delta)
        self.d2h, self.h2d = _Queue(self.bw, "d2h"), _Queue(self.bw, "h2d")
        self.infos = [
            dict(device_bytes=0, pool_bytes=0, recompute_s=0.0, copy_s=0.0, stall_s=0.0, convert_s=0.0) for _ in units
        ]
        self.feasible = True
        self.store = getattr(costs, "store_dtype", None)
        if self.store is None and any(u.store for u in units):
            raise ValueError("units store lossy (Unit.store) but costs.store_dtype is None: set the storage dtype")
        # pack order of offloaded storages, per co.offload context: the exact units' (False), the
        # lossy units' (True) and the selective_offload units' ("selective": the policy's context),
        # each with its own prefetcher
        self.groups = {False: [], True: [], "selective": []}
        # (unit index, block, storage index) -> _Handle ; (unit, "input", j) -> _Handle ;
        # (unit, block, storage index, pack position) -> _Handle of one converted saved tensor
        self.handles = {}
        self.outstanding = {False: 0, True: 0, "selective": 0}  # prefetched bytes waiting, per context
        self.prefetch_bytes = max(0, int(prefetch_bytes))
        self.cb = getattr(costs, "checkpoint_bytes", 0)
        self.t = 0.0  # the compute stream's clock
        self.forward_end = 0.0

    def schedule(self):
        """The steps in the order they run: ``(step, argument)``."""
        yield self.before_blocks, None
        for ui in range(len(self.units)):
            yield self.forward, ui
        yield self.loss, None
        for ui in range(len(self.units) - 1, -1, -1):
            yield self.backward, ui
        yield self.after_blocks, None

    # -- bookkeeping ----------------------------------------------------------------------------

    def mem(self, t, delta):
        if delta:
            self.events.append((t, len(self.events), delta))

    def new_handle(self, nbytes, pending, group, full=0):
        h = _Handle(nbytes, pending, len(self.groups[group]), group, full)
        self.groups[group].append(h)
        return h

    def offloadable(self, n):
        return n >= self.min_bytes and n > 0

    def copy_out(self, info, t, nbytes):
        """A D2H copy of ``nbytes`` queued at ``t``; they leave the device when it is done."""
        done = self.d2h.copy(t, nbytes)
        info["copy_s"] += self.bw.copy_seconds(nbytes, 1, "d2h")
        self.feasible &= math.isfinite(done)
        self.mem(done, -nbytes)
        info["pool_bytes"] += nbytes

    # -- the steps --------------------------------------------------------------------------------

    def before_blocks(self, _):
        self.mem(self.t, self.costs.pre_bytes)
        self.t += self.costs.pre_s

    def forward(self, ui):
        u, info = self.units[ui], self.infos[ui]
        self.mem(self.t, self.cb * u.checkpoints)  # each checkpoint's copy of the random state, until its backward ends
        if u.kind in ("recompute", "recompute_offload"):
            self.checkpoint_inputs(ui)
        for bi in range(u.start, u.end + 1):
            b = self.blocks[bi]
            t0 = self.t
            self.t += b.forward_s
            if u.kind == "keep":
                self.mem(self.t, b.saved_bytes)
                info["device_bytes"] += b.saved_bytes
            elif u.kind == "offload":
                self.offload_forward(ui, bi, t0)
            elif u.kind == "selective":
                extra = sum(n for n, si in zip(b.selective, b.selective_saved))
                self.mem(self.t, extra + b.input_bytes)
                info["device_bytes"] += extra + b.input_bytes
            elif u.kind == "selective_offload":
                self.selective_offload_forward(ui, bi, t0)

    def checkpoint_inputs(self, ui):
        """A checkpoint's inputs: kept, or (recompute_offload) copied to the host, converted first
        for a lossy unit (on the compute stream; the input leaves the device once converted)."""
        u, info = self.units[ui], self.infos[ui]
        first, bw = self.blocks[u.start], self.bw
        held = 0
        conv_in = converted_inputs(first, self.store) if u.store else [None] * len(first.input_sizes)
        for j, n in enumerate(first.input_sizes):
            self.mem(self.t, n)
            if u.kind == "recompute_offload" and self.offloadable(n) and conv_in[j] is not None:
                span, narrow = conv_in[j]
                c = bw.convert_seconds(span)
                self.t += c
                info["convert_s"] += c
                self.handles[(ui, "input", j)] = self.new_handle(narrow, 1, True, full=n)
                self.mem(self.t, narrow - n)
                self.copy_out(info, self.t, narrow)
            elif u.kind == "recompute_offload" and self.offloadable(n):
                self.handles[(ui, "input", j)] = self.new_handle(n, 1, u.store)
                self.copy_out(info, self.t, n)
            else:
                held += n
        info["device_bytes"] = held

    def offload_forward(self, ui, bi, t0):
        """An offloaded block's forward: each storage is packed (and its copy queued) when the op
        that saves it first runs, at its first pack position, spread evenly over the forward."""
        u, info, b, bw = self.units[ui], self.infos[ui], self.blocks[bi], self.bw
        pending = [0] * len(b.storages)
        for p in b.packs:
            if p >= 0:
                pending[p] += 1
        k = max(1, len(b.packs))
        conv = converted_packs(b, self.store) if u.store else {}
        conv = {si: v for si, v in conv.items() if self.offloadable(b.storages[si].nbytes)}
        dur = b.forward_s
        if conv:  # the conversions run on the compute stream, inside the block's forward
            c = sum(bw.convert_seconds(span) for v in conv.values() for _, span, _ in v)
            info["convert_s"] += c
            dur += c
            self.t = t0 + dur
        for si, s in enumerate(b.storages):
            tp = t0 + dur * (s.first + 1) / k
            self.mem(tp, s.nbytes)
            if si in conv:
                last = tp
                sharers = {}
                for p2, p1 in converted_shares(b, self.store).items():
                    sharers.setdefault(p1, []).append(p2)
                for pos, span, narrow in conv[si]:
                    tq = t0 + dur * (pos + 1) / k
                    # one copy for it and the saved tensors of exactly its span
                    h = self.new_handle(narrow, 1 + len(sharers.get(pos, ())), True, full=span)
                    self.handles[(ui, bi, si, pos)] = h
                    for p2 in sharers.get(pos, ()):
                        self.handles[(ui, bi, si, p2)] = h
                    self.mem(tq, narrow)
                    self.copy_out(info, tq, narrow)
                    last = max(last, tq)
                self.mem(last, -s.nbytes)
            elif self.offloadable(s.nbytes):
                self.handles[(ui, bi, si)] = self.new_handle(s.nbytes, pending[si], u.store)
                self.copy_out(info, tp, s.nbytes)
            else:
                info["device_bytes"] += s.nbytes

    def selective_offload_forward(self, ui, bi, t0):
        """The checkpoint's input stays; each output the policy keeps is copied to the pool as its
        op ends (spread over the block's forward) and leaves the device once copied."""
        info, b = self.infos[ui], self.blocks[bi]
        self.mem(self.t, b.input_bytes)
        info["device_bytes"] += b.input_bytes
        k = max(1, len(b.selective))
        for j, n in enumerate(b.selective):
            tp = t0 + b.forward_s * (j + 1) / k
            self.mem(tp, n)
            if self.offloadable(n):
                self.handles[(ui, "selective", j)] = self.new_handle(n, 1, "selective")
                self.copy_out(info, tp, n)
            else:
                info["device_bytes"] += n

    def loss(self, _):
        """Between the last block's forward and the last block's backward: the model's head, the
        loss and its backward, whose activations live only there."""
        self.forward_end = self.t
        self.mem(self.t, self.costs.post_bytes)
        self.t += self.costs.mid_s
        self.mem(self.t, -self.costs.post_bytes)

    def backward(self, ui):
        u, info = self.units[ui], self.infos[ui]
        first = self.blocks[u.start]
        if u.kind in ("recompute", "recompute_offload"):
            for j in range(len(first.input_sizes)):
                h = self.handles.get((ui, "input", j))
                if h is not None and not self.unpack(h, info):
                    self.feasible = False
            self.recompute_backward(ui, u, info)
            self.mem(self.t, -first.input_bytes - self.cb)
        elif u.kind in ("selective", "selective_offload"):
            self.selective_backward(ui, u, info)
        else:
            for bi in range(u.end, u.start - 1, -1):
                self.block_backward(ui, u.kind, bi, info, skip_input=False)

    def after_blocks(self, _):
        self.t += self.costs.post_s
        self.mem(self.t, -self.costs.pre_bytes)

    # -- backward's parts ---------------------------------------------------------------------------

    def prefetch_after(self, h):
        """Prefetcher::after_unpack: walk down from this handle, prefetch while the window allows."""
        i, scanned = h.seq, 0
        handles = self.groups[h.group]
        while i > 0 and scanned < 64:
            i -= 1
            scanned += 1
            r = handles[i]
            if r.pending <= 0 or r.staged or r.resident:
                continue
            if self.outstanding[h.group] + r.nbytes > self.prefetch_bytes:
                break
            self.outstanding[h.group] += r.nbytes
            r.staged = True
            self.mem(self.t, r.nbytes)
            r.ready = self.h2d.copy(self.t, r.nbytes)

    def unpack(self, h, info):
        """One saved tensor of an offloaded storage is unpacked (advancing the clock by what it
        waits for); False when its reload would never end (no link)."""
        if h.staged:
            h.staged = False
            self.outstanding[h.group] -= h.nbytes
            h.resident = True
            if h.ready > self.t:
                info["stall_s"] += h.ready - self.t
                self.t = h.ready
        elif not h.resident:
            self.mem(self.t, h.nbytes)
            done = self.h2d.copy(self.t, h.nbytes)
            info["copy_s"] += self.bw.copy_seconds(h.nbytes, 1, "h2d")
            if not math.isfinite(done):
                return False
            info["stall_s"] += done - self.t
            self.t = done
            h.resident = True
        h.pending -= 1
        self.prefetch_after(h)
        if h.full and not h.up:
            # Then (the engine's narrow unpack has started the next prefetches already) converted
            # up on the compute stream into a full-width tensor; the narrow one goes after. The
            # saved tensors sharing the copy share that tensor.
            h.up = True
            self.mem(self.t, h.full)
            c = self.bw.convert_seconds(h.full)
            self.t += c
            info["convert_s"] += c
            self.mem(self.t, -h.nbytes)
        return True

    def block_backward(self, ui, kind, bi, info, skip_input):
        """Backward of block ``bi``, node by node: a node unpacks its saved tensors (reloading
        offloaded ones), computes, then autograd frees the storages it was the first to save
        (``skip_input``: not the block's input, which a checkpoint frees at its end)."""
        b = self.blocks[bi]
        k = len(b.packs)
        if k == 0:
            self.t += b.backward_s
            return
        for group in _node_groups(b):
            for pos in group:
                si = b.packs[pos]
                if si >= 0 and kind == "offload":
                    h = self.handles.get((ui, bi, si)) or self.handles.get((ui, bi, si, pos))
                    if h is not None and not self.unpack(h, info):
                        self.feasible = False
            self.t += b.backward_s * len(group) / k
            for pos in group:
                si = b.packs[pos]
                h = self.handles.get((ui, bi, si, pos)) if si >= 0 and kind == "offload" else None
                if h is not None:  # a converted copy's full-width tensor, once its last user is done
                    h.users -= 1
                    if h.users == 0 and h.up:
                        h.up = False
                        self.mem(self.t, -h.full)
                elif si >= 0 and b.storages[si].first == pos:
                    s = b.storages[si]
                    if skip_input and s.is_input:
                        continue
                    self.mem(self.t, -s.nbytes)

    def recompute_backward(self, ui, u, info):
        """Backward of checkpoint ``u`` (flat or nested), its input already on the device. Its
        recompute runs its parts, keeping the saved activations of its "keep" blocks and only the
        inputs of its inner checkpoints; it stops once the last inner checkpoint's input is saved
        (torch's early stop), so that one's blocks run once, the others' twice. Then backward walks
        the parts in reverse, each inner checkpoint recomputing its own blocks when reached and
        freeing its input at its end. The unit's own input stays (the caller frees it)."""
        blocks = self.blocks
        parts = u.parts
        run = parts[:-1] if parts[-1].kind == "recompute" else parts
        rs = sum(blocks[bi].forward_s for p in run for bi in range(p.start, p.end + 1))
        self.t += rs
        info["recompute_s"] += rs
        for j, p in enumerate(parts):
            if p.kind == "recompute":
                if j:
                    self.mem(self.t, blocks[p.start].input_bytes)
            else:
                b = blocks[p.start]
                self.mem(self.t, sum(s.nbytes for s in b.storages if not (j == 0 and s.is_input)))
        for j in range(len(parts) - 1, -1, -1):
            p = parts[j]
            if p.kind == "recompute":
                self.recompute_backward(ui, p, info)
                self.mem(self.t, -(blocks[p.start].input_bytes if j else 0) - self.cb * p.checkpoints)
            else:
                self.block_backward(ui, u.kind, p.start, info, skip_input=(j == 0))

    def selective_backward(self, ui, u, info):
        """(selective_offload: the kept outputs come back first.) The recompute allocates the dropped
        saved tensors in pack order and frees each kept output nothing saved once the last op
        reading it has run again; then the block's backward."""
        b = self.blocks[u.start]
        # selective_offload: the recompute reads the kept outputs back as it reaches their ops
        # (modelled as its start: the conservative end); from then on the block's backward is
        # selective's.
        for j in range(len(b.selective)):
            h = self.handles.get((ui, "selective", j))
            if h is not None and not self.unpack(h, info):
                self.feasible = False
        self.t += b.selective_recompute_s
        info["recompute_s"] = b.selective_recompute_s
        kept = {si for si in b.selective_saved if si >= 0}
        only = [
            (use, n)
            for n, si, use in zip(b.selective, b.selective_saved, b.selective_last_use or [0] * len(b.selective))
            if si < 0
        ]
        for pos in range(len(b.packs) + 1):
            self.mem(self.t, -sum(n for use, n in only if use == pos))
            self.mem(
                self.t,
                sum(
                    s.nbytes for si, s in enumerate(b.storages) if s.first == pos and si not in kept and not s.is_input
                ),
            )
        self.mem(self.t, -sum(n for use, n in only if use > len(b.packs)))
        self.block_backward(ui, u.kind, u.start, info, skip_input=True)
        self.mem(self.t, -b.input_bytes - self.cb)

    def result(self) -> SimResult:
        self.events.sort()
        live, peak, timeline = 0, 0, [(0.0, 0)]
        for et, _, d in self.events:
            live += d
            peak = max(peak, live)
            timeline.append((et, live))
        if not self.feasible:
            return SimResult(peak, math.inf, timeline, self.infos, self.forward_end, feasible=False)
        return SimResult(int(peak), self.t, timeline, self.infos, self.forward_end)


def _shift(u, d):
    return Unit(u.start + d, u.end + d, u.kind, inner=tuple(_shift(v, d) for v in u.inner), store=u.store)


def call_units(costs, units):
    """``units`` (over blocks) as units over the block calls of ``costs.call_order``: each call of
    a block gets its block's choice, a segment's blocks called one after another in order are one
    checkpoint per such run (what the applied plan's wrappers do). Returns ``(units over calls,
    index in units of each)``, or None when a segment's blocks are not always called that way (the
    applied segment then refuses the call, or runs blocks outside its checkpoint: not modelled)."""
    order = costs.call_order
    unit_of = {}
    for ui, u in enumerate(units):
        for b in range(u.start, u.end + 1):
            unit_of[b] = ui
    out, owners, p = [], [], 0
    while p < len(order):
        ui = unit_of[order[p]]
        u = units[ui]
        size = u.end - u.start + 1
        if size > 1 and order[p : p + size] != list(range(u.start, u.end + 1)):
            return None
        out.append(_shift(u, p - u.start))
        owners.append(ui)
        p += size
    return out, owners


def _simulate_calls(costs, units, prefetch_bytes):
    """A step whose blocks are called several times (or out of order): simulated call by call,
    each call with its own measured costs; per-unit figures are summed over a unit's calls."""
    mapped = call_units(costs, units)
    if mapped is None:  # not a plan the model can run: infeasible (the joined costs give a peak to show)
        r = simulate(dataclasses.replace(costs, call_order=[], call_blocks=[]), units, prefetch_bytes)
        return SimResult(r.peak_bytes, math.inf, r.timeline, r.units, r.forward_end_s, feasible=False)
    per_call, owners = mapped
    calls = dataclasses.replace(costs, blocks=list(costs.call_blocks), call_order=[], call_blocks=[], excluded=[])
    r = simulate(calls, per_call, prefetch_bytes)
    infos = [
        {"device_bytes": 0, "pool_bytes": 0, "recompute_s": 0.0, "copy_s": 0.0, "stall_s": 0.0, "convert_s": 0.0}
        for _ in units
    ]
    for ui, info in zip(owners, r.units):
        for k, v in info.items():
            infos[ui][k] += v
    r.units = infos
    return r


def _node_groups(b):
    """Pack positions grouped by the autograd node that unpacks them, in backward order (measured;
    positions never unpacked come last, one by one, in reverse pack order)."""
    nodes = b.nodes if len(b.nodes) == len(b.packs) else [-1] * len(b.packs)
    seen = sorted((nid, -pos) for pos, nid in enumerate(nodes) if nid >= 0)
    groups, last = [], None
    for nid, neg in seen:
        if groups and nid == last:
            groups[-1].append(-neg)
        else:
            groups.append([-neg])
        last = nid
    groups += [[pos] for pos in range(len(nodes) - 1, -1, -1) if nodes[pos] < 0]
    return groups


def _check_units(units, n):
    expect = 0
    for u in units:
        if not isinstance(u, Unit):
            raise TypeError(f"units must be Unit objects, got {type(u).__name__}")
        if u.start != expect:
            raise ValueError(
                f"units must cover blocks 0..{n - 1} in order; expected a unit starting at {expect}, got {u}"
            )
        expect = u.end + 1
    if expect != n:
        raise ValueError(f"units cover {expect} blocks, the model has {n}")
