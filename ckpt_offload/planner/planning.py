"""``co.plan``: from "my saved activations must fit in B bytes" to the fastest mix of keep / offload /
recompute per block, predicted by the simulator from measured costs."""

from __future__ import annotations

import dataclasses
import math
import warnings

import torch

from ckpt_offload._args import check_int, parse_bytes, suggest_keywords
from ckpt_offload.blocks.handle import check_not_applied
from ckpt_offload.blocks.install import install_units
from ckpt_offload.blocks.select import select_blocks
from ckpt_offload.selective import OFFLOAD_POLICIES, create_selective_checkpoint_contexts
from ckpt_offload.options import STORE_DTYPE_NAMES, OffloadOptions, as_options
from ckpt_offload.planner.costs import INEXACT_REASONS, UNCHAINED, Bandwidth, CostModel
from ckpt_offload.planner.measuring import measure_costs
from ckpt_offload.planner.simulator import KINDS, STORE_KINDS, SimResult, choice_names, simulate, singles
from ckpt_offload.planner.solver import InfeasibleBudget, _fmt, solve
from ckpt_offload.planner.tiles import measure_tiled_costs, solve_with_tiles
from ckpt_offload.tile_model import as_tile_options, tile_blocks

__all__ = ["plan", "Plan", "parse_bytes", "parse_bandwidth", "parse_lossy", "LOSSY_NAMES", "SLACK_BYTES"]

#: Plans leave this many bytes of the budget free: autograd keeps a few scalar buffers alive through
#: backward that the cost model does not see (16 bytes a step on the built-in model).
SLACK_BYTES = 256

#: The deepest nesting of segments co.plan builds (levels=); deeper would plan like this anyway.
MAX_LEVELS = 3

#: The names ``co.plan(..., lossy=...)`` accepts besides the dtypes themselves: store_dtype='s.
LOSSY_NAMES = STORE_DTYPE_NAMES


def parse_lossy(value):
    """``co.plan``'s ``lossy``: None, one of co.offload's storage dtypes (``torch.bfloat16``,
    ``torch.float16``, ``torch.float8_e4m3fn``, ``torch.float8_e5m2``) or a name in
    :data:`LOSSY_NAMES` (``"bf16"``, ``"fp16"``, ``"fp8"`` = e4m3fn, ``"fp8_e5m2"``); returns the dtype.

    Example::

        parse_lossy("bf16")    # torch.bfloat16
        parse_lossy("int8")    # ValueError: lossy must be None, ...
    """
    from ckpt_offload.options import STORE_DTYPES

    if value is None:
        return None
    accepted = (
        "None (exact storage only), a storage dtype ("
        + ", ".join(str(d) for d in STORE_DTYPES)
        + ") or one of "
        + ", ".join(f"{k!r}" for k in LOSSY_NAMES)
    )
    if isinstance(value, str):
        got = LOSSY_NAMES.get(value.strip().lower())
        if got is None:
            raise ValueError(f"lossy must be {accepted}; got {value!r}")
        return got
    if isinstance(value, torch.dtype):
        if value not in STORE_DTYPES:
            raise ValueError(f"lossy must be {accepted}; got {value} (not a storage dtype co.offload converts to)")
        return value
    raise TypeError(f"lossy must be {accepted}; got {type(value).__name__} {value!r}")


def parse_bandwidth(value) -> Bandwidth | None:
    """``None`` (measure it), a number or string of bytes per second for both ways (``"25GB/s"``,
    ``math.inf``, ``0``), or a dict ``{"d2h": ..., "h2d": ..., "latency": seconds, "issue": seconds,
    "convert": ...}`` (``latency``: a copy's fixed delay; ``issue``: the queue time per copy of
    copies issued back to back, default ``latency``; ``convert``: bytes/s of lossy storage's
    conversion on the device, each way; all three optional)."""
    if value is None or isinstance(value, Bandwidth):
        return value

    def one(key, v):
        original = v
        if isinstance(v, float) and math.isinf(v) and v > 0:
            return math.inf
        if isinstance(v, str):
            v = v.strip()
            if v.lower() in ("inf", "infinite"):
                return math.inf
            v = v[:-2] if v.lower().endswith("/s") else v
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v < 0:
            raise ValueError(
                f"bandwidth{key} must be bytes per second >= 0, got {original!r}: a copy rate cannot "
                "be negative; write e.g. '25GB/s', 'inf' (no copy cost), or None to measure it"
            )
        try:
            return float(parse_bytes(f"bandwidth{key}", v))
        except (TypeError, ValueError) as e:
            # parse_bytes' own hint shows sizes ('2GiB'); a bandwidth is bytes per second.
            raise type(e)(
                f"bandwidth{key}: cannot read {original!r} as bytes per second; write e.g. '25GB/s', "
                "'12.5GiB/s', 'inf' (no copy cost), 0, a number of bytes/s, or None to measure it"
            ) from None

    if isinstance(value, dict):
        unknown = sorted(set(value) - {"d2h", "h2d", "latency", "issue", "convert"})
        if unknown:
            raise TypeError(f"bandwidth: unknown key(s) {unknown}; allowed: d2h, h2d, latency, issue, convert")
        if "d2h" not in value or "h2d" not in value:
            raise ValueError("bandwidth as a dict needs both 'd2h' and 'h2d' (bytes per second)")
        lat = float(value.get("latency", 0.0))
        if not lat >= 0:
            raise ValueError(f"bandwidth['latency'] must be seconds >= 0, got {value.get('latency')!r}")
        issue = value.get("issue")
        if issue is not None:
            issue = float(issue)
            if not 0 <= issue <= lat:
                raise ValueError(
                    f"bandwidth['issue'] must be seconds between 0 and bandwidth['latency'] ({lat}), "
                    f"got {value.get('issue')!r}: a copy holds its queue no longer than it takes"
                )
        convert = value.get("convert")
        if convert is not None:
            convert = one("['convert']", convert)
            if convert <= 0:
                raise ValueError("bandwidth['convert'] must be bytes per second > 0 (or None to measure it)")
        return Bandwidth(one("['d2h']", value["d2h"]), one("['h2d']", value["h2d"]), lat, convert, issue)
    bw = one("", value)
    return Bandwidth(bw, bw, 0.0)


class Plan:
    """What :func:`plan` chose and what it predicts.

    Attributes:
        choices: ``{block name: kind}``, kind in ``keep``, ``offload``, ``recompute``,
            ``recompute_offload``, ``selective``, ``selective_offload`` (selective recompute whose
            kept outputs wait in the host pool), or ``recompute_segment`` /
            ``recompute_offload_segment`` for the blocks of a segment checkpointed as one; in a
            nested segment, the checkpoints around the block from the outermost in, joined by
            ``">"`` (``"recompute_segment>recompute_segment"``: a block of an inner segment).
        predicted_peak_bytes: device peak of saved activations the simulator predicts.
        predicted_step_seconds: step time it predicts.
        baseline: the step without a plan, measured: ``step_seconds``, ``peak_bytes`` (saved
            activations at the end of forward, all kept) and the simulator's ``predicted_step_seconds``.
        budget: the budget in bytes; prefetch_bytes: the prefetch window the plan's offload uses;
        costs: the :class:`~ckpt_offload.planner.costs.CostModel`; units: the chosen units;
        simulation: the :class:`~ckpt_offload.planner.simulator.SimResult` of the plan.
        lossy: the storage dtype the plan was allowed (``co.plan(..., lossy=...)``), or None;
        store_dtypes: ``{block name: dtype}`` for the blocks whose offloaded activations the plan
            stores in that narrower dtype (not bit-exact); empty for an exact plan.
        predicted_host_bytes: the host bytes the plan's offloads take (narrow bytes for the lossy
            blocks; what the offload contexts' ``stats()["bytes_stored"]`` count in a step).
        tiles: the blocks the plan tiles (``co.plan(..., tile=...)``; empty without it or
            when the budget fits without tiles); tile_info: why (Note [Fewest tiles] in
            ``planner/tiles.py``): ``untiled_minimum``, ``tiled_minimum``, ``extra_s``.
    """

    def __init__(
        self,
        model,
        named_blocks,
        costs: CostModel,
        units,
        prefetch_bytes,
        budget,
        offload_options,
        sim: SimResult,
        baseline: dict,
        source: str,
        allow_inexact=frozenset(),
        lossy=None,
        tiles=(),
        tile_options=None,
        tile_info=None,
    ):
        self.model = model
        self.tiles = [named_blocks[i][0] for i in tiles]
        self._tiled = list(tiles)
        self.tile_options = tile_options
        self.tile_info = tile_info
        self.lossy = lossy
        self.store_dtypes = {named_blocks[i][0]: lossy for u in units if u.store for i in range(u.start, u.end + 1)}
        self.predicted_host_bytes = sum(info["pool_bytes"] for info in sim.units)
        self.allow_inexact = frozenset(allow_inexact)  #: the inexact reasons the plan was allowed
        self._named_blocks = named_blocks
        self.costs = costs
        self.units = list(units)
        self.prefetch_bytes = prefetch_bytes
        self.budget = budget
        #: the :class:`~ckpt_offload.OffloadOptions` of the plan's offloads (``co.plan``'s
        #: ``offload=`` and loose options, the devices resolved, the prefetch window chosen)
        self.offload_options = as_options(offload_options).replace(prefetch_bytes=prefetch_bytes)
        self.simulation = sim
        self.baseline = baseline
        self.source = source
        self.choices = {name: kind for (name, _), kind in zip(named_blocks, choice_names(self.units))}
        self.predicted_peak_bytes = sim.peak_bytes
        self.predicted_step_seconds = sim.step_s
        #: ``{block name: {kind: why}}``: the choices the plan could not give a block because the
        #: measured step showed they would not be exact (see ``allow_inexact`` of :func:`plan`)
        self.excluded = {name: dict(ex) for (name, _), ex in zip(named_blocks, costs.excluded or []) if ex}

    def apply(self):
        """Installs the plan on the model (like ``co.apply``); returns a handle whose ``remove()``
        restores it. The plan holds in training mode with gradients enabled; in ``eval()`` or under
        ``torch.no_grad()`` the blocks run unchanged.

        Example::

            handle = plan.apply()
            step()
            handle.remove()
        """
        handle = install_units(
            self.model, self._named_blocks, self.units, self.offload_options, self.allow_inexact, store_dtype=self.lossy
        )
        if self._tiled:
            try:
                handle.tiles = tile_blocks(
                    self.model,
                    [self._named_blocks[i] for i in self._tiled],
                    dataclasses.replace(self.tile_options, head=False),
                    "a plan",
                )
            except BaseException:
                handle.remove()
                raise
        return handle

    def summary(self) -> str:
        """A table: per block its choice, device bytes kept through forward, bytes sent to the pool,
        extra compute, copy time; then totals against no plan."""
        cm = self.costs
        lines = [
            f"plan for {len(cm.blocks)} blocks, budget {_fmt(self.budget)} of saved activations "
            f"(prefetch window {_fmt(self.prefetch_bytes)}, chosen by {self.source})",
            f"{'block':<28} {'choice':<26} {'device':>11} {'pool':>11} {'recompute':>10} {'copies':>10}",
        ]
        for u, info in zip(self.units, self.simulation.units):
            label = self._named_blocks[u.start][0]
            if u.end > u.start:
                label = f"{label}..{self._named_blocks[u.end][0].rsplit('.', 1)[-1]}"
            kind = u.kind if u.start == u.end else f"{u.kind} (segment)"
            if any(i in self._tiled for i in range(u.start, u.end + 1)):
                kind += " +tile"
            if u.store:
                kind += f" [{_dtype_name(self.lossy)}]"
            lines.append(
                f"{label:<28} {kind:<26} {_fmt(info['device_bytes']):>11} {_fmt(info['pool_bytes']):>11} "
                f"{info['recompute_s'] * 1e3:>8.2f}ms {info['copy_s'] * 1e3:>8.2f}ms"
            )
            lines += self._inner_lines(u, 1)
        b = self.baseline
        base_s = b["predicted_step_seconds"]
        slow = (self.predicted_step_seconds / base_s - 1) * 100 if base_s else 0
        lines.append(
            f"peak of saved activations: {_fmt(self.predicted_peak_bytes)} predicted "
            f"(no plan: {_fmt(b['peak_bytes'])}, {self.predicted_peak_bytes / max(b['peak_bytes'], 1):.0%})"
        )
        lines.append(
            f"step time: {self.predicted_step_seconds * 1e3:.2f} ms predicted (no plan: "
            f"{base_s * 1e3:.2f} ms predicted, {b['step_seconds'] * 1e3:.2f} ms measured; "
            f"{slow:+.1f}%)"
        )
        if self.tile_options is not None:
            lines.append(self._tile_line())
        if self.store_dtypes:
            conv = sum(info.get("convert_s", 0.0) for info in self.simulation.units)
            lines.append(
                f"lossy: blocks {', '.join(self.store_dtypes)} store their offloaded floating-point "
                f"activations as {_dtype_name(self.lossy)} (not bit-exact; host bytes "
                f"{_fmt(self.predicted_host_bytes)}, conversions {conv * 1e3:.2f} ms)"
            )
        elif self.lossy is not None:
            lines.append(
                f"lossy: {_dtype_name(self.lossy)} storage was allowed, and no block gains from it: the plan is exact"
            )
        if self.excluded:
            lines.append(
                "excluded, since their recompute would not be exact (co.plan(..., allow_inexact=...) allows them):"
            )
            for name, ex in self.excluded.items():
                by_why = {}
                for kind, why in ex.items():
                    by_why.setdefault(why, []).append(kind)
                for why, kinds in by_why.items():
                    if kinds == ["segment"]:  # not an exactness matter: allow_inexact cannot lift it
                        lines.append(f"  {name}: {why}")
                        continue
                    if "recompute" in kinds:
                        kinds = kinds + ["segments"]
                    lines.append(f"  {name}: no {', '.join(kinds)}: {why}")
        return "\n".join(lines)

    def _tile_line(self) -> str:
        """Why the plan tiles the blocks it tiles (Note [Fewest tiles])."""
        info = self.tile_info or {}
        n = len(self._named_blocks)
        if not self.tiles:
            return f"tiles: none of {n} blocks: the budget fits without tiling"
        parts = "MLP and norms" if self.tile_options.norms else "MLP"
        return (
            f"tiles: {len(self.tiles)} of {n} blocks tiled ({parts}), the fewest that fit the budget (the smallest "
            f"peak without tiles: {_fmt(info.get('untiled_minimum') or 0)}; with these tiles the plan's: "
            f"{_fmt(self.predicted_peak_bytes)}); the tiles add {info.get('extra_s', 0.0) * 1e3:.2f} ms of "
            "compute (each tile's forward again in backward, measured)"
        )

    def _inner_lines(self, u, depth):
        """A nested segment's inner checkpoints, one indented line each (the segment's line holds
        the bytes and the recompute of all its levels)."""
        out = []
        for v in u.inner:
            if v.kind != "recompute":
                continue
            label = self._named_blocks[v.start][0]
            if v.end > v.start:
                label = f"{label}..{self._named_blocks[v.end][0].rsplit('.', 1)[-1]}"
            kind = "recompute (inner segment)" if v.end > v.start else "recompute (inner)"
            out.append(f"{'  ' * depth + label:<28} {'  ' * depth + kind}")
            out += self._inner_lines(v, depth + 1)
        return out

    def __repr__(self):
        lossy = f", lossy={ {k: _dtype_name(v) for k, v in self.store_dtypes.items()} }" if self.store_dtypes else ""
        return (
            f"Plan(peak={_fmt(self.predicted_peak_bytes)}, step={self.predicted_step_seconds * 1e3:.2f} ms, "
            f"choices={self.choices}{lossy})"
        )


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _model_device(model) -> str:
    for p in model.parameters():
        return p.device.type
    return "cpu"


@suggest_keywords("co.plan")
def plan(
    model: torch.nn.Module,
    step,
    budget=None,
    devices=None,
    layers=None,
    bandwidth=None,
    *,
    min_bytes=None,
    kinds=KINDS,
    segments: bool = True,
    levels: int = 2,
    prefetch_bytes=None,
    costs: CostModel | None = None,
    pool=None,
    allow_inexact=False,
    lossy=None,
    offload=None,
    tile=None,
):
    """Measures ``step`` and picks, per block of ``model``, keep / offload / recompute /
    recompute_offload / selective / selective_offload (and segments of blocks recomputed as one)
    so that the device peak of saved activations fits ``budget`` with the least predicted step time.

    Args:
        model: the ``nn.Module`` whose blocks are planned (its parameters' device is the device).
        step: a function of no arguments running one forward and backward of the training step (no
            optimizer step needed). It is called three times (warm-up, bytes, times) with the
            model in its current mode; gradients accumulate, zero them after.
        budget: bytes (int) or a string such as ``"2GiB"``: the device memory saved activations
            may take at peak -- the one thing a plan must be told. Too small:
            :class:`~ckpt_offload.planner.solver.InfeasibleBudget` (a ``ValueError``) naming the
            smallest feasible budget. Left out, it is 2 GiB with a ``DeprecationWarning`` (required
            from 0.3.0).
        devices: deprecated (warns; goes in 0.3.0): ``offload={"devices": ...}``.
        layers: which blocks, as in ``co.apply`` (default: the longest list of identical blocks).
        bandwidth: ``None`` measures the host link through the pool; or bytes/s for both ways
            (``"25GB/s"``, ``math.inf``, ``0`` = no offload), or ``{"d2h", "h2d", "latency", "issue"}``, e.g.
            to plan for a GPU from a CPU machine.
        min_bytes: deprecated (warns; goes in 0.3.0): ``offload={"min_bytes": ...}``.
        kinds: the choices allowed (a subset of ``("keep", "offload", "recompute",
            "recompute_offload", "selective", "selective_offload")``). ``selective`` keeps the
            outputs of the block's matmuls, convolutions and fused attention on the device and
            recomputes the rest; ``selective_offload`` recomputes the same ops but keeps those
            outputs in the host pool (:func:`~ckpt_offload.selective_offload_context`).
        segments: allow segments of consecutive blocks checkpointed as one (needs blocks chained
            through their first argument).
        levels: how deep segments may nest (1 to 3): 1 = flat segments (Chen's), 2 = a segment whose
            recompute checkpoints inner segments again (multi-level, as in rotor: less memory, more
            recompute), 3 = one more level (a slower search: seconds for 16 blocks).
        prefetch_bytes: deprecated (warns; goes in 0.3.0): ``offload={"prefetch_bytes": ...}``.
        costs: a :class:`~ckpt_offload.planner.costs.CostModel` measured before (skips measuring).
        pool: deprecated (warns; goes in 0.3.0): ``offload={"pool": ...}``.
        allow_inexact: ``False`` (default): a block is never given a choice the measured step shows
            would not be exact -- no recompute (single, in a segment, selective) for a block that
            writes one of its inputs in place (``"input_write"``) or a tensor from outside itself,
            such as BatchNorm's running statistics, which a recompute would update twice
            (``"state_write"``), and no selective recompute for one that writes a matmul's output in
            place (``"saved_mutation"``); :meth:`Plan.summary` lists what was excluded and why.
            ``True`` allows all of them, or a collection of those reason names allows those.
        lossy: ``None`` (default): every offloaded byte is stored exactly, as without this option
            (the plan is the one made without it, and gradients are bit-identical). A storage
            dtype -- ``torch.bfloat16``, ``torch.float16``, ``torch.float8_e4m3fn``,
            ``torch.float8_e5m2``, or the names ``"bf16"``, ``"fp16"``, ``"fp8"`` (= e4m3fn),
            ``"fp8_e5m2"`` -- is the tolerance you accept: each offloading choice ("offload",
            "recompute_offload", single or segment) is then also offered storing what it offloads
            in that dtype (``co.offload(store_dtype=...)``), beside the exact one, and the solver
            takes a lossy one only where that makes the predicted step faster or is what brings
            the peak under the budget (at equal time and peak, the exact one). A lossy choice sends fewer bytes over the
            link and keeps fewer on the host
            (half of fp32 for bf16/fp16, a quarter for fp8) at the cost of a conversion each way
            on the device and of the rounding error in the gradients of that block and of the
            blocks before it; integer, bool and already-narrow tensors stay exact. The cost model
            counts, per saved tensor, what the dtype converts (from the dtypes measured), and the
            conversion rate is measured on the device (``bandwidth={..., "convert": bytes/s}``
            states it instead). :attr:`Plan.store_dtypes` lists the blocks that store lossy. The
            search takes about three times as long (the exact one runs first: a lossy plan is
            never predicted slower than the exact plan).
        offload: the options of the plan's offloads, in the one spelling every route takes: a
            :class:`~ckpt_offload.OffloadOptions` or a dict of ``co.offload`` options (default:
            ``co.offload``'s). ``devices`` (default: the model's device type; ``["cpu"]`` to
            offload CPU tensors) and ``min_bytes`` are also what the planner measures and plans
            with; ``prefetch_bytes`` is the prefetch window (``None`` lets the planner choose);
            ``pool`` is the :class:`~ckpt_offload.HostPool` the plan's offloads use when applied,
            e.g. one with ``spill_dir=`` so what exceeds its cap goes to disk (the plan's costs
            assume the host link, not the disk); ``on_full``, ``batch_below``, ``batch_bytes``,
            ``store_min_bytes`` and ``measure_error`` reach the plan's offloads as they are. Two are
            the planner's to choose: ``store_dtype`` (pass ``lossy=``, and the plan stores narrower
            only where it pays) and ``stream`` (the simulator models copies on queues of their own,
            so only ``"side"``).
        tile: ``None`` (default), or a :class:`~ckpt_offload.TileOptions` (``True``, an int of
            positions per tile, a size string, a dict of its fields): tiling a block's MLP along the
            sequence becomes a choice per block (its MLP and, by default, its norms). The step is
            measured a second time with every block tiled (what each block then saves, and the time
            the tiles add), and the plan
            tiles the fewest blocks with which it fits the budget -- none when it fits without
            (:attr:`Plan.tiles`; :meth:`Plan.summary` says why).

    The measuring runs of ``step`` leave the model's buffers (running statistics) as they found
    them.

    Returns:
        a :class:`Plan`.

    Example::

        plan = co.plan(model, lambda: loss_fn(model(x)).backward(), budget="2GiB")
        print(plan.summary())
        handle = plan.apply()
        # the plan's offloads with options of their own:
        co.plan(model, step, budget="2GiB", offload=co.OffloadOptions(min_bytes="1MiB", on_full="raise"))
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not callable(step):
        raise TypeError(
            f"step must be a function of no arguments running forward and backward, got {type(step).__name__}"
        )
    if budget is None:
        warnings.warn(
            "co.plan without budget= is deprecated and the 2GiB it falls back to goes in 0.3.0: pass the device "
            "memory saved activations may take, e.g. co.plan(model, step, budget='2GiB')",
            DeprecationWarning,
            stacklevel=2,
        )
        budget = "2GiB"
    budget_bytes = parse_bytes("budget", budget)
    tiles = as_tile_options(tile)
    opts = _plan_offload(offload, devices=devices, min_bytes=min_bytes, pool=pool, prefetch_bytes=prefetch_bytes)
    devices, min_bytes, pool, prefetch_bytes = opts.devices, opts.min_bytes, opts.pool, opts.prefetch_bytes
    kinds = tuple(kinds)
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise ValueError(f"kinds must be a non-empty subset of {KINDS}, got {kinds!r}")
    levels = check_int("levels", levels, minimum=1, maximum=MAX_LEVELS)
    bw = parse_bandwidth(bandwidth)
    store_dtype = parse_lossy(lossy)
    device = _model_device(model)
    dev_types = [device] if devices is None else list(devices)
    allow = _allowed_reasons(allow_inexact)
    _check_not_wrapped(model)
    try:
        named = select_blocks(model, layers, route="co.plan")
    except ValueError as e:
        if "found no" not in str(e):
            raise
        what = (
            "the blocks it plans are the largest list of identical blocks (an nn.ModuleList or nn.Sequential "
            "of 2 or more modules of one class), and there is none"
            if layers is None
            else f"layers={layers!r} selects no submodule"
        )
        raise ValueError(
            f"co.plan found no blocks to plan in {type(model).__name__}: {what}. Pass layers=<the block class> (for "
            "example layers=type(model.layers[0])) or a predicate layers=lambda name, module: ... selecting the "
            "blocks whose saved activations the plan chooses for"
        ) from None
    _check_not_wrapped(model, named)
    if costs is None:
        state = [(b, b.detach().clone()) for b in model.buffers()]
        try:
            costs = measure_costs(step, named, device=device, bandwidth=bw, min_bytes=min_bytes)
        finally:
            # The measuring runs are not training steps: running statistics stay as they were.
            with torch.no_grad():
                for b, before in state:
                    if b.shape == before.shape:
                        b.copy_(before)
            del state
    elif len(costs.blocks) != len(named):
        raise ValueError(f"costs has {len(costs.blocks)} blocks, the model {len(named)}; measure them again")
    else:
        # This plan's settings (min_bytes, bandwidth, exclusions, storage) go on a copy: the caller's
        # CostModel, which may serve other plans, stays as it was measured.
        costs = dataclasses.replace(costs)
    costs.excluded = _excluded(costs, allow)
    if bw is not None:
        costs.bandwidth = bw
    costs.min_bytes = min_bytes
    costs.store_dtype = store_dtype
    if device not in dev_types:
        kinds = tuple(k for k in kinds if k in ("keep", "recompute", "selective"))
    if create_selective_checkpoint_contexts is None:
        kinds = tuple(k for k in kinds if k not in ("selective", "selective_offload"))
    if not OFFLOAD_POLICIES:  # a torch without CheckpointPolicy.MUST_CPU_OFFLOAD
        kinds = tuple(k for k in kinds if k != "selective_offload")
    if store_dtype is not None and costs.bandwidth.convert is None and any(k in STORE_KINDS for k in kinds):
        # Measured like the link (the planner's costs are this machine's), unless stated.
        from ckpt_offload.planner.timing import measure_conversion

        costs.bandwidth = dataclasses.replace(costs.bandwidth, convert=measure_conversion(device, store_dtype))
    for (name, _), ex in zip(named, costs.excluded):
        if all(k in ex for k in kinds):
            raise ValueError(
                f"co.plan: block {name!r} can have none of kinds={kinds}: {'; '.join(sorted(set(ex.values())))}. "
                "Add 'keep' (or 'offload') to kinds, or pass allow_inexact=True to allow it anyway"
            )
    tiled, tile_info, plan_costs = [], None, costs
    try:
        if tiles is None:
            best = solve(
                costs,
                budget_bytes - SLACK_BYTES,
                kinds=kinds,
                prefetch_bytes=prefetch_bytes,
                segments=segments,
                levels=levels,
            )
        else:
            tiled_costs = dataclasses.replace(
                measure_tiled_costs(step, model, named, tiles, device, costs.bandwidth, min_bytes),
                bandwidth=costs.bandwidth,
                min_bytes=min_bytes,
                store_dtype=store_dtype,
                excluded=costs.excluded,
            )
            best, tiled, plan_costs, tile_info = solve_with_tiles(
                costs,
                tiled_costs,
                budget_bytes - SLACK_BYTES,
                kinds=kinds,
                prefetch_bytes=prefetch_bytes,
                segments=segments,
                levels=levels,
            )
    except InfeasibleBudget as e:
        smallest = e.minimum + SLACK_BYTES
        raise InfeasibleBudget(
            budget_bytes,
            smallest,
            f"budget={_fmt(budget_bytes)} is below the smallest peak of saved activations any plan reaches here"
            f"{' with every block tiled' if tiles is not None else ''}, {_fmt(smallest)} ({smallest} bytes): pass "
            f"budget >= {smallest} (a smaller batch or sequence lowers it)",
        ) from None
    if getattr(getattr(model, "config", None), "use_cache", False) is True and any(
        u.kind in ("recompute", "recompute_offload", "selective", "selective_offload") for u in best.units
    ):
        warnings.warn(
            "co.plan: model.config.use_cache is True, so recomputed key/value tensors stay alive until the end "
            "of backward and the measured peak exceeds the prediction; set model.config.use_cache = False for "
            "training (as gradient_checkpointing_enable does)",
            stacklevel=2,
        )
    sim = simulate(plan_costs, best.units, best.prefetch_bytes)
    base_sim = simulate(costs, singles(["keep"] * len(named)), 0)
    baseline = {
        "step_seconds": costs.baseline_step_s,
        "peak_bytes": base_sim.peak_bytes,
        "predicted_step_seconds": base_sim.step_s,
    }
    options = opts.replace(devices=dev_types)
    return Plan(
        model,
        named,
        plan_costs,
        best.units,
        best.prefetch_bytes,
        budget_bytes,
        options,
        sim,
        baseline,
        best.source,
        allow,
        lossy=store_dtype,
        tiles=tiled,
        tile_options=tiles,
        tile_info=tile_info,
    )


def _plan_offload(offload, **loose) -> OffloadOptions:
    """``co.plan``'s ``offload=`` with its deprecated loose options (``devices``, ``min_bytes``,
    ``pool``, ``prefetch_bytes``; they warn) merged in. A field both in ``offload=`` (a dict's
    keys; every field of an :class:`OffloadOptions`, which is a whole option set) and loose must
    have the same value there; ``devices`` stays None for "the model's".

    Example::

        _plan_offload({"on_full": "raise", "min_bytes": "1MiB"}, devices=None, min_bytes=None, pool=None,
                      prefetch_bytes=None)
        # OffloadOptions(min_bytes=1048576, on_full='raise')
    """
    if offload is False:
        raise ValueError(
            "co.plan(offload=False): a plan chooses per block whether to offload; to plan without offloading, "
            "pass kinds=('keep', 'recompute', 'selective')"
        )
    opts = as_options(True if offload is None else offload, name="co.plan offload")
    given = {k: v for k, v in loose.items() if v is not None}
    if given:
        spelled = ", ".join(f"{k!r}: {v!r}" for k, v in given.items())
        warnings.warn(
            f"co.plan({', '.join(f'{k}=' for k in given)}) is deprecated and goes in 0.3.0: pass the plan's offload "
            f"options in offload=, e.g. co.plan(model, step, budget=..., offload={{{spelled}}})",
            DeprecationWarning,
            stacklevel=3,
        )
        try:
            loose_opts = OffloadOptions(**given)  # the same checks and spelling ("1MiB" -> 1048576)
        except (TypeError, ValueError) as e:
            raise type(e)(f"co.plan: {e}") from None
        stated = (
            set(offload) if isinstance(offload, dict) else set(given) if isinstance(offload, OffloadOptions) else set()
        )
        for name in given:
            if name in stated and getattr(loose_opts, name) != getattr(opts, name):
                raise TypeError(
                    f"co.plan got {name} twice with different values: {name}={getattr(loose_opts, name)!r} as an "
                    f"argument and {getattr(opts, name)!r} in offload=; give it once, in offload="
                )
    if opts.store_dtype is not None:
        raise ValueError(
            f"co.plan: offload= sets store_dtype={opts.store_dtype}, which a plan chooses per block: pass "
            f"lossy={opts.store_dtype} instead (blocks store narrower where that pays, the rest exactly)"
        )
    if opts.stream != "side":
        raise ValueError(
            f"co.plan: offload= sets stream={opts.stream!r}; a plan's time model has copies on queues of their own, "
            "which is stream='side' (the default): leave stream out"
        )
    return opts.replace(**given) if given else opts


def _allowed_reasons(allow_inexact) -> set:
    if allow_inexact is True:
        return set(INEXACT_REASONS)
    if allow_inexact is False or allow_inexact is None:
        return set()
    if isinstance(allow_inexact, str):
        allow_inexact = [allow_inexact]
    try:
        reasons = set(allow_inexact)
    except TypeError:
        raise TypeError(
            f"allow_inexact must be True, False or a collection of {sorted(INEXACT_REASONS)}, got "
            f"{type(allow_inexact).__name__}"
        ) from None
    bad = sorted(str(r) for r in reasons - set(INEXACT_REASONS))
    if bad:
        raise ValueError(
            f"allow_inexact: unknown reason(s) {bad}; allowed: {sorted(INEXACT_REASONS)} (or True for all)"
        )
    return reasons


def _excluded(costs, allow) -> list:
    """Per block ``{kind: why}``: the kinds its measured ``inexact`` reasons rule out, less those
    ``allow`` allows."""
    out = []
    for b in costs.blocks:
        ex = {}
        for reason, what in (getattr(b, "inexact", None) or {}).items():
            if reason == UNCHAINED:  # not a matter of exactness: such a segment cannot run at all
                ex.setdefault("segment", f"no segment over it and the next block: it {what}")
                continue
            if reason in allow:
                continue
            for kind in INEXACT_REASONS.get(reason, ()):
                ex.setdefault(kind, f"{what} ({reason})")
        out.append(ex)
    return out


def _check_not_wrapped(model, named=()):
    check_not_applied(
        model,
        named,
        "co.plan",
        why="; measuring it would measure those checkpoints, not the model (every block would be 'keep')",
    )


__all__ += ["InfeasibleBudget"]
