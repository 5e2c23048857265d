#!/usr/bin/env python3
"""Low-precision storage of offloaded activations: bytes, step time and accuracy per storage dtype.

The built-in TinyTransformer (``ckpt_offload.demo.model``) in fp32, so bf16 / fp16 storage holds
half the bytes of each converted activation and fp8 a quarter (plus a 4-byte scale per tensor).
Each arm wraps the forward (and the loss) in
``co.offload(devices=[device], min_bytes=..., store_dtype=...)``:

* ``none``: no offload at all, the reference for the gradients and the time without offloading;
* ``exact``: ``store_dtype=None`` (bit-exact storage), the baseline of every ratio;
* ``exact_aa``: the same as ``exact``, measured as a separate arm: its time ratio to ``exact`` is
  the noise floor of the step-time ratios;
* ``bf16``, ``fp16``, ``fp8_e4m3``, ``fp8_e5m2``: ``torch.bfloat16``, ``torch.float16``,
  ``torch.float8_e4m3fn``, ``torch.float8_e5m2``.

Three measurements:

1. **Step time and bytes.** Every arm first runs ``--warmup`` steps; then ``--rounds`` rounds, in
   each of which every arm runs ``--steps`` steps, the order of the arms rotating from round to
   round, so that drift hits every arm alike. The weights do not change (no optimizer step); step
   ``i`` uses batch ``i mod --batches``. Per arm: the median step time, its ratio to ``exact``
   (beside the A/A ratio), and from ``ctx.stats()`` (reset before each step) the bytes offloaded
   per step (what exact storage of the offloaded tensors would hold), the bytes stored, their
   ratio, the bytes stored against the ``exact`` arm's, and the tensors converted.
2. **Gradient error per step.** For every batch, each arm's gradients against the ``none`` arm's
   from the same weights and batch: ``||g - g_ref|| / ||g_ref||`` over all parameters together
   (mean and max over the batches). ``exact`` must be 0 (bit-identical); the run fails otherwise.
   One extra step per lossy arm with ``measure_error=True`` gives the activations' own relative
   error (``stats()["store_error"]``, mean over the converted tensors).
3. **Training** (``--train-steps N``, 0 skips it). From the same initial weights, N Adam steps on
   the same batch sequence with each storage dtype; the loss after N steps and its difference to
   exact storage's (also the largest difference over the N steps, and the mean over the last
   tenth). The forward never sees the rounding (only backward reads the stored activations), so
   the losses part only through the weights.

Usage::

    python3 benchmarks/store_dtype.py --quick                    # CPU, tiny shapes, seconds
    python3 benchmarks/store_dtype.py --device cuda --out DIR    # the GPU run (medium preset)
    python3 benchmarks/store_dtype.py --preset small --train-steps 100

On CPU the clock is the process's CPU time with one intra-op thread (``--threads``), so that other
processes on the machine, and idle threads spinning for work, count as little as they can; on a
GPU the wall clock, synchronized.

Writes ``store_dtype.json`` and ``store_dtype.md`` under ``--out``. Benchmarks measure, they do not
assert: the exit status is 0 unless something crashed, the ``exact`` arm's gradients are not
bit-identical to ``none``'s, or it stored fewer bytes than it offloaded.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
from _package import co, save_report  # noqa: E402  (the checkout's build when it has one, else the installed package)
from ckpt_offload.demo.model import TinyTransformer, lm_loss, make_batch, make_config  # noqa: E402

#: Arm name -> store_dtype. ``none`` runs without ``co.offload``.
ARMS = {
    "none": "no offload",
    "exact": None,
    "exact_aa": None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
OFFLOAD_ARMS = [a for a in ARMS if a != "none"]
LOSSY_ARMS = [a for a in ARMS if ARMS[a] not in (None, "no offload")]
#: Arms trained with --train-steps (the A/A arm would repeat exact's numbers bit for bit).
TRAIN_ARMS = ["exact"] + LOSSY_ARMS
STAT_KEYS = (
    "tensors_offloaded",
    "bytes_offloaded",
    "bytes_stored",
    "tensors_converted",
    "tensors_deduplicated",
    "bytes_deduplicated",
    "tensors_kept",
    "bytes_kept",
)


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() and co._C.cuda_compiled() else "cpu"
    if name == "cuda" and not (torch.cuda.is_available() and co._C.cuda_compiled()):
        raise SystemExit(
            "--device cuda: no usable GPU (torch.cuda.is_available() and a CUDA build of ckpt_offload "
            "are both needed); use --device cpu"
        )
    return name


class Clock:
    """Wall clock (synchronized on a GPU) or, on CPU, the process's CPU time: on a shared machine
    other processes then do not inflate it (the copies run on this process's threads)."""

    def __init__(self, kind: str, device: str):
        self.kind, self.device = kind, device

    def now(self) -> float:
        if self.device == "cuda":
            torch.cuda.synchronize()
        return time.process_time() if self.kind == "process" else time.perf_counter()


def make_ctx(arm: str, device: str, min_bytes: int, measure_error: bool = False):
    if arm == "none":
        return None
    return co.offload(devices=[device], min_bytes=min_bytes, store_dtype=ARMS[arm], measure_error=measure_error)


def step(model, tokens, ctx, seed: int):
    """One forward + backward (gradients set fresh); ``seed`` fixes dropout's masks, if any."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    if ctx is None:
        loss = lm_loss(model, tokens)
    else:
        ctx.reset_stats()
        with ctx:
            loss = lm_loss(model, tokens)
    loss.backward()
    co.synchronize()
    return loss.detach()


def grads_of(model) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def relative_error(g: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """``||g - ref|| / ||ref||`` over all parameters together, in fp64."""
    num = sum(float((a.double() - b.double()).square().sum()) for a, b in zip(g, ref))
    den = sum(float(b.double().square().sum()) for b in ref)
    return math.sqrt(num / den) if den > 0 else math.sqrt(num)


def bit_identical(g: list[torch.Tensor], ref: list[torch.Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(g, ref))


def measure(args, cfg, device: str, clock: Clock) -> dict:
    model = TinyTransformer(**cfg.model_kwargs(), seed=0).to(device)
    batches = [make_batch(cfg, batch=cfg.batch, seed=1000 + i, device=device) for i in range(args.batches)]
    ctxs = {a: make_ctx(a, device, args.min_bytes) for a in ARMS}

    # 2. gradients: the reference (no offload) per batch, then every arm on the same weights and batch
    refs = []
    for i, tokens in enumerate(batches):
        step(model, tokens, None, seed=i)
        refs.append(grads_of(model))
    grad = {}
    for arm in OFFLOAD_ARMS:
        errs, same = [], True
        for i, tokens in enumerate(batches):
            step(model, tokens, ctxs[arm], seed=i)
            g = grads_of(model)
            errs.append(relative_error(g, refs[i]))
            same = same and bit_identical(g, refs[i])
        grad[arm] = {"mean": statistics.fmean(errs), "max": max(errs), "per_batch": errs, "bit_identical": same}
    del refs
    store_error = {}
    for arm in LOSSY_ARMS:
        ctx = make_ctx(arm, device, args.min_bytes, measure_error=True)
        step(model, batches[0], ctx, seed=0)
        store_error[arm] = ctx.stats()["store_error"]

    # 1. step time and bytes, interleaved
    seen: dict[str, list[dict]] = {a: [] for a in OFFLOAD_ARMS}

    def timed(arm: str, i: int) -> float:
        t0 = clock.now()
        step(model, batches[i % len(batches)], ctxs[arm], seed=i)
        t = clock.now() - t0
        if ctxs[arm] is not None:
            s = ctxs[arm].stats()
            seen[arm].append({k: s[k] for k in STAT_KEYS})
        return t

    for arm in ARMS:
        for i in range(args.warmup):
            timed(arm, i)
    times: dict[str, list[float]] = {a: [] for a in ARMS}
    round_medians: dict[str, list[float]] = {a: [] for a in ARMS}
    names = list(ARMS)
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for arm in order:
            ts = [timed(arm, args.warmup + r * args.steps + j) for j in range(args.steps)]
            times[arm] += ts
            round_medians[arm].append(statistics.median(ts))

    rows = {}
    t_exact = statistics.median(times["exact"])
    aa = statistics.median(times["exact_aa"]) / t_exact
    exact_stored = seen["exact"][-1]["bytes_stored"]
    for arm in ARMS:
        t = statistics.median(times[arm])
        row = {
            "store_dtype": None if ARMS[arm] in (None, "no offload") else str(ARMS[arm]).replace("torch.", ""),
            "offload": arm != "none",
            "median_step_s": t,
            "min_step_s": min(times[arm]),
            "max_step_s": max(times[arm]),
            "step_times_s": times[arm],
            "per_round_median_s": round_medians[arm],
            "time_ratio_to_exact": t / t_exact,
            "aa_ratio": aa,
            "noise_floor": abs(aa - 1.0),
        }
        if arm != "none":
            last = seen[arm][-1]
            row.update(last)
            # the counts of every step, warm-up included, are those of the last (same shapes, same tensors)
            row["stats_constant_over_steps"] = all(s == last for s in seen[arm])
            row["stored_ratio"] = last["bytes_stored"] / last["bytes_offloaded"] if last["bytes_offloaded"] else None
            row["stored_vs_exact_arm"] = last["bytes_stored"] / exact_stored if exact_stored else None
            row["grad_rel_error_mean"] = grad[arm]["mean"]
            row["grad_rel_error_max"] = grad[arm]["max"]
            row["grad_rel_error_per_batch"] = grad[arm]["per_batch"]
            row["grad_bit_identical"] = grad[arm]["bit_identical"]
            row["store_error"] = store_error.get(arm, {})
            errs = row["store_error"]
            n = sum(e["tensors"] for e in errs.values())
            row["activation_rel_error_mean"] = (
                sum(e["mean_rel_error"] * e["tensors"] for e in errs.values()) / n if n else None
            )
            row["activation_rel_error_max"] = max((e["max_rel_error"] for e in errs.values()), default=None)
        rows[arm] = row
    return rows


def train(args, cfg, device: str) -> dict:
    """``--train-steps`` Adam steps per arm from the same weights on the same batches."""
    out = {}
    for arm in TRAIN_ARMS:
        model = TinyTransformer(**cfg.model_kwargs(), seed=0).to(device)
        opt = torch.optim.Adam(model.parameters(), lr=args.lr)
        ctx = make_ctx(arm, device, args.min_bytes)
        losses = []
        for i in range(args.train_steps):
            tokens = make_batch(cfg, batch=cfg.batch, seed=5000 + i, device=device)
            losses.append(float(step(model, tokens, ctx, seed=i)))
            opt.step()
        out[arm] = {"losses": losses}
    base = out["exact"]["losses"]
    tail = max(1, len(base) // 10)
    for r in out.values():
        d = [a - b for a, b in zip(r["losses"], base)]
        r["first_loss"] = r["losses"][0]
        r["final_loss"] = r["losses"][-1]
        r["final_loss_diff"] = d[-1]
        r["max_abs_loss_diff"] = max(abs(x) for x in d)
        r["tail_mean_loss_diff"] = statistics.fmean(d[-tail:])
        r["tail_steps"] = tail
    return out


def fmt_bytes(n) -> str:
    if n is None:
        return ""
    return f"{n / (1 << 20):.2f} MiB" if n >= 1 << 20 else f"{n / 1024:.1f} KiB"


def markdown(r: dict) -> str:
    a = r["args"]
    c = r["config"]
    threads = "" if r.get("cpu_threads") is None else f", {r['cpu_threads']} CPU thread(s)"
    lines = [f"# Low-precision storage of offloaded activations ({r['device'].upper()})", ""]
    if r["device"] == "cpu":
        lines += [
            "**CPU numbers, not GPU numbers**: the 'offload' is a copy into host memory on the same CPU and "
            "the conversion runs on the CPU; only the bytes and the errors carry over to a GPU.",
            "",
        ]
    lines += [
        f"TinyTransformer fp32: {c['layers']} layers, dim {c['dim']}, heads {c['heads']}, seq {c['seq']}, "
        f"batch {c['batch']}, vocab {c['vocab']}, dropout {c['dropout']}; {r['device_name']}; "
        f"`co.offload(devices=['{r['device']}'], min_bytes={a['min_bytes']}, store_dtype=...)` around the "
        f"forward and loss. {a['rounds']} rounds x {a['steps']} steps per arm after {a['warmup']} warm-up "
        f"steps, arms interleaved; {r['clock']} clock{threads}; gradients over {a['batches']} batches.",
        "",
        "| arm | offloaded / step | stored / step | stored / offloaded | stored / exact's | converted | "
        "median step ms | vs exact | A/A | grad rel err (mean) | grad rel err (max) | activation rel err |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for arm, x in r["arms"].items():
        t = f"{x['median_step_s'] * 1e3:.2f}"
        ratio = f"{x['time_ratio_to_exact']:.3f}"
        aa = f"{x['aa_ratio']:.3f}"
        if not x["offload"]:
            lines.append(f"| {arm} | | | | | | {t} | {ratio} | {aa} | (reference) | | |")
            continue
        ge = "0 (bit-identical)" if x["grad_bit_identical"] else f"{x['grad_rel_error_mean']:.2e}"
        gm = "0" if x["grad_bit_identical"] else f"{x['grad_rel_error_max']:.2e}"
        ae = "" if x["activation_rel_error_mean"] is None else f"{x['activation_rel_error_mean']:.2e}"
        lines.append(
            f"| {arm} | {fmt_bytes(x['bytes_offloaded'])} | {fmt_bytes(x['bytes_stored'])} | "
            f"{x['stored_ratio']:.4f} | {x['stored_vs_exact_arm']:.4f} | {x['tensors_converted']} | {t} | "
            f"{ratio} | {aa} | {ge} | {gm} | {ae} |"
        )
    ex = r["arms"]["exact"]
    lossy = r["arms"][LOSSY_ARMS[0]]
    if lossy["bytes_offloaded"] != ex["bytes_offloaded"]:
        lines += [
            "",
            f"The lossy arms offload {fmt_bytes(lossy['bytes_offloaded'])} per step against exact's "
            f"{fmt_bytes(ex['bytes_offloaded'])}: converted views whose spans only overlap are not deduplicated "
            f"against each other (exact storage deduplicated {ex['tensors_deduplicated']} tensors, "
            f"{fmt_bytes(ex['bytes_deduplicated'])}), so `stored / exact's` is the host memory and link "
            "traffic actually saved.",
        ]
    if r.get("train"):
        tr = r["train"]
        lines += [
            "",
            f"## Training: {a['train_steps']} Adam steps (lr {a['lr']}), same initial weights and batches",
            "",
            "| arm | first loss | final loss | final - exact | max abs diff over steps | mean diff, last steps |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for arm, x in tr.items():
            lines.append(
                f"| {arm} | {x['first_loss']:.5f} | {x['final_loss']:.5f} | {x['final_loss_diff']:+.2e} | "
                f"{x['max_abs_loss_diff']:.2e} | {x['tail_mean_loss_diff']:+.2e} ({x['tail_steps']}) |"
            )
    lines += [
        "",
        "Columns: *offloaded / step*: `bytes_offloaded` (what exact storage of the offloaded tensors holds); "
        "*stored / step*: `bytes_stored`; *converted*: `tensors_converted`; *vs exact*: median step time over "
        "the exact arm's; *A/A*: the exact_aa arm's ratio (noise floor); *grad rel err*: "
        "||g - g_none|| / ||g_none|| over all parameters, per batch; *activation rel err*: mean of "
        "`store_error`'s per-tensor ||x - stored(x)|| / ||x||.",
    ]
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument(
        "--preset",
        default=None,
        help="TinyTransformer preset (tiny, small, medium); default medium on a GPU, small on CPU, tiny with --quick",
    )
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--dim", type=int, default=None)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument(
        "--dropout",
        type=float,
        default=0.0,
        help="dropout probability (default 0; with dropout the masks are seeded alike in every arm)",
    )
    p.add_argument("--min-bytes", type=int, default=0, help="co.offload's min_bytes (default 0: offload everything)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5; 3 with --quick)")
    p.add_argument("--steps", type=int, default=None, help="steps per arm per round (default 3; 1 with --quick)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps per arm (default 2; 1 with --quick)")
    p.add_argument("--batches", type=int, default=None, help="batches for the gradient error (default 4; 2 --quick)")
    p.add_argument(
        "--train-steps",
        type=int,
        default=None,
        help="Adam steps per arm (default 200 on a GPU, 50 on CPU, 20 with --quick; 0 skips training)",
    )
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument(
        "--clock",
        choices=["auto", "wall", "process"],
        default="auto",
        help="auto: wall on a GPU (synchronized), the process's CPU time on CPU",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU only: torch's intra-op threads while measuring (default 1: idle threads spinning "
        "for work would count in the process clock, and vary with the machine's load; 0 leaves "
        "torch's setting)",
    )
    p.add_argument("--quick", action="store_true", help="CPU, tiny shapes, few steps (seconds)")
    p.add_argument("--out", default=None, help="folder for store_dtype.json and store_dtype.md")
    args = p.parse_args(argv)
    if args.quick and args.device == "auto":
        args.device = "cpu"
    q = args.quick
    for name, quick, full in (("rounds", 3, 5), ("steps", 1, 3), ("warmup", 1, 2), ("batches", 2, 4)):
        if getattr(args, name) is None:
            setattr(args, name, quick if q else full)
    for name in ("rounds", "steps", "batches"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    if (
        args.warmup < 0
        or (args.train_steps is not None and args.train_steps < 0)
        or args.min_bytes < 0
        or args.threads < 0
    ):
        p.error("--warmup, --train-steps, --min-bytes and --threads must not be negative")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = resolve_device(args.device)
    args.device = device
    if args.preset is None:
        args.preset = "tiny" if args.quick else ("medium" if device == "cuda" else "small")
    if args.train_steps is None:
        args.train_steps = 20 if args.quick else (200 if device == "cuda" else 50)
    overrides = {k: getattr(args, k) for k in ("layers", "dim", "heads", "seq", "batch") if getattr(args, k)}
    cfg = make_config(args.preset, dropout=args.dropout, **overrides)
    clock_kind = args.clock if args.clock != "auto" else ("wall" if device == "cuda" else "process")
    clock = Clock(clock_kind, device)
    threads_before = torch.get_num_threads()
    if device == "cpu" and args.threads:
        torch.set_num_threads(args.threads)
    try:
        report = run(args, cfg, device, clock)
    finally:
        torch.set_num_threads(threads_before)
    md = markdown(report)
    print(md)
    if args.out:
        save_report(args.out, "store_dtype", report, md)
    return verdict(report["arms"])


def run(args, cfg, device: str, clock: Clock) -> dict:
    t0 = time.perf_counter()
    rows = measure(args, cfg, device, clock)
    report = {
        "device": device,
        "device_name": torch.cuda.get_device_name(0) if device == "cuda" else (platform.processor() or "CPU"),
        "torch": torch.__version__,
        "package": co.__file__,
        "clock": clock.kind,
        "cpu_threads": torch.get_num_threads() if device == "cpu" else None,
        "args": vars(args),
        "config": cfg.as_dict(),
        "arms": rows,
        "train": train(args, cfg, device) if args.train_steps > 0 else None,
    }
    report["wall_s"] = time.perf_counter() - t0
    return report


def verdict(rows: dict) -> int:
    """1 if exact storage was not exact (gradients or bytes), else 0; the reasons on stderr."""
    rc = 0
    ex = rows["exact"]
    for arm in ("exact", "exact_aa"):
        if not rows[arm]["grad_bit_identical"]:
            print(f"ERROR: the {arm} arm's gradients differ from the no-offload run's", file=sys.stderr)
            rc = 1
        if rows[arm]["bytes_stored"] != rows[arm]["bytes_offloaded"]:
            print(
                f"ERROR: the {arm} arm stored {rows[arm]['bytes_stored']} bytes of {rows[arm]['bytes_offloaded']}",
                file=sys.stderr,
            )
            rc = 1
    if ex["tensors_converted"] != 0:
        print("ERROR: exact storage converted tensors", file=sys.stderr)
        rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
