"""Command line: ``python -m ckpt_offload {demo,info}``.

Examples::

    python -m ckpt_offload info
    python -m ckpt_offload demo                          # small model, GPU if usable, else CPU
    python -m ckpt_offload demo --steps 4 --device cpu --out results/
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["main", "build_parser"]

_DEMO_DESCRIPTION = """\
Train the built-in TinyTransformer for a few steps twice, with the same seed, data and dropout:
once plainly and once with every forward inside co.offload(). Prints the activation bytes autograd
saved, how many stayed on the device and how many went to the host pool, the pool's counters, the
median step-time ratio offload/baseline (steps after the first), and whether the first step's
gradients and every step's loss are bit-identical.

On a GPU the offload run uses co.offload()'s default devices (CUDA tensors into a pinned pool) and
torch.cuda.max_memory_allocated is reported for both runs. Without one it uses
co.offload(devices=["cpu"]): CPU tensors copied into a pageable host pool. There the bytes and the
gradient equality are real; the time ratio is CPU copy overhead, not GPU behaviour.

Exit status: 0 when gradients and losses match, 1 when they do not, 2 for bad arguments."""


def _int_at_least(minimum: int):
    """An argparse type: an integer >= minimum, with an error that says so."""

    def parse(text: str) -> int:
        want = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def build_parser() -> argparse.ArgumentParser:
    from ckpt_offload.models import CONFIGS
    from ckpt_offload.offload import DEFAULT_MIN_BYTES, STREAM_MODES

    parser = argparse.ArgumentParser(
        prog="python -m ckpt_offload",
        description="ckpt_offload: offload saved activations to a host-memory pool.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{demo,info}")
    sub.required = True

    demo = sub.add_parser(
        "demo",
        help="train the built-in transformer with and without co.offload and compare",
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
        type=_non_negative_int,
        default=DEFAULT_MIN_BYTES,
        help=f"co.offload(min_bytes=...): smaller saved tensors stay on the device (default: {DEFAULT_MIN_BYTES})",
    )
    demo.add_argument(
        "--stream", choices=STREAM_MODES, default="side", help="co.offload(stream=...) (default: side)"
    )
    demo.add_argument(
        "--seed", type=_non_negative_int, default=0, help="seed for weights, data and dropout (default: 0)"
    )

    sub.add_parser(
        "info",
        help="print co.build_info() and the default pool's configuration and counters",
        description="Print how ckpt_offload was built (co.build_info()) and the default host pool's state.",
    )
    return parser


def _info() -> int:
    import ckpt_offload as co

    print("build_info:")
    for key, value in co.build_info().items():
        print(f"  {key}: {value}")
    print("default_pool:")
    for key, value in co.default_pool().stats().items():
        print(f"  {key}: {value}")
    return 0


def _demo(args, parser) -> int:
    from ckpt_offload import demo

    if args.device == "cuda" and not demo.gpu_usable():
        import torch

        import ckpt_offload as co

        parser.error(
            "--device cuda: no usable CUDA GPU here "
            f"(torch.cuda.is_available()={torch.cuda.is_available()}, "
            f"ckpt_offload cuda_compiled={co.build_info()['cuda_compiled']}); use --device cpu"
        )
    result = demo.run_demo(
        size=args.size,
        steps=args.steps,
        device=args.device,
        min_bytes=args.min_bytes,
        stream=args.stream,
        seed=args.seed,
    )
    print(demo.format_report(result))
    if args.out is not None:
        path = demo.write_json(result, args.out)
        print(f"wrote {path}")
    return 0 if (result["grads_match"] and result["losses_match"]) else 1


def main(argv=None) -> int:
    """Entry point; returns the exit status. ``argv`` defaults to ``sys.argv[1:]``.

    Example::

        from ckpt_offload.__main__ import main
        status = main(["demo", "--size", "tiny", "--steps", "2", "--device", "cpu"])
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "info":
        return _info()
    return _demo(args, parser)


if __name__ == "__main__":
    sys.exit(main())
