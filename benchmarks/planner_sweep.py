#!/usr/bin/env python3
"""Planner sweep: co.plan at budgets from "everything fits" down to the smallest feasible one,
predicted vs measured, against the strategies people use today.

For each budget (``--points`` of them, geometric between the no-plan peak of saved activations and
the smallest budget any plan reaches) the built-in TinyTransformer runs under:

=======================  ==========================================================================
``plan``                 ``co.plan(model, step, budget=B)``: the planner's choice
``chen_sqrt``            Chen et al.: round(sqrt(n)) segments of blocks, each one checkpoint
``every_layer_offload``  Hugging Face's ``offload=True``: every block checkpointed, inputs offloaded
``first_k_offload``      Transformer Engine: the first k blocks offloaded (the smallest k whose
                         predicted peak fits B; all blocks when none does)
``recompute_only``       rotor's optimum (keep or checkpoint, blocks grouped in segments) for B;
                         every block checkpointed when nothing fits
=======================  ==========================================================================

All run through the planner's ``apply`` (co.offload / co.checkpoint underneath) with the prefetch
window that gives each its best predicted time. Per row: the simulator's predicted peak of saved
activations and step time, the measured ones (peak: torch.profiler's allocator events, see
``ckpt_offload.planner.saved_peak``; time: median of ``--steps`` steps), and whether each fits B.
On CPU the bytes are exact and the times indicative (CPU memcpy stands in for PCIe).

Usage::

    python3 benchmarks/planner_sweep.py --quick --out /tmp/sweep     # CPU: tiny model, ~a minute
    python3 benchmarks/planner_sweep.py --size medium --out DIR       # GPU sizes
    python3 benchmarks/planner_sweep.py --bandwidth 25GB/s            # plan for a given link

Writes OUT/planner_sweep.json, OUT/planner_sweep.md and OUT/planner_sweep.png. Benchmarks measure,
they don't assert: the exit status is 0 unless something crashed.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
from _package import co, save_report  # noqa: E402  (the checkout's build when it has one, else the installed package)
from ckpt_offload.planner import InfeasibleBudget, simulate  # noqa: E402
from ckpt_offload.planner.simulator import singles  # noqa: E402
from ckpt_offload.blocks import install_units  # noqa: E402
from ckpt_offload.cli.plan import _measure, builtin_model  # noqa: E402
from ckpt_offload.planner.solver import _prefetch_options, chen_units, evaluate, first_k_units, rotor  # noqa: E402

STRATEGIES = ("plan", "chen_sqrt", "every_layer_offload", "first_k_offload", "recompute_only")


def _best_window(cm, units, budget):
    """The prefetch window with the least predicted time that fits (else the smallest peak)."""
    cands = [evaluate(cm, units, p) for p in _prefetch_options(cm)]
    fits = [c for c in cands if c.peak_bytes <= budget and math.isfinite(c.step_s)]
    return min(fits, key=lambda c: c.key()) if fits else min(cands, key=lambda c: (c.peak_bytes, c.step_s))


def _baseline_units(cm, name, budget):
    n = len(cm.blocks)
    if name == "chen_sqrt":
        return chen_units(n)
    if name == "every_layer_offload":
        return singles(["recompute_offload"] * n)
    if name == "first_k_offload":
        for k in range(n + 1):
            units = first_k_units(n, k)
            if _best_window(cm, units, budget).peak_bytes <= budget:
                return units
        return first_k_units(n, n)
    units = rotor(cm, budget)
    return units if units is not None else singles(["recompute"] * n)


def _choices(units):
    """``recompute[0-3]{recompute[0-1] keep[2] recompute[3]}``: each unit, a nested segment's inner ones in braces."""

    def one(u):
        text = f"{u.kind}[{u.start}-{u.end}]" if u.end > u.start else u.kind
        return text + (
            "{" + " ".join(one(v) if v.end > v.start or v.inner else f"{v.kind}[{v.start}]" for v in u.inner) + "}"
            if u.inner
            else ""
        )

    return ",".join(one(u) for u in units)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="CPU smoke run: tiny model, 4 budgets, 2 steps")
    p.add_argument("--size", default=None, help="built-in preset (default: medium on a GPU, small on CPU)")
    p.add_argument("--layers", type=int, default=None, help="override the preset's number of layers")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--points", type=int, default=None, help="budgets in the sweep (default 6; quick 4)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per measurement (default 5; quick 2)")
    p.add_argument("--bandwidth", default=None, help="plan for this link (bytes/s, e.g. 25GB/s) instead of measuring")
    p.add_argument("--budget-s", type=float, default=None, help="stop measuring new rows after this many seconds")
    p.add_argument("--out", default=None, help="folder for planner_sweep.json/.md/.png")
    args = p.parse_args(argv)

    start = time.time()
    gpu = torch.cuda.is_available() and co.build_info()["gpu_available"]
    device = ("cuda" if gpu else "cpu") if args.device == "auto" else args.device
    size = args.size or ("tiny" if args.quick else ("medium" if device == "cuda" else "small"))
    overrides = {"layers": args.layers} if args.layers else ({"layers": 4} if args.quick else {})
    points = args.points or (4 if args.quick else 6)
    steps = args.steps or (2 if args.quick else 5)
    model, step, cfg = builtin_model(size, device, 0, **overrides)
    # The plan's offload options: CPU tensors offloaded whatever their size on a CPU run.
    offload = {"devices": [device], "min_bytes": 0} if device == "cpu" else {"devices": [device]}
    print(f"planner sweep: TinyTransformer {size} ({cfg.layers} layers) on {device}", file=sys.stderr)

    first = co.plan(model, step, budget=1 << 62, bandwidth=args.bandwidth, offload=offload)
    cm = first.costs
    model.zero_grad(set_to_none=True)
    full = first.baseline["peak_bytes"]
    try:
        co.plan(model, step, budget=0, offload=offload, costs=cm)
        low = 0
    except InfeasibleBudget as e:
        low = e.minimum
    budgets = [int(full * (low / full) ** (i / (points - 1))) if points > 1 else full for i in range(points)]
    budgets[-1] = max(budgets[-1], low)

    measured_cache = {}
    rows = []

    def measure(units, prefetch):
        key = (tuple(units), prefetch)
        if key not in measured_cache:
            handle = install_units(
                model,
                first._named_blocks,
                units,
                {"devices": [device], "min_bytes": cm.min_bytes, "prefetch_bytes": prefetch},
            )
            try:
                secs, tl = _measure(step, device, steps)
            finally:
                handle.remove()
                model.zero_grad(set_to_none=True)
            measured_cache[key] = (secs, tl.peak_bytes)
        return measured_cache[key]

    base_s, base_tl = _measure(step, device, steps)
    model.zero_grad(set_to_none=True)
    budgets[0] = max(budgets[0], base_tl.peak_bytes + 256)  # "everything fits", measured
    skipped = 0
    for budget in budgets:
        for name in STRATEGIES:
            if args.budget_s is not None and time.time() - start > args.budget_s:
                skipped += 1
                continue
            if name == "plan":
                pl = co.plan(model, step, budget=budget, offload=offload, costs=cm)
                units, prefetch = pl.units, pl.prefetch_bytes
                choices = _choices(units)
            else:
                units = _baseline_units(cm, name, budget)
                prefetch = _best_window(cm, units, budget).prefetch_bytes
                choices = _choices(units)
            sim = simulate(cm, units, prefetch)
            secs, peak = measure(units, prefetch)
            rows.append(
                {
                    "budget_bytes": budget,
                    "strategy": name,
                    "choices": choices,
                    "prefetch_bytes": prefetch,
                    "predicted_peak_bytes": sim.peak_bytes,
                    "predicted_step_s": sim.step_s,
                    "measured_peak_bytes": peak,
                    "measured_step_s": secs,
                    "fits_predicted": sim.peak_bytes <= budget,
                    "fits_measured": peak <= budget,
                }
            )
            print(
                f"  {budget / 2**20:9.2f} MiB  {name:<20} pred {sim.peak_bytes / 2**20:8.2f} MiB "
                f"{sim.step_s * 1e3:9.2f} ms | meas {peak / 2**20:8.2f} MiB {secs * 1e3:9.2f} ms",
                file=sys.stderr,
            )

    result = {
        "mode": "gpu" if device == "cuda" else "cpu",
        "gpu_name": torch.cuda.get_device_name(0) if device == "cuda" else None,
        "model": {"name": size, **cfg.as_dict()},
        "bandwidth": vars(cm.bandwidth),
        "no_plan": {
            "predicted_peak_bytes": full,
            "measured_peak_bytes": base_tl.peak_bytes,
            "predicted_step_s": first.baseline["predicted_step_seconds"],
            "measured_step_s": base_s,
        },
        "smallest_budget_bytes": low,
        "budgets": budgets,
        "rows": rows,
        "skipped_rows": skipped,
        "elapsed_s": time.time() - start,
        "steps": steps,
    }
    result["headline"] = _headline(rows)
    text = _markdown(result)
    print(text)
    if args.out:
        save_report(args.out, "planner_sweep", result, text + "\n", default=float)
        _plot(result, os.path.join(args.out, "planner_sweep.png"))
    return 0


def _headline(rows):
    """Per budget: the plan's measured time vs the best baseline that fits (measured)."""
    out = []
    for b in sorted({r["budget_bytes"] for r in rows}, reverse=True):
        here = [r for r in rows if r["budget_bytes"] == b]
        plan = next((r for r in here if r["strategy"] == "plan"), None)
        others = [r for r in here if r["strategy"] != "plan" and r["fits_measured"]]
        best = min(others, key=lambda r: r["measured_step_s"]) if others else None
        out.append(
            {
                "budget_bytes": b,
                "plan_fits": plan["fits_measured"] if plan else None,
                "plan_peak_error": (plan["measured_peak_bytes"] / plan["predicted_peak_bytes"] - 1)
                if plan and plan["predicted_peak_bytes"]
                else None,
                "best_baseline": best["strategy"] if best else None,
                "plan_vs_best_baseline_time": (plan["measured_step_s"] / best["measured_step_s"])
                if plan and best
                else None,
            }
        )
    return out


def _markdown(r):
    mib = 2**20
    lines = ["# Planner sweep", ""]
    if r["mode"] == "cpu":
        lines += ["**CPU numbers, not GPU numbers**: bytes exact, times indicative.", ""]
    m, bw = r["model"], r["bandwidth"]
    lines.append(
        f"TinyTransformer {m['name']} ({m['layers']} layers, dim {m['dim']}, seq {m['seq']}, batch "
        f"{m['batch']}) · link D2H {bw['d2h'] / 1e9:.2f} GB/s, H2D {bw['h2d'] / 1e9:.2f} GB/s, latency "
        f"{bw['latency'] * 1e6:.0f} µs · no plan: {r['no_plan']['measured_peak_bytes'] / mib:.2f} MiB, "
        f"{r['no_plan']['measured_step_s'] * 1e3:.1f} ms · smallest budget "
        f"{r['smallest_budget_bytes'] / mib:.2f} MiB · {r['elapsed_s']:.0f} s"
    )
    lines += [
        "",
        "| budget MiB | strategy | pred peak MiB | meas peak MiB | fits | pred ms | meas ms | choices |",
        "|---:|---|---:|---:|---|---:|---:|---|",
    ]
    for row in r["rows"]:
        fits = "yes" if row["fits_measured"] else "NO"
        lines.append(
            f"| {row['budget_bytes'] / mib:.2f} | {row['strategy']} | "
            f"{row['predicted_peak_bytes'] / mib:.2f} | "
            f"{row['measured_peak_bytes'] / mib:.2f} | {fits} | {row['predicted_step_s'] * 1e3:.1f} | "
            f"{row['measured_step_s'] * 1e3:.1f} | {row['choices']} |"
        )
    if r["skipped_rows"]:
        lines.append(f"\n{r['skipped_rows']} rows skipped: --budget-s reached.")
    lines += [
        "",
        "| budget MiB | plan fits | plan peak error | best fitting baseline | plan time / its time |",
        "|---:|---|---:|---|---:|",
    ]
    for h in r["headline"]:
        err = "-" if h["plan_peak_error"] is None else f"{h['plan_peak_error'] * 100:+.1f}%"
        ratio = "-" if h["plan_vs_best_baseline_time"] is None else f"{h['plan_vs_best_baseline_time']:.2f}"
        lines.append(
            f"| {h['budget_bytes'] / mib:.2f} | {h['plan_fits']} | {err} | {h['best_baseline'] or '-'} | {ratio} |"
        )
    return "\n".join(lines)


def _plot(r, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    mib = 2**20
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in STRATEGIES:
        rows = sorted((x for x in r["rows"] if x["strategy"] == name), key=lambda x: x["budget_bytes"])
        if not rows:
            continue
        xs = [x["budget_bytes"] / mib for x in rows]
        (line,) = a.plot(xs, [x["measured_step_s"] * 1e3 for x in rows], marker="o", label=f"{name} measured")
        a.plot(
            xs,
            [x["predicted_step_s"] * 1e3 for x in rows],
            linestyle="--",
            color=line.get_color(),
            label=f"{name} predicted",
        )
        b.plot(xs, [x["measured_peak_bytes"] / mib for x in rows], marker="o", color=line.get_color(), label=name)
    lim = [min(r["budgets"]) / mib, max(r["budgets"]) / mib]
    b.plot(lim, lim, color="black", linewidth=0.8, linestyle=":", label="budget")
    a.set_xlabel("budget (MiB)")
    a.set_ylabel("step time (ms)")
    a.set_title("step time (solid: measured, dashed: predicted)" + (" — CPU" if r["mode"] == "cpu" else ""))
    b.set_xlabel("budget (MiB)")
    b.set_ylabel("measured peak of saved activations (MiB)")
    b.set_title("peak vs budget (on or under the dotted line fits)")
    a.legend(fontsize=7)
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
