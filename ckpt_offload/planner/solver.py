"""Choosing a plan: the cheapest assignment of keep / offload / recompute / ... to the blocks whose
predicted peak of saved activations fits a budget.

Three searches, all judged by the event simulator (:func:`~ckpt_offload.planner.simulator.simulate`):

* a dynamic program over the blocks (rotor / POFO style) on a block-level *chain model* of the
  simulator -- per unit a forward-held size, a backward working size, extra compute, copies -- whose
  state carries the bytes held so far, the D2H copy backlog (seconds of copies still queued), the
  previous unit's reload (hidden behind this unit's backward, or not) and how much was offloaded
  (the prefetch window it may occupy). Dominated states are pruned, so it is exact for that model
  (:func:`chain_exhaustive` checks it);
* local search with the full simulator from the best candidates (one block changed at a time);
* exact enumeration with the full simulator when there are few blocks.

The known strategies (Chen's sqrt(n) segments, every block recomputed with its input offloaded,
the first k blocks offloaded, rotor's recompute-only optimum) are candidates too, so a plan is
never predicted slower than any of them at the same budget.

Lossy storage (``cm.store_dtype`` set, ``co.plan(..., lossy=...)``): every offloading unit
("offload", "recompute_offload", single or segment) that has bytes the storage dtype converts is
offered twice, exact and with ``store=True``, to every search alike; the least predicted time
within the budget decides as for every choice, and at equal time and peak the plan with fewer
lossy units wins, so lossy storage is used only where it makes the step faster or the peak fit.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ckpt_offload.planner.lossy import converted_inputs, converted_packs
from ckpt_offload.planner.nested import fronts, nested_terms, structures
from ckpt_offload.planner.simulator import KINDS, OFFLOADING_KINDS, SEGMENT_KINDS, STORE_KINDS, Unit, simulate, singles

__all__ = [
    "Candidate",
    "solve",
    "chain_dp",
    "chain_exhaustive",
    "chain_cost",
    "baselines",
    "rotor",
    "chen_units",
    "InfeasibleBudget",
]


class InfeasibleBudget(ValueError):
    """The budget is below the smallest predicted peak any plan reaches; ``minimum`` is that peak."""

    def __init__(self, budget, minimum, message):
        super().__init__(message)
        self.budget, self.minimum = budget, minimum


@dataclass
class Candidate:
    units: list
    prefetch_bytes: int
    peak_bytes: int
    step_s: float
    source: str = ""

    def key(self):
        # lossy units last: at equal time and peak the exact plan is chosen
        return (self.step_s, self.peak_bytes, sum(u.store for u in self.units))


# ---- the chain model (block level) -------------------------------------------------------------


def _unit_terms(cm, u, prefetch):
    """(held, work, extra_s, bwd_s, d2h_bytes, d2h_copies, fwd_s) of unit ``u`` in the chain model.

    held: bytes it keeps on the device from its forward until its backward; work: bytes it has
    on the device at the start of its backward (a bound of its backward peak without prefetch);
    extra_s: recompute seconds; bwd_s: its backward compute (what a reload of the unit before it
    hides behind); d2h: what it copies to the host (and reloads); fwd_s: its blocks' forward."""
    terms = _terms6(cm, u)
    fwd = sum(b.forward_s for b in cm.blocks[u.start : u.end + 1])
    if u.store:
        held, work, extra, bwd, d_bytes, d_copies = terms
        d_bytes, d_copies, conv_bytes, work_extra = store_terms(cm, u)
        c = cm.bandwidth.convert_seconds(conv_bytes)
        return held, work + work_extra, extra, bwd + c, d_bytes, d_copies, fwd + c
    return terms + (fwd,)


def store_terms(cm, u):
    """A lossy unit's (d2h bytes, d2h copies, bytes converted each way, extra backward working bytes)
    in the chain model: its offloaded bytes the storage dtype converts cross the link narrow, one
    copy per converted copy (a saved tensor of exactly an earlier one's span shares it), and come
    back as one full-width tensor per converted copy."""
    mb, store = cm.min_bytes, cm.store_dtype
    d_bytes = d_copies = conv = extra = 0
    if u.kind == "offload":
        b = cm.blocks[u.start]
        packs = converted_packs(b, store)
        for si, st in enumerate(b.storages):
            if not (st.nbytes >= mb and st.nbytes > 0):
                continue
            if si in packs:
                d_bytes += sum(n for _, _, n in packs[si])
                d_copies += len(packs[si])
                spans = sum(span for _, span, _ in packs[si])
                conv += spans
                extra += spans - st.nbytes
            else:
                d_bytes += st.nbytes
                d_copies += 1
        return d_bytes, d_copies, conv, max(0, extra)
    first = cm.blocks[u.start]
    for n, c in zip(first.input_sizes, converted_inputs(first, store)):
        if not (n >= mb and n > 0):
            continue
        d_bytes += n if c is None else c[1]
        d_copies += 1
        conv += 0 if c is None else c[0]
    return d_bytes, d_copies, conv, 0


def store_gain(cm, u) -> int:
    """Bytes a lossy ``u`` keeps off the link (and the host) against the exact one: > 0 when the
    storage dtype converts something it offloads."""
    if cm.store_dtype is None or u.kind not in STORE_KINDS:
        return 0
    mb = cm.min_bytes
    first = cm.blocks[u.start]
    # what the exact unit sends (as _terms6 counts it, without walking a nesting)
    sizes = [s.nbytes for s in first.storages] if u.kind == "offload" else first.input_sizes
    exact = sum(n for n in sizes if n >= mb and n > 0)
    return exact - store_terms(cm, u)[0]


def _lossy_variants(cm, units):
    """``units`` and, after each offloading one that gains from lossy storage, its lossy twin."""
    out = []
    for u in units:
        out.append(u)
        if u.kind in STORE_KINDS and not u.store and store_gain(cm, dataclasses.replace(u, store=True)) > 0:
            out.append(dataclasses.replace(u, store=True))
    return out


def _terms6(cm, u):
    bs = cm.blocks[u.start : u.end + 1]
    first = bs[0]
    mb = cm.min_bytes

    def off(n):
        return n >= mb and n > 0

    saved = sum(b.saved_bytes for b in bs)
    bwd = sum(b.backward_s for b in bs)
    if u.kind == "keep":
        return saved, saved, 0.0, bwd, 0, 0
    if u.kind == "offload":
        b = first
        o = [s.nbytes for s in b.storages if off(s.nbytes)]
        return b.saved_bytes - sum(o), b.saved_bytes, 0.0, bwd, sum(o), len(o)
    fwd = sum(b.forward_s for b in bs)
    inp = first.input_bytes
    not_input = saved - sum(s.nbytes for s in first.storages if s.is_input)
    if u.inner:  # a nested segment: less held in its backward, more recompute
        not_input, fwd = nested_terms(cm, u)
    # every checkpoint's random state (nested: the inner ones' are in not_input, held by their part)
    cb, cbs = cm.checkpoint_bytes, cm.checkpoint_bytes * u.checkpoints
    if u.kind == "recompute":
        return inp + cbs, inp + cb + not_input, fwd, bwd + fwd, 0, 0
    if u.kind == "recompute_offload":
        o = [n for n in first.input_sizes if off(n)]
        return inp - sum(o) + cbs, inp + cb + not_input, fwd, bwd + fwd, sum(o), len(o)
    # selective (what its policy keeps stays on the device) / selective_offload (what the policy
    # keeps waits in the pool, at least min_bytes; the recompute reloads it, so its backward
    # works with the same bytes)
    b = first
    sel = sum(b.selective)
    sel_only = sum(n for n, si in zip(b.selective, b.selective_saved) if si < 0)
    o = [n for n in b.selective if off(n)] if u.kind == "selective_offload" else []
    return (
        inp + sel - sum(o) + cb,
        inp + cb + not_input + sel_only,
        b.selective_recompute_s,
        bwd + b.selective_recompute_s,
        sum(o),
        len(o),
    )


def allowed(cm, u) -> bool:
    """Whether unit ``u`` gives no block a kind ``cm.excluded`` rules out for it (a segment
    recomputes every block it holds: each must allow ``"recompute"``)."""
    ex = getattr(cm, "excluded", None)
    if not ex:
        return True
    if u.start == u.end:
        return u.kind not in ex[u.start]
    # "segment": block i does not hand its output to block i+1 as a segment would (UNCHAINED).
    return all(u.kind not in ex[i] and "recompute" not in ex[i] for i in range(u.start, u.end + 1)) and all(
        "segment" not in ex[i] for i in range(u.start, u.end)
    )


def _unit_options(n, kinds, max_segment, inners=None):
    """Units starting at each block: singles of every kind, segments (of at most ``max_segment``
    blocks) of SEGMENT_KINDS; ``inners`` gives the nestings of each segment (``{(i, j): [inner,
    ...]}``, default flat only)."""
    out = []
    for i in range(n):
        opts = [Unit(i, i, k) for k in kinds]
        for j in range(i + 1, min(n, i + max_segment)):
            for inner in inners.get((i, j), ((),)) if inners else ((),):
                opts += [Unit(i, j, k, inner=inner) for k in SEGMENT_KINDS if k in kinds]
        out.append(opts)
    return out


#: Points of each segment's Pareto front of nestings the solver's DP tries (bounds its work on long
#: chains; the front's two ends, least memory and least recompute, are always among them), and the
#: longest segment that nests (longer ones stay flat).
MAX_NESTINGS = 12
MAX_NESTED_SEGMENT = 16


def _nested_options(cm, n, kinds, max_segment, levels, max_points=None):
    """:func:`_unit_options` with each segment's Pareto front of nestings, as ``[[(unit, terms),
    ...] per block]`` (the terms computed once: nested ones cost a walk of the nesting)."""
    if levels <= 1 or not any(k in kinds for k in SEGMENT_KINDS):
        options = _unit_options(n, kinds, max_segment)
    else:
        # Nested segments of at most MAX_NESTED_SEGMENT blocks, and fewer nestings per segment on long
        # chains: the DP's work grows with both (a 32-block chain: seconds instead of a minute).
        long = n > MAX_NESTED_SEGMENT
        if max_points is None:
            max_points = 4 if long else MAX_NESTINGS
        f = fronts(cm, levels, min(max_segment, MAX_NESTED_SEGMENT // 2 if long else MAX_NESTED_SEGMENT), max_points)
        options = _unit_options(n, kinds, max_segment, {k: [p[2] for p in v] for k, v in f.items()})
    if getattr(cm, "store_dtype", None) is not None:
        options = [_lossy_variants(cm, opts) for opts in options]
    return [[(u, _unit_terms(cm, u, 0)) for u in opts if allowed(cm, u)] for opts in options]


def chain_cost(cm, units, prefetch):
    """The chain model's (peak bound, time) of ``units``: what :func:`chain_dp` minimises."""
    state = _initial(cm)
    for u in units:
        state = _advance(cm, state, u, prefetch, _unit_terms(cm, u, prefetch))
        if state is None:
            return math.inf, math.inf
    return _finish(cm, state)


def _initial(cm):
    # held, backlog_s, prev reload bytes, prev reload copies, offloaded so far (capped), peak, time
    return (0, 0.0, 0, 0, 0, cm.pre_bytes, cm.pre_s)


def _advance(cm, state, u, prefetch, terms):
    held, backlog, r_prev, c_prev, offl, peak, time = state
    h, work, extra, bwd, d_bytes, d_copies, fwd = terms
    bw = cm.bandwidth
    if d_copies and bw.d2h <= 0:
        return None
    # backward of the previous (earlier) unit's reload hides behind this unit's backward
    time += fwd + bwd  # bwd includes the recompute (extra): counted once
    if c_prev:
        hidden = min(r_prev, prefetch)
        stall = max(0.0, bw.copy_seconds(hidden, c_prev, "h2d") - bwd) + bw.copy_seconds(r_prev - hidden, 0, "h2d")
        time += stall
    # forward: the copy backlog (bytes not yet on the host) is device memory
    backlog = max(0.0, backlog - fwd) + (bw.copy_seconds(d_bytes, d_copies, "d2h") if d_copies else 0.0)
    in_flight = 0 if backlog <= 0 or math.isinf(bw.d2h) else backlog * bw.d2h
    base = cm.pre_bytes
    peak = max(peak, base + held + h + in_flight)  # end of this unit's forward
    peak = max(peak, base + held + work + min(prefetch, offl))  # start of this unit's backward
    offl = min(prefetch, offl + d_bytes)
    return (held + h, backlog, d_bytes, d_copies, offl, peak, time)


def _finish(cm, state):
    held, backlog, r_prev, c_prev, offl, peak, time = state
    bw = cm.bandwidth
    if c_prev:
        time += bw.copy_seconds(r_prev, c_prev, "h2d")  # nothing before it to hide behind... the first unit
    peak = max(peak, cm.pre_bytes + held + cm.post_bytes)
    return peak, time + cm.mid_s + cm.post_s


def chain_dp(
    cm, budget, prefetch=0, kinds=KINDS, max_segment=None, levels=1, objective="time", max_points=None, _options=None
):
    """The dynamic program: the units with the least chain-model time whose chain-model peak is at
    most ``budget``, or None. States after each block are pruned to the Pareto front of (held,
    backlog, previous reload, offloaded, peak, time); ties keep the smaller peak. ``levels`` > 1
    lets segments nest that deep (each segment's Pareto front of nestings, :mod:`.nested`, is an
    option); ``objective="peak"`` gives the least peak instead (ties: the least time).

    Example::

        units = chain_dp(cm, budget=64 << 20, prefetch=8 << 20)
        smallest = chain_dp(cm, math.inf, levels=3, objective="peak")
    """
    n = len(cm.blocks)
    max_segment = n if max_segment is None else max_segment
    options = _options or _nested_options(cm, n, kinds, max_segment, levels, max_points)
    by_peak = objective == "peak"
    fronts = [dict() for _ in range(n + 1)]  # position -> {state: (units)}
    fronts[0][_initial(cm)] = ()
    for i in range(n):
        if not fronts[i]:
            continue
        for state, units in _pareto(fronts[i], by_peak):
            for u, t in options[i]:
                s = _advance(cm, state, u, prefetch, t)
                if s is None or s[5] > budget or not math.isfinite(s[6]):
                    continue
                old = fronts[u.end + 1].get(s)
                if old is None:
                    fronts[u.end + 1][s] = units + (u,)
    best = None
    for state, units in fronts[n].items():
        peak, time = _finish(cm, state)
        key = (peak, time) if by_peak else (time, peak)
        if peak <= budget and (best is None or key < best[0]):
            best = (key, list(units))
    return None if best is None else best[1]


def least_peak_plans(cm, prefetch=0, kinds=KINDS, max_segment=None, levels=1, ties=8, limit=256, _options=None):
    """The chain model's lowest-peak plans (at most ``limit``, lowest chain-model peak first): the
    least-peak DP keeping, per state, up to ``ties`` plans that reach it (the chain model does not
    tell them apart; the simulator may: its peak is what a budget is checked against).

    Example::

        candidates = least_peak_plans(cm, 0, levels=3)
    """
    n = len(cm.blocks)
    max_segment = n if max_segment is None else max_segment
    options = _options or _nested_options(cm, n, kinds, max_segment, levels)
    fronts = [dict() for _ in range(n + 1)]  # position -> {state: [units, ...]}
    fronts[0][_initial(cm)] = [()]
    for i in range(n):
        if not fronts[i]:
            continue
        for state, plans in _pareto(fronts[i], by_peak=True):
            for u, t in options[i]:
                s = _advance(cm, state, u, prefetch, t)
                if s is None or not math.isfinite(s[6]):
                    continue
                at = fronts[u.end + 1].setdefault(s, [])
                for units in plans:
                    if len(at) >= ties:
                        break
                    at.append(units + (u,))
    done = []
    for state, plans in fronts[n].items():
        peak, time = _finish(cm, state)
        done += [((peak, time), list(units)) for units in plans]
    done.sort(key=lambda x: x[0])
    return [units for _, units in done[:limit]]


#: Largest Pareto front kept per block (the fastest states): the DP is exact while fronts stay
#: smaller, which they do for chains of tens of blocks with measured costs.
MAX_FRONT = 4000


def _pareto(front, by_peak=False):
    """Drops states another state beats in every coordinate (monotone costs: exactness kept);
    ``by_peak``: time is not compared (the least peak is sought, time only breaks ties)."""
    items = sorted(front.items(), key=lambda kv: (kv[0][5], kv[0][6]) if by_peak else (kv[0][6], kv[0][5]))
    kept = []
    for s, units in items:
        dominated = False
        for k, _ in kept:
            if (
                k[0] <= s[0]
                and k[1] <= s[1]
                and k[2] <= s[2]
                and k[3] <= s[3]
                and k[4] <= s[4]
                and k[5] <= s[5]
                and (by_peak or k[6] <= s[6])
            ):
                dominated = True
                break
        if not dominated:
            kept.append((s, units))
            if len(kept) >= MAX_FRONT:
                break
    return kept


def _all_unit_lists(n, kinds, max_segment=None, levels=1, cm=None):
    max_segment = n if max_segment is None else max_segment
    inners = {(i, j): list(structures(i, j, levels)) for i in range(n) for j in range(i, n)}
    options = _unit_options(n, kinds, max_segment, inners)
    if cm is not None and getattr(cm, "store_dtype", None) is not None:
        options = [_lossy_variants(cm, opts) for opts in options]

    def rec(i):
        if i == n:
            yield ()
            return
        for u in options[i]:
            for rest in rec(u.end + 1):
                yield (u,) + rest

    return rec(0)


def chain_exhaustive(cm, budget, prefetch=0, kinds=KINDS, max_segment=None, levels=1):
    """Every assignment (every nesting up to ``levels`` levels), judged by :func:`chain_cost`: what
    :func:`chain_dp` must equal (tests)."""
    best = None
    for units in _all_unit_lists(len(cm.blocks), kinds, max_segment, levels, cm):
        if not all(allowed(cm, u) for u in units):
            continue
        peak, time = chain_cost(cm, units, prefetch)
        if peak <= budget and math.isfinite(time) and (best is None or (time, peak) < best[0]):
            best = ((time, peak), list(units))
    return None if best is None else best[1]


# ---- known strategies ----------------------------------------------------------------------------


def chen_units(n, kind="recompute"):
    """Chen et al.'s rule: about sqrt(n) segments of consecutive blocks, each one checkpoint."""
    k = max(1, round(math.sqrt(n)))
    size = math.ceil(n / k)
    return [Unit(s, min(n, s + size) - 1, kind) for s in range(0, n, size)]


def rotor(cm, budget, max_segment=None, levels=1):
    """Rotor's problem (Beaumont et al.): the fastest recompute-only schedule (keep or checkpoint,
    blocks grouped in segments) within ``budget``; the same DP restricted to those kinds. Rotor's
    multi-level schedules are ``levels`` > 1 (segments nested that deep); the baseline the solver
    compares with is flat.

    Example::

        units = rotor(cm, 64 << 20, levels=2)
    """
    return chain_dp(cm, budget, 0, kinds=("keep", "recompute"), max_segment=max_segment, levels=levels)


def baselines(cm, budget=None):
    """The strategies a plan is compared with, as ``{name: units}``: ``chen_sqrt`` (about sqrt(n)
    segments), ``every_layer_offload`` (Hugging Face: every block checkpointed, inputs offloaded),
    ``first_k_offload`` (Transformer Engine's, here with k = n; :func:`first_k_units` gives any k,
    and the solver tries them all) and ``recompute_only`` (every block checkpointed; :func:`rotor`
    gives the best recompute-only schedule for a budget). ``budget`` is unused (kept for callers)."""
    n = len(cm.blocks)
    out = {
        "chen_sqrt": chen_units(n),
        "every_layer_offload": singles(["recompute_offload"] * n),
    }
    out["first_k_offload"] = singles(["offload"] * n)
    out["recompute_only"] = singles(["recompute"] * n)
    return out


def first_k_units(n, k):
    return singles(["offload"] * k + ["keep"] * (n - k))


def _all_lossy(units):
    """``units`` with every offloading unit storing lossy."""
    return [dataclasses.replace(u, store=True) if u.kind in STORE_KINDS else u for u in units]


# ---- the solver ------------------------------------------------------------------------------------


def _prefetch_options(cm, units_hint=None):
    mb = cm.min_bytes
    sizes = [sum(s.nbytes for s in b.storages if s.nbytes >= mb) for b in cm.blocks]
    biggest = max(sizes + [0])
    biggest_tensor = max([s.nbytes for b in cm.blocks for s in b.storages] + [0])
    opts = {0, biggest_tensor, biggest, 2 * biggest}
    return sorted(o for o in opts if o >= 0)


def evaluate(cm, units, prefetch, source=""):
    """The simulator's verdict on ``units`` as a :class:`Candidate`; one giving a block a kind
    ``cm.excluded`` rules out is never chosen (its step time is infinite)."""
    r = simulate(cm, list(units), prefetch)
    ok = r.feasible and all(allowed(cm, u) for u in units)
    return Candidate(list(units), prefetch, r.peak_bytes, r.step_s if ok else math.inf, source)


def _choices(cm, kinds):
    """What a block can be given one at a time: ``kinds``, then (lossy) the offloading ones with
    ``store=True`` as ``(kind, True)``."""
    out = list(kinds)
    if getattr(cm, "store_dtype", None) is not None:
        out += [(k, True) for k in kinds if k in STORE_KINDS]
    return out


def _local_search(cm, cand, budget, kinds, rounds=3):
    """Changes one block's kind at a time (splitting a segment into singles around it) while that
    lowers the predicted time (then the peak) and keeps the peak within the budget."""
    best = cand
    n = len(cm.blocks)
    for _ in range(rounds):
        improved = False
        kinds_now = _per_block(best.units)
        for i in range(n):
            for k in _choices(cm, kinds):
                if k == kinds_now[i]:
                    continue
                units = _replace(best.units, i, k)
                c = evaluate(cm, units, best.prefetch_bytes, best.source + "+ls")
                if c.peak_bytes <= budget and c.key() < best.key():
                    best, improved = c, True
        if not improved:
            break
    return best


def _per_block(units):
    """Per block its unit's kind, ``(kind, True)`` for a lossy one (as :func:`_choices` names them)."""
    out = []
    for u in units:
        out += [(u.kind, True) if u.store else u.kind] * (u.end - u.start + 1)
    return out


def _replace(units, i, kind):
    """``units`` with block ``i`` alone given ``kind`` (or ``(kind, True)``: lossy)."""
    kind, store = kind if isinstance(kind, tuple) else (kind, False)
    out = []
    for u in units:
        if u.start <= i <= u.end:
            for j in range(u.start, u.end + 1):
                if j == i:
                    out.append(Unit(j, j, kind, store=store))
                elif u.start == u.end:
                    out.append(u)
                else:
                    out.append(Unit(j, j, u.kind, store=u.store))
        else:
            out.append(u)
    return out


def solve(cm, budget, kinds=KINDS, exhaustive_max_blocks=4, prefetch_bytes=None, segments=True, levels=2):
    """The plan with the least predicted step time whose predicted peak fits ``budget``.

    Candidates: the DP's optimum for each prefetch window tried, the DP's least-peak plan, the
    baselines (every first-k), exact enumeration when the model has at most
    ``exhaustive_max_blocks`` blocks, then local search from the best of them. ``levels``: how deep
    segments may nest (1: flat segments only). Raises :class:`InfeasibleBudget` (with the smallest
    feasible budget) when nothing fits.

    With ``cm.store_dtype`` (lossy storage allowed) the exact problem is solved first and its best
    plan joins the candidates (local search can then turn its offloads lossy one at a time): the
    lossy search is larger and its pruning could miss a plan the exact one finds, and a lossy
    answer must never be slower than the exact one. So it takes about three times as long.

    Example::

        best = solve(cm, 32 << 20)      # Candidate(units, prefetch_bytes, peak_bytes, step_s)
    """
    n = len(cm.blocks)
    max_segment = n if segments else 1
    levels = levels if segments else 1
    windows = _prefetch_options(cm) if prefetch_bytes is None else [prefetch_bytes]
    cands = []
    if getattr(cm, "store_dtype", None) is not None:
        try:
            exact = solve(
                dataclasses.replace(cm, store_dtype=None),
                budget,
                kinds,
                exhaustive_max_blocks,
                prefetch_bytes,
                segments,
                levels,
            )
            cands.append(evaluate(cm, exact.units, exact.prefetch_bytes, exact.source))
        except InfeasibleBudget:
            pass
    options = _nested_options(cm, n, kinds, max_segment, levels)
    for p in windows:
        units = chain_dp(cm, budget, p, kinds=kinds, max_segment=max_segment, _options=options)
        if units:
            cands.append(evaluate(cm, units, p, "dp"))
        # The least memory the chain model reaches: at budgets near the minimum the time-optimal DP
        # can miss because its peak is a bound; this one is then often the only plan that fits.
        units = chain_dp(cm, math.inf, p, kinds=kinds, max_segment=max_segment, objective="peak", _options=options)
        if units:
            cands.append(evaluate(cm, units, p, "dp_least_peak"))
    r = rotor(cm, budget, max_segment) if "recompute" in kinds else None
    lossy = getattr(cm, "store_dtype", None) is not None
    for p in windows:
        for name, units in baselines(cm).items():
            if all(u.kind in kinds and (segments or u.start == u.end) for u in units):
                cands.append(evaluate(cm, units, p, name))
                if lossy and any(u.kind in STORE_KINDS for u in units):
                    cands.append(evaluate(cm, _all_lossy(units), p, name + "_lossy"))
        for k in range(n + 1):
            if "offload" in kinds or k == 0:
                cands.append(evaluate(cm, first_k_units(n, k), p, f"first_{k}_offload"))
                if lossy and k:
                    cands.append(evaluate(cm, _all_lossy(first_k_units(n, k)), p, f"first_{k}_offload_lossy"))
        if r:
            cands.append(evaluate(cm, r, p, "rotor"))
    if n <= exhaustive_max_blocks:
        for units in _all_unit_lists(n, kinds, max_segment, levels, cm):
            for p in windows if any(u.kind in OFFLOADING_KINDS for u in units) else windows[:1]:
                cands.append(evaluate(cm, units, p, "exhaustive"))
    # The fixed recipes (rotor's keep/recompute, first-k offload with the rest kept) may give a
    # block a kind the caller did not allow: only plans within ``kinds`` are candidates.
    cands = [c for c in cands if _within(c.units, kinds)]
    fits = [c for c in cands if c.peak_bytes <= budget and math.isfinite(c.step_s)]
    if not fits and n > exhaustive_max_blocks:
        # Near the least peak the chain model's bound can miss plans that fit: the lowest-peak
        # plans it sees, judged and improved by the simulator, are what reaches the true minimum.
        cands += least_peak_candidates(cm, kinds, windows, segments, levels, options)
        fits = [c for c in cands if c.peak_bytes <= budget and math.isfinite(c.step_s)]
    if fits:
        fits.sort(key=Candidate.key)
        best = fits[0]
        if n > exhaustive_max_blocks:
            for c in fits[:3]:
                c = _local_search(cm, c, budget, kinds)
                if c.key() < best.key():
                    best = c
        return best
    smallest = minimum_peak(cm, kinds, windows, cands, segments, levels=0)  # cands hold the least-peak ones
    raise InfeasibleBudget(
        budget,
        smallest,
        f"budget={_fmt(budget)} is below the smallest peak of saved activations any plan reaches here, "
        f"{_fmt(smallest)} ({smallest} bytes): pass budget >= {smallest} (a smaller batch or sequence lowers it)",
    )


def least_peak_candidates(cm, kinds, windows, segments, levels, options=None):
    """The chain model's lowest-peak plans for each prefetch window (:func:`least_peak_plans`),
    judged by the simulator, then improved for the simulated peak one block at a time."""
    n = len(cm.blocks)
    out = []
    for p in windows:
        for units in least_peak_plans(cm, p, kinds, n if segments else 1, levels if segments else 1, _options=options):
            out.append(evaluate(cm, units, p, "least_peak"))
    finite = sorted((c for c in out if math.isfinite(c.step_s)), key=lambda c: (c.peak_bytes, c.step_s))
    out += [_lower_peak(cm, c, kinds) for c in finite[:3]]
    return out


def _lower_peak(cm, cand, kinds, rounds=3):
    """Changes one block's kind at a time while that lowers the simulated peak."""
    best = cand
    for _ in range(rounds):
        improved = False
        kinds_now = _per_block(best.units)
        for i in range(len(cm.blocks)):
            for k in _choices(cm, kinds):
                if k == kinds_now[i]:
                    continue
                c = evaluate(cm, _replace(best.units, i, k), best.prefetch_bytes, best.source + "+lp")
                if math.isfinite(c.step_s) and (c.peak_bytes, c.step_s) < (best.peak_bytes, best.step_s):
                    best, improved = c, True
        if not improved:
            break
    return best


def minimum_peak(cm, kinds=KINDS, windows=None, cands=(), segments=True, levels=2):
    """The smallest predicted peak over the candidates (``cands``, every block with the same
    kind and Chen's segments for each prefetch window, and, unless ``levels`` is 0, the DP's
    least-peak plan with segments nested up to ``levels`` deep)."""
    windows = windows if windows is not None else _prefetch_options(cm)
    n = len(cm.blocks)
    pool = list(cands)
    if levels:
        pool += least_peak_candidates(cm, kinds, windows, segments, levels)
    lossy = getattr(cm, "store_dtype", None) is not None
    for p in windows:
        for kind in kinds:
            pool.append(evaluate(cm, singles([kind] * n), p))
            if lossy and kind in STORE_KINDS:
                pool.append(evaluate(cm, _all_lossy(singles([kind] * n)), p))
        if segments:
            for kind in SEGMENT_KINDS:
                if kind in kinds:
                    pool.append(evaluate(cm, chen_units(n, kind), p))
    finite = [c for c in pool if math.isfinite(c.step_s) and _within(c.units, kinds)]
    return min(c.peak_bytes for c in finite)


def _within(units, kinds) -> bool:
    """Whether every unit of ``units`` has one of ``kinds`` (a segment's kind is its outer one;
    its inner checkpoints are recomputes of that segment)."""
    return all(u.kind in kinds for u in units)


def _fmt(n):
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
