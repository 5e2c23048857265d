"""The fixed cost of a saved tensor: what the pack / unpack hooks add per tensor, side by side.

    python3 benchmarks/hot_path.py                 # CPU (one thread) or the GPU, full run
    python3 benchmarks/hot_path.py --quick         # a CI-friendly smoke run (a few seconds on CPU)
    python3 benchmarks/hot_path.py --out DIR       # also writes DIR/hot_path.json and DIR/hot_path.md
    python3 benchmarks/hot_path.py --quick --write-baseline benchmarks/results/hot_path_cpu.json
                                                   # records this run as the committed CPU reference

A model of ``--blocks`` blocks ``Linear(dim, dim)`` + ``tanh`` saves three small tensors per block:
the Linear's input and tanh's output (activations) and the Linear's ``weight.t()`` (a view of a
parameter, which every variant of ours keeps). Every variant runs the same step.

The method (what keeps an arm measured twice at a ratio near 1.0 on a shared machine): many short
rounds; in each round every arm runs once, in an order drawn afresh for that round (a seeded
shuffle: no arm always follows the same one, as a rotation would make it); an arm first runs one
untimed step (what the arm before it left in the caches and the allocator is then its own) and
then ``--reps`` timed steps, of which the fastest forward and the fastest backward count. The cyclic garbage collector
is off
while timing (collected between rounds); the model, its input and the pool are made once, before.
An arm's overhead in a round is its time minus the plain step's time in the same round, per saved
tensor; the table has the median over rounds with the 25th-75th percentile spread. A ratio is
taken per round (the numerator's overhead over the denominator's, both from that round) and the
median over rounds is reported.

Variants: ``plain`` (no hooks), ``identity`` (``saved_tensors_hooks`` returning the tensor),
``save_on_cpu`` (torch's), ``clone_hook`` (a Python hook that returns ``t.clone()``), ``co_keep``
(``co.offload`` with its default ``min_bytes``: everything kept), ``co_offload_compute`` and
``co_offload_side`` (``min_bytes=0``: everything offloaded, ``prefetch_bytes=0``), ``co_prefetch``
(side stream with prefetch) and ``co_batch`` (``batch_below``: small tensors gathered).

The two headline ratios: ``co_keep / save_on_cpu`` and ``co_offload_compute / clone_hook``
(per saved tensor, forward + backward). Each denominator is also run as a second, separate arm
(interleaved like the others, not a row of the table): its ratio to the first, per round, is the
A/A pair, printed as its median with its 25th-75th percentiles and its extremes: the noise floor
of a ratio in this run (a ratio differs from another only by more than that spread). On CPU the ratios are printed
beside those of the
committed reference run (``--baseline``, default ``benchmarks/results/hot_path_cpu.json``), so
a regression shows in every CI log; nothing is asserted on time. On a GPU the host time per
offloaded tensor is also put against the GPU time per tensor of the step (is the host falling
behind the GPU?).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
import warnings

import torch
import torch.nn as nn

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
from _package import co, save_report  # noqa: E402  (the checkout's build when it has one, else the installed package)

KEEP_RATIO = ("co_keep", "save_on_cpu")
OFFLOAD_RATIO = ("co_offload_compute", "clone_hook")
# The A/A arms: each headline denominator again, as an arm of its own (not a row of the table).
AA_SUFFIX = " (again)"
AA_ARMS = (KEEP_RATIO[1], OFFLOAD_RATIO[1])
DEFAULT_BASELINE = os.path.join(_HERE, "results", "hot_path_cpu.json")
# How the arms are timed (round_orders, the settle step, the fastest of --reps, per-round ratios).
# A reference run made another way is not printed beside this one's: its ratios meant something else.
METHOD = "shuffled-rounds/v2"


class Blocks(nn.Module):
    def __init__(self, blocks: int, dim: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(blocks))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _clone_pack(t):
    return t.clone()


def _same(t):
    return t


def variants(device: str, pool) -> dict:
    """name -> a factory of the context a step runs its forward in (None: no context)."""
    dev = [device]
    cuda = device == "cuda"
    return {
        "plain": lambda: None,
        "identity": lambda: torch.autograd.graph.saved_tensors_hooks(_same, _same),
        "save_on_cpu": lambda: torch.autograd.graph.save_on_cpu(pin_memory=cuda),
        "clone_hook": lambda: torch.autograd.graph.saved_tensors_hooks(_clone_pack, _same),
        "co_keep": lambda: co.offload(devices=dev, pool=pool),
        "co_offload_compute": lambda: co.offload(
            min_bytes=0, stream="compute", prefetch_bytes=0, devices=dev, pool=pool
        ),
        "co_offload_side": lambda: co.offload(min_bytes=0, stream="side", prefetch_bytes=0, devices=dev, pool=pool),
        "co_prefetch": lambda: co.offload(min_bytes=0, stream="side", devices=dev, pool=pool),
        "co_batch": lambda: co.offload(
            min_bytes=0, stream="side", batch_below=1 << 20, prefetch_bytes=0, devices=dev, pool=pool
        ),
    }


def count_saved(model, x) -> int:
    n = [0]

    def pack(t):
        n[0] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, _same):
        model(x).sum().backward()
    model.zero_grad(set_to_none=True)
    return n[0]


def one_step(model, x, ctx, cuda: bool, clock=time.perf_counter) -> dict:
    """Times one forward and one backward with ``clock`` (synchronized on a GPU); on a GPU also
    the host time of the forward (until it returned, before the synchronize) and the GPU time of
    the step (CUDA events)."""
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = clock()
    if ctx is None:
        loss = model(x).sum()
    else:
        with ctx:
            loss = model(x).sum()
    t_host = clock()
    if cuda:
        torch.cuda.synchronize()
    t1 = clock()
    loss.backward()
    if cuda:
        co.synchronize()
        end.record()
        torch.cuda.synchronize()
    t2 = clock()
    model.zero_grad(set_to_none=True)
    out = {"forward": t1 - t0, "backward": t2 - t1, "forward_host": t_host - t0}
    if cuda:
        out["gpu_step"] = start.elapsed_time(end) / 1e3
    return out


def pct(values, q):
    s = sorted(values)
    if not s:
        return float("nan")
    i = (len(s) - 1) * q
    lo, hi = int(i), min(int(i) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (i - lo)


def round_orders(names: list, rounds: int, seed: int) -> list:
    """The order the arms run in, one list per round: a seeded shuffle drawn afresh each round,
    so that no arm always runs right after the same one (a rotation keeps every arm's neighbours
    for good: what one arm leaves behind would always be charged to the same other arm)."""
    rng = random.Random(seed)
    orders = []
    for _ in range(rounds):
        order = list(names)
        rng.shuffle(order)
        orders.append(order)
    return orders


def load_average():
    """The machine's 1-minute load average, None where the OS has none."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def shuffled_rounds(names: list, measure, warmup: int, rounds: int, reps: int, seed: int) -> dict:
    """The timing method (module docstring): ``warmup`` rounds of ``measure(name, 1)`` per arm,
    then ``rounds`` rounds of ``measure(name, reps)``, each round in a freshly shuffled order, the
    cyclic garbage collector off while timing and collected between rounds (untimed: no
    collection lands in one arm's step). Returns ``{name: [measure's result, one per round]}``."""
    out = {n: [] for n in names}
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for order in round_orders(names, warmup, seed + 1):
            for n in order:
                measure(n, 1)
        for order in round_orders(names, rounds, seed):
            gc.collect()
            for n in order:
                out[n].append(measure(n, reps))
        co.synchronize()
    finally:
        if gc_was_enabled:
            gc.enable()
    return out


def spread(values) -> dict:
    """Median, 25th-75th percentiles and extremes of ``values`` (None when there are none)."""
    v = [x for x in values if x is not None]
    if not v:
        return {"median": None, "p25": None, "p75": None, "min": None, "max": None}
    return {"median": statistics.median(v), "p25": pct(v, 0.25), "p75": pct(v, 0.75), "min": min(v), "max": max(v)}


def run(args) -> dict:
    cuda = args.device == "cuda"
    # On CPU the process's CPU time (all its threads, the CPU copy streams included): other
    # processes on a shared machine do not inflate it, as they do the wall clock.
    clock = time.process_time if args.clock == "process" else time.perf_counter
    if not cuda:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    # Everything a step reuses is made here, outside the timed region.
    model = Blocks(args.blocks, args.dim).to(args.device)
    x = torch.randn(args.batch, args.dim, device=args.device, requires_grad=True)
    saved = count_saved(model, x)
    pool = co.HostPool()
    factories = variants(args.device, pool)
    rows = list(factories)
    for n in AA_ARMS:
        factories[n + AA_SUFFIX] = factories[n]
    names = list(factories)
    phases = ("forward", "backward", "forward_host", "gpu_step")
    # times[n][phase][r]: arm n's time of that phase in round r (the fastest of its timed steps).
    times = {n: {k: [] for k in phases + ("total",)} for n in names}
    stats = {}

    def measure(n, reps):
        best = None
        for i in range(reps + 1):  # step 0 settles the arm, untimed
            ctx = factories[n]()
            t = one_step(model, x, ctx, cuda, clock)
            if isinstance(ctx, co.offload):
                stats[n] = ctx.stats()
            if i == 0:
                continue
            best = t if best is None else {k: min(best[k], t[k]) for k in t}
        # Forward and backward each at their fastest: the shorter the timed stretch, the likelier
        # one of its tries ran without another process in the caches.
        best["total"] = best["forward"] + best["backward"]
        return best

    load_before = load_average()
    for n, per_round in shuffled_rounds(names, measure, args.warmup, args.rounds, args.reps, args.seed).items():
        for t in per_round:
            for k, v in t.items():
                times[n][k].append(v)

    def per_round(n, phase):
        """Arm n's overhead per saved tensor in each round (µs): its time less plain's that round."""
        return [(a - p) / saved * 1e6 for a, p in zip(times[n][phase], times["plain"][phase])]

    def overhead(n, phase):
        per = per_round(n, phase)
        return {"median_us": statistics.median(per), "p25_us": pct(per, 0.25), "p75_us": pct(per, 0.75)}

    results = []
    for n in rows:
        row = {
            "variant": n,
            "step_forward_ms": statistics.median(times[n]["forward"]) * 1e3,
            "step_backward_ms": statistics.median(times[n]["backward"]) * 1e3,
            "per_tensor": {ph: overhead(n, ph) for ph in ("forward", "backward", "total")} if n != "plain" else None,
        }
        if n in stats:
            s = stats[n]
            row["offloaded"] = s["tensors_offloaded"]
            row["deduplicated"] = s["tensors_deduplicated"]
            row["kept_by_reason"] = {k: v for k, v in s["kept_by_reason"].items() if v}  # the reasons that kept any
        if cuda:
            host = statistics.median(times[n]["forward_host"])
            gpu = statistics.median(times[n]["gpu_step"])
            row["host_forward_us_per_tensor"] = host / saved * 1e6
            row["gpu_step_us_per_tensor"] = gpu / saved * 1e6
            row["host_behind_gpu"] = host > gpu
        results.append(row)

    def ratio(pair):
        """The ratio of two arms' overheads: taken in every round, the median over rounds
        (``ratio``) with its spread; ``numerator_us`` / ``denominator_us`` are the arms' medians."""
        num, den = per_round(pair[0], "total"), per_round(pair[1], "total")
        rounds = [a / b if b > 0 else None for a, b in zip(num, den)]
        sp = spread(rounds)
        return {
            "numerator": pair[0],
            "denominator": pair[1],
            "ratio": sp["median"],
            "numerator_us": statistics.median(num),
            "denominator_us": statistics.median(den),
            "p25": sp["p25"],
            "p75": sp["p75"],
            "min": sp["min"],
            "max": sp["max"],
        }

    return {
        "benchmark": "hot_path",
        "mode": "gpu" if cuda else "cpu",
        "gpu_name": torch.cuda.get_device_name(0) if cuda else None,
        "args": {
            k: getattr(args, k)
            for k in (
                "device",
                "blocks",
                "dim",
                "batch",
                "rounds",
                "warmup",
                "reps",
                "seed",
                "threads",
                "quick",
                "clock",
            )
        },
        "method": METHOD,
        # The machine's 1-minute load average before and after: above its core count the spread widens.
        "load_average": [load_before, load_average()],
        "cpu_count": os.cpu_count(),
        "saved_tensors_per_step": saved,
        "saved_tensor_bytes": args.batch * args.dim * 4,
        "torch_version": torch.__version__,
        "python": platform.python_version(),
        "build_info": co.build_info(),
        "package": os.path.dirname(os.path.abspath(co.__file__)),  # which ckpt_offload was measured
        "results": results,
        "ratios": {"keep_vs_save_on_cpu": ratio(KEEP_RATIO), "offload_vs_clone_hook": ratio(OFFLOAD_RATIO)},
        # The same arm measured twice: how far from 1.0 a ratio of this run moves by noise alone.
        "aa": {n: ratio((n + AA_SUFFIX, n)) for n in AA_ARMS},
    }


def baseline_entry(r: dict) -> dict:
    """What --write-baseline keeps of a run: the ratios, their A/A pairs, each variant's total."""
    return {
        "benchmark": "hot_path",
        "mode": r["mode"],
        "args": r["args"],
        "command": "python benchmarks/hot_path.py " + ("--quick" if r["args"]["quick"] else ""),
        "torch_version": r["torch_version"],
        "method": r["method"],
        "ratios": {k: round(v["ratio"], 3) if v["ratio"] is not None else None for k, v in r["ratios"].items()},
        "aa": {k: round(v["ratio"], 3) if v["ratio"] is not None else None for k, v in r["aa"].items()},
        # The A/A pairs' spread over rounds: [p25, p75] and [min, max].
        "aa_spread": {
            k: {q: round(v[q], 3) if v[q] is not None else None for q in ("p25", "p75", "min", "max")}
            for k, v in r["aa"].items()
        },
        "total_us": {
            x["variant"]: round(x["per_tensor"]["total"]["median_us"], 2)
            for x in r["results"]
            if x["per_tensor"] is not None
        },
    }


def read_baseline(path: str | None, r: dict) -> dict | None:
    """The committed reference run at ``path`` when it exists and was measured like ``r`` (same
    mode, model and method), else None."""
    if not path or not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            b = json.load(f)
    except (OSError, ValueError):
        return None
    same = (
        b.get("mode") == r["mode"]
        and b.get("method") == r["method"]
        and all(b.get("args", {}).get(k) == r["args"][k] for k in ("blocks", "dim", "batch", "threads", "clock"))
    )
    return b if same else None


def markdown(r: dict) -> str:
    lines = [
        "# Hot path: fixed cost per saved tensor "
        f"({'GPU: ' + r['gpu_name'] if r['mode'] == 'gpu' else 'CPU numbers, not GPU numbers'})",
        "",
    ]
    a = r["args"]
    lines.append(
        f"{a['blocks']} blocks of Linear({a['dim']}, {a['dim']}) + tanh, batch {a['batch']}, "
        f"{r['saved_tensors_per_step']} saved tensors of {r['saved_tensor_bytes']} B per step, "
        f"{a['rounds']} rounds in shuffled order after {a['warmup']} warm-up, each arm the fastest of "
        f"{a['reps']} steps after an untimed one (forward, backward each)"
        + (f", {a['threads']} CPU thread(s)" if r["mode"] == "cpu" else "")
        + f"; clock: {a['clock']} time; torch {r['torch_version']}. Overhead = step time - plain step time in the "
        "same round, per saved tensor: median [p25, p75] in µs. Ratios: the median over rounds of the ratio in "
        "each round; A/A: the denominator over itself run again, median [p25, p75] (min-max)."
    )
    load = r.get("load_average") or [None, None]
    if load[0] is not None:
        lines.append("")
        lines.append(
            f"Load average (1 min) {load[0]:.2f} before, {load[1]:.2f} after, on {r.get('cpu_count')} CPUs"
            + (
                ": the machine was busier than its cores, the spreads are wider"
                if max(load) > (r.get("cpu_count") or 1)
                else ""
            )
            + "."
        )
    lines.append("")
    gpu = r["mode"] == "gpu"
    head = "| variant | forward | backward | total | plain-relative step fwd / bwd ms |"
    sep = "|---|---:|---:|---:|---:|"
    if gpu:
        head += " host fwd µs/tensor | GPU step µs/tensor | host behind |"
        sep += "---:|---:|---|"
    lines += [head, sep]
    for x in r["results"]:
        pt = x["per_tensor"]
        cells = (
            ["-"] * 3
            if pt is None
            else [
                f"{pt[ph]['median_us']:.2f} [{pt[ph]['p25_us']:.2f}, {pt[ph]['p75_us']:.2f}]"
                for ph in ("forward", "backward", "total")
            ]
        )
        line = (
            f"| {x['variant']} | "
            + " | ".join(cells)
            + f" | {x['step_forward_ms']:.2f} / {x['step_backward_ms']:.2f} |"
        )
        if gpu:
            line += (
                f" {x['host_forward_us_per_tensor']:.2f} | {x['gpu_step_us_per_tensor']:.2f} | "
                f"{'YES' if x['host_behind_gpu'] else 'no'} |"
            )
        lines.append(line)
    lines.append("")
    base = r.get("baseline")
    for key, v in r["ratios"].items():
        ratio = "n/a" if v["ratio"] is None else f"{v['ratio']:.2f}"
        aa = r["aa"][v["denominator"]]
        aa_text = (
            "n/a"
            if aa["ratio"] is None
            else (f"{aa['ratio']:.2f} [{aa['p25']:.2f}, {aa['p75']:.2f}] ({aa['min']:.2f}-{aa['max']:.2f})")
        )
        spread_text = "" if v["ratio"] is None else f" [{v['p25']:.2f}, {v['p75']:.2f}]"
        was = ""
        if base is not None:
            old = base.get("ratios", {}).get(key)
            was = f"; last committed: {old:.2f}" if isinstance(old, (int, float)) else "; last committed: n/a"
        lines.append(
            f"- **{key}**: {v['numerator']} / {v['denominator']} = {v['numerator_us']:.2f} / "
            f"{v['denominator_us']:.2f} µs = **{ratio}**{spread_text} (target ≤ 1.0; A/A {v['denominator']} / "
            f"itself again = {aa_text}{was})"
        )
    if base is not None:
        lines.append(
            f"- last committed run: `{base.get('command', '').strip()}` "
            f"({os.path.relpath(r['baseline_path'], os.path.dirname(_HERE))}; torch {base.get('torch_version')})"
        )
    return "\n".join(lines) + "\n"


def main(argv=None):
    # co_keep measures the keep path: its saved tensors are all under min_bytes by design, so the
    # library's "offloaded none of them" warning is this benchmark's point, not a mistake.
    warnings.filterwarnings("ignore", message=r"co\.offload\(\): this context saw saved tensors but offloaded none")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when usable, else cpu")
    p.add_argument("--blocks", type=int, default=64)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=16, help="rows of the input (saved tensor bytes = batch*dim*4)")
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--reps", type=int, default=5, help="timed steps per arm and round, the fastest counts (default 5)")
    p.add_argument("--seed", type=int, default=0, help="seed of the rounds' shuffled orders")
    p.add_argument("--threads", type=int, default=1, help="torch threads on CPU (default 1)")
    p.add_argument(
        "--clock",
        choices=["process", "wall"],
        default=None,
        help="process: CPU time of this process (default on CPU: immune to other processes' load); "
        "wall: the wall clock (default and forced on a GPU, whose time is not CPU time)",
    )
    p.add_argument("--quick", action="store_true", help="16 blocks, 40 rounds, 2 warm-up: a smoke run (seconds)")
    p.add_argument("--out", default=None, help="directory for hot_path.json and hot_path.md")
    p.add_argument(
        "--baseline",
        default=DEFAULT_BASELINE,
        help="the committed reference run whose ratios are printed beside this run's (when measured "
        "the same way); '' for none",
    )
    p.add_argument(
        "--write-baseline",
        default=None,
        metavar="PATH",
        help="also write this run's ratios, A/A pairs and per-variant totals to PATH as the reference",
    )
    args = p.parse_args(argv)
    if args.reps < 1:
        p.error(f"--reps must be at least 1, got {args.reps}")
    if args.device is None:
        args.device = "cuda" if (torch.cuda.is_available() and co.build_info()["cuda_compiled"]) else "cpu"
    if args.device == "cuda" or args.clock is None:
        args.clock = "wall" if args.device == "cuda" else "process"
    if args.quick:
        args.blocks, args.rounds, args.warmup = min(args.blocks, 16), min(args.rounds, 40), min(args.warmup, 2)
    r = run(args)
    base = read_baseline(args.baseline, r)
    if base is not None:
        r["baseline"], r["baseline_path"] = base, os.path.abspath(args.baseline)
    md = markdown(r)
    print(md)
    if args.out:
        save_report(args.out, "hot_path", r, md)
    if args.write_baseline:
        os.makedirs(os.path.dirname(os.path.abspath(args.write_baseline)), exist_ok=True)
        with open(args.write_baseline, "w") as f:
            json.dump(baseline_entry(r), f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
