#!/usr/bin/env python3
"""How far sequence tiling moves gradients and training from the untiled run.

Tiling (``co.tiled``, ``co.apply(tile=...)``, ``co.tiled_cross_entropy``) computes each token's
forward output and input gradient as the untiled run does, but sums each parameter's gradient over
tiles, which rounds differently from one large matmul. This measures what that does:

1. **Gradient error at one step.** From the same weights and batch, the tiled model's gradient of
   every parameter against the untiled one's: ``||g_tiled - g|| / ||g||``, the largest over the
   parameters (and which), the median, and how many are bit-identical. The forward's loss too.
2. **Training.** ``--steps`` AdamW steps from the same initial weights on the same batches, tiled
   and untiled; the untiled run again from ``--seeds`` other seeds (weights and batches) gives the
   seed-to-seed spread of the loss at each step. Reported: the largest ``|loss_tiled - loss|`` over
   the steps (same seed), the spread (standard deviation over the seeds) at each step, and their
   ratio; and, since a run whose rounding changes at all parts from the reference after enough
   steps (bfloat16 does so within tens of steps), the mean loss over the last tenth of the steps
   against the spread of that mean over the seeds, and a **rounding control**: the untiled model
   whose loss is summed over two halves of the batch, which changes nothing but the rounding of
   the head's gradient. The untiled run of seed 0 is run twice (the A/A pair): it must be
   bit-identical.

The model: a Llama-style decoder (``benchmarks/llama_decoder.py``: RMSNorm, grouped-query attention,
SwiGLU MLP) at a width a CPU trains in seconds; the tiled arm is ``co.apply(model, tile=...)``
(each block checkpointed, its MLP tiled) and the loss ``co.tiled_cross_entropy`` over the head; the
untiled arm is the plain model and ``F.cross_entropy`` of the full logits. Data: arithmetic
sequences mod the vocabulary (learnable, so the loss falls), a fixed set of batches per seed.

Usage::

    python3 benchmarks/tiling_exactness.py --out benchmarks/results     # CPU, float32: ~1-2 min
    python3 benchmarks/tiling_exactness.py --quick                       # a few steps: seconds
    python3 benchmarks/tiling_exactness.py --dtype bfloat16              # under CPU autocast bf16

Writes ``tiling_exactness_<device>.json`` and ``.md`` under ``--out``. Benchmarks measure, they do
not assert: the exit status is 0 unless something crashed or the A/A pair differs.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from _package import co, save_report  # noqa: E402
from llama_decoder import DecoderConfig, LlamaDecoder, rotary_tables  # noqa: E402

DEFAULTS = {
    "dim": 64,
    "layers": 2,
    "heads": 4,
    "kv_heads": 2,
    "ffn_dim": 176,
    "vocab": 256,
    "seq": 256,
    "batch": 4,
    "tile": 32,
    "head_tile": 64,
    "steps": 100,
    "seeds": 5,
    "batches": 8,
    "lr": 3e-3,
}
QUICK = {"steps": 5, "seeds": 2, "seq": 128, "batches": 2}


def make_batches(cfg: DecoderConfig, n: int, batch: int, seq: int, seed: int) -> list:
    """``n`` batches of ``(batch, seq + 1)`` arithmetic sequences mod the vocabulary (learnable)."""
    g = torch.Generator().manual_seed(1000 + seed)
    out = []
    for _ in range(n):
        start = torch.randint(0, cfg.vocab, (batch, 1), generator=g)
        step = torch.randint(1, 17, (batch, 1), generator=g)
        out.append((start + step * torch.arange(seq + 1)) % cfg.vocab)
    return out


def hidden(model: LlamaDecoder, tokens: torch.Tensor) -> torch.Tensor:
    """The decoder's final hidden states (after the final norm): the head's input."""
    x = model.embed(tokens)
    cos, sin = rotary_tables(tokens.shape[1], model.cfg.head_dim, model.cfg.rope_theta, dtype=x.dtype)
    for layer in model.layers:
        x = layer(x, cos=cos, sin=sin)
    return model.norm(x)


def loss_of(model, tokens, tiled: bool, head_tile: int, halves: bool = False) -> torch.Tensor:
    h = hidden(model, tokens[:, :-1])
    labels = tokens[:, 1:]
    if tiled:
        return co.tiled_cross_entropy(h, model.lm_head, labels, tile=head_tile)
    if halves:  # the rounding control: the same loss, summed over two halves of the batch
        k = h.shape[0] // 2
        parts = [
            F.cross_entropy(model.lm_head(p).float().flatten(0, 1), y.flatten(), reduction="sum")
            for p, y in ((h[:k], labels[:k]), (h[k:], labels[k:]))
        ]
        return (parts[0] + parts[1]) / labels.numel()
    logits = model.lm_head(h).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


class Arm:
    """A model (tiled or not) built from ``seed``, its optimizer, and its batches."""

    def __init__(self, args, seed: int, tiled: bool, halves: bool = False):
        self.cfg = DecoderConfig(
            "exactness",
            vocab=args.vocab,
            dim=args.dim,
            layers=args.layers,
            heads=args.heads,
            kv_heads=args.kv_heads,
            ffn_dim=args.ffn_dim,
            max_seq=args.seq,
        )
        self.model = LlamaDecoder(self.cfg, seed=seed).train()
        self.tiled, self.halves = tiled, halves
        self.handle = co.apply(self.model, tile=args.tile) if tiled else None
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=args.lr)
        self.batches = make_batches(self.cfg, args.batches, args.batch, args.seq, seed)
        self.head_tile = args.head_tile
        self.autocast = (
            torch.autocast("cpu", dtype=torch.bfloat16) if args.dtype == "bfloat16" else contextlib.nullcontext()
        )

    def loss(self, i: int) -> torch.Tensor:
        with self.autocast:
            return loss_of(self.model, self.batches[i % len(self.batches)], self.tiled, self.head_tile, self.halves)

    def train(self, steps: int) -> list:
        losses = []
        for i in range(steps):
            self.opt.zero_grad(set_to_none=True)
            loss = self.loss(i)
            loss.backward()
            self.opt.step()
            losses.append(float(loss.detach()))
        return losses


def gradient_error(args) -> dict:
    """Measurement 1: one step's gradients, tiled against untiled, from the same weights and batch."""
    plain, tiled = Arm(args, 0, False), Arm(args, 0, True)
    lp, lt = plain.loss(0), tiled.loss(0)
    lp.backward()
    lt.backward()
    rows = []
    for (name, p), (_, q) in zip(plain.model.named_parameters(), tiled.model.named_parameters()):
        g, h = p.grad.double(), q.grad.double()
        rows.append(
            {
                "param": name,
                "rel_error": float((h - g).norm() / g.norm()),
                "bit_identical": bool(torch.equal(p.grad, q.grad)),
            }
        )
    worst = max(rows, key=lambda r: r["rel_error"])
    stats = tiled.handle.tiles.stats()
    lp, lt = float(lp.detach()), float(lt.detach())
    return {
        "loss": lp,
        "loss_tiled": lt,
        "loss_rel_error": abs(lt - lp) / lp,
        "max_rel_error": worst["rel_error"],
        "worst_param": worst["param"],
        "median_rel_error": statistics.median(r["rel_error"] for r in rows),
        "bit_identical_params": sum(r["bit_identical"] for r in rows),
        "params": len(rows),
        "tiles_per_mlp_call": stats["tiles"] // max(stats["calls"], 1),
        "per_param": rows,
    }


def training(args) -> dict:
    """Measurement 2: loss curves, tiled and untiled from seed 0, untiled from the other seeds."""
    t0 = time.perf_counter()
    curves = {
        "untiled_seed0": Arm(args, 0, False).train(args.steps),
        "untiled_seed0_again": Arm(args, 0, False).train(args.steps),
        "tiled_seed0": Arm(args, 0, True).train(args.steps),
        "control_seed0": Arm(args, 0, False, halves=True).train(args.steps),
    }
    for s in range(1, args.seeds):
        curves[f"untiled_seed{s}"] = Arm(args, s, False).train(args.steps)
    seeds = [curves["untiled_seed0"]] + [curves[f"untiled_seed{s}"] for s in range(1, args.seeds)]
    spread = [statistics.pstdev(c[i] for c in seeds) for i in range(args.steps)]
    dev = [abs(a - b) for a, b in zip(curves["tiled_seed0"], curves["untiled_seed0"])]
    aa = [abs(a - b) for a, b in zip(curves["untiled_seed0_again"], curves["untiled_seed0"])]
    ratio = [d / s for d, s in zip(dev, spread) if s > 0]
    control = [abs(a - b) for a, b in zip(curves["control_seed0"], curves["untiled_seed0"])]
    tail = max(1, args.steps // 10)
    tail_means = [statistics.fmean(c[-tail:]) for c in seeds]
    return {
        "curves": curves,
        "seed_spread_std": spread,
        "tiled_deviation": dev,
        "control_deviation": control,
        "max_control_deviation": max(control),
        "tail_steps": tail,
        "tail_mean_untiled": tail_means[0],
        "tail_mean_tiled": statistics.fmean(curves["tiled_seed0"][-tail:]),
        "tail_mean_control": statistics.fmean(curves["control_seed0"][-tail:]),
        "tail_mean_seed_spread": statistics.pstdev(tail_means),
        "tail_mean_seed_range": [min(tail_means), max(tail_means)],
        "max_tiled_deviation": max(dev),
        "step_of_max_deviation": dev.index(max(dev)),
        "median_seed_spread": statistics.median(spread),
        "min_seed_spread": min(spread),
        "max_deviation_over_spread": max(ratio) if ratio else None,
        "aa_max_deviation": max(aa),
        "final_loss_untiled": curves["untiled_seed0"][-1],
        "final_loss_tiled": curves["tiled_seed0"][-1],
        "elapsed_s": time.perf_counter() - t0,
    }


def format_markdown(r: dict) -> str:
    a, g, t = r["args"], r["gradients"], r["training"]
    lines = [
        f"# Tiling exactness ({r['device'].upper()}, {a['dtype']})",
        "",
        f"{r['note']}",
        "",
        f"Command: `{r['command']}`",
        "",
        f"Model: Llama-style decoder, {a['layers']} layers, width {a['dim']}, SwiGLU {a['ffn_dim']}, vocabulary "
        f"{a['vocab']}; batch {a['batch']} x {a['seq']} tokens; MLP tiles of {a['tile']} positions "
        f"({g['tiles_per_mlp_call']} per call), head tiles of {a['head_tile']} tokens; AdamW lr {a['lr']}.",
        "",
        "## Gradients at one step (same weights, same batch)",
        "",
        "| | value |",
        "|---|---|",
        f"| loss, untiled / tiled | {g['loss']:.8f} / {g['loss_tiled']:.8f} (rel. {g['loss_rel_error']:.1e}) |",
        f"| max relative gradient error (parameter) | {g['max_rel_error']:.2e} ({g['worst_param']}) |",
        f"| median relative gradient error | {g['median_rel_error']:.2e} |",
        f"| parameters bit-identical | {g['bit_identical_params']} of {g['params']} |",
        "",
        f"## Training: {a['steps']} steps, tiled against untiled and the seed-to-seed spread",
        "",
        "| | value |",
        "|---|---|",
        f"| final loss, untiled / tiled (seed 0) | {t['final_loss_untiled']:.6f} / {t['final_loss_tiled']:.6f} |",
        f"| largest \\|loss tiled - loss untiled\\| over the steps | {t['max_tiled_deviation']:.2e} "
        f"(step {t['step_of_max_deviation']}) |",
        f"| seed-to-seed spread of the untiled loss (std over {a['seeds']} seeds): median / smallest | "
        f"{t['median_seed_spread']:.2e} / {t['min_seed_spread']:.2e} |",
        f"| largest deviation / spread at the same step | "
        f"{'-' if t['max_deviation_over_spread'] is None else format(t['max_deviation_over_spread'], '.2e')} |",
        f"| rounding control (untiled, loss summed over two halves): largest deviation | "
        f"{t['max_control_deviation']:.2e} |",
        f"| mean loss over the last {t['tail_steps']} steps: untiled / tiled / control | "
        f"{t['tail_mean_untiled']:.6f} / {t['tail_mean_tiled']:.6f} / {t['tail_mean_control']:.6f} |",
        f"| that mean over the {a['seeds']} untiled seeds: std / range | {t['tail_mean_seed_spread']:.2e} / "
        f"{t['tail_mean_seed_range'][0]:.6f} .. {t['tail_mean_seed_range'][1]:.6f} |",
        f"| A/A: untiled seed 0 twice, largest difference | {t['aa_max_deviation']:.1e} |",
        "",
        "Loss every 10 steps (untiled seed 0, tiled seed 0, spread):",
        "",
        "```",
    ]
    c = t["curves"]
    for i in range(0, a["steps"], max(1, a["steps"] // 10)):
        lines.append(
            f"step {i:4d}  untiled {c['untiled_seed0'][i]:.6f}  tiled {c['tiled_seed0'][i]:.6f}  "
            f"|diff| {t['tiled_deviation'][i]:.1e}  control |diff| {t['control_deviation'][i]:.1e}  "
            f"spread {t['seed_spread_std'][i]:.1e}"
        )
    lines += ["```", ""]
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"fewer steps and seeds ({QUICK})")
    p.add_argument("--out", default=None, help="write tiling_exactness_<device>.json and .md here")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="bfloat16: every step under CPU autocast to bfloat16",
    )
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    for k, v in DEFAULTS.items():
        p.add_argument(f"--{k.replace('_', '-')}", type=type(v), default=None, help=f"default {v}")
    args = p.parse_args(argv)
    for k, v in DEFAULTS.items():
        if getattr(args, k) is None:
            setattr(args, k, QUICK.get(k, v) if args.quick else v)
    if args.seeds < 2:
        p.error("--seeds: at least 2 (the spread needs two)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    old = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        t0 = time.perf_counter()
        report = {
            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),  # noqa: UP017
            "device": "cpu",
            "torch_version": torch.__version__,
            "host": {"platform": platform.platform(), "cpus": os.cpu_count()},
            "command": "python3 benchmarks/tiling_exactness.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "note": (
                "CPU numbers: float32 (or bfloat16 autocast) on the CPU; the rounding of a GPU's matmuls "
                "differs, the method does not."
            ),
            "args": vars(args),
        }
        report["gradients"] = gradient_error(args)
        g = report["gradients"]
        print(
            f"tiling_exactness: one step: max relative gradient error {g['max_rel_error']:.2e} "
            f"({g['worst_param']}), median {g['median_rel_error']:.2e}, {g['bit_identical_params']} of "
            f"{g['params']} parameters bit-identical; loss {g['loss']:.8f} vs {g['loss_tiled']:.8f}"
        )
        report["training"] = t = training(args)
        print(
            f"tiling_exactness: {args.steps} steps: largest |loss tiled - untiled| {t['max_tiled_deviation']:.2e} "
            f"(step {t['step_of_max_deviation']}); seed-to-seed spread median {t['median_seed_spread']:.2e}, "
            f"smallest {t['min_seed_spread']:.2e}; rounding control {t['max_control_deviation']:.2e}; last "
            f"{t['tail_steps']} steps' mean loss untiled {t['tail_mean_untiled']:.4f} tiled "
            f"{t['tail_mean_tiled']:.4f} "
            f"(seed spread {t['tail_mean_seed_spread']:.2e}); A/A {t['aa_max_deviation']:.1e}"
        )
        report["elapsed_s"] = time.perf_counter() - t0
        if args.out:
            stem = "tiling_exactness_cpu" + ("" if args.dtype == "float32" else f"_{args.dtype}")
            save_report(args.out, stem, report, format_markdown(report))
            print(f"tiling_exactness: wrote {stem}.json and {stem}.md to {args.out}")
        return 0 if t["aa_max_deviation"] == 0 else 1
    finally:
        torch.set_num_threads(old)


if __name__ == "__main__":
    sys.exit(main())
