"""Command line: ``python -m ckpt_offload {demo,profile,plan,info}``.

Examples::

    python -m ckpt_offload info
    python -m ckpt_offload profile --steps 3 --size small --out prof/   # summary, trace, CSV, plot
    python -m ckpt_offload profile --script train.py:step             # profile your own step
    python -m ckpt_offload demo                          # small model, GPU if usable, else CPU
    python -m ckpt_offload demo --steps 4 --device cpu --out results/
    python -m ckpt_offload plan --size small --budget 20MiB          # plan, apply, measure, plot
"""

from __future__ import annotations

import argparse
import re
import sys

from ckpt_offload.cli._common import (  # noqa: F401
    EXIT_WRITE_FAILED,
    _check_out,
    _non_negative_int,
    _positive_int,
    _size,
    load_script,
    write_failed,
)
from ckpt_offload.cli.plan import add_plan_parser, run_plan

__all__ = ["main", "build_parser"]

_DEMO_DESCRIPTION = """\
Train the built-in TinyTransformer for a few steps four times, with the same seed, data and
dropout: plainly; with every block checkpointed; with the recommended recipe, every block
checkpointed and its input offloaded (co.apply(model, offload=True)); and with every forward
inside co.offload() (everything offloaded). The report shows the recipe first (saved activations
on the device at peak, bytes copied, step time against checkpointing alone and the baseline), then
offload-everything as the contrast, and the bandwidth arithmetic between them: bytes copied per
step / GB/s (measured by co.profile) against the compute time the copies can hide behind; when the
copies take longer, offload-everything is copy-bound. Then offload-everything in detail: the
activation bytes autograd saved, how many stayed on the device and how many went to the host pool,
the pool's counters, the median step-time ratio offload/baseline (steps after the first), and
whether the first step's gradients and every step's loss are bit-identical.

On a GPU the offload run uses co.offload()'s default devices (CUDA tensors into a pinned pool) and
torch.cuda.max_memory_allocated is reported for both runs. Without one it uses
co.offload(devices=["cpu"]): CPU tensors copied into a pageable host pool. There the bytes and the
gradient equality are real; the time ratio is CPU copy overhead, not GPU behaviour.

Exit status: 0 when gradients and losses match in every run, 1 when they do not, 2 for bad
arguments, 3 when --out's demo.json cannot be written."""

_PROFILE_DESCRIPTION = """\
Run a few training steps under co.profile() and write what ckpt_offload did: summary.txt (the
table also printed here: bytes offloaded and reloaded per module, bandwidth per direction, copy
time hidden behind compute vs. time the compute stream stalled for reloads, pool peak / reserved /
backend allocations / cap hits, tensors kept and why), trace.json (Chrome trace: open it in
https://ui.perfetto.dev or chrome://tracing), records.csv (one row per copy), profile.json and
memory.png (needs matplotlib).

Without --script: the built-in TinyTransformer trains (Adam) with every forward inside
co.offload(); on a GPU CUDA tensors go to the pinned pool, on --device cpu CPU tensors are copied
to a pageable pool (co.offload(devices=["cpu"])), and the bandwidths are memcpy speed, not GPU.

With --script path/to/file.py:function the file is imported and function() is called once per
step, with no arguments: it is your whole training step and uses co.offload / co.checkpoint /
co.apply itself (the profiler records what they do; nothing is offloaded for you).

Exit status: 0 on success, 2 for bad arguments (an --out folder that cannot be written included),
3 when the files cannot be written at the end (e.g. the disk is full)."""


_PREFETCH_HELP = (
    "co.offload(prefetch_bytes=...): a fixed window of prefetched bytes in backward, 0 for none "
    "(default: the automatic window, about one block of the model)"
)


def build_parser() -> argparse.ArgumentParser:
    from ckpt_offload.demo.model import CONFIGS
    from ckpt_offload.options import DEFAULT_MIN_BYTES, STREAM_MODES

    parser = argparse.ArgumentParser(
        prog="python -m ckpt_offload",
        description="ckpt_offload: offload saved activations to a host-memory pool.",
    )
    from ckpt_offload._version import __version__

    parser.add_argument("--version", action="version", version=f"ckpt_offload {__version__}")
    parser.epilog = "Run 'python -m ckpt_offload COMMAND --help' for a command's options and exit status."
    sub = parser.add_subparsers(dest="command", metavar="{demo,profile,plan,info}")
    sub.required = True

    demo = sub.add_parser(
        "demo",
        help="train the built-in transformer plainly, with the recommended recipe and offloading everything",
        description=_DEMO_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sizes = "; ".join(
        f"{name}: dim {c.dim}, {c.layers} layers, seq {c.seq}, batch {c.batch}" for name, c in CONFIGS.items()
    )
    demo.add_argument("--steps", type=_positive_int, default=8, help="training steps per run (default: 8)")
    demo.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=None,
        help="where to train (default: cuda if a GPU is usable, else cpu)",
    )
    demo.add_argument(
        "--size",
        choices=tuple(CONFIGS),
        default="small",
        help=f"model preset (default: small). {sizes}. medium is meant for a GPU (a minute a step on a 2-core CPU)",
    )
    demo.add_argument("--out", metavar="DIR", default=None, help="also write DIR/demo.json with every number")
    demo.add_argument(
        "--min-bytes",
        type=_size,
        default=DEFAULT_MIN_BYTES,
        help=f"co.offload(min_bytes=...): smaller saved tensors stay on the device (default: {DEFAULT_MIN_BYTES})",
    )
    demo.add_argument("--stream", choices=STREAM_MODES, default="side", help="co.offload(stream=...) (default: side)")
    demo.add_argument(
        "--seed", type=_non_negative_int, default=0, help="seed for weights, data and dropout (default: 0)"
    )
    demo.add_argument("--prefetch-bytes", type=_size, default=None, help=_PREFETCH_HELP)
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.set_defaults(_parser=demo)  # its errors print its own usage

    prof = sub.add_parser(
        "profile",
        help="run a few training steps under co.profile() and write summary, trace, CSV and plot",
        description=_PROFILE_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    prof.add_argument("--steps", type=_positive_int, default=3, help="training steps to profile (default: 3)")
    prof.add_argument(
        "--size",
        choices=tuple(CONFIGS),
        default=None,
        help=f"built-in model preset (default: small). {sizes}",
    )
    prof.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=None,
        help="where the built-in model trains (default: cuda if a GPU is usable, else cpu)",
    )
    prof.add_argument(
        "--out",
        metavar="DIR",
        default="ckpt_offload_profile",
        help="folder for summary.txt, trace.json, records.csv, profile.json, memory.png "
        "(default: ./ckpt_offload_profile)",
    )
    prof.add_argument(
        "--script",
        metavar="FILE.py:FUNCTION",
        default=None,
        help="profile your own step instead: import FILE.py and call FUNCTION() once per step",
    )
    prof.add_argument(
        "--min-bytes",
        type=_size,
        default=DEFAULT_MIN_BYTES,
        help=f"built-in model: co.offload(min_bytes=...) (default: {DEFAULT_MIN_BYTES})",
    )
    prof.add_argument(
        "--stream", choices=STREAM_MODES, default="side", help="built-in model: co.offload(stream=...) (default: side)"
    )
    prof.add_argument("--seed", type=_non_negative_int, default=0, help="built-in model: seed (default: 0)")
    prof.add_argument("--prefetch-bytes", type=_size, default=None, help="built-in model: " + _PREFETCH_HELP)
    prof.add_argument("--top", type=_positive_int, default=None, help="summary: show the N heaviest modules only")
    prof.add_argument("--no-progress", action="store_true", help="no progress bar")
    prof.set_defaults(_parser=prof)

    add_plan_parser(sub, CONFIGS, DEFAULT_MIN_BYTES)

    info = sub.add_parser(
        "info",
        help="print co.build_info() and the default pool's configuration and counters",
        description="Print how ckpt_offload was built (co.build_info()) and the default host pool's state.",
    )
    info.set_defaults(_parser=info)
    return parser


_NEGATIVE = re.compile(r"-[0-9.]")


def _join_negative_values(argv: list) -> list:
    """``--budget -5MiB`` -> ``--budget=-5MiB``: argparse reads a value that starts with '-' (and
    is not a plain number) as an option, and answers "expected one argument"; joined, the value
    reaches its own check, which says what is wrong with it. No option of ours starts with a digit."""
    out = []
    for arg in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and _NEGATIVE.match(arg):
            out[-1] = f"{out[-1]}={arg}"
            continue
        out.append(arg)
    return out


def _info() -> int:
    from ckpt_offload._info import build_info
    from ckpt_offload._runtime import _C
    from ckpt_offload.pool import default_pool

    print("build_info:")
    info = build_info()
    for key, value in info.items():
        print(f"  {key}: {value}")
    if info["cuda_compiled"] and info["gpu_available"]:
        print("co.offload() with defaults here: offloads CUDA tensors (devices=['cuda'])")
    else:
        print(
            "co.offload() with defaults here: offloads NOTHING (no usable CUDA GPU"
            + ("" if info["cuda_compiled"] else "; this build has no CUDA")
            + "); pass devices=['cpu'] to offload CPU tensors into the host pool"
        )

    pool = default_pool()
    stats = pool.stats()
    print("default_pool configuration:")
    print(f"  backend: {stats['backend']}")
    print(f"  max_bytes: {'none' if stats['max_bytes'] is None else stats['max_bytes']}")
    # default_pool() is HostPool() with the default segment size.
    print(f"  segment_bytes: {int(_C.DEFAULT_SEGMENT_BYTES)}")
    print(f"  reserved: {stats['bytes_reserved']}")
    print("default_pool counters:")
    for key, value in stats.items():
        print(f"  {key}: {value}")
    return 0


def _progress(steps: int, enabled: bool):
    """range(steps) with a tqdm progress bar when tqdm is installed (stderr), plain otherwise."""
    from ckpt_offload.demo.runner import progress_range

    return progress_range(steps, "profiling", enabled)


def _gpu_or_error(device: str, parser) -> None:
    """A parser error (exit status 2) when ``device`` is "cuda" and no CUDA GPU is usable here."""
    from ckpt_offload.demo.runner import gpu_usable

    if device == "cuda" and not gpu_usable():
        import torch

        from ckpt_offload._info import build_info

        parser.error(
            "--device cuda: no usable CUDA GPU here "
            f"(torch.cuda.is_available()={torch.cuda.is_available()}, "
            f"ckpt_offload cuda_compiled={build_info()['cuda_compiled']}); use --device cpu"
        )


def _profile(args, parser) -> int:
    import torch

    from ckpt_offload.offloading import offload
    from ckpt_offload.pool import HostPool
    from ckpt_offload.profiling import profile

    _check_out(args.out, parser)
    if args.script is not None and args.size is not None:
        parser.error(
            "--size picks the built-in model's preset; with --script your FUNCTION builds its own "
            "model and sizes: drop --size (or drop --script to profile the built-in model)"
        )
    args.size = args.size or "small"
    step_fn = load_script(args.script, parser) if args.script is not None else None
    model, pools = None, None  # a script's steps use their own pools: the default one is reported
    if step_fn is None:
        from ckpt_offload.demo.model import TinyTransformer, lm_loss, make_batch, make_config
        from ckpt_offload.demo.runner import SimpleAdam, default_device

        device = args.device or default_device()
        _gpu_or_error(device, parser)
        cfg = make_config(args.size)
        torch.manual_seed(args.seed)
        model = TinyTransformer(**cfg.model_kwargs(), seed=args.seed).to(device).train()
        opt = SimpleAdam(model.parameters(), lr=3e-3)
        batches = [make_batch(cfg, seed=args.seed * 100_003 + i, device=device) for i in range(args.steps)]
        # A pool of its own, so the pool lines of the summary describe this run alone.
        pools = [HostPool()]
        ctx = offload(
            min_bytes=args.min_bytes,
            stream=args.stream,
            devices=None if device == "cuda" else ["cpu"],
            pool=pools[0],
            prefetch_bytes=args.prefetch_bytes,
        )
        print(
            f"profiling {args.steps} step(s) of TinyTransformer {args.size} on {device} under {ctx!r}",
            file=sys.stderr,
        )

        next_batch = iter(batches).__next__

        def step_fn():
            with ctx:
                loss = lm_loss(model, next_batch())
            loss.backward()
            opt.step()
            opt.zero_grad()
            if device == "cuda":
                torch.cuda.synchronize()
    else:
        print(f"profiling {args.steps} call(s) of {args.script}", file=sys.stderr)

    with profile(model=model, pools=pools) as prof:
        for _ in _progress(args.steps, not args.no_progress):
            step_fn()
    print(prof.summary(top=args.top))
    try:
        paths = prof.save(args.out)
    except ValueError as e:
        parser.error(f"--out: {e}")
    except OSError as e:
        return write_failed(f"the profile files in {args.out!r}", e)
    if "memory" not in paths:
        print("memory.png not written: matplotlib is not installed (`pip install matplotlib`)")
    print(f"wrote {', '.join(paths[k] for k in ('summary', 'trace', 'csv', 'json', 'memory') if k in paths)}")
    return 0


def _demo(args, parser) -> int:
    from ckpt_offload.demo import report
    from ckpt_offload.demo import runner as demo

    _gpu_or_error(args.device, parser)
    if args.out is not None:
        _check_out(args.out, parser)
    result = demo.run_demo(
        size=args.size,
        steps=args.steps,
        device=args.device,
        min_bytes=args.min_bytes,
        stream=args.stream,
        seed=args.seed,
        prefetch_bytes=args.prefetch_bytes,
        progress=not args.no_progress,
    )
    print(report.format_report(result))
    if args.out is not None:
        try:
            path = report.write_json(result, args.out)
        except OSError as e:
            return write_failed(f"demo.json in {args.out!r}", e)
        print(f"wrote {path}")
    recipe = result.get("recipe") or {}
    ok = (
        result["grads_match"]
        and result["losses_match"]
        and recipe.get("grads_match", True)
        and recipe.get("losses_match", True)
    )
    return 0 if ok else 1


def main(argv=None) -> int:
    """Entry point; returns the exit status. ``argv`` defaults to ``sys.argv[1:]``.

    Example::

        from ckpt_offload.cli import main
        status = main(["demo", "--size", "tiny", "--steps", "2", "--device", "cpu"])
        status = main(["profile", "--size", "tiny", "--steps", "2", "--device", "cpu", "--out", "prof"])
    """
    parser = build_parser()
    args = parser.parse_args(_join_negative_values(list(sys.argv[1:] if argv is None else argv)))
    # Errors found after parsing print the subcommand's usage, not the top-level one.
    sub_parser = args._parser
    if args.command == "info":
        return _info()
    if args.command == "profile":
        return _profile(args, sub_parser)
    if args.command == "plan":
        return run_plan(args, sub_parser)
    return _demo(args, sub_parser)


if __name__ == "__main__":
    sys.exit(main())
