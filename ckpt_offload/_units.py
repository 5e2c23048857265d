"""What a block does in a step, as the planner and the block installer both name it.

A :class:`Unit` is blocks ``start..end`` handled as one: kept, offloaded, recomputed (its input
kept or offloaded), selectively recomputed (what the policy keeps kept on the device, or offloaded
to the host pool: "selective_offload"), or -- several blocks -- a segment recomputed as one.
The planner's solver produces units (``ckpt_offload.planner``); :mod:`ckpt_offload.blocks`
installs them on a model. Importable as ``ckpt_offload.planner.simulator.Unit`` too.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KINDS", "SEGMENT_KINDS", "INNER_KINDS", "STORE_KINDS", "OFFLOADING_KINDS", "Unit", "choice_names"]

#: What a unit of the plan does with its blocks' saved activations.
KINDS = ("keep", "offload", "recompute", "recompute_offload", "selective", "selective_offload")
#: Kinds a unit of several consecutive blocks can have (one checkpoint around them: Chen's segments).
SEGMENT_KINDS = ("recompute", "recompute_offload")
#: Kinds that offload, and so may store what they offload in a narrower dtype (``Unit.store``).
STORE_KINDS = ("offload", "recompute_offload")
#: Kinds that copy something to the host pool (and reload it in backward).
OFFLOADING_KINDS = ("offload", "recompute_offload", "selective_offload")


#: Kinds of the parts inside a nested segment: a block the segment's recompute runs as is, or an
#: inner checkpoint (itself flat or nested) that the segment's recompute runs without keeping its
#: activations, recomputed again when backward reaches it (multi-level checkpointing, as in rotor).
INNER_KINDS = ("keep", "recompute")


@dataclass(frozen=True)
class Unit:
    """Blocks ``start..end`` (inclusive) handled as one: ``kind`` in :data:`KINDS`; several blocks
    only for :data:`SEGMENT_KINDS`.

    ``inner`` nests a segment: units covering ``start..end`` in order, each ``"keep"`` (one block the
    segment's recompute runs as is) or ``"recompute"`` (an inner checkpoint, itself flat or with its
    own ``inner``). In backward the segment's recompute then keeps only the inputs of its inner
    checkpoints, and each inner checkpoint recomputes its blocks when backward reaches it: less
    memory, more recompute. An ``inner`` of only ``"keep"`` units is the flat segment (normalised
    to ``()``).

    Example::

        Unit(0, 7, "recompute", inner=(Unit(0, 3, "recompute"), Unit(4, 7, "recompute")))
    """

    start: int
    end: int
    kind: str
    inner: tuple = ()
    #: the unit stores what it offloads in the cost model's ``store_dtype`` (lossy; only for
    #: "offload" and "recompute_offload")
    store: bool = False

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown kind {self.kind!r}; allowed: {KINDS}")
        if self.end < self.start:
            raise ValueError(f"unit end {self.end} < start {self.start}")
        if self.end > self.start and self.kind not in SEGMENT_KINDS:
            raise ValueError(f"a unit of several blocks must be one of {SEGMENT_KINDS}, got {self.kind!r}")
        if self.store and self.kind not in STORE_KINDS:
            raise ValueError(f"only {STORE_KINDS} units offload, so only they can store lossy; got {self.kind!r}")
        inner = tuple(self.inner)
        if not inner:
            return
        if self.kind not in SEGMENT_KINDS:
            raise ValueError(f"only a segment ({SEGMENT_KINDS}) can have inner units, got {self.kind!r}")
        expect = self.start
        for v in inner:
            if not isinstance(v, Unit) or v.kind not in INNER_KINDS:
                raise ValueError(f"inner units must be Unit objects of kind {INNER_KINDS}, got {v!r}")
            if v.start != expect:
                raise ValueError(
                    f"inner units must cover blocks {self.start}..{self.end} in order; expected one "
                    f"starting at {expect}, got {v}"
                )
            expect = v.end + 1
        if expect != self.end + 1:
            raise ValueError(
                f"inner units cover blocks {self.start}..{expect - 1}, the segment {self.start}..{self.end}"
            )
        if len(inner) == 1 and inner[0].kind == "recompute":
            raise ValueError(
                f"an inner checkpoint around the whole segment {self.start}..{self.end} recomputes it "
                "twice and saves nothing: leave inner empty"
            )
        # Equal plans compare equal: only-"keep" parts are the flat segment.
        object.__setattr__(self, "inner", inner if any(v.kind == "recompute" for v in inner) else ())

    @property
    def parts(self) -> tuple:
        """What the unit's recompute runs, in order: ``inner``, or one ``"keep"`` unit per block."""
        return self.inner or tuple(Unit(i, i, "keep") for i in range(self.start, self.end + 1))

    @property
    def checkpoints(self) -> int:
        """How many checkpoints the unit is: 0 for keep / offload, 1 + its inner ones otherwise."""
        if self.kind in ("keep", "offload"):
            return 0
        return 1 + sum(v.checkpoints for v in self.inner if v.kind == "recompute")

    @property
    def levels(self) -> int:
        """Checkpoint levels: 1 for a flat unit, 2 for a segment with inner checkpoints, ..."""
        return 1 + max((v.levels for v in self.inner if v.kind == "recompute"), default=0)

    def describe(self) -> str:
        """``"0..7 recompute [0..3 recompute, 4..7 recompute]"`` -- the nesting on one line."""
        head = f"{self.start}" if self.start == self.end else f"{self.start}..{self.end}"
        head += f" {self.kind}" + (" (lossy)" if self.store else "")
        if self.inner:
            head += " [" + ", ".join(v.describe() for v in self.inner) + "]"
        return head


def choice_names(units) -> list:
    """Per block, what it does, as ``plan.choices`` shows it: the unit's kind for a single block,
    ``"<kind>_segment"`` in a segment; in a nested segment, the checkpoints around the block from
    the outermost in, joined by ``">"``.

    Example::

        choice_names([Unit(0, 2, "recompute", inner=(Unit(0, 1, "recompute"), Unit(2, 2, "keep")))])
        # ['recompute_segment>recompute_segment', 'recompute_segment>recompute_segment', 'recompute_segment']
    """
    out = []
    for u in units:
        own = u.kind if u.start == u.end else f"{u.kind}_segment"
        if not u.inner:
            out += [own] * (u.end - u.start + 1)
            continue
        for p in u.inner:
            out += [own] if p.kind == "keep" else [f"{own}>{x}" for x in choice_names([p])]
    return out
