"""Where a saved tensor's time goes: the hooks called directly, one piece at a time.

    python3 benchmarks/hot_path_breakdown.py                # the table (CPU, a few seconds)
    python3 benchmarks/hot_path_breakdown.py --loop co_keep --seconds 10
                                                            # hot_path.py's step of one arm in a loop,
                                                            # for a profiler to attach to (perf, py-spy)

The table times each piece in a tight loop (the fastest of ``--repeats`` loops of ``--calls``
calls, less the same loop calling a C function that does nothing with its argument), on the
tensors hot_path.py's model saves: 4 KiB float32 activations (non-leaf), a parameter's view
(``weight.t()``), and the model's input (a leaf that is no parameter: the one tensor per step that
makes pack look through the Python stack for the modules running). Pack and unpack are called as
torch's saved-tensor hooks call them (a function of one argument), outside autograd, so what is
left of a step's cost per saved tensor beyond these is torch's own hook machinery (the
``identity`` row of hot_path.py). CPU numbers, not GPU numbers; nothing is asserted.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import warnings

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
import hot_path
from _package import co


def per_call_us(fn, arg, calls: int, repeats: int) -> float:
    """The fastest of ``repeats`` loops of ``calls`` calls of fn(arg), in µs per call."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        for _ in range(calls):
            fn(arg)
        best = min(best, time.process_time() - t0)
    return best / calls * 1e6


def _pairs(pack, unpack, ts):
    """Packs every tensor of ``ts`` then unpacks them in reverse (as forward then backward)."""

    def run(_):
        saved = [pack(t) for t in ts]
        for s in reversed(saved):
            unpack(s)

    return run


def table(calls: int, repeats: int) -> list:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 64)
    x = torch.randn(16, 64, requires_grad=True)  # the input: a leaf, no parameter
    act = torch.tanh(x * 2)  # a non-leaf activation, 4 KiB
    acts = [torch.tanh(x + i) for i in range(48)]  # distinct storages: nothing deduplicates
    wt = lin.weight.t()  # what nn.Linear saves: a view of a parameter
    pool = co.HostPool()
    rows = []

    base = per_call_us(id, act, calls, repeats)  # the loop and one C call: subtracted below
    rows.append(("loop + a C call (subtracted from the rows below)", base))

    def hooks(**kw):
        ctx = co.offload(devices=["cpu"], pool=pool, **kw)
        p = ctx._packer
        p.begin()
        return ctx, p, p.pack, p.unpack

    _, keep_p, kpack, kunpack = hooks()
    rows.append(("co pack, kept activation (too_small)", per_call_us(kpack, act, calls, repeats) - base))
    rows.append(("co pack, parameter view (weight.t())", per_call_us(kpack, wt, calls, repeats) - base))
    rows.append(("co pack, leaf input (stack walk, 1 frame deep)", per_call_us(kpack, x, calls, repeats) - base))

    # The stack walk from inside module calls, as in a model's forward: 3 modules deep.
    class Deep(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, t):
            return self.inner(t)

    class Leaf(torch.nn.Module):
        def forward(self, t):
            t0 = time.process_time()
            for _ in range(calls):
                kpack(t)
            return (time.process_time() - t0) / calls * 1e6

    deep = Deep(Deep(Leaf()))
    walk = min(deep(x) for _ in range(repeats)) - base
    rows.append(("co pack, leaf input, 3 modules deep (stack walk)", walk))
    kept = kpack(act)
    rows.append(("co unpack, kept", per_call_us(kunpack, kept, calls, repeats) - base))
    keep_p.end(keep_dedup=False)

    for stream in ("compute", "side"):
        _, p, opack, ounpack = hooks(min_bytes=0, stream=stream, prefetch_bytes=0)
        n = len(acts)
        both = per_call_us(_pairs(opack, ounpack, acts), None, max(1, calls // n), repeats) / n
        packs = per_call_us(lambda _, pack=opack: [pack(t) for t in acts], None, max(1, calls // n), repeats) / n
        p.end(keep_dedup=False)
        rows.append((f"co pack, offloaded ({stream} stream)", packs - base))
        rows.append((f"co unpack, reload ({stream} stream)", both - packs - base))

    _, p, opack, _ = hooks(min_bytes=0, stream="compute", prefetch_bytes=0)
    first = opack(act)  # noqa: F841  (kept alive: the next packs find it)
    rows.append(("co pack, duplicate of an offloaded storage", per_call_us(opack, act, calls, repeats) - base))
    p.end(keep_dedup=False)

    # Per step, not per tensor: a context's entry and exit, and making one (a loop that writes
    # `with co.offload(...)` makes one per step; hot_path.py makes it outside the timed step).
    reused = co.offload(devices=["cpu"], pool=pool)

    def enter_exit(_):
        with reused:
            pass

    rows.append(
        ("per step: co.offload entry + exit (context reused)", per_call_us(enter_exit, None, calls, repeats) - base)
    )
    rows.append(
        (
            "per step: making co.offload(devices=..., pool=...)",
            per_call_us(lambda _: co.offload(devices=["cpu"], pool=pool), None, max(1, calls // 4), repeats) - base,
        )
    )
    identity = torch.autograd.graph.saved_tensors_hooks(hot_path._same, hot_path._same)

    def hooks_enter_exit(_):
        with identity:
            pass

    rows.append(
        (
            "per step: torch's saved_tensors_hooks entry + exit",
            per_call_us(hooks_enter_exit, None, calls, repeats) - base,
        )
    )

    # torch's own hooks, for the same tensors.
    def save_on_cpu_pack(t):  # what torch.autograd.graph.save_on_cpu's pack does on CPU
        packed = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=False)
        packed.copy_(t)
        return (t.device, packed)

    rows.append(("save_on_cpu pack (its Python function)", per_call_us(save_on_cpu_pack, act, calls, repeats) - base))
    rows.append(("clone hook pack (t.clone())", per_call_us(hot_path._clone_pack, act, calls, repeats) - base))
    rows.append(
        (
            "t.detach() (what a kept tensor's alias costs through the op)",
            per_call_us(torch.Tensor.detach, act, calls, repeats) - base,
        )
    )
    gc.collect()
    return rows


def loop(arm: str, seconds: float) -> None:
    """Runs hot_path.py's --quick step of one arm for ``seconds`` (for a profiler)."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    model = hot_path.Blocks(16, 64)
    x = torch.randn(16, 64, requires_grad=True)
    factories = hot_path.variants("cpu", co.HostPool())
    if arm not in factories:
        raise SystemExit(f"--loop: unknown arm {arm!r}; one of {', '.join(factories)}")
    for _ in range(20):  # warm: the profile is of the steady state
        hot_path.one_step(model, x, factories[arm](), False)
    print("ready", flush=True)  # a profiler attaching now sees only steps
    end = time.perf_counter() + seconds
    steps = 0
    gc.disable()  # as hot_path.py times its steps (a full collection costs more than many steps)
    t0 = time.process_time()
    while time.perf_counter() < end:
        hot_path.one_step(model, x, factories[arm](), False)
        steps += 1
    print(f"{arm}: {steps} steps, {(time.process_time() - t0) / steps * 1e6:.0f} µs CPU per step")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--loop", default=None, metavar="ARM", help="run one arm's step in a loop instead (profiling)")
    p.add_argument("--seconds", type=float, default=10.0)
    args = p.parse_args(argv)
    if args.loop:
        loop(args.loop, args.seconds)
        return 0
    rows = table(args.calls, args.repeats)
    print("| piece (CPU, one thread) | µs per call |")
    print("|---|---:|")
    for name, us in rows:
        print(f"| {name} | {us:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
