"""``python -m ckpt_offload plan``: plan the built-in model (or your own) for a budget, print the
summary, apply the plan, measure it, and plot predicted vs measured memory over the step."""

from __future__ import annotations

import json
import os

__all__ = ["builtin_model", "add_plan_parser", "run_plan", "plot_memory"]

PLAN_DESCRIPTION = """\
Measure one training step of a model, plan keep / offload / recompute per block so that saved
activations fit --budget with the least predicted step time, print the plan's summary, then apply
it and measure: the peak of saved activations (torch.profiler's allocator events) and the step time,
next to the prediction. Writes OUT/plan.json and OUT/plan_memory.png (predicted vs measured device
memory of saved activations over the step; needs matplotlib).

Without --script: the built-in TinyTransformer (--size) on --device. With --script FILE.py:FUNCTION,
FUNCTION() is called once and must return (model, step): the model whose blocks are planned and a
function of no arguments running one forward and backward.

Exit status: 0 when the measured peak is within the budget, 1 when it is not, 2 for bad arguments
(an impossible budget included: the message names the smallest feasible one; an --out folder that
cannot be written too, found before anything is measured), 3 when OUT/plan.json or
OUT/plan_memory.png cannot be written at the end (e.g. the disk is full)."""


def _budget_arg(text: str) -> str:
    """argparse type of --budget: checked when the arguments are read (before any measuring);
    the text itself is kept for the messages."""
    import argparse

    from ckpt_offload.planner.planning import parse_bytes

    if text.strip().startswith("-"):
        raise argparse.ArgumentTypeError(f"must be an amount of bytes >= 0 such as 20MiB or 2GiB, got {text!r}")
    try:
        parse_bytes("--budget", text)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e).replace("--budget: ", "")) from None
    return text


def _bandwidth_arg(text: str) -> str:
    """argparse type of --bandwidth: checked when the arguments are read, not after measuring."""
    import argparse

    from ckpt_offload.planner.planning import parse_bandwidth

    try:
        parse_bandwidth(text)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _lossy_arg(text: str) -> str:
    """argparse type of --lossy: a storage name co.plan(lossy=...) accepts, checked when the
    arguments are read, not after measuring."""
    import argparse

    from ckpt_offload.planner.planning import parse_lossy

    try:
        parse_lossy(text)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def builtin_model(size: str = "small", device: str = "cpu", seed: int = 0, **overrides):
    """The built-in TinyTransformer preset ``size`` and a step (forward + backward of the LM loss)
    on ``device``: ``(model, step, config)``. The one place the planner's CLI and benchmark import
    the built-in model from."""
    import torch

    from ckpt_offload.demo.model import TinyTransformer, lm_loss, make_batch, make_config

    cfg = make_config(size, **overrides)
    model = TinyTransformer(**cfg.model_kwargs(), seed=seed).to(device).train()
    tokens = make_batch(cfg, seed=seed, device=device)

    def step():
        torch.manual_seed(seed)
        lm_loss(model, tokens).backward()

    return model, step, cfg


def add_plan_parser(sub, configs, default_min_bytes):
    sizes = "; ".join(f"{n}: dim {c.dim}, {c.layers} layers, seq {c.seq}, batch {c.batch}" for n, c in configs.items())
    import argparse

    p = sub.add_parser(
        "plan",
        help="plan keep/offload/recompute per block for a memory budget, apply and check it",
        description=PLAN_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from ckpt_offload.cli._common import _non_negative_int, _positive_int, _size

    p.add_argument(
        "--budget",
        required=True,
        type=_budget_arg,
        help="device memory for saved activations at peak, e.g. 20MiB, 2GiB",
    )
    p.add_argument(
        "--size", choices=tuple(configs), default=None, help=f"built-in model preset (default: small). {sizes}"
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=None,
        help="where the built-in model runs (default: cuda if a GPU is usable, else cpu)",
    )
    p.add_argument(
        "--script",
        metavar="FILE.py:FUNCTION",
        default=None,
        help="plan your own model: FUNCTION() returns (model, step)",
    )
    p.add_argument(
        "--bandwidth",
        default=None,
        type=_bandwidth_arg,
        help="host link bytes/s both ways (e.g. 25GB/s, inf, 0) instead of measuring it",
    )
    p.add_argument(
        "--min-bytes",
        type=_size,
        default=None,
        help=f"offloaded tensors' minimum size (default: co.offload's, {default_min_bytes}; 0 on cpu)",
    )
    p.add_argument("--no-segments", action="store_true", help="no segments of blocks checkpointed as one")
    p.add_argument(
        "--lossy",
        default=None,
        metavar="DTYPE",
        type=_lossy_arg,
        help="allow offloaded activations stored narrower where that pays (co.plan(lossy=...)): bf16, "
        "fp16, fp8 (e4m3fn) or fp8_e5m2; not bit-exact (default: exact storage only)",
    )
    p.add_argument(
        "--levels",
        type=int,
        choices=(1, 2, 3),
        default=2,
        help="how deep segments may nest (co.plan(levels=...)): 1 flat segments, 2 (default) a "
        "segment whose recompute checkpoints inner segments, 3 one more level (slower search)",
    )
    p.add_argument(
        "--out",
        metavar="DIR",
        default="ckpt_offload_plan",
        help="folder for plan.json and plan_memory.png (default: ./ckpt_offload_plan)",
    )
    p.add_argument("--seed", type=_non_negative_int, default=0, help="built-in model: seed (default: 0)")
    p.add_argument("--steps", type=_positive_int, default=3, help="timed steps per measurement (default: 3)")
    p.set_defaults(_parser=p)  # its errors print its own usage
    return p


def _measure(step, device, repeats=3):
    """Median step seconds and the saved-activation timeline of ``step``."""
    import time

    import torch

    import ckpt_offload as co
    from ckpt_offload.planner.saved_peak import saved_activation_peak

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()
        co.synchronize()

    step()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2], saved_activation_peak(step, device)


def plot_memory(path, predicted, measured, baseline=None, budget=None, title=""):
    """Predicted and measured saved-activation memory over the step (time as a fraction of each
    step, since predicted and measured step times differ). Returns False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False

    def norm(tl):
        end = max(t for t, _ in tl) or 1.0
        return [t / end for t, _ in tl], [b / 2**20 for _, b in tl]

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for tl, label, style in (
        (baseline, "measured, no plan", ":"),
        (predicted, "predicted (simulator)", "--"),
        (measured, "measured with the plan", "-"),
    ):
        if tl:
            x, y = norm(tl)
            ax.step(x, y, where="post", linestyle=style, label=label)
    if budget is not None:
        ax.axhline(budget / 2**20, color="red", linewidth=0.8, label="budget")
    ax.set_xlabel("fraction of the step")
    ax.set_ylabel("saved activations on the device (MiB)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def run_plan(args, parser) -> int:
    import torch

    import ckpt_offload as co
    from ckpt_offload.cli._common import _check_out, heartbeat, write_failed
    from ckpt_offload.planner import InfeasibleBudget, parse_bytes

    _check_out(args.out, parser)  # before minutes of measuring, not after
    if args.script is not None and args.size is not None:
        parser.error(
            "--size picks the built-in model's preset; with --script your FUNCTION builds its own "
            "model: drop --size (or drop --script to plan for the built-in model)"
        )
    args.size = args.size or "small"
    if args.script is not None:
        from ckpt_offload.cli._common import load_script as _load_script

        fn = _load_script(args.script, parser)
        got = fn()
        if not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], torch.nn.Module) and callable(got[1])):
            parser.error(f"--script: {args.script} must return (model, step), got {type(got).__name__}")
        model, step = got
        device = next(model.parameters()).device.type
        what = args.script
    else:
        from ckpt_offload import demo

        device = args.device or demo.default_device()
        if device == "cuda" and not demo.gpu_usable():
            parser.error("--device cuda: no usable CUDA GPU here; use --device cpu")
        model, step, _ = builtin_model(args.size, device, args.seed)
        what = f"TinyTransformer {args.size} on {device}"
    try:
        budget = parse_bytes("--budget", args.budget)
    except (TypeError, ValueError) as e:
        parser.error(str(e))
    min_bytes = args.min_bytes if args.min_bytes is not None else (0 if device == "cpu" else None)
    try:
        offload = {"devices": [device]} if min_bytes is None else {"devices": [device], "min_bytes": min_bytes}
        # Measuring (three runs of the step, the link's bandwidth) and the search: minutes on a CPU.
        with heartbeat(f"planning {what} for {args.budget} of saved activations (measuring, then searching)"):
            plan = co.plan(
                model,
                step,
                budget=budget,
                bandwidth=args.bandwidth,
                offload=offload,
                segments=not args.no_segments,
                levels=args.levels,
                lossy=args.lossy,
            )
    except InfeasibleBudget as e:
        parser.error(str(e))
    except (TypeError, ValueError) as e:
        parser.error(str(e))
    print(plan.summary())
    model.zero_grad(set_to_none=True)
    with heartbeat(f"measuring {args.steps} step(s) without the plan"):
        base_s, base_mem = _measure(step, device, args.steps)
    handle = plan.apply()
    try:
        with heartbeat(f"measuring {args.steps} step(s) with the plan"):
            plan_s, plan_mem = _measure(step, device, args.steps)
    finally:
        handle.remove()
    model.zero_grad(set_to_none=True)
    ok = plan_mem.peak_bytes <= budget
    print(
        f"measured with the plan: peak {plan_mem.peak_bytes / 2**20:.2f} MiB (predicted "
        f"{plan.predicted_peak_bytes / 2**20:.2f} MiB, budget {budget / 2**20:.2f} MiB: "
        f"{'within' if ok else 'OVER'}), step {plan_s * 1e3:.2f} ms "
        f"(predicted {plan.predicted_step_seconds * 1e3:.2f} ms)"
    )
    print(f"measured without: peak {base_mem.peak_bytes / 2**20:.2f} MiB, step {base_s * 1e3:.2f} ms")
    result = {
        "model": what,
        "device": device,
        "budget_bytes": budget,
        "choices": plan.choices,
        "prefetch_bytes": plan.prefetch_bytes,
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "predicted_step_seconds": plan.predicted_step_seconds,
        "measured_peak_bytes": plan_mem.peak_bytes,
        "measured_step_seconds": plan_s,
        "baseline": dict(plan.baseline, measured_peak_bytes=base_mem.peak_bytes, measured_step_seconds=base_s),
        "bandwidth": vars(plan.costs.bandwidth),
        "within_budget": ok,
        "lossy": None if plan.lossy is None else str(plan.lossy).removeprefix("torch."),
        "store_dtypes": {k: str(v).removeprefix("torch.") for k, v in plan.store_dtypes.items()},
        "predicted_host_bytes": plan.predicted_host_bytes,
    }
    png = os.path.join(args.out, "plan_memory.png")
    try:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "plan.json"), "w") as f:
            json.dump(result, f, indent=1, default=float)
        plotted = plot_memory(
            png,
            plan.simulation.timeline,
            plan_mem.timeline,
            base_mem.timeline,
            budget,
            f"{what}: budget {budget / 2**20:.1f} MiB",
        )
    except OSError as e:
        return write_failed(f"the plan files in {args.out!r}", e)
    if plotted:
        print(f"wrote {os.path.join(args.out, 'plan.json')}, {png}")
    else:
        print(f"wrote {os.path.join(args.out, 'plan.json')} (plan_memory.png needs matplotlib)")
    return 0 if ok else 1
