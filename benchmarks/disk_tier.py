#!/usr/bin/env python3
"""Disk tier benchmark: the file tier's sustained bandwidth, and what spilling costs a step.

1. **Tier bandwidth.** A ``FileTier`` (the spill files behind ``co.HostPool(spill_dir=...)``) in
   ``--dir`` writes ``--total`` bytes as blocks of ``--block`` bytes from host memory, waits, then
   reads them all back and checks the last block: GB/s each way, for 1, 2 and 4 I/O threads.
   The files are preallocated first (not timed) and opened ``O_DIRECT`` where the file system
   takes it (the ``direct_io`` column), so the numbers are the disk's, not the page cache's
   (tmpfs is memory: there they are memcpy speed).
2. **Step time.** The built-in Llama decoder (``ckpt_offload.models``), one training step timed
   as the median of ``--steps`` after warmup, three ways: no offload, ``co.offload`` into an
   uncapped host pool (host-only), and ``co.offload`` into a pool capped at ``--spill-fraction``
   of what the host-only run kept in the pool, with ``spill_dir`` (the rest goes to disk and comes
   back with prefetch). Reported: the spill run's step time against host-only, bytes spilled per
   step, disk bandwidth during the steps, and the stalls (backward waiting for a read, forward
   waiting for staging memory). The gradients of the spill run are compared bit for bit with the
   host-only run.

Without a GPU (or with ``--device cpu``) the model runs on CPU tensors (``devices=["cpu"]``) at a
small size; those are CPU numbers, not GPU numbers, and every table says so.

Usage::

    python3 benchmarks/disk_tier.py                          # GPU: 2 GiB through the tier, "small" model
    python3 benchmarks/disk_tier.py --quick                  # seconds, CPU-sized
    python3 benchmarks/disk_tier.py --dir /local/nvme --out results/   # writes disk_tier.json / .md

Benchmarks measure, they don't assert: the exit status is 0 unless something crashed or a block
or gradient came back different.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # llama_decoder.py sits next to this file
    sys.path.insert(0, HERE)

from _package import co, save_report  # noqa: E402  (the checkout's build when it has one, else the installed package)
from ckpt_offload import _C  # noqa: E402
from llama_decoder import LlamaDecoder, causal_lm_loss, random_tokens  # noqa: E402
from llama_decoder import make_decoder_config as make_llama_config  # noqa: E402

MiB = 1 << 20


def parse_size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().rstrip("ib")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def tier_bandwidth(directory: str, total: int, block: int, threads: int, pinned: bool) -> dict:
    n = max(1, total // block)
    tier = _C.FileTier(dir=directory, file_bytes=n * block, io_threads=threads)
    tier.reserve(n * block)  # fallocate up front: not part of the timing
    src = torch.empty(n * block, dtype=torch.uint8, pin_memory=pinned)
    src.random_(0, 256)
    blocks = [src[i * block : (i + 1) * block] for i in range(n)]
    t0 = time.perf_counter()
    spills = [tier.write(b) for b in blocks]
    for s in spills:
        s.wait_written()
    t_write = time.perf_counter() - t0
    dst = torch.empty_like(src, pin_memory=pinned)
    t0 = time.perf_counter()
    tickets = [tier.read(s, dst[i * block : (i + 1) * block]) for i, s in enumerate(spills)]
    for t in tickets:
        t.wait()
    t_read = time.perf_counter() - t0
    ok = torch.equal(dst[-block:], src[-block:])
    st = tier.stats()
    del spills, tickets
    tier.synchronize()
    tier.empty_cache()
    return {
        "io_threads": threads,
        "bytes": n * block,
        "block_bytes": block,
        "write_gbps": n * block / t_write / 1e9,
        "read_gbps": n * block / t_read / 1e9,
        "direct_io": st["direct_io"],
        "verified": bool(ok),
    }


def step_times(model, tokens, ctx_factory, steps: int, warmup: int, device: str):
    times, grads = [], None
    for i in range(warmup + steps):
        model.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        ctx = ctx_factory()
        if ctx is None:
            loss = causal_lm_loss(model, tokens)
        else:
            with ctx:
                logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
            )
        loss.backward()
        del loss
        if device == "cuda":
            torch.cuda.synchronize()
        co.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return statistics.median(times), grads


def step_overhead(args, directory: str, device: str) -> dict:
    if device == "cuda":
        cfg = make_llama_config(args.model)
        seq, batch = args.seq, args.batch
    else:
        cfg = make_llama_config("tiny", dim=128, layers=4, ffn_dim=352)
        seq, batch = min(args.seq, 256), args.batch
    model = LlamaDecoder(cfg, seed=0, device=device)
    tokens = random_tokens(cfg.vocab, batch, seq, seed=0, device=device)
    opts = {} if device == "cuda" else {"devices": ["cpu"], "min_bytes": 0}
    pinned = device == "cuda"

    none_t, _ = step_times(model, tokens, lambda: None, args.steps, args.warmup, device)
    host_pool = co.HostPool(pinned=pinned)
    host_t, host_grads = step_times(
        model, tokens, lambda: co.offload(pool=host_pool, **opts), args.steps, args.warmup, device
    )
    peak = host_pool.stats()["peak_bytes_in_use"]
    cap = max(MiB, int(peak * args.spill_fraction))
    spill_pool = co.HostPool(pinned=pinned, max_bytes=cap, spill_dir=directory)
    ctxs = []

    def spill_ctx():
        ctxs.append(co.offload(pool=spill_pool, **opts))
        return ctxs[-1]

    spill_t, spill_grads = step_times(model, tokens, spill_ctx, args.steps, args.warmup, device)
    d = spill_pool.stats()["disk"]
    runs = args.steps + args.warmup
    same = host_grads.keys() == spill_grads.keys() and all(
        torch.equal(host_grads[k], spill_grads[k]) for k in host_grads
    )
    out = {
        "model": cfg.name,
        "layers": cfg.layers,
        "dim": cfg.dim,
        "seq": seq,
        "batch": batch,
        "device": device,
        "step_s_no_offload": none_t,
        "step_s_host_only": host_t,
        "step_s_spill": spill_t,
        "spill_vs_host": spill_t / host_t - 1.0,
        "host_pool_peak_bytes": peak,
        "spill_pool_max_bytes": cap,
        "bytes_spilled_per_step": d["bytes_spilled"] / runs,
        "bytes_offloaded_per_step": ctxs[-1].stats()["bytes_offloaded"],
        "disk_write_gbps": (d["write_bandwidth"] or 0) / 1e9,
        "disk_read_gbps": (d["read_bandwidth"] or 0) / 1e9,
        "read_stall_s_per_step": d["read_stall_seconds"] / runs,
        "write_stall_s_per_step": d["write_stall_seconds"] / runs,
        "reads_prefetch": d["reads_prefetch"],
        "blocks_read": d["blocks_read"],
        "direct_io": d["direct_io"],
        "gradients_equal_host_only": bool(same),
    }
    spill_pool = host_pool = None  # the pools go now, before the report
    return out


def markdown(r: dict) -> str:
    lines = ["# Disk tier benchmark", ""]
    if r["mode"] == "cpu":
        lines += ["**CPU numbers, not GPU numbers** (the model runs on CPU tensors).", ""]
    lines += [
        f"Spill directory `{r['dir']}` ({r['fs_type']}); {r.get('gpu_name') or 'no GPU'}.",
        "",
        "## File tier bandwidth",
        "",
        "| I/O threads | bytes | block | write GB/s | read GB/s | O_DIRECT | verified |",
        "|---:|---:|---:|---:|---:|---|---|",
    ]
    for b in r["bandwidth"]:
        lines.append(
            f"| {b['io_threads']} | {b['bytes'] // MiB} MiB | {b['block_bytes'] // MiB} MiB | "
            f"{b['write_gbps']:.2f} | {b['read_gbps']:.2f} | {b['direct_io']} | {b['verified']} |"
        )
    s = r["step"]
    lines += [
        "",
        f"## Step time: {s['model']} ({s['layers']} layers, dim {s['dim']}), seq {s['seq']}, "
        f"batch {s['batch']}, {s['device']}",
        "",
        "| run | step ms | vs host-only |",
        "|---|---:|---:|",
        f"| no offload | {s['step_s_no_offload'] * 1e3:.1f} | |",
        f"| host-only offload | {s['step_s_host_only'] * 1e3:.1f} | |",
        f"| spill (pool capped at {s['spill_pool_max_bytes'] // MiB} MiB) | {s['step_s_spill'] * 1e3:.1f} | "
        f"{s['spill_vs_host'] * 100:+.1f}% |",
        "",
        f"Spilled {s['bytes_spilled_per_step'] / MiB:.1f} MiB of {s['bytes_offloaded_per_step'] / MiB:.1f} MiB "
        f"offloaded per step; disk {s['disk_write_gbps']:.2f} GB/s write, {s['disk_read_gbps']:.2f} GB/s read; "
        f"stalls per step: read {s['read_stall_s_per_step'] * 1e3:.2f} ms, write "
        f"{s['write_stall_s_per_step'] * 1e3:.2f} ms; {s['reads_prefetch']} of {s['blocks_read']} reads started "
        f"by prefetch; gradients equal to host-only: {s['gradients_equal_host_only']}.",
    ]
    return "\n".join(lines) + "\n"


def fs_type(path: str) -> str:
    best, kind = "", "?"
    try:
        for line in open("/proc/mounts"):
            parts = line.split()
            if len(parts) > 2 and os.path.realpath(path).startswith(parts[1]) and len(parts[1]) > len(best):
                best, kind = parts[1], parts[2]
    except OSError:
        pass
    return kind


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", default=None, help="a directory on the disk to test (default: a temporary one in /tmp)")
    p.add_argument("--out", default=None, help="folder for disk_tier.json and disk_tier.md")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None)
    p.add_argument(
        "--total", type=parse_size, default=None, help="bytes through the tier per run (default 2G, 256M on CPU)"
    )
    p.add_argument("--block", type=parse_size, default=None, help="block size (default 64M, 16M on CPU)")
    p.add_argument("--model", default="small", help="Llama preset on a GPU (tiny, small, 1b)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--spill-fraction",
        type=float,
        default=0.25,
        help="the spill pool's cap as a fraction of the host-only pool's peak (default 0.25)",
    )
    p.add_argument("--quick", action="store_true", help="small sizes, few steps (seconds)")
    args = p.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() and _C.cuda_compiled() else "cpu")
    cpu = device == "cpu"
    if args.quick:
        args.steps, args.warmup = min(args.steps, 3), 1
    total = args.total or (64 * MiB if args.quick else (256 * MiB if cpu else 2 << 30))
    block = args.block or (8 * MiB if args.quick else (16 * MiB if cpu else 64 * MiB))
    parent = args.dir or tempfile.gettempdir()
    directory = tempfile.mkdtemp(prefix="ckpt_offload_disk_tier_", dir=parent)
    try:
        report = {
            "mode": device if device == "cpu" else "gpu",
            "dir": parent,
            "fs_type": fs_type(parent),
            "gpu_name": torch.cuda.get_device_name(0) if device == "cuda" else None,
            "args": vars(args),
            "bandwidth": [tier_bandwidth(directory, total, block, t, pinned=not cpu) for t in (1, 2, 4)],
            "step": step_overhead(args, directory, device),
        }
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    md = markdown(report)
    print(md)
    if args.out:
        save_report(args.out, "disk_tier", report, md)
    bad = [b for b in report["bandwidth"] if not b["verified"]]
    if bad:
        print("ERROR: a block read back from the tier differs from what was written", file=sys.stderr)
        return 1
    if not report["step"]["gradients_equal_host_only"] and cpu:
        # On CPU both runs use the same deterministic kernels: a difference is a bug.
        print("ERROR: gradients with spilling differ from host-only offload", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
