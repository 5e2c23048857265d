#!/usr/bin/env python3
"""Device peak of a training step under whole-model ``torch.compile``, eager against compiled.

The model: ``--blocks`` MLP blocks (``--dim`` -> 4 x ``--dim`` -> ``--dim``, GELU) at batch
``--batch``, in fp32. Each arm runs one warm-up step (compiles), then one measured step; the peak
is the most bytes allocated above the step's start, read from torch.profiler's memory events on
CPU (every allocation through torch's allocator; the host pool allocates its own memory and is
not counted) and from ``torch.cuda.max_memory_allocated`` on a GPU. Two figures per arm: the peak
during the forward (``forward``) and over the whole step (``step``).

Arms (``eager`` and ``compiled`` = ``torch.compile(model, backend=--backend)`` of the whole model):

* ``none``: no ckpt_offload;
* ``co.offload``: the forward inside ``co.offload()`` -- the compiled arm is what whole-model compile
  did before, and still does: the compiled region hands its saved tensors to the hooks after its
  forward, so they are all on the device at its end;
* ``co.apply``: ``co.apply(model, offload=...)`` (every block checkpointed, its input offloaded);
* ``co.apply fullgraph``: the same, compiled with ``fullgraph=True`` (one graph: the blocks are traced
  as torch's checkpoint, their inputs offloaded by ckpt_offload's ops inside the graph; its eager arm
  is ``co.apply``'s). Its step peak is that of any whole-model compiled backward: the one backward
  graph returns every weight's gradient together, before they are accumulated;
* ``plan offload``: ``co.plan(..., kinds=("offload",))`` applied (each block's saved tensors
  offloaded, no recompute).

With ckpt_offload's wrappers, ``torch.compile`` skips the wrapper and compiles each block's own
forward as a graph of its own (the wrapper runs it inside the block's offload context or
checkpoint), so the compiled arms of ``co.apply`` and ``plan offload`` keep the saving: their peaks
sit within one block's saved activations of the eager ones (a compiled block hands what it saves to
the checkpoint or the hooks when its graph ends). Gradients of every arm are compared with the same (eager or compiled)
model without ckpt_offload: the run fails if they are not bit-identical (``aot_eager``) or close
(inductor).

Usage::

    python3 benchmarks/compile_peak.py                   # CPU, aot_eager, ~1 min on 2 cores
    python3 benchmarks/compile_peak.py --out benchmarks/results
    python3 benchmarks/compile_peak.py --device cuda --backend inductor --out DIR

Writes ``compile_peak.json`` and ``compile_peak.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
import torch
from _package import co
from torch.profiler import ProfilerActivity, profile

MiB = 2**20
ROUTES = ("none", "co.offload", "co.apply", "co.apply fullgraph", "plan offload")


def make_model(blocks: int, dim: int, device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return (
        torch.nn.Sequential(
            *[
                torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))
                for _ in range(blocks)
            ]
        )
        .to(device)
        .train()
    )


def _peaks_cpu(run_forward, run_backward):
    """(forward peak, step peak) above the step's start, from the profiler's memory events."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = run_forward()
        with torch.profiler.record_function("compile_peak::backward"):
            run_backward(out)
        del out
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    os.remove(path)
    mem = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    back = [e["ts"] for e in events if e.get("name") == "compile_peak::backward"]
    if not mem:
        return 0, 0
    start = mem[0]["args"]["Total Allocated"] - mem[0]["args"]["Bytes"]
    totals = [(e["ts"], e["args"]["Total Allocated"]) for e in mem]
    fwd = [t for ts, t in totals if not back or ts < back[0]]
    return max(fwd, default=start) - start, max(t for _, t in totals) - start


def _peaks_cuda(run_forward, run_backward):
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = run_forward()
    torch.cuda.synchronize()
    fwd = torch.cuda.max_memory_allocated() - start
    run_backward(out)
    del out
    torch.cuda.synchronize()
    return fwd, torch.cuda.max_memory_allocated() - start


def run_arm(route: str, compiled: bool, args, x, pool) -> dict:
    model = make_model(args.blocks, args.dim, args.device)
    opts = {"devices": [args.device], "min_bytes": 0, "pool": pool}
    handle = ctx = None
    if route in ("co.apply", "co.apply fullgraph"):
        handle = co.apply(model, offload=opts)
    elif route == "plan offload":

        def step():
            model(x).sum().backward()

        plan = co.plan(
            model,
            step,
            budget=2**40,
            devices=[args.device],
            bandwidth=math.inf,
            min_bytes=0,
            kinds=("offload",),
            segments=False,
            pool=pool,
        )
        model.zero_grad(set_to_none=True)
        handle = plan.apply()
    elif route == "co.offload":
        ctx = co.offload(**opts)
    fn = torch.compile(model, backend=args.backend, fullgraph=route == "co.apply fullgraph") if compiled else model

    def forward():
        if ctx is None:
            return fn(x).sum()
        with ctx:
            return fn(x).sum()

    def backward(loss):
        loss.backward()

    forward().backward()  # warm-up: compiles, and allocates the gradients (not counted in the peak)
    for q in model.parameters():
        q.grad.zero_()
    peaks = (_peaks_cuda if args.device == "cuda" else _peaks_cpu)(forward, backward)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    kinds = sorted(set(handle.kinds)) if handle is not None else []
    if handle is not None:
        handle.remove()
    return {
        "route": route,
        "compiled": compiled,
        "forward_peak": peaks[0],
        "step_peak": peaks[1],
        "pool_bytes_in_use_after": pool.stats()["bytes_in_use"],
        "kinds": kinds,
        "grads": grads,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--backend", default="aot_eager")
    p.add_argument("--threads", type=int, default=1, help="CPU intra-op threads")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(1)
    x = torch.randn(args.batch, args.dim, device=args.device)
    pool = co.HostPool(pinned=args.device == "cuda")
    rows = []
    for compiled in (False, True):
        for route in ROUTES:
            torch._dynamo.reset()
            rows.append(run_arm(route, compiled, args, x, pool))
            r = rows[-1]
            print(
                f"{'compiled' if compiled else 'eager':8} {route:13} forward {r['forward_peak'] / MiB:8.2f} MiB  "
                f"step {r['step_peak'] / MiB:8.2f} MiB",
                flush=True,
            )
    failures = []
    for r in rows:
        ref = next(b for b in rows if b["route"] == "none" and b["compiled"] == r["compiled"])
        for k, g in ref["grads"].items():
            same = (
                torch.equal(g, r["grads"][k])
                if args.backend in ("eager", "aot_eager")
                else torch.allclose(g, r["grads"][k], rtol=1e-4, atol=1e-5)
            )
            if not same:
                failures.append(f"{r['route']} ({'compiled' if r['compiled'] else 'eager'}): gradient of {k} differs")
                break
        if r["pool_bytes_in_use_after"]:
            failures.append(f"{r['route']}: {r['pool_bytes_in_use_after']} pool bytes in use after the step")
    table = _table(rows, args)
    print(table)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "compile_peak.md"), "w") as f:
            f.write(table)
        with open(os.path.join(args.out, "compile_peak.json"), "w") as f:
            json.dump(
                {
                    "args": vars(args),
                    "torch": torch.__version__,
                    "machine": platform.machine(),
                    "rows": [{k: v for k, v in r.items() if k != "grads"} for r in rows],
                },
                f,
                indent=1,
            )
    for line in failures:
        print("FAILED:", line, file=sys.stderr)
    return 1 if failures else 0


def _table(rows, args) -> str:
    where = "CPU numbers, not GPU numbers" if args.device == "cpu" else f"GPU: {torch.cuda.get_device_name()}"
    lines = [
        f"# Device peak under whole-model torch.compile ({where})",
        "",
        (
            f"{args.blocks} MLP blocks {args.dim} -> {4 * args.dim} -> {args.dim}, batch {args.batch}, fp32; "
            f"backend {args.backend}; torch {torch.__version__}. Peak above the step's start, in MiB "
            f"({'torch.profiler memory events' if args.device == 'cpu' else 'torch.cuda.max_memory_allocated'}); "
            "the step's peak with the gradients already allocated. Every arm's gradients were checked against "
            "the same (eager or compiled) model without ckpt_offload."
        ),
        "",
        "| route | eager forward | compiled forward | compiled / eager | eager step | compiled step |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for route in ROUTES:
        e = next(r for r in rows if r["route"] == route and not r["compiled"])
        c = next(r for r in rows if r["route"] == route and r["compiled"])
        ratio = c["forward_peak"] / e["forward_peak"] if e["forward_peak"] else float("nan")
        lines.append(
            f"| {route} | {e['forward_peak'] / MiB:.2f} | {c['forward_peak'] / MiB:.2f} | {ratio:.3f} | "
            f"{e['step_peak'] / MiB:.2f} | {c['step_peak'] / MiB:.2f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
