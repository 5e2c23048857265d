#!/usr/bin/env python3
"""Overlap benchmark: ckpt_offload side by side with every peer, on a built-in Llama-style decoder.

For each sequence length (short to long) the same model, the same weights and the same random
tokens go through every strategy, one after the other, in one process:

==============================  ===================================================================
``none``                        no checkpointing: every activation stays on the device
``checkpoint``                  ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` per layer
``hf_offload``                  Hugging Face's ``offload=True``: every layer's checkpoint call runs
                                inside ``save_on_cpu(pin_memory=True)`` (transformers'
                                ``checkpoint_func``; copies on the compute stream)
``torchtune``                   torchtune's ``OffloadActivations`` around the checkpointed model
                                forward, output head excluded (``NoOpManager``), as its recipes do
                                (when torchtune is installed; otherwise the row says so)
``co_offload``                  ``with co.offload():`` around the plain model forward (no recompute)
``co_checkpoint_compute``       ``co.checkpoint(layer, x, offload={"stream": "compute",
                                "prefetch_bytes": 0})``: copies on the compute stream, no prefetch
``co_checkpoint_side_prefetch`` ``co.checkpoint(..., offload={"stream": "side"})``: side copy streams
                                and the default prefetch
``co_checkpoint_side_batched``  as above plus ``batch_below=256 KiB, min_bytes=4096`` (small saved
                                tensors gathered into one copy)
==============================  ===================================================================

``none`` and ``checkpoint`` always run: they are the references for the step-time ratio, for the
gradients and for the hidden-copy estimate. A strategy whose options this ckpt_offload build does
not accept yet (``prefetch_bytes``, ``batch_below``) is reported as ``unavailable: <reason>``.

The code: overlap_strategies.py (the strategies), overlap_measure.py (steps,
bandwidth, gradients), overlap_report.py (headline, markdown, plot, JSON), llama_decoder.py (the
model); this file parses the arguments and runs the sequence lengths.

Per strategy: median step time (warmup excluded) and its ratio to ``checkpoint``; peak device
memory; device memory still held after forward (the activations); host bytes reserved vs
requested and the backend allocations after the first step; achieved D2H/H2D bandwidth vs a raw
pinned ``copy_`` of the typical activation size measured in the same run; the fraction of copy
time hidden behind compute; the gradients' difference from ``none`` and from the run with the
same checkpointing. See benchmarks/README.md for every column.

Contexts (``co.offload``, torchtune) wrap the model's forward (logits); the float32 loss is computed
outside, identically for every strategy.

Usage::

    python3 benchmarks/overlap.py                              # GPU: 1b preset, seq 512..4096
    python3 benchmarks/overlap.py --quick                      # a smoke run (~seconds on CPU)
    python3 benchmarks/overlap.py --out results/ --seq-lens 1024,4096 --batch 2 --model small
    python3 benchmarks/overlap.py --device cpu --strategies co_offload,co_checkpoint_side_prefetch

Without a GPU (or with ``--device cpu``) a small configuration runs on CPU tensors (our strategies
with ``devices=["cpu"], min_bytes=0``; ``save_on_cpu`` with ``pin_memory=False``). Those are CPU
numbers: only the ratios, the byte counts and the gradient checks mean something there.

Benchmarks measure, they don't assert: the exit status is 0 unless a strategy crashed or one of
ours gave gradients that differ from the run with the same checkpointing (when that run is itself
repeatable).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import socket
import sys
import time
import traceback

import torch

# The benchmark's modules sit next to this file. Running it as a script puts this folder on
# sys.path already; loading it from its path (the tests do) does not.
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from _package import co, positive_int_list  # noqa: E402  (the checkout's build when it has one, else the installed package)

from llama_decoder import DECODER_CONFIGS, LlamaDecoder, make_decoder_config, random_tokens  # noqa: E402
from overlap_measure import finish_rows, grads_check, raw_copy_bandwidth, run_strategy  # noqa: E402
from overlap_report import CPU_WARNING, fmt, headline, mib, public_row, write_outputs  # noqa: E402
from overlap_strategies import (  # noqa: E402, F401 - BASELINE, OUR_OPTIONS: the tests read them here
    BASELINE,
    DESCRIPTIONS,
    OUR_OPTIONS,
    OURS,
    REFERENCES,
    STRATEGIES,
    Unavailable,
    build_strategy,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

GPU_DEFAULTS = {
    "model": "1b",
    "seq_lens": [512, 1024, 2048, 4096],
    "batch": 1,
    "steps": 6,
    "warmup": 2,
    "dtype": "bfloat16",
}
GPU_QUICK = {"model": "small", "seq_lens": [512, 1024], "batch": 1, "steps": 3, "warmup": 1, "dtype": "bfloat16"}
CPU_DEFAULTS = {"model": "tiny", "seq_lens": [64, 128, 256], "batch": 2, "steps": 5, "warmup": 2, "dtype": "float32"}
CPU_QUICK = {"model": "tiny", "seq_lens": [64, 128], "batch": 2, "steps": 3, "warmup": 1, "dtype": "float32"}


def _strategy_list(text: str) -> list[str]:
    names = [v for v in text.replace(" ", "").split(",") if v]
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"--strategies: unknown strategy {unknown or text!r}; choose from {', '.join(STRATEGIES)}"
        )
    return names


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="a short smoke run (CPU: ~seconds)")
    p.add_argument(
        "--seq-lens",
        type=positive_int_list,
        default=None,
        help="comma-separated sequence lengths, e.g. 512,1024,2048,4096",
    )
    p.add_argument("--batch", type=int, default=None, help="batch size")
    p.add_argument("--steps", type=int, default=None, help="timed steps per strategy")
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed steps before timing (>= 1; the first measures memory, bytes and gradients)",
    )
    p.add_argument(
        "--model", choices=tuple(DECODER_CONFIGS), default=None, help="Llama preset (GPU default 1b, CPU default tiny)"
    )
    p.add_argument("--layers", type=int, default=None, help="override the preset's number of layers")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="GPU default bfloat16, CPU float32")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument(
        "--strategies",
        type=_strategy_list,
        default=list(STRATEGIES),
        help="comma-separated subset (none and checkpoint always run): " + ",".join(STRATEGIES),
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="skip a sequence length when it is predicted to end after this many seconds from the "
        "start (its rows say 'skipped')",
    )
    p.add_argument("--out", default=None, help="write overlap.json, overlap.md, overlap.png into this folder")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    args = p.parse_args(argv)

    gpu = co.build_info()["gpu_available"]  # CUDA tensors can be offloaded here (ckpt_offload's one test of it)
    if args.device == "auto":
        args.device = "cuda" if gpu else "cpu"
    elif args.device == "cuda" and not gpu:
        p.error(
            "--device cuda: no usable CUDA device here (torch.cuda.is_available() is False or ckpt_offload "
            "was built without CUDA); use --device cpu or auto"
        )
    on_gpu = args.device == "cuda"
    defaults = (GPU_QUICK if args.quick else GPU_DEFAULTS) if on_gpu else (CPU_QUICK if args.quick else CPU_DEFAULTS)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for name in ("batch", "steps", "warmup", "layers"):
        v = getattr(args, name)
        if v is not None and v < 1:
            p.error(f"--{name}: must be >= 1, got {v}")
    cfg = DECODER_CONFIGS[args.model]
    too_long = [s for s in args.seq_lens if s > cfg.max_seq]
    if too_long:
        p.error(f"--seq-lens: {too_long} longer than the {args.model} preset's max_seq={cfg.max_seq}")
    args.seq_lens = sorted(set(args.seq_lens))
    args.strategies = [s for s in STRATEGIES if s in REFERENCES or s in args.strategies]
    return args


def _progress(total: int, disable: bool):
    try:
        if disable:
            raise ImportError
        from tqdm import tqdm

        return tqdm(total=total, desc="overlap", unit="run", leave=False, dynamic_ncols=True)
    except ImportError:

        class _Null:
            @staticmethod
            def write(s):
                print(s)

            def update(self, n=1):
                pass

            def set_postfix_str(self, s):
                pass

            def close(self):
                pass

        return _Null()


def _print_row(row: dict, write) -> None:
    if row["status"] != "ok":
        write(f"  {row['strategy']:<28} {row['status']}")
        return
    host = row.get("host") or {}
    g = (row.get("grads") or {}).get("vs_none") or {}
    vr = (row.get("grads") or {}).get("vs_reference")
    write(
        f"  {row['strategy']:<28} {row['median_step_s'] * 1e3:9.2f} ms  x{fmt(row.get('ratio_to_checkpoint'))}"
        f"  peak {mib(row.get('peak_above_start_bytes'))} MiB  host req {mib(host.get('bytes_requested'))} MiB"
        f"  grads vs none {'=' if g.get('bit_identical') else fmt(g.get('max_abs_diff'), '.1e')}"
        + ("" if vr is None else f", vs {row['grads']['reference']} {'=' if vr['bit_identical'] else 'DIFF'}")
    )


def main(argv=None) -> int:
    """Runs the benchmark; returns the exit status. Example::

    main(["--quick", "--out", "/tmp/overlap"])       # CPU: a few seconds
    """
    args = parse_args(argv)
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    dtype = DTYPES[args.dtype]
    old_threads = torch.get_num_threads()
    if not on_gpu:
        # torch's intra-op pool makes tiny CPU kernels slow and noisy on a 2-core machine.
        torch.set_num_threads(1)
    t_start = time.perf_counter()
    status = 0
    try:
        overrides = {"layers": args.layers} if args.layers else {}
        cfg = make_decoder_config(args.model, **overrides)
        torch.manual_seed(args.seed)
        model = LlamaDecoder(cfg, seed=args.seed, device=device, dtype=dtype).train()
        report = {
            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),  # noqa: UP017 - Python 3.9
            "mode": "gpu" if on_gpu else "cpu",
            "warning": None if on_gpu else CPU_WARNING,
            "gpu_name": torch.cuda.get_device_name(device) if on_gpu else None,
            "torch_version": torch.__version__,
            "build_info": co.build_info(),
            "co_profile_available": hasattr(co, "profile"),
            "host": {
                "hostname": socket.gethostname(),
                "platform": platform.platform(),
                "python": platform.python_version(),
                "cpus": os.cpu_count(),
                "torch_threads": torch.get_num_threads(),
            },
            "args": {k: v for k, v in vars(args).items()},
            "model": {**cfg.as_dict(), "num_parameters": model.num_parameters()},
            "strategies": {s: DESCRIPTIONS[s] for s in args.strategies},
            "raw_bandwidth": {},
            "results": [],
        }
        print(
            f"overlap: {report['gpu_name'] or 'CPU'} · model {cfg.name} ({model.num_parameters() / 1e6:.1f} M "
            f"params) · {args.dtype} · batch {args.batch} · seq {args.seq_lens} · {args.steps} steps "
            f"(+{args.warmup} warmup)" + ("" if on_gpu else " · CPU numbers, not GPU numbers")
        )
        bar = _progress(len(args.seq_lens) * len(args.strategies), args.no_progress)
        last = None  # (seq, seconds) of the previous length, to predict the next one
        for seq in args.seq_lens:
            elapsed = time.perf_counter() - t_start
            # The next length takes about (seq / previous seq) times as long (linear layers dominate).
            predicted = 0.0 if last is None else last[1] * 1.25 * seq / last[0]
            if args.budget_s is not None and elapsed + predicted > args.budget_s:
                for name in args.strategies:
                    report["results"].append(
                        {
                            "seq_len": seq,
                            "batch": args.batch,
                            "strategy": name,
                            "status": f"skipped: --budget-s {args.budget_s:g} s would be "
                            f"exceeded (predicted {elapsed + predicted:.0f} s)",
                        }
                    )
                bar.update(len(args.strategies))
                bar.write(f"seq {seq}: {report['results'][-1]['status']}")
                continue
            t_seq = time.perf_counter()
            tokens = random_tokens(cfg.vocab, args.batch, seq, seed=args.seed, device=device)
            act_bytes = args.batch * seq * cfg.dim * torch.empty((), dtype=dtype).element_size()
            raw = raw_copy_bandwidth(act_bytes, device)
            report["raw_bandwidth"][str(seq)] = raw
            rows: dict = {}
            ref_grads: dict = {}
            for name in args.strategies:
                bar.set_postfix_str(f"seq {seq} {name}")
                try:
                    strategy = build_strategy(name, device, model)
                    try:
                        row = run_strategy(model, tokens, strategy, device, args)
                    finally:
                        strategy.cleanup()
                except Unavailable as e:
                    row = {"status": str(e)}
                except Exception as e:  # noqa: BLE001 - one strategy's crash must not lose the others
                    traceback.print_exc()
                    row = {"status": f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
                    status = 1
                    model.zero_grad(set_to_none=True)
                    if on_gpu:
                        torch.cuda.empty_cache()
                row.update(seq_len=seq, batch=args.batch, strategy=name, description=DESCRIPTIONS[name])
                if row["status"] == "ok":
                    if name in REFERENCES:
                        ref_grads[name] = row["_first_grads"]
                    row["grads"] = grads_check(name, row, ref_grads, rows)
                    row.pop("_first_grads")  # one model's worth of gradients: free it now
                rows[name] = row
                bar.update(1)
            finish_rows(rows, raw, device)
            for name in OURS:
                g = (rows.get(name) or {}).get("grads") or {}
                vr = g.get("vs_reference")
                if vr is not None and not vr["bit_identical"] and g.get("reference_repeatable"):
                    bar.write(
                        f"overlap: {name} at seq {seq}: gradients differ from {g['reference']} "
                        f"(max abs diff {vr['max_abs_diff']:.3e})"
                    )
                    status = 1
            report["results"].extend(public_row(r) for r in rows.values())
            del rows, ref_grads
            bar.write(
                f"seq {seq} (raw copy of {mib(act_bytes)} MiB: D2H {raw['d2h_gbps']:.2f} GB/s, "
                f"H2D {raw['h2d_gbps']:.2f} GB/s{'' if on_gpu else ', CPU memcpy'})"
            )
            for r in [r for r in report["results"] if r["seq_len"] == seq]:
                _print_row(r, bar.write)
            last = (seq, time.perf_counter() - t_seq)
            report["headline"] = headline(report["results"], cpu=not on_gpu)
            report["elapsed_s"] = time.perf_counter() - t_start
            if args.out:
                write_outputs(report, args.out)  # after every length: a timeout keeps what was measured
        bar.close()
        report["headline"] = headline(report["results"], cpu=not on_gpu)
        report["elapsed_s"] = time.perf_counter() - t_start
        for p in report["headline"]["per_seq"]:
            o, h = p["ours_overhead"], p["hf_overhead"]
            print(
                f"headline seq {p['seq_len']}: co_checkpoint_side_prefetch vs checkpoint "
                f"{'-' if o is None else f'{o * 100:+.1f}%'}, hf_offload "
                f"{'-' if h is None else f'{h * 100:+.1f}%'}" + ("" if on_gpu else " (CPU times)")
            )
        if args.out:
            write_outputs(report, args.out)
            written = ["overlap.json", "overlap.md"] + ([] if report.get("plot") else ["overlap.png"])
            print(
                f"wrote {', '.join(written)} to {args.out}"
                + (f" (overlap.png {report['plot']})" if report.get("plot") else "")
            )
        print(f"overlap: done in {report['elapsed_s']:.1f} s")
    finally:
        torch.set_num_threads(old_threads)
    return status


if __name__ == "__main__":
    sys.exit(main())
