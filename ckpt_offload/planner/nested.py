"""Nested segments (multi-level checkpointing) in the solver's chain model.

A nested segment is a checkpoint whose function runs some of its blocks as inner checkpoints
(:class:`~ckpt_offload.planner.simulator.Unit` with ``inner``). In the chain model a checkpoint
``u`` costs, besides what a flat one costs, two numbers that depend on its inner structure:

* ``wx``: the bytes its backward has on the device besides its own input, at most. Backward
  walks its parts in reverse; when it reaches part ``j``, the parts before it still hold what
  the segment's recompute kept for them (a "keep" block: its saved activations; an inner
  checkpoint: its input), and part ``j`` adds its own working set (an inner checkpoint: its
  ``wx``). ``wx`` is the largest of these sums.
* ``extra``: seconds of recompute. The segment's recompute runs every part but the last when
  that is an inner checkpoint (torch stops a recompute once the last tensor it needs is saved),
  and each inner checkpoint adds its own ``extra``: a block nested two levels deep runs up to
  three times.

:func:`fronts` gives, per range of blocks, the Pareto front of ``(wx, extra)`` over every
nesting of at most ``levels`` levels, by dynamic programming over the parts (rotor's recursion,
Beaumont et al.): a prefix of parts is summarised by (bytes it holds, its largest sum so far,
its recompute seconds), and dominated prefixes are dropped, which is exact because later parts
only add to all three. :func:`structures` enumerates every nesting, for the exhaustive search
that checks it.
"""

from __future__ import annotations

from ckpt_offload.planner.simulator import Unit

__all__ = ["nested_terms", "fronts", "structures"]


def _held(cm, p, first):
    """Bytes part ``p`` holds through its enclosing segment's backward until backward reaches it
    (``first``: the segment's first part, whose input is the segment's own)."""
    if p.kind == "recompute":  # its input, and its random state since the forward
        return (0 if first else cm.blocks[p.start].input_bytes) + cm.checkpoint_bytes * p.checkpoints
    b = cm.blocks[p.start]
    return b.saved_bytes - (sum(s.nbytes for s in b.storages if s.is_input) if first else 0)


def _fwd(cm, start, end):
    return sum(b.forward_s for b in cm.blocks[start : end + 1])


def nested_terms(cm, u, _cache=None):
    """``(wx, extra)`` of checkpoint ``u`` (flat or nested) in the chain model (module docstring).

    Example::

        nested_terms(cm, Unit(0, 3, "recompute", inner=(Unit(0, 1, "recompute"), Unit(2, 3, "recompute"))))
    """
    held, peak, extra = 0, 0, 0.0
    parts = u.parts
    for j, p in enumerate(parts):
        held += _held(cm, p, j == 0)
        if p.kind == "recompute":
            wx, e = nested_terms(cm, p)
            peak = max(peak, held + wx)
            extra += e + (0.0 if j == len(parts) - 1 else _fwd(cm, p.start, p.end))
        else:
            peak = max(peak, held)
            extra += cm.blocks[p.start].forward_s
    return peak, extra


def _pareto2(points):
    """(wx, extra, inner) points -> those no other beats in both, smallest wx first."""
    out = []
    for wx, e, inner in sorted(points, key=lambda x: (x[0], x[1])):
        if not out or e < out[-1][1] - 1e-12 * abs(out[-1][1]):  # sums in another order: not better
            out.append((wx, e, inner))
    return out


def _pareto3(states):
    """(held, peak, extra, parts) prefixes -> those no other beats in all three."""
    kept = []
    for s in sorted(states, key=lambda x: (x[2], x[1], x[0])):
        if not any(k[0] <= s[0] and k[1] <= s[1] and k[2] <= s[2] for k in kept):
            kept.append(s)
    return kept


def fronts(cm, levels=2, max_segment=None, max_points=None):
    """``{(start, end): [(wx, extra, inner), ...]}``: for every range of at most ``max_segment``
    blocks, the Pareto front of checkpoints over it nested at most ``levels`` levels (``inner``
    ``()`` is the flat one), smallest ``wx`` first. ``max_points`` keeps that many points per range
    (spread over the front, always both ends), to bound the solver's work on long chains.

    Example::

        f = fronts(cm, levels=2)
        f[(0, len(cm.blocks) - 1)][0]      # the least memory any 2-level nesting of all blocks needs
    """
    n = len(cm.blocks)
    max_segment = n if max_segment is None else max_segment
    flat = {}
    for s in range(n):
        for e in range(s, min(n, s + max_segment)):
            flat[(s, e)] = [nested_terms(cm, Unit(s, e, "recompute")) + ((),)]
    prev = flat
    for _ in range(2, levels + 1):
        cur = {}
        for s in range(n):
            last = min(n, s + max_segment)  # one past the last block a segment from s may hold
            states = {s: [(0, 0, 0.0, ())]}  # prefixes ending before block t, as reached
            pruned = {}  # ... less the dominated ones (the whole range as one part stays in: legit as a prefix)
            for t in range(s, last):
                pruned[t] = _pareto3(states.get(t, []))
                for held, peak, extra, parts in pruned[t]:
                    h = _held(cm, Unit(t, t, "keep"), t == s)
                    states.setdefault(t + 1, []).append(
                        (held + h, max(peak, held + h), extra + cm.blocks[t].forward_s, parts + (Unit(t, t, "keep"),))
                    )
                    for u in range(t, last):
                        for wx, e, inner in prev[(t, u)]:
                            h = _held(cm, Unit(t, u, "recompute", inner=inner), t == s)
                            states.setdefault(u + 1, []).append(
                                (
                                    held + h,
                                    max(peak, held + h + wx),
                                    extra + e + _fwd(cm, t, u),
                                    parts + (Unit(t, u, "recompute", inner=inner),),
                                )
                            )
            for e in range(s, last):
                # A last part that is an inner checkpoint is counted here as if the segment's
                # recompute ran it; torch stops before it, which makes it exactly as good as its
                # parts run as "keep" parts of this segment (the same bytes, the same runs, one
                # random state less): those are here, so nothing is lost (the exhaustive search,
                # which counts the early stop, checks it).
                points = [
                    (peak, extra, parts)
                    for _, peak, extra, parts in states.get(e + 1, [])
                    if not (len(parts) == 1 and parts[0].kind == "recompute")
                ]
                front = _pareto2([(wx, x, Unit(s, e, "recompute", inner=parts).inner) for wx, x, parts in points])
                cur[(s, e)] = _thin(front, max_points)
        prev = cur
    return prev


def _thin(front, max_points):
    if max_points is None or len(front) <= max_points:
        return front
    step = (len(front) - 1) / (max_points - 1)
    return [front[round(i * step)] for i in range(max_points)]


def structures(start, end, levels):
    """Every ``inner`` of a checkpoint over ``start..end`` nested at most ``levels`` levels
    (``()`` first: the flat one). For exhaustive search on short chains: their number grows about
    2.4-fold per block at two levels."""
    yield ()
    if levels < 2 or end == start:
        return

    def parts(t):
        if t > end:
            yield ()
            return
        for rest in parts(t + 1):
            yield (Unit(t, t, "keep"),) + rest
        for u in range(t, end + 1):
            if t == start and u == end:
                continue
            for inner in structures(t, u, levels - 1):
                for rest in parts(u + 1):
                    yield (Unit(t, u, "recompute", inner=inner),) + rest

    for p in parts(start):
        if any(v.kind == "recompute" for v in p):
            yield p
