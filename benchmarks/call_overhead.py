"""The fixed cost of a checkpointed call: what ckpt_offload's routes add per block, per step.

    python3 benchmarks/call_overhead.py              # CPU (one thread) or the GPU
    python3 benchmarks/call_overhead.py --quick      # a smoke run (seconds on CPU)
    python3 benchmarks/call_overhead.py --out DIR    # also writes DIR/call_overhead.json and .md

hot_path.py measures what a context costs per *saved tensor*. A checkpointed model also pays a
cost per *call*: every block, every step, the route checks and resolves its options, finds its
offload context, hands its inputs to torch's checkpoint and enters and exits the context. In a
32-layer model that is paid 32 times a step, in forward and again in the recompute. This
benchmark times that cost on a block so small (``Linear(dim, dim)`` + ``tanh``) that the call's
fixed cost is most of its time:

- ``plain``: the block, no checkpoint;
- ``torch_checkpoint``: ``torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)``,
  measured twice (the second arm is the A/A pair, the noise floor of the ratios);
- ``co_checkpoint``: ``co.checkpoint(block, x)`` (no offload);
- ``co_checkpoint_offload``: ``co.checkpoint(block, x, offload=opts)`` with ``opts`` an
  ``OffloadOptions`` made once;
- ``co_checkpoint_offload_dict``: the same with ``offload={...}`` written in the call, as most
  code does, into the default pool (a dict of plain values: made into options once);
- ``co_apply_offload``: a block wrapped once by ``co.apply(..., offload=opts)``, called as is.

Apart from the arms: what making a context costs (``co.offload(...)`` with keywords, as a
training loop writes ``with co.offload(...):`` every step; against torch's ``saved_tensors_hooks``
and ``save_on_cpu``), in µs per context, the median of ``--rounds`` batches of 200.

The offload arms offload with ``min_bytes=0``, so the block's input is copied to the pool and
back: their extra over ``co_checkpoint`` is one offloaded tensor plus the context. Timing as in
hot_path.py: rounds in a freshly shuffled order, each arm one untimed step then the fastest of
``--reps`` timed ones (forward and backward each), the cyclic GC off while timing. An arm's
overhead is its time minus plain's in the same round; a route's ratio is its overhead over
torch_checkpoint's, per round, median over rounds. Printed, never asserted on.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
import warnings

import torch
import torch.nn as nn
import torch.utils.checkpoint as torch_checkpoint

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
from _package import co, save_report  # noqa: E402
from hot_path import load_average, pct, shuffled_rounds, spread  # noqa: E402  (the same timing method)

BASE = "torch_checkpoint"
AA = BASE + " (again)"


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def forward(self, x):
        return torch.tanh(self.linear(x))


def arms(device: str, dim: int, pool) -> dict:
    """name -> a function of x that runs one checkpointed block (its forward)."""
    block = Block(dim).to(device)
    opts = co.OffloadOptions(devices=[device], min_bytes=0, pool=pool)
    as_dict = {"devices": [device], "min_bytes": 0}  # the default pool: a dict of plain values
    wrapped = nn.Sequential(Block(dim).to(device))
    wrapped.load_state_dict({"0." + k: v for k, v in block.state_dict().items()})
    co.apply(wrapped, layers=Block, offload=opts)  # its one Block is checkpointed
    return {
        "plain": block,
        BASE: lambda x: torch_checkpoint.checkpoint(block, x, use_reentrant=False),
        AA: lambda x: torch_checkpoint.checkpoint(block, x, use_reentrant=False),
        "co_checkpoint": lambda x: co.checkpoint(block, x),
        "co_checkpoint_offload": lambda x: co.checkpoint(block, x, offload=opts),
        "co_checkpoint_offload_dict": lambda x: co.checkpoint(block, x, offload=as_dict),
        "co_apply_offload": wrapped,
    }


def _same(t):
    return t


def construction_us(device: str, pool, rounds: int, clock, per_batch: int = 200) -> dict:
    """µs to make one context, per kind: the median over ``rounds`` batches of ``per_batch``."""
    dev = [device]
    makers = {
        "co_offload": lambda: co.offload(min_bytes=0, stream="compute", devices=dev, pool=pool),
        "saved_tensors_hooks": lambda: torch.autograd.graph.saved_tensors_hooks(_same, _same),
        "save_on_cpu": lambda: torch.autograd.graph.save_on_cpu(),
    }
    out = {}
    for name, make in makers.items():
        make()  # the first one fills what later ones reuse
        batches = []
        for _ in range(max(rounds, 1)):
            t0 = clock()
            for _ in range(per_batch):
                make()
            batches.append((clock() - t0) / per_batch * 1e6)
        out[name] = statistics.median(batches)
    return out


def one_step(fn, x, cuda: bool, clock) -> tuple:
    if cuda:
        torch.cuda.synchronize()
    t0 = clock()
    y = fn(x)
    if cuda:
        torch.cuda.synchronize()
    t1 = clock()
    y.sum().backward()
    if cuda:
        co.synchronize()
        torch.cuda.synchronize()
    t2 = clock()
    return t1 - t0, t2 - t1


def run(args) -> dict:
    cuda = args.device == "cuda"
    if not cuda:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "process" else time.perf_counter
    torch.manual_seed(0)
    pool = co.HostPool()
    fns = arms(args.device, args.dim, pool)
    x = torch.randn(args.batch, args.dim, device=args.device, requires_grad=True)
    names = list(fns)

    def measure(n, reps):
        """(forward, backward) of arm n, each the fastest of ``reps`` steps after an untimed one."""
        best = None
        for i in range(reps + 1):
            t = one_step(fns[n], x, cuda, clock)
            x.grad = None
            if i:
                best = t if best is None else (min(best[0], t[0]), min(best[1], t[1]))
        return best

    load_before = load_average()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # what a route warns once is not what is timed
        times = shuffled_rounds(names, measure, args.warmup, args.rounds, args.reps, args.seed)

    def overhead(n):
        """Arm n's time over plain's per round (µs), forward + backward."""
        return [(sum(a) - sum(p)) * 1e6 for a, p in zip(times[n], times["plain"])]

    base = overhead(BASE)
    rows = []
    for n in names:
        if n == "plain":
            continue
        mine = overhead(n)
        over_base = [a - b for a, b in zip(mine, base)]
        rounds = [a / b if b > 0 else None for a, b in zip(mine, base)]
        sp = spread(rounds)
        rows.append(
            {
                "arm": n,
                "overhead_us": statistics.median(mine),
                "over_torch_checkpoint_us": statistics.median(over_base),
                "over_p25": pct(over_base, 0.25),
                "over_p75": pct(over_base, 0.75),
                "ratio": sp["median"],
                "ratio_p25": sp["p25"],
                "ratio_p75": sp["p75"],
            }
        )
    return {
        "benchmark": "call_overhead",
        "mode": "gpu" if cuda else "cpu",
        "gpu_name": torch.cuda.get_device_name(0) if cuda else None,
        "args": vars(args),
        "load_average": [load_before, load_average()],
        "cpu_count": os.cpu_count(),
        "plain_step_us": statistics.median(sum(t) for t in times["plain"]) * 1e6,
        "torch_version": torch.__version__,
        "python": platform.python_version(),
        "package": os.path.dirname(os.path.abspath(co.__file__)),
        "rows": rows,
        "construction_us": construction_us(args.device, pool, args.rounds, clock),
    }


def markdown(r: dict) -> str:
    a = r["args"]
    lines = [
        f"# Call overhead: the fixed cost of a checkpointed block "
        f"({'GPU: ' + r['gpu_name'] if r['mode'] == 'gpu' else 'CPU numbers, not GPU numbers'})",
        "",
        f"Block Linear({a['dim']}, {a['dim']}) + tanh, batch {a['batch']}; {a['rounds']} rounds in shuffled "
        f"order, each arm the fastest of {a['reps']} steps (forward, backward each); clock: {a['clock']} time; "
        f"torch {r['torch_version']}. Plain step {r['plain_step_us']:.1f} µs. Overhead: the arm's forward + "
        "backward less plain's, in the same round (µs, median over rounds). Ratio: the overhead over "
        f"{BASE}'s, per round, median [p25, p75]; `{AA}` is its A/A pair.",
        "",
    ]
    load = r.get("load_average") or [None, None]
    if load[0] is not None:
        lines += [f"Load average (1 min) {load[0]:.2f} before, {load[1]:.2f} after, on {r['cpu_count']} CPUs.", ""]
    lines += ["| arm | overhead µs | over torch_checkpoint µs [p25, p75] | ratio [p25, p75] |", "|---|---:|---:|---:|"]
    for x in r["rows"]:
        lines.append(
            f"| {x['arm']} | {x['overhead_us']:.1f} | {x['over_torch_checkpoint_us']:+.1f} "
            f"[{x['over_p25']:+.1f}, {x['over_p75']:+.1f}] | {x['ratio']:.2f} "
            f"[{x['ratio_p25']:.2f}, {x['ratio_p75']:.2f}] |"
        )
    c = r.get("construction_us")
    if c:
        lines += [
            "",
            f"Making a context: co.offload(...) {c['co_offload']:.1f} µs, torch's saved_tensors_hooks "
            f"{c['saved_tensors_hooks']:.1f} µs, save_on_cpu {c['save_on_cpu']:.1f} µs (median of "
            f"{a['rounds']} batches of 200).",
        ]
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when usable, else cpu")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--rounds", type=int, default=None, help="default 60 (25 with --quick)")
    p.add_argument("--warmup", type=int, default=None, help="default 5 (2 with --quick)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--clock",
        choices=["process", "wall"],
        default=None,
        help="default: process time on CPU (other processes do not inflate it), wall on a GPU",
    )
    p.add_argument("--quick", action="store_true", help="25 rounds, 2 warm-up (a few seconds on CPU)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if (torch.cuda.is_available() and co.build_info()["cuda_compiled"]) else "cpu"
    if args.clock is None:
        args.clock = "wall" if args.device == "cuda" else "process"
    if args.rounds is None:
        args.rounds = 25 if args.quick else 60
    if args.warmup is None:
        args.warmup = 2 if args.quick else 5
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    r = run(args)
    text = markdown(r)
    print(text)
    if args.out:
        save_report(args.out, "call_overhead", r, text)
    return r


if __name__ == "__main__":
    main()
